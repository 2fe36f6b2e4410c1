// Writing pickles (protocol 2) opcode by opcode: enough for torch.save's tensor records and torch DCP's metadata
// and small Python values, which Python's pickle.load reads.
#pragma once
#include <cstdint>
#include <cstring>
#include <string>

namespace titan::pickle {

class Writer {
 public:
  std::string out = std::string("\x80\x02", 2);  // PROTO 2

  void op(char c) { out.push_back(c); }
  void mark() { op('('); }
  void global(const std::string& module, const std::string& name) { out += "c" + module + "\n" + name + "\n"; }
  void none() { op('N'); }
  void boolean(bool v) { op(v ? '\x88' : '\x89'); }
  void unicode(const std::string& s) {
    op('X');
    u32(static_cast<uint32_t>(s.size()));
    out += s;
  }
  void integer(int64_t v) {
    if (v >= INT32_MIN && v <= INT32_MAX) {
      op('J');
      u32(static_cast<uint32_t>(static_cast<int32_t>(v)));
      return;
    }
    op('\x8a');  // LONG1: little-endian two's complement
    out.push_back(8);
    for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>(static_cast<uint64_t>(v) >> (8 * i)));
  }
  void real(double v) {  // BINFLOAT: big-endian IEEE 754
    uint64_t bits;
    std::memcpy(&bits, &v, 8);
    op('G');
    for (int i = 7; i >= 0; --i) out.push_back(static_cast<char>(bits >> (8 * i)));
  }
  void tuple_of_ints(const auto& values) {
    mark();
    for (int64_t v : values) integer(v);
    op('t');
  }
  // cls.__new__(cls) with no arguments (NEWOBJ), as pickle writes dataclasses; BUILD with a state follows.
  void new_object(const std::string& module, const std::string& name) {
    global(module, name);
    op(')');
    op('\x81');
  }
  void build() { op('b'); }
  void stop() { op('.'); }

 private:
  void u32(uint32_t v) {
    for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>(v >> (8 * i)));
  }
};

}  // namespace titan::pickle
