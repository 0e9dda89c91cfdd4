// Shared by the .cu files. GO_CUDA_CHECK: raises gpu_offload::Error with the file, line, failed call and the CUDA
// error's name and string, and clears the error so a later call does not see it again.
#pragma once

#include <cuda_runtime.h>

#include <string>

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

}  // namespace gpu_offload::cuda
