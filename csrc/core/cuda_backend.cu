// CUDA implementation of cuda_backend.hpp: streams per device and direction, batched async copies, events.
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <deque>
#include <memory>
#include <mutex>
#include <string>

#include "cuda_backend.hpp"
#include "cuda_check.cuh"
#include "errors.hpp"

#ifndef GPU_OFFLOAD_CUDA_ARCHS
#define GPU_OFFLOAD_CUDA_ARCHS "unknown"
#endif


namespace gpu_offload::cuda {
namespace {

constexpr int kMaxDevices = 64;

// One piece of a gather/scatter: at most kChunkBytes, so a large tensor spreads over many blocks.
struct Chunk {
  const unsigned char* src;
  unsigned char* dst;
  unsigned long long num_bytes;
};
constexpr std::size_t kChunkBytes = 64 * 1024;
constexpr int kGatherThreads = 256;

// A gather kernel's chunk table, in pinned host memory mapped into the device: the kernel reads it over
// the link, so nothing is allocated on the device (which is full when people offload) and nothing is
// uploaded from pageable memory. Reused once the kernel that last read it has finished (`done`).
struct ChunkTable {
  Chunk* host = nullptr;
  Chunk* device = nullptr;  // the same memory, as the kernel addresses it
  std::size_t capacity = 0;
  cudaEvent_t done = nullptr;
};

// One non-blocking stream per device and direction, so D2H and H2D run on both copy engines at once.
// Created on first use; never destroyed (they live as long as the process, like torch's pool streams).
struct DeviceStreams {
  std::once_flag once;
  std::array<cudaStream_t, 2> streams{};         // copy engines, per direction
  std::array<cudaStream_t, 2> kernel_streams{};  // gather/scatter kernels, per direction
  std::array<std::mutex, 2> locks;  // one batch at a time per direction keeps the enqueue order simple
  // Chunk tables per direction, under that direction's lock; grow-only (a few, a few KiB each).
  std::array<std::deque<ChunkTable>, 2> tables;
  int num_sms = 0;
};
std::array<DeviceStreams, kMaxDevices> g_streams;

DeviceStreams& device_streams(int device) {
  GO_CHECK(device >= 0 && device < kMaxDevices, "device index out of range: " + std::to_string(device));
  DeviceStreams& ds = g_streams[device];
  std::call_once(ds.once, [&] {
    DeviceGuard guard(device);
    int least = 0, greatest = 0;
    GO_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
    for (auto& s : ds.streams) GO_CUDA_CHECK(cudaStreamCreateWithPriority(&s, cudaStreamNonBlocking, least));
    for (auto& s : ds.kernel_streams) GO_CUDA_CHECK(cudaStreamCreateWithPriority(&s, cudaStreamNonBlocking, least));
    GO_CUDA_CHECK(cudaDeviceGetAttribute(&ds.num_sms, cudaDevAttrMultiProcessorCount, device));
  });
  return ds;
}

// A table of at least `n` chunks that no kernel still reads (caller holds the direction's lock). A new
// one is pinned only when every table is busy or too small: in a steady loop, never.
ChunkTable& take_table(std::deque<ChunkTable>& tables, std::size_t n) {
  for (ChunkTable& t : tables) {
    if (t.capacity < n) continue;
    const cudaError_t status = cudaEventQuery(t.done);
    if (status == cudaSuccess) return t;  // also an event never recorded
    (void)cudaGetLastError();
  }
  ChunkTable t;
  t.capacity = mapped_capacity(n);
  const MappedBlock block = alloc_mapped_block(t.capacity * sizeof(Chunk));
  t.host = static_cast<Chunk*>(block.host);
  t.device = static_cast<Chunk*>(block.device);
  t.done = block.done;
  tables.push_back(t);
  return tables.back();
}

// Copies each chunk with 16-byte accesses where both ends are 16-byte aligned, bytes elsewhere. Through
// mapped pinned memory every access crosses the link, so wide accesses are what reach the limit.
__global__ void gather_chunks(const Chunk* __restrict__ chunks, unsigned long long num_chunks) {
  __shared__ Chunk ch;  // read once per block over the link, not once per thread
  for (unsigned long long c = blockIdx.x; c < num_chunks; c += gridDim.x) {
    if (threadIdx.x == 0) ch = chunks[c];
    __syncthreads();
    unsigned long long done = 0;
    if (((reinterpret_cast<std::uintptr_t>(ch.src) | reinterpret_cast<std::uintptr_t>(ch.dst)) & 15) == 0) {
      const unsigned long long n16 = ch.num_bytes / 16;
      const uint4* src = reinterpret_cast<const uint4*>(ch.src);
      uint4* dst = reinterpret_cast<uint4*>(ch.dst);
      for (unsigned long long i = threadIdx.x; i < n16; i += blockDim.x) dst[i] = src[i];
      done = n16 * 16;
    }
    for (unsigned long long i = done + threadIdx.x; i < ch.num_bytes; i += blockDim.x) ch.dst[i] = ch.src[i];
    __syncthreads();  // `ch` is overwritten by the next chunk
  }
}

// Enqueues one gather kernel for the list on `stream`. Host addresses are translated to the region's
// mapped device address; the chunk table is one of the direction's pinned tables (caller holds its lock).
void enqueue_kernel_copies(const Batch& batch, cudaStream_t stream, DeviceStreams& ds, int dir) {
  unsigned char* host_dev = nullptr;
  GO_CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&host_dev), reinterpret_cast<void*>(batch.host_base), 0));
  const auto translate = [&](const void* host) {
    return host_dev + (reinterpret_cast<std::uintptr_t>(host) - batch.host_base);
  };
  std::size_t num_chunks = 0;
  for (std::size_t i = 0; i < batch.kernel.size(); ++i) num_chunks += (batch.kernel.sizes[i] + kChunkBytes - 1) / kChunkBytes;
  if (num_chunks == 0) return;
  ChunkTable& table = take_table(ds.tables[dir], num_chunks);
  std::size_t c = 0;
  for (std::size_t i = 0; i < batch.kernel.size(); ++i) {
    const auto* src = static_cast<const unsigned char*>(batch.to_host ? batch.kernel.src[i] : translate(batch.kernel.src[i]));
    auto* dst = static_cast<unsigned char*>(batch.to_host ? translate(batch.kernel.dst[i])
                                                          : batch.kernel.dst[i]);
    for (std::size_t off = 0; off < batch.kernel.sizes[i]; off += kChunkBytes) {
      table.host[c++] = {src + off, dst + off, std::min(kChunkBytes, batch.kernel.sizes[i] - off)};
    }
  }
  const unsigned long long blocks = std::min<unsigned long long>(num_chunks, 4ull * std::max(ds.num_sms, 1));
  gather_chunks<<<static_cast<unsigned>(blocks), kGatherThreads, 0, stream>>>(table.device, num_chunks);
  GO_CUDA_CHECK(cudaGetLastError());
  // The table is free again once the kernel has run. (If this fails, copy_batch waits for the stream.)
  GO_CUDA_CHECK(cudaEventRecord(table.done, stream));
}

void enqueue_engine_copies(const CopyList& list, bool to_host, cudaStream_t stream) {
  const cudaMemcpyKind kind = to_host ? cudaMemcpyDeviceToHost : cudaMemcpyHostToDevice;
  const std::size_t n = list.size();
  if (n > 1) {
    // One call for the whole batch: the driver packs the descriptors, which is what makes many copies
    // cheap on the host side. Falls back to a loop where the driver does not support it.
    cudaMemcpyAttributes attrs = {};
    attrs.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
    std::size_t attrs_index = 0;
    cudaError_t status = cudaMemcpyBatchAsync(list.dst.data(), list.src.data(), list.sizes.data(), n, &attrs,
                                              &attrs_index, 1, stream);
    if (status == cudaSuccess) return;
    (void)cudaGetLastError();
  }
  for (std::size_t i = 0; i < n; ++i) {
    if (list.sizes[i] != 0) GO_CUDA_CHECK(cudaMemcpyAsync(list.dst[i], list.src[i], list.sizes[i], kind, stream));
  }
}

// An event recorded on `stream`, to be waited on by another stream (then dropped: waits already enqueued
// hold on to what they need).
cudaEvent_t record(cudaStream_t stream) {
  cudaEvent_t event = nullptr;
  GO_CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
  cudaError_t status = cudaEventRecord(event, stream);
  if (status != cudaSuccess) cudaEventDestroy(event);
  GO_CUDA_CHECK(status);
  return event;
}

void wait_and_drop(cudaStream_t waiter, cudaEvent_t event) {
  cudaError_t status = cudaStreamWaitEvent(waiter, event, 0);
  cudaEventDestroy(event);
  GO_CUDA_CHECK(status);
}

}  // namespace

bool compiled() { return true; }

bool available() {
  static const bool ok = [] {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
      (void)cudaGetLastError();  // no driver or no device: the CPU path still works
      return false;
    }
    return n > 0;
  }();
  return ok;
}

int device_count() {
  if (!available()) return 0;
  int n = 0;
  GO_CUDA_CHECK(cudaGetDeviceCount(&n));
  return n;
}

int runtime_version() {
  int v = 0;
  if (cudaRuntimeGetVersion(&v) != cudaSuccess) (void)cudaGetLastError();
  return v != 0 ? v : CUDART_VERSION;
}

std::string architectures() { return GPU_OFFLOAD_CUDA_ARCHS; }

// Pinning (and unpinning) needs a current context. In a thread with none (the first snapshot from a fresh thread, or a
// rank that never called set_device) the runtime would create one on GPU 0; pin under a device whose
// context already exists instead (the one the tensors live on), and leave the thread as it was.
class PinContext {
 public:
  PinContext() {
    if (thread_has_context() || !available()) return;
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
      (void)cudaGetLastError();
      return;
    }
    for (int d = 0; d < n; ++d) {
      if (has_primary_context(d)) {
        guard_ = std::make_unique<DeviceGuard>(d);
        return;
      }
    }
  }

 private:
  std::unique_ptr<DeviceGuard> guard_;
};

void* host_alloc(std::size_t num_bytes) {
  PinContext pin;
  void* ptr = nullptr;
  GO_CUDA_CHECK(cudaHostAlloc(&ptr, num_bytes, cudaHostAllocPortable | cudaHostAllocMapped));
  return ptr;
}

void host_free(void* ptr) {
  PinContext pin;  // unpinning needs a context too (trim() from a fresh thread)
  GO_CUDA_CHECK(cudaFreeHost(ptr));
}

bool host_register(void* ptr, std::size_t num_bytes) {
  PinContext pin;
  if (cudaHostRegister(ptr, num_bytes, cudaHostRegisterPortable | cudaHostRegisterMapped) == cudaSuccess) {
    return true;
  }
  (void)cudaGetLastError();
  return false;
}

void host_unregister(void* ptr) {
  PinContext pin;
  GO_CUDA_CHECK(cudaHostUnregister(ptr));
}

Event::~Event() {
  // Destroying a recorded event is legal before it completes; resources are released once it does.
  // Under the event's device, so that a thread with no current device does not get one on GPU 0.
  if (handle_ == nullptr) return;
  try {
    DeviceGuard guard(device_);
    cudaEventDestroy(static_cast<cudaEvent_t>(handle_));
  } catch (...) {
    cudaEventDestroy(static_cast<cudaEvent_t>(handle_));
  }
}

bool Event::query() const {
  DeviceGuard guard(device_);
  cudaError_t status = cudaEventQuery(static_cast<cudaEvent_t>(handle_));
  if (status == cudaErrorNotReady) {
    (void)cudaGetLastError();
    return false;
  }
  GO_CUDA_CHECK(status);
  return true;
}

void Event::synchronize() const {
  DeviceGuard guard(device_);
  GO_CUDA_CHECK(cudaEventSynchronize(static_cast<cudaEvent_t>(handle_)));
}

bool is_mapped_host(int device, std::uintptr_t host_base) {
  DeviceGuard guard(device);  // a query in a thread with no current device would create one on GPU 0
  cudaPointerAttributes attrs = {};
  if (cudaPointerGetAttributes(&attrs, reinterpret_cast<void*>(host_base)) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return attrs.type == cudaMemoryTypeHost && attrs.devicePointer != nullptr;
}

std::vector<std::uintptr_t> engine_streams(int device) {
  DeviceStreams& ds = device_streams(device);
  return {reinterpret_cast<std::uintptr_t>(ds.streams[0]), reinterpret_cast<std::uintptr_t>(ds.streams[1]),
          reinterpret_cast<std::uintptr_t>(ds.kernel_streams[0]), reinterpret_cast<std::uintptr_t>(ds.kernel_streams[1])};
}

EventPtr copy_batch(int device, const Batch& batch, std::uintptr_t user_stream, const std::vector<EventPtr>& waits,
                    bool user_waits) {
  DeviceGuard guard(device);
  DeviceStreams& ds = device_streams(device);
  const int dir = batch.to_host ? 0 : 1;
  cudaStream_t stream = ds.streams[dir];
  cudaStream_t kernel_stream = ds.kernel_streams[dir];
  std::lock_guard<std::mutex> lock(ds.locks[dir]);
  auto user = reinterpret_cast<cudaStream_t>(user_stream);

  try {
    // Stream order: the batch starts after everything already enqueued on the caller's stream and after
    // the given events (e.g. the snapshot a restore reads).
    wait_and_drop(stream, record(user));
    for (const EventPtr& w : waits) {
      if (w) GO_CUDA_CHECK(cudaStreamWaitEvent(stream, static_cast<cudaEvent_t>(w->handle()), 0));
    }
    if (batch.kernel.size() != 0) {
      // Fork: the kernel runs on its own stream beside the copy engines; join before `done`.
      wait_and_drop(kernel_stream, record(stream));
      enqueue_kernel_copies(batch, kernel_stream, ds, dir);
      enqueue_engine_copies(batch.engine, batch.to_host, stream);
      wait_and_drop(stream, record(kernel_stream));
    } else {
      enqueue_engine_copies(batch.engine, batch.to_host, stream);
    }

    cudaEvent_t done = nullptr;
    GO_CUDA_CHECK(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
    auto event = std::make_shared<Event>(done, device);
    GO_CUDA_CHECK(cudaEventRecord(done, stream));
    if (user_waits) GO_CUDA_CHECK(cudaStreamWaitEvent(user, done, 0));
    return event;
  } catch (...) {
    // Part of the batch may be enqueued (a kernel launched, then the copy engines refused): wait for it,
    // so that the caller, which frees the host region on this error, frees nothing a copy still uses.
    // Rare, and an error path: blocking here is the simple way to be sure.
    if (cudaStreamSynchronize(kernel_stream) != cudaSuccess) (void)cudaGetLastError();
    if (cudaStreamSynchronize(stream) != cudaSuccess) (void)cudaGetLastError();
    throw;
  }
}

}  // namespace gpu_offload::cuda
