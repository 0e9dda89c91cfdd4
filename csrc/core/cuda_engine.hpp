// Internals shared by cuda_backend.cpp, checksum_cuda.cpp and kernel_loader.cpp: a device's engine (its
// streams and kernels), the kernel loader, and pinned mapped scratch blocks.
#pragma once

#include <array>
#include <cstddef>
#include <string>

#include "cuda_backend.hpp"
#include "driver_api.hpp"

namespace gpu_offload::cuda {

constexpr int kMaxDevices = 64;
// At most this many chunk tables per device and direction, and checksum scratch blocks per device: past
// it, a new batch waits for the oldest one's kernel instead of pinning more.
constexpr std::size_t kMaxPooledBlocks = 8;

struct Kernels {
  drv::CUfunction gather = nullptr;
  drv::CUfunction checksum = nullptr;
  DeviceKernelInfo info;
};

// Loads the kernel module on `device` (its context current): the embedded fatbin, else NVRTC (compiled for
// the device's architecture, cached on disk), else the simulator's stand-in where it offers one, else
// none. Never throws: without kernels the copy engines do every copy.
Kernels load_kernels(int device);
// NVRTC as found (path, version, or why not), searching on the first call.
struct NvrtcFound {
  std::string path;
  int major = 0;
  int minor = 0;
  std::string error;
};
const NvrtcFound& find_nvrtc();
std::string kernel_cache_dir();
bool has_fatbin();

// A device's engine, made on first use under its primary context: the copy engines' and the kernels'
// streams per direction (non-blocking, lowest priority), its SM count and its kernels, which are loaded
// here and never lazily inside a copy. First use also registers memory pinned before any device was in use.
struct Engine {
  std::array<drv::CUstream, 2> streams{};         // copy engines: D2H, H2D
  std::array<drv::CUstream, 2> kernel_streams{};  // gather/scatter kernels: D2H, H2D
  int num_sms = 0;
  Kernels kernels;
};
const Engine& engine(int device);
// The engine if it exists, else null (creates nothing).
const Engine* engine_if_created(int device);

// Raises a clear Error when `stream` (of `device`, current) is capturing a CUDA graph; call it before
// anything is enqueued.
void refuse_capture(drv::CUstream stream, int device, const char* what);

// Pinned host memory mapped into the device (the current context), with an event marking its last use.
// Nothing is allocated on the device, which is full when people offload.
struct MappedBlock {
  void* host = nullptr;
  drv::CUdeviceptr device = 0;  // the same memory, as a kernel addresses it
  drv::CUevent done = nullptr;
};
MappedBlock alloc_mapped_block(std::size_t num_bytes);
void free_mapped_block(MappedBlock& block);
// Room for at least `n` items: powers of two from 256, so a pool holds few sizes.
std::size_t mapped_capacity(std::size_t n);

}  // namespace gpu_offload::cuda
