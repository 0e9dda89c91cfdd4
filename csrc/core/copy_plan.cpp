#include "copy_plan.hpp"

#include <algorithm>
#include <cstring>
#include <string>

#include "errors.hpp"
#include "thread_pool.hpp"

namespace gpu_offload {
namespace {

// Below this a batch is copied on the calling thread: waking the pool costs more than it saves.
constexpr std::size_t kParallelMinBytes = 4u << 20;

}  // namespace

CopyPlan::CopyPlan(int device, std::vector<std::uintptr_t> device_ptrs, std::vector<std::size_t> host_offsets,
                   std::vector<std::size_t> sizes, std::size_t gather_max_bytes)
    : device_(device),
      device_ptrs_(std::move(device_ptrs)),
      host_offsets_(std::move(host_offsets)),
      sizes_(std::move(sizes)),
      gather_max_bytes_(device >= 0 ? gather_max_bytes : 0) {
  GO_CHECK(device_ptrs_.size() == sizes_.size() && host_offsets_.size() == sizes_.size(),
           "plan arrays differ in length: " + std::to_string(device_ptrs_.size()) + " pointers, " +
               std::to_string(host_offsets_.size()) + " offsets, " + std::to_string(sizes_.size()) + " sizes");
  GO_CHECK(device_ >= -1, "device must be -1 (host) or a CUDA device index, got " + std::to_string(device_));
  for (std::size_t i = 0; i < sizes_.size(); ++i) {
    GO_CHECK(sizes_[i] == 0 || device_ptrs_[i] != 0, "null storage pointer for copy " + std::to_string(i));
    total_bytes_ += sizes_[i];
    host_extent_bytes_ = std::max(host_extent_bytes_, host_offsets_[i] + sizes_[i]);
    if (sizes_[i] != 0 && sizes_[i] <= gather_max_bytes_) ++num_kernel_copies_;
  }
}

void parallel_memcpy(void* const* dst, const void* const* src, const std::size_t* sizes, std::size_t n) {
  std::size_t total = 0;
  for (std::size_t i = 0; i < n; ++i) total += sizes[i];
  auto& pool = ThreadPool::instance();
  const std::size_t shards = total < kParallelMinBytes ? 1 : std::min<std::size_t>(pool.num_threads(), total / (1u << 20));
  if (shards <= 1) {
    for (std::size_t i = 0; i < n; ++i) {
      if (sizes[i] != 0) std::memcpy(dst[i], src[i], sizes[i]);
    }
    return;
  }
  // Shard s copies the bytes [s*total/shards, (s+1)*total/shards) of the concatenated batch, so one huge
  // storage is split as evenly as many small ones.
  pool.parallel_for(shards, [&](std::size_t s) {
    const std::size_t begin = total / shards * s, end = s + 1 == shards ? total : total / shards * (s + 1);
    std::size_t pos = 0;
    for (std::size_t i = 0; i < n && pos < end; ++i) {
      const std::size_t a = std::max(begin, pos), b = std::min(end, pos + sizes[i]);
      if (a < b) {
        std::memcpy(static_cast<char*>(dst[i]) + (a - pos), static_cast<const char*>(src[i]) + (a - pos), b - a);
      }
      pos += sizes[i];
    }
  });
}

void CopyPlan::run_host(Direction direction, std::uintptr_t host_base) const {
  const std::size_t n = sizes_.size();
  std::vector<void*> dst(n);
  std::vector<const void*> src(n);
  for (std::size_t i = 0; i < n; ++i) {
    auto* host = reinterpret_cast<void*>(host_base + host_offsets_[i]);
    auto* dev = reinterpret_cast<void*>(device_ptrs_[i]);
    dst[i] = direction == Direction::kToHost ? host : dev;
    src[i] = direction == Direction::kToHost ? dev : host;
  }
  parallel_memcpy(dst.data(), src.data(), sizes_.data(), n);
}

cuda::EventPtr CopyPlan::run(Direction direction, std::uintptr_t host_base, std::uintptr_t stream,
                             const std::vector<cuda::EventPtr>& waits, bool stream_waits) const {
  GO_CHECK(host_base != 0 || total_bytes_ == 0, "null host region");
  if (device_ < 0) {
    for (const auto& w : waits) {
      if (w) w->synchronize();
    }
    run_host(direction, host_base);
    return nullptr;
  }
  // The kernel reaches host memory through its mapped address: only a pinned, mapped region qualifies, and
  // only where the device has the kernel loaded.
  const bool use_kernel = num_kernel_copies_ != 0 && cuda::can_gather(device_, host_base);
  cuda::Batch batch;
  batch.to_host = direction == Direction::kToHost;
  batch.host_base = host_base;
  batch.engine.dst.reserve(sizes_.size());
  batch.engine.src.reserve(sizes_.size());
  batch.engine.sizes.reserve(sizes_.size());
  for (std::size_t i = 0; i < sizes_.size(); ++i) {
    if (sizes_[i] == 0) continue;  // nothing to move
    auto* host = reinterpret_cast<void*>(host_base + host_offsets_[i]);
    auto* dev = reinterpret_cast<void*>(device_ptrs_[i]);
    cuda::CopyList& list = use_kernel && sizes_[i] <= gather_max_bytes_ ? batch.kernel : batch.engine;
    if (batch.to_host) {
      list.push(host, dev, sizes_[i]);
    } else {
      list.push(dev, host, sizes_[i]);
    }
  }
  return cuda::copy_batch(device_, batch, stream, waits, stream_waits);
}

}  // namespace gpu_offload
