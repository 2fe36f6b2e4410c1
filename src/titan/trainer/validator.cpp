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
  for (const auto& source : sources_)
    log::info("Validation dataset ", quote(source.name), ": ", source.shards.size(), " file(s) (", source.shards.size() > 1 ? "first " : "",
              source.shards.front().path, "), every ", v.freq, " steps, ", v.steps < 0 ? std::string("one full pass") : cat(v.steps, " batches"));
}

ValidationResult Validator::run(StepSchedule& schedule) const {
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
  auto sources = sources_;
  for (auto& s : sources) s.loop = v.steps >= 0;  // steps = -1: one pass over the data
  data::DataLoader loader(std::move(sources), &tokenizer_, o);
  auto dp = mesh_.get("dp");
  ValidationResult out;
  double loss_sum = 0;
  while (v.steps < 0 || out.batches < v.steps) {
    data::Batch batch;
    bool have = true;
    try {
      batch = loader.next();
    } catch (const data::DataExhausted&) {
      have = false;
    }
    if (dp->size() > 1) {
      // Lanes end at different batches: every rank stops when one has nothing left.
      at::Tensor flag = at::full({1}, static_cast<int64_t>(have), at::kLong).to(device_);
      dp->all_reduce(flag, distributed::ReduceOp::Min);
      have = flag.cpu().item<int64_t>() != 0;
    }
    if (!have) break;
    at::Tensor valid = at::full({1}, count_valid_tokens(batch.labels), at::kLong).to(device_);
    dp->all_reduce(valid, distributed::ReduceOp::Sum);
    const double sum = schedule.evaluate(batch);
    // torchtitan's formula: the mean over batches of (this batch's loss sum / its global valid tokens).
    loss_sum += sum / static_cast<double>(std::max<int64_t>(1, valid.cpu().item<int64_t>()));
    out.tokens += batch.labels.numel();
    ++out.batches;
  }
  // Units FSDP keeps gathered after forward wait for a backward that never comes.
  for (auto& part : schedule.parts()) part.data_parallel->reshard_all();
  if (out.batches == 0)
    fail("validation: the validation data has no complete batch of ", v.local_batch_size, " x ", v.seq_len, " tokens");
  at::Tensor total = at::full({1}, loss_sum / static_cast<double>(out.batches), at::TensorOptions().dtype(at::kDouble)).to(device_);
  dp->all_reduce(total, distributed::ReduceOp::Sum);
  out.loss = total.cpu().item<double>();
  out.seconds = now_seconds() - start;
  return out;
}

}  // namespace titan
