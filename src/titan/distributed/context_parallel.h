// Context parallelism: each sequence is split over the ranks of the "cp" group, and causal (or block-causal)
// attention of the local queries runs over the whole sequence's keys and values, exchanged between the CP ranks.
//
// The sequence is cut into chunks. Without load balancing ("None") rank r holds chunk r of cp; with "headtail"
// the sequence is cut into 2 cp chunks and rank r holds chunks r and 2 cp - 1 - r; with "ptrr" (processing-time
// round-robin) it is cut into blocks of 128 tokens, ordered by their causal work (block i attends to i + 1
// blocks), heaviest first, and dealt to the ranks in rows of cp, every other row in reverse. Either balancer gives
// every rank the same share of causal attention work. Attention runs chunk pair by chunk pair: a query chunk sees
// earlier key chunks whole, its own chunk causally, and later ones not at all. The partial results of one query
// chunk are combined by their log-sum-exp (online softmax); the backward of each pair is the kernel's own backward
// given the combined output and log-sum-exp, which is exact. Block-causal masks apply per pair from every position's
// document (known on every rank), and pairs that share no document are skipped.
//
// Keys and values are exchanged either by one all-gather (rotate method "allgather": every rank holds all of them
// during attention) or passed around the ring of CP ranks, one block at a time, with their gradients travelling
// the same way in backward ("alltoall"; torchtitan's name): less memory, cp - 1 exchanges overlapping compute.
#pragma once

#include <ATen/ATen.h>

#include <memory>
#include <string>
#include <vector>

#include "titan/distributed/communicator.h"

namespace titan::distributed {

enum class CpLoadBalancer { None, HeadTail, Ptrr };
enum class CpRotateMethod { AllGather, AllToAll };

class ContextParallel {
 public:
  ContextParallel(std::shared_ptr<Communicator> group, CpLoadBalancer balancer, CpRotateMethod rotate);

  int degree() const { return cp_; }
  int rank() const { return rank_; }
  CpLoadBalancer balancer() const { return balancer_; }
  CpRotateMethod rotate() const { return rotate_; }
  const std::shared_ptr<Communicator>& group() const { return group_; }
  std::string describe() const;

  // How many chunks a sequence of `seq_len` tokens is cut into, and those rank `rank` holds, in their local order.
  int64_t chunks(int64_t seq_len) const;
  std::vector<int64_t> chunks_of(int rank, int64_t seq_len) const;
  // What every sequence length must be a multiple of: cp, 2 cp (headtail) or 128 cp (ptrr).
  static int64_t sequence_multiple(CpLoadBalancer balancer, int64_t cp);
  // Throws UserError naming `key` when a sequence of `seq_len` tokens does not cut into equal chunks.
  static void check_seq_len(CpLoadBalancer balancer, int64_t cp, int64_t seq_len, const std::string& key);
  void check_seq_len(int64_t seq_len, const std::string& key) const { check_seq_len(balancer_, cp_, seq_len, key); }
  // This rank's part of `x` along `dim` (a whole sequence there), its chunks concatenated.
  at::Tensor shard(const at::Tensor& x, int64_t dim) const;
  // The positions in the whole sequence of this rank's tokens: int64 (1, seq_len / cp).
  at::Tensor positions(int64_t seq_len, const at::Device& device) const;
  // Causal attention of the local queries over the whole sequence: q (batch, heads, local, head_dim), k and v
  // (batch, kv_heads, local, head_dim), heads a multiple of kv_heads (GQA). Differentiable. With `documents` (each
  // position's document index over the whole sequence, (batch, seq_len), as document_ids gives) it is block-causal:
  // a query sees the earlier keys of its own document only (CPU only so far).
  at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& documents = {}) const;
  // Seconds this process has spent blocked in context-parallel attention's communication, all layers together.
  static double wait_seconds();

 private:
  std::shared_ptr<Communicator> group_;
  int cp_ = 1, rank_ = 0;
  CpLoadBalancer balancer_;
  CpRotateMethod rotate_;
};

// Tokens per ptrr block (flex attention's default block size, as torch's PTRR balancer uses).
constexpr int64_t kPtrrBlock = 128;

// From parallelism.context_parallel_load_balancer / context_parallel_rotate_method; errors name the key and value.
CpLoadBalancer parse_cp_load_balancer(const std::optional<std::string>& value);
CpRotateMethod parse_cp_rotate_method(const std::string& value);

}  // namespace titan::distributed
