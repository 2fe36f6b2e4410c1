#include "titan/distributed/sharded_parameter.h"

#include <map>
#include <set>

#include "titan/common/error.h"
#include "titan/common/strings.h"
#include "titan/nn/storage.h"

namespace titan::distributed {

at::Tensor unpadded(const at::Tensor& padded, const TensorLayout& layout) {
  const Box box = layout.local_box();
  at::Tensor out = padded;
  for (int64_t d = 0; d < out.dim() && d < static_cast<int64_t>(box.lengths.size()); ++d)
    if (out.size(d) != box.lengths[d]) out = out.narrow(d, 0, box.lengths[d]);
  return out;
}

at::Tensor ShardedParameter::piece() const { return unpadded(local, layout); }

std::vector<ShardedParameter> describe_parameters(torch::nn::Module& model) {
  std::vector<ShardedParameter> out;
  for (const auto& item : model.named_parameters())
    out.push_back({item.key(), item.value(), item.value(), TensorLayout(item.value().sizes().vec())});
  return out;
}

ShardedParameter* find_parameter(std::vector<ShardedParameter>& params, const at::Tensor& param) {
  for (auto& p : params)
    if (p.module_param.unsafeGetTensorImpl() == param.unsafeGetTensorImpl()) return &p;
  return nullptr;
}

std::vector<at::Tensor> local_tensors(const std::vector<ShardedParameter>& params) {
  std::vector<at::Tensor> out;
  out.reserve(params.size());
  for (const auto& p : params) out.push_back(p.local);
  return out;
}

void materialize(std::vector<ShardedParameter>& params) {
  for (auto& p : params) nn::allocate_storage(p.local);
}

void initialize(std::vector<ShardedParameter>& params, const std::map<std::string, nn::InitSpec>& specs, uint64_t seed) {
  at::NoGradGuard no_grad;
  for (auto& p : params) {
    auto it = specs.find(p.name);
    if (it == specs.end()) fail("no initialisation is defined for parameter ", p.name);
    if (!nn::has_storage(p.local)) fail("parameter ", p.name, " has no storage yet (materialize it before initialising)");
    at::Tensor local = p.local.detach();
    local.zero_();  // padding stays zero: FSDP's gathers and the gradient norm rely on it
    nn::fill_box(unpadded(local, p.layout), it->second, seed, p.name, p.layout.global_shape(), p.layout.local_box().offsets);
  }
}

std::vector<std::pair<std::string, at::Tensor>> gather_full(const std::vector<ShardedParameter>& params, Communicator& world,
                                                            at::ScalarType dtype) {
  at::NoGradGuard no_grad;
  // Ranks may hold different parameters (pipeline stages): agree on the union, in the order ranks list them.
  std::string mine;
  for (const auto& p : params) mine += p.name + "=" + join_ints(p.layout.global_shape()) + "\n";
  std::vector<std::pair<std::string, std::vector<int64_t>>> names;
  std::set<std::string> seen;
  for (const auto& text : world.size() > 1 ? all_gather_strings(world, mine) : std::vector<std::string>{mine})
    for (const auto& line : split(text, '\n')) {
      if (line.empty()) continue;
      const auto eq = line.rfind('=');
      std::string name = line.substr(0, eq);
      if (!seen.insert(name).second) continue;
      std::vector<int64_t> shape;
      for (const auto& d : split(line.substr(eq + 1), ',')) shape.push_back(std::stoll(trim(d)));
      names.emplace_back(std::move(name), std::move(shape));
    }
  std::map<std::string, const ShardedParameter*> local;
  for (const auto& p : params) local[p.name] = &p;
  const auto options = at::TensorOptions().dtype(dtype).device(world.tensor_device());
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& [name, shape] : names) {
    // Owners place their pieces (which do not overlap) into zeros; the sum over all ranks is the whole tensor.
    at::Tensor full = at::zeros(shape, options);
    auto it = local.find(name);
    if (it != local.end() && it->second->layout.owner()) {
      const ShardedParameter& p = *it->second;
      const Box box = p.layout.local_box();
      at::Tensor target = full;
      for (size_t d = 0; d < box.offsets.size(); ++d) target = target.narrow(static_cast<int64_t>(d), box.offsets[d], box.lengths[d]);
      target.copy_(p.piece().detach());
    }
    if (world.size() > 1) world.all_reduce(full, ReduceOp::Sum);
    out.emplace_back(name, full);
  }
  return out;
}

int64_t local_parameter_bytes(const std::vector<ShardedParameter>& params) {
  int64_t bytes = 0;
  for (const auto& p : params) bytes += p.local.numel() * p.local.element_size();
  return bytes;
}

}  // namespace titan::distributed
