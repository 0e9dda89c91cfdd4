#include <sys/stat.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "check.hpp"
#include "core/arena.hpp"
#include "core/errors.hpp"

using gpu_offload::HostArena;
using gpu_offload::PinMode;

constexpr std::size_t kMiB = 1u << 20;

TEST_CASE(regions_are_aligned_and_writable) {
  HostArena arena(0, 4 * kMiB, PinMode::kNone);
  std::vector<std::uintptr_t> ptrs;
  for (std::size_t n : {1, 255, 256, 257, 4096, 100000}) {
    auto p = arena.allocate(n);
    CHECK(p % HostArena::kAlignment == 0);
    std::memset(reinterpret_cast<void*>(p), 0xAB, n);
    ptrs.push_back(p);
  }
  CHECK(arena.stats().num_regions == ptrs.size());
  for (auto p : ptrs) arena.free(p);
  CHECK(arena.stats().used_bytes == 0);
}

TEST_CASE(free_coalesces_neighbours) {
  HostArena arena(0, 4 * kMiB, PinMode::kNone);
  auto a = arena.allocate(kMiB), b = arena.allocate(kMiB), c = arena.allocate(kMiB);
  arena.free(a);
  arena.free(c);
  CHECK(arena.stats().num_free_blocks == 2);  // [a] and [c + tail]
  arena.free(b);
  auto s = arena.stats();
  CHECK(s.num_free_blocks == 1);
  CHECK(s.largest_free_block_bytes == s.capacity_bytes);
  CHECK(s.num_slabs == 1);
}

TEST_CASE(best_fit_reuses_the_smallest_hole) {
  HostArena arena(0, 8 * kMiB, PinMode::kNone);
  auto big = arena.allocate(2 * kMiB), sep1 = arena.allocate(256);
  auto small = arena.allocate(kMiB), sep2 = arena.allocate(256);
  arena.free(big);
  arena.free(small);
  // A 1 MiB request must land in the 1 MiB hole, not split the 2 MiB one.
  auto again = arena.allocate(kMiB);
  CHECK(again == small);
  (void)sep1;
  (void)sep2;
}

TEST_CASE(grows_by_slabs_then_reuses) {
  HostArena arena(0, 2 * kMiB, PinMode::kNone);
  auto a = arena.allocate(2 * kMiB);
  auto b = arena.allocate(3 * kMiB);  // does not fit the first slab: a second one
  CHECK(arena.stats().num_slabs == 2);
  arena.free(a);
  arena.free(b);
  auto c = arena.allocate(3 * kMiB);
  CHECK(arena.stats().num_slab_allocations == 2);  // steady state: no new slab
  arena.free(c);
  const std::size_t released = arena.trim();
  CHECK(released == 6 * kMiB);  // a 2 MiB slab and a 4 MiB one (3 MiB rounded to huge pages)
  CHECK(arena.trim() == 0);
  CHECK(arena.stats().capacity_bytes == 0);
}

TEST_CASE(cap_is_hard_and_leaves_the_arena_unchanged) {
  HostArena arena(4 * kMiB, kMiB, PinMode::kNone);
  auto a = arena.allocate(3 * kMiB);
  auto before = arena.stats();
  bool thrown = false;
  try {
    arena.allocate(2 * kMiB);
  } catch (const gpu_offload::Error& e) {
    thrown = std::string(e.what()).find("max_bytes") != std::string::npos;
  }
  CHECK(thrown);
  auto after = arena.stats();
  CHECK(after.capacity_bytes == before.capacity_bytes && after.used_bytes == before.used_bytes);
  CHECK(after.capacity_bytes <= 4 * kMiB);
  arena.allocate(kMiB);  // what is left under the cap still works
  arena.free(a);
}

TEST_CASE(refuses_more_than_available_memory) {
  HostArena arena(0, kMiB, PinMode::kNone);
  const std::size_t available = gpu_offload::available_host_memory();
  CHECK(available > 0);
  CHECK_THROWS(arena.allocate(available + (std::size_t(64) << 30)));
  CHECK(arena.stats().capacity_bytes == 0);
}

TEST_CASE(errors_carry_file_line_and_expression) {
  HostArena arena(0, kMiB, PinMode::kNone);
  std::string what;
  try {
    arena.free(12345);
  } catch (const gpu_offload::Error& e) {
    what = e.what();
  }
  CHECK(what.find("arena.cpp:") != std::string::npos);
  CHECK(what.find("check `") != std::string::npos);
}

TEST_CASE(cgroup_headroom_reads_v2_and_v1_limits) {
  char dir_template[] = "/tmp/go_cgroup_XXXXXX";
  const std::string root = mkdtemp(dir_template);
  auto write = [&](const std::string& name, const std::string& text) { std::ofstream(root + "/" + name) << text; };
  CHECK(gpu_offload::cgroup_headroom(root) == 0);  // no files: no limit known
  write("memory.max", "max\n");
  write("memory.current", "1000\n");
  CHECK(gpu_offload::cgroup_headroom(root) == 0);  // v2 without a limit
  write("memory.max", "10000\n");
  write("memory.stat", "anon 500\ninactive_file 400\nactive_file 100\n");
  CHECK(gpu_offload::cgroup_headroom(root) == 10000 - (1000 - 400));  // reclaimable page cache not counted
  std::remove((root + "/memory.max").c_str());
  mkdir((root + "/memory").c_str(), 0700);
  write("memory/memory.limit_in_bytes", "9223372036854771712\n");  // v1's "no limit"
  write("memory/memory.usage_in_bytes", "5000\n");
  CHECK(gpu_offload::cgroup_headroom(root) == 0);
  write("memory/memory.limit_in_bytes", "8000\n");
  write("memory/memory.stat", "total_inactive_file 1000\n");
  CHECK(gpu_offload::cgroup_headroom(root) == 8000 - 4000);
}

TEST_CASE(an_empty_arena_takes_any_request_under_its_cap) {
  // Four slabs kept empty after use fill the cap; a region cannot span them, so they must go first.
  HostArena arena(8 * kMiB, 2 * kMiB, PinMode::kNone);
  std::vector<std::uintptr_t> ptrs;
  for (int i = 0; i < 4; ++i) ptrs.push_back(arena.allocate(2 * kMiB));
  for (auto p : ptrs) arena.free(p);
  CHECK(arena.stats().num_slabs == 4 && arena.stats().capacity_bytes == 8 * kMiB);
  auto big = arena.allocate(6 * kMiB);
  std::memset(reinterpret_cast<void*>(big), 1, 6 * kMiB);
  CHECK(arena.stats().capacity_bytes <= 8 * kMiB);
  arena.free(big);
  arena.trim();
  // With one slab in use, only the empty ones go; the one in use stays where it is.
  ptrs.clear();
  for (int i = 0; i < 4; ++i) ptrs.push_back(arena.allocate(2 * kMiB));
  for (int i = 1; i < 4; ++i) arena.free(ptrs[i]);
  auto mid = arena.allocate(5 * kMiB);
  std::memset(reinterpret_cast<void*>(mid), 2, 5 * kMiB);
  CHECK(arena.stats().num_slabs == 2 && arena.stats().capacity_bytes <= 8 * kMiB);
  std::memset(reinterpret_cast<void*>(ptrs[0]), 3, 2 * kMiB);  // still mapped
  arena.free(mid);
  arena.free(ptrs[0]);
  auto all = arena.allocate(8 * kMiB);  // the whole cap, from an arena that had slabs everywhere
  arena.free(all);
  CHECK(arena.stats().used_bytes == 0);
}

TEST_CASE(the_cap_message_says_why) {
  HostArena arena(4 * kMiB, kMiB, PinMode::kNone);
  std::string what;
  try {
    arena.allocate(5 * kMiB);
  } catch (const gpu_offload::Error& e) {
    what = e.what();
  }
  CHECK(what.find("larger than max_bytes") != std::string::npos);
  CHECK(what.find("largest free block") == std::string::npos);
  // Sizes a person reads, and no check text: the cap is the user's setting, not a broken invariant.
  CHECK(what.find("a region of 5 MiB does not fit; in use 0 B, capacity 0 B, max_bytes 4 MiB") != std::string::npos);
  CHECK(what.find("check `") == std::string::npos && what.find("arena.cpp") == std::string::npos);
  auto a = arena.allocate(kMiB), b = arena.allocate(kMiB), c = arena.allocate(kMiB);
  arena.free(b);  // 2 MiB free in all, 1 MiB of it in a hole
  what.clear();
  try {
    arena.allocate(2 * kMiB);
  } catch (const gpu_offload::Error& e) {
    what = e.what();
  }
  CHECK(what.find("in use 2 MiB") != std::string::npos);
  CHECK(what.find("largest free block") != std::string::npos);
  arena.free(a);
  arena.free(c);
}

namespace {
int g_release_calls = 0;
void fail_first_release(std::uintptr_t, std::size_t) {
  if (g_release_calls++ == 0) throw gpu_offload::Error("injected: cudaHostUnregister failed");
}
}  // namespace

TEST_CASE(trim_keeps_a_slab_it_cannot_release) {
  HostArena arena(0, 2 * kMiB, PinMode::kNone);
  auto a = arena.allocate(2 * kMiB), b = arena.allocate(2 * kMiB);
  arena.free(a);
  arena.free(b);
  CHECK(arena.stats().num_slabs == 2);
  g_release_calls = 0;
  gpu_offload::testing::before_slab_release = fail_first_release;
  std::string what;
  try {
    arena.trim();
  } catch (const gpu_offload::Error& e) {
    what = e.what();
  }
  gpu_offload::testing::before_slab_release = nullptr;
  CHECK(what.find("injected") != std::string::npos && what.find("released 2 MiB") != std::string::npos);
  auto s = arena.stats();
  CHECK(s.num_slabs == 1 && s.capacity_bytes == 2 * kMiB && s.num_free_blocks == 1);
  CHECK(s.largest_free_block_bytes == 2 * kMiB);
  // The kept slab is whole and usable: a region of its size comes from it without a new slab.
  auto c = arena.allocate(2 * kMiB);
  std::memset(reinterpret_cast<void*>(c), 7, 2 * kMiB);
  CHECK(arena.stats().num_slab_allocations == 2);
  arena.free(c);
  CHECK(arena.trim() == 2 * kMiB && arena.stats().capacity_bytes == 0);
}

int main() { return check::run_all(); }
