#include "arena.hpp"

#include <pthread.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <new>
#include <sstream>

#include "cuda_backend.hpp"
#include "errors.hpp"
#include "ledger.hpp"
#include "thread_pool.hpp"

namespace gpu_offload {

namespace testing {
void (*before_slab_release)(std::uintptr_t, std::size_t) = nullptr;
}  // namespace testing

namespace {

constexpr std::size_t kHugePage = 2u << 20;

// Sizes past 2**63-1 (what torch's int64 sizes hold) are refused here, before any rounding could wrap them.
std::size_t round_up(std::size_t n, std::size_t to) {
  GO_CHECK(n <= (std::size_t{1} << 63) - 1, "a size of " + std::to_string(n) + " bytes is past 2**63-1 bytes");
  return (n + to - 1) / to * to;
}

// A size for people, as gpu_offload._bytes.format_bytes writes it: powers of 1024, three significant digits
// (512 B, 1.2 KiB, 3.31 GiB).
std::string human(std::size_t bytes) {
  static const char* const kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double value = static_cast<double>(bytes);
  int unit = 0;
  while (value >= 1024 && unit < 4) {
    value /= 1024;
    ++unit;
  }
  char buf[64];
  if (unit == 0) {
    std::snprintf(buf, sizeof(buf), "%zu B", bytes);
  } else {
    std::snprintf(buf, sizeof(buf), value < 1000 ? "%.3g %s" : "%.0f %s", value, kUnits[unit]);
  }
  return buf;
}

constexpr std::size_t kPage = 4096;
constexpr std::size_t kHugeRoundFrom = 256u << 20;  // slabs from this size on are whole huge pages
constexpr int kMaxNumaNodes = HostArena::kMaxNumaNodes;
constexpr int kMpolPreferred = 1;  // <numaif.h>'s MPOL_PREFERRED, without depending on libnuma
constexpr std::size_t kMaskWords = kMaxNumaNodes / (8 * sizeof(unsigned long));

// Asks the kernel to take the pages of [ptr, ptr + size) from `node`, before they are touched. Preferred,
// not bound: a full node then lends pages from the others instead of getting the process OOM-killed at
// first touch (MPOL_BIND). A refusal (no such node, a seccomp profile without mbind) leaves the range to
// the default policy and says so in `notes`.
void prefer_node(void* ptr, std::size_t size, int node, std::vector<std::string>* notes) {
  if (node < 0) return;
  unsigned long mask[kMaskWords] = {};
  if (node < kMaxNumaNodes) mask[node / (8 * sizeof(unsigned long))] = 1ul << (node % (8 * sizeof(unsigned long)));
  const long rc = node < kMaxNumaNodes ? syscall(SYS_mbind, ptr, size, kMpolPreferred, mask, kMaxNumaNodes + 1, 0) : -1;
  if (rc != 0) {
    notes->push_back("could not place a slab of " + human(size) + " on NUMA node " + std::to_string(node) + ": mbind: " +
                     (node < kMaxNumaNodes ? std::strerror(errno) : "node number too large") +
                     "; its pages go where the kernel puts them");
  }
}

}  // namespace

ThreadPrefersNode::ThreadPrefersNode(int node, std::size_t size, std::vector<std::string>* notes) {
  if (node < 0) return;
  unsigned long mask[kMaskWords] = {};
  long rc = -1;
  if (node < kMaxNumaNodes &&
      syscall(SYS_get_mempolicy, &old_mode_, old_mask_, kMaxNumaNodes + 1, nullptr, 0ul) == 0) {
    mask[node / (8 * sizeof(unsigned long))] = 1ul << (node % (8 * sizeof(unsigned long)));
    rc = syscall(SYS_set_mempolicy, kMpolPreferred, mask, kMaxNumaNodes + 1);
  }
  if (rc != 0) {
    notes->push_back("could not place a slab of " + human(size) + " on NUMA node " + std::to_string(node) +
                     ": set_mempolicy: " + (node < kMaxNumaNodes ? std::strerror(errno) : "node number too large") +
                     "; its pages go where the kernel puts them");
    return;
  }
  active_ = true;
}

ThreadPrefersNode::~ThreadPrefersNode() {
  if (!active_) return;
  // MPOL_DEFAULT takes no mask; any other policy gets its own back (its mode flags included).
  if (old_mode_ == 0) {
    syscall(SYS_set_mempolicy, 0, nullptr, 0ul);
  } else {
    syscall(SYS_set_mempolicy, old_mode_, old_mask_, kMaxNumaNodes + 1);
  }
}

namespace {

// The NUMA node most of the range's pages are on (a sample of up to 64 pages; move_pages only asks), and
// how many of the sampled pages are on `want`; -1 when the kernel does not say.
int placed_node(std::uintptr_t base, std::size_t size, int want, int* on_want, int* sampled) {
  constexpr int kSamples = 64;
  const std::size_t pages = std::max<std::size_t>(1, size / kPage);
  const int n = static_cast<int>(std::min<std::size_t>(kSamples, pages));
  void* addrs[kSamples];
  int status[kSamples];
  for (int i = 0; i < n; ++i) addrs[i] = reinterpret_cast<void*>(base + (pages * i / n) * kPage);
  *on_want = 0;
  *sampled = 0;
  if (syscall(SYS_move_pages, 0, static_cast<unsigned long>(n), addrs, nullptr, status, 0) != 0) return -1;
  std::map<int, int> count;
  for (int i = 0; i < n; ++i) {
    if (status[i] >= 0) ++count[status[i]];
  }
  int best = -1, best_count = 0;
  for (const auto& [node, c] : count) {
    *sampled += c;
    if (c > best_count) best = node, best_count = c;
  }
  *on_want = want >= 0 && count.count(want) ? count[want] : 0;
  return best;
}

// Bytes held by every arena of the process, by kind and by node.
struct ProcessHost {
  std::mutex mutex;
  HostMemoryStats stats;
};
ProcessHost& process_host() {
  static auto* p = new ProcessHost();  // never destroyed: arenas release slabs during exit
  return *p;
}
void account(PinMode mode, int node, std::size_t size, bool add) {
  ProcessHost& p = process_host();
  std::lock_guard<std::mutex> lock(p.mutex);
  auto change = [&](std::size_t& v) { v = add ? v + size : v - std::min(v, size); };
  if (mode == PinMode::kNone) {
    change(p.stats.pageable_bytes);
  } else {
    change(p.stats.pinned_bytes);
    if (mode == PinMode::kRegister) change(p.stats.registered_bytes);
  }
  change(p.stats.bytes_by_numa_node[node]);
  if (p.stats.bytes_by_numa_node[node] == 0) p.stats.bytes_by_numa_node.erase(node);
}

// Maps size bytes and faults every page in from all cores at once: page population, not the copy, is
// what makes pinning slow, and it parallelises well (calibration: 8 GiB in 0.46 s on 16 cores with huge
// pages, against 5 s for cudaHostAlloc). The pages are taken from numa_node (when one is given).
void* map_and_touch(std::size_t size, int numa_node, std::vector<std::string>* notes) {
  void* ptr = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  GO_CHECK(ptr != MAP_FAILED, "mmap of " + human(size) + " failed: " + std::strerror(errno));
#ifdef MADV_HUGEPAGE
  madvise(ptr, size, MADV_HUGEPAGE);  // best effort: fewer page faults and TLB entries where THP allows
#endif
  prefer_node(ptr, size, numa_node, notes);  // before the first touch: that is when pages are placed
  const std::size_t page = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
  auto& pool = ThreadPool::instance();
  const std::size_t shards = std::min<std::size_t>(pool.num_threads(), std::max<std::size_t>(1, size / kHugePage));
  const std::size_t per = round_up(size / shards + 1, page);
  char* base = static_cast<char*>(ptr);
  pool.parallel_for(shards, [&](std::size_t s) {
    const std::size_t begin = s * per, end = std::min(size, begin + per);
    for (std::size_t off = begin; off < end; off += page) base[off] = 0;
  });
  return ptr;
}

}  // namespace

std::string to_string(PinMode mode) {
  switch (mode) {
    case PinMode::kAuto: return "auto";
    case PinMode::kNone: return "none";
    case PinMode::kHostAlloc: return "hostalloc";
    case PinMode::kRegister: return "register";
  }
  return "?";
}

namespace {

// One number from a cgroup file ("max" means no limit).
bool read_cgroup_value(const char* path, std::size_t* value) {
  std::ifstream file(path);
  std::string text;
  if (!(file >> text) || text == "max") return false;
  try {
    *value = static_cast<std::size_t>(std::stoull(text));
  } catch (...) {
    return false;
  }
  return true;
}

// Page cache the kernel can drop on demand: charged to the cgroup, but no obstacle to pinning.
std::size_t cgroup_reclaimable(const char* stat_path, const char* key) {
  std::ifstream stat(stat_path);
  std::string name;
  std::size_t value = 0;
  while (stat >> name >> value) {
    if (name == key) return value;
  }
  return 0;
}

// cgroup v1 reports "no limit" as a huge number rather than "max".
constexpr std::size_t kNoLimit = std::size_t(1) << 60;

// The memory cgroups that hold this process, under root, as (folder, is v2): its own and every one above
// it, for its v2 path (the "0::" line of /proc/self/cgroup) and its v1 memory controller's. Without a
// cgroup namespace (a Slurm job, a systemd slice) the limit sits on a nested folder; inside a container
// with one, the path is "/" and the limit is on root itself; a path that does not exist under root (a
// container without a namespace) is skipped up to where it does. No text: root's own files.
std::vector<std::pair<std::string, bool>> memory_cgroups(const std::string& root, const std::string& proc_self_cgroup) {
  if (proc_self_cgroup.empty()) return {{root, true}, {root + "/memory", false}};
  std::vector<std::pair<std::string, bool>> out;
  std::istringstream lines(proc_self_cgroup);
  std::string line;
  while (std::getline(lines, line)) {
    const auto first = line.find(':'), second = line.find(':', first + 1);
    if (first == std::string::npos || second == std::string::npos) continue;
    const std::string controllers = "," + line.substr(first + 1, second - first - 1) + ",";
    const bool v2 = line.compare(0, first, "0") == 0 && controllers == ",,";
    if (!v2 && controllers.find(",memory,") == std::string::npos) continue;
    const std::string base = v2 ? root : root + "/memory";
    std::string path = line.substr(second + 1);
    if (path == "/") path.clear();
    while (true) {
      out.emplace_back(base + path, v2);
      if (path.empty()) break;
      const auto slash = path.rfind('/');
      path.resize(slash == std::string::npos ? 0 : slash);  // its parent ("" for the root)
    }
  }
  return out;
}

std::string self_cgroup() {
  std::ifstream file("/proc/self/cgroup");
  return std::string((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
}

}  // namespace

std::size_t cgroup_headroom(const std::string& root, const std::string& proc_self_cgroup) {
  std::size_t headroom = 0;
  for (const auto& [dir, v2] : memory_cgroups(root, proc_self_cgroup)) {
    std::size_t limit = 0, usage = 0;
    if (!read_cgroup_value((dir + (v2 ? "/memory.max" : "/memory.limit_in_bytes")).c_str(), &limit) ||
        limit >= kNoLimit ||
        !read_cgroup_value((dir + (v2 ? "/memory.current" : "/memory.usage_in_bytes")).c_str(), &usage)) {
      continue;
    }
    usage -= std::min(usage, cgroup_reclaimable((dir + "/memory.stat").c_str(), v2 ? "inactive_file" : "total_inactive_file"));
    const std::size_t room = limit > usage ? limit - usage : 1;
    if (headroom == 0 || room < headroom) headroom = room;
  }
  return headroom;
}

namespace {

// A /proc/meminfo figure in bytes ("MemTotal:", "MemAvailable:"), 0 where it is absent. Read line by line:
// some lines (HugePages_Total and the like) have no unit, which a word-by-word read would misalign.
std::size_t meminfo_bytes(const char* key) {
  std::ifstream meminfo("/proc/meminfo");
  const std::size_t n = std::strlen(key);
  std::string line;
  while (std::getline(meminfo, line)) {
    if (line.compare(0, n, key) == 0) {
      return static_cast<std::size_t>(std::strtoull(line.c_str() + n, nullptr, 10)) * 1024;  // (kB)
    }
  }
  return 0;
}

// The lower of the host's figure and the cgroup's, either of which may be unknown (0).
std::size_t lower_known(std::size_t host, std::size_t cgroup) {
  return cgroup != 0 && (host == 0 || cgroup < host) ? cgroup : host;
}

}  // namespace

std::size_t available_host_memory() {
  // GPU_OFFLOAD_HOST_MEMORY_BYTES stands in for the measured figure (0: no check). A machine whose memory
  // grows as it is used (a VM with memory hot-plug or a balloon) reports far less MemAvailable at first
  // than it can give.
  if (const char* set = std::getenv("GPU_OFFLOAD_HOST_MEMORY_BYTES"); set != nullptr && *set != '\0') {
    char* end = nullptr;
    errno = 0;
    const unsigned long long value = std::strtoull(set, &end, 10);
    if (*end != '\0' || errno != 0 || set[0] == '-') {
      throw Error(std::string("GPU_OFFLOAD_HOST_MEMORY_BYTES must be a number of bytes, got '") + set + "'");
    }
    return static_cast<std::size_t>(value);
  }
  return lower_known(meminfo_bytes("MemAvailable:"), cgroup_headroom("/sys/fs/cgroup", self_cgroup()));
}

std::size_t cgroup_limit(const std::string& root, const std::string& proc_self_cgroup) {
  std::size_t limit = 0;
  for (const auto& [dir, v2] : memory_cgroups(root, proc_self_cgroup)) {
    std::size_t value = 0;
    if (read_cgroup_value((dir + (v2 ? "/memory.max" : "/memory.limit_in_bytes")).c_str(), &value) &&
        value < kNoLimit && (limit == 0 || value < limit)) {
      limit = value;
    }
  }
  return limit;
}

std::size_t host_memory_limit() {
  return lower_known(meminfo_bytes("MemTotal:"), cgroup_limit("/sys/fs/cgroup", self_cgroup()));
}

HostMemoryStats process_host_memory() {
  ProcessHost& p = process_host();
  std::lock_guard<std::mutex> lock(p.mutex);
  return p.stats;
}

// Every live arena, for a forked child: fork() copies only the calling thread, so a mutex another thread held
// at that moment (one pinning a slab, for seconds) would stay held in the child forever. The child handler
// re-initialises them unheld. Never destroyed (a static destructor at exit would race threads still running).
namespace {
std::mutex* g_live_mutex = new std::mutex;
std::set<HostArena*>* g_live = new std::set<HostArena*>;
std::once_flag g_atfork_once;
}  // namespace

void HostArena::after_fork_in_child() {
  new (g_live_mutex) std::mutex;
  for (HostArena* arena : *g_live) new (&arena->mutex_) std::mutex;
}

HostArena::HostArena(std::size_t max_bytes, std::size_t min_slab_bytes, PinMode mode)
    : max_bytes_(max_bytes), min_slab_bytes_(round_up(std::max<std::size_t>(min_slab_bytes, 1), 4096)), mode_(mode) {
  // Every copy goes through an arena: a bad GPU_OFFLOAD_NUM_THREADS is refused here, before any byte moves.
  ThreadPool::instance();
  std::call_once(g_atfork_once, [] { pthread_atfork(nullptr, nullptr, &HostArena::after_fork_in_child); });
  std::lock_guard<std::mutex> lock(*g_live_mutex);
  g_live->insert(this);
}

HostArena::~HostArena() {
  {
    std::lock_guard<std::mutex> lock(*g_live_mutex);
    g_live->erase(this);
  }
  for (auto& [id, slab] : slabs_) {
    try {
      release_slab(slab);
      forget_slab(slab);
    } catch (...) {
      // A destructor must not throw; the process is usually exiting here anyway.
    }
  }
}

PinMode HostArena::resolve_mode() {
  if (mode_ == PinMode::kAuto) mode_ = cuda::available() ? PinMode::kRegister : PinMode::kNone;
  return mode_;
}

PinMode HostArena::pin_mode() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return mode_;
}

void HostArena::insert_free(std::uint64_t slab_id, std::size_t offset, std::size_t size) {
  Slab& slab = slabs_.at(slab_id);
  slab.free_blocks.emplace(offset, size);
  by_size_.emplace(slab.numa_node, size, slab_id, offset);
}

void HostArena::erase_free(std::uint64_t slab_id, std::size_t offset, std::size_t size) {
  Slab& slab = slabs_.at(slab_id);
  slab.free_blocks.erase(offset);
  by_size_.erase(FreeKey{slab.numa_node, size, slab_id, offset});
}

std::vector<std::string> HostArena::take_notes() {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<std::string> out;
  out.swap(notes_);
  return out;
}

// A region that fits in no free block gets a slab of its own size (pages, or 2 MiB from 256 MiB on), unless
// it is small next to the arena: then a shared slab as large as the arena so far, at most min_slab_bytes,
// for the small regions that follow. A first small snapshot pins a few pages, not min_slab_bytes; shared
// slabs grow geometrically (the arena doubles) up to min_slab_bytes; and what shared slabs leave unused
// (a tail too short for the region that came next) stays under 1/(kShareDivisor - 1) of them, so the
// arena's capacity stays within about 1.02x the bytes handed out plus one slab.
std::size_t HostArena::next_slab_size(std::size_t size) const {
  const std::size_t own = round_up(size, size >= kHugeRoundFrom ? kHugePage : kPage);
  const std::size_t shared = round_up(std::min(min_slab_bytes_, capacity_bytes_), kPage);
  return own * kShareDivisor >= shared ? own : shared;
}

void HostArena::grow(std::size_t size, int numa_node) {
  const std::size_t available = available_host_memory();
  // A refusal the user acts on (not a broken invariant): the message alone, without the check's text.
  if (available != 0 && size > available) {
    throw Error("refusing to pin " + human(size) + ": the machine has only " + human(available) +
                " available (MemAvailable, or the memory cgroup's headroom if lower); free host memory or "
                "lower the arena's max_bytes");
  }
  NodeLedger& ledger = NodeLedger::instance();
  ledger.reserve(size);  // before anything is pinned: throws naming the node's users when over the budget
  const std::size_t notes_before = notes_.size();
  try {
    add_slab(size, numa_node);
  } catch (const Error& e) {
    ledger.release(size);
    if (mode_ == PinMode::kNone || !cuda::compiled()) throw;
    // The driver (or the locked-memory limit it is held to) refused to pin: say what can be changed.
    std::string limit = "unlimited";
    if (FILE* f = std::fopen("/proc/self/limits", "r")) {
      char line[256];
      while (std::fgets(line, sizeof(line), f)) {
        if (std::strncmp(line, "Max locked memory", 17) == 0) {
          unsigned long long soft = 0;
          if (std::sscanf(line + 17, " %llu", &soft) == 1) limit = human(soft);
        }
      }
      std::fclose(f);
    }
    throw Error("pinning a slab of " + human(size) + " failed (pin mode " + to_string(mode_) + "): " + e.what() +
                ". The locked-memory limit (ulimit -l) is " + limit + ": raise it where it is set (ulimit -l "
                "unlimited, docker run --ulimit memlock=-1, LimitMEMLOCK=infinity for a systemd service); "
                "otherwise the driver ran out of pinnable memory: keep less off the device at once, set "
                "GPU_OFFLOAD_NODE_MAX_BYTES so that the node's processes stay under it, or use "
                "GPU_OFFLOAD_PIN=none (pageable memory, slower copies)");
  } catch (...) {
    ledger.release(size);
    throw;
  }
  Slab& slab = std::prev(slabs_.end())->second;
  int on_node = 0, sampled = 0;
  slab.placed_node = placed_node(slab.base, slab.size, numa_node, &on_node, &sampled);
  if (numa_node >= 0 && notes_.size() == notes_before && sampled > 0 && on_node < sampled) {
    notes_.push_back("NUMA node " + std::to_string(numa_node) + " did not hold a new slab of " + human(slab.size) +
                     " (full?): " + std::to_string(sampled - on_node) + " of " + std::to_string(sampled) +
                     " sampled pages are on other nodes");
  }
  account(slab.mode, slab.placed_node, slab.size, true);
}

void HostArena::forget_slab(const Slab& slab) {
  account(slab.mode, slab.placed_node, slab.size, false);
  NodeLedger::instance().release(slab.size);
}

void HostArena::add_slab(std::size_t size, int numa_node) {
  const auto start = std::chrono::steady_clock::now();
  Slab slab;
  slab.size = size;
  slab.numa_node = numa_node;
  slab.mode = resolve_mode();
  switch (slab.mode) {
    case PinMode::kHostAlloc: {
      ThreadPrefersNode prefer(numa_node, size, &notes_);  // the driver takes the pages in this thread
      slab.base = reinterpret_cast<std::uintptr_t>(cuda::host_alloc(size));
      break;
    }
    case PinMode::kRegister: {
      void* ptr = map_and_touch(size, numa_node, &notes_);
      if (!cuda::host_register(ptr, size)) {
        // The driver refused to register (e.g. a locked-memory limit): pin the slow, sure way.
        munmap(ptr, size);
        slab.mode = PinMode::kHostAlloc;
        ThreadPrefersNode prefer(numa_node, size, &notes_);
        slab.base = reinterpret_cast<std::uintptr_t>(cuda::host_alloc(size));
      } else {
        slab.base = reinterpret_cast<std::uintptr_t>(ptr);
      }
      break;
    }
    default:
      slab.mode = PinMode::kNone;
      slab.base = reinterpret_cast<std::uintptr_t>(map_and_touch(size, numa_node, &notes_));
      break;
  }
#ifdef MADV_DONTFORK
  // A forked child (a DataLoader worker) must not share pinned pages copy-on-write: the first write after
  // the fork would move the parent's page away from the physical page the GPU reads and writes. Best
  // effort: the child simply does not get the slab (it cannot use CUDA after a fork anyway).
  if (slab.mode != PinMode::kNone) madvise(reinterpret_cast<void*>(slab.base), size, MADV_DONTFORK);
#endif
  pin_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const std::uint64_t id = next_slab_id_++;
  slabs_.emplace(id, std::move(slab));
  insert_free(id, 0, size);
  capacity_bytes_ += size;
  ++num_slab_allocations_;
}

void HostArena::release_slab(Slab& slab) {
  void* ptr = reinterpret_cast<void*>(slab.base);
  if (testing::before_slab_release != nullptr) testing::before_slab_release(slab.base, slab.size);
  switch (slab.mode) {
    case PinMode::kHostAlloc: cuda::host_free(ptr); break;
    case PinMode::kRegister:
      cuda::host_unregister(ptr);  // throws on failure: the memory may still be registered, keep it mapped
      munmap(ptr, slab.size);
      break;
    default: munmap(ptr, slab.size); break;
  }
}

bool HostArena::take_best_fit(std::size_t size, int numa_node, std::uintptr_t* out) {
  auto it = by_size_.end();
  if (numa_node == kAnyNode) {
    // The best fit over every node's blocks: one lookup per node present (few).
    for (auto group = by_size_.begin(); group != by_size_.end();) {
      const int node = std::get<0>(*group);
      auto fit = by_size_.lower_bound(FreeKey{node, size, 0, 0});
      if (fit != by_size_.end() && std::get<0>(*fit) == node && (it == by_size_.end() || std::get<1>(*fit) < std::get<1>(*it))) {
        it = fit;
      }
      group = by_size_.lower_bound(FreeKey{node + 1, 0, 0, 0});
    }
  } else {
    auto fit = by_size_.lower_bound(FreeKey{numa_node, size, 0, 0});
    if (fit != by_size_.end() && std::get<0>(*fit) == numa_node) it = fit;
  }
  if (it == by_size_.end()) return false;
  const auto [node, block_size, slab_id, offset] = *it;
  (void)node;
  erase_free(slab_id, offset, block_size);
  if (block_size > size) insert_free(slab_id, offset + size, block_size - size);
  Slab& slab = slabs_.at(slab_id);
  slab.used += size;
  used_bytes_ += size;
  *out = slab.base + offset;
  regions_.emplace(*out, Region{slab_id, offset, size});
  return true;
}

std::string HostArena::release_empty_slab(std::map<std::uint64_t, Slab>::iterator* it) {
  Slab& slab = (*it)->second;
  try {
    release_slab(slab);
  } catch (const std::exception& e) {
    ++*it;
    return e.what();
  }
  // Only once the memory is gone: a slab that could not be released stays whole and usable.
  by_size_.erase(FreeKey{slab.numa_node, slab.size, (*it)->first, 0});
  capacity_bytes_ -= slab.size;
  forget_slab(slab);
  *it = slabs_.erase(*it);
  return {};
}

// Why a region does not fit under the cap, in the words that point at the remedy.
std::size_t HostArena::largest_free_block() const {
  std::size_t largest = 0;
  for (auto group = by_size_.begin(); group != by_size_.end();) {
    const int node = std::get<0>(*group);
    auto next = by_size_.lower_bound(FreeKey{node + 1, 0, 0, 0});
    largest = std::max(largest, std::get<1>(*std::prev(next)));
    group = next;
  }
  return largest;
}

std::size_t HostArena::release_empty_slabs() {
  const std::size_t before = capacity_bytes_;
  for (auto it = slabs_.begin(); it != slabs_.end();) {
    if (it->second.used != 0) {
      ++it;
    } else {
      release_empty_slab(&it);  // one that cannot be released is kept (and skipped)
    }
  }
  return before - capacity_bytes_;
}

std::string HostArena::cap_message(std::size_t size) const {
  std::string why;
  const std::size_t largest = largest_free_block();
  if (size > max_bytes_) {
    why = "the region alone is larger than max_bytes";
  } else if (used_bytes_ == 0) {
    why = "nothing is in use but empty slabs could not be given back";
  } else if (max_bytes_ - used_bytes_ >= size) {
    why = "enough free bytes in total, but the largest free block is " + human(largest) +
          " (free space is split between slabs and around the regions in use; a region cannot span slabs)";
  } else {
    why = "the regions in use leave too little room under the cap";
  }
  return "arena cap exceeded: a region of " + human(size) + " does not fit; in use " + human(used_bytes_) +
         ", capacity " + human(capacity_bytes_) + ", max_bytes " + human(max_bytes_) + " (" + why + ")";
}

std::uintptr_t HostArena::allocate(std::size_t num_bytes, int numa_node) {
  const std::size_t size = round_up(std::max<std::size_t>(num_bytes, 1), kAlignment);
  std::lock_guard<std::mutex> lock(mutex_);
  std::uintptr_t ptr = 0;
  if (take_best_fit(size, numa_node, &ptr)) return ptr;
  // Grow by one slab (next_slab_size), never past the cap.
  std::size_t slab_size = next_slab_size(size);
  // The node's own slabs are full: a new slab there if the cap leaves room for one as it is; otherwise (and
  // when the node's budget or the machine refuses one) another node's free block, before anything is given
  // back to make room.
  const bool room = max_bytes_ == 0 || capacity_bytes_ + slab_size <= max_bytes_;
  if (numa_node != kAnyNode && !room && take_best_fit(size, kAnyNode, &ptr)) return ptr;
  if (max_bytes_ != 0) {
    if (capacity_bytes_ + size > max_bytes_ && size <= max_bytes_) {
      // Empty slabs count against the cap, and a region cannot span slabs: give back as many empty slabs
      // as it takes to make room for one slab that holds the region (only when that is enough).
      std::size_t empty = 0;
      for (const auto& [id, slab] : slabs_) empty += slab.used == 0 ? slab.size : 0;
      if (capacity_bytes_ - empty + size <= max_bytes_) {
        for (auto it = slabs_.begin(); it != slabs_.end() && capacity_bytes_ + size > max_bytes_;) {
          if (it->second.used != 0) {
            ++it;
          } else {
            release_empty_slab(&it);  // one that cannot be released is kept; the check below then says so
          }
        }
      }
    }
    // A refusal the user acts on (not a broken invariant): the message alone, without the check's text.
    if (capacity_bytes_ + size > max_bytes_) throw Error(cap_message(size));
    slab_size = std::min(slab_size, max_bytes_ - capacity_bytes_);
  }
  try {
    grow(slab_size, numa_node);
  } catch (const Error&) {
    if (numa_node != kAnyNode && take_best_fit(size, kAnyNode, &ptr)) return ptr;
    // Empty slabs count against the node's budget and the machine's memory too: give them back and try
    // once more (only when there were some).
    if (release_empty_slabs() == 0) throw;
    grow(slab_size, numa_node);
  }
  GO_CHECK(take_best_fit(size, numa_node, &ptr), "internal error: a fresh slab did not fit its region");
  return ptr;
}

void HostArena::free(std::uintptr_t ptr) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = regions_.find(ptr);
  GO_CHECK(it != regions_.end(), "free of a pointer that is not a live arena region");
  Region region = it->second;
  regions_.erase(it);
  Slab& slab = slabs_.at(region.slab_id);
  slab.used -= region.size;
  used_bytes_ -= region.size;
  std::size_t offset = region.offset, size = region.size;
  // Coalesce with the free neighbours on both sides.
  auto next = slab.free_blocks.lower_bound(offset);
  if (next != slab.free_blocks.end() && next->first == offset + size) {
    const std::size_t next_size = next->second;
    erase_free(region.slab_id, next->first, next_size);
    size += next_size;
  }
  auto after = slab.free_blocks.lower_bound(offset);
  if (after != slab.free_blocks.begin()) {
    auto prev = std::prev(after);
    if (prev->first + prev->second == offset) {
      const std::size_t prev_offset = prev->first, prev_size = prev->second;
      erase_free(region.slab_id, prev_offset, prev_size);
      offset = prev_offset;
      size += prev_size;
    }
  }
  insert_free(region.slab_id, offset, size);
}

void HostArena::reserve(std::size_t num_bytes, int numa_node) {
  std::uintptr_t ptr = allocate(num_bytes, numa_node);
  free(ptr);
}

std::size_t HostArena::trim(std::uint64_t first_slab) {
  std::lock_guard<std::mutex> lock(mutex_);
  const std::size_t before = capacity_bytes_;
  std::string failure;
  for (auto it = slabs_.lower_bound(first_slab); it != slabs_.end();) {
    if (it->second.used != 0) {
      ++it;
      continue;
    }
    std::string error = release_empty_slab(&it);
    if (failure.empty()) failure = error;
  }
  const std::size_t released = before - capacity_bytes_;
  GO_CHECK(failure.empty(), "trim released " + human(released) + " but a slab could not be given back (it stays in "
                                "the arena, usable): " + failure);
  return released;
}

std::size_t HostArena::region_bytes(std::uintptr_t ptr) const {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = regions_.find(ptr);
  GO_CHECK(it != regions_.end(), "not a live arena region");
  return it->second.size;
}

ArenaStats HostArena::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  ArenaStats s;
  s.capacity_bytes = capacity_bytes_;
  s.used_bytes = used_bytes_;
  s.max_bytes = max_bytes_;
  s.num_slabs = slabs_.size();
  s.num_regions = regions_.size();
  s.num_free_blocks = by_size_.size();
  s.largest_free_block_bytes = largest_free_block();
  s.num_slab_allocations = num_slab_allocations_;
  s.pin_seconds = pin_seconds_;
  for (const auto& [id, slab] : slabs_) s.bytes_by_numa_node[slab.placed_node] += slab.size;
  return s;
}

}  // namespace gpu_offload
