// Writing files so that a full disk or an I/O error is an error naming the file, never a silently short file:
// whole-file writes through a temporary name and a rename, and fsync of files and folders.
#pragma once
#include <filesystem>
#include <string>
#include <string_view>

namespace titan {

// Writes `content` to `path` (via "<path>.tmp.<pid>", renamed into place; the temporary is removed on failure).
// `durable` also fsyncs the file before the rename. Throws UserError naming the path and the cause.
void write_file(const std::string& path, std::string_view content, bool durable = false);

// fsync of a file or a folder (for renames inside it). Throws UserError on failure; a file system that cannot
// sync folders (EINVAL) is not an error.
void fsync_path(const std::string& path, bool directory);
// Copies `from` over `to` as a new file of this user's: readable by all, writable by its owner (0644), whatever the
// source's mode (a read-only shared tokenizer must not make the export's copy read-only).
void copy_file_as_own(const std::string& from, const std::string& to);

// " (the disk is full)" for ENOSPC / EDQUOT, else ": <strerror>".
std::string describe_write_error(int error);

// titan's per-user cache folder: $XDG_CACHE_HOME/titan, else $HOME/.cache/titan; empty when neither is set.
std::filesystem::path user_cache_dir();

// What identifies this build of titan: its executable's path, size and modification time (a rebuild changes them).
std::string binary_identity();

}  // namespace titan
