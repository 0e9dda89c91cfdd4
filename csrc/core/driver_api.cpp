#include "driver_api.hpp"

#include <dlfcn.h>

#include <array>
#include <cstdlib>
#include <mutex>

#include "errors.hpp"
#include "sim_driver.hpp"

namespace gpu_offload::drv {
namespace {

constexpr int kMaxDevices = 64;

std::mutex g_mutex;  // guards g_state's creation against install_driver
DriverState* g_state = nullptr;
const DriverTable* g_installed = nullptr;
int g_installed_version = 0;
std::string g_installed_source;

using GetProcAddressV1 = CUresult (*)(const char*, void**, int, unsigned long long);
using GetProcAddressV2 = CUresult (*)(const char*, void**, int, unsigned long long, int*);

DriverState load_libcuda() {
  DriverState s;
  // The driver library by its soname (never the unversioned dev symlink): whatever the system installed.
  void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    const char* why = dlerror();
    s.error = std::string("no CUDA driver: dlopen(libcuda.so.1) failed: ") + (why ? why : "unknown");
    return s;
  }
  // cuGetProcAddress_v2 (12.5 drivers on) reports whether a symbol exists at the version asked;
  // cuGetProcAddress (11.3 on, the R535 drivers have it) does not, and we read a null pointer then.
  auto v2 = reinterpret_cast<GetProcAddressV2>(dlsym(lib, "cuGetProcAddress_v2"));
  auto v1 = reinterpret_cast<GetProcAddressV1>(dlsym(lib, "cuGetProcAddress"));
  if (v2 == nullptr && v1 == nullptr) {
    s.error = "the CUDA driver is too old: libcuda.so.1 has no cuGetProcAddress (R535 or later is needed)";
    return s;
  }
  char path[4096] = {0};
  if (dlinfo(lib, RTLD_DI_ORIGIN, path) == 0) {
    s.source = std::string(path) + "/libcuda.so.1";
  } else {
    s.source = "libcuda.so.1";
  }
  auto* table = new DriverTable();  // lives as long as the process, like the library
  std::string missing_required;
  const auto resolve = [&](const char* name, int version, bool required, void** slot) {
    void* fn = nullptr;
    CUresult r;
    if (v2 != nullptr) {
      int found = -1;
      r = v2(name, &fn, version, kGetProcAddressLegacyStream, &found);
      if (found != kGetProcAddressSuccess) fn = nullptr;
    } else {
      r = v1(name, &fn, version, kGetProcAddressLegacyStream);
    }
    if (r != kSuccess) fn = nullptr;
    *slot = fn;
    if (fn != nullptr) {
      s.found.push_back(name);
    } else if (required) {
      missing_required += (missing_required.empty() ? "" : ", ") + std::string(name);
    } else {
      s.missing.push_back(name);
    }
  };
#define GO_RESOLVE(name, version, required) \
  resolve(#name, version, required, reinterpret_cast<void**>(&table->name##_));
  GO_DRIVER_ENTRY_POINTS(GO_RESOLVE)
#undef GO_RESOLVE
  if (!missing_required.empty()) {
    s.error = "the CUDA driver lacks entry points the engine needs (" + missing_required + "); R535 or later is needed";
    delete table;
    return s;
  }
  const CUresult init = table->cuInit_(0);
  if (init != kSuccess) {
    const char* name = nullptr;
    table->cuGetErrorName_(init, &name);
    s.error = std::string("cuInit failed: ") + (name ? name : std::to_string(init));
    delete table;
    return s;
  }
  table->cuDriverGetVersion_(&s.version);
  if (table->cuDeviceGetCount_(&s.device_count) != kSuccess) s.device_count = 0;
  s.table = table;
  return s;
}

DriverState load() {
  if (g_installed == nullptr) {
    // GPU_OFFLOAD_SIM=<devices>[,key=value...]: the simulated driver, for tests run as a whole process.
    const char* env = std::getenv("GPU_OFFLOAD_SIM");
    if (env != nullptr && *env != '\0') {
      sim::Config config = sim::parse_config(env);
      g_installed = sim::make_table(config);
      g_installed_version = config.driver_version;
      g_installed_source = "simulated";
    }
  }
  if (g_installed != nullptr) {
    DriverState s;
    s.table = g_installed;
    s.source = g_installed_source;
    s.version = g_installed_version;
    const DriverTable& t = *g_installed;
#define GO_LIST(name, version, required) (t.name##_ != nullptr ? s.found : s.missing).push_back(#name);
    GO_DRIVER_ENTRY_POINTS(GO_LIST)
#undef GO_LIST
    if (t.cuInit_(0) != kSuccess || t.cuDeviceGetCount_(&s.device_count) != kSuccess) s.device_count = 0;
    return s;
  }
  return load_libcuda();
}

}  // namespace

const DriverState& driver_state() {
  static std::once_flag once;
  std::call_once(once, [] {
    std::lock_guard<std::mutex> lock(g_mutex);
    auto* s = new DriverState(load());
    // Batched copies where the driver has them (12.8 on); chosen by the driver's version, not the build's.
    // GPU_OFFLOAD_BATCHED_COPIES=0 asks for one cuMemcpyAsync per copy anyway: the path of R535-R565
    // drivers, so that a newer driver can run (and test) it.
    const char* batched = std::getenv("GPU_OFFLOAD_BATCHED_COPIES");
    const bool allowed = batched == nullptr || std::string(batched) != "0";
    s->batched_copies = allowed && s->table != nullptr && s->table->cuMemcpyBatchAsync_ != nullptr &&
                        s->version >= 12080;
    g_state = s;
  });
  return *g_state;
}

bool driver_loaded() {
  std::lock_guard<std::mutex> lock(g_mutex);
  return g_state != nullptr;
}

bool install_driver(const DriverTable* table, int version, const std::string& source) {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (g_state != nullptr) return false;
  g_installed = table;
  g_installed_version = version;
  g_installed_source = source;
  return true;
}

const DriverTable& api() {
  const DriverState& s = driver_state();
  if (s.table == nullptr) throw Error(s.error.empty() ? "no CUDA driver" : s.error);
  return *s.table;
}

std::string describe(CUresult result) {
  const char* name = nullptr;
  const char* text = nullptr;
  const DriverState& s = driver_state();
  if (s.table != nullptr) {
    s.table->cuGetErrorName_(result, &name);
    s.table->cuGetErrorString_(result, &text);
  }
  std::string out = name ? name : "CUDA error " + std::to_string(result);
  if (text != nullptr) out += std::string(": ") + text;
  return out;
}

void throw_cu_error(const char* file, int line, const char* call, CUresult result) {
  throw_error(file, line, call, "CUDA error " + describe(result));
}

namespace {

struct PrimaryContexts {
  std::array<std::once_flag, kMaxDevices> once;
  std::array<CUcontext, kMaxDevices> ctx{};
  std::array<CUresult, kMaxDevices> status{};
};
PrimaryContexts& primaries() {
  static PrimaryContexts* p = new PrimaryContexts();  // never destroyed: used until the process ends
  return *p;
}

}  // namespace

CUcontext primary_context(int device) {
  const DriverTable& d = api();
  GO_CHECK(device >= 0 && device < kMaxDevices && device < driver_state().device_count,
           "CUDA device " + std::to_string(device) + " does not exist (" +
               std::to_string(driver_state().device_count) + " devices)");
  PrimaryContexts& p = primaries();
  std::call_once(p.once[device], [&] {
    CUdevice dev = 0;
    p.status[device] = d.cuDeviceGet_(&dev, device);
    if (p.status[device] == kSuccess) p.status[device] = d.cuDevicePrimaryCtxRetain_(&p.ctx[device], dev);
  });
  if (p.status[device] != kSuccess) {
    throw_cu_error(__FILE__, __LINE__, ("cuDevicePrimaryCtxRetain(device " + std::to_string(device) + ")").c_str(),
                   p.status[device]);
  }
  return p.ctx[device];
}

bool primary_context_active(int device) {
  const DriverState& s = driver_state();
  if (s.table == nullptr || device < 0 || device >= s.device_count) return false;
  CUdevice dev = 0;
  unsigned flags = 0;
  int active = 0;
  return s.table->cuDeviceGet_(&dev, device) == kSuccess &&
         s.table->cuDevicePrimaryCtxGetState_(dev, &flags, &active) == kSuccess && active != 0;
}

ContextGuard::ContextGuard(int device) {
  const DriverTable& d = api();
  CUcontext ctx = primary_context(device);
  GO_CU_CHECK(d.cuCtxGetCurrent_(&previous_));
  if (previous_ != ctx) {
    GO_CU_CHECK(d.cuCtxSetCurrent_(ctx));
    changed_ = true;
  }
}

ContextGuard::~ContextGuard() {
  if (changed_) api().cuCtxSetCurrent_(previous_);
}

RelaxedCaptureMode::RelaxedCaptureMode() {
  const DriverState& s = driver_state();
  if (s.table == nullptr) return;
  int mode = kCaptureModeRelaxed;
  if (s.table->cuThreadExchangeStreamCaptureMode_(&mode) == kSuccess) {
    previous_ = mode;
    changed_ = true;
  }
}

RelaxedCaptureMode::~RelaxedCaptureMode() {
  if (!changed_) return;
  int mode = previous_;
  driver_state().table->cuThreadExchangeStreamCaptureMode_(&mode);
}

}  // namespace gpu_offload::drv
