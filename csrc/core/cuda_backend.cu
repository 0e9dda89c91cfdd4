// CUDA implementation of cuda_backend.hpp: streams per device and direction, batched async copies, events.
#include <cuda_runtime.h>

#include <array>
#include <mutex>
#include <string>

#include "cuda_backend.hpp"
#include "errors.hpp"

#ifndef GPU_OFFLOAD_CUDA_ARCHS
#define GPU_OFFLOAD_CUDA_ARCHS "unknown"
#endif

// Raises with the CUDA error's name and string, and clears it so a later call does not see it again.
#define GO_CUDA_CHECK(call)                                                                     \
  do {                                                                                          \
    cudaError_t status_ = (call);                                                               \
    if (status_ != cudaSuccess) {                                                               \
      (void)cudaGetLastError();                                                                 \
      ::gpu_offload::throw_error(__FILE__, __LINE__, #call,                                     \
                                 std::string("CUDA error ") + cudaGetErrorName(status_) + ": " + \
                                     cudaGetErrorString(status_));                              \
    }                                                                                           \
  } while (0)

namespace gpu_offload::cuda {
namespace {

constexpr int kMaxDevices = 64;

// Makes `device` current for the scope and puts the caller's device back afterwards.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    GO_CUDA_CHECK(cudaGetDevice(&previous_));
    if (previous_ != device) GO_CUDA_CHECK(cudaSetDevice(device));
  }
  ~DeviceGuard() { cudaSetDevice(previous_); }

 private:
  int previous_ = 0;
};

// One non-blocking stream per device and direction, so D2H and H2D run on both copy engines at once.
// Created on first use; never destroyed (they live as long as the process, like torch's pool streams).
struct DeviceStreams {
  std::once_flag once;
  std::array<cudaStream_t, 2> streams{};
  std::array<std::mutex, 2> locks;  // one batch at a time per stream keeps the enqueue order simple
};
std::array<DeviceStreams, kMaxDevices> g_streams;

cudaStream_t engine_stream(int device, bool to_host) {
  GO_CHECK(device >= 0 && device < kMaxDevices, "device index out of range: " + std::to_string(device));
  DeviceStreams& ds = g_streams[device];
  std::call_once(ds.once, [&] {
    DeviceGuard guard(device);
    int least = 0, greatest = 0;
    GO_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
    for (auto& s : ds.streams) GO_CUDA_CHECK(cudaStreamCreateWithPriority(&s, cudaStreamNonBlocking, least));
  });
  return ds.streams[to_host ? 0 : 1];
}

void enqueue_copies(void* const* dst, const void* const* src, const std::size_t* sizes, std::size_t n,
                    bool to_host, cudaStream_t stream) {
  const cudaMemcpyKind kind = to_host ? cudaMemcpyDeviceToHost : cudaMemcpyHostToDevice;
  if (n > 1) {
    // One call for the whole batch: the driver packs the descriptors, which is what makes many small
    // copies cheap on the host side. Falls back to a loop where the driver does not support it.
    cudaMemcpyAttributes attrs = {};
    attrs.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
    std::size_t attrs_index = 0;
    cudaError_t status = cudaMemcpyBatchAsync(dst, src, sizes, n, &attrs, &attrs_index, 1, stream);
    if (status == cudaSuccess) return;
    (void)cudaGetLastError();
  }
  for (std::size_t i = 0; i < n; ++i) {
    if (sizes[i] != 0) GO_CUDA_CHECK(cudaMemcpyAsync(dst[i], src[i], sizes[i], kind, stream));
  }
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

void* host_alloc(std::size_t num_bytes) {
  void* ptr = nullptr;
  GO_CUDA_CHECK(cudaHostAlloc(&ptr, num_bytes, cudaHostAllocPortable | cudaHostAllocMapped));
  return ptr;
}

void host_free(void* ptr) { GO_CUDA_CHECK(cudaFreeHost(ptr)); }

bool host_register(void* ptr, std::size_t num_bytes) {
  if (cudaHostRegister(ptr, num_bytes, cudaHostRegisterPortable | cudaHostRegisterMapped) == cudaSuccess) {
    return true;
  }
  (void)cudaGetLastError();
  return false;
}

void host_unregister(void* ptr) { GO_CUDA_CHECK(cudaHostUnregister(ptr)); }

Event::~Event() {
  // Destroying a recorded event is legal before it completes; resources are released once it does.
  if (handle_ != nullptr) cudaEventDestroy(static_cast<cudaEvent_t>(handle_));
}

bool Event::query() const {
  cudaError_t status = cudaEventQuery(static_cast<cudaEvent_t>(handle_));
  if (status == cudaErrorNotReady) {
    (void)cudaGetLastError();
    return false;
  }
  GO_CUDA_CHECK(status);
  return true;
}

void Event::synchronize() const { GO_CUDA_CHECK(cudaEventSynchronize(static_cast<cudaEvent_t>(handle_))); }

EventPtr copy_batch(int device, bool to_host, void* const* dst, const void* const* src,
                    const std::size_t* sizes, std::size_t n, std::uintptr_t user_stream,
                    const std::vector<EventPtr>& waits, bool user_waits) {
  DeviceGuard guard(device);
  cudaStream_t stream = engine_stream(device, to_host);
  std::lock_guard<std::mutex> lock(g_streams[device].locks[to_host ? 0 : 1]);
  auto user = reinterpret_cast<cudaStream_t>(user_stream);

  // Stream order: the copy starts after everything already enqueued on the caller's stream.
  cudaEvent_t ready = nullptr;
  GO_CUDA_CHECK(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming));
  cudaError_t status = cudaEventRecord(ready, user);
  if (status == cudaSuccess) status = cudaStreamWaitEvent(stream, ready, 0);
  cudaEventDestroy(ready);
  GO_CUDA_CHECK(status);
  for (const EventPtr& w : waits) {
    if (w) GO_CUDA_CHECK(cudaStreamWaitEvent(stream, static_cast<cudaEvent_t>(w->handle()), 0));
  }

  enqueue_copies(dst, src, sizes, n, to_host, stream);

  cudaEvent_t done = nullptr;
  GO_CUDA_CHECK(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
  auto event = std::make_shared<Event>(done, device);
  GO_CUDA_CHECK(cudaEventRecord(done, stream));
  if (user_waits) GO_CUDA_CHECK(cudaStreamWaitEvent(user, done, 0));
  return event;
}

}  // namespace gpu_offload::cuda
