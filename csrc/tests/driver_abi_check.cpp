// Compile-time proof that driver_api.hpp declares the driver as cuda.h does: every entry point's type against
// cuda.h's PFN_<name>_v<version> for the version the table asks cuGetProcAddress for (so the ABI we call is
// the ABI we get), every constant's value, the batched-copy attributes' layout. Built against the headers
// of each CUDA version CI has (the local toolkit, PyPI's nvidia-cuda-runtime-cu12 12.6, 12.8, 12.9); it
// produces no code. Enums and integers of the same size count as the same type (the ABI passes them alike).
#include <cuda.h>
#include <cudaTypedefs.h>

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "driver_api.hpp"

namespace abi {

namespace drv = gpu_offload::drv;

template <class T>
using canonical_int = std::conditional_t<sizeof(T) == 4, std::uint32_t, std::conditional_t<sizeof(T) == 8, std::uint64_t, T>>;

template <class T, class = void>
struct norm {
  using type = T;
};
template <class T>
using norm_t = typename norm<std::remove_cv_t<T>>::type;
template <class T>
struct norm<T, std::enable_if_t<std::is_enum_v<T> || std::is_integral_v<T>>> {
  using type = canonical_int<T>;
};
template <class T>
struct norm<T*, void> {
  using type = norm_t<T>*;
};
template <class R, class... A>
struct norm<R (*)(A...), void> {
  using type = norm_t<R> (*)(norm_t<A>...);
};
#if CUDA_VERSION >= 12080
template <>
struct norm<drv::MemcpyAttributes, void> {
  using type = CUmemcpyAttributes_v1;
};
static_assert(sizeof(drv::MemcpyAttributes) == sizeof(CUmemcpyAttributes_v1));
static_assert(offsetof(drv::MemcpyAttributes, srcAccessOrder) == offsetof(CUmemcpyAttributes_v1, srcAccessOrder));
static_assert(offsetof(drv::MemcpyAttributes, srcLocHint) == offsetof(CUmemcpyAttributes_v1, srcLocHint));
static_assert(offsetof(drv::MemcpyAttributes, dstLocHint) == offsetof(CUmemcpyAttributes_v1, dstLocHint));
static_assert(offsetof(drv::MemcpyAttributes, flags) == offsetof(CUmemcpyAttributes_v1, flags));
static_assert(sizeof(drv::MemLocation) == sizeof(CUmemLocation));
static_assert(drv::kMemcpySrcAccessOrderStream == CU_MEMCPY_SRC_ACCESS_ORDER_STREAM);
#else
// These headers predate cuMemcpyBatchAsync: nothing to compare (drivers of that age lack it, and the table
// then leaves it null).
#define PFN_cuMemcpyBatchAsync_v12080 decltype(gpu_offload::drv::DriverTable::cuMemcpyBatchAsync_)
#endif

#define GO_ABI_CHECK(name, version, required)                                                        \
  static_assert(std::is_same_v<norm_t<decltype(drv::DriverTable::name##_)>, norm_t<PFN_##name##_v##version>>, \
                #name " differs from cuda.h's PFN_" #name "_v" #version);
GO_DRIVER_ENTRY_POINTS(GO_ABI_CHECK)
#undef GO_ABI_CHECK

static_assert(std::is_same_v<drv::CUcontext, CUcontext>);
static_assert(std::is_same_v<drv::CUstream, CUstream>);
static_assert(std::is_same_v<drv::CUevent, CUevent>);
static_assert(std::is_same_v<drv::CUmodule, CUmodule>);
static_assert(std::is_same_v<drv::CUfunction, CUfunction>);
static_assert(std::is_same_v<drv::CUdeviceptr, CUdeviceptr>);
static_assert(std::is_same_v<drv::CUdevice, CUdevice>);

static_assert(drv::kSuccess == CUDA_SUCCESS);
static_assert(drv::kErrorInvalidValue == CUDA_ERROR_INVALID_VALUE);
static_assert(drv::kErrorOutOfMemory == CUDA_ERROR_OUT_OF_MEMORY);
static_assert(drv::kErrorNotInitialized == CUDA_ERROR_NOT_INITIALIZED);
static_assert(drv::kErrorNoDevice == CUDA_ERROR_NO_DEVICE);
static_assert(drv::kErrorInvalidDevice == CUDA_ERROR_INVALID_DEVICE);
static_assert(drv::kErrorInvalidImage == CUDA_ERROR_INVALID_IMAGE);
static_assert(drv::kErrorInvalidContext == CUDA_ERROR_INVALID_CONTEXT);
static_assert(drv::kErrorNoBinaryForGpu == CUDA_ERROR_NO_BINARY_FOR_GPU);
static_assert(drv::kErrorInvalidHandle == CUDA_ERROR_INVALID_HANDLE);
static_assert(drv::kErrorNotFound == CUDA_ERROR_NOT_FOUND);
static_assert(drv::kErrorNotReady == CUDA_ERROR_NOT_READY);
static_assert(drv::kErrorIllegalAddress == CUDA_ERROR_ILLEGAL_ADDRESS);
static_assert(drv::kErrorHostMemoryAlreadyRegistered == CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED);
static_assert(drv::kErrorHostMemoryNotRegistered == CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED);
static_assert(drv::kErrorLaunchFailed == CUDA_ERROR_LAUNCH_FAILED);
static_assert(drv::kErrorNotSupported == CUDA_ERROR_NOT_SUPPORTED);
static_assert(drv::kErrorStreamCaptureUnsupported == CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
static_assert(drv::kErrorStreamCaptureInvalidated == CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);
static_assert(drv::kErrorStreamCaptureImplicit == CUDA_ERROR_STREAM_CAPTURE_IMPLICIT);
static_assert(drv::kErrorCapturedEvent == CUDA_ERROR_CAPTURED_EVENT);
static_assert(drv::kErrorUnknown == CUDA_ERROR_UNKNOWN);

static_assert(drv::kStreamNonBlocking == CU_STREAM_NON_BLOCKING);
static_assert(drv::kEventBlockingSync == CU_EVENT_BLOCKING_SYNC);
static_assert(drv::kEventDisableTiming == CU_EVENT_DISABLE_TIMING);
static_assert(drv::kHostAllocPortable == CU_MEMHOSTALLOC_PORTABLE);
static_assert(drv::kHostAllocDeviceMap == CU_MEMHOSTALLOC_DEVICEMAP);
static_assert(drv::kHostRegisterPortable == CU_MEMHOSTREGISTER_PORTABLE);
static_assert(drv::kHostRegisterDeviceMap == CU_MEMHOSTREGISTER_DEVICEMAP);
static_assert(drv::kPointerAttributeMemoryType == CU_POINTER_ATTRIBUTE_MEMORY_TYPE);
static_assert(drv::kPointerAttributeDevicePointer == CU_POINTER_ATTRIBUTE_DEVICE_POINTER);
static_assert(drv::kPointerAttributeDeviceOrdinal == CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL);
static_assert(drv::kMemoryTypeHost == CU_MEMORYTYPE_HOST);
static_assert(drv::kMemoryTypeDevice == CU_MEMORYTYPE_DEVICE);
static_assert(drv::kDeviceAttributeMultiprocessorCount == CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT);
static_assert(drv::kDeviceAttributeComputeCapabilityMajor == CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR);
static_assert(drv::kDeviceAttributeComputeCapabilityMinor == CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR);
static_assert(drv::kFuncAttributeNumRegs == CU_FUNC_ATTRIBUTE_NUM_REGS);
static_assert(drv::kCaptureStatusNone == CU_STREAM_CAPTURE_STATUS_NONE);
static_assert(drv::kCaptureStatusActive == CU_STREAM_CAPTURE_STATUS_ACTIVE);
static_assert(drv::kCaptureStatusInvalidated == CU_STREAM_CAPTURE_STATUS_INVALIDATED);
static_assert(drv::kCaptureModeGlobal == CU_STREAM_CAPTURE_MODE_GLOBAL);
static_assert(drv::kCaptureModeThreadLocal == CU_STREAM_CAPTURE_MODE_THREAD_LOCAL);
static_assert(drv::kCaptureModeRelaxed == CU_STREAM_CAPTURE_MODE_RELAXED);
static_assert(drv::kGetProcAddressLegacyStream == CU_GET_PROC_ADDRESS_LEGACY_STREAM);
static_assert(drv::kGetProcAddressSuccess == CU_GET_PROC_ADDRESS_SUCCESS);

}  // namespace abi
