// Stand-in for the CUDA backend in a CPU-only build (GPU_OFFLOAD_CUDA=0): reports no CUDA, refuses device
// work clearly.
#include "cuda_backend.hpp"
#include "errors.hpp"

namespace gpu_offload::cuda {

bool compiled() { return false; }
bool available() { return false; }
int device_count() { return 0; }
std::string architectures() { return ""; }
BackendInfo info() {
  BackendInfo i;
  i.driver_error = "gpu_offload was built without the CUDA backend (GPU_OFFLOAD_CUDA=0)";
  return i;
}
void set_library_dirs(const std::vector<std::string>&) {}

void* host_alloc(std::size_t) { GO_FAIL("gpu_offload was built without CUDA: cannot pin host memory"); }
void host_free(void*) {}
bool host_register(void*, std::size_t) { return false; }
void host_unregister(void*) {}

Event::~Event() = default;
bool Event::query() const { return true; }
void Event::synchronize() const {}

EventPtr copy_batch(int, const Batch&, std::uintptr_t, const std::vector<EventPtr>&, bool) {
  GO_FAIL("gpu_offload was built without CUDA (GPU_OFFLOAD_CUDA=0): rebuild without it to copy device memory");
}

bool is_mapped_host(int, std::uintptr_t) { return false; }
bool can_gather(int, std::uintptr_t) { return false; }

std::vector<std::uintptr_t> engine_streams(int) {
  GO_FAIL("gpu_offload was built without CUDA: it has no device streams");
}

void engine_synchronize(int, bool) {}

}  // namespace gpu_offload::cuda
