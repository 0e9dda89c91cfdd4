// A simulated CUDA driver behind the same table as libcuda (driver_api.hpp), so that the GPU path's logic
// (stream order, forks and joins, events, chunk-table reuse, error paths, several devices) runs in CI on
// a machine with no GPU. It keeps the semantics that matter to that logic:
//   * each stream is a worker thread running its queue in order; events mark a point in a stream's queue,
//     cross-stream waits block the waiting stream's worker until that point has run;
//   * "device" memory is host memory the simulator allocated (mem_alloc), tagged with its device;
//   * host registration is tracked: a kernel that touches host memory which is not registered and mapped
//     faults (CUDA_ERROR_ILLEGAL_ADDRESS, sticky, as on a GPU), and calls that need a current context
//     (registration, allocation, stream and event creation, copies) fail without one;
//   * primary contexts exist only once retained (or once mem_alloc touched the device, as torch would);
//   * kernels run the host versions of the same bodies (kernels.cuh), reading their chunk tables when they
//     execute, not when they are launched, as a GPU does;
//   * tests can delay every operation of a stream, hold a stream on a gate the host releases, capture a
//     stream (CUDA graph capture status and mode rules), make the Nth call of any entry point return a
//     chosen CUresult, or park the thread making it until the test releases it.
// The legacy stream (handle 0) is a plain stream of the current context here: its implicit
// synchronization with other blocking streams is not modelled (the engine's streams are non-blocking).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>

#include "driver_api.hpp"

namespace gpu_offload::sim {

struct Config {
  int num_devices = 1;
  int driver_version = 13000;  // what cuDriverGetVersion answers
  bool batch = true;           // cuMemcpyBatchAsync in the table (drivers before 12.8 lack it)
  int sm_count = 4;
  int cc_major = 9;
  int cc_minor = 0;
  // Which images cuModuleLoadData accepts: "builtin" also takes the simulator's own stand-in image (the
  // engine's kernel loader offers it when it has neither a fatbin nor NVRTC), "real" only a fatbin, cubin
  // or PTX, "off" none (every load fails, as on a GPU the fatbin does not cover).
  std::string kernels = "builtin";
};

// "2" or "devices=2,driver=12080,batch=0,sm=4,cc=90,kernels=real".
Config parse_config(const std::string& text);
// The simulator's table (one simulator per process, made on the first call).
const drv::DriverTable* make_table(const Config& config);
// Installs the simulator as the driver; false when a driver was already loaded in this process.
bool enable(const Config& config);
bool enabled();
const Config& config();

// The stand-in image for "builtin" kernels (it starts with this tag).
constexpr const char* kBuiltinImage = "GO-SIM-KERNELS";

// ---- test controls (the simulator must be enabled) ---------------------------------------------------
// Device memory of `device`, zero-filled and 512-byte aligned (as torch's allocator hands out blocks).
// Like torch's first allocation, it creates the device's primary context.
std::uintptr_t mem_alloc(int device, std::size_t num_bytes);
void mem_free(std::uintptr_t ptr);
// A user stream on `device` (like torch.cuda.Stream): non-blocking.
std::uintptr_t stream_create(int device);
// Holds `stream` at this point of its queue until release(); returns the gate's id.
std::uint64_t gate(std::uintptr_t stream);
void release(std::uint64_t gate_id);
// Sleeps `seconds` before every copy, kernel and fill that `stream` runs (0 removes the delay).
void set_delay(std::uintptr_t stream, double seconds);
// Device work on a stream: writes `num_bytes` bytes of `value` at `ptr` when the stream gets there (what a
// kernel of the user's would do). `stream` 0 is the legacy stream of `device`'s primary context.
void enqueue_fill(int device, std::uintptr_t stream, std::uintptr_t ptr, unsigned char value, std::size_t num_bytes);
// Runs fn on the stream's worker when the stream gets there (C++ tests).
void enqueue_host(int device, std::uintptr_t stream, std::function<void()> fn);
// Waits until every stream has run everything enqueued so far (gates must be released first).
void synchronize();
// Parks the calling thread in the nth call (1 = the next one) of `entry` until release() of the returned
// gate, or until `timeout_seconds` have passed (so that a test of a thread that can no longer release it
// ends instead of hanging); the call then goes ahead.
std::uint64_t block(const std::string& entry, int nth, double timeout_seconds);
// True while a call parked by block() waits on `gate_id`.
bool parked(std::uint64_t gate_id);
// The nth call (1 = the next one) of `entry` (e.g. "cuMemcpyAsync") returns `result` and does nothing.
void fail(const std::string& entry, int nth, int result);
void clear_failures();
// Calls of `entry` so far.
std::size_t calls(const std::string& entry);
// Starts or ends a capture of `stream` (mode: drv::kCaptureMode*); a capture the engine broke reports
// status invalidated. capture_status answers drv::kCaptureStatus*.
void begin_capture(std::uintptr_t stream, int mode);
void end_capture(std::uintptr_t stream);
int capture_status(std::uintptr_t stream);
// The device's sticky error (0: none): a kernel that faulted sets it.
int sticky_error(int device);
void clear_sticky_error(int device);
// Whether [ptr, ptr + num_bytes) lies in host memory registered (or allocated) as mapped.
bool host_mapped(std::uintptr_t ptr, std::size_t num_bytes);
// Kernels launched so far (all devices).
std::size_t kernel_launches();
// cuEventSynchronize calls on events made without CU_EVENT_BLOCKING_SYNC (the real driver spins a core in those).
std::size_t spinning_waits();

}  // namespace gpu_offload::sim
