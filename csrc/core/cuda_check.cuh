// GO_CUDA_CHECK for the .cu files: raises gpu_offload::Error with the file, line, failed call and the CUDA
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
