#include "titan/common/progress.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>

#include "titan/common/clock.h"
#include "titan/common/error.h"
#include "titan/common/strings.h"

namespace titan {

namespace {

std::string amount(double value, const std::string& unit, bool with_unit = true) {
  if (unit != "bytes") return with_unit ? cat(static_cast<int64_t>(value), " ", unit) : cat(static_cast<int64_t>(value));
  if (value >= 1e9) return strprintf("%.2f GB", value / 1e9);
  return strprintf("%.1f MB", value / 1e6);
}

std::string duration(double seconds) {
  if (seconds < 90) return strprintf("%.0f s", seconds);
  if (seconds < 5400) return strprintf("%.0f min", seconds / 60);
  return strprintf("%.1f h", seconds / 3600);
}

}  // namespace

Progress::Progress(std::string what, int64_t total, std::string unit)
    : what_(std::move(what)), unit_(std::move(unit)), total_(std::max<int64_t>(total, 1)), start_(now_seconds()),
      last_draw_(start_), tty_(isatty(STDERR_FILENO) != 0) {}

Progress::~Progress() {
  if (drawn_) draw(true);
}

void Progress::advance(int64_t done_units) { set(done_ + done_units); }

void Progress::set(int64_t done_total) {
  done_ = std::min(done_total, total_);
  const double now = now_seconds();
  if (now - start_ < 1.0 || done_ == total_) return;  // quick work stays quiet; the end is drawn by the destructor
  const int64_t decile = done_ * 10 / total_;
  if (tty_ ? now - last_draw_ >= 0.2 : (decile != last_decile_ && now - last_draw_ >= 2.0)) {
    last_decile_ = decile;
    last_draw_ = now;
    draw(false);
  }
}

void Progress::draw(bool final) {
  const double elapsed = std::max(now_seconds() - start_, 1e-9);
  const double rate = static_cast<double>(done_) / elapsed;
  const double left = rate > 0 ? static_cast<double>(total_ - done_) / rate : 0;
  std::string line = strprintf("%s: %3.0f%% (%s of %s, %s/s", what_.c_str(), 100.0 * static_cast<double>(done_) / static_cast<double>(total_),
                               amount(static_cast<double>(done_), unit_, false).c_str(),
                               amount(static_cast<double>(total_), unit_).c_str(), amount(rate, unit_).c_str());
  line += final ? cat(", ", duration(elapsed), ")") : cat(", about ", duration(left), " left)");
  if (tty_) std::fprintf(stderr, "\r%s\033[K%s", line.c_str(), final ? "\n" : "");
  else std::fprintf(stderr, "%s\n", line.c_str());
  std::fflush(stderr);
  drawn_ = true;
}

}  // namespace titan
