// Where the kernels come from, per device, in order: the fatbin nvcc built into this module (every
// supported architecture plus PTX), else NVRTC at first use (libnvrtc found the way NVIDIA's
// cuda-pathfinder looks for it, compiled for the device's architecture and cached on disk), else (on the
// simulated driver only) the simulator's stand-in, else none: the copy engines then do every copy, and GPU
// checksums are refused with a clear error.
#include <dirent.h>
#include <dlfcn.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <mutex>
#include <sstream>
#include <string>
#include <vector>

#include "cuda_engine.hpp"
#include "driver_api.hpp"
#include "errors.hpp"
#include "sim_driver.hpp"

// The kernel source (kernels.cuh) and, when nvcc was found at build time, the fatbin, embedded in the
// module's read-only data. GPU_OFFLOAD_KERNEL_SOURCE_PATH and GPU_OFFLOAD_FATBIN_PATH are absolute paths
// set by CMake.
__asm__(".section .rodata.gpu_offload_kernels,\"a\",@progbits\n"
        ".balign 16\n"
        ".globl gpu_offload_kernel_source\n"
        ".hidden gpu_offload_kernel_source\n"
        "gpu_offload_kernel_source:\n"
        ".incbin \"" GPU_OFFLOAD_KERNEL_SOURCE_PATH "\"\n"
        ".byte 0\n"
#ifdef GPU_OFFLOAD_FATBIN_PATH
        ".balign 16\n"
        ".globl gpu_offload_fatbin\n"
        ".hidden gpu_offload_fatbin\n"
        "gpu_offload_fatbin:\n"
        ".incbin \"" GPU_OFFLOAD_FATBIN_PATH "\"\n"
        ".globl gpu_offload_fatbin_end\n"
        ".hidden gpu_offload_fatbin_end\n"
        "gpu_offload_fatbin_end:\n"
#endif
        ".previous\n");
extern "C" const char gpu_offload_kernel_source[];
#ifdef GPU_OFFLOAD_FATBIN_PATH
extern "C" const unsigned char gpu_offload_fatbin[];
extern "C" const unsigned char gpu_offload_fatbin_end[];
#endif

namespace gpu_offload::cuda {

using namespace drv;

namespace {

// ---- NVRTC, declared here (no header needed) ----------------------------------------------------------
struct NvrtcProgram;
using nvrtcResult = int;
struct NvrtcApi {
  const char* (*GetErrorString)(nvrtcResult) = nullptr;
  nvrtcResult (*Version)(int*, int*) = nullptr;
  nvrtcResult (*CreateProgram)(NvrtcProgram**, const char*, const char*, int, const char* const*,
                               const char* const*) = nullptr;
  nvrtcResult (*CompileProgram)(NvrtcProgram*, int, const char* const*) = nullptr;
  nvrtcResult (*GetCUBINSize)(NvrtcProgram*, std::size_t*) = nullptr;
  nvrtcResult (*GetCUBIN)(NvrtcProgram*, char*) = nullptr;
  nvrtcResult (*GetPTXSize)(NvrtcProgram*, std::size_t*) = nullptr;
  nvrtcResult (*GetPTX)(NvrtcProgram*, char*) = nullptr;
  nvrtcResult (*GetProgramLogSize)(NvrtcProgram*, std::size_t*) = nullptr;
  nvrtcResult (*GetProgramLog)(NvrtcProgram*, char*) = nullptr;
  nvrtcResult (*DestroyProgram)(NvrtcProgram**) = nullptr;
  nvrtcResult (*GetNumSupportedArchs)(int*) = nullptr;
  nvrtcResult (*GetSupportedArchs)(int*) = nullptr;
};

std::mutex g_dirs_mutex;
std::vector<std::string> g_library_dirs;

NvrtcApi g_nvrtc;

bool file_exists(const std::string& path) {
  struct stat st;
  return stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

std::string env(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr ? std::string(v) : std::string();
}

// Candidates in cuda-pathfinder's order: an explicit path, a libnvrtc already loaded in the process (torch
// may have loaded its own), the pip wheels' site-packages/nvidia/*/lib (nvidia-cuda-nvrtc-cu12, or cu13's
// nvidia/cu13/lib), conda, CUDA_HOME / CUDA_PATH, /usr/local/cuda, then the system's search path.
std::vector<std::pair<std::string, bool>> nvrtc_candidates() {
  std::vector<std::pair<std::string, bool>> out;  // (path or soname, only if already loaded)
  const char* sonames[] = {"libnvrtc.so.13", "libnvrtc.so.12"};
  if (!env("GPU_OFFLOAD_NVRTC").empty()) out.emplace_back(env("GPU_OFFLOAD_NVRTC"), false);
  for (const char* so : sonames) out.emplace_back(so, true);
  std::vector<std::string> dirs;
  {
    std::lock_guard<std::mutex> lock(g_dirs_mutex);
    dirs = g_library_dirs;
  }
  for (const std::string& nvidia : dirs) {
    DIR* d = opendir(nvidia.c_str());
    if (d == nullptr) continue;
    std::vector<std::string> subdirs;
    while (dirent* e = readdir(d)) {
      if (e->d_name[0] != '.') subdirs.push_back(nvidia + "/" + e->d_name + "/lib/");
    }
    closedir(d);
    for (const char* so : sonames) {
      for (const std::string& lib : subdirs) {
        if (file_exists(lib + so)) out.emplace_back(lib + so, false);
      }
    }
  }
  std::vector<std::string> roots;
  if (!env("CONDA_PREFIX").empty()) roots.push_back(env("CONDA_PREFIX") + "/lib/");
  for (const char* var : {"CUDA_HOME", "CUDA_PATH"}) {
    if (!env(var).empty()) roots.push_back(env(var) + "/lib64/");
  }
  roots.push_back("/usr/local/cuda/lib64/");
  for (const std::string& root : roots) {
    for (const char* so : sonames) {
      if (file_exists(root + so)) out.emplace_back(root + so, false);
    }
  }
  for (const char* so : sonames) out.emplace_back(so, false);
  return out;
}

NvrtcFound search_nvrtc() {
  NvrtcFound found;
  const DriverState& ds = driver_state();
  const int driver_major = ds.version / 1000;
  std::string newer;
  for (const auto& [name, only_loaded] : nvrtc_candidates()) {
    void* lib = dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL | (only_loaded ? RTLD_NOLOAD : 0));
    if (lib == nullptr) continue;
    NvrtcApi api;
#define GO_NVRTC_SYM(sym) api.sym = reinterpret_cast<decltype(api.sym)>(dlsym(lib, "nvrtc" #sym));
    GO_NVRTC_SYM(GetErrorString)
    GO_NVRTC_SYM(Version)
    GO_NVRTC_SYM(CreateProgram)
    GO_NVRTC_SYM(CompileProgram)
    GO_NVRTC_SYM(GetCUBINSize)
    GO_NVRTC_SYM(GetCUBIN)
    GO_NVRTC_SYM(GetPTXSize)
    GO_NVRTC_SYM(GetPTX)
    GO_NVRTC_SYM(GetProgramLogSize)
    GO_NVRTC_SYM(GetProgramLog)
    GO_NVRTC_SYM(DestroyProgram)
    GO_NVRTC_SYM(GetNumSupportedArchs)
    GO_NVRTC_SYM(GetSupportedArchs)
#undef GO_NVRTC_SYM
    int major = 0, minor = 0;
    if (api.Version == nullptr || api.CreateProgram == nullptr || api.GetCUBIN == nullptr ||
        api.GetSupportedArchs == nullptr || api.Version(&major, &minor) != 0) {
      continue;
    }
    char origin[4096] = {0};
    const std::string path = dlinfo(lib, RTLD_DI_ORIGIN, origin) == 0 && name.find('/') == std::string::npos
                                 ? std::string(origin) + "/" + name
                                 : name;
    // Code from a newer CUDA major than the driver's cannot be loaded by it.
    if (driver_major != 0 && major > driver_major) {
      if (newer.empty()) newer = path + " is CUDA " + std::to_string(major) + "." + std::to_string(minor);
      continue;
    }
    g_nvrtc = api;
    found.path = path;
    found.major = major;
    found.minor = minor;
    return found;
  }
  found.error = newer.empty() ? "no libnvrtc found (pip install nvidia-cuda-nvrtc-cu12, or set GPU_OFFLOAD_NVRTC)"
                              : "no usable libnvrtc: " + newer + ", newer than the driver (CUDA " +
                                    std::to_string(ds.version / 1000) + "." + std::to_string(ds.version % 1000 / 10) + ")";
  return found;
}

std::uint64_t fnv1a(const std::string& text, std::uint64_t h = 1469598103934665603ull) {
  for (unsigned char c : text) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return h;
}

bool read_file(const std::string& path, std::string* out) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return false;
  std::ostringstream s;
  s << f.rdbuf();
  *out = s.str();
  return !out->empty();
}

void make_dirs(const std::string& path) {
  for (std::size_t i = 1; i <= path.size(); ++i) {
    if (i == path.size() || path[i] == '/') mkdir(path.substr(0, i).c_str(), 0755);
  }
}

// Writes atomically (a temporary file, then rename), so that concurrent ranks never read half a file.
void write_file(const std::string& path, const std::string& data) {
  const std::string dir = path.substr(0, path.rfind('/'));
  make_dirs(dir);
  const std::string tmp = path + ".tmp" + std::to_string(getpid());
  {
    std::ofstream f(tmp, std::ios::binary);
    if (!f) return;  // an unwritable cache only costs a compile per process
    f.write(data.data(), static_cast<std::streamsize>(data.size()));
    if (!f) {
      std::remove(tmp.c_str());
      return;
    }
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) std::remove(tmp.c_str());
}

// Compiles the kernel source for `cc` (e.g. 90) with NVRTC: a cubin for that architecture when this NVRTC
// knows it, else PTX for the newest one it knows, which the driver compiles further. Cached on disk.
bool nvrtc_image(int cc, std::string* image, std::string* label, std::string* error) {
  const NvrtcFound& found = find_nvrtc();
  if (found.path.empty()) {
    *error = found.error;
    return false;
  }
  const NvrtcApi& n = g_nvrtc;
  int num = 0;
  std::vector<int> archs;
  if (n.GetNumSupportedArchs != nullptr && n.GetNumSupportedArchs(&num) == 0 && num > 0) {
    archs.resize(num);
    n.GetSupportedArchs(archs.data());
  }
  bool cubin = archs.empty();
  int target = cc;
  for (int a : archs) cubin = cubin || a == cc;
  if (!cubin) {
    target = 0;
    for (int a : archs) {
      if (a <= cc && a > target) target = a;
    }
    if (target == 0) {
      *error = "NVRTC " + std::to_string(found.major) + "." + std::to_string(found.minor) + " supports no architecture up to sm_" +
               std::to_string(cc);
      return false;
    }
  }
  const std::string option = std::string("--gpu-architecture=") + (cubin ? "sm_" : "compute_") + std::to_string(target);
  const std::vector<const char*> options = {option.c_str(), "-default-device"};
  const std::string source = gpu_offload_kernel_source;
  const std::string key = std::to_string(found.major) + "." + std::to_string(found.minor) + "|" + option + "|v1|" + source;
  char name[32];
  std::snprintf(name, sizeof name, "%016llx", static_cast<unsigned long long>(fnv1a(key)));
  const std::string cache = kernel_cache_dir();
  const std::string path = cache.empty() ? "" : cache + "/kernels-" + name + (cubin ? "-sm_" : "-compute_") +
                                                    std::to_string(target) + (cubin ? ".cubin" : ".ptx");
  if (!path.empty() && read_file(path, image)) {
    *label = "nvrtc-cache";
    return true;
  }
  NvrtcProgram* prog = nullptr;
  if (n.CreateProgram(&prog, source.c_str(), "gpu_offload_kernels.cu", 0, nullptr, nullptr) != 0) {
    *error = "nvrtcCreateProgram failed";
    return false;
  }
  const nvrtcResult r = n.CompileProgram(prog, static_cast<int>(options.size()), options.data());
  if (r != 0) {
    std::size_t log_size = 0;
    std::string log;
    if (n.GetProgramLogSize(prog, &log_size) == 0 && log_size > 1) {
      log.resize(log_size);
      n.GetProgramLog(prog, &log[0]);
      log.resize(log_size - 1);
    }
    *error = std::string("NVRTC could not compile the kernels (") + (n.GetErrorString ? n.GetErrorString(r) : "error") +
             "): " + log;
    n.DestroyProgram(&prog);
    return false;
  }
  std::size_t size = 0;
  const bool ok = cubin ? n.GetCUBINSize(prog, &size) == 0 : n.GetPTXSize(prog, &size) == 0;
  image->assign(size, '\0');
  const bool got = ok && size != 0 && (cubin ? n.GetCUBIN(prog, &(*image)[0]) == 0 : n.GetPTX(prog, &(*image)[0]) == 0);
  n.DestroyProgram(&prog);
  if (!got) {
    *error = "NVRTC produced no image";
    return false;
  }
  if (!path.empty()) write_file(path, *image);
  *label = "nvrtc";
  return true;
}

// Loads both kernels from `image` into the current context; false (with the driver's words) on failure.
bool load_image(const void* image, Kernels* k, std::string* error) {
  const DriverTable& d = api();
  CUmodule module = nullptr;
  CUresult r = d.cuModuleLoadData_(&module, image);
  if (r != kSuccess) {
    *error = "cuModuleLoadData: " + describe(r);
    return false;
  }
  // Resolving the functions (and asking for an attribute) loads them now even under
  // CUDA_MODULE_LOADING=LAZY, so that no copy ever pays for a load.
  r = d.cuModuleGetFunction_(&k->gather, module, "gather_chunks");
  if (r == kSuccess) r = d.cuModuleGetFunction_(&k->checksum, module, "checksum_kernel");
  if (r == kSuccess) r = d.cuFuncGetAttribute_(&k->info.gather_regs, kFuncAttributeNumRegs, k->gather);
  if (r == kSuccess) r = d.cuFuncGetAttribute_(&k->info.checksum_regs, kFuncAttributeNumRegs, k->checksum);
  if (r != kSuccess) {
    k->gather = k->checksum = nullptr;
    *error = "cuModuleGetFunction: " + describe(r);
    return false;
  }
  return true;
}

}  // namespace

void set_library_dirs(const std::vector<std::string>& dirs) {
  std::lock_guard<std::mutex> lock(g_dirs_mutex);
  g_library_dirs = dirs;
}

const NvrtcFound& find_nvrtc() {
  static const NvrtcFound found = search_nvrtc();
  return found;
}

bool has_fatbin() {
#ifdef GPU_OFFLOAD_FATBIN_PATH
  return gpu_offload_fatbin_end > gpu_offload_fatbin;
#else
  return false;
#endif
}

std::string kernel_cache_dir() {
  std::string root = env("GPU_OFFLOAD_CACHE_DIR");
  if (root.empty() && !env("XDG_CACHE_HOME").empty()) root = env("XDG_CACHE_HOME") + "/gpu_offload";
  if (root.empty() && !env("HOME").empty()) root = env("HOME") + "/.cache/gpu_offload";
  return root.empty() ? root : root + "/kernels";
}

Kernels load_kernels(int device) {
  Kernels k;
  k.info.device = device;
  const DriverTable& d = api();
  CUdevice dev = 0;
  int major = 0, minor = 0;
  if (d.cuDeviceGet_(&dev, device) != kSuccess ||
      d.cuDeviceGetAttribute_(&major, kDeviceAttributeComputeCapabilityMajor, dev) != kSuccess ||
      d.cuDeviceGetAttribute_(&minor, kDeviceAttributeComputeCapabilityMinor, dev) != kSuccess) {
    k.info.source = "none";
    k.info.error = "cannot read the device's compute capability";
    return k;
  }
  const int cc = major * 10 + minor;
  k.info.arch = "sm_" + std::to_string(cc);
  // GPU_OFFLOAD_KERNELS=fatbin|nvrtc|off narrows the choice (auto, the default, tries them in order).
  const std::string mode = env("GPU_OFFLOAD_KERNELS").empty() ? "auto" : env("GPU_OFFLOAD_KERNELS");
  std::vector<std::string> why;
  if (mode == "off") {
    why.push_back("GPU_OFFLOAD_KERNELS=off");
  } else if (mode != "auto" && mode != "fatbin" && mode != "nvrtc") {
    why.push_back("GPU_OFFLOAD_KERNELS must be auto, fatbin, nvrtc or off, not '" + mode + "'");
  }
  std::string error;
  if (mode == "auto" || mode == "fatbin") {
#ifdef GPU_OFFLOAD_FATBIN_PATH
    if (load_image(gpu_offload_fatbin, &k, &error)) {
      k.info.source = "fatbin";
      return k;
    }
    why.push_back("fatbin: " + error);
#else
    why.push_back("no fatbin in this build (nvcc was not found when it was built)");
#endif
  }
  if (mode == "auto" || mode == "nvrtc") {
    std::string image, label;
    if (!nvrtc_image(cc, &image, &label, &error)) {
      why.push_back(error);
    } else if (load_image(image.data(), &k, &error)) {
      k.info.source = label;
      return k;
    } else {
      why.push_back("NVRTC image: " + error);
    }
  }
  if (mode == "auto" && sim::enabled() && sim::config().kernels == "builtin") {
    if (load_image(sim::kBuiltinImage, &k, &error)) {
      k.info.source = "simulated";
      return k;
    }
    why.push_back(error);
  }
  k.info.source = "none";
  for (const std::string& w : why) k.info.error += (k.info.error.empty() ? "" : "; ") + w;
  return k;
}

}  // namespace gpu_offload::cuda
