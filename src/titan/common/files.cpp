#include "titan/common/files.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <filesystem>

#include "titan/common/error.h"
#include "titan/common/strings.h"

namespace titan {

std::string describe_write_error(int error) {
  if (error == ENOSPC || error == EDQUOT) return ": the disk is full (or over quota)";
  return cat(": ", std::strerror(error));
}

void write_file(const std::string& path, std::string_view content, bool durable) {
  const std::string tmp = cat(path, ".tmp.", ::getpid());
  FILE* f = std::fopen(tmp.c_str(), "wb");
  if (!f) fail("cannot write ", quote(path), describe_write_error(errno));
  int error = 0;
  if (!content.empty() && std::fwrite(content.data(), 1, content.size(), f) != content.size()) error = errno;
  if (!error && std::fflush(f) != 0) error = errno;
  if (!error && durable && ::fsync(fileno(f)) != 0) error = errno;
  if (std::fclose(f) != 0 && !error) error = errno;
  if (!error && std::rename(tmp.c_str(), path.c_str()) != 0) error = errno;
  if (error) {
    std::remove(tmp.c_str());
    fail("cannot write ", quote(path), describe_write_error(error));
  }
}

void fsync_path(const std::string& given, bool directory) {
  // The parent of a bare name ("out") is the current directory.
  const std::string path = given.empty() && directory ? "." : given;
  const int fd = ::open(path.c_str(), directory ? O_RDONLY | O_DIRECTORY : O_RDONLY);
  if (fd < 0) fail("cannot open ", quote(path), " to flush it to disk: ", std::strerror(errno));
  const int rc = ::fsync(fd);
  const int error = errno;
  ::close(fd);
  if (rc != 0 && !(directory && error == EINVAL))
    fail("cannot flush ", quote(path), " to disk", describe_write_error(error));
}

std::filesystem::path user_cache_dir() {
  if (const char* xdg = std::getenv("XDG_CACHE_HOME"); xdg && *xdg) return std::filesystem::path(xdg) / "titan";
  if (const char* home = std::getenv("HOME"); home && *home) return std::filesystem::path(home) / ".cache" / "titan";
  return {};
}

std::string binary_identity() {
  std::error_code error;
  const auto exe = std::filesystem::read_symlink("/proc/self/exe", error);
  if (error) return "unknown binary";
  const auto size = std::filesystem::file_size(exe, error);
  if (error) return exe.string();
  const auto mtime = std::filesystem::last_write_time(exe, error).time_since_epoch().count();
  return cat(exe.string(), " (", size, " bytes, modified ", mtime, ")");
}

void copy_file_as_own(const std::string& from, const std::string& to) {
  namespace fs = std::filesystem;
  fs::copy_file(from, to, fs::copy_options::overwrite_existing);
  std::error_code ignored;  // a file system without modes (some network mounts) keeps its own
  fs::permissions(to, fs::perms::owner_read | fs::perms::owner_write | fs::perms::group_read | fs::perms::others_read,
                  fs::perm_options::replace, ignored);
}

}  // namespace titan
