#include "titan/components/checkpoint/formats/pickle.h"

#include <cstring>
#include <map>
#include <unordered_map>

#include "titan/common/error.h"
#include "titan/common/strings.h"

namespace titan::pickle {

using Kind = Value::Kind;

Value::~Value() {
  // Take the children over and free the values no one else holds one level at a time, in a loop.
  std::vector<Ptr> pending;
  auto adopt = [&pending](Value& v) {
    for (auto& item : v.items) pending.push_back(std::move(item));
    for (auto& [k, x] : v.entries) {
      pending.push_back(std::move(k));
      pending.push_back(std::move(x));
    }
    if (v.state) pending.push_back(std::move(v.state));
    v.items.clear();
    v.entries.clear();
  };
  adopt(*this);
  while (!pending.empty()) {
    Ptr p = std::move(pending.back());
    pending.pop_back();
    if (p && p.use_count() == 1) adopt(const_cast<Value&>(*p));  // the last owner: empty it before it goes
  }
}

Ptr Value::get(std::string_view key) const {
  if (kind != Kind::dict) return nullptr;
  for (const auto& [k, v] : entries)
    if (k && k->kind == Kind::string && k->text == key) return v;
  return nullptr;
}

std::string Value::describe() const {
  switch (kind) {
    case Kind::none: return "None";
    case Kind::boolean: return boolean ? "True" : "False";
    case Kind::integer: return std::to_string(integer);
    case Kind::real: return cat(real);
    case Kind::string: return quote(text.size() > 40 ? text.substr(0, 40) + "..." : text);
    case Kind::bytes: return cat("bytes of length ", text.size());
    case Kind::list: return cat("a list of ", items.size());
    case Kind::tuple: return cat("a tuple of ", items.size());
    case Kind::set: return cat("a set of ", items.size());
    case Kind::dict: return cat("a dict of ", entries.size());
    case Kind::global: return module + "." + name;
    case Kind::object: return cat("a ", module, ".", name, " object");
    case Kind::persistent: return "a persistent id";
  }
  return "?";
}

namespace {

using Mutable = std::shared_ptr<Value>;

class Reader {
 public:
  Reader(std::string_view data, const std::string& where, size_t max_values)
      : data_(data), where_(where), max_values_(max_values) {}

  // On any failure, and when the result would contain itself, every value made is emptied: values that refer to
  // each other (through the memo) must not keep each other alive.
  Ptr run() {
    try {
      while (true) {
        const unsigned char op = byte();
        if (op == '.') {
          if (stack_.size() != 1 || !marks_.empty()) malformed("STOP with a stack other than one value");
          Ptr result = stack_.back();
          if (contains_cycle(result)) malformed("a value that contains itself");
          return result;
        }
        step(op);
      }
    } catch (...) {
      for (auto& v : made_values_) {
        v->items.clear();
        v->entries.clear();
        v->state.reset();
      }
      throw;
    }
  }

 private:
  std::string_view data_;
  const std::string& where_;
  size_t max_values_, made_ = 0, p_ = 0;
  std::vector<Mutable> stack_;
  std::vector<size_t> marks_;
  std::map<uint64_t, Mutable> memo_;
  std::vector<Mutable> made_values_;  // every value, to break reference cycles on failure

  // Whether some value reaches itself (iterative depth-first search; 1 = on the current path, 2 = done).
  static bool contains_cycle(const Ptr& root) {
    std::unordered_map<const Value*, int> mark;
    std::vector<std::pair<const Value*, size_t>> path;  // value, index of the next child to visit
    auto children = [](const Value* v, size_t i) -> const Value* {
      if (i < v->items.size()) return v->items[i].get();
      i -= v->items.size();
      if (i < 2 * v->entries.size()) return (i % 2 ? v->entries[i / 2].second : v->entries[i / 2].first).get();
      i -= 2 * v->entries.size();
      if (i == 0 && v->state) return v->state.get();
      return nullptr;
    };
    auto count = [](const Value* v) { return v->items.size() + 2 * v->entries.size() + (v->state ? 1 : 0); };
    mark[root.get()] = 1;
    path.emplace_back(root.get(), 0);
    while (!path.empty()) {
      auto& [v, next] = path.back();
      if (next == count(v)) {
        mark[v] = 2;
        path.pop_back();
        continue;
      }
      const Value* child = children(v, next++);
      if (!child) continue;
      int& m = mark[child];
      if (m == 1) return true;
      if (m == 0) {
        m = 1;
        path.emplace_back(child, 0);
      }
    }
    return false;
  }

  [[noreturn]] void malformed(const std::string& what) const { fail(where_, ": malformed pickle (", what, " at byte ", p_, ")"); }

  Mutable make(Kind kind) {
    if (++made_ > max_values_) fail(where_, ": the pickle holds more than ", max_values_, " values; refused");
    auto v = std::make_shared<Value>();
    v->kind = kind;
    made_values_.push_back(v);
    return v;
  }
  void need(size_t n) const {
    if (n > data_.size() - p_) fail(where_, ": truncated pickle (", n, " more bytes needed at byte ", p_, ")");
  }
  unsigned char byte() {
    need(1);
    return static_cast<unsigned char>(data_[p_++]);
  }
  uint64_t le(int n) {
    need(static_cast<size_t>(n));
    uint64_t v = 0;
    for (int i = 0; i < n; ++i) v |= static_cast<uint64_t>(static_cast<unsigned char>(data_[p_ + i])) << (8 * i);
    p_ += static_cast<size_t>(n);
    return v;
  }
  std::string take(uint64_t n) {
    if (n > data_.size() - p_) fail(where_, ": truncated pickle (a ", n, "-byte string at byte ", p_, ")");
    std::string s(data_.substr(p_, n));
    p_ += n;
    return s;
  }
  std::string line() {
    const size_t end = data_.find('\n', p_);
    if (end == std::string_view::npos) fail(where_, ": truncated pickle (no end of line after byte ", p_, ")");
    std::string s(data_.substr(p_, end - p_));
    p_ = end + 1;
    return s;
  }
  Mutable pop() {
    if (stack_.empty() || (!marks_.empty() && stack_.size() <= marks_.back())) malformed("stack underflow");
    Mutable v = stack_.back();
    stack_.pop_back();
    return v;
  }
  Mutable& top() {
    if (stack_.empty() || (!marks_.empty() && stack_.size() <= marks_.back())) malformed("stack underflow");
    return stack_.back();
  }
  std::vector<Mutable> pop_mark() {
    if (marks_.empty()) malformed("no MARK");
    const size_t m = marks_.back();
    marks_.pop_back();
    std::vector<Mutable> items(stack_.begin() + static_cast<std::ptrdiff_t>(m), stack_.end());
    stack_.resize(m);
    return items;
  }
  void push(Mutable v) { stack_.push_back(std::move(v)); }
  void push_integer(int64_t i) {
    auto v = make(Kind::integer);
    v->integer = i;
    push(v);
  }
  void push_text(Kind kind, std::string s) {
    auto v = make(kind);
    v->text = std::move(s);
    push(v);
  }
  Mutable sequence(Kind kind, std::vector<Mutable> items) {
    auto v = make(kind);
    v->items.assign(items.begin(), items.end());
    return v;
  }
  void push_long(uint64_t n) {
    if (n > 8) malformed("an integer wider than 64 bits");
    need(n);
    uint64_t v = 0;
    for (size_t i = 0; i < n; ++i) v |= static_cast<uint64_t>(static_cast<unsigned char>(data_[p_ + i])) << (8 * i);
    if (n > 0 && n < 8 && (static_cast<unsigned char>(data_[p_ + n - 1]) & 0x80)) v |= ~uint64_t{0} << (8 * n);
    p_ += n;
    push_integer(static_cast<int64_t>(v));
  }
  Mutable global(std::string module, std::string name) {
    auto v = make(Kind::global);
    v->module = std::move(module);
    v->name = std::move(name);
    v->text = v->module + "." + v->name;
    return v;
  }
  // callable(*args): an OrderedDict becomes a dict; anything else a record of the call.
  Mutable construct(const Mutable& callable, const Mutable& args) {
    if (callable->kind != Kind::global) malformed("a call of " + callable->describe() + ", not of a named class or function");
    if (args->kind != Kind::tuple) malformed("call arguments that are not a tuple");
    if (callable->module == "collections" && callable->name == "OrderedDict" && args->items.empty()) return make(Kind::dict);
    auto v = make(Kind::object);
    v->module = callable->module;
    v->name = callable->name;
    v->items = args->items;
    return v;
  }
  Mutable memo_get(uint64_t key) {
    auto it = memo_.find(key);
    if (it == memo_.end()) malformed("memo key never stored");
    return it->second;
  }
  static int64_t parse_int(const std::string& text, const Reader& r) {
    try {
      size_t used = 0;
      std::string t = text;
      if (!t.empty() && t.back() == 'L') t.pop_back();
      const long long v = std::stoll(t, &used);
      if (used != t.size()) r.malformed("a bad integer literal");
      return v;
    } catch (const std::exception&) {
      r.malformed("a bad integer literal");
    }
  }

  void step(unsigned char op) {
    switch (op) {
      case 0x80: byte(); break;   // PROTO
      case 0x95: le(8); break;    // FRAME: a length hint
      case '(': marks_.push_back(stack_.size()); break;
      case '0': pop(); break;
      case '1': pop_mark(); break;
      case '2': push(top()); break;
      case 'N': push(make(Kind::none)); break;
      case 0x88:
      case 0x89: {
        auto v = make(Kind::boolean);
        v->boolean = op == 0x88;
        push(v);
        break;
      }
      case 'J': push_integer(static_cast<int32_t>(le(4))); break;
      case 'K': push_integer(static_cast<int64_t>(le(1))); break;
      case 'M': push_integer(static_cast<int64_t>(le(2))); break;
      case 0x8a: push_long(le(1)); break;
      case 0x8b: push_long(le(4)); break;
      case 'I': {
        const std::string t = line();
        if (t == "00" || t == "01") {
          auto v = make(Kind::boolean);
          v->boolean = t == "01";
          push(v);
        } else {
          push_integer(parse_int(t, *this));
        }
        break;
      }
      case 'L': push_integer(parse_int(line(), *this)); break;
      case 'G': {
        need(8);
        uint64_t bits = 0;
        for (int i = 0; i < 8; ++i) bits = (bits << 8) | static_cast<unsigned char>(data_[p_ + i]);
        p_ += 8;
        auto v = make(Kind::real);
        std::memcpy(&v->real, &bits, 8);
        push(v);
        break;
      }
      case 'F': {
        auto v = make(Kind::real);
        try {
          v->real = std::stod(line());
        } catch (const std::exception&) {
          malformed("a bad float literal");
        }
        push(v);
        break;
      }
      case 'X': push_text(Kind::string, take(le(4))); break;
      case 0x8c: push_text(Kind::string, take(le(1))); break;
      case 0x8d: push_text(Kind::string, take(le(8))); break;
      case 'T': push_text(Kind::string, take(le(4))); break;   // BINSTRING (Python 2 str)
      case 'U': push_text(Kind::string, take(le(1))); break;   // SHORT_BINSTRING
      case 'B': push_text(Kind::bytes, take(le(4))); break;
      case 'C': push_text(Kind::bytes, take(le(1))); break;
      case 0x8e:
      case 0x96: push_text(Kind::bytes, take(le(8))); break;  // BINBYTES8, BYTEARRAY8
      case ']': push(make(Kind::list)); break;
      case ')': push(make(Kind::tuple)); break;
      case '}': push(make(Kind::dict)); break;
      case 0x8f: push(make(Kind::set)); break;
      case 'l': push(sequence(Kind::list, pop_mark())); break;
      case 't': push(sequence(Kind::tuple, pop_mark())); break;
      case 0x91: push(sequence(Kind::set, pop_mark())); break;
      case 0x85: {
        auto a = pop();
        push(sequence(Kind::tuple, {a}));
        break;
      }
      case 0x86: {
        auto b = pop(), a = pop();
        push(sequence(Kind::tuple, {a, b}));
        break;
      }
      case 0x87: {
        auto c = pop(), b = pop(), a = pop();
        push(sequence(Kind::tuple, {a, b, c}));
        break;
      }
      case 'd': {
        auto items = pop_mark();
        if (items.size() % 2) malformed("DICT with an odd number of values");
        auto v = make(Kind::dict);
        for (size_t i = 0; i < items.size(); i += 2) v->entries.emplace_back(items[i], items[i + 1]);
        push(v);
        break;
      }
      case 'a': {
        auto v = pop();
        auto& list = top();
        if (list->kind != Kind::list) malformed("APPEND to " + list->describe());
        if (v == list) malformed("a list appended to itself");
        list->items.push_back(v);
        break;
      }
      case 'e': {
        auto items = pop_mark();
        auto& list = top();
        if (list->kind != Kind::list) malformed("APPENDS to " + list->describe());
        for (const auto& item : items)
          if (item == list) malformed("a list appended to itself");
        list->items.insert(list->items.end(), items.begin(), items.end());
        break;
      }
      case 0x90: {
        auto items = pop_mark();
        auto& set = top();
        if (set->kind != Kind::set) malformed("ADDITEMS to " + set->describe());
        set->items.insert(set->items.end(), items.begin(), items.end());
        break;
      }
      case 's': {
        auto value = pop(), key = pop();
        auto& dict = top();
        if (dict->kind != Kind::dict) malformed("SETITEM on " + dict->describe());
        if (value == dict || key == dict) malformed("a dict put into itself");
        dict->entries.emplace_back(key, value);
        break;
      }
      case 'u': {
        auto items = pop_mark();
        if (items.size() % 2) malformed("SETITEMS with an odd number of values");
        auto& dict = top();
        if (dict->kind != Kind::dict) malformed("SETITEMS on " + dict->describe());
        for (const auto& item : items)
          if (item == dict) malformed("a dict put into itself");
        for (size_t i = 0; i < items.size(); i += 2) dict->entries.emplace_back(items[i], items[i + 1]);
        break;
      }
      case 'c': {
        std::string module = line();
        std::string name = line();
        push(global(std::move(module), std::move(name)));
        break;
      }
      case 0x93: {
        auto name = pop(), module = pop();
        if (module->kind != Kind::string || name->kind != Kind::string) malformed("STACK_GLOBAL without two strings");
        push(global(module->text, name->text));
        break;
      }
      case 'R':
      case 0x81: {  // REDUCE, NEWOBJ: both (callable, args) here
        auto args = pop(), callable = pop();
        push(construct(callable, args));
        break;
      }
      case 0x92: {  // NEWOBJ_EX: keyword arguments are kept as the state
        auto kwargs = pop(), args = pop(), callable = pop();
        auto v = construct(callable, args);
        if (!kwargs->entries.empty()) v->state = kwargs;
        push(v);
        break;
      }
      case 'b': {
        auto state = pop();
        auto& target = top();
        if (state == target) malformed("an object built from itself");
        target->state = state;  // an OrderedDict's attributes, or an object's __dict__ / __setstate__ argument
        break;
      }
      case 'Q': {
        auto id = pop();
        auto v = make(Kind::persistent);
        v->items = {id};
        push(v);
        break;
      }
      case 'P': {
        auto v = make(Kind::persistent);
        auto id = make(Kind::string);
        id->text = line();
        v->items = {id};
        push(v);
        break;
      }
      case 'p': memo_[static_cast<uint64_t>(parse_int(line(), *this))] = top(); break;
      case 'q': memo_[le(1)] = top(); break;
      case 'r': memo_[le(4)] = top(); break;
      case 0x94: memo_[memo_.size()] = top(); break;
      case 'g': push(memo_get(static_cast<uint64_t>(parse_int(line(), *this)))); break;
      case 'h': push(memo_get(le(1))); break;
      case 'j': push(memo_get(le(4))); break;
      default:
        fail(where_, ": unsupported pickle opcode 0x", strprintf("%02x", op), " at byte ", p_ - 1);
    }
  }
};

}  // namespace

Ptr load(std::string_view data, const std::string& where, size_t max_values) {
  return Reader(data, where, max_values).run();
}

}  // namespace titan::pickle
