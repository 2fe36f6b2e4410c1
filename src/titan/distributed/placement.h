// Placement: how one global tensor lies over the device mesh, in the terms of PyTorch's DTensor (per mesh
// dimension Shard(d), Replicate or Partial(sum)) and of torch DCP's chunk metadata (a rank's piece is a box of
// offsets and lengths). TP, FSDP/HSDP, DDP, the optimizer, gradient clipping and checkpoints all read this one
// description; nothing else in titan assumes how a tensor is split.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace titan::distributed {

struct Placement {
  enum class Kind { Replicate, Shard, Partial };
  Kind kind = Kind::Replicate;
  int64_t dim = 0;  // Shard only; negative counts from the last dimension

  static Placement replicate() { return {Kind::Replicate, 0}; }
  static Placement shard(int64_t dim) { return {Kind::Shard, dim}; }
  static Placement partial() { return {Kind::Partial, 0}; }  // every rank holds a summand of the global value
  bool is_shard() const { return kind == Kind::Shard; }
  bool is_replicate() const { return kind == Kind::Replicate; }
  bool is_partial() const { return kind == Kind::Partial; }
  // The sharded dimension for a tensor of `rank` dimensions (Shard(-1) is the last).
  int64_t normalized_dim(int64_t rank) const { return dim < 0 ? dim + rank : dim; }
  bool operator==(const Placement& o) const { return kind == o.kind && (kind != Kind::Shard || dim == o.dim); }
  std::string str() const;  // "Shard(0)", "Replicate()", "Partial(sum)"
};

// [offsets[d], offsets[d] + lengths[d]) on every tensor dimension d.
struct Box {
  std::vector<int64_t> offsets, lengths;

  static Box whole(const std::vector<int64_t>& shape);
  int64_t numel() const;
  bool empty() const { return numel() == 0; }
  // The common part of two boxes of the same tensor, or nothing when they do not overlap.
  std::optional<Box> intersect(const Box& other) const;
  bool operator==(const Box& o) const { return offsets == o.offsets && lengths == o.lengths; }
  std::string str() const;  // "[0:128, 64:128]"
};

// torch.chunk's rule, which DTensor and FSDP2 follow: pieces of ceil(length / parts) elements; the last pieces may
// be shorter or empty. Returns piece `index`'s [begin, begin + length).
struct Range {
  int64_t begin = 0, length = 0;
};
Range chunk(int64_t length, int64_t parts, int64_t index);
inline int64_t chunk_capacity(int64_t length, int64_t parts) { return (length + parts - 1) / parts; }

// How one global tensor lies over the mesh, as seen from this rank: placements over named mesh dimensions,
// applied in order. Each Shard level splits what the previous levels left local, so TP's Shard(0) followed by
// FSDP's Shard(0) gives each rank one contiguous box (DTensor's strided sharding) and TP's Shard(1) followed by
// FSDP's Shard(0) a box of rows of a column block.
class TensorLayout {
 public:
  struct Level {
    std::string mesh_dim;  // "tp", "dp_shard", "dp_replicate", ...
    int64_t size = 1;      // ranks along that mesh dimension
    int64_t coordinate = 0;
    Placement placement;
  };

  TensorLayout() = default;
  explicit TensorLayout(std::vector<int64_t> global_shape) : global_shape_(std::move(global_shape)) {}

  // A copy with one more level. Throws UserError for a Shard of a dimension the tensor does not have.
  TensorLayout then(const std::string& mesh_dim, int64_t size, int64_t coordinate, Placement placement) const;

  const std::vector<int64_t>& global_shape() const { return global_shape_; }
  const std::vector<Level>& levels() const { return levels_; }
  // This rank's part of the global tensor (the whole tensor when nothing is sharded).
  Box local_box() const;
  // The shape of the tensor a rank allocates: the box, except that the last Shard level is padded to equal pieces
  // (FSDP's all-gather and reduce-scatter need equal sizes). Padding sits at the end of that dimension.
  std::vector<int64_t> padded_local_shape() const;
  // True where this rank's copy is the one that counts: coordinate 0 along every Replicate level. Norms add each
  // element once and checkpoints write it once by reading only owners' pieces.
  bool owner() const;
  bool has_partial() const;
  // "Shard(0)@tp(2) Shard(0)@dp_shard(4) Replicate()@dp_replicate(2)"; "Replicate()" when there are no levels.
  std::string str() const;

 private:
  std::vector<int64_t> global_shape_;
  std::vector<Level> levels_;
};

}  // namespace titan::distributed
