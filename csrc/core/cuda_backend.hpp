// The only door to CUDA. Declared without CUDA headers: cuda_backend.cpp implements it on the driver API
// (driver_api.hpp: libcuda loaded on first use, or the simulated driver), cuda_backend_stub.cpp stands in
// for a CPU-only build (GPU_OFFLOAD_CUDA=0). Nothing here touches the driver until a function is called:
// importing the module costs no CUDA call, and a machine without a driver runs the CPU path.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace gpu_offload::cuda {

bool compiled();               // this binary has the CUDA backend
bool available();              // a driver and at least one device answer (cached after the first call)
int device_count();
std::string architectures();   // the architectures of the embedded fatbin, e.g. "75-real,...,120"; "" without one

// Which kernels a device runs, once its streams exist (before that: source "not loaded").
struct DeviceKernelInfo {
  int device = 0;
  std::string source;  // "fatbin", "nvrtc", "nvrtc-cache", "simulated", "none"
  std::string arch;    // e.g. "sm_90"
  std::string error;   // why "none"
  int gather_regs = 0;
  int checksum_regs = 0;
};

// What runs, for build_info() and `gpu-offload info`: loads the driver (no context is created).
struct BackendInfo {
  bool driver = false;
  std::string driver_source;  // libcuda's path, or "simulated"
  std::string driver_error;
  int driver_version = 0;
  int device_count = 0;
  std::vector<std::string> entry_points;          // resolved
  std::vector<std::string> missing_entry_points;  // optional ones the driver lacks
  bool batched_copies = false;                    // cuMemcpyBatchAsync (driver 12.8 on), else per-copy cuMemcpyAsync
  std::string fatbin_architectures;
  std::string nvrtc_path;     // the libnvrtc NVRTC kernels come from (found on first need, or by this call)
  std::string nvrtc_version;  // e.g. "12.9"
  std::string nvrtc_error;
  std::string kernel_cache_dir;
  std::vector<DeviceKernelInfo> devices;  // devices whose streams exist
  std::size_t num_deferred_pins = 0;      // slabs pinned before any device was in use, not yet registered
  std::size_t num_failed_pins = 0;        // of those, registrations the driver refused (they stay pageable)
  std::string pin_error;
  std::size_t num_batch_fallbacks = 0;  // batches whose cuMemcpyBatchAsync was refused (copied one by one)
  std::string batch_error;              // the driver's last refusal
};
BackendInfo info();

// Where NVRTC may be: folders such as site-packages/nvidia/<component>/lib (set by the Python package).
void set_library_dirs(const std::vector<std::string>& dirs);

// Page-locked host memory, mapped into the device address space and usable from every device. Pinning
// needs a context: the calling thread's, else that of a device already in use. Before any device is in
// use, no context is created for it: the memory is mapped now and registered when a device's streams are
// first created, under that device's context (so a process that pins first and uses GPU 3 later never
// gets a context on GPU 0).
void* host_alloc(std::size_t num_bytes);
void host_free(void* ptr);
// Pins memory the caller already owns; false (and no exception) when the driver refuses, so callers can
// fall back to host_alloc.
bool host_register(void* ptr, std::size_t num_bytes);
void host_unregister(void* ptr);

// Completion of one submitted batch. Destroying an Event never blocks.
class Event {
 public:
  Event(void* handle, int device) : handle_(handle), device_(device) {}
  ~Event();
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  bool query() const;      // true once every copy of the batch has finished
  void synchronize() const;  // blocks the calling thread (sleeping, not spinning) until then
  void* handle() const { return handle_; }
  int device() const { return device_; }

 private:
  void* handle_;
  int device_;
};
using EventPtr = std::shared_ptr<Event>;

// One batch of copies between device memory and one host region. Copies in `engine` go through the copy
// engines (cuMemcpyBatchAsync where the driver has it, else cuMemcpyAsync each); copies in `kernel` are done by one gather/scatter kernel launch that
// reads or writes the region through its mapped device address (it must be pinned and mapped), which is
// what keeps many small tensors near the link limit. Both run at once, on two streams.
struct CopyList {
  std::vector<void*> dst;
  std::vector<const void*> src;
  std::vector<std::size_t> sizes;
  void push(void* d, const void* s, std::size_t n) {
    dst.push_back(d);
    src.push_back(s);
    sizes.push_back(n);
  }
  std::size_t size() const { return sizes.size(); }
};

struct Batch {
  bool to_host = true;
  std::uintptr_t host_base = 0;  // the host region every host address lies in
  CopyList engine;
  CopyList kernel;
};

// Enqueues the batch for `device`, ordered after the work already enqueued on user_stream and after every
// event in waits. When user_waits is set, user_stream waits (on the GPU) for the whole batch, so later
// work on it cannot overwrite what the copy still reads. When it throws, nothing of the batch is still
// running (what was enqueued has been waited for), so the caller may free the host region at once.
// A user_stream that is capturing a CUDA graph is refused before anything is enqueued.
EventPtr copy_batch(int device, const Batch& batch, std::uintptr_t user_stream, const std::vector<EventPtr>& waits,
                    bool user_waits);

// True when host_base lies in page-locked memory mapped into `device`'s address space.
bool is_mapped_host(int device, std::uintptr_t host_base);
// True when the batch's small copies can go through the gather kernel: the kernel is loaded on `device`
// and host_base is mapped there. Creates the device's streams (and loads its kernels) on first use.
bool can_gather(int device, std::uintptr_t host_base);

// The engine's streams on `device` (created on first use), as cudaStream_t integers: the copy engines'
// D2H and H2D streams, then the gather kernels' D2H and H2D streams. A caller that frees memory a batch
// may still read or write (torch's caching allocator) must order the reuse after these streams. Every
// batch's completion is recorded on its copy-engine stream after it has joined the kernel stream, so
// work recorded on a copy-engine stream later than a batch covers that batch's kernel too.
std::vector<std::uintptr_t> engine_streams(int device);

// Blocks (sleeping, in relaxed capture mode) until everything enqueued so far on `device`'s copy-engine and
// kernel streams of one direction has run. Nothing to wait for when the device's streams do not exist.
void engine_synchronize(int device, bool to_host);

}  // namespace gpu_offload::cuda
