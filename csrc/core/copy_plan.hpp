// CopyPlan: the storages of one target on one device, as device pointers, offsets into a host region and
// byte counts. Built once per target layout (the Python side caches it), run many times against
// different host regions. Device -1 means the storages are host memory: the plan then runs as memcpy
// shards on the thread pool and completes before run() returns.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "cuda_backend.hpp"

namespace gpu_offload {

enum class Direction { kToHost, kToDevice };

class CopyPlan {
 public:
  // Storages of at most gather_max_bytes go through the gather/scatter kernel when the host region is
  // pinned and mapped; the rest through the copy engines. 0 sends everything to the copy engines.
  CopyPlan(int device, std::vector<std::uintptr_t> device_ptrs, std::vector<std::size_t> host_offsets,
           std::vector<std::size_t> sizes, std::size_t gather_max_bytes = 0);

  // The same copies from or to other device addresses (the storages were released and allocated again): the
  // host offsets and sizes are kept, the pointers checked as the constructor checks them.
  // The offsets and sizes are shared, not copied (a reload rebases a plan of every storage of its target).
  CopyPlan with_device_ptrs(std::vector<std::uintptr_t> device_ptrs) const;

  int device() const { return device_; }
  std::size_t num_copies() const { return sizes_->size(); }
  std::size_t num_kernel_copies() const { return num_kernel_copies_; }
  std::size_t gather_max_bytes() const { return gather_max_bytes_; }
  std::size_t total_bytes() const { return total_bytes_; }
  // One past the last host byte a run touches, relative to host_base: the region must be at least this.
  std::size_t host_extent_bytes() const { return host_extent_bytes_; }

  // Copies every storage to (kToHost) or from (kToDevice) host_base + offset. On a device, the batch is
  // ordered after `stream`'s pending work and after `waits`; with stream_waits, `stream` waits for it.
  // Returns the completion event (null on the host path, which is synchronous).
  cuda::EventPtr run(Direction direction, std::uintptr_t host_base, std::uintptr_t stream,
                     const std::vector<cuda::EventPtr>& waits, bool stream_waits) const;

 private:
  CopyPlan() = default;
  void check_device_ptrs() const;
  void run_host(Direction direction, std::uintptr_t host_base) const;

  int device_ = -1;
  std::vector<std::uintptr_t> device_ptrs_;
  std::shared_ptr<const std::vector<std::size_t>> host_offsets_;  // (immutable: shared by rebased plans)
  std::shared_ptr<const std::vector<std::size_t>> sizes_;
  std::size_t total_bytes_ = 0;
  std::size_t host_extent_bytes_ = 0;
  std::size_t gather_max_bytes_ = 0;
  std::size_t num_kernel_copies_ = 0;
};

// Copies n (dst, src, size) triples on the host, split into byte-balanced shards over the thread pool.
void parallel_memcpy(void* const* dst, const void* const* src, const std::size_t* sizes, std::size_t n);

}  // namespace gpu_offload
