// The CUDA driver, as one table of entry points (the model is PyTorch's c10/cuda/driver_api). The table is
// filled on first use: from libcuda.so.1 (dlopen, then cuGetProcAddress with an explicit ABI version for
// every entry, so one binary behaves the same on every driver from R535 on), or from the simulated driver
// (sim_driver.hpp) when a test asked for it before that. Nothing here includes a CUDA header: the types and
// prototypes are declared below, with the struct tags cuda.h uses, so the module builds with g++ alone and
// csrc/tests/driver_abi_check.cpp can prove every declaration against cuda.h of each CUDA version.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

// The handle types, as cuda.h names them (a unit that includes both sees the very same types).
struct CUctx_st;
struct CUstream_st;
struct CUevent_st;
struct CUmod_st;
struct CUfunc_st;

namespace gpu_offload::drv {

using CUresult = int;  // an enum in cuda.h (the same size)
using CUdevice = int;
using CUdeviceptr = unsigned long long;
using CUcontext = CUctx_st*;
using CUstream = CUstream_st*;
using CUevent = CUevent_st*;
using CUmodule = CUmod_st*;
using CUfunction = CUfunc_st*;

// CUmemLocation and CUmemcpyAttributes_v1 (cuMemcpyBatchAsync, 12.8 on).
struct MemLocation {
  int type;
  int id;
};
struct MemcpyAttributes {
  int srcAccessOrder;
  MemLocation srcLocHint;
  MemLocation dstLocHint;
  unsigned int flags;
};

// Result codes used by name here (cuda.h's values; the ABI check compares them).
constexpr CUresult kSuccess = 0;
constexpr CUresult kErrorInvalidValue = 1;
constexpr CUresult kErrorOutOfMemory = 2;
constexpr CUresult kErrorNotInitialized = 3;
constexpr CUresult kErrorNoDevice = 100;
constexpr CUresult kErrorInvalidDevice = 101;
constexpr CUresult kErrorInvalidImage = 200;
constexpr CUresult kErrorInvalidContext = 201;
constexpr CUresult kErrorNoBinaryForGpu = 209;
constexpr CUresult kErrorInvalidHandle = 400;
constexpr CUresult kErrorNotFound = 500;
constexpr CUresult kErrorNotReady = 600;
constexpr CUresult kErrorIllegalAddress = 700;
constexpr CUresult kErrorHostMemoryAlreadyRegistered = 712;
constexpr CUresult kErrorHostMemoryNotRegistered = 713;
constexpr CUresult kErrorLaunchFailed = 719;
constexpr CUresult kErrorNotSupported = 801;
constexpr CUresult kErrorStreamCaptureUnsupported = 900;
constexpr CUresult kErrorStreamCaptureInvalidated = 901;
constexpr CUresult kErrorStreamCaptureImplicit = 906;
constexpr CUresult kErrorCapturedEvent = 907;
constexpr CUresult kErrorUnknown = 999;

// Flags and enumerators.
constexpr unsigned kStreamNonBlocking = 0x1;
constexpr unsigned kEventBlockingSync = 0x1;
constexpr unsigned kEventDisableTiming = 0x2;
constexpr unsigned kHostAllocPortable = 0x1;
constexpr unsigned kHostAllocDeviceMap = 0x2;
constexpr unsigned kHostRegisterPortable = 0x1;
constexpr unsigned kHostRegisterDeviceMap = 0x2;
constexpr int kPointerAttributeMemoryType = 2;
constexpr int kPointerAttributeDevicePointer = 3;
constexpr int kPointerAttributeDeviceOrdinal = 9;
constexpr unsigned kMemoryTypeHost = 1;
constexpr unsigned kMemoryTypeDevice = 2;
constexpr int kDeviceAttributeMultiprocessorCount = 16;
constexpr int kDeviceAttributeComputeCapabilityMajor = 75;
constexpr int kDeviceAttributeComputeCapabilityMinor = 76;
constexpr int kFuncAttributeNumRegs = 4;
constexpr int kCaptureStatusNone = 0;
constexpr int kCaptureStatusActive = 1;
constexpr int kCaptureStatusInvalidated = 2;
constexpr int kCaptureModeGlobal = 0;
constexpr int kCaptureModeThreadLocal = 1;
constexpr int kCaptureModeRelaxed = 2;
constexpr int kMemcpySrcAccessOrderStream = 1;
constexpr unsigned long long kGetProcAddressLegacyStream = 1;  // stream 0 is the legacy stream, as in torch
constexpr int kGetProcAddressSuccess = 0;

// Every entry point the engine calls. The member names carry a trailing underscore so that cuda.h's
// macros (cuMemHostRegister -> cuMemHostRegister_v2, ...) cannot rename them where both are visible.
// X(name, ABI version asked of cuGetProcAddress, required)
#define GO_DRIVER_ENTRY_POINTS(X)                 \
  X(cuInit, 2000, true)                           \
  X(cuDriverGetVersion, 2020, true)               \
  X(cuGetErrorName, 6000, true)                   \
  X(cuGetErrorString, 6000, true)                 \
  X(cuDeviceGetCount, 2000, true)                 \
  X(cuDeviceGet, 2000, true)                      \
  X(cuDeviceGetAttribute, 2000, true)             \
  X(cuDevicePrimaryCtxRetain, 7000, true)         \
  X(cuDevicePrimaryCtxRelease, 11000, true)       \
  X(cuDevicePrimaryCtxGetState, 7000, true)       \
  X(cuCtxGetCurrent, 4000, true)                  \
  X(cuCtxSetCurrent, 4000, true)                  \
  X(cuCtxGetStreamPriorityRange, 5050, true)      \
  X(cuStreamCreateWithPriority, 5050, true)       \
  X(cuStreamWaitEvent, 3020, true)                \
  X(cuStreamSynchronize, 2000, true)              \
  X(cuStreamIsCapturing, 10000, true)             \
  X(cuStreamGetCaptureInfo, 10010, false)         \
  X(cuThreadExchangeStreamCaptureMode, 10010, true) \
  X(cuEventCreate, 2000, true)                    \
  X(cuEventRecord, 2000, true)                    \
  X(cuEventQuery, 2000, true)                     \
  X(cuEventSynchronize, 2000, true)               \
  X(cuEventDestroy, 4000, true)                   \
  X(cuMemcpyAsync, 4000, true)                    \
  X(cuMemcpyBatchAsync, 12080, false)             \
  X(cuMemHostAlloc, 2020, true)                   \
  X(cuMemFreeHost, 2000, true)                    \
  X(cuMemHostRegister, 6050, true)                \
  X(cuMemHostUnregister, 4000, true)              \
  X(cuMemHostGetDevicePointer, 3020, true)        \
  X(cuPointerGetAttribute, 4000, true)            \
  X(cuModuleLoadData, 2000, true)                 \
  X(cuModuleGetFunction, 2000, true)              \
  X(cuFuncGetAttribute, 2020, true)               \
  X(cuLaunchKernel, 4000, true)

struct DriverTable {
  CUresult (*cuInit_)(unsigned int flags) = nullptr;
  CUresult (*cuDriverGetVersion_)(int* version) = nullptr;
  CUresult (*cuGetErrorName_)(CUresult error, const char** name) = nullptr;
  CUresult (*cuGetErrorString_)(CUresult error, const char** text) = nullptr;
  CUresult (*cuDeviceGetCount_)(int* count) = nullptr;
  CUresult (*cuDeviceGet_)(CUdevice* device, int ordinal) = nullptr;
  CUresult (*cuDeviceGetAttribute_)(int* value, int attribute, CUdevice device) = nullptr;
  CUresult (*cuDevicePrimaryCtxRetain_)(CUcontext* ctx, CUdevice device) = nullptr;
  CUresult (*cuDevicePrimaryCtxRelease_)(CUdevice device) = nullptr;
  CUresult (*cuDevicePrimaryCtxGetState_)(CUdevice device, unsigned int* flags, int* active) = nullptr;
  CUresult (*cuCtxGetCurrent_)(CUcontext* ctx) = nullptr;
  CUresult (*cuCtxSetCurrent_)(CUcontext ctx) = nullptr;
  CUresult (*cuCtxGetStreamPriorityRange_)(int* least, int* greatest) = nullptr;
  CUresult (*cuStreamCreateWithPriority_)(CUstream* stream, unsigned int flags, int priority) = nullptr;
  CUresult (*cuStreamWaitEvent_)(CUstream stream, CUevent event, unsigned int flags) = nullptr;
  CUresult (*cuStreamSynchronize_)(CUstream stream) = nullptr;
  CUresult (*cuStreamIsCapturing_)(CUstream stream, int* status) = nullptr;
  CUresult (*cuStreamGetCaptureInfo_)(CUstream stream, int* status, unsigned long long* id) = nullptr;
  CUresult (*cuThreadExchangeStreamCaptureMode_)(int* mode) = nullptr;
  CUresult (*cuEventCreate_)(CUevent* event, unsigned int flags) = nullptr;
  CUresult (*cuEventRecord_)(CUevent event, CUstream stream) = nullptr;
  CUresult (*cuEventQuery_)(CUevent event) = nullptr;
  CUresult (*cuEventSynchronize_)(CUevent event) = nullptr;
  CUresult (*cuEventDestroy_)(CUevent event) = nullptr;
  CUresult (*cuMemcpyAsync_)(CUdeviceptr dst, CUdeviceptr src, std::size_t num_bytes, CUstream stream) = nullptr;
  // The 12.8 ABI (with failIdx), which 13.x drivers still serve when asked for version 12080.
  CUresult (*cuMemcpyBatchAsync_)(CUdeviceptr* dsts, CUdeviceptr* srcs, std::size_t* sizes, std::size_t count,
                                  MemcpyAttributes* attrs, std::size_t* attr_idxs, std::size_t num_attrs,
                                  std::size_t* fail_idx, CUstream stream) = nullptr;
  CUresult (*cuMemHostAlloc_)(void** ptr, std::size_t num_bytes, unsigned int flags) = nullptr;
  CUresult (*cuMemFreeHost_)(void* ptr) = nullptr;
  CUresult (*cuMemHostRegister_)(void* ptr, std::size_t num_bytes, unsigned int flags) = nullptr;
  CUresult (*cuMemHostUnregister_)(void* ptr) = nullptr;
  CUresult (*cuMemHostGetDevicePointer_)(CUdeviceptr* device_ptr, void* host_ptr, unsigned int flags) = nullptr;
  CUresult (*cuPointerGetAttribute_)(void* data, int attribute, CUdeviceptr ptr) = nullptr;
  CUresult (*cuModuleLoadData_)(CUmodule* module, const void* image) = nullptr;
  CUresult (*cuModuleGetFunction_)(CUfunction* function, CUmodule module, const char* name) = nullptr;
  CUresult (*cuFuncGetAttribute_)(int* value, int attribute, CUfunction function) = nullptr;
  CUresult (*cuLaunchKernel_)(CUfunction f, unsigned int grid_x, unsigned int grid_y, unsigned int grid_z,
                              unsigned int block_x, unsigned int block_y, unsigned int block_z,
                              unsigned int shared_bytes, CUstream stream, void** params, void** extra) = nullptr;
};

// What was loaded, for build_info() and `gpu-offload info`.
struct DriverState {
  const DriverTable* table = nullptr;  // null: no usable driver (the CPU path still works)
  std::string source;                  // the library's path, or "simulated"
  std::string error;                   // why there is no driver, when there is none
  int version = 0;                     // cuDriverGetVersion, e.g. 12080
  int device_count = 0;
  std::vector<std::string> found;      // entry points resolved
  std::vector<std::string> missing;    // optional entry points the driver lacks
  bool batched_copies = false;         // cuMemcpyBatchAsync used (driver 12.8 or later)
};

// Loads the driver on the first call (thread-safe); never throws.
const DriverState& driver_state();
// The table, or Error saying why there is none.
const DriverTable& api();
// True once driver_state() has run (in this process): a simulated driver can no longer be installed.
bool driver_loaded();
// Installs `table` as the driver (the simulator) instead of libcuda; false when a driver was already loaded.
bool install_driver(const DriverTable* table, int version, const std::string& source);

// The name and text of a result, e.g. "CUDA_ERROR_NOT_READY: device not ready".
std::string describe(CUresult result);
// Raises gpu_offload::Error with the file, line, failed call and the driver's error name and text.
[[noreturn]] void throw_cu_error(const char* file, int line, const char* call, CUresult result);

#define GO_CU_CHECK(call)                                                           \
  do {                                                                              \
    const ::gpu_offload::drv::CUresult go_status_ = (call);                         \
    if (go_status_ != ::gpu_offload::drv::kSuccess) {                               \
      ::gpu_offload::drv::throw_cu_error(__FILE__, __LINE__, #call, go_status_);    \
    }                                                                               \
  } while (0)

// GO_CU(cuEventRecord, event, stream): calls the table's entry, raising Error when it fails.
#define GO_CU(name, ...) GO_CU_CHECK(::gpu_offload::drv::api().name##_(__VA_ARGS__))
// The same, returning the result instead of raising.
#define GO_CU_TRY(name, ...) (::gpu_offload::drv::api().name##_(__VA_ARGS__))

// The primary context of `device` (the one torch's runtime uses), retained once and kept for the life of
// the process. Retaining creates it when it does not exist yet: call this only for a device the caller's
// memory is on (it exists then).
CUcontext primary_context(int device);
// True when `device`'s primary context exists; creates nothing.
bool primary_context_active(int device);

// Makes `device`'s primary context current for the scope and afterwards puts back exactly the context that
// was current before, none included.
class ContextGuard {
 public:
  explicit ContextGuard(int device);
  ~ContextGuard();
  ContextGuard(const ContextGuard&) = delete;
  ContextGuard& operator=(const ContextGuard&) = delete;

 private:
  CUcontext previous_ = nullptr;
  bool changed_ = false;
};

// Switches the calling thread to relaxed stream-capture mode for the scope: a query or synchronize from a
// helper thread then cannot invalidate a CUDA graph another thread is capturing in global mode.
class RelaxedCaptureMode {
 public:
  RelaxedCaptureMode();
  ~RelaxedCaptureMode();
  RelaxedCaptureMode(const RelaxedCaptureMode&) = delete;
  RelaxedCaptureMode& operator=(const RelaxedCaptureMode&) = delete;

 private:
  int previous_ = kCaptureModeGlobal;
  bool changed_ = false;
};

}  // namespace gpu_offload::drv
