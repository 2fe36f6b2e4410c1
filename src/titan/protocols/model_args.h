// What every model family's arguments answer without the model being built: parameter shapes and counts,
// training FLOPs per token (torchtitan's figures for the family), the sequence and vocabulary sizes, and the
// arguments as JSON in checkpoint metadata.
#pragma once
#include <nlohmann/json.hpp>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace titan::protocols {

struct ParameterShape {
  std::string name;  // torchtitan FQN, e.g. "layers.0.attention.wq.weight"
  std::vector<int64_t> shape;
  int64_t numel() const;
};

class ModelArgs {
 public:
  virtual ~ModelArgs() = default;
  // The registered family (model.name): "llama3", "qwen3".
  virtual std::string family() const = 0;
  // Every parameter the model stores, in registration order (a tied weight once).
  virtual std::vector<ParameterShape> parameter_shapes() const = 0;
  // Parameters stored once under another name that torchtitan's state dicts also carry: (alias, stored name), e.g.
  // a tied output projection ("output.weight", "tok_embeddings.weight").
  virtual std::vector<std::pair<std::string, std::string>> tied_aliases() const { return {}; }
  // State the model keeps beside its parameters and checkpoints, untrained (MoE balancing biases); not counted as
  // parameters. A checkpoint without them (a Hugging Face directory) leaves them at their initial values.
  virtual std::vector<ParameterShape> buffer_shapes() const { return {}; }
  // Elements of all stored parameters.
  int64_t stored_parameters() const;
  // The parameter count and the embedding's part of it as torchtitan's get_nparams_and_flops reports them.
  virtual int64_t reported_parameters() const = 0;
  // The parameters one token uses: reported_parameters() less the routed experts it is not sent to (Mixture of
  // Experts: top_k of num_experts per MoE block), as model cards count "activated" parameters.
  virtual int64_t active_parameters() const { return reported_parameters(); }
  virtual int64_t embedding_parameters() const = 0;
  // Training FLOPs per token (forward + backward), torchtitan's formula for the family.
  virtual double flops_per_token(int64_t seq_len) const = 0;
  virtual int64_t vocabulary() const = 0;      // tokens the embedding holds
  virtual int64_t context_length() const = 0;  // the longest sequence the position tables cover (max_seq_len)
  virtual int64_t layers() const = 0;          // transformer blocks
  // The attention mask the flavor is defined with ("causal" or "block_causal": torchtitan's flavors carry it), which
  // a job takes unless it sets model.attn_mask_type.
  virtual std::string attn_mask_type() const { return "causal"; }
  // The arguments as JSON ("family" included) for checkpoint metadata, and back for the same family.
  virtual nlohmann::json to_json() const = 0;
  virtual std::shared_ptr<const ModelArgs> parse_json(const nlohmann::json& j, const std::string& where) const = 0;
  // One line per field where this and `other` would compute differently ("rope_theta: 10000 vs 500000"); the
  // sequence-length cap is not one of them. Empty when they compute the same model.
  virtual std::vector<std::string> computation_differences(const ModelArgs& other) const = 0;
  // The same model with position tables for `max_seq_len` tokens.
  virtual std::shared_ptr<const ModelArgs> with_context_length(int64_t max_seq_len) const = 0;
};

}  // namespace titan::protocols
