#include "titan/components/quantization/float8.h"

#include <algorithm>
#include <functional>
#include <memory>
#include <tuple>

#include "titan/common/error.h"
#include "titan/common/logging.h"
#include "titan/common/strings.h"
#include "titan/nn/float8.h"
#include "titan/nn/kept_ops.h"
#include "titan/nn/unit.h"

namespace titan::quantization {

namespace {

// A converted linear's wrapper. Under op-level selective checkpointing it counts among the block's products as a
// plain linear does: torchtitan's policy counts aten.mm, and torchao's float8 and MX linears call torch.mm on their
// float8 tensors, which is what the policy's dispatch mode sees. So every other product's output is kept from the
// forward and the recomputation returns it instead of casting and multiplying again (nn/kept_ops.h).
nn::Unit::Wrapper converted_linear(nn::Linear* linear, std::function<at::Tensor(const at::Tensor& x, const at::Tensor& kept)> run) {
  return [linear, run = std::move(run)](const nn::Unit::Inputs& inputs, const nn::Context& context, const nn::Unit::Next&) {
    if (!context.kept_ops || linear->recompute_under_op_checkpointing) return run(inputs[0], at::Tensor());
    return context.kept_ops->product([&](const at::Tensor& kept) { return run(inputs[0], kept); });
  };
}

constexpr const char* kAutoFilter = "auto_filter_small_kn";

std::string recipe_name(const config::Float8Linear& s) { return s.recipe_name.value_or("tensorwise"); }

bool is_float8_converter(const std::string& name) { return name == "quantize.linear.float8" || name == "float8"; }
bool is_mx_converter(const std::string& name) { return name == "quantize.linear.mx" || name == "mx"; }
bool is_grouped_mx_converter(const std::string& name) { return name == "quantize.grouped_mm.mx"; }
bool is_grouped_float8_converter(const std::string& name) { return name == "quantize.grouped_mm.float8"; }

std::vector<std::string> mx_config_errors(const config::LoadedConfig& loaded, const at::Device& device) {
  const config::JobConfig& c = loaded.config;
  const auto& s = c.quantize.linear.mx;
  std::vector<std::string> errors;
  const auto& names = nn::float8::mx_recipe_names();
  if (std::find(names.begin(), names.end(), s.recipe_name) == names.end()) {
    errors.push_back(cat("quantize.linear.mx.recipe_name = ", quote(s.recipe_name), " ", loaded.where("quantize.linear.mx.recipe_name"),
                         ": not an MX recipe titan runs; expected one of ", join(names, ", "), " (MXFP4 is not supported)"));
    return errors;
  }
  std::string why;
  if (!s.emulate && s.recipe_name != "mxfp8_emulated" && !nn::float8::has_mx_matmul(device, &why))
    errors.push_back(cat("quantize.linear.mx.recipe_name = ", quote(s.recipe_name), " ", loaded.where("quantize.linear.mx.recipe_name"),
                         " asks for LibTorch's blockwise-scaled matmul, but ", why,
                         "; quantize.linear.mx.emulate = true (or recipe_name = \"mxfp8_emulated\") runs MXFP8 linears "
                         "emulated on any device (MXFP8 values, high-precision matmuls)"));
  const int64_t cp = std::max<int64_t>(1, c.parallelism.context_parallel_degree);
  if ((c.training.seq_len / cp) % 32 != 0)
    errors.push_back(cat("training.seq_len = ", c.training.seq_len, " ", loaded.where("training.seq_len"),
                         cp > 1 ? cat(" over context_parallel_degree = ", cp) : std::string(),
                         ": MXFP8 linears need each rank's sequences in multiples of 32 tokens (the weight gradient's blocks "
                         "of 32 run along the tokens)"));
  return errors;
}

// Gives each linear unit of `model` that `selected` picks the innermost wrapper `make` returns, and lists the
// converted and the kept 2-D projections in `result`. Innermost: tensor parallelism, activation checkpointing and
// FSDP wrap it as they wrap the plain linear, and it reads the weight as they leave it (the local shard, the
// gathered copy).
void convert_linears(nn::Model& model, Float8Conversion& result,
                     const std::function<bool(const std::string&, const nn::Linear&)>& selected,
                     const std::function<nn::Unit::Wrapper(nn::Linear*)>& make) {
  for (const auto& item : model.named_modules("", /*include_self=*/false)) {
    const std::string& fqn = item.key();
    auto* linear = dynamic_cast<nn::Linear*>(item.value().get());
    if (!linear) {
      // A projection that is not a plain linear unit (the output projection, which computes the loss with its
      // matmul) stays in high precision; torchtitan's float8 TOMLs filter "output" anyway.
      const auto* weight = item.value()->named_parameters(/*recurse=*/false).find("weight");
      if (weight && weight->dim() == 2 && !dynamic_cast<nn::Embedding*>(item.value().get())) result.kept.push_back(fqn);
      continue;
    }
    if (!selected(fqn, *linear)) {
      result.kept.push_back(fqn);
      continue;
    }
    linear->add_innermost_wrapper(nn::float8::kWrapperName, make(linear));
    result.converted.push_back(fqn);
  }
}

}  // namespace

bool float8_enabled(const config::JobConfig& config) {
  const auto& converters = config.model.converters;
  return std::any_of(converters.begin(), converters.end(), is_float8_converter);
}

std::string float8_recipe_name(const config::JobConfig& config) { return recipe_name(config.quantize.linear.float8); }

std::vector<std::string> float8_config_errors(const config::LoadedConfig& loaded, const at::Device& device) {
  const config::JobConfig& c = loaded.config;
  std::vector<std::string> errors;
  int float8_count = 0, mx_count = 0, grouped_mx_count = 0, grouped_float8_count = 0;
  for (const auto& name : c.model.converters) {
    if (is_float8_converter(name)) {
      ++float8_count;
    } else if (is_mx_converter(name)) {
      ++mx_count;
    } else if (is_grouped_mx_converter(name)) {
      ++grouped_mx_count;
    } else if (is_grouped_float8_converter(name)) {
      ++grouped_float8_count;
    } else {
      errors.push_back(cat("model.converters lists ", quote(name), " ", loaded.where("model.converters"),
                           ": not a converter; expected \"quantize.linear.float8\" (or its short name \"float8\"), "
                           "\"quantize.linear.mx\" (\"mx\"), \"quantize.grouped_mm.mx\" or \"quantize.grouped_mm.float8\""));
    }
  }
  for (const auto& [key, count, fqns] : {std::tuple{"mx", grouped_mx_count, &c.quantize.grouped_mm.mx.fqns},
                                         std::tuple{"float8", grouped_float8_count, &c.quantize.grouped_mm.float8.fqns}}) {
    if (count > 1)
      errors.push_back(cat("model.converters ", loaded.where("model.converters"), " lists \"quantize.grouped_mm.", key, "\" twice"));
    if (count > 0 && fqns->empty())
      errors.push_back(cat("model.converters lists \"quantize.grouped_mm.", key, "\" ", loaded.where("model.converters"),
                           " but quantize.grouped_mm.", key, ".fqns is empty, so no MoE layer would be converted; name them, "
                           "for example fqns = [\"experts\"] (a substring of each layer's name, as torchtitan matches them)"));
  }
  if (float8_count > 1 || mx_count > 1)
    errors.push_back(cat("model.converters ", loaded.where("model.converters"), " lists the ", float8_count > 1 ? "float8" : "MX",
                         " converter twice"));
  if (float8_count > 0 && mx_count > 0)
    errors.push_back(cat("model.converters ", loaded.where("model.converters"),
                         " lists both the float8 and the MX converter; a linear layer takes one of them"));
  if (mx_count > 0)
    for (auto& e : mx_config_errors(loaded, device)) errors.push_back(std::move(e));
  if (float8_count == 0) return errors;
  const auto& s = c.quantize.linear.float8;
  const std::string recipe = recipe_name(s);
  const auto& names = nn::float8::recipe_names();
  if (std::find(names.begin(), names.end(), recipe) == names.end()) {
    errors.push_back(cat("quantize.linear.float8.recipe_name = ", quote(recipe), " ", loaded.where("quantize.linear.float8.recipe_name"),
                         ": not a float8 recipe; expected one of ", join(names, ", ")));
    return errors;
  }
  if (recipe == "rowwise_with_gw_hp" && std::find(s.filter_fqns.begin(), s.filter_fqns.end(), kAutoFilter) != s.filter_fqns.end())
    errors.push_back(cat("quantize.linear.float8.filter_fqns lists ", quote(kAutoFilter), " ", loaded.where("quantize.linear.float8.filter_fqns"),
                         ", which has no size thresholds for recipe \"rowwise_with_gw_hp\" (torchao has them for tensorwise and "
                         "rowwise); name the layers to keep in high precision instead"));
  if (s.enable_fsdp_float8_all_gather && recipe != "tensorwise")
    errors.push_back(cat("quantize.linear.float8.enable_fsdp_float8_all_gather = true ", loaded.where("quantize.linear.float8.enable_fsdp_float8_all_gather"),
                         " needs recipe \"tensorwise\" (with recipe ", quote(recipe),
                         " each matmul casts its own operands, so the gathered weight stays in high precision, as in torchao)"));
  if (s.precompute_float8_dynamic_scale_for_fsdp && !s.enable_fsdp_float8_all_gather)
    errors.push_back(cat("quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp = true ",
                         loaded.where("quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp"),
                         " precomputes the scales of float8 FSDP all-gathers: it needs quantize.linear.float8.enable_fsdp_float8_all_gather = true"));
  std::string why;
  if (!s.emulate && !nn::float8::has_float8_matmul(device, &why))
    errors.push_back(cat("model.converters asks for float8 linears ", loaded.where("model.converters"), ", but ", why,
                         "; quantize.linear.float8.emulate = true runs them emulated (float8 values, float32 matmuls)"));
  return errors;
}

bool grouped_mx_enabled(const config::JobConfig& config) {
  const auto& converters = config.model.converters;
  return std::any_of(converters.begin(), converters.end(), is_grouped_mx_converter);
}

bool grouped_float8_enabled(const config::JobConfig& config) {
  const auto& converters = config.model.converters;
  return std::any_of(converters.begin(), converters.end(), is_grouped_float8_converter);
}

std::vector<std::string> convert_grouped(torch::nn::Module& model, const config::JobConfig& config) {
  // torchtitan hands quantize.grouped_mm.{mx,float8}.fqns to torchao, which swaps the parameters of every module whose
  // name contains an entry, and of the modules below it: the experts' 3-D weights then run low-precision grouped
  // matmuls, and 2-D linear weights among them (the shared experts' under fqns = ["experts"]) low-precision linears
  // (MXFP8 with RCEIL scales; float8 with torchao's rowwise recipe). titan does the same.
  struct Kind {
    const char* key;
    const config::StringList* fqns;
    nn::float8::GroupedCast cast;
    const char* what;
    int64_t unit;  // the widths a shard's linear needs: MX blocks of 32, float8's multiples of 16
  };
  std::vector<Kind> kinds;
  if (grouped_mx_enabled(config))
    kinds.push_back({"mx", &config.quantize.grouped_mm.mx.fqns, nn::float8::GroupedCast::mx_rceil, "MXFP8", 32});
  if (grouped_float8_enabled(config))
    kinds.push_back({"float8", &config.quantize.grouped_mm.float8.fqns, nn::float8::GroupedCast::float8_rowwise, "float8 (rowwise)", 16});
  const int64_t tp = std::max<int64_t>(1, config.parallelism.tensor_parallel_degree);
  std::vector<std::string> all_grouped;
  for (const Kind& kind : kinds) {
    const bool mx = kind.cast != nn::float8::GroupedCast::float8_rowwise;
    // A linear under those names is converted when each rank's piece of its weight has the widths the format needs
    // (checked on both dimensions divided by the TP degree, whichever TP splits) and, under TP, unless it runs whole
    // on every rank with partial output gradients (the router, latent attention's down-projections), which MXFP8
    // cannot scale as one process does; the others stay in high precision, listed.
    const auto linear_converts = [tp, &kind](const std::string& fqn, const at::Tensor& w) {
      if (tp > 1)
        for (const char* suffix : {".router.gate", ".wq_a", ".wkv_a"})
          if (ends_with(fqn, suffix)) return false;
      return w.size(0) % (kind.unit * tp) == 0 && w.size(1) % (kind.unit * tp) == 0;
    };
    const auto named = [&kind](const std::string& fqn) {
      return std::any_of(kind.fqns->begin(), kind.fqns->end(), [&](const std::string& f) { return !f.empty() && fqn.find(f) != std::string::npos; });
    };
    std::vector<std::string> grouped, linears, kept;
    for (const auto& item : model.named_modules("", /*include_self=*/false)) {
      const std::string& fqn = item.key();
      if (!named(fqn)) continue;
      if (auto* experts = dynamic_cast<nn::float8::GroupedMatmuls*>(item.value().get())) {
        if (experts->low_precision)
          fail("MoE experts ", quote(fqn), " are named by both quantize.grouped_mm.mx.fqns and quantize.grouped_mm.float8.fqns; "
               "name each MoE layer in one of them");
        experts->low_precision = kind.cast;
        grouped.push_back(fqn);
      } else if (auto* linear = dynamic_cast<nn::Linear*>(item.value().get()); linear && !linear->has_wrapper(nn::float8::kWrapperName)) {
        if (!linear_converts(fqn, linear->weight)) {
          kept.push_back(fqn);
          continue;
        }
        nn::Unit::Wrapper wrapper;
        if (mx) {
          wrapper = converted_linear(linear, [linear](const at::Tensor& x, const at::Tensor& kept) {
            return nn::float8::mx_linear(x, linear->weight, nn::float8::MxScaleRounding::rceil, /*emulate=*/true, kept);
          });
        } else {
          auto recipe = std::make_shared<const nn::float8::Recipe>(nn::float8::recipe("rowwise"));
          wrapper = converted_linear(linear, [linear, recipe](const at::Tensor& x, const at::Tensor& kept) {
            return nn::float8::linear(x, linear->weight, *recipe, /*emulate=*/true, {}, kept);
          });
        }
        linear->add_innermost_wrapper(nn::float8::kWrapperName, wrapper);
        linears.push_back(fqn);
      }
    }
    if (grouped.empty())
      fail("quantize.grouped_mm.", kind.key, ".fqns = [", join(*kind.fqns, ", "), "] names no MoE experts of this model "
           "(model.converters lists \"quantize.grouped_mm.", kind.key, "\"); torchtitan's MoE layers are named like "
           "layers.1.moe.experts, so fqns = [\"experts\"] converts them all");
    const int64_t cp = std::max<int64_t>(1, config.parallelism.context_parallel_degree);
    if (mx && !linears.empty() && (config.training.seq_len / cp) % 32 != 0)
      fail("training.seq_len = ", config.training.seq_len, cp > 1 ? cat(" over context_parallel_degree = ", cp) : std::string(),
           ": quantize.grouped_mm.mx converts ", join(linears, ", "), " to MXFP8 linears, which need each rank's sequences in "
           "multiples of 32 tokens (the weight gradient's blocks of 32 run along the tokens)");
    log::info(kind.what, " grouped matmuls (quantize.grouped_mm.", kind.key, mx ? ", rceil scales" : ", power-of-two scales per row",
              ", emulated: dequantised, multiplied in ", mx ? "bf16" : "float32", "): ", grouped.size(), " MoE expert unit(s) converted",
              linears.empty() ? std::string() : cat(", and ", linears.size(), " linear(s) under the same names as ", kind.what,
                                                   " linears (", join(linears, ", "), ")"),
              kept.empty() ? std::string() : cat("; kept in high precision: ", join(kept, ", ")));
    all_grouped.insert(all_grouped.end(), grouped.begin(), grouped.end());
  }
  return all_grouped;
}

bool mx_enabled(const config::JobConfig& config) {
  const auto& converters = config.model.converters;
  return std::any_of(converters.begin(), converters.end(), is_mx_converter);
}

bool mx_converts(const std::string& fqn, int64_t out_features, int64_t in_features, const config::MXLinear& settings) {
  for (const auto& f : settings.filter_fqns)
    if (!f.empty() && fqn.find(f) != std::string::npos) return false;
  return out_features % 32 == 0 && in_features % 32 == 0;
}

bool float8_converts(const std::string& fqn, int64_t out_features, int64_t in_features, const config::Float8Linear& settings) {
  bool auto_filter = false;
  for (const auto& f : settings.filter_fqns) {
    if (f == kAutoFilter) {
      auto_filter = true;
      continue;
    }
    if (!f.empty() && fqn.find(f) != std::string::npos) return false;
  }
  const int64_t n = out_features, k = in_features;
  if (n % 16 != 0 || k % 16 != 0) return false;  // float8 matmuls need both dimensions in multiples of 16
  if (!auto_filter) return true;
  // torchao's thresholds below which the float8 casts cost more than the faster matmul saves (measured on H100).
  if (recipe_name(settings) == "tensorwise") return !(k <= 4096 && n <= 1024);
  return !(n <= 2048 || k <= 1024 || (n <= 4096 && k <= 2048));
}

Float8Conversion convert_to_float8(nn::Model& model, const config::JobConfig& config) {
  const auto& settings = config.quantize.linear.float8;
  auto recipe = std::make_shared<const nn::float8::Recipe>(nn::float8::recipe(recipe_name(settings)));
  const bool emulate = settings.emulate;
  Float8Conversion result;
  if (settings.enable_fsdp_float8_all_gather) {
    result.fsdp_float8 = std::make_shared<distributed::FsdpOptions::Float8AllGather>();
    result.fsdp_float8->precompute_scales = settings.precompute_float8_dynamic_scale_for_fsdp;
  }
  convert_linears(model, result, [&](const std::string& fqn, const nn::Linear& linear) {
    return float8_converts(fqn, linear.weight.size(0), linear.weight.size(1), settings);
  }, [&](nn::Linear* linear) -> nn::Unit::Wrapper {
    // With float8 all-gathers, FSDP fills the slot with the gathered float8 weight while the unit is unsharded
    // (without FSDP it stays empty and the linear casts its weight itself).
    c10::intrusive_ptr<nn::float8::PrecastWeight> precast;
    if (result.fsdp_float8) {
      precast = c10::make_intrusive<nn::float8::PrecastWeight>();
      result.fsdp_float8->weights[linear->weight.unsafeGetTensorImpl()] = precast;
    }
    return converted_linear(linear, [linear, recipe, emulate, precast](const at::Tensor& x, const at::Tensor& kept) {
      return nn::float8::linear(x, linear->weight, *recipe, emulate, precast, kept);
    });
  });
  if (result.converted.empty())
    log::warn("model.converters asks for float8 linears, but none of the model's ", result.kept.size(),
              " linears can be converted (float8 needs both dimensions divisible by 16, and filter_fqns leaves some out): "
              "training runs in high precision");
  log::info("Float8 linears (", recipe->name, emulate ? ", emulated" : "",
            result.fsdp_float8 ? (result.fsdp_float8->precompute_scales ? ", float8 FSDP all-gathers with precomputed scales" : ", float8 FSDP all-gathers") : "",
            "): ", result.converted.size(), " converted",
            result.kept.empty() ? std::string() : cat(", ", result.kept.size(), " kept in high precision (", join(result.kept, ", "), ")"));
  return result;
}

Float8Conversion convert_to_mx(nn::Model& model, const config::JobConfig& config) {
  const auto& settings = config.quantize.linear.mx;
  const nn::float8::MxScaleRounding rounding = nn::float8::mx_recipe(settings.recipe_name);
  const bool emulate = settings.emulate || settings.recipe_name == "mxfp8_emulated";
  Float8Conversion result;
  convert_linears(model, result, [&](const std::string& fqn, const nn::Linear& linear) {
    return mx_converts(fqn, linear.weight.size(0), linear.weight.size(1), settings);
  }, [rounding, emulate](nn::Linear* linear) -> nn::Unit::Wrapper {
    return converted_linear(linear, [linear, rounding, emulate](const at::Tensor& x, const at::Tensor& kept) {
      return nn::float8::mx_linear(x, linear->weight, rounding, emulate, kept);
    });
  });
  if (result.converted.empty())
    log::warn("model.converters asks for MXFP8 linears, but none of the model's ", result.kept.size(),
              " linears can be converted (MXFP8 needs both dimensions divisible by 32, and filter_fqns leaves some out): "
              "training runs in high precision");
  log::info("MXFP8 linears (", settings.recipe_name, ", ", rounding == nn::float8::MxScaleRounding::rceil ? "rceil" : "floor",
            " scales", emulate ? ", emulated" : ", LibTorch's blockwise-scaled matmul", "): ", result.converted.size(), " converted",
            result.kept.empty() ? std::string() : cat(", ", result.kept.size(), " kept in high precision (", join(result.kept, ", "), ")"));
  return result;
}

}  // namespace titan::quantization
