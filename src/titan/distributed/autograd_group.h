// A Communicator carried through a torch::autograd::Function's arguments (and kept in its context for backward),
// for the differentiable collectives and the vocabulary-parallel loss.
#pragma once
#include <torch/custom_class.h>

#include <memory>

#include "titan/distributed/communicator.h"

namespace titan::distributed {

struct GroupHolder : torch::CustomClassHolder {
  explicit GroupHolder(std::shared_ptr<Communicator> g) : group(std::move(g)) {}
  std::shared_ptr<Communicator> group;
};

inline c10::intrusive_ptr<GroupHolder> hold(const std::shared_ptr<Communicator>& group) {
  return c10::make_intrusive<GroupHolder>(group);
}

}  // namespace titan::distributed
