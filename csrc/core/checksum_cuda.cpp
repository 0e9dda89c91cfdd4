// The checksum of checksum.hpp computed by a kernel (kernels.cuh), on the caller's stream.
//
// The storages are cut into 1 MiB chunks; a grid-stride loop hands chunks to blocks, each block reads
// its chunk with 16-byte loads (8-byte or byte loads where a storage is not aligned for them), reduces
// its threads' partial sums and writes the chunk's partial to its own slot; the host adds a storage's
// partials (the sum is order-free, so the value is the host's exactly). The chunk table and the partials
// live in pinned host memory mapped into the device, in a bounded pool per device.
#include <algorithm>
#include <array>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "checksum.hpp"
#include "cuda_engine.hpp"
#include "driver_api.hpp"
#include "errors.hpp"
#include "kernels.cuh"

namespace gpu_offload::cuda {

using namespace drv;

namespace {

using kernels::SumChunk;
constexpr unsigned kThreads = kernels::kChecksumThreads;
constexpr unsigned kBlocksPerSm = 4;
using checksum_detail::kChunkBytes;

struct Scratch;

// One job's sums: in its scratch block until read out (by the job, or by a later job that needs the block).
struct JobState {
  std::mutex mutex;
  int device = 0;
  Scratch* scratch = nullptr;  // null once the sums are read out
  std::vector<std::size_t> sizes;
  std::vector<std::uint64_t> result;
  bool done = false;
  void harvest();  // reads the sums out (kernel finished, mutex held)
};

// Pinned host memory mapped into the device: the chunk table going up and the partial sums coming down,
// with the event of the last job that used it.
struct Scratch {
  std::size_t chunks = 0;  // capacity
  MappedBlock block;
  std::shared_ptr<JobState> owner;  // whose sums it holds (under the pool's mutex)
  std::uint64_t last_use = 0;
  SumChunk* table() const { return static_cast<SumChunk*>(block.host); }
  unsigned long long* partials() const { return reinterpret_cast<unsigned long long*>(table() + chunks); }
};

void JobState::harvest() {
  const std::size_t n = sizes.size();
  const unsigned long long* partials = scratch->partials();
  result.resize(n);
  std::size_t c = 0;
  for (std::size_t i = 0; i < n; ++i) {
    unsigned long long sum = 0;
    for (std::uint64_t k = checksum_detail::num_chunks(sizes[i]); k > 0; --k) sum += partials[c++];
    result[i] = checksum_finish(sum, sizes[i]);
  }
  scratch = nullptr;
  done = true;
}

struct Pool {
  std::mutex mutex;
  std::vector<std::unique_ptr<Scratch>> items;  // at most kMaxPooledBlocks
  std::uint64_t uses = 0;
};
Pool& pool(int device) {
  static auto* pools = new std::array<Pool, kMaxDevices>();
  return (*pools)[device];
}

void wait_event(CUevent event) {
  RelaxedCaptureMode relaxed;
  GO_CU(cuEventSynchronize, event);
}

MappedBlock new_block(std::size_t capacity) {
  return alloc_mapped_block(capacity * (sizeof(SumChunk) + sizeof(unsigned long long)));
}

// A scratch block of at least `chunks` for `state` (device current; the caller holds state's mutex, and
// state is not yet known to anyone else, which keeps the lock order: new job, pool, older job). A free one is reused; a new one is
// pinned while the pool has room; past that the block used longest ago is waited for, its job's sums read
// out into that job, and the block reused: the pool never grows past its cap, whatever the caller holds.
Scratch* acquire(int device, std::size_t chunks, const std::shared_ptr<JobState>& state) {
  Pool& p = pool(device);
  std::lock_guard<std::mutex> lock(p.mutex);
  for (auto& item : p.items) {
    if (item->owner || item->chunks < chunks) continue;
    // A job dropped before it finished leaves its block busy on the GPU until then: skip it for now.
    const CUresult r = GO_CU_TRY(cuEventQuery, item->block.done);
    if (r == kErrorNotReady) continue;
    if (r != kSuccess) throw_cu_error(__FILE__, __LINE__, "cuEventQuery(scratch)", r);
    item->owner = state;
    item->last_use = ++p.uses;
    state->scratch = item.get();
    return item.get();
  }
  if (p.items.size() < kMaxPooledBlocks) {
    auto item = std::make_unique<Scratch>();
    item->chunks = mapped_capacity(chunks);
    item->block = new_block(item->chunks);
    item->owner = state;
    item->last_use = ++p.uses;
    state->scratch = item.get();
    p.items.push_back(std::move(item));
    return p.items.back().get();
  }
  Scratch* oldest = std::min_element(p.items.begin(), p.items.end(), [](const auto& a, const auto& b) {
                      return a->last_use < b->last_use;
                    })->get();
  if (std::shared_ptr<JobState> owner = oldest->owner) {
    // The owner's mutex is held while it enqueues, so its kernel and event are in the stream once we have it.
    std::lock_guard<std::mutex> l(owner->mutex);
    wait_event(oldest->block.done);
    if (owner->scratch == oldest) owner->harvest();
  } else {
    wait_event(oldest->block.done);
  }
  if (oldest->chunks < chunks) {
    MappedBlock bigger = new_block(mapped_capacity(chunks));
    free_mapped_block(oldest->block);
    oldest->block = bigger;
    oldest->chunks = mapped_capacity(chunks);
  }
  oldest->owner = state;
  oldest->last_use = ++p.uses;
  state->scratch = oldest;
  return oldest;
}

// Hands the block back if `state` still owns it.
void release(int device, Scratch* item, const std::shared_ptr<JobState>& state) {
  Pool& p = pool(device);
  std::lock_guard<std::mutex> lock(p.mutex);
  if (item->owner == state) item->owner.reset();
}

class DeviceChecksumJob final : public ChecksumJob {
 public:
  explicit DeviceChecksumJob(std::shared_ptr<JobState> state) : state_(std::move(state)) {}
  ~DeviceChecksumJob() override {
    Scratch* item = nullptr;
    {
      std::lock_guard<std::mutex> lock(state_->mutex);
      item = state_->scratch;
    }
    if (item != nullptr) release(state_->device, item, state_);
  }

  bool query() const override {
    std::lock_guard<std::mutex> lock(state_->mutex);
    if (state_->done) return true;
    ContextGuard guard(state_->device);  // (first: see cuda_backend.cpp's PinScope)
    RelaxedCaptureMode relaxed;
    const CUresult status = GO_CU_TRY(cuEventQuery, state_->scratch->block.done);
    if (status == kErrorNotReady) return false;
    if (status != kSuccess) throw_cu_error(__FILE__, __LINE__, "cuEventQuery(checksum)", status);
    return true;
  }

  std::vector<std::uint64_t> wait() override {
    Scratch* item = nullptr;
    std::vector<std::uint64_t> result;
    {
      std::lock_guard<std::mutex> lock(state_->mutex);
      if (!state_->done) {
        ContextGuard guard(state_->device);
        wait_event(state_->scratch->block.done);
        item = state_->scratch;
        state_->harvest();
      }
      result = state_->result;
    }
    if (item != nullptr) release(state_->device, item, state_);  // after the job's mutex (lock order)
    return result;
  }

 private:
  std::shared_ptr<JobState> state_;
};

}  // namespace

std::shared_ptr<ChecksumJob> checksum_device_async(int device, const std::vector<std::uintptr_t>& ptrs,
                                                   const std::vector<std::size_t>& sizes, std::uintptr_t stream) {
  GO_CHECK(ptrs.size() == sizes.size(), "checksum arrays differ in length: " + std::to_string(ptrs.size()) +
                                            " pointers, " + std::to_string(sizes.size()) + " sizes");
  GO_CHECK(device >= 0 && device < kMaxDevices, "device index out of range: " + std::to_string(device));
  const std::size_t n = sizes.size();
  unsigned long long total_chunks = 0;
  for (std::size_t i = 0; i < n; ++i) {
    GO_CHECK(sizes[i] == 0 || ptrs[i] != 0, "null pointer for storage " + std::to_string(i));
    total_chunks += checksum_detail::num_chunks(sizes[i]);
  }
  auto state = std::make_shared<JobState>();
  state->device = device;
  state->sizes = sizes;
  if (total_chunks == 0) {  // nothing to compute: every storage is empty
    for (std::size_t s : sizes) state->result.push_back(checksum_finish(0, s));
    state->done = true;
    return std::make_shared<DeviceChecksumJob>(state);
  }

  const Engine& e = engine(device);
  // Without the kernel the sums would have to come from the host copy, which proves nothing about the
  // copy: refuse, clearly, instead.
  GO_CHECK(e.kernels.checksum != nullptr,
           "GPU checksums need the checksum kernel, which is not loaded on cuda:" + std::to_string(device) + " (" +
               e.kernels.info.error + "); install nvidia-cuda-nvrtc-cu12 (or -cu13) or build with nvcc, or take the "
               "snapshot without checksum=True");
  ContextGuard guard(device);
  auto user = reinterpret_cast<CUstream>(stream);
  refuse_capture(user, device, "checksum");  // before anything is enqueued
  std::unique_lock<std::mutex> job_lock(state->mutex);  // until the kernel and its event are enqueued
  Scratch* scratch = acquire(device, total_chunks, state);
  try {
    std::size_t c = 0;
    for (std::size_t i = 0; i < n; ++i) {
      for (std::uint64_t begin = 0; begin < sizes[i]; begin += kChunkBytes) {
        const std::uint64_t end = begin + kChunkBytes < sizes[i] ? begin + kChunkBytes : sizes[i];
        scratch->table()[c++] = {ptrs[i], begin, end, 0};
      }
    }
    const unsigned long long most = static_cast<unsigned long long>(std::max(e.num_sms, 1)) * kBlocksPerSm;
    const auto grid = static_cast<unsigned>(total_chunks < most ? total_chunks : most);
    CUdeviceptr table = scratch->block.device;
    CUdeviceptr partials = table + scratch->chunks * sizeof(SumChunk);
    void* params[] = {&table, &total_chunks, &partials};
    GO_CU(cuLaunchKernel, e.kernels.checksum, grid, 1, 1, kThreads, 1, 1, 0, user, params, nullptr);
    GO_CU(cuEventRecord, scratch->block.done, user);
  } catch (...) {
    // A launched kernel may still use the scratch: wait for the stream before handing it back.
    {
      RelaxedCaptureMode relaxed;
      GO_CU_TRY(cuStreamSynchronize, user);
    }
    state->scratch = nullptr;
    job_lock.unlock();
    release(device, scratch, state);
    throw;
  }
  job_lock.unlock();
  return std::make_shared<DeviceChecksumJob>(state);
}

}  // namespace gpu_offload::cuda
