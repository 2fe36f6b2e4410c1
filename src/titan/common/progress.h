// Progress of long non-training commands (titan convert, titan tokenizer train) on standard error: a line that
// rewrites itself on a terminal, or a plain line every 10% (at most one per 2 s) when stderr is a file, with the
// rate and the estimated time left. Silent for work that ends within a second.
#pragma once
#include <cstdint>
#include <string>

namespace titan {

class Progress {
 public:
  // `total` units of `unit` ("bytes" are shown as MB/GB).
  Progress(std::string what, int64_t total, std::string unit);
  ~Progress();  // ends the line when one was drawn
  void advance(int64_t done_units);  // adds to the count done
  void set(int64_t done_total);

 private:
  void draw(bool final);
  std::string what_, unit_;
  int64_t total_ = 0, done_ = 0;
  double start_ = 0, last_draw_ = 0;
  int64_t last_decile_ = -1;
  bool tty_ = false, drawn_ = false;
};

}  // namespace titan
