#include "titan/distributed/model_part.h"

#include "titan/distributed/tensor_parallel.h"

namespace titan::distributed {

void ModelPart::finish_gradients() {
  data_parallel->finish_gradients();
  if (tp_group) reduce_replicated_gradients(parameters, *tp_group, "tp");
}

}  // namespace titan::distributed
