#include "titan/distributed/context_parallel.h"

#include <torch/csrc/autograd/custom_function.h>
#include <torch/custom_class.h>

#include <algorithm>
#include <atomic>
#include <limits>
#include <map>
#include <utility>

#include "titan/common/clock.h"
#include "titan/common/error.h"
#include "titan/common/strings.h"
#include "titan/kernels/fused_ops.h"

#ifdef TITAN_WITH_CUDA
#include <ATen/ops/_scaled_dot_product_flash_attention.h>
#include <ATen/ops/_scaled_dot_product_flash_attention_backward.h>
#endif
#include <ATen/ops/_scaled_dot_product_flash_attention_for_cpu.h>
#include <ATen/ops/_scaled_dot_product_flash_attention_for_cpu_backward.h>

namespace titan::distributed {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// One (query block, key/value block) of attention with equal head counts: the output, the log-sum-exp of each
// query's scores (float32, (batch, heads, queries)) and, on CUDA, the random-number state the kernel's backward
// takes back. `causal`: the blocks cover the same positions.
struct BlockResult {
  at::Tensor out, lse;
  at::Tensor rng_state, rng_unused;  // CUDA flash attention's philox seed and offset outputs (undefined on the CPU)
};

// `mask`: undefined, or additive (0 or -inf, q's dtype, (batch, 1, queries, keys)) with the causal part in it.
BlockResult block_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal, const at::Tensor& mask) {
  if (q.is_cpu()) {
    auto [out, lse] = mask.defined() ? at::_scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, false, mask)
                                     : at::_scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal);
    return {out, lse, at::Tensor(), at::Tensor()};
  }
#ifdef TITAN_WITH_CUDA
  if (q.is_cuda()) {
    if (mask.defined())
      fail("block-causal attention (model.attn_mask_type = \"block_causal\") under context parallelism runs on CPUs only "
           "so far: LibTorch's CUDA flash-attention kernel takes no mask; use attn_mask_type = \"causal\" on CUDA");
    if (q.scalar_type() != at::kBFloat16 && q.scalar_type() != at::kHalf)
      fail("context parallelism on CUDA runs the flash-attention kernel, which takes bfloat16 or float16, but attention "
           "computes in ", c10::toString(q.scalar_type()), "; set training.mixed_precision_param = \"bfloat16\"");
    auto r = at::_scaled_dot_product_flash_attention(q, k, v, 0.0, causal);
    return {std::get<0>(r), std::get<1>(r), std::get<6>(r), std::get<7>(r)};
  }
#endif
  fail("context parallelism has no attention kernel for device ", q.device().str());
}

// The gradients of one block pair given the combined output and log-sum-exp of the query block: the softmax over
// every key block is exp(score - lse), so each pair's share of the gradients is what the kernel's backward computes.
// The kernels read the log-sum-exp as dense (batch, heads, queries): a chunk of it is made contiguous.
std::tuple<at::Tensor, at::Tensor, at::Tensor> block_backward(const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k,
                                                              const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse,
                                                              bool causal, const at::Tensor& mask, const BlockResult& forward) {
  const at::Tensor dense_lse = lse.contiguous();
  if (q.is_cpu()) {
    if (mask.defined()) return at::_scaled_dot_product_flash_attention_for_cpu_backward(grad_out, q, k, v, out, dense_lse, 0.0, false, mask);
    return at::_scaled_dot_product_flash_attention_for_cpu_backward(grad_out, q, k, v, out, dense_lse, 0.0, causal);
  }
#ifdef TITAN_WITH_CUDA
  if (q.is_cuda()) {
    // Undefined cumulative sequence lengths: defined ones (even empty) select the variable-length kernel.
    return at::_scaled_dot_product_flash_attention_backward(grad_out, q, k, v, out, dense_lse, at::Tensor(), at::Tensor(), q.size(2),
                                                            k.size(2), 0.0, causal, forward.rng_state, forward.rng_unused);
  }
#endif
  (void)forward;
  fail("context parallelism has no attention kernel for device ", q.device().str());
}

at::Tensor expand_heads(const at::Tensor& kv, int64_t rep) { return rep == 1 ? kv : kv.repeat_interleave(rep, 1); }

// Whether the diagonal pairs run through titan's fused CPU attention kernel (kernels/fused_ops.h): it skips the
// blocks the causal or block-causal mask hides, takes the key/value heads as they are (GQA) and, like LibTorch's,
// returns the log-sum-exp and takes the combined one back in backward.
bool fused_diagonal(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  return q.is_cpu() && k.sizes() == v.sizes() && q.size(3) == k.size(3) &&
         kernels::fused_kernel_applies(kernels::Op::attention, {q, k, v});
}

at::Tensor reduce_heads(const at::Tensor& g, int64_t rep) {
  if (rep == 1) return g;
  return g.view({g.size(0), g.size(1) / rep, rep, g.size(2), g.size(3)}).sum(2);
}

// The running result of one query chunk: output (float32) and log-sum-exp, combined block by block. Under
// block-causal masks a query may have no key yet (log-sum-exp -inf, output 0): it stays so until one comes.
struct Partial {
  at::Tensor out, lse;
  void add(const at::Tensor& o, const at::Tensor& l) {
    if (!out.defined()) {
      out = o.to(at::kFloat);
      lse = l;
      return;
    }
    at::Tensor merged = at::logaddexp(lse, l);
    const at::Tensor base = at::where(merged.isneginf(), at::zeros({}, merged.options()), merged);
    out = out * (lse - base).exp().unsqueeze(-1) + o.to(at::kFloat) * (l - base).exp().unsqueeze(-1);
    lse = merged;
  }
};

// Block-causal masks over the whole sequence's documents, chunk pair by chunk pair.
class ChunkDocuments {
 public:
  ChunkDocuments() = default;
  // `documents`: each position's document index over the whole sequence, (batch, seq_len), non-decreasing along it.
  ChunkDocuments(const at::Tensor& documents, int64_t chunk) : documents_(documents), chunk_(chunk) {
    const at::Tensor host = documents.to(at::kCPU, at::kLong).contiguous();
    const int64_t batch = host.size(0), chunks = host.size(1) / chunk;
    first_.assign(static_cast<size_t>(batch * chunks), 0);
    last_.assign(first_.size(), 0);
    const int64_t* d = host.data_ptr<int64_t>();
    for (int64_t b = 0; b < batch; ++b)
      for (int64_t c = 0; c < chunks; ++c) {
        first_[static_cast<size_t>(b * chunks + c)] = d[b * host.size(1) + c * chunk];
        last_[static_cast<size_t>(b * chunks + c)] = d[b * host.size(1) + (c + 1) * chunk - 1];
      }
    batch_ = batch;
    chunks_ = chunks;
  }
  bool defined() const { return documents_.defined(); }
  // The document index of every position of chunk `c`, int32 (batch, chunk).
  at::Tensor of_chunk(int64_t c) const { return documents_.narrow(1, c * chunk_, chunk_).to(at::kInt).contiguous(); }
  // Whether some query of chunk `q` sees some key of the earlier (or same) chunk `k`: documents only grow along the
  // sequence, so an earlier chunk shares a document with a later one exactly when its last is the other's first.
  bool any(int64_t q, int64_t k) const {
    if (q == k) return true;
    for (int64_t b = 0; b < batch_; ++b)
      if (last_[static_cast<size_t>(b * chunks_ + k)] == first_[static_cast<size_t>(b * chunks_ + q)]) return true;
    return false;
  }
  // The additive mask of queries of chunk `q` over keys of chunk `k` ((batch, 1, chunk, chunk), `dtype`), and which
  // queries see no key there ((batch, 1, chunk) bool).
  std::pair<at::Tensor, at::Tensor> mask(int64_t q, int64_t k, bool causal, at::ScalarType dtype) const {
    const at::Tensor dq = documents_.narrow(1, q * chunk_, chunk_), dk = documents_.narrow(1, k * chunk_, chunk_);
    at::Tensor allowed = dq.unsqueeze(2).eq(dk.unsqueeze(1));
    if (causal) allowed = allowed.logical_and(at::ones({chunk_, chunk_}, allowed.options()).tril());
    at::Tensor additive = at::zeros(allowed.sizes(), documents_.options().dtype(dtype))
                              .masked_fill_(allowed.logical_not(), -std::numeric_limits<double>::infinity());
    return {additive.unsqueeze(1), allowed.any(2).logical_not().unsqueeze(1)};
  }

 private:
  at::Tensor documents_;
  int64_t chunk_ = 0, batch_ = 0, chunks_ = 0;
  std::vector<int64_t> first_, last_;
};

struct CpHolder : torch::CustomClassHolder {
  CpHolder(const ContextParallel& c, ChunkDocuments d) : cp(c), documents(std::move(d)) {}
  ContextParallel cp;
  ChunkDocuments documents;  // block-causal attention's documents, or undefined (causal)
  // Per (key source rank, query chunk, key chunk): what the forward kernel returned for its backward (CUDA).
  std::map<std::tuple<int, int64_t, int64_t>, BlockResult> forward_states;
};

CpHolder& holder_of(AutogradContext* ctx) { return *c10::static_intrusive_pointer_cast<CpHolder>(ctx->saved_data["cp"].toCapsule()); }

// The key/value blocks of one rank, (2, batch, kv_heads, local, head_dim), stacked so one message carries both.
at::Tensor chunk_of(const at::Tensor& x, int64_t index, int64_t len) { return x.narrow(2, index * len, len); }

// Every (query chunk, key chunk) pair this rank computes when it holds the keys of `source`'s chunks, with
// whether the pair is the diagonal (causal) one. Under block-causal masks, pairs with no document in common are
// left out.
struct Pair {
  int64_t q_index, k_index;  // local chunk indices: into this rank's queries, into the source's keys
  int64_t q_chunk, k_chunk;  // the same chunks' indices in the whole sequence
  bool causal;
};
std::vector<Pair> pairs_with(const ContextParallel& cp, int source, int64_t seq_len, const ChunkDocuments& documents) {
  std::vector<Pair> out;
  const auto mine = cp.chunks_of(cp.rank(), seq_len), theirs = cp.chunks_of(source, seq_len);
  for (size_t x = 0; x < mine.size(); ++x)
    for (size_t y = 0; y < theirs.size(); ++y)
      if (theirs[y] <= mine[x] && (!documents.defined() || documents.any(mine[x], theirs[y])))
        out.push_back({static_cast<int64_t>(x), static_cast<int64_t>(y), mine[x], theirs[y], theirs[y] == mine[x]});
  return out;
}

// Seconds this process spent blocked in context-parallel communication (all-gathers, reduce-scatters, waiting for
// the ring's next block).
std::atomic<double> g_wait_seconds{0};

template <typename Fn>
auto timed(Fn&& fn) {
  const double start = now_seconds();
  auto result = fn();
  double seen = g_wait_seconds.load();
  while (!g_wait_seconds.compare_exchange_weak(seen, seen + now_seconds() - start)) {
  }
  return result;
}

// The rank whose keys this rank holds at step t of the ring (keys move to the next rank each step).
int ring_source(const ContextParallel& cp, int t) { return ((cp.rank() - t) % cp.degree() + cp.degree()) % cp.degree(); }

class CpAttention : public torch::autograd::Function<CpAttention> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
                            c10::intrusive_ptr<CpHolder> holder) {
    const ContextParallel& cp = holder->cp;
    const at::Tensor q = q_in.contiguous();
    const at::Tensor kv = at::stack({k_in, v_in}).contiguous();
    const int64_t rep = q.size(1) / k_in.size(1);
    const int64_t seq_len = q.size(2) * cp.degree();
    const int64_t chunk = seq_len / cp.chunks(seq_len);
    std::vector<Partial> partial(cp.chunks_of(cp.rank(), seq_len).size());
    const bool fused = fused_diagonal(q, k_in, v_in);
    auto compute = [&](const at::Tensor& block, int source) {
      for (const auto& p : pairs_with(cp, source, seq_len, holder->documents)) {
        if (p.causal && fused) {
          auto [o, l] = kernels::attention_outputs(chunk_of(q, p.q_index, chunk), chunk_of(block[0], p.k_index, chunk),
                                                   chunk_of(block[1], p.k_index, chunk),
                                                   holder->documents.defined() ? holder->documents.of_chunk(p.q_chunk) : at::Tensor());
          partial[static_cast<size_t>(p.q_index)].add(o, l);
          continue;
        }
        const at::Tensor k = expand_heads(chunk_of(block[0], p.k_index, chunk), rep);
        const at::Tensor v = expand_heads(chunk_of(block[1], p.k_index, chunk), rep);
        at::Tensor mask, unseen;
        if (holder->documents.defined()) std::tie(mask, unseen) = holder->documents.mask(p.q_chunk, p.k_chunk, p.causal, q.scalar_type());
        BlockResult r = block_forward(chunk_of(q, p.q_index, chunk), k, v, p.causal, mask);
        // The kernel gives a query that sees no key here a log-sum-exp of 0; it is -inf, so nothing of it is added.
        if (unseen.defined() && !p.causal) r.lse = r.lse.masked_fill(unseen, -std::numeric_limits<double>::infinity());
        partial[static_cast<size_t>(p.q_index)].add(r.out, r.lse);
        if (r.rng_state.defined() || r.rng_unused.defined())
          holder->forward_states[{source, p.q_index, p.k_index}] = {at::Tensor(), at::Tensor(), r.rng_state, r.rng_unused};
      }
    };
    for_each_block(cp, kv, compute);
    std::vector<at::Tensor> outs, lses;
    for (auto& p : partial) {
      outs.push_back(p.out.to(q.scalar_type()));
      lses.push_back(p.lse);
    }
    at::Tensor out = at::cat(outs, 2), lse = at::cat(lses, 2);
    ctx->save_for_backward({q, k_in, v_in, out, lse});
    ctx->saved_data["cp"] = c10::IValue::make_capsule(holder);
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    CpHolder& holder = holder_of(ctx);
    const ContextParallel& cp = holder.cp;
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &q = saved[0], &k_in = saved[1], &v_in = saved[2], &out = saved[3], &lse = saved[4];
    const at::Tensor grad_out = grads[0].contiguous();
    const int64_t rep = q.size(1) / k_in.size(1);
    const int64_t seq_len = q.size(2) * cp.degree();
    const int64_t chunk = seq_len / cp.chunks(seq_len);
    at::Tensor dq = at::zeros(q.sizes(), q.options().dtype(at::kFloat));
    const at::Tensor kv = at::stack({k_in, v_in}).contiguous();
    // Gradients of a block's keys and values, (2, batch, kv_heads, local, head_dim) in float32.
    const bool fused = fused_diagonal(q, k_in, v_in);
    auto block_grads = [&](const at::Tensor& block, int source) {
      at::Tensor d = at::zeros(block.sizes(), block.options().dtype(at::kFloat));
      for (const auto& p : pairs_with(cp, source, seq_len, holder.documents)) {
        if (p.causal && fused) {
          auto [gq, gk, gv] = kernels::attention_gradients(
              chunk_of(grad_out, p.q_index, chunk), chunk_of(q, p.q_index, chunk), chunk_of(block[0], p.k_index, chunk),
              chunk_of(block[1], p.k_index, chunk), holder.documents.defined() ? holder.documents.of_chunk(p.q_chunk) : at::Tensor(),
              chunk_of(out, p.q_index, chunk), chunk_of(lse, p.q_index, chunk));
          chunk_of(dq, p.q_index, chunk).add_(gq);
          chunk_of(d[0], p.k_index, chunk).add_(gk);
          chunk_of(d[1], p.k_index, chunk).add_(gv);
          continue;
        }
        const at::Tensor k = expand_heads(chunk_of(block[0], p.k_index, chunk), rep);
        const at::Tensor v = expand_heads(chunk_of(block[1], p.k_index, chunk), rep);
        const auto state = holder.forward_states.find({source, p.q_index, p.k_index});
        const at::Tensor mask = holder.documents.defined() ? holder.documents.mask(p.q_chunk, p.k_chunk, p.causal, q.scalar_type()).first : at::Tensor();
        auto [gq, gk, gv] = block_backward(chunk_of(grad_out, p.q_index, chunk), chunk_of(q, p.q_index, chunk), k, v,
                                           chunk_of(out, p.q_index, chunk), chunk_of(lse, p.q_index, chunk), p.causal, mask,
                                           state == holder.forward_states.end() ? BlockResult{} : state->second);
        chunk_of(dq, p.q_index, chunk).add_(gq);
        chunk_of(d[0], p.k_index, chunk).add_(reduce_heads(gk, rep));
        chunk_of(d[1], p.k_index, chunk).add_(reduce_heads(gv, rep));
      }
      return d;
    };
    at::Tensor dkv;
    auto& group = *cp.group();
    const int n = cp.degree();
    if (cp.rotate() == CpRotateMethod::AllGather) {
      std::vector<at::Tensor> parts(static_cast<size_t>(n));
      for_each_block(cp, kv, [&](const at::Tensor& block, int source) {
        parts[static_cast<size_t>(source)] = block_grads(block, source);
      });
      at::Tensor stacked = at::stack(parts).contiguous();
      dkv = at::empty(kv.sizes(), stacked.options());
      timed([&] { return group.reduce_scatter(dkv, stacked.view(-1), ReduceOp::Sum); });
    } else {
      // The keys go around the ring again, each block's gradient accumulator travelling with it; after n shifts the
      // accumulator is back on the block's own rank.
      const int next = (cp.rank() + 1) % n, prev = (cp.rank() + n - 1) % n;
      at::Tensor acc;
      for_each_block(cp, kv, [&](const at::Tensor& block, int source) {
        at::Tensor d = block_grads(block, source);
        if (acc.defined()) d.add_(acc);
        acc = at::empty_like(d);
        timed([&] { return group.send_recv(d, next, acc, prev); });
      });
      dkv = acc;
    }
    return {dq.to(q.scalar_type()), dkv[0].to(k_in.scalar_type()), dkv[1].to(v_in.scalar_type()), at::Tensor()};
  }

 private:
  // Calls fn(block, source rank) for every rank's key/value block: all at once after one all-gather, or one at a
  // time as they pass around the ring (the next exchange overlapping this block's compute).
  template <typename Fn>
  static void for_each_block(const ContextParallel& cp, const at::Tensor& kv, Fn&& fn) {
    auto& group = *cp.group();
    const int n = cp.degree();
    if (cp.rotate() == CpRotateMethod::AllGather) {
      at::Tensor all = at::empty({n * kv.numel()}, kv.options());
      timed([&] { return group.all_gather_into(all, kv.view(-1)); });
      for (int j = 0; j < n; ++j) fn(all.narrow(0, j * kv.numel(), kv.numel()).view(kv.sizes()), j);
      return;
    }
    const int next = (cp.rank() + 1) % n, prev = (cp.rank() + n - 1) % n;
    at::Tensor block = kv;
    for (int t = 0; t < n; ++t) {
      at::Tensor incoming;
      std::shared_ptr<Work> moving;
      if (t + 1 < n) {
        incoming = at::empty_like(block);
        moving = group.send_recv(block, next, incoming, prev, /*async=*/true);
      }
      fn(block, ring_source(cp, t));
      if (moving) {
        timed([&] {
          moving->wait();
          return 0;
        });
        block = incoming;
      }
    }
  }
};

}  // namespace

ContextParallel::ContextParallel(std::shared_ptr<Communicator> group, CpLoadBalancer balancer, CpRotateMethod rotate)
    : group_(std::move(group)), balancer_(balancer), rotate_(rotate) {
  cp_ = group_->size();
  rank_ = group_->rank();
}

std::string ContextParallel::describe() const {
  std::string balancing;
  switch (balancer_) {
    case CpLoadBalancer::HeadTail: balancing = cat("headtail load balancing (2 x ", cp_, " chunks, rank r holds r and ", 2 * cp_ - 1, " - r)"); break;
    case CpLoadBalancer::Ptrr: balancing = cat("ptrr load balancing (blocks of ", kPtrrBlock, " tokens dealt by causal work)"); break;
    case CpLoadBalancer::None: balancing = cat("no load balancing (rank r holds chunk r of ", cp_, ")"); break;
  }
  return cat("context parallelism over ", cp_, " ranks: ", balancing, ", keys/values ",
             rotate_ == CpRotateMethod::AllGather ? "all-gathered" : "passed around the ring");
}

int64_t ContextParallel::sequence_multiple(CpLoadBalancer balancer, int64_t cp) {
  switch (balancer) {
    case CpLoadBalancer::HeadTail: return 2 * cp;
    case CpLoadBalancer::Ptrr: return kPtrrBlock * cp;
    case CpLoadBalancer::None: break;
  }
  return cp;
}

int64_t ContextParallel::chunks(int64_t seq_len) const {
  switch (balancer_) {
    case CpLoadBalancer::HeadTail: return 2 * cp_;
    case CpLoadBalancer::Ptrr: return seq_len / kPtrrBlock;
    case CpLoadBalancer::None: break;
  }
  return cp_;
}

std::vector<int64_t> ContextParallel::chunks_of(int rank, int64_t seq_len) const {
  if (balancer_ == CpLoadBalancer::HeadTail) return {rank, 2 * cp_ - 1 - rank};
  if (balancer_ == CpLoadBalancer::None) return {rank};
  // ptrr: block i does i + 1 blocks of causal work. Heaviest first, the blocks are dealt in rows of cp, every other
  // row in reverse, so each rank's total is even; each rank keeps its blocks in sequence order.
  const int64_t n = chunks(seq_len);
  std::vector<int64_t> out;
  for (int64_t row = 0; row * cp_ < n; ++row) {
    const int64_t column = row % 2 == 0 ? rank : cp_ - 1 - rank;
    out.push_back(n - 1 - (row * cp_ + column));
  }
  std::sort(out.begin(), out.end());
  return out;
}

void ContextParallel::check_seq_len(CpLoadBalancer balancer, int64_t cp, int64_t seq_len, const std::string& key) {
  const int64_t multiple = sequence_multiple(balancer, cp);
  if (seq_len % multiple == 0) return;
  std::string how;
  switch (balancer) {
    case CpLoadBalancer::HeadTail: how = cat(" into ", multiple, " equal chunks for context_parallel_degree = ", cp, " with headtail load balancing (2 x degree chunks)"); break;
    case CpLoadBalancer::Ptrr: how = cat(" into blocks of ", kPtrrBlock, " tokens dealt evenly over context_parallel_degree = ", cp, " (ptrr load balancing)"); break;
    case CpLoadBalancer::None: how = cat(" into ", multiple, " equal chunks for context_parallel_degree = ", cp); break;
  }
  fail(key, " = ", seq_len, " does not cut", how, "; titan does not pad sequences: use a multiple of ", multiple);
}

at::Tensor ContextParallel::shard(const at::Tensor& x, int64_t dim) const {
  const int64_t len = x.size(dim);
  check_seq_len(len, "the sequence length");
  const int64_t chunk = len / chunks(len);
  std::vector<at::Tensor> parts;
  for (int64_t c : chunks_of(rank_, len)) parts.push_back(x.narrow(dim, c * chunk, chunk));
  return parts.size() == 1 ? parts[0].contiguous() : at::cat(parts, dim);
}

at::Tensor ContextParallel::positions(int64_t seq_len, const at::Device& device) const {
  return shard(at::arange(seq_len, at::TensorOptions().dtype(at::kLong)), 0).unsqueeze(0).to(device);
}

at::Tensor ContextParallel::attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& documents) const {
  if (q.size(1) % k.size(1) != 0) fail("context parallelism: ", q.size(1), " query heads do not group over ", k.size(1), " key/value heads");
  const int64_t seq_len = q.size(2) * cp_;
  if (seq_len % sequence_multiple(balancer_, cp_) != 0)
    fail("internal: context-parallel attention got ", q.size(2), " local positions, which do not make whole chunks");
  ChunkDocuments chunk_documents;
  if (documents.defined()) {
    if (documents.dim() != 2 || documents.size(0) != q.size(0) || documents.size(1) != seq_len)
      fail("internal: context-parallel attention got documents of shape ", documents.sizes(), " for ", q.size(0),
           " sequences of ", seq_len, " positions");
    chunk_documents = ChunkDocuments(documents, seq_len / chunks(seq_len));
  }
  return CpAttention::apply(q, k, v, c10::make_intrusive<CpHolder>(*this, std::move(chunk_documents)));
}

double ContextParallel::wait_seconds() { return g_wait_seconds.load(); }

CpLoadBalancer parse_cp_load_balancer(const std::optional<std::string>& value) {
  if (!value || *value == "None" || *value == "none") return CpLoadBalancer::None;
  if (*value == "headtail") return CpLoadBalancer::HeadTail;
  if (*value == "ptrr") return CpLoadBalancer::Ptrr;
  fail("parallelism.context_parallel_load_balancer = ", quote(*value), ": expected headtail, ptrr or None");
}

CpRotateMethod parse_cp_rotate_method(const std::string& value) {
  if (value == "allgather") return CpRotateMethod::AllGather;
  if (value == "alltoall") return CpRotateMethod::AllToAll;
  fail("parallelism.context_parallel_rotate_method = ", quote(value), ": expected allgather or alltoall");
}

}  // namespace titan::distributed
