// The checksum of checksum.hpp computed by a kernel, on the caller's stream.
//
// The storages are cut into 1 MiB chunks; a grid-stride loop hands chunks to blocks, each block reads
// its chunk with 16-byte loads (8-byte or byte loads where a storage is not aligned for them), reduces
// its threads' partial sums and adds the result into the storage's slot with one 64-bit atomicAdd. The
// sum is order-free, so the value is the host's exactly. Pointer, size and chunk tables go up and the
// sums come down through small scratch buffers that are allocated once per device and reused.
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

// Scratch table, in 64-bit words: [0, n) pointers, [n, 2n) sizes, [2n, 3n] first chunk of each storage
// (3n: the total), [3n + 1, 4n + 1) the sums.
inline std::size_t table_words(std::size_t n) { return 4 * n + 1; }

__global__ void __launch_bounds__(kThreads)
    checksum_kernel(const std::uint64_t* __restrict__ table, std::uint64_t n, unsigned long long* __restrict__ sums) {
  const std::uint64_t* ptrs = table;
  const std::uint64_t* sizes = table + n;
  const std::uint64_t* starts = table + 2 * n;
  const std::uint64_t total_chunks = starts[n];
  __shared__ unsigned long long warp_sums[kThreads / 32];

  for (std::uint64_t c = blockIdx.x; c < total_chunks; c += gridDim.x) {
    const std::uint64_t s = checksum_detail::chunk_owner(starts, n, c);
    const std::uint64_t begin = (c - starts[s]) * kChunkBytes;
    const std::uint64_t end = begin + kChunkBytes < sizes[s] ? begin + kChunkBytes : sizes[s];
    unsigned long long acc = checksum_detail::chunk_share(ptrs[s], begin, end, threadIdx.x, kThreads);

    for (int offset = 16; offset > 0; offset >>= 1) acc += __shfl_down_sync(0xffffffffu, acc, offset);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) warp_sums[warp] = acc;
    __syncthreads();
    if (warp == 0) {
      unsigned long long v = lane < kThreads / 32 ? warp_sums[lane] : 0ull;
      for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_down_sync(0xffffffffu, v, offset);
      if (lane == 0) atomicAdd(sums + s, v);
    }
    __syncthreads();  // warp_sums is reused by the next chunk
  }
}

// A device table and its pinned host twin, with the event of the last job that used them. Kept for the
// life of the process (a few KiB each); a job takes one that is free and whose last use has finished.
struct Scratch {
  std::size_t words = 0;
  unsigned long long* device = nullptr;
  unsigned long long* host = nullptr;
  cudaEvent_t event = nullptr;
  bool in_use = false;
};

struct Pool {
  std::mutex mutex;
  std::vector<std::unique_ptr<Scratch>> items;
  int sm_count = 0;
};
std::array<Pool, kMaxDevices> g_pools;

Scratch* acquire(int device, std::size_t words, int* sm_count) {
  Pool& pool = g_pools[device];
  std::lock_guard<std::mutex> lock(pool.mutex);
  if (pool.sm_count == 0) {
    GO_CUDA_CHECK(cudaDeviceGetAttribute(&pool.sm_count, cudaDevAttrMultiProcessorCount, device));
  }
  *sm_count = pool.sm_count;
  for (auto& item : pool.items) {
    if (item->in_use || item->words < words) continue;
    // A job dropped before it finished leaves its scratch busy on the GPU until then: skip it for now.
    if (cudaEventQuery(item->event) == cudaSuccess) {
      item->in_use = true;
      return item.get();
    }
    (void)cudaGetLastError();
  }
  auto item = std::make_unique<Scratch>();
  std::size_t capacity = 1024;
  while (capacity < words) capacity *= 2;
  GO_CUDA_CHECK(cudaMalloc(&item->device, capacity * sizeof(unsigned long long)));
  cudaError_t status = cudaMallocHost(&item->host, capacity * sizeof(unsigned long long));
  if (status == cudaSuccess) status = cudaEventCreateWithFlags(&item->event, cudaEventDisableTiming);
  if (status != cudaSuccess) {
    if (item->host != nullptr) cudaFreeHost(item->host);
    cudaFree(item->device);
    GO_CUDA_CHECK(status);
  }
  item->words = capacity;
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
    if (scratch_ == nullptr) done_ = true;  // nothing to compute
  }
  ~DeviceChecksumJob() override {
    if (scratch_ != nullptr) release(device_, scratch_);
  }

  bool query() const override {
    std::lock_guard<std::mutex> lock(mutex_);
    if (done_) return true;
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
      GO_CUDA_CHECK(cudaEventSynchronize(scratch_->event));
      const std::size_t n = sizes_.size();
      const unsigned long long* sums = scratch_->host + 3 * n + 1;
      result_.resize(n);
      for (std::size_t i = 0; i < n; ++i) result_[i] = checksum_finish(sums[i], sizes_[i]);
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
  if (n == 0) return std::make_shared<DeviceChecksumJob>(device, nullptr, std::vector<std::size_t>{});

  DeviceGuard guard(device);
  int sm_count = 0;
  Scratch* scratch = acquire(device, table_words(n), &sm_count);
  auto user = reinterpret_cast<cudaStream_t>(stream);
  try {
    unsigned long long* host = scratch->host;
    unsigned long long chunk = 0;
    for (std::size_t i = 0; i < n; ++i) {
      host[i] = ptrs[i];
      host[n + i] = sizes[i];
      host[2 * n + i] = chunk;
      host[3 * n + 1 + i] = 0;
      chunk += checksum_detail::num_chunks(sizes[i]);
    }
    host[3 * n] = chunk;
    const std::size_t bytes = table_words(n) * sizeof(unsigned long long);
    GO_CUDA_CHECK(cudaMemcpyAsync(scratch->device, host, bytes, cudaMemcpyHostToDevice, user));
    if (total_chunks != 0) {
      const unsigned long long most = static_cast<unsigned long long>(sm_count) * kBlocksPerSm;
      const unsigned int grid = static_cast<unsigned int>(total_chunks < most ? total_chunks : most);
      checksum_kernel<<<grid, kThreads, 0, user>>>(reinterpret_cast<const std::uint64_t*>(scratch->device), n,
                                                   scratch->device + 3 * n + 1);
      GO_CUDA_CHECK(cudaGetLastError());
    }
    GO_CUDA_CHECK(cudaMemcpyAsync(host + 3 * n + 1, scratch->device + 3 * n + 1, n * sizeof(unsigned long long),
                                           cudaMemcpyDeviceToHost, user));
    GO_CUDA_CHECK(cudaEventRecord(scratch->event, user));
  } catch (...) {
    // Whatever was enqueued may still use the scratch: mark its end before handing it back.
    if (cudaEventRecord(scratch->event, user) != cudaSuccess) (void)cudaGetLastError();
    release(device, scratch);
    throw;
  }
  return std::make_shared<DeviceChecksumJob>(device, scratch, sizes);
}

}  // namespace gpu_offload::cuda
