// The model's part of a checkpoint (torchtitan's ModelWrapper): every parameter's piece under "model.<name>" as its
// layout says -- a replicated piece written by one rank only -- and the model's arguments, flavor and tokenizer in
// the metadata. On load each rank reads the boxes it holds; a saved model of another shape is refused naming the
// tensor, one that computes differently (RoPE, norm epsilon) is loaded with a warning.
#pragma once
#include <string>
#include <vector>

#include "titan/distributed/sharded_parameter.h"
#include "titan/protocols/model_args.h"
#include "titan/protocols/stateful.h"

namespace titan::checkpoint {

class ModelWeights : public protocols::Stateful {
 public:
  // `flavor` names the model in logs and metadata; `tokenizer_path` (may be empty) is recorded so that an export
  // finds the run's tokenizer.
  // `buffers` (may be null): untrained state saved beside the weights (ModelArgs::buffer_shapes); a source without
  // them leaves them as they are.
  ModelWeights(std::vector<distributed::ShardedParameter>& parameters, const protocols::ModelArgs& args, std::string flavor,
               std::string tokenizer_path, std::vector<distributed::ShardedParameter>* buffers = nullptr);
  protocols::SavedState state_dict(const protocols::SaveOptions& options) const override;
  void load_state_dict(protocols::StateSource& source) override;

  static std::string key(const std::string& parameter) { return "model." + parameter; }
  const protocols::ModelArgs& args() const { return args_; }

 private:
  std::vector<distributed::ShardedParameter>& parameters_;
  std::vector<distributed::ShardedParameter>* buffers_;
  const protocols::ModelArgs& args_;
  std::string flavor_, tokenizer_path_;
};

}  // namespace titan::checkpoint
