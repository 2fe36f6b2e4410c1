#include "titan/trainer/validator.h"

#include <algorithm>

#include "titan/common/clock.h"
#include "titan/common/error.h"
#include "titan/common/logging.h"
#include "titan/common/strings.h"
#include "titan/nn/loss.h"

namespace titan {

Validator::Validator(const config::JobConfig& config, const tokenizer::Tokenizer& tokenizer, const distributed::DeviceMesh& mesh,
                     const at::Device& device)
    : config_(config), tokenizer_(tokenizer), mesh_(mesh), device_(device) {
  const auto& v = config.validation;
  sources_ = data::resolve_sources(v.dataset, v.dataset_path, v.dataset_format, "text", "validation");
  // A full pass deals the set to the lanes once: lanes that share one whole-file document would validate the same
  // windows or none. Checked at start-up, not at the first validation. (A fixed number of batches loops over the
  // data, where repeated windows change nothing.)
  const int64_t dp = mesh.dims().dp_degree();
  if (v.steps < 0) data::check_documents_per_lane(sources_, config.training.data_lanes > 0 ? config.training.data_lanes : dp, "validation");
  for (const auto& source : sources_)
    log::info("Validation dataset ", quote(source.name), ": ", source.shards.size(), " file(s) (", source.shards.size() > 1 ? "first " : "",
              source.shards.front().path, "), every ", v.freq, " steps, ", v.steps < 0 ? std::string("one full pass") : cat(v.steps, " batches"));
}

ValidationResult Validator::run(StepSchedule& schedule, const std::function<int()>& stop) const {
  const auto& v = config_.validation;
  const double start = now_seconds();
  // A fresh loader every time: the same batches each validation, in file order, without shuffling.
  data::LoaderOptions o;
  o.seq_len = v.seq_len;
  o.batch_size = v.local_batch_size;
  o.dp_rank = mesh_.dp_rank();
  o.dp_degree = mesh_.dims().dp_degree();
  o.lanes = config_.training.data_lanes;  // a fixed lane count gives the same validation set on any number of ranks
  o.positions = config_.model.attn_mask_type == "block_causal";
  o.name = "validation";
  o.check_documents_per_lane = false;  // the constructor checked a full pass
  const bool full_pass = v.steps < 0;
  o.drain = full_pass;
  auto sources = sources_;
  for (auto& s : sources) s.loop = !full_pass;  // steps = -1: one pass over the data
  data::DataLoader loader(std::move(sources), &tokenizer_, o);
  auto dp = mesh_.get("dp");
  ValidationResult out;
  double loss_sum = 0, valid_sum = 0;
  while (full_pass || out.batches < v.steps) {
    if (stop) {
      if (const int signal = stop()) {
        out.interrupted = signal;
        break;
      }
    }
    data::Batch batch;
    bool have = true;
    try {
      batch = loader.next();
    } catch (const data::DataExhausted&) {
      have = false;
    }
    if (dp->size() > 1) {
      // A full pass goes on while any rank has windows left (the others evaluate batches of padding, which add no
      // loss and no tokens), so that every window of every lane is validated once on any number of ranks.
      at::Tensor flag = at::full({1}, static_cast<int64_t>(have), at::kLong).to(device_);
      dp->all_reduce(flag, full_pass ? distributed::ReduceOp::Max : distributed::ReduceOp::Min);
      if (flag.cpu().item<int64_t>() == 0) break;
      if (!have) {
        batch.inputs = at::zeros({v.local_batch_size, v.seq_len}, at::kLong);
        batch.labels = at::full({v.local_batch_size, v.seq_len}, kIgnoreIndex, at::kLong);
        if (o.positions) batch.positions = at::zeros({v.local_batch_size, v.seq_len}, at::kLong);
      }
    } else if (!have) {
      break;
    }
    const int64_t local_valid = count_valid_tokens(batch.labels);
    at::Tensor valid = at::full({1}, local_valid, at::kLong).to(device_);
    dp->all_reduce(valid, distributed::ReduceOp::Sum);
    const double global_valid = static_cast<double>(valid.cpu().item<int64_t>());
    const double sum = schedule.evaluate(batch);
    if (full_pass) {
      // The pass's loss: every validated token's cross-entropy over their number, whatever the batching.
      loss_sum += sum;
      valid_sum = valid_sum + global_valid;
    } else {
      // torchtitan's formula: the mean over batches of (this batch's loss sum / its global valid tokens).
      loss_sum += sum / std::max(1.0, global_valid);
    }
    out.tokens += local_valid;
    ++out.batches;
  }
  // Units FSDP keeps gathered after forward wait for a backward that never comes.
  for (auto& part : schedule.parts()) part.data_parallel->reshard_all();
  if (out.interrupted) return out;
  if (out.batches == 0)
    fail("validation: the validation data has no complete batch of ", v.local_batch_size, " x ", v.seq_len, " tokens",
         dp->size() > 1 ? cat(" on any of the ", dp->size(), " data-parallel ranks") : std::string());
  const double share = full_pass ? loss_sum / std::max(1.0, valid_sum) : loss_sum / static_cast<double>(out.batches);
  at::Tensor total = at::full({1}, share, at::TensorOptions().dtype(at::kDouble)).to(device_);
  dp->all_reduce(total, distributed::ReduceOp::Sum);
  out.loss = total.cpu().item<double>();
  out.seconds = now_seconds() - start;
  return out;
}

}  // namespace titan
