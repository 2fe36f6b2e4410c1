#include "titan/models/qwen3/spec.h"

#include "titan/models/common/decoder_spec.h"
#include "titan/models/qwen3/args.h"
#include "titan/models/qwen3/hf_config.h"

namespace titan::qwen3 {

protocols::ModelSpec spec() {
  return models::decoder_spec({"qwen3", {"qwen3", "qwen3_moe"}, flavor_names, {flavor, read_hf_config}, to_hf_config,
                               /*counts_tied_output=*/false});
}

}  // namespace titan::qwen3
