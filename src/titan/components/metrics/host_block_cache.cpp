#include "titan/components/metrics/host_block_cache.h"

#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>
#include <c10/util/Exception.h>
#include <sys/mman.h>

#include <algorithm>
#include <bit>
#include <limits>
#include <mutex>
#include <map>
#include <unordered_map>
#include <vector>

namespace titan::metrics {
namespace {

constexpr size_t kLarge = size_t{1} << 20;

// Sizes rounded up to a sixteenth of their power of two: at most 1/16 more, and a few classes per octave so that a
// request finds a block freed by a slightly different size.
size_t size_class(size_t n) {
  if (n > std::numeric_limits<size_t>::max() / 2) return n;  // no such block can be mapped; mmap reports it
  const size_t step = std::bit_floor(n) / 16;
  return (n + step - 1) / step * step;
}

struct State {
  std::mutex mutex;
  std::unordered_map<void*, size_t> live;  // block -> its size
  // Held blocks, by size (the best fit for a request) and by address (to merge a freed block with held neighbours).
  std::multimap<size_t, char*> by_size;
  std::map<char*, size_t> by_address;
  HostBlockCacheStats stats;
};

// Never destroyed: tensors freed during static destruction still find it.
State& state() {
  static auto* s = new State;
  return *s;
}

// Hands a held range back to the kernel. Unmapping part of a mapping splits it, which fails at the kernel's limit of
// mappings (vm.max_map_count): the range is then held again rather than lost.
void unmap(void* block, size_t size);

void hold(State& s, char* block, size_t size) {
  const bool added = s.by_address.emplace(block, size).second;
  TORCH_INTERNAL_ASSERT(added, "titan host block cache: a block held twice");
  s.by_size.emplace(size, block);
  s.stats.cached_bytes += static_cast<int64_t>(size);
}

void unmap(void* block, size_t size) {
  if (munmap(block, size) == 0) return;
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  hold(s, static_cast<char*>(block), size);
  --s.stats.unmaps;
}

// Takes a held block out of both indices (under the lock); `in_size` is its entry in by_size.
void take(State& s, std::multimap<size_t, char*>::iterator in_size) {
  s.by_address.erase(in_size->second);
  s.stats.cached_bytes -= static_cast<int64_t>(in_size->first);
  s.by_size.erase(in_size);
}

void take(State& s, std::map<char*, size_t>::iterator in_address) {
  auto [first, last] = s.by_size.equal_range(in_address->second);
  for (auto it = first; it != last; ++it)
    if (it->second == in_address->first) {
      take(s, it);
      return;
    }
}

// Hands every held block back to the kernel (under the lock).
std::vector<std::pair<void*, size_t>> take_all_cached(State& s) {
  std::vector<std::pair<void*, size_t>> out(s.by_address.begin(), s.by_address.end());
  s.by_address.clear();
  s.by_size.clear();
  s.stats.cached_bytes = 0;
  s.stats.unmaps += static_cast<int64_t>(out.size());
  return out;
}

void* map_block(size_t size) {
  void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  return p == MAP_FAILED ? nullptr : p;
}

// Keeps a large block for reuse, merged with the held blocks next to it in the address space (pieces of one mapping
// split earlier, or mappings the kernel placed side by side: munmap and the tensors need only that the range is
// mapped); false when `block` is not one of the cache's large blocks.
bool hold_for_reuse(void* pointer) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  auto it = s.live.find(pointer);
  if (it == s.live.end()) return false;
  char* block = static_cast<char*>(pointer);
  size_t size = it->second;
  s.live.erase(it);
  s.stats.live_bytes -= static_cast<int64_t>(size);
  if (auto next = s.by_address.find(block + size); next != s.by_address.end()) {
    size += next->second;
    take(s, next);
  }
  if (auto next = s.by_address.lower_bound(block); next != s.by_address.begin()) {
    auto before = std::prev(next);
    if (before->first + before->second == block) {
      char* start = before->first;
      size += before->second;
      take(s, before);
      block = start;
    }
  }
  hold(s, block, size);
  return true;
}

void free_large(void* block) { hold_for_reuse(block); }

// raw_deallocate's deleter: the block may be either kind.
void free_any(void* block) {
  if (block && !hold_for_reuse(block)) c10::free_cpu(block);
}

void note_live(State& s, void* block, size_t size) {
  s.live.emplace(block, size);
  s.stats.live_bytes += static_cast<int64_t>(size);
  s.stats.peak_live_bytes = std::max(s.stats.peak_live_bytes, s.stats.live_bytes);
}

// The smallest held block large enough for `size` bytes, made live (under the lock); nullptr when none is. What it
// has beyond the request stays held as a block of its own (merged back when the request's tensor is freed), unless
// that is under a large block's size: then the request takes the whole block.
void* reuse(State& s, size_t size) {
  auto it = s.by_size.lower_bound(size);
  if (it == s.by_size.end()) return nullptr;
  char* held = it->second;
  size_t taken = it->first;
  take(s, it);
  if (taken - size >= kLarge) {
    hold(s, held + size, taken - size);
    taken = size;
    ++s.stats.splits;
  }
  ++s.stats.reuses;
  note_live(s, held, taken);
  return held;
}

class HostBlockCache final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t n) override {
    if (n < kLarge) {
      void* p = c10::alloc_cpu(n);
      return {p, p, &c10::free_cpu, c10::Device(c10::DeviceType::CPU)};
    }
    const size_t size = size_class(n);
    State& s = state();
    // Mapping more would take live and held blocks together above a quarter over the most ever live: the largest
    // held blocks go back first (a class the step needs again is mapped and faulted in again then).
    std::vector<std::pair<void*, size_t>> evicted;
    {
      std::lock_guard<std::mutex> lock(s.mutex);
      if (void* held = reuse(s, size)) return {held, held, &free_large, c10::Device(c10::DeviceType::CPU)};
      const int64_t want = s.stats.live_bytes + static_cast<int64_t>(size);
      const int64_t limit = std::max(s.stats.peak_live_bytes, want) / 4 * 5;
      while (s.stats.cached_bytes > 0 && want + s.stats.cached_bytes > limit) {
        auto it = std::prev(s.by_size.end());
        evicted.emplace_back(it->second, it->first);
        take(s, it);
        ++s.stats.unmaps;
      }
    }
    for (auto& [b, bytes] : evicted) unmap(b, bytes);
    void* block = map_block(size);
    if (!block) {
      // Out of address space or memory: give back what is held for other sizes, then try once more.
      std::vector<std::pair<void*, size_t>> held;
      {
        std::lock_guard<std::mutex> lock(s.mutex);
        held = take_all_cached(s);
      }
      for (auto& [b, bytes] : held) unmap(b, bytes);
      block = map_block(size);
    }
    TORCH_CHECK_WITH(OutOfMemoryError, block, "titan host block cache: could not map ", size, " bytes for a ", n,
                     "-byte CPU tensor (mmap failed; the blocks held for reuse were given back first)");
    std::lock_guard<std::mutex> lock(s.mutex);
    ++s.stats.maps;
    note_live(s, block, size);
    return {block, block, &free_large, c10::Device(c10::DeviceType::CPU)};
  }

  // allocate() gives small blocks free_cpu and large ones free_large (no lookup on the many small frees); a raw
  // pointer may be either, so raw_deallocate looks it up.
  c10::DeleterFnPtr raw_deleter() const override { return &free_any; }

  void copy_data(void* dest, const void* src, std::size_t count) const override { default_copy_data(dest, src, count); }

};

}  // namespace

c10::Allocator* host_block_cache() {
  // Never destroyed: c10 keeps a pointer to it, and tensors may be allocated and freed during static destruction.
  static auto* allocator = new HostBlockCache;
  return allocator;
}

bool install_host_block_cache() {
  static std::once_flag once;
  // c10 keeps an allocator of higher priority: the allocation tracker (priority 100), when it was installed first,
  // stays in front and the cache is not used. Installed after the cache, the tracker wraps it.
  std::call_once(once, [] { c10::SetCPUAllocator(host_block_cache(), /*priority=*/50); });
  return c10::GetCPUAllocator() == host_block_cache();
}

HostBlockCacheStats host_block_cache_stats() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  return s.stats;
}

}  // namespace titan::metrics
