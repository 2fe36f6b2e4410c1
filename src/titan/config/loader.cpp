#include "titan/config/loader.h"

#include <algorithm>
#include <toml++/toml.h>

#include <cerrno>
#include <cmath>
#include <filesystem>
#include <cstdlib>
#include <nlohmann/json.hpp>
#include <set>

#include "titan/common/error.h"
#include "titan/common/logging.h"
#include "titan/common/strings.h"
#include "titan/config/schema.h"

namespace titan::config {
namespace {

struct KeyIndex {
  std::vector<KeySpec> keys;
  std::map<std::string, size_t> by_name;
  std::vector<std::string> names;
  std::set<std::string> sections;

  explicit KeyIndex(JobConfig& config) : keys(describe(config)) {
    for (size_t i = 0; i < keys.size(); ++i) {
      by_name[keys[i].full_name()] = i;
      names.push_back(keys[i].full_name());
    }
    for (const auto& s : section_names()) sections.insert(s);
  }
  KeySpec* find(const std::string& full) {
    auto it = by_name.find(full);
    return it == by_name.end() ? nullptr : &keys[it->second];
  }
  std::string suggest(const std::string& full) const {
    std::string hint = closest_match(full, names);
    return hint.empty() ? "" : cat("; did you mean '", hint, "'?");
  }
};

std::string describe_toml(const toml::node& node) {
  switch (node.type()) {
    case toml::node_type::string: return cat("a string (", quote(*node.value<std::string>()), ")");
    case toml::node_type::integer: return cat("an integer (", *node.value<int64_t>(), ")");
    case toml::node_type::floating_point: return cat("a float (", *node.value<double>(), ")");
    case toml::node_type::boolean: return cat("a boolean (", (*node.value<bool>() ? "true" : "false"), ")");
    case toml::node_type::array: return "an array";
    case toml::node_type::table: return "a table";
    default: return "a date/time";
  }
}

std::string location(const toml::node& node, const std::string& file) {
  return cat(file, ":", node.source().begin.line);
}

StringList toml_string_list(const toml::node& node, const std::string& where, const std::string& key) {
  StringList out;
  if (auto s = node.value<std::string>()) {
    for (auto& part : split(*s, ',')) {
      auto t = trim(part);
      if (!t.empty()) out.push_back(t);
    }
    return out;
  }
  const auto* array = node.as_array();
  if (!array) fail(where, ": ", key, " expects a list of strings, got ", describe_toml(node));
  for (const auto& item : *array) {
    auto s = item.value<std::string>();
    if (!s) fail(where, ": ", key, " expects a list of strings, but an element is ", describe_toml(item));
    out.push_back(*s);
  }
  return out;
}

// `file`: the TOML file the node was read from (empty for a command-line value), so that an error names the line of
// the table or key at fault rather than the array's first.
DatasetSources toml_dataset_sources(const toml::node& node, const std::string& array_where, const std::string& key,
                                    const std::string& file) {
  auto at = [&](const toml::node& n) { return file.empty() ? array_where : location(n, file); };
  const auto* array = node.as_array();
  if (!array) fail(array_where, ": ", key, " expects an array of tables ([[", key, "]] or [{path = ...}, ...]), got ", describe_toml(node));
  DatasetSources out;
  for (size_t i = 0; i < array->size(); ++i) {
    const auto* table = (*array)[i].as_table();
    const std::string item = cat(key, "[", i, "]");
    if (!table) fail(at((*array)[i]), ": ", item, " must be a table with keys name, path, format, weight, text_field, loop");
    DatasetSource source;
    bool has_path = false;
    for (auto&& [k, node_value] : *table) {
      const std::string name(k.str());
      const auto& v = node_value;  // clang 14 cannot capture a structured binding in a lambda
      auto want_string = [&](std::string& target) {
        auto s = v.value_exact<std::string>();
        if (!s) fail(at(v), ": ", item, ".", name, " expects a string, got ", describe_toml(v));
        target = *s;
      };
      if (name == "name") want_string(source.name);
      else if (name == "path") want_string(source.path), has_path = true;
      else if (name == "format") want_string(source.format);
      else if (name == "text_field") want_string(source.text_field);
      else if (name == "weight") {
        auto w = v.is_number() ? v.value<double>() : std::nullopt;
        if (!w) fail(at(v), ": ", item, ".weight expects a number, got ", describe_toml(v));
        source.weight = *w;
      } else if (name == "loop") {
        auto b = v.value_exact<bool>();
        if (!b) fail(at(v), ": ", item, ".loop expects true or false, got ", describe_toml(v));
        source.loop = *b;
      } else {
        std::string hint = closest_match(name, {"name", "path", "format", "weight", "text_field", "loop"});
        fail(at(v), ": unknown key ", quote(name), " in ", item, hint.empty() ? "" : cat("; did you mean '", hint, "'?"),
             " Keys: name, path, format, weight, text_field, loop");
      }
    }
    if (!has_path && source.name != "fortunes")
      fail(at(*table), ": ", item, " needs a path (a file, directory or glob), or name = \"fortunes\" for the built-in corpus");
    if (!(source.weight > 0) || !std::isfinite(source.weight))
      fail(table->contains("weight") ? at(*table->get("weight")) : at(*table), ": ", item, ".weight must be a positive number, got ", source.weight);
    static const std::vector<std::string> formats = {"auto", "text", "lines", "paragraphs", "jsonl", "fortune", "tokens", "parquet", "arrow"};
    if (std::find(formats.begin(), formats.end(), source.format) == formats.end())
      fail(table->contains("format") ? at(*table->get("format")) : at(*table), ": ", item, ".format must be one of {", join(formats, ", "), "}, got ", quote(source.format));
    if (source.name.empty()) source.name = source.path;
    out.push_back(source);
  }
  return out;
}

void set_from_toml(KeySpec& spec, const toml::node& node, const std::string& where, const std::string& file = "") {
  const std::string key = spec.full_name();
  auto wrong = [&](const char* expected) {
    fail(where, ": ", key, " expects ", expected, ", got ", describe_toml(node));
  };
  std::visit(
      [&](auto* target) {
        using T = std::remove_pointer_t<decltype(target)>;
        if constexpr (std::is_same_v<T, bool>) {
          auto v = node.value_exact<bool>();
          if (!v) wrong("a boolean (true or false)");
          *target = *v;
        } else if constexpr (std::is_same_v<T, int64_t> || std::is_same_v<T, std::optional<int64_t>>) {
          auto v = node.value_exact<int64_t>();
          if (!v) wrong("an integer");
          *target = *v;
        } else if constexpr (std::is_same_v<T, double> || std::is_same_v<T, std::optional<double>>) {
          auto v = node.is_number() ? node.value<double>() : std::nullopt;
          if (!v) wrong("a number (representable as a double)");
          if (!std::isfinite(*v)) fail(where, ": ", key, " must be a finite number, got ", describe_toml(node));
          *target = *v;
        } else if constexpr (std::is_same_v<T, std::string> || std::is_same_v<T, std::optional<std::string>>) {
          auto v = node.value_exact<std::string>();
          if (!v) wrong("a string");
          *target = *v;
        } else if constexpr (std::is_same_v<T, StringList>) {
          *target = toml_string_list(node, where, key);
        } else if constexpr (std::is_same_v<T, DatasetSources>) {
          *target = toml_dataset_sources(node, where, key, file);
        } else {
          const auto* outer = node.as_array();
          if (!outer) wrong("a list of lists of strings");
          std::vector<StringList> lists;
          for (const auto& inner : *outer) {
            if (!inner.is_array()) wrong("a list of lists of strings");
            lists.push_back(toml_string_list(inner, where, key));
          }
          *target = lists;
        }
      },
      spec.value);
}

bool parse_bool(const std::string& text, bool& out) {
  std::string v = to_lower(text);
  if (v == "true" || v == "1" || v == "yes" || v == "on") return out = true, true;
  if (v == "false" || v == "0" || v == "no" || v == "off") return out = false, true;
  return false;
}

bool is_none(const std::string& text) { return text == "None" || text == "none" || text == "null"; }

void set_from_string(KeySpec& spec, const std::string& text, const std::string& where) {
  const std::string key = spec.full_name();
  auto wrong = [&](const char* expected) { fail(where, ": ", key, " expects ", expected, ", got ", quote(text)); };
  auto parse_int = [&](int64_t& out) {
    char* end = nullptr;
    errno = 0;
    long long v = std::strtoll(text.c_str(), &end, 10);
    if (text.empty() || *end != '\0' || errno == ERANGE) wrong("an integer");
    out = v;
  };
  auto parse_double = [&](double& out) {
    char* end = nullptr;
    errno = 0;
    double v = std::strtod(text.c_str(), &end);
    if (text.empty() || *end != '\0' || errno == ERANGE) wrong("a number");
    if (!std::isfinite(v)) fail(where, ": ", key, " must be a finite number, got ", quote(text));
    out = v;
  };
  std::visit(
      [&](auto* target) {
        using T = std::remove_pointer_t<decltype(target)>;
        if constexpr (std::is_same_v<T, bool>) {
          bool v;
          if (!parse_bool(text, v)) wrong("true or false");
          *target = v;
        } else if constexpr (std::is_same_v<T, int64_t>) {
          parse_int(*target);
        } else if constexpr (std::is_same_v<T, std::optional<int64_t>>) {
          if (is_none(text)) {
            target->reset();
          } else {
            int64_t v;
            parse_int(v);
            *target = v;
          }
        } else if constexpr (std::is_same_v<T, double>) {
          parse_double(*target);
        } else if constexpr (std::is_same_v<T, std::optional<double>>) {
          if (is_none(text)) {
            target->reset();
          } else {
            double v;
            parse_double(v);
            *target = v;
          }
        } else if constexpr (std::is_same_v<T, std::string>) {
          *target = text;
        } else if constexpr (std::is_same_v<T, std::optional<std::string>>) {
          if (is_none(text)) target->reset();
          else *target = text;
        } else if constexpr (std::is_same_v<T, StringList>) {
          target->clear();
          for (auto& part : split(text, ',')) {
            auto t = trim(part);
            if (!t.empty()) target->push_back(t);
          }
        } else if constexpr (std::is_same_v<T, DatasetSources>) {
          toml::table parsed;
          try {
            parsed = toml::parse("value = " + text);
          } catch (const toml::parse_error&) {
            wrong("a TOML array of tables, e.g. '[{path=\"a.jsonl\", weight=0.7}, {path=\"b.txt\", weight=0.3}]'");
          }
          *target = toml_dataset_sources(*parsed.get("value"), where, key, "");
        } else {
          if (is_none(text)) {
            target->reset();
            return;
          }
          // A nested list is given in TOML syntax: '[["tok_embeddings", "layers.0"], ["layers.1"]]'.
          toml::table parsed;
          try {
            parsed = toml::parse("value = " + text);
          } catch (const toml::parse_error&) {
            wrong("a TOML list of lists of strings, e.g. '[[\"layers.0\"], [\"layers.1\"]]'");
          }
          set_from_toml(spec, *parsed.get("value"), where);
        }
      },
      spec.value);
}

void check_range(const KeySpec& spec, const std::string& where) {
  const std::string key = spec.full_name();
  auto check_number = [&](double v, bool is_int) {
    if (is_int && std::find(spec.also_allowed.begin(), spec.also_allowed.end(), static_cast<int64_t>(v)) !=
                      spec.also_allowed.end())
      return;
    bool low = spec.min && (spec.min_exclusive ? v <= *spec.min : v < *spec.min);
    bool high = spec.max && v > *spec.max;
    if (!low && !high) return;
    std::string expected;
    if (spec.min && spec.max) expected = cat("between ", *spec.min, " and ", *spec.max);
    else if (spec.min) expected = cat(spec.min_exclusive ? "greater than " : "at least ", *spec.min);
    else expected = cat("at most ", *spec.max);
    for (auto extra : spec.also_allowed) expected += cat(" (or ", extra, ")");
    fail(where, ": ", key, " must be ", expected, ", got ", is_int ? std::to_string(static_cast<int64_t>(v)) : cat(v));
  };
  std::visit(
      [&](auto* target) {
        using T = std::remove_pointer_t<decltype(target)>;
        if constexpr (std::is_same_v<T, int64_t>) check_number(static_cast<double>(*target), true);
        else if constexpr (std::is_same_v<T, std::optional<int64_t>>) {
          if (*target) check_number(static_cast<double>(**target), true);
        } else if constexpr (std::is_same_v<T, double>) check_number(*target, false);
        else if constexpr (std::is_same_v<T, std::optional<double>>) {
          if (*target) check_number(**target, false);
        } else if constexpr (std::is_same_v<T, std::string> || std::is_same_v<T, std::optional<std::string>>) {
          if (spec.choices.empty()) return;
          const std::string* s = nullptr;
          if constexpr (std::is_same_v<T, std::string>) s = target;
          else if (*target) s = &**target;
          if (!s) return;
          if (std::find(spec.choices.begin(), spec.choices.end(), *s) == spec.choices.end())
            fail(where, ": ", key, " must be one of {", join(spec.choices, ", "), "}, got ", quote(*s));
        }
      },
      spec.value);
}

void apply_toml(KeyIndex& index, LoadedConfig& loaded, const std::string& path) {
  toml::table root;
  {
    std::error_code ec;
    if (std::filesystem::is_directory(path, ec))
      fail("job.config_file = ", quote(path), " is a directory; expected a TOML file (e.g. configs/debug_model.toml)");
    if (!std::filesystem::exists(path, ec))
      fail("job.config_file = ", quote(path), ": no such file (relative paths are from the current directory, ",
           std::filesystem::current_path(ec).string(), ")");
  }
  try {
    root = toml::parse_file(path);
  } catch (const toml::parse_error& e) {
    const auto& src = e.source();
    fail(path, ":", src.begin.line, ":", src.begin.column, ": invalid TOML: ", e.description());
  } catch (const std::exception& e) {
    fail("cannot read config file ", quote(path), ": ", e.what());
  }
  std::function<void(const toml::table&, const std::string&)> walk = [&](const toml::table& table,
                                                                           const std::string& prefix) {
    for (auto&& [name, node] : table) {
      std::string full = prefix.empty() ? std::string(name.str()) : prefix + "." + std::string(name.str());
      std::string where = location(node, path);
      if (node.is_table()) {
        if (!index.sections.count(full)) {
          std::vector<std::string> all(index.sections.begin(), index.sections.end());
          // A section torchtitan has since moved ([float8] is now [quantize.linear.float8]): the one ending in it.
          std::string hint;
          for (const auto& section : all)
            if (section.size() > full.size() && section.ends_with("." + full)) hint = section;
          if (hint.empty()) hint = closest_match(full, all);
          fail(where, ": unknown section [", full, "]", hint.empty() ? "." : cat("; did you mean [", hint, "]?"),
               " Run `titan train --help` for every section and key.");
        }
        walk(*node.as_table(), full);
        continue;
      }
      if (prefix.empty())
        fail(where, ": key ", quote(full), " must be inside a section such as [training]");
      KeySpec* spec = index.find(full);
      if (!spec) {
        if (index.sections.count(full))
          fail(where, ": [", full, "] is a section, not a key; write it as a table");
        fail(where, ": unknown key '", std::string(name.str()), "' in section [", prefix, "]", index.suggest(full),
             " Run `titan train --help` for every key.");
      }
      set_from_toml(*spec, node, where, path);
      loaded.origins[full] = where;
    }
  };
  walk(root, "");
}

void apply_cli(KeyIndex& index, LoadedConfig& loaded, const std::vector<std::string>& args) {
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& arg = args[i];
    if (arg == "--help" || arg == "-h") {
      loaded.help_requested = true;
      continue;
    }
    if (!starts_with(arg, "--") || arg.size() == 2)
      fail("unexpected argument ", quote(arg), ": options look like --section.key value or --section.key=value");
    std::string body = arg.substr(2);
    std::optional<std::string> inline_value;
    if (auto eq = body.find('='); eq != std::string::npos) {
      inline_value = body.substr(eq + 1);
      body = body.substr(0, eq);
    }
    std::replace(body.begin(), body.end(), '-', '_');
    const std::string where = "command line (" + arg + ")";
    KeySpec* spec = index.find(body);
    if (!spec) {
      // --section.no_key turns a boolean off, as torchtitan's command line does.
      auto dot = body.rfind('.');
      if (dot != std::string::npos && body.compare(dot + 1, 3, "no_") == 0) {
        std::string positive_name = body.substr(0, dot + 1) + body.substr(dot + 4);
        KeySpec* negated = index.find(positive_name);
        if (negated && std::holds_alternative<bool*>(negated->value) && !inline_value) {
          *std::get<bool*>(negated->value) = false;
          loaded.origins[positive_name] = where;
          continue;
        }
      }
      if (body.find('.') == std::string::npos)
        fail("unknown option ", quote(arg), ": options are --section.key", index.suggest(body));
      fail("unknown option ", quote(arg), index.suggest(body), " Run `titan train --help` for every key.");
    }
    std::string value;
    if (std::holds_alternative<bool*>(spec->value)) {
      bool unused;
      if (inline_value) value = *inline_value;
      else if (i + 1 < args.size() && parse_bool(args[i + 1], unused) && !starts_with(args[i + 1], "--")) value = args[++i];
      else value = "true";
    } else if (inline_value) {
      value = *inline_value;
    } else {
      if (i + 1 >= args.size()) fail(where, ": ", spec->full_name(), " expects a value (", spec->type_name(), ")");
      // An option in a value's place means the value was left out: taken as the value, it would be lost (a folder
      // named "--checkpoint.enable", and checkpointing off) without a word.
      if (starts_with(args[i + 1], "--"))
        fail(where, ": ", spec->full_name(), " expects a value (", spec->type_name(), ") but is followed by the option ",
             quote(args[i + 1]), "; for a value that starts with --, write ", arg, "=VALUE");
      value = args[++i];
    }
    set_from_string(*spec, value, where);
    loaded.origins[spec->full_name()] = where;
  }
}

std::optional<std::string> find_config_file(const std::vector<std::string>& args) {
  std::optional<std::string> found;
  for (size_t i = 0; i < args.size(); ++i) {
    for (const char* flag : {"--job.config_file", "--job.config-file"}) {
      std::string f = flag;
      std::optional<std::string> file;
      if (args[i] == f) {
        if (i + 1 >= args.size()) fail(f, " expects a file path");
        file = args[i + 1];
      } else if (starts_with(args[i], f + "=")) {
        file = args[i].substr(f.size() + 1);
      }
      // One TOML per job (as torchtitan): a second would otherwise be dropped without a word.
      if (file && found)
        fail("--job.config_file is given twice (", quote(*found), " and ", quote(*file), "); a job reads one TOML file: "
             "merge them, or override its keys with --section.key value");
      if (file) found = file;
    }
  }
  return found;
}

}  // namespace

std::string LoadedConfig::where(const std::string& key) const {
  auto it = origins.find(key);
  return it == origins.end() ? "(default)" : "(set at " + it->second + ")";
}

void validate(LoadedConfig& loaded) {
  JobConfig& c = loaded.config;
  {
    // A misspelt part would silently load it after all.
    static const std::vector<std::string> parts = {"model", "optimizer", "lr_scheduler", "dataloader", "train_state"};
    for (const auto& part : c.checkpoint.exclude_from_loading)
      if (std::find(parts.begin(), parts.end(), part) == parts.end())
        fail(loaded.where("checkpoint.exclude_from_loading"), ": checkpoint.exclude_from_loading lists ", quote(part),
             "; the parts are ", join(parts, ", "));
  }
  {
    static const std::vector<std::string> parts = {"model", "loss"};
    for (const auto& part : c.compile.components)
      if (std::find(parts.begin(), parts.end(), part) == parts.end())
        fail(loaded.where("compile.components"), ": compile.components lists ", quote(part), "; the parts are model, loss");
  }
  KeyIndex index(c);
  for (const auto& spec : index.keys) {
    auto it = loaded.origins.find(spec.full_name());
    check_range(spec, it == loaded.origins.end() ? "default" : it->second);
  }
  auto where = [&](const char* key) {
    auto it = loaded.origins.find(key);
    return it == loaded.origins.end() ? std::string("default") : it->second;
  };
  if (c.model.tokenizer_path) {
    log::warn("model.tokenizer_path is deprecated; using it as model.hf_assets_path");
    c.model.hf_assets_path = *c.model.tokenizer_path;
  }
  const std::string& option = c.activation_checkpoint.selective_ac_option;
  if (option != "op") {
    const bool digits = !option.empty() && option.size() <= 9 &&
                        std::all_of(option.begin(), option.end(), [](char ch) { return ch >= '0' && ch <= '9'; });
    if (!digits)
      fail(where("activation_checkpoint.selective_ac_option"),
           ": activation_checkpoint.selective_ac_option must be \"op\" or a non-negative integer N (checkpoint every N-th block), got ",
           quote(option));
  }
  if (c.parallelism.context_parallel_load_balancer && c.parallelism.context_parallel_load_balancer->empty())
    fail(where("parallelism.context_parallel_load_balancer"),
         ": parallelism.context_parallel_load_balancer cannot be empty; use None to disable load balancing");
  if (c.parallelism.context_parallel_load_balancer) {
    const auto& lb = *c.parallelism.context_parallel_load_balancer;
    if (lb != "headtail" && lb != "ptrr")
      fail(where("parallelism.context_parallel_load_balancer"),
           ": parallelism.context_parallel_load_balancer must be headtail, ptrr or None, got ", quote(lb));
  }
  if (c.checkpoint.initial_load_in_hf && !c.checkpoint.initial_load_model_only)
    fail(where("checkpoint.initial_load_in_hf"),
         ": checkpoint.initial_load_in_hf needs checkpoint.initial_load_model_only = true (safetensors hold only the model)");
  if (c.checkpoint.last_save_in_hf && !c.checkpoint.last_save_model_only)
    fail(where("checkpoint.last_save_in_hf"),
         ": checkpoint.last_save_in_hf needs checkpoint.last_save_model_only = true (safetensors hold only the model)");
  if (!c.experimental.custom_args_module.empty() && c.job.custom_config_module.empty())
    c.job.custom_config_module = c.experimental.custom_args_module;
}

LoadedConfig load_job_config(const std::vector<std::string>& args) {
  LoadedConfig loaded;
  KeyIndex index(loaded.config);
  if (auto file = find_config_file(args)) {
    apply_toml(index, loaded, *file);
    loaded.config.job.config_file = *file;
  }
  apply_cli(index, loaded, args);
  if (!loaded.help_requested) validate(loaded);
  return loaded;
}

LoadedConfig load_toml_file(const std::string& path) {
  LoadedConfig loaded;
  KeyIndex index(loaded.config);
  apply_toml(index, loaded, path);
  loaded.config.job.config_file = path;
  validate(loaded);
  return loaded;
}

std::string help_text() {
  JobConfig defaults;
  auto keys = describe(defaults);
  std::ostringstream out;
  out << "usage: titan train [--job.config_file FILE.toml] [--section.key VALUE | --section.key=VALUE | --section.flag |\n"
         "                   --section.no_flag] ...\n\n"
         "Precedence: command line > TOML file > defaults. Booleans given alone mean true; lists are comma-separated.\n"
         "Section and key names are torchtitan's (v0.2.2); its TOML files load unchanged.\n";
  std::string section;
  for (const auto& k : keys) {
    if (k.section != section) {
      section = k.section;
      out << "\n[" << section << "]\n";
    }
    std::string head = "  --" + k.full_name() + " (" + k.type_name() + ", default " + k.value_string() + ")";
    out << head << "\n      " << k.doc;
    if (!k.choices.empty()) out << " {" << join(k.choices, ", ") << "}";
    out << "\n";
  }
  return out.str();
}

std::string to_json(const JobConfig& config) {
  JobConfig copy = config;
  nlohmann::ordered_json root = nlohmann::ordered_json::object();
  for (const auto& k : describe(copy)) {
    nlohmann::ordered_json* node = &root;
    for (const auto& part : split(k.section, '.')) node = &(*node)[part];
    nlohmann::ordered_json value;
    std::visit(
        [&](auto* target) {
          using T = std::remove_pointer_t<decltype(target)>;
          if constexpr (std::is_same_v<T, std::optional<std::string>> || std::is_same_v<T, std::optional<int64_t>> ||
                        std::is_same_v<T, std::optional<double>> ||
                        std::is_same_v<T, std::optional<std::vector<StringList>>>) {
            value = *target ? nlohmann::ordered_json(**target) : nlohmann::ordered_json(nullptr);
          } else if constexpr (std::is_same_v<T, DatasetSources>) {
            value = nlohmann::ordered_json::array();
            for (const auto& d : *target)
              value.push_back({{"name", d.name}, {"path", d.path}, {"format", d.format}, {"weight", d.weight},
                               {"text_field", d.text_field}, {"loop", d.loop}});
          } else {
            value = *target;
          }
        },
        k.value);
    (*node)[k.name] = value;
  }
  return root.dump(2);
}

}  // namespace titan::config
