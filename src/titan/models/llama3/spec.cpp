#include "titan/models/llama3/spec.h"

#include "titan/models/common/decoder_spec.h"
#include "titan/models/llama3/args.h"
#include "titan/models/llama3/hf_config.h"

namespace titan::llama3 {

protocols::ModelSpec spec() {
  return models::decoder_spec({"llama3", {"llama"}, flavor_names, {flavor, read_hf_config}, to_hf_config});
}

}  // namespace titan::llama3
