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
};

class HostArena {
 public:
  static constexpr std::size_t kAlignment = 256;

  // max_bytes: hard cap on capacity (0: none). min_slab_bytes: the smallest slab created on demand.
  HostArena(std::size_t max_bytes, std::size_t min_slab_bytes, PinMode mode);
  ~HostArena();
  HostArena(const HostArena&) = delete;
  HostArena& operator=(const HostArena&) = delete;

  // A region of at least num_bytes, aligned to kAlignment. Throws Error (with the sizes) when the cap or
  // the machine's available memory would be exceeded; the arena is unchanged then.
  std::uintptr_t allocate(std::size_t num_bytes);
  void free(std::uintptr_t ptr);
  // Makes sure a region of num_bytes can be handed out without creating a slab later.
  void reserve(std::size_t num_bytes);
  // Releases slabs with nothing allocated in them; returns the bytes released. A slab the system refuses
  // to take back (cudaHostUnregister or cudaFreeHost failing) stays in the arena, usable, and trim throws
  // after releasing the others, saying so. With first_slab, only slabs created after stats() reported
  // num_slab_allocations == first_slab (slabs are numbered in creation order): what one call added.
  std::size_t trim(std::uint64_t first_slab = 0);
  // The region's size as handed out (after rounding); throws when ptr is not a live region.
  std::size_t region_bytes(std::uintptr_t ptr) const;

  ArenaStats stats() const;
  PinMode pin_mode() const;

 private:
  struct Slab {
    std::uintptr_t base = 0;
    std::size_t size = 0;
    std::size_t used = 0;
    PinMode mode = PinMode::kNone;
    std::map<std::size_t, std::size_t> free_blocks;  // offset -> size, for coalescing
  };
  struct Region {
    std::uint64_t slab_id;
    std::size_t offset;
    std::size_t size;
  };
  using FreeKey = std::tuple<std::size_t, std::uint64_t, std::size_t>;  // size, slab id, offset

  bool take_best_fit(std::size_t size, std::uintptr_t* out);
  // Gives an empty slab back to the system and forgets it; on failure it is kept as it was and the error
  // is returned (empty string on success).
  std::string release_empty_slab(std::map<std::uint64_t, Slab>::iterator* it);
  std::string cap_message(std::size_t size) const;
  void add_slab(std::size_t size);
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
};

namespace testing {
// Called before a slab's memory is given back to the system; a hook that throws stands for a failing
// cudaHostUnregister or cudaFreeHost (C++ tests only; null otherwise).
extern void (*before_slab_release)(std::uintptr_t base, std::size_t size);
}  // namespace testing

// Host memory that can still be taken, in bytes: MemAvailable from /proc/meminfo, or the memory cgroup's
// headroom where that is lower (containers); 0 when unknown.
std::size_t available_host_memory();

// Room left under the memory cgroup mounted at root (v2 files, else v1's memory/ controller), page cache
// not counted; 0 when there is no limit. Inside a container MemAvailable is the host's figure.
std::size_t cgroup_headroom(const std::string& root);

}  // namespace gpu_offload
