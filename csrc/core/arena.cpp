#include "arena.hpp"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>

#include "cuda_backend.hpp"
#include "errors.hpp"
#include "thread_pool.hpp"

namespace gpu_offload {

namespace testing {
void (*before_slab_release)(std::uintptr_t, std::size_t) = nullptr;
}  // namespace testing

namespace {

constexpr std::size_t kHugePage = 2u << 20;

std::size_t round_up(std::size_t n, std::size_t to) { return (n + to - 1) / to * to; }

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

// Maps size bytes and faults every page in from all cores at once: page population, not the copy, is
// what makes pinning slow, and it parallelises well (calibration: 8 GiB in 0.46 s on 16 cores with huge
// pages, against 5 s for cudaHostAlloc).
void* map_and_touch(std::size_t size) {
  void* ptr = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  GO_CHECK(ptr != MAP_FAILED, "mmap of " + human(size) + " failed: " + std::strerror(errno));
#ifdef MADV_HUGEPAGE
  madvise(ptr, size, MADV_HUGEPAGE);  // best effort: fewer page faults and TLB entries where THP allows
#endif
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

}  // namespace

std::size_t cgroup_headroom(const std::string& root) {
  std::size_t limit = 0, usage = 0;
  if (read_cgroup_value((root + "/memory.max").c_str(), &limit) &&
      read_cgroup_value((root + "/memory.current").c_str(), &usage)) {
    usage -= std::min(usage, cgroup_reclaimable((root + "/memory.stat").c_str(), "inactive_file"));
    return limit > usage ? limit - usage : 1;
  }
  // cgroup v1 reports "no limit" as a huge number rather than "max".
  if (read_cgroup_value((root + "/memory/memory.limit_in_bytes").c_str(), &limit) &&
      read_cgroup_value((root + "/memory/memory.usage_in_bytes").c_str(), &usage) && limit < (std::size_t(1) << 60)) {
    usage -= std::min(usage, cgroup_reclaimable((root + "/memory/memory.stat").c_str(), "total_inactive_file"));
    return limit > usage ? limit - usage : 1;
  }
  return 0;
}

std::size_t available_host_memory() {
  std::ifstream meminfo("/proc/meminfo");
  std::string key;
  std::size_t value = 0, available = 0;
  std::string unit;
  while (meminfo >> key >> value >> unit) {
    if (key == "MemAvailable:") {
      available = value * 1024;
      break;
    }
  }
  const std::size_t headroom = cgroup_headroom("/sys/fs/cgroup");
  if (headroom != 0 && (available == 0 || headroom < available)) return headroom;
  return available;
}

HostArena::HostArena(std::size_t max_bytes, std::size_t min_slab_bytes, PinMode mode)
    : max_bytes_(max_bytes), min_slab_bytes_(round_up(std::max<std::size_t>(min_slab_bytes, 1), 4096)), mode_(mode) {
  // Every copy goes through an arena: a bad GPU_OFFLOAD_NUM_THREADS is refused here, before any byte moves.
  ThreadPool::instance();
}

HostArena::~HostArena() {
  for (auto& [id, slab] : slabs_) {
    try {
      release_slab(slab);
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
  slabs_.at(slab_id).free_blocks.emplace(offset, size);
  by_size_.emplace(size, slab_id, offset);
}

void HostArena::erase_free(std::uint64_t slab_id, std::size_t offset, std::size_t size) {
  slabs_.at(slab_id).free_blocks.erase(offset);
  by_size_.erase(FreeKey{size, slab_id, offset});
}

void HostArena::add_slab(std::size_t size) {
  const std::size_t available = available_host_memory();
  // A refusal the user acts on (not a broken invariant): the message alone, without the check's text.
  if (available != 0 && size > available) {
    throw Error("refusing to pin " + human(size) + ": the machine has only " + human(available) +
                " available (MemAvailable, or the memory cgroup's headroom if lower); free host memory or "
                "lower the arena's max_bytes");
  }
  const auto start = std::chrono::steady_clock::now();
  Slab slab;
  slab.size = size;
  slab.mode = resolve_mode();
  switch (slab.mode) {
    case PinMode::kHostAlloc:
      slab.base = reinterpret_cast<std::uintptr_t>(cuda::host_alloc(size));
      break;
    case PinMode::kRegister: {
      void* ptr = map_and_touch(size);
      if (!cuda::host_register(ptr, size)) {
        // The driver refused to register (e.g. a locked-memory limit): pin the slow, sure way.
        munmap(ptr, size);
        slab.mode = PinMode::kHostAlloc;
        slab.base = reinterpret_cast<std::uintptr_t>(cuda::host_alloc(size));
      } else {
        slab.base = reinterpret_cast<std::uintptr_t>(ptr);
      }
      break;
    }
    default:
      slab.mode = PinMode::kNone;
      slab.base = reinterpret_cast<std::uintptr_t>(map_and_touch(size));
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

bool HostArena::take_best_fit(std::size_t size, std::uintptr_t* out) {
  auto it = by_size_.lower_bound(FreeKey{size, 0, 0});
  if (it == by_size_.end()) return false;
  const auto [block_size, slab_id, offset] = *it;
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
  by_size_.erase(FreeKey{slab.size, (*it)->first, 0});
  capacity_bytes_ -= slab.size;
  *it = slabs_.erase(*it);
  return {};
}

// Why a region does not fit under the cap, in the words that point at the remedy.
std::string HostArena::cap_message(std::size_t size) const {
  std::string why;
  const std::size_t largest = by_size_.empty() ? 0 : std::get<0>(*by_size_.rbegin());
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

std::uintptr_t HostArena::allocate(std::size_t num_bytes) {
  const std::size_t size = round_up(std::max<std::size_t>(num_bytes, 1), kAlignment);
  std::lock_guard<std::mutex> lock(mutex_);
  std::uintptr_t ptr = 0;
  if (take_best_fit(size, &ptr)) return ptr;
  // Grow by one slab: at least min_slab_bytes, rounded to huge pages, never past the cap.
  std::size_t slab_size = std::max(round_up(size, kHugePage), min_slab_bytes_);
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
  add_slab(slab_size);
  GO_CHECK(take_best_fit(size, &ptr), "internal error: a fresh slab did not fit its region");
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

void HostArena::reserve(std::size_t num_bytes) {
  std::uintptr_t ptr = allocate(num_bytes);
  free(ptr);
}

std::size_t HostArena::trim() {
  std::lock_guard<std::mutex> lock(mutex_);
  const std::size_t before = capacity_bytes_;
  std::string failure;
  for (auto it = slabs_.begin(); it != slabs_.end();) {
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
  s.largest_free_block_bytes = by_size_.empty() ? 0 : std::get<0>(*by_size_.rbegin());
  s.num_slab_allocations = num_slab_allocations_;
  s.pin_seconds = pin_seconds_;
  return s;
}

}  // namespace gpu_offload
