// A cache of large host blocks for LibTorch's CPU tensors, so that CPU training reuses the same memory step after
// step without page-faulting it in again and without fragmenting the C library's heap.
//
// A training step allocates and frees the same tensor sizes in the same order every step. Blocks of 1 MiB and more
// are mapped from the kernel in size classes (sizes rounded up by at most 1/16), and a freed block is kept for reuse
// instead of being unmapped, merged with the held blocks beside it in the address space. A request takes the smallest
// held block large enough for it, and what that block has beyond the request stays held on its own (unless it is
// under 1 MiB), so memory freed by one phase of a step (the forward's activations) serves the next (the gradients)
// without mapping more. When a request finds no held block large enough and mapping a new one would take the blocks
// live and held together more than a quarter above the most that was ever live at once, the largest held blocks are
// unmapped first: the memory the cache maps stays within about 1.25x the peak of the live large blocks (two threads
// that miss at once may both map). Smaller blocks go to LibTorch's own allocation (the C library's malloc).
//
// Why not glibc's heap alone: with large blocks on the heap (glibc's defaults after the first step, or
// M_MMAP_THRESHOLD raised) the blocks saved for backward leave holes that later requests of other sizes cannot use,
// and the peak resident set grew 20-80% above the live tensors (docs/performance.md); with them unmapped on every
// free, each step page-faults and zeroes its activations again (1.5x slower on the debug model).
#pragma once
#include <cstdint>

namespace c10 {
struct Allocator;
}

namespace titan::metrics {

// The cache (one per process), whether installed or not.
c10::Allocator* host_block_cache();

// Makes the cache LibTorch's CPU allocator (idempotent); false when an allocator of higher priority (titan's
// allocation tracker) was installed before. Tensors allocated before keep their original deleters.
bool install_host_block_cache();

struct HostBlockCacheStats {
  int64_t live_bytes = 0;       // large blocks in tensors now
  int64_t cached_bytes = 0;     // large blocks held free for reuse
  int64_t peak_live_bytes = 0;  // the most large-block bytes live at once
  int64_t maps = 0;             // blocks mapped from the kernel
  int64_t reuses = 0;           // requests served from the cache
  int64_t splits = 0;           // of them, served from a larger held block whose rest stayed held
  int64_t unmaps = 0;           // freed blocks handed back (over the bound, or to retry a failed map)
};
HostBlockCacheStats host_block_cache_stats();

}  // namespace titan::metrics
