#include "sim_driver.hpp"

#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <thread>
#include <unordered_map>
#include <vector>

#include "errors.hpp"
#include "kernels.cuh"

using namespace gpu_offload;
using namespace gpu_offload::drv;

namespace {

// A point in a stream's queue: done once the stream has run everything enqueued before it.
struct Marker {
  std::mutex m;
  std::condition_variable cv;
  bool done = false;
  void set() {
    {
      std::lock_guard<std::mutex> lock(m);
      done = true;
    }
    cv.notify_all();
  }
  void wait() {
    std::unique_lock<std::mutex> lock(m);
    cv.wait(lock, [&] { return done; });
  }
  void wait_for(double seconds) {
    std::unique_lock<std::mutex> lock(m);
    cv.wait_for(lock, std::chrono::duration<double>(seconds), [&] { return done; });
  }
  bool is_done() {
    std::lock_guard<std::mutex> lock(m);
    return done;
  }
};
using MarkerPtr = std::shared_ptr<Marker>;

}  // namespace

// The handle types, defined only here (the real driver's are opaque to the engine).
struct CUctx_st {
  int device = 0;
  bool active = false;
  int retains = 0;
  CUstream_st* legacy = nullptr;  // stream 0 of this context, made on first use
};

struct CUstream_st {
  struct Op {
    bool work;  // copies, kernels and fills are delayed; records and waits are bookkeeping
    std::function<void()> fn;
  };
  int device = 0;
  std::mutex m;
  std::condition_variable cv;
  std::deque<Op> queue;
  bool running = false;
  double delay = 0;
  int capture_status = kCaptureStatusNone;
  int capture_mode = kCaptureModeGlobal;

  void push(bool work, std::function<void()> fn) {
    {
      std::lock_guard<std::mutex> lock(m);
      queue.push_back(Op{work, std::move(fn)});
    }
    cv.notify_all();
  }
  void loop() {
    for (;;) {
      Op op;
      double wait = 0;
      {
        std::unique_lock<std::mutex> lock(m);
        cv.wait(lock, [&] { return !queue.empty(); });
        op = std::move(queue.front());
        queue.pop_front();
        running = true;
        wait = delay;
      }
      if (op.work && wait > 0) std::this_thread::sleep_for(std::chrono::duration<double>(wait));
      op.fn();
      {
        std::lock_guard<std::mutex> lock(m);
        running = false;
      }
      cv.notify_all();
    }
  }
};

struct CUevent_st {
  std::mutex m;
  MarkerPtr last;  // the latest record; null: never recorded (queries as complete)
  bool captured = false;
  unsigned flags = 0;
  int device = 0;
};

struct CUmod_st {
  int device = 0;
  std::string kind;  // builtin, fatbin, cubin, ptx
  std::string names;  // the image's bytes where they can be searched for a symbol (cubin, PTX)
};

struct CUfunc_st {
  CUmod_st* module = nullptr;
  std::string name;
};

namespace gpu_offload::sim {
namespace {

struct Range {
  std::uintptr_t base = 0;
  std::size_t size = 0;
  int device = -1;       // device memory: its device; host: -1
  unsigned flags = 0;    // host registrations: CU_MEMHOSTREGISTER_* / CU_MEMHOSTALLOC_*
  bool host_alloc = false;
};

struct Injection {
  int remaining;
  CUresult result;
};

// A call parked by block(): it waits for its gate (or the timeout) before it goes ahead.
struct Block {
  int remaining;
  std::uint64_t gate;
  double timeout;
};

struct Sim {
  Config config;
  std::mutex m;  // everything below
  std::vector<CUctx_st> contexts;
  std::vector<CUstream_st*> streams;
  std::map<std::uintptr_t, Range> device_mem;
  std::map<std::uintptr_t, Range> host_reg;
  std::unordered_map<std::string, std::size_t> calls;
  std::unordered_map<std::string, std::vector<Injection>> injections;
  std::unordered_map<std::uint64_t, MarkerPtr> gates;
  std::unordered_map<std::string, std::vector<Block>> blocks;
  std::unordered_map<std::uint64_t, bool> parked;  // gate -> a call waits on it now
  std::uint64_t next_gate = 1;
  std::vector<int> sticky;
  std::size_t kernel_launches = 0;
  std::size_t spinning_waits = 0;  // cuEventSynchronize on an event made without blocking sync
};

Sim* g_sim = nullptr;
std::mutex g_make_mutex;
thread_local CUctx_st* t_current = nullptr;
thread_local int t_capture_mode = kCaptureModeGlobal;

Sim& sim() {
  GO_CHECK(g_sim != nullptr, "the simulated CUDA driver is not enabled");
  return *g_sim;
}

// Counts the call and applies an injected failure; 0 when the call goes ahead.
CUresult hook(const char* name) {
  Sim& s = sim();
  std::unique_lock<std::mutex> lock(s.m);
  ++s.calls[name];
  auto b = s.blocks.find(name);
  if (b != s.blocks.end()) {
    for (auto blk = b->second.begin(); blk != b->second.end(); ++blk) {
      if (--blk->remaining != 0) continue;
      const Block parked = *blk;
      b->second.erase(blk);
      auto g = s.gates.find(parked.gate);
      if (g == s.gates.end()) break;  // released before the call came
      MarkerPtr gate = g->second;
      s.parked[parked.gate] = true;
      lock.unlock();
      gate->wait_for(parked.timeout);
      lock.lock();
      s.parked[parked.gate] = false;
      break;
    }
  }
  auto it = s.injections.find(name);
  if (it == s.injections.end()) return kSuccess;
  for (auto inj = it->second.begin(); inj != it->second.end(); ++inj) {
    if (--inj->remaining == 0) {
      const CUresult r = inj->result;
      it->second.erase(inj);
      return r;
    }
  }
  return kSuccess;
}

#define SIM_HOOK(name)                       \
  do {                                       \
    const CUresult hooked_ = hook(#name);    \
    if (hooked_ != kSuccess) return hooked_; \
  } while (0)

CUstream_st* new_stream(int device) {
  auto* st = new CUstream_st();  // never destroyed: its worker runs for the life of the process
  st->device = device;
  std::thread([st] { st->loop(); }).detach();
  sim().streams.push_back(st);  // caller holds the lock
  return st;
}

// Stream 0 means the legacy stream of the current context.
CUresult resolve(CUstream stream, CUstream_st** out) {
  if (stream != nullptr) {
    *out = stream;
    return kSuccess;
  }
  CUctx_st* ctx = t_current;
  if (ctx == nullptr) return kErrorInvalidContext;
  Sim& s = sim();
  std::lock_guard<std::mutex> lock(s.m);
  if (ctx->legacy == nullptr) ctx->legacy = new_stream(ctx->device);
  *out = ctx->legacy;
  return kSuccess;
}

bool global_capture_active(Sim& s) {
  for (CUstream_st* st : s.streams) {
    std::lock_guard<std::mutex> lock(st->m);
    if (st->capture_status == kCaptureStatusActive && st->capture_mode == kCaptureModeGlobal) return true;
  }
  return false;
}

// A "potentially unsafe" call (a query, a synchronize, pinning) while some stream is capturing in global
// mode breaks that capture unless the calling thread is in relaxed mode, as the real driver does.
CUresult unsafe_call() {
  if (t_capture_mode == kCaptureModeRelaxed) return kSuccess;
  Sim& s = sim();
  std::lock_guard<std::mutex> lock(s.m);
  bool broke = false;
  for (CUstream_st* st : s.streams) {
    std::lock_guard<std::mutex> l(st->m);
    if (st->capture_status == kCaptureStatusActive && st->capture_mode == kCaptureModeGlobal) {
      st->capture_status = kCaptureStatusInvalidated;
      broke = true;
    }
  }
  return broke ? kErrorStreamCaptureUnsupported : kSuccess;
}

int capturing(CUstream_st* st) {
  std::lock_guard<std::mutex> lock(st->m);
  return st->capture_status;
}

// The range containing [p, p + n) in `ranges`, or null; *partial is set when it overlaps one without
// fitting in it.
const Range* find(const std::map<std::uintptr_t, Range>& ranges, std::uintptr_t p, std::size_t n, bool* partial) {
  *partial = false;
  auto it = ranges.upper_bound(p);
  if (it != ranges.begin()) {
    const Range& r = std::prev(it)->second;
    if (p < r.base + r.size) {
      if (p + n <= r.base + r.size) return &r;
      *partial = true;
      return nullptr;
    }
  }
  if (it != ranges.end() && n != 0 && it->second.base < p + n) *partial = true;
  return nullptr;
}

// A copy operand: device memory (all of it inside one allocation) or host memory (outside all of them).
CUresult check_operand(Sim& s, std::uintptr_t p, std::size_t n) {
  bool partial = false;
  const Range* r = find(s.device_mem, p, n, &partial);
  if (partial) return kErrorInvalidValue;
  (void)r;
  return p == 0 && n != 0 ? kErrorInvalidValue : kSuccess;
}

// What a kernel on `device` may touch: that device's memory, or host memory registered as mapped.
bool device_accessible(Sim& s, int device, std::uintptr_t p, std::size_t n) {
  bool partial = false;
  if (const Range* r = find(s.device_mem, p, n, &partial)) return r->device == device;
  if (partial) return false;
  const Range* h = find(s.host_reg, p, n, &partial);
  return h != nullptr && (h->flags & kHostRegisterDeviceMap) != 0;
}

CUresult sticky(int device) {
  Sim& s = sim();
  std::lock_guard<std::mutex> lock(s.m);
  return s.sticky[device];
}

// ---- the entry points ---------------------------------------------------------------------------------

CUresult sim_cuInit(unsigned) {
  SIM_HOOK(cuInit);
  return kSuccess;
}
CUresult sim_cuDriverGetVersion(int* v) {
  SIM_HOOK(cuDriverGetVersion);
  *v = sim().config.driver_version;
  return kSuccess;
}

const char* error_name(CUresult r) {
  switch (r) {
    case kSuccess: return "CUDA_SUCCESS";
    case kErrorInvalidValue: return "CUDA_ERROR_INVALID_VALUE";
    case kErrorOutOfMemory: return "CUDA_ERROR_OUT_OF_MEMORY";
    case kErrorNotInitialized: return "CUDA_ERROR_NOT_INITIALIZED";
    case kErrorNoDevice: return "CUDA_ERROR_NO_DEVICE";
    case kErrorInvalidDevice: return "CUDA_ERROR_INVALID_DEVICE";
    case kErrorInvalidImage: return "CUDA_ERROR_INVALID_IMAGE";
    case kErrorInvalidContext: return "CUDA_ERROR_INVALID_CONTEXT";
    case kErrorNoBinaryForGpu: return "CUDA_ERROR_NO_BINARY_FOR_GPU";
    case kErrorInvalidHandle: return "CUDA_ERROR_INVALID_HANDLE";
    case kErrorNotFound: return "CUDA_ERROR_NOT_FOUND";
    case kErrorNotReady: return "CUDA_ERROR_NOT_READY";
    case kErrorIllegalAddress: return "CUDA_ERROR_ILLEGAL_ADDRESS";
    case kErrorHostMemoryAlreadyRegistered: return "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED";
    case kErrorHostMemoryNotRegistered: return "CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED";
    case kErrorLaunchFailed: return "CUDA_ERROR_LAUNCH_FAILED";
    case kErrorNotSupported: return "CUDA_ERROR_NOT_SUPPORTED";
    case kErrorStreamCaptureUnsupported: return "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED";
    case kErrorStreamCaptureInvalidated: return "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED";
    case kErrorStreamCaptureImplicit: return "CUDA_ERROR_STREAM_CAPTURE_IMPLICIT";
    case kErrorCapturedEvent: return "CUDA_ERROR_CAPTURED_EVENT";
    case kErrorUnknown: return "CUDA_ERROR_UNKNOWN";
    default: return nullptr;
  }
}
CUresult sim_cuGetErrorName(CUresult r, const char** name) {
  *name = error_name(r);
  return *name ? kSuccess : kErrorInvalidValue;
}
CUresult sim_cuGetErrorString(CUresult r, const char** text) {
  *text = error_name(r) ? "(simulated driver)" : nullptr;
  return *text ? kSuccess : kErrorInvalidValue;
}

CUresult sim_cuDeviceGetCount(int* n) {
  SIM_HOOK(cuDeviceGetCount);
  *n = sim().config.num_devices;
  return kSuccess;
}
CUresult sim_cuDeviceGet(CUdevice* dev, int ordinal) {
  SIM_HOOK(cuDeviceGet);
  if (ordinal < 0 || ordinal >= sim().config.num_devices) return kErrorInvalidDevice;
  *dev = ordinal;
  return kSuccess;
}
CUresult sim_cuDeviceGetAttribute(int* value, int attribute, CUdevice dev) {
  SIM_HOOK(cuDeviceGetAttribute);
  const Config& c = sim().config;
  if (dev < 0 || dev >= c.num_devices) return kErrorInvalidDevice;
  switch (attribute) {
    case kDeviceAttributeMultiprocessorCount: *value = c.sm_count; return kSuccess;
    case kDeviceAttributeComputeCapabilityMajor: *value = c.cc_major; return kSuccess;
    case kDeviceAttributeComputeCapabilityMinor: *value = c.cc_minor; return kSuccess;
    default: return kErrorInvalidValue;
  }
}

CUresult sim_cuDevicePrimaryCtxRetain(CUcontext* ctx, CUdevice dev) {
  SIM_HOOK(cuDevicePrimaryCtxRetain);
  Sim& s = sim();
  if (dev < 0 || dev >= s.config.num_devices) return kErrorInvalidDevice;
  std::lock_guard<std::mutex> lock(s.m);
  CUctx_st& c = s.contexts[dev];
  c.active = true;
  ++c.retains;
  *ctx = &c;
  return kSuccess;
}
CUresult sim_cuDevicePrimaryCtxRelease(CUdevice dev) {
  SIM_HOOK(cuDevicePrimaryCtxRelease);
  Sim& s = sim();
  if (dev < 0 || dev >= s.config.num_devices) return kErrorInvalidDevice;
  std::lock_guard<std::mutex> lock(s.m);
  CUctx_st& c = s.contexts[dev];
  if (c.retains == 0) return kErrorInvalidContext;
  if (--c.retains == 0) c.active = false;
  return kSuccess;
}
CUresult sim_cuDevicePrimaryCtxGetState(CUdevice dev, unsigned* flags, int* active) {
  SIM_HOOK(cuDevicePrimaryCtxGetState);
  Sim& s = sim();
  if (dev < 0 || dev >= s.config.num_devices) return kErrorInvalidDevice;
  std::lock_guard<std::mutex> lock(s.m);
  *flags = 0;
  *active = s.contexts[dev].active ? 1 : 0;
  return kSuccess;
}
CUresult sim_cuCtxGetCurrent(CUcontext* ctx) {
  SIM_HOOK(cuCtxGetCurrent);
  *ctx = t_current;
  return kSuccess;
}
CUresult sim_cuCtxSetCurrent(CUcontext ctx) {
  SIM_HOOK(cuCtxSetCurrent);
  if (ctx != nullptr) {
    std::lock_guard<std::mutex> lock(sim().m);
    if (!ctx->active) return kErrorInvalidContext;
  }
  t_current = ctx;
  return kSuccess;
}
CUresult sim_cuCtxGetStreamPriorityRange(int* least, int* greatest) {
  SIM_HOOK(cuCtxGetStreamPriorityRange);
  if (t_current == nullptr) return kErrorInvalidContext;
  *least = 0;
  *greatest = -5;
  return kSuccess;
}

CUresult sim_cuStreamCreateWithPriority(CUstream* out, unsigned, int) {
  SIM_HOOK(cuStreamCreateWithPriority);
  if (t_current == nullptr) return kErrorInvalidContext;
  Sim& s = sim();
  std::lock_guard<std::mutex> lock(s.m);
  *out = new_stream(t_current->device);
  return kSuccess;
}

CUresult sim_cuStreamWaitEvent(CUstream stream, CUevent event, unsigned) {
  SIM_HOOK(cuStreamWaitEvent);
  CUstream_st* st = nullptr;
  if (CUresult r = resolve(stream, &st)) return r;
  MarkerPtr m;
  {
    std::lock_guard<std::mutex> lock(event->m);
    if (event->captured) {
      // Waiting on an event recorded in a capture pulls the waiting stream into that capture.
      std::lock_guard<std::mutex> l(st->m);
      if (st->capture_status == kCaptureStatusNone) {
        st->capture_status = kCaptureStatusActive;
        st->capture_mode = kCaptureModeGlobal;
      }
      return kSuccess;
    }
    m = event->last;
  }
  if (capturing(st) != kCaptureStatusNone) return kSuccess;  // becomes a graph edge, runs nothing now
  if (m) st->push(false, [m] { m->wait(); });
  return kSuccess;
}

CUresult sim_cuStreamSynchronize(CUstream stream) {
  SIM_HOOK(cuStreamSynchronize);
  if (CUresult r = unsafe_call()) return r;
  CUstream_st* st = nullptr;
  if (CUresult r = resolve(stream, &st)) return r;
  if (capturing(st) != kCaptureStatusNone) return kErrorStreamCaptureUnsupported;
  auto m = std::make_shared<Marker>();
  st->push(false, [m] { m->set(); });
  m->wait();
  return sticky(st->device);
}

CUresult sim_cuStreamIsCapturing(CUstream stream, int* status) {
  SIM_HOOK(cuStreamIsCapturing);
  if (stream == nullptr) {
    if (t_current == nullptr) return kErrorInvalidContext;
    Sim& s = sim();
    std::lock_guard<std::mutex> lock(s.m);
    if (global_capture_active(s)) return kErrorStreamCaptureImplicit;
    *status = kCaptureStatusNone;
    return kSuccess;
  }
  *status = capturing(stream);
  return kSuccess;
}

CUresult sim_cuStreamGetCaptureInfo(CUstream stream, int* status, unsigned long long* id) {
  SIM_HOOK(cuStreamGetCaptureInfo);
  int st = kCaptureStatusNone;
  if (CUresult r = sim_cuStreamIsCapturing(stream, &st)) return r;
  *status = st;
  if (id != nullptr) *id = st == kCaptureStatusNone ? 0 : reinterpret_cast<std::uintptr_t>(stream);
  return kSuccess;
}

CUresult sim_cuThreadExchangeStreamCaptureMode(int* mode) {
  SIM_HOOK(cuThreadExchangeStreamCaptureMode);
  if (*mode < kCaptureModeGlobal || *mode > kCaptureModeRelaxed) return kErrorInvalidValue;
  std::swap(*mode, t_capture_mode);
  return kSuccess;
}

CUresult sim_cuEventCreate(CUevent* out, unsigned flags) {
  SIM_HOOK(cuEventCreate);
  if (t_current == nullptr) return kErrorInvalidContext;
  auto* e = new CUevent_st();
  e->flags = flags;
  e->device = t_current->device;
  *out = e;
  return kSuccess;
}

CUresult sim_cuEventRecord(CUevent event, CUstream stream) {
  SIM_HOOK(cuEventRecord);
  CUstream_st* st = nullptr;
  if (CUresult r = resolve(stream, &st)) return r;
  if (capturing(st) == kCaptureStatusActive) {
    std::lock_guard<std::mutex> lock(event->m);
    event->captured = true;
    return kSuccess;
  }
  auto m = std::make_shared<Marker>();
  {
    std::lock_guard<std::mutex> lock(event->m);
    event->last = m;
    event->captured = false;
  }
  st->push(false, [m] { m->set(); });
  return kSuccess;
}

CUresult sim_cuEventQuery(CUevent event) {
  SIM_HOOK(cuEventQuery);
  if (CUresult r = unsafe_call()) return r;
  MarkerPtr m;
  {
    std::lock_guard<std::mutex> lock(event->m);
    if (event->captured) return kErrorCapturedEvent;
    m = event->last;
  }
  if (m && !m->is_done()) return kErrorNotReady;
  return sticky(event->device);
}

CUresult sim_cuEventSynchronize(CUevent event) {
  SIM_HOOK(cuEventSynchronize);
  if (CUresult r = unsafe_call()) return r;
  MarkerPtr m;
  {
    std::lock_guard<std::mutex> lock(event->m);
    if (event->captured) return kErrorCapturedEvent;
    m = event->last;
  }
  if ((event->flags & kEventBlockingSync) == 0) {
    // The real driver spins a core in this wait: counted, so tests can see that we never ask for it.
    Sim& s = sim();
    std::lock_guard<std::mutex> lock(s.m);
    ++s.spinning_waits;
  }
  if (m) m->wait();
  return sticky(event->device);
}

CUresult sim_cuEventDestroy(CUevent event) {
  SIM_HOOK(cuEventDestroy);
  delete event;  // waits already enqueued hold the marker, not the event
  return kSuccess;
}

CUresult enqueue_copies(CUstream_st* st, std::vector<std::uintptr_t> dst, std::vector<std::uintptr_t> src,
                        std::vector<std::size_t> sizes) {
  if (capturing(st) != kCaptureStatusNone) return kSuccess;  // captured: runs at graph launch, not now
  st->push(true, [dst = std::move(dst), src = std::move(src), sizes = std::move(sizes)] {
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      if (sizes[i] != 0) std::memmove(reinterpret_cast<void*>(dst[i]), reinterpret_cast<const void*>(src[i]), sizes[i]);
    }
  });
  return kSuccess;
}

CUresult sim_cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, std::size_t n, CUstream stream) {
  SIM_HOOK(cuMemcpyAsync);
  if (t_current == nullptr) return kErrorInvalidContext;
  CUstream_st* st = nullptr;
  if (CUresult r = resolve(stream, &st)) return r;
  if (CUresult r = sticky(st->device)) return r;
  {
    Sim& s = sim();
    std::lock_guard<std::mutex> lock(s.m);
    if (CUresult r = check_operand(s, dst, n)) return r;
    if (CUresult r = check_operand(s, src, n)) return r;
  }
  return enqueue_copies(st, {dst}, {src}, {n});
}

CUresult sim_cuMemcpyBatchAsync(CUdeviceptr* dsts, CUdeviceptr* srcs, std::size_t* sizes, std::size_t count,
                                MemcpyAttributes* attrs, std::size_t* attr_idxs, std::size_t num_attrs,
                                std::size_t* fail_idx, CUstream stream) {
  SIM_HOOK(cuMemcpyBatchAsync);
  if (fail_idx != nullptr) *fail_idx = ~std::size_t(0);
  if (t_current == nullptr) return kErrorInvalidContext;
  // The driver refuses the legacy stream, an empty batch and attributes without a valid access order.
  if (stream == nullptr || count == 0 || num_attrs == 0 || attrs == nullptr || attr_idxs == nullptr ||
      attr_idxs[0] != 0) {
    return kErrorInvalidValue;
  }
  for (std::size_t a = 0; a < num_attrs; ++a) {
    if (attrs[a].srcAccessOrder < 1 || attrs[a].srcAccessOrder > 3) return kErrorInvalidValue;
  }
  if (CUresult r = sticky(stream->device)) return r;
  {
    Sim& s = sim();
    std::lock_guard<std::mutex> lock(s.m);
    for (std::size_t i = 0; i < count; ++i) {
      if (check_operand(s, dsts[i], sizes[i]) != kSuccess || check_operand(s, srcs[i], sizes[i]) != kSuccess) {
        if (fail_idx != nullptr) *fail_idx = i;
        return kErrorInvalidValue;
      }
    }
  }
  return enqueue_copies(stream, std::vector<std::uintptr_t>(dsts, dsts + count),
                        std::vector<std::uintptr_t>(srcs, srcs + count), std::vector<std::size_t>(sizes, sizes + count));
}

CUresult register_range(void* p, std::size_t n, unsigned flags, bool host_alloc) {
  Sim& s = sim();
  std::lock_guard<std::mutex> lock(s.m);
  const auto base = reinterpret_cast<std::uintptr_t>(p);
  bool partial = false;
  if (find(s.host_reg, base, n, &partial) != nullptr || partial) return kErrorHostMemoryAlreadyRegistered;
  s.host_reg[base] = Range{base, n, -1, flags, host_alloc};
  return kSuccess;
}

CUresult sim_cuMemHostAlloc(void** out, std::size_t n, unsigned flags) {
  SIM_HOOK(cuMemHostAlloc);
  if (t_current == nullptr) return kErrorInvalidContext;
  if (CUresult r = unsafe_call()) return r;
  void* p = std::aligned_alloc(4096, (std::max<std::size_t>(n, 1) + 4095) / 4096 * 4096);
  if (p == nullptr) return kErrorOutOfMemory;
  if (CUresult r = register_range(p, n, flags, true)) {
    std::free(p);
    return r;
  }
  *out = p;
  return kSuccess;
}

CUresult sim_cuMemFreeHost(void* p) {
  SIM_HOOK(cuMemFreeHost);
  if (t_current == nullptr) return kErrorInvalidContext;
  if (CUresult r = unsafe_call()) return r;
  Sim& s = sim();
  {
    std::lock_guard<std::mutex> lock(s.m);
    auto it = s.host_reg.find(reinterpret_cast<std::uintptr_t>(p));
    if (it == s.host_reg.end() || !it->second.host_alloc) return kErrorInvalidValue;
    s.host_reg.erase(it);
  }
  std::free(p);
  return kSuccess;
}

CUresult sim_cuMemHostRegister(void* p, std::size_t n, unsigned flags) {
  SIM_HOOK(cuMemHostRegister);
  if (t_current == nullptr) return kErrorInvalidContext;
  if (CUresult r = unsafe_call()) return r;
  if (p == nullptr || n == 0) return kErrorInvalidValue;
  return register_range(p, n, flags, false);
}

CUresult sim_cuMemHostUnregister(void* p) {
  SIM_HOOK(cuMemHostUnregister);
  if (t_current == nullptr) return kErrorInvalidContext;
  if (CUresult r = unsafe_call()) return r;
  Sim& s = sim();
  std::lock_guard<std::mutex> lock(s.m);
  auto it = s.host_reg.find(reinterpret_cast<std::uintptr_t>(p));
  if (it == s.host_reg.end() || it->second.host_alloc) return kErrorHostMemoryNotRegistered;
  s.host_reg.erase(it);
  return kSuccess;
}

CUresult sim_cuMemHostGetDevicePointer(CUdeviceptr* out, void* p, unsigned flags) {
  SIM_HOOK(cuMemHostGetDevicePointer);
  if (flags != 0) return kErrorInvalidValue;
  Sim& s = sim();
  std::lock_guard<std::mutex> lock(s.m);
  bool partial = false;
  const Range* r = find(s.host_reg, reinterpret_cast<std::uintptr_t>(p), 1, &partial);
  if (r == nullptr || (r->flags & kHostRegisterDeviceMap) == 0) return kErrorInvalidValue;
  *out = reinterpret_cast<std::uintptr_t>(p);  // unified addressing: the same address
  return kSuccess;
}

CUresult sim_cuPointerGetAttribute(void* data, int attribute, CUdeviceptr ptr) {
  SIM_HOOK(cuPointerGetAttribute);
  Sim& s = sim();
  std::lock_guard<std::mutex> lock(s.m);
  bool partial = false;
  const Range* dev = find(s.device_mem, ptr, 1, &partial);
  const Range* host = dev ? nullptr : find(s.host_reg, ptr, 1, &partial);
  if (dev == nullptr && host == nullptr) return kErrorInvalidValue;
  switch (attribute) {
    case kPointerAttributeMemoryType:
      *static_cast<unsigned*>(data) = dev ? kMemoryTypeDevice : kMemoryTypeHost;
      return kSuccess;
    case kPointerAttributeDevicePointer:
      if (host != nullptr && (host->flags & kHostRegisterDeviceMap) == 0) return kErrorInvalidValue;
      *static_cast<CUdeviceptr*>(data) = ptr;
      return kSuccess;
    case kPointerAttributeDeviceOrdinal:
      *static_cast<int*>(data) = dev ? dev->device : (t_current ? t_current->device : 0);
      return kSuccess;
    default: return kErrorInvalidValue;
  }
}

bool image_is(const void* image, const char* tag, std::size_t n) { return std::memcmp(image, tag, n) == 0; }

CUresult sim_cuModuleLoadData(CUmodule* out, const void* image) {
  SIM_HOOK(cuModuleLoadData);
  if (t_current == nullptr) return kErrorInvalidContext;
  const Config& c = sim().config;
  if (image == nullptr) return kErrorInvalidValue;
  if (c.kernels == "off") return kErrorNoBinaryForGpu;
  auto* m = new CUmod_st();
  m->device = t_current->device;
  std::uint32_t magic = 0;
  std::memcpy(&magic, image, sizeof magic);
  if (image_is(image, kBuiltinImage, std::strlen(kBuiltinImage))) {
    m->kind = "builtin";
    if (c.kernels != "builtin") {
      delete m;
      return kErrorInvalidImage;
    }
  } else if (magic == 0xBA55ED50u) {
    m->kind = "fatbin";
    // Header: magic, version (2 bytes), header size (2), then the size of what follows (8). nvcc does not
    // compress by default, so the entry points' names are in there: search all of it.
    const auto* b = static_cast<const unsigned char*>(image);
    std::uint16_t header = 0;
    std::uint64_t size = 0;
    std::memcpy(&header, b + 6, 2);
    std::memcpy(&size, b + 8, 8);
    m->names.assign(reinterpret_cast<const char*>(b), header + size);
  } else if (image_is(image, "\x7f" "ELF", 4)) {
    m->kind = "cubin";
    // The symbol names are in the section headers' string tables: search the whole ELF file.
    const auto* b = static_cast<const unsigned char*>(image);
    std::uint64_t shoff = 0;
    std::uint16_t shentsize = 0, shnum = 0;
    std::memcpy(&shoff, b + 0x28, 8);
    std::memcpy(&shentsize, b + 0x3A, 2);
    std::memcpy(&shnum, b + 0x3C, 2);
    m->names.assign(reinterpret_cast<const char*>(b), shoff + std::uint64_t(shentsize) * shnum);
  } else {
    const char* text = static_cast<const char*>(image);
    if (std::strstr(text, ".version") == nullptr || std::strstr(text, ".target") == nullptr) {
      delete m;
      return kErrorInvalidImage;
    }
    m->kind = "ptx";
    m->names = text;
  }
  *out = m;
  return kSuccess;
}

CUresult sim_cuModuleGetFunction(CUfunction* out, CUmodule module, const char* name) {
  SIM_HOOK(cuModuleGetFunction);
  const std::string n = name;
  if (n != "gather_chunks" && n != "checksum_kernel") return kErrorNotFound;
  if (!module->names.empty()) {
    // In an ELF image (a cubin, or the fatbin's) a symbol is a whole string-table entry: a C++-mangled
    // name (_Z13gather_chunks...) is not found by the real driver, and not here either.
    const std::string entry = module->kind == "ptx" ? n : std::string(1, '\0') + n + '\0';
    if (module->names.find(entry) == std::string::npos) return kErrorNotFound;
  }
  auto* f = new CUfunc_st();
  f->module = module;
  f->name = n;
  *out = f;
  return kSuccess;
}

CUresult sim_cuFuncGetAttribute(int* value, int attribute, CUfunction f) {
  SIM_HOOK(cuFuncGetAttribute);
  if (attribute != kFuncAttributeNumRegs) return kErrorInvalidValue;
  *value = f->name == "gather_chunks" ? 24 : 32;
  return kSuccess;
}

// The gather kernel on the host: the table is read when the kernel runs, chunk by chunk, and every
// address is checked against what a kernel on this device may touch.
void run_gather(int device, std::uintptr_t table, std::uint64_t num_chunks, unsigned threads) {
  using kernels::Chunk;
  Sim& s = sim();
  for (std::uint64_t c = 0; c < num_chunks; ++c) {
    Chunk ch;
    {
      std::lock_guard<std::mutex> lock(s.m);
      if (!device_accessible(s, device, table + c * sizeof(Chunk), sizeof(Chunk))) {
        s.sticky[device] = s.sticky[device] ? s.sticky[device] : kErrorIllegalAddress;
        return;
      }
      std::memcpy(&ch, reinterpret_cast<const void*>(table + c * sizeof(Chunk)), sizeof ch);
      if (!device_accessible(s, device, reinterpret_cast<std::uintptr_t>(ch.src), ch.num_bytes) ||
          !device_accessible(s, device, reinterpret_cast<std::uintptr_t>(ch.dst), ch.num_bytes)) {
        s.sticky[device] = s.sticky[device] ? s.sticky[device] : kErrorIllegalAddress;
        return;
      }
    }
    for (unsigned t = 0; t < threads; ++t) kernels::gather_share(ch, t, threads);
  }
}

void run_checksum(int device, std::uintptr_t table, std::uint64_t num_chunks, std::uintptr_t partials,
                  unsigned threads) {
  using kernels::SumChunk;
  Sim& s = sim();
  for (std::uint64_t c = 0; c < num_chunks; ++c) {
    SumChunk ch;
    {
      std::lock_guard<std::mutex> lock(s.m);
      if (!device_accessible(s, device, table + c * sizeof(SumChunk), sizeof(SumChunk)) ||
          !device_accessible(s, device, partials + c * 8, 8)) {
        s.sticky[device] = s.sticky[device] ? s.sticky[device] : kErrorIllegalAddress;
        return;
      }
      std::memcpy(&ch, reinterpret_cast<const void*>(table + c * sizeof(SumChunk)), sizeof ch);
      if (!device_accessible(s, device, ch.ptr + ch.begin, ch.end - ch.begin)) {
        s.sticky[device] = s.sticky[device] ? s.sticky[device] : kErrorIllegalAddress;
        return;
      }
    }
    unsigned long long acc = 0;
    for (unsigned t = 0; t < threads; ++t) acc += kernels::chunk_share(ch.ptr, ch.begin, ch.end, t, threads);
    std::memcpy(reinterpret_cast<void*>(partials + c * 8), &acc, 8);
  }
}

CUresult sim_cuLaunchKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                            unsigned bz, unsigned, CUstream stream, void** params, void** extra) {
  SIM_HOOK(cuLaunchKernel);
  if (t_current == nullptr) return kErrorInvalidContext;
  if (f == nullptr || params == nullptr || extra != nullptr) return kErrorInvalidValue;
  if (gx == 0 || gy != 1 || gz != 1 || bx == 0 || bx > 1024 || by != 1 || bz != 1) return kErrorInvalidValue;
  const int device = f->module->device;
  if (device != t_current->device) return kErrorInvalidContext;
  CUstream_st* st = nullptr;
  if (CUresult r = resolve(stream, &st)) return r;
  if (st->device != device) return kErrorInvalidHandle;
  if (CUresult r = sticky(device)) return r;
  {
    std::lock_guard<std::mutex> lock(sim().m);
    ++sim().kernel_launches;
  }
  if (capturing(st) != kCaptureStatusNone) return kSuccess;
  // The arguments are read at launch, as the driver copies them; the tables they point to are read when
  // the kernel runs.
  if (f->name == "gather_chunks") {
    const std::uintptr_t table = *static_cast<std::uintptr_t*>(params[0]);
    const std::uint64_t n = *static_cast<unsigned long long*>(params[1]);
    st->push(true, [=] { run_gather(device, table, n, bx); });
  } else {
    const std::uintptr_t table = *static_cast<std::uintptr_t*>(params[0]);
    const std::uint64_t n = *static_cast<unsigned long long*>(params[1]);
    const std::uintptr_t partials = *static_cast<std::uintptr_t*>(params[2]);
    st->push(true, [=] { run_checksum(device, table, n, partials, bx); });
  }
  return kSuccess;
}

DriverTable make() {
  DriverTable t;
#define SIM_SET(name, version, required) t.name##_ = &sim_##name;
  GO_DRIVER_ENTRY_POINTS(SIM_SET)
#undef SIM_SET
  return t;
}

CUstream_st* user_stream(int device, std::uintptr_t stream) {
  if (stream != 0) return reinterpret_cast<CUstream_st*>(stream);
  Sim& s = sim();
  std::lock_guard<std::mutex> lock(s.m);
  CUctx_st& c = s.contexts.at(device);
  GO_CHECK(c.active, "the legacy stream of simulated device " + std::to_string(device) + " needs its context");
  if (c.legacy == nullptr) c.legacy = new_stream(device);
  return c.legacy;
}

}  // namespace

Config parse_config(const std::string& text) {
  Config c;
  std::stringstream in(text);
  std::string item;
  while (std::getline(in, item, ',')) {
    const auto eq = item.find('=');
    const std::string key = eq == std::string::npos ? "devices" : item.substr(0, eq);
    const std::string value = eq == std::string::npos ? item : item.substr(eq + 1);
    try {
      if (key == "devices") c.num_devices = std::stoi(value);
      else if (key == "driver") c.driver_version = std::stoi(value);
      else if (key == "batch") c.batch = value != "0";
      else if (key == "sm") c.sm_count = std::stoi(value);
      else if (key == "cc") c.cc_major = std::stoi(value) / 10, c.cc_minor = std::stoi(value) % 10;
      else if (key == "kernels") c.kernels = value;
      else throw Error("unknown key");
    } catch (const std::exception&) {
      throw Error("GPU_OFFLOAD_SIM: cannot read '" + item + "' (expected e.g. 2 or devices=2,driver=12080,batch=0,"
                  "sm=4,cc=90,kernels=builtin|real|off)");
    }
  }
  GO_CHECK(c.num_devices >= 1 && c.num_devices <= 64, "GPU_OFFLOAD_SIM: devices must be 1 to 64");
  GO_CHECK(c.kernels == "builtin" || c.kernels == "real" || c.kernels == "off",
           "GPU_OFFLOAD_SIM: kernels must be builtin, real or off");
  return c;
}

const drv::DriverTable* make_table(const Config& config) {
  std::lock_guard<std::mutex> lock(g_make_mutex);
  static DriverTable* table = nullptr;
  if (g_sim == nullptr) {
    auto* s = new Sim();  // one per process, never destroyed: its stream workers run until exit
    s->config = config;
    s->contexts.resize(config.num_devices);
    for (int d = 0; d < config.num_devices; ++d) s->contexts[d].device = d;
    s->sticky.assign(config.num_devices, kSuccess);
    table = new DriverTable(make());
    if (!config.batch) table->cuMemcpyBatchAsync_ = nullptr;
    g_sim = s;
  }
  return table;
}

bool enable(const Config& config) {
  if (drv::driver_loaded()) return false;
  return drv::install_driver(make_table(config), config.driver_version, "simulated");
}

bool enabled() { return g_sim != nullptr && drv::driver_state().source == "simulated"; }

const Config& config() { return sim().config; }

std::uintptr_t mem_alloc(int device, std::size_t num_bytes) {
  Sim& s = sim();
  GO_CHECK(device >= 0 && device < s.config.num_devices, "no simulated device " + std::to_string(device));
  const std::size_t size = (std::max<std::size_t>(num_bytes, 1) + 511) / 512 * 512;
  void* p = std::aligned_alloc(512, size);
  GO_CHECK(p != nullptr, "simulated device memory: out of host memory");
  std::memset(p, 0, size);
  const auto base = reinterpret_cast<std::uintptr_t>(p);
  std::lock_guard<std::mutex> lock(s.m);
  s.device_mem[base] = Range{base, num_bytes, device, 0, false};
  CUctx_st& c = s.contexts[device];
  if (!c.active) {  // torch's first allocation on a device creates its primary context
    c.active = true;
    ++c.retains;
  }
  return base;
}

void mem_free(std::uintptr_t ptr) {
  Sim& s = sim();
  {
    std::lock_guard<std::mutex> lock(s.m);
    GO_CHECK(s.device_mem.erase(ptr) == 1, "not simulated device memory");
  }
  std::free(reinterpret_cast<void*>(ptr));
}

std::uintptr_t stream_create(int device) {
  Sim& s = sim();
  GO_CHECK(device >= 0 && device < s.config.num_devices, "no simulated device " + std::to_string(device));
  std::lock_guard<std::mutex> lock(s.m);
  return reinterpret_cast<std::uintptr_t>(new_stream(device));
}

std::uint64_t gate(std::uintptr_t stream) {
  GO_CHECK(stream != 0, "gate: pass a stream handle");
  Sim& s = sim();
  auto m = std::make_shared<Marker>();
  std::uint64_t id;
  {
    std::lock_guard<std::mutex> lock(s.m);
    id = s.next_gate++;
    s.gates[id] = m;
  }
  reinterpret_cast<CUstream_st*>(stream)->push(false, [m] { m->wait(); });
  return id;
}

void release(std::uint64_t gate_id) {
  Sim& s = sim();
  MarkerPtr m;
  {
    std::lock_guard<std::mutex> lock(s.m);
    auto it = s.gates.find(gate_id);
    GO_CHECK(it != s.gates.end(), "no such gate");
    m = it->second;
    s.gates.erase(it);
  }
  m->set();
}

void set_delay(std::uintptr_t stream, double seconds) {
  GO_CHECK(stream != 0, "set_delay: pass a stream handle");
  auto* st = reinterpret_cast<CUstream_st*>(stream);
  std::lock_guard<std::mutex> lock(st->m);
  st->delay = seconds;
}

void enqueue_fill(int device, std::uintptr_t stream, std::uintptr_t ptr, unsigned char value, std::size_t num_bytes) {
  user_stream(device, stream)->push(true, [=] { std::memset(reinterpret_cast<void*>(ptr), value, num_bytes); });
}

void enqueue_host(int device, std::uintptr_t stream, std::function<void()> fn) {
  user_stream(device, stream)->push(true, std::move(fn));
}

void synchronize() {
  Sim& s = sim();
  std::vector<CUstream_st*> streams;
  {
    std::lock_guard<std::mutex> lock(s.m);
    streams = s.streams;
  }
  // Twice: a stream waiting on another's event is only done once that one is.
  for (int round = 0; round < 2; ++round) {
    for (CUstream_st* st : streams) {
      auto m = std::make_shared<Marker>();
      st->push(false, [m] { m->set(); });
      m->wait();
    }
  }
}

std::uint64_t block(const std::string& entry, int nth, double timeout_seconds) {
  GO_CHECK(nth >= 1, "block: nth counts from 1");
  Sim& s = sim();
  std::lock_guard<std::mutex> lock(s.m);
  const std::uint64_t id = s.next_gate++;
  s.gates[id] = std::make_shared<Marker>();
  s.blocks[entry].push_back(Block{nth, id, timeout_seconds});
  return id;
}

bool parked(std::uint64_t gate_id) {
  Sim& s = sim();
  std::lock_guard<std::mutex> lock(s.m);
  auto it = s.parked.find(gate_id);
  return it != s.parked.end() && it->second;
}

void fail(const std::string& entry, int nth, int result) {
  GO_CHECK(nth >= 1, "fail: nth counts from 1");
  Sim& s = sim();
  std::lock_guard<std::mutex> lock(s.m);
  s.injections[entry].push_back(Injection{nth, result});
}

void clear_failures() {
  Sim& s = sim();
  std::lock_guard<std::mutex> lock(s.m);
  s.injections.clear();
}

std::size_t calls(const std::string& entry) {
  Sim& s = sim();
  std::lock_guard<std::mutex> lock(s.m);
  auto it = s.calls.find(entry);
  return it == s.calls.end() ? 0 : it->second;
}

void begin_capture(std::uintptr_t stream, int mode) {
  GO_CHECK(stream != 0, "begin_capture: the legacy stream cannot be captured");
  auto* st = reinterpret_cast<CUstream_st*>(stream);
  std::lock_guard<std::mutex> lock(st->m);
  st->capture_status = kCaptureStatusActive;
  st->capture_mode = mode;
}

void end_capture(std::uintptr_t stream) {
  auto* st = reinterpret_cast<CUstream_st*>(stream);
  std::lock_guard<std::mutex> lock(st->m);
  st->capture_status = kCaptureStatusNone;
}

int capture_status(std::uintptr_t stream) { return capturing(reinterpret_cast<CUstream_st*>(stream)); }

int sticky_error(int device) { return sticky(device); }

void clear_sticky_error(int device) {
  Sim& s = sim();
  std::lock_guard<std::mutex> lock(s.m);
  s.sticky.at(device) = kSuccess;
}

bool host_mapped(std::uintptr_t ptr, std::size_t num_bytes) {
  Sim& s = sim();
  std::lock_guard<std::mutex> lock(s.m);
  bool partial = false;
  const Range* r = find(s.host_reg, ptr, num_bytes, &partial);
  return r != nullptr && (r->flags & kHostRegisterDeviceMap) != 0;
}

std::size_t kernel_launches() {
  Sim& s = sim();
  std::lock_guard<std::mutex> lock(s.m);
  return s.kernel_launches;
}

std::size_t spinning_waits() {
  Sim& s = sim();
  std::lock_guard<std::mutex> lock(s.m);
  return s.spinning_waits;
}

}  // namespace gpu_offload::sim
