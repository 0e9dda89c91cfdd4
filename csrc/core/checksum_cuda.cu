// The checksum of checksum.hpp computed by a kernel, on the caller's stream.
//
// The storages are cut into 1 MiB chunks; a grid-stride loop hands chunks to blocks, each block reads
// its chunk with 16-byte loads (8-byte or byte loads where a storage is not aligned for them), reduces
// its threads' partial sums and writes the chunk's partial to its own slot; the host adds a storage's
// partials (the sum is order-free, so the value is the host's exactly). The chunk table and the partials
// live in pinned host memory mapped into the device, allocated once per device and reused.
#include <cuda_runtime.h>

#include <array>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "checksum.hpp"
#include "cuda_check.cuh"
#include "errors.hpp"


namespace gpu_offload::cuda {
namespace {

constexpr int kMaxDevices = 64;
constexpr int kThreads = 256;
constexpr int kBlocksPerSm = 4;
using checksum_detail::kChunkBytes;

// One chunk of one storage, as the kernel reads it; the host fills the table, so the kernel needs no
// search. 32 bytes: three fields and the slot the chunk's partial sum is written to.
struct SumChunk {
  std::uint64_t ptr;  // the storage's start (chunk_share needs it for alignment and word indices)
  std::uint64_t begin;
  std::uint64_t end;
  std::uint64_t pad;
};

// Each block sums its chunks and writes one partial per chunk (no atomics: the slots are in host memory);
// the host adds a storage's partials. The sum is order-free, so the value is the host's exactly.
__global__ void __launch_bounds__(kThreads)
    checksum_kernel(const SumChunk* __restrict__ chunks, std::uint64_t num_chunks, unsigned long long* partials) {
  __shared__ unsigned long long warp_sums[kThreads / 32];
  __shared__ SumChunk ch;  // read once per block over the link

  for (std::uint64_t c = blockIdx.x; c < num_chunks; c += gridDim.x) {
    if (threadIdx.x == 0) ch = chunks[c];
    __syncthreads();
    unsigned long long acc = checksum_detail::chunk_share(ch.ptr, ch.begin, ch.end, threadIdx.x, kThreads);

    for (int offset = 16; offset > 0; offset >>= 1) acc += __shfl_down_sync(0xffffffffu, acc, offset);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) warp_sums[warp] = acc;
    __syncthreads();
    if (warp == 0) {
      unsigned long long v = lane < kThreads / 32 ? warp_sums[lane] : 0ull;
      for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_down_sync(0xffffffffu, v, offset);
      if (lane == 0) partials[c] = v;
    }
    __syncthreads();  // warp_sums and ch are reused by the next chunk
  }
}

// Pinned host memory mapped into the device: the chunk table going up and the partial sums coming down,
// with the event of the last job that used it. Nothing is allocated on the device (which is full when
// people offload) and nothing outside torch's allocator. Kept for the life of the process (grow-only, a
// few KiB each); a job takes one that is free and whose last use has finished.
struct Scratch {
  std::size_t chunks = 0;  // capacity
  SumChunk* table = nullptr;
  unsigned long long* partials = nullptr;
  SumChunk* device_table = nullptr;  // the same memory, as the kernel addresses it
  unsigned long long* device_partials = nullptr;
  cudaEvent_t event = nullptr;
  bool in_use = false;
};

struct Pool {
  std::mutex mutex;
  std::vector<std::unique_ptr<Scratch>> items;
  int sm_count = 0;
};
std::array<Pool, kMaxDevices> g_pools;

Scratch* acquire(int device, std::size_t chunks, int* sm_count) {
  Pool& pool = g_pools[device];
  std::lock_guard<std::mutex> lock(pool.mutex);
  if (pool.sm_count == 0) {
    GO_CUDA_CHECK(cudaDeviceGetAttribute(&pool.sm_count, cudaDevAttrMultiProcessorCount, device));
  }
  *sm_count = pool.sm_count;
  for (auto& item : pool.items) {
    if (item->in_use || item->chunks < chunks) continue;
    // A job dropped before it finished leaves its scratch busy on the GPU until then: skip it for now.
    if (cudaEventQuery(item->event) == cudaSuccess) {
      item->in_use = true;
      return item.get();
    }
    (void)cudaGetLastError();
  }
  auto item = std::make_unique<Scratch>();
  const std::size_t capacity = mapped_capacity(chunks);
  const MappedBlock block = alloc_mapped_block(capacity * (sizeof(SumChunk) + sizeof(unsigned long long)));
  item->event = block.done;
  item->table = static_cast<SumChunk*>(block.host);
  item->partials = reinterpret_cast<unsigned long long*>(item->table + capacity);
  item->device_table = static_cast<SumChunk*>(block.device);
  item->device_partials = reinterpret_cast<unsigned long long*>(item->device_table + capacity);
  item->chunks = capacity;
  item->in_use = true;
  pool.items.push_back(std::move(item));
  return pool.items.back().get();
}

void release(int device, Scratch* item) {
  std::lock_guard<std::mutex> lock(g_pools[device].mutex);
  item->in_use = false;
}

class DeviceChecksumJob final : public ChecksumJob {
 public:
  DeviceChecksumJob(int device, Scratch* scratch, std::vector<std::size_t> sizes)
      : device_(device), scratch_(scratch), sizes_(std::move(sizes)) {
    if (scratch_ == nullptr) {  // nothing to compute: every storage is empty
      done_ = true;
      for (std::size_t n : sizes_) result_.push_back(checksum_finish(0, n));
    }
  }
  ~DeviceChecksumJob() override {
    if (scratch_ != nullptr) release(device_, scratch_);
  }

  bool query() const override {
    std::lock_guard<std::mutex> lock(mutex_);
    if (done_) return true;
    DeviceGuard guard(device_);
    cudaError_t status = cudaEventQuery(scratch_->event);
    if (status == cudaErrorNotReady) {
      (void)cudaGetLastError();
      return false;
    }
    GO_CUDA_CHECK(status);
    return true;
  }

  std::vector<std::uint64_t> wait() override {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!done_) {
      {
        DeviceGuard guard(device_);
        GO_CUDA_CHECK(cudaEventSynchronize(scratch_->event));
      }
      const std::size_t n = sizes_.size();
      const unsigned long long* partials = scratch_->partials;
      result_.resize(n);
      std::size_t c = 0;
      for (std::size_t i = 0; i < n; ++i) {
        unsigned long long sum = 0;
        for (std::uint64_t k = checksum_detail::num_chunks(sizes_[i]); k > 0; --k) sum += partials[c++];
        result_[i] = checksum_finish(sum, sizes_[i]);
      }
      release(device_, scratch_);
      scratch_ = nullptr;
      done_ = true;
    }
    return result_;
  }

 private:
  int device_;
  Scratch* scratch_;
  std::vector<std::size_t> sizes_;
  std::vector<std::uint64_t> result_;
  bool done_ = false;
  mutable std::mutex mutex_;
};

}  // namespace

std::shared_ptr<ChecksumJob> checksum_device_async(int device, const std::vector<std::uintptr_t>& ptrs,
                                                   const std::vector<std::size_t>& sizes, std::uintptr_t stream) {
  GO_CHECK(ptrs.size() == sizes.size(), "checksum arrays differ in length: " + std::to_string(ptrs.size()) +
                                            " pointers, " + std::to_string(sizes.size()) + " sizes");
  GO_CHECK(device >= 0 && device < kMaxDevices, "device index out of range: " + std::to_string(device));
  const std::size_t n = sizes.size();
  unsigned long long total_chunks = 0;
  for (std::size_t i = 0; i < n; ++i) {
    GO_CHECK(sizes[i] == 0 || ptrs[i] != 0, "null pointer for storage " + std::to_string(i));
    total_chunks += checksum_detail::num_chunks(sizes[i]);
  }
  if (total_chunks == 0) return std::make_shared<DeviceChecksumJob>(device, nullptr, sizes);

  DeviceGuard guard(device);
  int sm_count = 0;
  Scratch* scratch = acquire(device, total_chunks, &sm_count);
  auto user = reinterpret_cast<cudaStream_t>(stream);
  try {
    std::size_t c = 0;
    for (std::size_t i = 0; i < n; ++i) {
      for (std::uint64_t begin = 0; begin < sizes[i]; begin += kChunkBytes) {
        const std::uint64_t end = begin + kChunkBytes < sizes[i] ? begin + kChunkBytes : sizes[i];
        scratch->table[c++] = {ptrs[i], begin, end, 0};
      }
    }
    const unsigned long long most = static_cast<unsigned long long>(sm_count) * kBlocksPerSm;
    const unsigned int grid = static_cast<unsigned int>(total_chunks < most ? total_chunks : most);
    checksum_kernel<<<grid, kThreads, 0, user>>>(scratch->device_table, total_chunks, scratch->device_partials);
    GO_CUDA_CHECK(cudaGetLastError());
    GO_CUDA_CHECK(cudaEventRecord(scratch->event, user));
  } catch (...) {
    // A launched kernel may still use the scratch: wait for the stream before handing it back.
    if (cudaStreamSynchronize(user) != cudaSuccess) (void)cudaGetLastError();
    release(device, scratch);
    throw;
  }
  return std::make_shared<DeviceChecksumJob>(device, scratch, sizes);
}

}  // namespace gpu_offload::cuda
