// HostArena: host memory in large slabs (page-locked when CUDA works), handed out as regions.
// Pinning is slow (about 2 GB/s with cudaHostAlloc), so the arena pins once and reuses forever: regions
// come from a best-fit free list with coalescing, and the arena grows by whole slabs only on demand.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

namespace gpu_offload {

enum class PinMode {
  kAuto,       // kRegister when a CUDA device answers, else kNone; resolved at the first slab
  kNone,       // plain page-aligned memory (CPU-only machines, or pinning turned off)
  kHostAlloc,  // cudaHostAlloc(portable | mapped)
  kRegister,   // mmap + huge pages + first touch from all cores, then cudaHostRegister(portable | mapped)
};

std::string to_string(PinMode mode);

struct ArenaStats {
  std::size_t capacity_bytes = 0;       // all slabs
  std::size_t used_bytes = 0;           // regions handed out (rounded to the alignment)
  std::size_t max_bytes = 0;            // 0: no cap
  std::size_t num_slabs = 0;
  std::size_t num_regions = 0;
  std::size_t num_free_blocks = 0;
  std::size_t largest_free_block_bytes = 0;
  std::size_t num_slab_allocations = 0;  // slabs ever created: flat in steady state
  double pin_seconds = 0.0;              // time spent creating slabs
  std::map<int, std::size_t> bytes_by_numa_node;  // capacity by the NUMA node its pages are on (-1: unknown)
};

// Host memory held by every arena of this process.
struct HostMemoryStats {
  std::size_t pinned_bytes = 0;      // page-locked: registered or cudaHostAlloc'ed slabs
  std::size_t registered_bytes = 0;  // the part pinned with cudaHostRegister
  std::size_t pageable_bytes = 0;    // slabs that are not page-locked (pin mode none)
  std::map<int, std::size_t> bytes_by_numa_node;
};
HostMemoryStats process_host_memory();

class HostArena {
 public:
  static constexpr std::size_t kAlignment = 256;
  static constexpr int kAnyNode = -1;
  static constexpr int kMaxNumaNodes = 1024;  // the node masks handed to the kernel  // a region not tied to a NUMA node (no GPU, or its node unknown)
  // A region smaller than 1/kShareDivisor of the next shared slab shares one (see next_slab_size): what the
  // shared slabs leave unused stays under 1/(kShareDivisor - 1) of them.
  static constexpr std::size_t kShareDivisor = 64;

  // max_bytes: hard cap on capacity (0: none). min_slab_bytes: the size up to which shared slabs grow
  // (geometrically, from the first region's own size).
  HostArena(std::size_t max_bytes, std::size_t min_slab_bytes, PinMode mode);
  ~HostArena();
  HostArena(const HostArena&) = delete;
  HostArena& operator=(const HostArena&) = delete;

  // A region of at least num_bytes, aligned to kAlignment. Throws Error (with the sizes) when the cap,
  // the node's budget (NodeLedger) or the machine's available memory would be exceeded; the arena is
  // unchanged then. numa_node: the node of the GPU the region serves; its slabs are placed there, and its
  // regions come from them while they have room (a region from another node's slab only when no new slab
  // can be had).
  std::uintptr_t allocate(std::size_t num_bytes, int numa_node = kAnyNode);
  void free(std::uintptr_t ptr);
  // Makes sure a region of num_bytes can be handed out without creating a slab later.
  void reserve(std::size_t num_bytes, int numa_node = kAnyNode);
  // Releases slabs with nothing allocated in them; returns the bytes released. A slab the system refuses
  // to take back (cudaHostUnregister or cudaFreeHost failing) stays in the arena, usable, and trim throws
  // after releasing the others, saying so. With first_slab, only slabs created after stats() reported
  // num_slab_allocations == first_slab (slabs are numbered in creation order): what one call added.
  std::size_t trim(std::uint64_t first_slab = 0);
  // The region's size as handed out (after rounding); throws when ptr is not a live region.
  std::size_t region_bytes(std::uintptr_t ptr) const;

  ArenaStats stats() const;
  PinMode pin_mode() const;
  // What happened that the caller may want to log (a slab that could not be placed on its node), once.
  std::vector<std::string> take_notes();

 private:
  struct Slab {
    std::uintptr_t base = 0;
    std::size_t size = 0;
    std::size_t used = 0;
    PinMode mode = PinMode::kNone;
    int numa_node = kAnyNode;   // the node it serves (its regions' key)
    int placed_node = -1;       // the node most of its pages are on (-1: unknown)
    std::map<std::size_t, std::size_t> free_blocks;  // offset -> size, for coalescing
  };
  struct Region {
    std::uint64_t slab_id;
    std::size_t offset;
    std::size_t size;
  };
  using FreeKey = std::tuple<int, std::size_t, std::uint64_t, std::size_t>;  // node, size, slab id, offset

  // The smallest free block that holds size: on numa_node's slabs, or on any slab for kAnyNode.
  bool take_best_fit(std::size_t size, int numa_node, std::uintptr_t* out);
  std::size_t largest_free_block() const;
  std::size_t next_slab_size(std::size_t size) const;
  // Reserves the bytes on the node's ledger, then pins a slab and accounts for it.
  void grow(std::size_t size, int numa_node);
  std::size_t release_empty_slabs();
  void forget_slab(const Slab& slab);
  // Gives an empty slab back to the system and forgets it; on failure it is kept as it was and the error
  // is returned (empty string on success).
  std::string release_empty_slab(std::map<std::uint64_t, Slab>::iterator* it);
  std::string cap_message(std::size_t size) const;
  void add_slab(std::size_t size, int numa_node);
  void release_slab(Slab& slab);
  void insert_free(std::uint64_t slab_id, std::size_t offset, std::size_t size);
  void erase_free(std::uint64_t slab_id, std::size_t offset, std::size_t size);
  PinMode resolve_mode();
  // pthread_atfork child handler: every live arena's mutex unheld again (see arena.cpp).
  static void after_fork_in_child();

  mutable std::mutex mutex_;
  std::size_t max_bytes_;
  std::size_t min_slab_bytes_;
  PinMode mode_;
  std::uint64_t next_slab_id_ = 0;
  std::map<std::uint64_t, Slab> slabs_;
  std::set<FreeKey> by_size_;  // best fit: the smallest free block that is large enough
  std::unordered_map<std::uintptr_t, Region> regions_;
  std::size_t capacity_bytes_ = 0;
  std::size_t used_bytes_ = 0;
  std::size_t num_slab_allocations_ = 0;
  double pin_seconds_ = 0.0;
  std::vector<std::string> notes_;
};

// For its lifetime, the calling thread takes new pages from `node` (MPOL_PREFERRED), then its own policy
// again: how a slab that the driver allocates (cudaHostAlloc, which faults its pages in the calling thread)
// is placed. A node below 0 does nothing; a refusal (no such node, a seccomp profile without
// set_mempolicy) leaves the policy as it was and says so in `notes`.
class ThreadPrefersNode {
 public:
  ThreadPrefersNode(int node, std::size_t size, std::vector<std::string>* notes);
  ~ThreadPrefersNode();
  ThreadPrefersNode(const ThreadPrefersNode&) = delete;
  ThreadPrefersNode& operator=(const ThreadPrefersNode&) = delete;

 private:
  bool active_ = false;
  int old_mode_ = 0;
  unsigned long old_mask_[HostArena::kMaxNumaNodes / (8 * sizeof(unsigned long))] = {};
};

namespace testing {
// Called before a slab's memory is given back to the system; a hook that throws stands for a failing
// cudaHostUnregister or cudaFreeHost (C++ tests only; null otherwise).
extern void (*before_slab_release)(std::uintptr_t base, std::size_t size);
}  // namespace testing

// Host memory that can still be taken, in bytes: MemAvailable from /proc/meminfo, or the memory cgroup's
// headroom where that is lower (containers); 0 when unknown. GPU_OFFLOAD_HOST_MEMORY_BYTES, where set, is
// the figure instead (0: unknown, no check).
std::size_t available_host_memory();

// All the host memory this process may have: MemTotal, or the memory cgroup's limit where that is lower;
// 0 when unknown. What a fractional GPU_OFFLOAD_NODE_MAX_BYTES is a fraction of.
std::size_t host_memory_limit();
// The memory limit that holds this process: the smallest v2 memory.max or v1 memory.limit_in_bytes, under
// root, of its own cgroup and those above it, as proc_self_cgroup (the text of /proc/self/cgroup) names
// them (empty: root's own files); 0: no limit.
std::size_t cgroup_limit(const std::string& root, const std::string& proc_self_cgroup = "");

// Room left under the memory cgroups that hold this process (see cgroup_limit; the smallest of limit minus
// usage, page cache not counted); 0 when none has a limit. Inside a container MemAvailable is the host's.
std::size_t cgroup_headroom(const std::string& root, const std::string& proc_self_cgroup = "");

}  // namespace gpu_offload
