// Log lines in torchtitan's layout ("[titan] <time> - INFO - ..."), with per-rank muting and optional color.
#pragma once
#include <string>

#include "titan/common/error.h"

namespace titan::log {

enum class Level { Debug, Info, Warning, Error };

// Only ranks listed by the launcher print (rank 0 by default); set once at start-up.
void set_enabled(bool enabled);
bool enabled();
void set_color(bool color);
bool color();

void write(Level level, const std::string& message);

template <typename... Args>
void info(const Args&... args) { write(Level::Info, cat(args...)); }
template <typename... Args>
void warn(const Args&... args) { write(Level::Warning, cat(args...)); }
template <typename... Args>
void error(const Args&... args) { write(Level::Error, cat(args...)); }

// ANSI colors used by the step line; empty strings when color is off.
struct Colors {
  const char *red, *green, *orange, *turquoise, *blue, *cyan, *magenta, *yellow, *reset;
};
const Colors& colors();

}  // namespace titan::log
