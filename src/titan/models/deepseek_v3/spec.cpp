#include "titan/models/deepseek_v3/spec.h"

#include "titan/models/common/decoder_spec.h"
#include "titan/models/deepseek_v3/args.h"
#include "titan/models/deepseek_v3/hf_config.h"

namespace titan::deepseek_v3 {

protocols::ModelSpec spec() {
  return models::decoder_spec({"deepseek_v3", {"deepseek_v3"}, flavor_names, {flavor, read_hf_config}, to_hf_config,
                               /*counts_tied_output=*/false});
}

}  // namespace titan::deepseek_v3
