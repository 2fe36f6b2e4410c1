#include "titan/distributed/activation_checkpoint.h"

#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>

#include "titan/common/error.h"
#include "titan/nn/autocast.h"
#include "titan/nn/float8.h"
#include "titan/nn/kept_ops.h"

namespace titan::distributed {
namespace {

struct Closure : torch::CustomClassHolder {
  nn::Unit::Next next;
  nn::Context context;
  std::vector<at::Tensor> parameters;
  nn::AutocastState autocast;
  std::shared_ptr<nn::KeptOps> kept;  // op-level selective checkpointing: what the forward kept
};

struct CheckpointFunction : torch::autograd::Function<CheckpointFunction> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, at::TensorList inputs, at::TensorList parameters,
                            c10::intrusive_ptr<Closure> closure) {
    at::Tensor output;
    {
      at::NoGradGuard no_grad;
      if (closure->kept) closure->context.kept_ops = closure->kept;
      output = closure->next(inputs.vec(), closure->context);
    }
    if (closure->kept) nn::KeptOps::notify(closure->kept->kept());
    ctx->save_for_backward(inputs.vec());
    ctx->saved_data["closure"] = c10::IValue::make_capsule(closure);
    ctx->saved_data["num_parameters"] = static_cast<int64_t>(parameters.size());
    return output;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs) {
    auto closure = c10::static_intrusive_pointer_cast<Closure>(ctx->saved_data["closure"].toCapsule());
    auto saved = ctx->get_saved_variables();
    std::vector<at::Tensor> inputs;
    for (const auto& t : saved) inputs.push_back(t.detach().requires_grad_(t.requires_grad()));

    at::Tensor output;
    {
      at::AutoGradMode grad_mode(true);
      nn::AutocastRegion region(closure->autocast);
      if (closure->kept) closure->kept->start_recomputation();
      output = closure->next(inputs, closure->context);
    }

    std::vector<at::Tensor> wrt;
    std::vector<int64_t> slot;  // position in the returned gradient list
    for (size_t i = 0; i < inputs.size(); ++i)
      if (inputs[i].requires_grad()) wrt.push_back(inputs[i]), slot.push_back(static_cast<int64_t>(i));
    for (size_t i = 0; i < closure->parameters.size(); ++i)
      if (closure->parameters[i].requires_grad())
        wrt.push_back(closure->parameters[i]), slot.push_back(static_cast<int64_t>(inputs.size() + i));

    torch::autograd::variable_list result(inputs.size() + closure->parameters.size() + 1);
    if (!wrt.empty() && output.requires_grad()) {
      auto grads = torch::autograd::grad({output}, wrt, {grad_outputs[0]}, /*retain_graph=*/false,
                                         /*create_graph=*/false, /*allow_unused=*/true);
      for (size_t j = 0; j < grads.size(); ++j) result[slot[j]] = grads[j];
    }
    if (closure->kept) closure->kept->release();
    return result;
  }
};

}  // namespace

at::Tensor checkpointed_call(const nn::Unit::Inputs& inputs, const nn::Context& context, const nn::Unit::Next& next,
                             const std::vector<at::Tensor>& parameters, const std::vector<at::Tensor>* cast_ahead,
                             Recompute recompute) {
  if (!at::GradMode::is_enabled()) return next(inputs, context);
  nn::cast_weights_ahead(cast_ahead ? *cast_ahead : parameters);  // the forward below runs without gradients
  auto closure = c10::make_intrusive<Closure>();
  closure->next = next;
  closure->context = context;
  closure->parameters = parameters;
  closure->autocast = nn::AutocastState::current();
  if (recompute == Recompute::all_but_kept_ops) closure->kept = std::make_shared<nn::KeptOps>();
  return CheckpointFunction::apply(at::TensorList(inputs), at::TensorList(parameters), closure);
}

void checkpoint_unit(nn::Unit& unit, Recompute recompute) {
  // Recomputation must run inside FSDP's gather/reshard wrappers, never around them.
  if (unit.has_wrapper("fsdp_unshard") || unit.has_wrapper("fsdp_reshard"))
    fail("activation checkpointing must be applied before FSDP (torchtitan's order: TP, CP, AC, FSDP)");
  nn::Unit* self = &unit;
  unit.add_wrapper("activation_checkpoint", [self, recompute](const nn::Unit::Inputs& inputs, const nn::Context& context,
                                                   const nn::Unit::Next& next) {
    // Float8 linears cast their weights to float8 from the float32 masters: a bf16 copy of those would go unused.
    std::vector<at::Tensor> cast_ahead;
    for (const auto& module : self->modules()) {
      const auto* unit = dynamic_cast<const nn::Unit*>(module.get());
      if (unit && unit->has_wrapper(nn::float8::kWrapperName)) continue;
      for (const auto& p : module->parameters(/*recurse=*/false)) cast_ahead.push_back(p);
    }
    return checkpointed_call(inputs, context, next, self->parameters(), &cast_ahead, recompute);
  });
}

}  // namespace titan::distributed
