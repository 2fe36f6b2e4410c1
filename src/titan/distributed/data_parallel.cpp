#include "titan/distributed/data_parallel.h"

#include "titan/common/error.h"
#include "titan/components/optimizer.h"
#include "titan/distributed/ddp.h"
#include "titan/distributed/fsdp.h"
#include "titan/models/llama3/model.h"

namespace titan::distributed {
namespace {

// One data-parallel rank: gradients are already final after backward.
class NoDataParallel final : public DataParallel {
 public:
  explicit NoDataParallel(std::vector<at::Tensor> params) : params_(std::move(params)) {}
  void before_backward(bool) override {}
  void finish_gradients() override {}
  std::vector<at::Tensor> optimizer_parameters() override { return params_; }
  at::Tensor clip_grad_norm(double max_norm) override { return clip_grad_norm_(params_, max_norm); }
  std::string describe() const override { return "no data parallelism (one rank)"; }
  std::vector<LocalShard> local_shards() override { return full_shards(params_, true); }
  int64_t bytes_communicated() const override { return 0; }
  double wait_seconds() const override { return 0; }

 private:
  std::vector<at::Tensor> params_;
};

}  // namespace

std::vector<LocalShard> full_shards(const std::vector<at::Tensor>& params, bool writer) {
  std::vector<LocalShard> out;
  for (const auto& p : params)
    out.push_back({p, p, p.sizes().vec(), 0, p.dim() == 0 ? 1 : p.size(0), writer});
  return out;
}

std::unique_ptr<DataParallel> apply_data_parallel(llama3::Transformer& model, const DeviceMesh& mesh,
                                                  const FsdpOptions& options) {
  const ParallelDims& dims = mesh.dims();
  if (dims.fsdp_enabled()) {
    if (model.args().tie_word_embeddings)
      fail("FSDP with tied embeddings (model.flavor 1B/3B) is not supported yet; train these flavors without "
           "data_parallel_shard_degree > 1");
    const std::string& policy = options.reshard_after_forward;
    const bool reshard = policy != "never";
    std::vector<FsdpUnitSpec> units;
    units.push_back({"tok_embeddings", {model.tok_embeddings.get()}, reshard});
    for (size_t i = 0; i < model.layers.size(); ++i)
      units.push_back({"layers." + std::to_string(i), {model.layers[i].get()}, reshard});
    // As torchtitan: norm + output are needed again right at the start of backward, so by default they stay gathered.
    units.push_back({"norm+output", {model.norm.get(), model.output.get()}, policy == "always"});
    return std::make_unique<Fsdp>(units, mesh.get("dp_shard"), mesh.get("dp_replicate"), options);
  }
  if (dims.ddp_enabled()) return std::make_unique<Ddp>(model.parameters(), mesh.get("dp_replicate"));
  return std::make_unique<NoDataParallel>(model.parameters());
}

}  // namespace titan::distributed
