#include "titan/components/metrics/allocation_tracker.h"

#include <c10/core/CPUAllocator.h>

#include <atomic>
#include <mutex>
#include <unordered_map>

namespace titan::metrics {
namespace {

std::atomic<int64_t> g_current{0};
std::atomic<int64_t> g_peak{0};

// The context of each DataPtr is the data pointer itself (raw_allocate requires that), so the wrapped
// allocation is found again through this table when it is freed.
// Both live for the whole process (never destroyed) so that tensors freed during static destruction still find them.
std::mutex& g_mutex = *new std::mutex;
std::unordered_map<void*, std::pair<c10::DataPtr, int64_t>>& live() {
  static auto* table = new std::unordered_map<void*, std::pair<c10::DataPtr, int64_t>>;
  return *table;
}

void release(void* data) {
  if (!data) return;
  c10::DataPtr inner;
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    auto it = live().find(data);
    if (it == live().end()) return;
    inner = std::move(it->second.first);
    g_current.fetch_sub(it->second.second);
    live().erase(it);
  }
  // `inner` frees the allocation through its own deleter here.
}

class CountingAllocator final : public c10::Allocator {
 public:
  explicit CountingAllocator(c10::Allocator* inner) : inner_(inner) {}

  c10::DataPtr allocate(size_t n) override {
    c10::DataPtr inner = inner_->allocate(n);
    void* data = inner.get();
    if (data) {
      std::lock_guard<std::mutex> lock(g_mutex);
      live().emplace(data, std::make_pair(std::move(inner), static_cast<int64_t>(n)));
    }
    int64_t now = g_current.fetch_add(static_cast<int64_t>(n)) + static_cast<int64_t>(n);
    int64_t peak = g_peak.load();
    while (now > peak && !g_peak.compare_exchange_weak(peak, now)) {
    }
    return {data, data, &release, c10::Device(c10::DeviceType::CPU)};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &release; }

  void copy_data(void* dest, const void* src, std::size_t count) const override { default_copy_data(dest, src, count); }

 private:
  c10::Allocator* inner_;
};

}  // namespace

void install_cpu_allocation_tracker() {
  static std::once_flag once;
  std::call_once(once, [] {
    static CountingAllocator allocator(c10::GetCPUAllocator());
    c10::SetCPUAllocator(&allocator, /*priority=*/100);
  });
}

int64_t cpu_bytes_in_use() { return g_current.load(); }
int64_t cpu_peak_bytes() { return g_peak.load(); }
void reset_cpu_peak_bytes() { g_peak.store(g_current.load()); }

}  // namespace titan::metrics
