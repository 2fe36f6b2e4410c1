#include "titan/common/logging.h"

#include <algorithm>
#include <sys/time.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <ctime>
#include <mutex>

namespace titan::log {
namespace {
std::atomic<bool> g_enabled{true};
std::atomic<bool> g_color{false};
std::mutex g_mutex;
}  // namespace

void set_enabled(bool on) { g_enabled = on; }
bool enabled() { return g_enabled; }
void set_color(bool on) { g_color = on; }
bool color() { return g_color; }

void write(Level level, const std::string& message) {
  if (!g_enabled && level != Level::Error) return;
  timeval now{};
  gettimeofday(&now, nullptr);
  tm local{};
  localtime_r(&now.tv_sec, &local);
  char stamp[32];
  std::strftime(stamp, sizeof stamp, "%Y-%m-%d %H:%M:%S", &local);
  const char* name = level == Level::Debug ? "DEBUG" : level == Level::Info ? "INFO" : level == Level::Warning ? "WARNING" : "ERROR";
  std::lock_guard<std::mutex> lock(g_mutex);
  std::fprintf(stdout, "[titan] %s,%03d - %s - %s\n", stamp, static_cast<int>(now.tv_usec / 1000), name, message.c_str());
  std::fflush(stdout);
}

const Colors& colors() {
  static const Colors on{"\033[31m", "\033[32m", "\033[38;2;180;60;0m", "\033[38;2;54;234;195m", "\033[34m",
                         "\033[36m", "\033[35m", "\033[33m", "\033[39m"};
  static const Colors off{"", "", "", "", "", "", "", "", ""};
  return g_color ? on : off;
}

}  // namespace titan::log
