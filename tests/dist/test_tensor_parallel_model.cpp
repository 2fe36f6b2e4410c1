// The Llama 3 TP plan applied directly (models::parallelize over a real TP mesh) to a small model with tied
// embeddings, built without storage and initialised piece by piece: loss and every gradient equal one process's
// autograd on the whole model.
#include <gtest/gtest.h>

#include "titan/nn/loss.h"
#include "titan/config/job_config.h"
#include "titan/distributed/communicator.h"
#include "titan/distributed/parallel_dims.h"
#include "titan/models/common/decoder_parallelize.h"
#include "titan/models/llama3/args.h"

using namespace titan;

TEST(TensorParallelModel, TiedEmbeddingsMatchOneProcess) {
  auto world = distributed::world(distributed::detect_launch());
  const int n = world->size();
  if (16 % n != 0) GTEST_SKIP() << "needs a rank count dividing 16";
  models::DecoderArgs args = llama3::flavor("debugmodel_gqa");
  args.n_layers = 2;
  args.max_seq_len = 16;
  args.tie_word_embeddings = true;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(9);
  at::Tensor tokens = at::randint(0, args.vocab_size, {2, 17}, gen, at::kLong);
  at::Tensor inputs = tokens.narrow(1, 0, 16).contiguous(), labels = tokens.narrow(1, 1, 16).contiguous();

  models::Decoder whole(args);
  whole.init_weights(3);
  at::Tensor reference = cross_entropy_sum(whole.forward(inputs), labels);
  reference.backward();

  config::JobConfig c;
  c.parallelism.tensor_parallel_degree = n;
  c.parallelism.data_parallel_shard_degree = 1;
  c.training.seq_len = 16;
  c.activation_checkpoint.mode = "none";
  distributed::DeviceMesh mesh(distributed::ParallelDims::from_config(c.parallelism, n), world);
  models::Decoder model(args, nn::ParameterOptions{at::TensorOptions(), /*allocate=*/false});
  auto parallel = models::parallelize(model, mesh, c, distributed::FsdpOptions{}, distributed::ModuleRange::whole(model));
  ASSERT_EQ(parallel.parameters.size(), whole.named_parameters().size());  // the tied table is one parameter
  distributed::initialize(parallel.parameters, model.init_specs(), 3);
  at::Tensor loss = parallel.loss(model.forward(inputs), labels);
  loss.backward();
  parallel.finish_gradients();
  EXPECT_NEAR(loss.item<double>(), reference.item<double>(), 1e-5 * reference.item<double>());

  // Gradients gathered like the weights: the same placements, the gradients as local tensors.
  std::vector<distributed::ShardedParameter> grads = parallel.parameters;
  for (auto& g : grads) g.local = g.local.grad();
  auto full = distributed::gather_full(grads, *world);
  auto expected = whole.named_parameters();
  for (const auto& [name, grad] : full) {
    const at::Tensor& ref = expected[name].grad();
    // Float32 sums in another order: compare the difference with the gradient's own size.
    const double relative = ((grad - ref).norm() / ref.norm()).item<double>();
    EXPECT_LT(relative, 2e-6) << name << ": max difference " << (grad - ref).abs().max().item<double>() << ", relative " << relative;
  }
}
