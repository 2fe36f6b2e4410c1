#include "titan/models/llama3/spec.h"

#include "titan/models/common/decoder_spec.h"
#include "titan/models/common/json_fields.h"
#include "titan/models/llama3/args.h"
#include "titan/models/llama3/hf_config.h"

namespace titan::llama3 {

protocols::ModelSpec spec() {
  protocols::ModelSpec s = models::decoder_spec({"llama3", {"llama"}, flavor_names, {flavor, read_hf_config}, to_hf_config});
  s.read_meta_params = [](const std::string& path, bool tied) -> std::shared_ptr<const protocols::ModelArgs> {
    return std::make_shared<DecoderArgs>(
        from_meta_params(models::read_json_file(path, "Meta's params.json"), path, tied));
  };
  return s;
}

}  // namespace titan::llama3
