// Stand-in for cuda_backend.cu in a build without nvcc: reports no CUDA, refuses device work clearly.
#include "cuda_backend.hpp"
#include "errors.hpp"

namespace gpu_offload::cuda {

bool compiled() { return false; }
bool available() { return false; }
int device_count() { return 0; }
int runtime_version() { return 0; }
std::string architectures() { return ""; }

void* host_alloc(std::size_t) { GO_FAIL("gpu_offload was built without CUDA: cannot pin host memory"); }
void host_free(void*) {}
bool host_register(void*, std::size_t) { return false; }
void host_unregister(void*) {}

Event::~Event() = default;
bool Event::query() const { return true; }
void Event::synchronize() const {}

EventPtr copy_batch(int, const Batch&, std::uintptr_t, const std::vector<EventPtr>&, bool) {
  GO_FAIL("gpu_offload was built without CUDA: rebuild with GPU_OFFLOAD_CUDA=1 to copy device memory");
}

bool is_mapped_host(int, std::uintptr_t) { return false; }

std::vector<std::uintptr_t> engine_streams(int) {
  GO_FAIL("gpu_offload was built without CUDA: it has no device streams");
}

}  // namespace gpu_offload::cuda
