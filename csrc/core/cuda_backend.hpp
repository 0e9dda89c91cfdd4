// The only door to CUDA. Declared without CUDA headers so the arena and the CPU copy path compile and run
// in a build without nvcc; cuda_backend.cu implements it, cuda_backend_stub.cpp stands in otherwise.
// Nothing here touches the driver until a function is called: importing the module costs no CUDA call.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace gpu_offload::cuda {

bool compiled();               // this binary was built with CUDA code
bool available();              // a driver and at least one device answer (cached after the first call)
int device_count();
int runtime_version();         // e.g. 13000; 0 without CUDA
std::string architectures();   // the architectures the kernels were compiled for, e.g. "80-real,90"

// Page-locked host memory, mapped into the device address space and usable from every device.
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
  void synchronize() const;  // blocks the calling thread (without the GIL) until then
  void* handle() const { return handle_; }
  int device() const { return device_; }

 private:
  void* handle_;
  int device_;
};
using EventPtr = std::shared_ptr<Event>;

// One batch of copies between device memory and one host region. Copies in `engine` go through the copy
// engines (cudaMemcpyBatchAsync); copies in `kernel` are done by one gather/scatter kernel launch that
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
EventPtr copy_batch(int device, const Batch& batch, std::uintptr_t user_stream, const std::vector<EventPtr>& waits,
                    bool user_waits);

// True when host_base lies in page-locked memory mapped into `device`'s address space.
bool is_mapped_host(int device, std::uintptr_t host_base);

// The engine's streams on `device` (created on first use), as cudaStream_t integers: the copy engines'
// D2H and H2D streams, then the gather kernels' D2H and H2D streams. A caller that frees memory a batch
// may still read or write (torch's caching allocator) must order the reuse after these streams. Every
// batch's completion is recorded on its copy-engine stream after it has joined the kernel stream, so
// work recorded on a copy-engine stream later than a batch covers that batch's kernel too.
std::vector<std::uintptr_t> engine_streams(int device);

}  // namespace gpu_offload::cuda
