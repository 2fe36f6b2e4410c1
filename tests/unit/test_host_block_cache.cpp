// The host block cache: large CPU blocks are reused instead of mapped again, small ones are left to malloc, a held
// block is split for a smaller request and merged back when it is freed, and what it maps stays within 1.25x the
// peak of the live blocks when the sizes a program asks for change.
#include <gtest/gtest.h>
#include <c10/core/Allocator.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "titan/components/metrics/host_block_cache.h"

namespace {

using titan::metrics::host_block_cache;
using titan::metrics::host_block_cache_stats;
constexpr size_t kMiB = size_t{1} << 20;

TEST(HostBlockCache, AFreedLargeBlockServesTheNextRequestOfItsSize) {
  c10::Allocator* cache = host_block_cache();
  void* first = nullptr;
  {
    c10::DataPtr block = cache->allocate(5 * kMiB + 123);
    first = block.get();
    ASSERT_NE(first, nullptr);
    std::memset(first, 7, 5 * kMiB + 123);  // the whole request is writable
  }
  const auto before = host_block_cache_stats();
  c10::DataPtr again = cache->allocate(5 * kMiB + 100);  // same size class
  EXPECT_EQ(again.get(), first);
  const auto after = host_block_cache_stats();
  EXPECT_EQ(after.reuses, before.reuses + 1);
  EXPECT_EQ(after.maps, before.maps);
  EXPECT_EQ(after.cached_bytes, before.cached_bytes - after.live_bytes + before.live_bytes);
}

TEST(HostBlockCache, AHeldBlockIsSplitForSmallerRequestsAndMergedBackWhenTheyAreFreed) {
  c10::Allocator* cache = host_block_cache();
  char* whole = nullptr;
  {
    c10::DataPtr block = cache->allocate(64 * kMiB);
    whole = static_cast<char*>(block.get());
    std::memset(whole, 1, 64 * kMiB);
  }
  const auto before = host_block_cache_stats();
  char* start = nullptr;
  {
    // Three requests of other sizes (as backward's gradients after the forward's activations) take the held
    // 64 MiB, the smallest held block large enough, one after another: nothing is mapped.
    c10::DataPtr a = cache->allocate(20 * kMiB);
    c10::DataPtr b = cache->allocate(12 * kMiB);
    c10::DataPtr c = cache->allocate(30 * kMiB);
    for (auto* p : {&a, &b, &c}) std::memset(p->get(), 2, 12 * kMiB);
    const auto during = host_block_cache_stats();
    EXPECT_EQ(during.maps, before.maps);
    EXPECT_EQ(during.splits, before.splits + 3);
    // The held block starts at `whole`, or lower when a neighbour held by an earlier test merged with it.
    start = static_cast<char*>(a.get());
    EXPECT_LE(start, whole);
    EXPECT_EQ(static_cast<char*>(b.get()), start + 20 * kMiB);
    EXPECT_EQ(static_cast<char*>(c.get()), start + 32 * kMiB);
    EXPECT_EQ(during.live_bytes + during.cached_bytes, before.live_bytes + before.cached_bytes);
  }
  // Freed in another order than taken, the pieces merge back into one block that serves the whole size again.
  c10::DataPtr again = cache->allocate(64 * kMiB);
  EXPECT_EQ(static_cast<char*>(again.get()), start);
  const auto after = host_block_cache_stats();
  EXPECT_EQ(after.maps, before.maps);
  std::memset(again.get(), 3, 64 * kMiB);  // the merged block is one writable range
}

TEST(HostBlockCache, SmallBlocksAreLeftToMalloc) {
  const auto before = host_block_cache_stats();
  {
    c10::DataPtr small = host_block_cache()->allocate(64 * 1024);
    ASSERT_NE(small.get(), nullptr);
    std::memset(small.get(), 1, 64 * 1024);
  }
  const auto after = host_block_cache_stats();
  EXPECT_EQ(after.maps, before.maps);
  EXPECT_EQ(after.reuses, before.reuses);
  EXPECT_EQ(after.live_bytes, before.live_bytes);
}

TEST(HostBlockCache, RawAllocationsOfEitherKindAreFreedByTheRawDeleter) {
  c10::Allocator* cache = host_block_cache();
  for (size_t n : {size_t{1000}, 3 * kMiB}) {
    const auto before = host_block_cache_stats();
    void* p = cache->raw_allocate(n);
    ASSERT_NE(p, nullptr);
    std::memset(p, 3, n);
    cache->raw_deallocate(p);
    const auto after = host_block_cache_stats();
    EXPECT_EQ(after.live_bytes, before.live_bytes) << n;
  }
}

TEST(HostBlockCache, MappedMemoryStaysWithinAQuarterAboveThePeakOfLiveBlocksWhenSizesChange) {
  c10::Allocator* cache = host_block_cache();
  const auto mapped = [] {
    const auto s = host_block_cache_stats();
    return s.live_bytes + s.cached_bytes;
  };
  const auto start = host_block_cache_stats();
  // Phase after phase of blocks of a larger size, each phase freed before the next: a request larger than every held
  // block finds none to split, and without eviction the cache would hold every phase's blocks; with it, what is
  // mapped stays near one phase's worth. A 1 MiB guard stays live after each block, so that freed blocks the kernel
  // placed side by side do not merge into one large enough for the next phase. A phase is at least the peak so far
  // (other tests in this process may have used the cache), so that the second phase must evict.
  const size_t per_phase = std::max<size_t>(40, static_cast<size_t>(start.peak_live_bytes) / kMiB + 1);
  std::vector<c10::DataPtr> guards;
  for (size_t mib : {2, 3, 5, 8, 13, 21}) {
    std::vector<c10::DataPtr> phase;
    for (size_t i = 0; i < per_phase / mib + 1; ++i) {
      phase.push_back(cache->allocate(mib * kMiB));
      std::memset(phase.back().get(), 1, mib * kMiB);
      guards.push_back(cache->allocate(kMiB));
      const auto s = host_block_cache_stats();
      EXPECT_LE(static_cast<double>(mapped()), 1.25 * static_cast<double>(s.peak_live_bytes) + 1.0) << mib;
    }
  }
  const auto end = host_block_cache_stats();
  EXPECT_GT(end.unmaps, start.unmaps);
}

}  // namespace
