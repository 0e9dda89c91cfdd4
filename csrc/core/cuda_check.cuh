// Shared by the .cu files. GO_CUDA_CHECK: raises gpu_offload::Error with the file, line, failed call and the CUDA
// error's name and string, and clears the error so a later call does not see it again.
#pragma once

#include <cuda.h>  // types only: driver functions are reached through cudaGetDriverEntryPointByVersion
#include <cuda_runtime.h>

#include <cstddef>
#include <string>
#include <type_traits>

#include "errors.hpp"

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

// The few driver calls the runtime has no equivalent for: which context is current on this thread (the
// runtime's cudaGetDevice answers 0 for a thread that has none) and whether a device's primary context
// exists. Resolved once through the runtime, so nothing links against libcuda; null where unavailable.
struct DriverApi {
  CUresult (*ctx_get_current)(CUcontext*) = nullptr;
  CUresult (*ctx_set_current)(CUcontext) = nullptr;
  CUresult (*primary_ctx_get_state)(CUdevice, unsigned int*, int*) = nullptr;
};

inline const DriverApi& driver_api() {
  static const DriverApi api = [] {
    DriverApi a;
    const auto load = [](const char* name, auto& fn) {
      void* ptr = nullptr;
      cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
      if (cudaGetDriverEntryPointByVersion(name, &ptr, 12000, cudaEnableDefault, &found) == cudaSuccess &&
          found == cudaDriverEntryPointSuccess) {
        fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(ptr);
      } else {
        (void)cudaGetLastError();
      }
    };
    load("cuCtxGetCurrent", a.ctx_get_current);
    load("cuCtxSetCurrent", a.ctx_set_current);
    load("cuDevicePrimaryCtxGetState", a.primary_ctx_get_state);
    return a;
  }();
  return api;
}

// True when `device`'s primary context exists (making it current then creates nothing new).
inline bool has_primary_context(int device) {
  const DriverApi& d = driver_api();
  if (d.primary_ctx_get_state == nullptr) return true;  // cannot tell: behave as before
  unsigned int flags = 0;
  int active = 0;
  return d.primary_ctx_get_state(device, &flags, &active) == CUDA_SUCCESS && active != 0;
}

// Makes `device` current for the scope and afterwards puts back exactly the context that was current
// before, including none at all. (Restoring "device 0" in a thread that had no current device, as
// cudaGetDevice reports it, would create a ~500 MB context on GPU 0 in every rank of a multi-GPU job.)
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    const DriverApi& d = driver_api();
    if (d.ctx_get_current != nullptr && d.ctx_set_current != nullptr &&
        d.ctx_get_current(&previous_ctx_) == CUDA_SUCCESS) {
      exact_ = true;
    }
    int current = -1;
    GO_CUDA_CHECK(cudaGetDevice(&current));
    if (current != device || (exact_ && previous_ctx_ == nullptr)) {
      GO_CUDA_CHECK(cudaSetDevice(device));
      changed_ = true;
      previous_device_ = current;
    }
  }
  ~DeviceGuard() {
    if (!changed_) return;
    if (exact_) {
      driver_api().ctx_set_current(previous_ctx_);
    } else {
      cudaSetDevice(previous_device_);
    }
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  CUcontext previous_ctx_ = nullptr;
  int previous_device_ = 0;
  bool exact_ = false;
  bool changed_ = false;
};

// True when the calling thread has a current context (false also when that cannot be told).
inline bool thread_has_context() {
  const DriverApi& d = driver_api();
  CUcontext ctx = nullptr;
  return d.ctx_get_current != nullptr && d.ctx_get_current(&ctx) == CUDA_SUCCESS && ctx != nullptr;
}

// Kernel scratch (chunk tables, partial sums) in pinned host memory mapped into the device, with an event
// marking its last use: nothing is allocated on the device, which is full when people offload, and nothing
// outside torch's allocator. Grow-only pools keep them for the life of the process; an event never recorded
// queries as complete, so a fresh block is free at once.
struct MappedBlock {
  void* host = nullptr;
  void* device = nullptr;  // the same memory, as a kernel addresses it
  cudaEvent_t done = nullptr;
};

// Room for at least `n` items: powers of two from 256, so a pool holds few sizes.
inline std::size_t mapped_capacity(std::size_t n) {
  std::size_t capacity = 256;
  while (capacity < n) capacity *= 2;
  return capacity;
}

// A new block of `num_bytes` under the current device; nothing is leaked when a step fails.
inline MappedBlock alloc_mapped_block(std::size_t num_bytes) {
  MappedBlock b;
  GO_CUDA_CHECK(cudaHostAlloc(&b.host, num_bytes, cudaHostAllocPortable | cudaHostAllocMapped));
  cudaError_t status = cudaHostGetDevicePointer(&b.device, b.host, 0);
  if (status == cudaSuccess) status = cudaEventCreateWithFlags(&b.done, cudaEventDisableTiming);
  if (status != cudaSuccess) {
    cudaFreeHost(b.host);
    GO_CUDA_CHECK(status);
  }
  return b;
}

}  // namespace gpu_offload::cuda
