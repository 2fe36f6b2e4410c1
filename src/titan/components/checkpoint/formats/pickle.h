// A general pickle reader (protocols 2 to 5) that builds a tree of values without running anything: classes and
// functions stay names (Global), constructions stay records (Object: the callable, its arguments and the state
// BUILD gave it), persistent ids stay records. Callers interpret the tree; torch DCP's .metadata and the small
// Python objects inside its data files are read this way.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace titan::pickle {

struct Value;
using Ptr = std::shared_ptr<const Value>;

struct Value {
  enum class Kind { none, boolean, integer, real, string, bytes, list, tuple, set, dict, global, object, persistent };
  Kind kind = Kind::none;
  bool boolean = false;
  int64_t integer = 0;
  double real = 0;
  std::string text;                           // string and bytes; global: "module.name"
  std::string module, name;                   // global, and the callable of an object
  std::vector<Ptr> items;                     // list, tuple, set; object: the constructor's arguments; persistent: the id
  std::vector<std::pair<Ptr, Ptr>> entries;   // dict (and OrderedDict), in insertion order
  Ptr state;                                  // object: what BUILD set (a dict or a tuple), or null

  Value() = default;
  Value(const Value&) = delete;
  Value& operator=(const Value&) = delete;
  ~Value();  // frees nested values iteratively: a deeply nested pickle must not overflow the stack

  bool is(Kind k) const { return kind == k; }
  bool is_object(std::string_view module_name, std::string_view class_name) const {
    return kind == Kind::object && module == module_name && name == class_name;
  }
  // Dict lookup by string key (null when absent or not a dict).
  Ptr get(std::string_view key) const;
  std::string describe() const;  // short, for error messages
};

// Reads one pickle. `where` names the source in errors ("<file>: malformed pickle (...)"). Every value needs at
// least one opcode byte, so memory stays proportional to the input; more than `max_values` values are refused. A
// container is never put into itself; nesting of any depth is freed without recursion.
Ptr load(std::string_view data, const std::string& where, size_t max_values = 20'000'000);

}  // namespace titan::pickle
