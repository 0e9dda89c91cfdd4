// cuda_backend.hpp on the driver API: streams per device and direction, batched async copies, events,
// pinning. Every call goes through the driver table (driver_api.hpp), under the device's primary context,
// which is made current only for the call and then put back as it was.
#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>

#include "cuda_backend.hpp"
#include "cuda_engine.hpp"
#include "driver_api.hpp"
#include "errors.hpp"
#include "kernels.cuh"

#ifndef GPU_OFFLOAD_FATBIN_ARCHS
#define GPU_OFFLOAD_FATBIN_ARCHS ""
#endif

namespace gpu_offload::cuda {

using namespace drv;

namespace {

using kernels::Chunk;
using kernels::kGatherChunkBytes;
using kernels::kGatherThreads;

// A gather kernel's chunk table, in pinned host memory mapped into the device: the kernel reads it over
// the link, so nothing is allocated on the device and nothing is uploaded from pageable memory. Reused
// once the kernel that last read it has finished (`block.done`).
struct ChunkTable {
  MappedBlock block;
  std::size_t capacity = 0;
  std::uint64_t last_use = 0;
  Chunk* host() const { return static_cast<Chunk*>(block.host); }
};

struct DeviceEngine {
  std::once_flag once;
  std::atomic<bool> ready{false};
  Engine engine;
  std::array<std::mutex, 2> locks;  // one batch at a time per direction keeps the enqueue order simple
  // Chunk tables per direction, under that direction's lock; at most kMaxPooledBlocks each.
  std::array<std::deque<ChunkTable>, 2> tables;
  std::array<std::uint64_t, 2> uses{};
};

DeviceEngine& device_engine(int device) {
  static auto* engines = new std::array<DeviceEngine, kMaxDevices>();  // used until the process ends
  GO_CHECK(device >= 0 && device < kMaxDevices, "device index out of range: " + std::to_string(device));
  return (*engines)[device];
}

// ---- pinning before any device is in use -----------------------------------------------------------
// Memory pinned while no context exists anywhere is mapped (and touched) at once, and registered when the
// first device's engine is made, under that device's context. Until then it is plain pageable memory,
// which the copy engines handle (more slowly) and the gather kernel is never given (can_gather says no).
struct DeferredPin {
  std::size_t size = 0;
  bool mapped_here = false;  // host_alloc made it with mmap: host_free unmaps it
  enum State { kPending, kRegistered, kFailed } state = kPending;
};
struct Pins {
  std::mutex mutex;
  std::map<std::uintptr_t, DeferredPin> deferred;
  std::atomic<std::size_t> pending{0};
  std::size_t failed = 0;
  std::string last_error;
};
Pins& pins() {
  static auto* p = new Pins();
  return *p;
}

// A context for a pinning call: the thread's current one, else the primary context of a device already
// in use. None when no device is in use yet; then nothing is created. The context is looked at and made
// current before any other driver call, the capture mode's exchange included: a thread that had none must
// be left with none (on the H200 a fresh thread kept a context after its first pinning and copy).
class PinScope {
 public:
  PinScope() {
    const DriverTable& d = api();
    CUcontext current = nullptr;
    if (d.cuCtxGetCurrent_(&current) == kSuccess && current != nullptr) {
      ok_ = true;
    } else {
      for (int dev = 0; dev < driver_state().device_count; ++dev) {
        if (primary_context_active(dev)) {
          guard_ = std::make_unique<ContextGuard>(dev);
          ok_ = true;
          break;
        }
      }
    }
    relaxed_.emplace();  // pinning is "unsafe" during another thread's global-mode capture
  }
  bool ok() const { return ok_; }

 private:
  std::unique_ptr<ContextGuard> guard_;
  std::optional<RelaxedCaptureMode> relaxed_;  // (after guard_: restored before the context is)
  bool ok_ = false;
};

constexpr unsigned kRegisterFlags = kHostRegisterPortable | kHostRegisterDeviceMap;
constexpr unsigned kAllocFlags = kHostAllocPortable | kHostAllocDeviceMap;

// Registers the deferred slabs under the current context (the first device's).
void flush_pins() {
  Pins& p = pins();
  if (p.pending.load() == 0) return;
  std::lock_guard<std::mutex> lock(p.mutex);
  RelaxedCaptureMode relaxed;
  for (auto& [ptr, pin] : p.deferred) {
    if (pin.state != DeferredPin::kPending) continue;
    const CUresult r = api().cuMemHostRegister_(reinterpret_cast<void*>(ptr), pin.size, kRegisterFlags);
    if (r == kSuccess) {
      pin.state = DeferredPin::kRegistered;
    } else {
      pin.state = DeferredPin::kFailed;  // stays pageable: correct, slower, and never given to the kernel
      ++p.failed;
      p.last_error = "cuMemHostRegister of " + std::to_string(pin.size) + " bytes: " + describe(r);
    }
    --p.pending;
  }
}

Engine make_engine(int device) {
  Engine e;
  ContextGuard guard(device);
  int least = 0, greatest = 0;
  GO_CU(cuCtxGetStreamPriorityRange, &least, &greatest);
  for (auto& s : e.streams) GO_CU(cuStreamCreateWithPriority, &s, kStreamNonBlocking, least);
  for (auto& s : e.kernel_streams) GO_CU(cuStreamCreateWithPriority, &s, kStreamNonBlocking, least);
  CUdevice dev = 0;
  GO_CU(cuDeviceGet, &dev, device);
  GO_CU(cuDeviceGetAttribute, &e.num_sms, kDeviceAttributeMultiprocessorCount, dev);
  // Loaded now, with the streams, not at a kernel's first launch: a lazy load inside a copy could
  // synchronize the context or wait behind a kernel that waits for a peer (NCCL loads eagerly too).
  e.kernels = load_kernels(device);
  flush_pins();
  return e;
}

CUevent new_event(unsigned flags) {
  CUevent event = nullptr;
  GO_CU(cuEventCreate, &event, flags);
  return event;
}

// An event recorded on `stream`, to be waited on by another stream (then dropped: waits already enqueued
// hold on to what they need).
CUevent record(CUstream stream) {
  CUevent event = new_event(kEventDisableTiming);
  const CUresult status = GO_CU_TRY(cuEventRecord, event, stream);
  if (status != kSuccess) {
    GO_CU_TRY(cuEventDestroy, event);
    throw_cu_error(__FILE__, __LINE__, "cuEventRecord(event, stream)", status);
  }
  return event;
}

void wait_and_drop(CUstream waiter, CUevent event) {
  const CUresult status = GO_CU_TRY(cuStreamWaitEvent, waiter, event, 0);
  GO_CU_TRY(cuEventDestroy, event);
  if (status != kSuccess) throw_cu_error(__FILE__, __LINE__, "cuStreamWaitEvent(waiter, event, 0)", status);
}

// A table of at least `n` chunks that no kernel still reads (caller holds the direction's lock, the device
// is current). A free one is reused; a new one is pinned while the pool has room; past that the batch
// waits for the table used longest ago (its kernel has long been enqueued) rather than pinning more.
ChunkTable& take_table(DeviceEngine& de, int dir, std::size_t n) {
  auto& tables = de.tables[dir];
  for (ChunkTable& t : tables) {
    if (t.capacity < n) continue;
    const CUresult status = GO_CU_TRY(cuEventQuery, t.block.done);
    if (status == kSuccess) {  // also an event never recorded
      t.last_use = ++de.uses[dir];
      return t;
    }
    if (status != kErrorNotReady) throw_cu_error(__FILE__, __LINE__, "cuEventQuery(table.done)", status);
  }
  if (tables.size() < kMaxPooledBlocks) {
    ChunkTable t;
    t.capacity = mapped_capacity(n);
    t.block = alloc_mapped_block(t.capacity * sizeof(Chunk));
    t.last_use = ++de.uses[dir];
    tables.push_back(t);
    return tables.back();
  }
  ChunkTable& oldest = *std::min_element(tables.begin(), tables.end(),
                                         [](const ChunkTable& a, const ChunkTable& b) { return a.last_use < b.last_use; });
  {
    RelaxedCaptureMode relaxed;
    GO_CU(cuEventSynchronize, oldest.block.done);
  }
  if (oldest.capacity < n) {
    MappedBlock bigger = alloc_mapped_block(mapped_capacity(n) * sizeof(Chunk));
    free_mapped_block(oldest.block);
    oldest.block = bigger;
    oldest.capacity = mapped_capacity(n);
  }
  oldest.last_use = ++de.uses[dir];
  return oldest;
}

// Enqueues one gather kernel for the list on `stream`. Host addresses are translated to the region's
// mapped device address; the chunk table is one of the direction's pinned tables (caller holds its lock).
void enqueue_kernel_copies(const Batch& batch, CUstream stream, DeviceEngine& de, int dir) {
  CUdeviceptr host_dev = 0;
  GO_CU(cuMemHostGetDevicePointer, &host_dev, reinterpret_cast<void*>(batch.host_base), 0);
  const auto translate = [&](const void* host) {
    return reinterpret_cast<unsigned char*>(host_dev + (reinterpret_cast<std::uintptr_t>(host) - batch.host_base));
  };
  std::size_t num_chunks = 0;
  for (std::size_t i = 0; i < batch.kernel.size(); ++i) {
    num_chunks += (batch.kernel.sizes[i] + kGatherChunkBytes - 1) / kGatherChunkBytes;
  }
  if (num_chunks == 0) return;
  ChunkTable& table = take_table(de, dir, num_chunks);
  std::size_t c = 0;
  for (std::size_t i = 0; i < batch.kernel.size(); ++i) {
    const auto* src = static_cast<const unsigned char*>(batch.to_host ? batch.kernel.src[i] : translate(batch.kernel.src[i]));
    auto* dst = static_cast<unsigned char*>(batch.to_host ? translate(batch.kernel.dst[i]) : batch.kernel.dst[i]);
    for (std::size_t off = 0; off < batch.kernel.sizes[i]; off += kGatherChunkBytes) {
      table.host()[c++] = {src + off, dst + off, std::min<std::size_t>(kGatherChunkBytes, batch.kernel.sizes[i] - off)};
    }
  }
  const Engine& e = de.engine;
  unsigned long long count = num_chunks;
  CUdeviceptr chunks = table.block.device;
  void* params[] = {&chunks, &count};
  const auto blocks = static_cast<unsigned>(std::min<unsigned long long>(count, 4ull * std::max(e.num_sms, 1)));
  GO_CU(cuLaunchKernel, e.kernels.gather, blocks, 1, 1, kGatherThreads, 1, 1, 0, stream, params, nullptr);
  // The table is free again once the kernel has run. (If this fails, copy_batch waits for the stream.)
  GO_CU(cuEventRecord, table.block.done, stream);
}

// Refusals of cuMemcpyBatchAsync: the copies still happen, one by one, so a driver that refuses every batch
// would only be slower; counted, for build_info() and the GPU tests.
struct BatchFallbacks {
  std::mutex mutex;
  std::size_t count = 0;
  std::string last_error;
};
BatchFallbacks& batch_fallbacks() {
  static auto* f = new BatchFallbacks();
  return *f;
}

void enqueue_engine_copies(const CopyList& list, CUstream stream) {
  std::vector<CUdeviceptr> dst, src;
  std::vector<std::size_t> sizes;
  dst.reserve(list.size());
  src.reserve(list.size());
  sizes.reserve(list.size());
  for (std::size_t i = 0; i < list.size(); ++i) {
    if (list.sizes[i] == 0) continue;
    dst.push_back(reinterpret_cast<CUdeviceptr>(list.dst[i]));
    src.push_back(reinterpret_cast<CUdeviceptr>(list.src[i]));
    sizes.push_back(list.sizes[i]);
  }
  const std::size_t n = sizes.size();
  if (n > 1 && driver_state().batched_copies) {
    // One call for the whole batch: the driver packs the descriptors, which is what makes many copies
    // cheap on the host side. The location hints are ignored for memory not managed by CUDA.
    MemcpyAttributes attrs = {};
    attrs.srcAccessOrder = kMemcpySrcAccessOrderStream;
    std::size_t attrs_index = 0, fail_index = 0;
    const CUresult r = api().cuMemcpyBatchAsync_(dst.data(), src.data(), sizes.data(), n, &attrs, &attrs_index, 1,
                                                 &fail_index, stream);
    if (r == kSuccess) return;
    {
      BatchFallbacks& f = batch_fallbacks();
      std::lock_guard<std::mutex> lock(f.mutex);
      ++f.count;
      f.last_error = describe(r) + " (copy " + std::to_string(fail_index) + " of " + std::to_string(n) + ")";
    }
    // Refused (the copies are idempotent, so whatever it enqueued is simply copied again): one by one.
  }
  for (std::size_t i = 0; i < n; ++i) GO_CU(cuMemcpyAsync, dst[i], src[i], sizes[i], stream);
}

}  // namespace

// ---- engine and scratch (cuda_engine.hpp) ------------------------------------------------------------

const Engine& engine(int device) {
  DeviceEngine& de = device_engine(device);
  std::call_once(de.once, [&] {  // an exception leaves it to be tried again by the next call
    de.engine = make_engine(device);
    de.ready = true;
  });
  return de.engine;
}

const Engine* engine_if_created(int device) {
  if (device < 0 || device >= kMaxDevices) return nullptr;
  DeviceEngine& de = device_engine(device);
  return de.ready ? &de.engine : nullptr;
}

void refuse_capture(CUstream stream, int device, const char* what) {
  int status = kCaptureStatusNone;
  const CUresult r = GO_CU_TRY(cuStreamIsCapturing, stream, &status);
  if (r == kErrorStreamCaptureImplicit || (r == kSuccess && status != kCaptureStatusNone)) {
    const std::string who = r == kErrorStreamCaptureImplicit
                                ? "the caller's stream is the legacy stream while another stream"
                                : "the caller's stream";
    throw Error(std::string("cannot ") + what + " on cuda:" + std::to_string(device) + ": " + who +
                " is capturing a CUDA graph: call gpu_offload.join() / snap.wait() before capturing (and "
                "snapshot, offload or restore outside the capture)");
  }
  if (r != kSuccess) throw_cu_error(__FILE__, __LINE__, "cuStreamIsCapturing(stream, &status)", r);
}

std::size_t mapped_capacity(std::size_t n) {
  std::size_t capacity = 256;
  while (capacity < n) capacity *= 2;
  return capacity;
}

MappedBlock alloc_mapped_block(std::size_t num_bytes) {
  MappedBlock b;
  RelaxedCaptureMode relaxed;
  GO_CU(cuMemHostAlloc, &b.host, num_bytes, kAllocFlags);
  CUresult status = GO_CU_TRY(cuMemHostGetDevicePointer, &b.device, b.host, 0);
  if (status == kSuccess) status = GO_CU_TRY(cuEventCreate, &b.done, kEventBlockingSync | kEventDisableTiming);
  if (status != kSuccess) {
    GO_CU_TRY(cuMemFreeHost, b.host);
    throw_cu_error(__FILE__, __LINE__, "alloc_mapped_block", status);
  }
  return b;
}

void free_mapped_block(MappedBlock& block) {
  if (block.done != nullptr) GO_CU_TRY(cuEventDestroy, block.done);
  if (block.host != nullptr) {
    RelaxedCaptureMode relaxed;
    GO_CU_TRY(cuMemFreeHost, block.host);
  }
  block = MappedBlock{};
}

// ---- cuda_backend.hpp --------------------------------------------------------------------------------

bool compiled() { return true; }

bool available() { return driver_state().table != nullptr && driver_state().device_count > 0; }

int device_count() { return available() ? driver_state().device_count : 0; }

std::string architectures() { return GPU_OFFLOAD_FATBIN_ARCHS; }

BackendInfo info() {
  BackendInfo i;
  const DriverState& s = driver_state();
  i.driver = s.table != nullptr;
  i.driver_source = s.source;
  i.driver_error = s.error;
  i.driver_version = s.version;
  i.device_count = s.device_count;
  i.entry_points = s.found;
  i.missing_entry_points = s.missing;
  i.batched_copies = s.batched_copies;
  i.fatbin_architectures = architectures();
  const NvrtcFound& nvrtc = find_nvrtc();
  i.nvrtc_path = nvrtc.path;
  i.nvrtc_version = nvrtc.path.empty() ? "" : std::to_string(nvrtc.major) + "." + std::to_string(nvrtc.minor);
  i.nvrtc_error = nvrtc.error;
  i.kernel_cache_dir = kernel_cache_dir();
  for (int d = 0; d < kMaxDevices; ++d) {
    if (const Engine* e = engine_if_created(d)) i.devices.push_back(e->kernels.info);
  }
  Pins& p = pins();
  std::lock_guard<std::mutex> lock(p.mutex);
  i.num_deferred_pins = p.pending.load();
  i.num_failed_pins = p.failed;
  i.pin_error = p.last_error;
  BatchFallbacks& f = batch_fallbacks();
  std::lock_guard<std::mutex> batch_lock(f.mutex);
  i.num_batch_fallbacks = f.count;
  i.batch_error = f.last_error;
  return i;
}

void* host_alloc(std::size_t num_bytes) {
  GO_CHECK(available(), "cannot pin host memory: " +
                            (driver_state().error.empty() ? std::string("no CUDA device") : driver_state().error));
  PinScope scope;
  if (scope.ok()) {
    void* ptr = nullptr;
    GO_CU(cuMemHostAlloc, &ptr, num_bytes, kAllocFlags);
    return ptr;
  }
  // No device in use yet: map now, register at the first device's engine (see DeferredPin).
  void* ptr = mmap(nullptr, num_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  GO_CHECK(ptr != MAP_FAILED, "mmap of " + std::to_string(num_bytes) + " bytes failed");
  Pins& p = pins();
  std::lock_guard<std::mutex> lock(p.mutex);
  p.deferred[reinterpret_cast<std::uintptr_t>(ptr)] = DeferredPin{num_bytes, true, DeferredPin::kPending};
  ++p.pending;
  return ptr;
}

bool host_register(void* ptr, std::size_t num_bytes) {
  if (!available()) return false;
  PinScope scope;
  if (scope.ok()) return GO_CU_TRY(cuMemHostRegister, ptr, num_bytes, kRegisterFlags) == kSuccess;
  Pins& p = pins();
  std::lock_guard<std::mutex> lock(p.mutex);
  p.deferred[reinterpret_cast<std::uintptr_t>(ptr)] = DeferredPin{num_bytes, false, DeferredPin::kPending};
  ++p.pending;
  return true;
}

namespace {

// Forgets a deferred pin, unregistering it if it was registered; false when `ptr` was not deferred.
bool release_deferred(void* ptr, bool* mapped_here, std::size_t* size) {
  Pins& p = pins();
  std::lock_guard<std::mutex> lock(p.mutex);
  auto it = p.deferred.find(reinterpret_cast<std::uintptr_t>(ptr));
  if (it == p.deferred.end()) return false;
  if (it->second.state == DeferredPin::kRegistered) {
    PinScope scope;  // a device is in use: the registration happened under its context
    GO_CU(cuMemHostUnregister, ptr);
  }
  if (it->second.state == DeferredPin::kPending) --p.pending;
  *mapped_here = it->second.mapped_here;
  *size = it->second.size;
  p.deferred.erase(it);
  return true;
}

}  // namespace

void host_free(void* ptr) {
  bool mapped_here = false;
  std::size_t size = 0;
  if (release_deferred(ptr, &mapped_here, &size)) {
    if (mapped_here) munmap(ptr, size);
    return;
  }
  PinScope scope;  // unpinning needs a context too (trim() from a fresh thread)
  GO_CU(cuMemFreeHost, ptr);
}

void host_unregister(void* ptr) {
  bool mapped_here = false;
  std::size_t size = 0;
  if (release_deferred(ptr, &mapped_here, &size)) return;
  PinScope scope;
  GO_CU(cuMemHostUnregister, ptr);
}

Event::~Event() {
  // Destroying a recorded event is legal before it completes; resources are released once it does. Under
  // the event's own context: the last reference may go on any thread (Python's collector), with none current.
  if (handle_ == nullptr) return;
  const DriverState& s = driver_state();
  if (s.table == nullptr) return;
  try {
    ContextGuard guard(device_);
    s.table->cuEventDestroy_(static_cast<CUevent>(handle_));
  } catch (...) {
    // The driver is shutting down (process exit): nothing left to release.
  }
}

bool Event::query() const {
  ContextGuard guard(device_);  // (first: see PinScope)
  RelaxedCaptureMode relaxed;
  const CUresult status = GO_CU_TRY(cuEventQuery, static_cast<CUevent>(handle_));
  if (status == kErrorNotReady) return false;
  if (status != kSuccess) throw_cu_error(__FILE__, __LINE__, "cuEventQuery(event)", status);
  return true;
}

void Event::synchronize() const {
  // The event was made with CU_EVENT_BLOCKING_SYNC: the thread sleeps instead of spinning a core.
  ContextGuard guard(device_);  // (first: see PinScope)
  RelaxedCaptureMode relaxed;
  GO_CU(cuEventSynchronize, static_cast<CUevent>(handle_));
}

bool is_mapped_host(int device, std::uintptr_t host_base) {
  engine(device);  // first use of the device: memory pinned before it is registered now
  ContextGuard guard(device);
  CUdeviceptr dptr = 0;
  return GO_CU_TRY(cuPointerGetAttribute, &dptr, kPointerAttributeDevicePointer, host_base) == kSuccess && dptr != 0;
}

bool can_gather(int device, std::uintptr_t host_base) {
  return engine(device).kernels.gather != nullptr && is_mapped_host(device, host_base);
}

std::vector<std::uintptr_t> engine_streams(int device) {
  const Engine& e = engine(device);
  return {reinterpret_cast<std::uintptr_t>(e.streams[0]), reinterpret_cast<std::uintptr_t>(e.streams[1]),
          reinterpret_cast<std::uintptr_t>(e.kernel_streams[0]), reinterpret_cast<std::uintptr_t>(e.kernel_streams[1])};
}

void engine_synchronize(int device, bool to_host) {
  const Engine* e = engine_if_created(device);
  if (e == nullptr) return;  // no stream, nothing enqueued
  const int dir = to_host ? 0 : 1;
  ContextGuard guard(device);  // (first: see PinScope)
  RelaxedCaptureMode relaxed;
  GO_CU(cuStreamSynchronize, e->kernel_streams[dir]);
  GO_CU(cuStreamSynchronize, e->streams[dir]);
}

EventPtr copy_batch(int device, const Batch& batch, std::uintptr_t user_stream, const std::vector<EventPtr>& waits,
                    bool user_waits) {
  DeviceEngine& de = device_engine(device);
  const Engine& e = engine(device);
  ContextGuard guard(device);
  flush_pins();  // memory pinned while the engine was being made, under this device's context
  auto user = reinterpret_cast<CUstream>(user_stream);
  refuse_capture(user, device, "copy");  // before anything is enqueued
  GO_CHECK(batch.kernel.size() == 0 || e.kernels.gather != nullptr,
           "the gather kernel is not loaded on cuda:" + std::to_string(device) + " (" + e.kernels.info.error + ")");
  const int dir = batch.to_host ? 0 : 1;
  CUstream stream = e.streams[dir];
  CUstream kernel_stream = e.kernel_streams[dir];
  std::lock_guard<std::mutex> lock(de.locks[dir]);

  try {
    // Stream order: the batch starts after everything already enqueued on the caller's stream and after
    // the given events (e.g. the snapshot a restore reads).
    wait_and_drop(stream, record(user));
    for (const EventPtr& w : waits) {
      if (w) GO_CU(cuStreamWaitEvent, stream, static_cast<CUevent>(w->handle()), 0);
    }
    if (batch.kernel.size() != 0) {
      // Fork: the kernel runs on its own stream beside the copy engines; join before `done`.
      wait_and_drop(kernel_stream, record(stream));
      enqueue_kernel_copies(batch, kernel_stream, de, dir);
      enqueue_engine_copies(batch.engine, stream);
      wait_and_drop(stream, record(kernel_stream));
    } else {
      enqueue_engine_copies(batch.engine, stream);
    }

    // Blocking sync: whoever waits for it (snap.wait(), the stager's worker) sleeps instead of spinning.
    auto event = std::make_shared<Event>(new_event(kEventBlockingSync | kEventDisableTiming), device);
    GO_CU(cuEventRecord, static_cast<CUevent>(event->handle()), stream);
    if (user_waits) GO_CU(cuStreamWaitEvent, user, static_cast<CUevent>(event->handle()), 0);
    return event;
  } catch (...) {
    // Part of the batch may be enqueued (a kernel launched, then the copy engines refused): wait for it,
    // so that the caller, which frees the host region on this error, frees nothing a copy still uses.
    // Rare, and an error path: blocking here is the simple way to be sure.
    RelaxedCaptureMode relaxed;
    GO_CU_TRY(cuStreamSynchronize, kernel_stream);
    GO_CU_TRY(cuStreamSynchronize, stream);
    throw;
  }
}

}  // namespace gpu_offload::cuda
