#include "titan/protocols/model_args.h"

namespace titan::protocols {

int64_t ParameterShape::numel() const {
  int64_t n = 1;
  for (auto d : shape) n *= d;
  return n;
}

int64_t ModelArgs::stored_parameters() const {
  int64_t n = 0;
  for (const auto& p : parameter_shapes()) n += p.numel();
  return n;
}

}  // namespace titan::protocols
