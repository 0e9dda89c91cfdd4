#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "check.hpp"
#include "core/arena.hpp"
#include "core/errors.hpp"
#include "core/thread_pool.hpp"

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
  arena.reserve(4 * kMiB);  // one slab for all three
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
  CHECK(released == 5 * kMiB);  // a 2 MiB slab and a 3 MiB one: each region's own size
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
  const std::string root = check::scratch_dir("go_cgroup_");
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

TEST_CASE(cgroup_limit_and_headroom_are_the_smallest_over_the_process_cgroup_and_its_parents) {
  const std::string root = check::scratch_dir("go_cgroup_");
  auto write = [&](const std::string& name, const std::string& text) { std::ofstream(root + "/" + name) << text; };
  const std::string v2 = "0::/job_7/step_0\n";
  CHECK(gpu_offload::cgroup_limit(root, v2) == 0);  // no files: no limit known
  mkdir((root + "/job_7").c_str(), 0700);
  mkdir((root + "/job_7/step_0").c_str(), 0700);
  write("job_7/step_0/memory.max", "max\n");
  CHECK(gpu_offload::cgroup_limit(root, v2) == 0);
  write("job_7/memory.max", "50000\n");  // a Slurm job's limit, one level up (no cgroup namespace)
  CHECK(gpu_offload::cgroup_limit(root, v2) == 50000);
  write("job_7/step_0/memory.max", "70000\n");
  CHECK(gpu_offload::cgroup_limit(root, v2) == 50000);  // the smallest on the way up holds
  // The headroom is taken where the limits are: the job's 50000 minus its use, not root's figures.
  write("job_7/memory.current", "20000\n");
  write("job_7/step_0/memory.current", "15000\n");
  CHECK(gpu_offload::cgroup_headroom(root, v2) == 30000);
  CHECK(gpu_offload::cgroup_headroom(root) == 0);  // root alone has no limit
  write("memory.max", "40000\n");
  CHECK(gpu_offload::cgroup_limit(root, v2) == 40000);
  CHECK(gpu_offload::cgroup_limit(root, "0::/\n") == 40000);  // a container's own namespace: root's
  CHECK(gpu_offload::cgroup_limit(root, "0::/elsewhere/abc\n") == 40000);  // a path not mounted here
  CHECK(gpu_offload::cgroup_limit(root, "") == 40000);  // no /proc/self/cgroup: root's files
  // cgroup v1: the memory controller's line, its folder under memory/, "no limit" as a huge number.
  const std::string v1 = "9:pids:/\n4:cpu,memory:/process_api/abc\n0::/\n";
  std::remove((root + "/memory.max").c_str());
  mkdir((root + "/memory").c_str(), 0700);
  mkdir((root + "/memory/process_api").c_str(), 0700);
  mkdir((root + "/memory/process_api/abc").c_str(), 0700);
  write("memory/memory.limit_in_bytes", "9223372036854771712\n");
  write("memory/process_api/abc/memory.limit_in_bytes", "9223372036854771712\n");
  CHECK(gpu_offload::cgroup_limit(root, v1) == 0);
  write("memory/process_api/memory.limit_in_bytes", "8000\n");
  CHECK(gpu_offload::cgroup_limit(root, v1) == 8000);
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
  arena.reserve(4 * kMiB);  // one slab: the whole cap
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

TEST_CASE(the_first_slab_is_the_request_and_shared_slabs_grow_geometrically) {
  const std::size_t min_slab = 4 * kMiB;
  HostArena arena(0, min_slab, PinMode::kNone);
  arena.allocate(1000);
  CHECK(arena.stats().capacity_bytes == 4096);  // one page for a 1 KB snapshot, not min_slab_bytes
  // Small regions: slabs of their own size while the arena is small, then shared slabs that double the
  // arena, never larger than min_slab_bytes; the bytes handed out stay within 1.02x of the capacity
  // (plus one slab) all along.
  std::size_t used = 0, largest_slab = 0, last_capacity = arena.stats().capacity_bytes;
  for (int i = 0; i < 4000; ++i) {
    const std::size_t n = 4096 * (1 + i % 3);
    arena.allocate(n);
    used += n;
    auto s = arena.stats();
    largest_slab = std::max(largest_slab, s.capacity_bytes - last_capacity);
    last_capacity = s.capacity_bytes;
    CHECK(double(s.capacity_bytes) <= 1.02 * double(used + 1024) + double(min_slab));
  }
  CHECK(largest_slab == min_slab);
  CHECK(arena.stats().num_slabs < 64 + 8 + (used / min_slab) + 1);
  // A region that is large next to the arena gets a slab of exactly its size (rounded to pages).
  const std::size_t before = arena.stats().capacity_bytes;
  arena.allocate(3 * min_slab + 100);
  CHECK(arena.stats().capacity_bytes - before == 3 * min_slab + 4096);
}

namespace {
// The policy of the page at addr and its node mask (first word), as the kernel reports them.
std::pair<int, unsigned long> policy_of(std::uintptr_t addr) {
  int mode = -1;
  unsigned long mask[16] = {};
  constexpr unsigned long kMpolFNode = 1, kMpolFAddr = 2;
  (void)kMpolFNode;
  if (syscall(SYS_get_mempolicy, &mode, mask, 1024 + 1, reinterpret_cast<void*>(addr), kMpolFAddr) != 0) return {-2, 0};
  return {mode, mask[0]};
}
int node_of_page(std::uintptr_t addr) {
  void* pages[1] = {reinterpret_cast<void*>(addr)};
  int status[1] = {-1};
  if (syscall(SYS_move_pages, 0, 1ul, pages, nullptr, status, 0) != 0) return -2;
  return status[0];
}
}  // namespace

TEST_CASE(a_slab_for_a_numa_node_is_placed_there_before_its_pages_are_touched) {
  if (policy_of(reinterpret_cast<std::uintptr_t>(&kMiB)).first == -2) {
    std::printf("  (get_mempolicy is not allowed here: skipped)\n");
    return;
  }
  HostArena arena(0, kMiB, PinMode::kNone);
  auto unplaced = arena.allocate(kMiB);
  CHECK(policy_of(unplaced).first == 0);  // MPOL_DEFAULT: no node asked for
  auto p = arena.allocate(kMiB, 0);
  CHECK(p != unplaced && arena.stats().num_slabs == 2);  // node 0's region does not go in the unplaced slab
  auto [mode, mask] = policy_of(p);
  CHECK(mode == 1 && mask == 1ul);  // MPOL_PREFERRED, node 0
  CHECK(node_of_page(p) == 0 && node_of_page(p + kMiB - 4096) == 0);
  CHECK(arena.take_notes().empty());
  CHECK(arena.stats().bytes_by_numa_node.at(0) == 2 * kMiB);
  // A node this machine does not have: the slab is made all the same, unplaced, and a note says so.
  auto q = arena.allocate(kMiB, 1000);
  CHECK(policy_of(q).first == 0);
  auto notes = arena.take_notes();
  CHECK(notes.size() == 1 && notes[0].find("could not place a slab") != std::string::npos &&
        notes[0].find("node 1000") != std::string::npos);
  CHECK(arena.take_notes().empty());  // said once
  arena.free(p);
  // A node's region takes a free block of its own node first.
  auto again = arena.allocate(kMiB / 2, 0);
  CHECK(again == p);
}

namespace {
std::pair<int, unsigned long> thread_policy() {
  int mode = -1;
  unsigned long mask[16] = {};
  if (syscall(SYS_get_mempolicy, &mode, mask, 1024 + 1, nullptr, 0ul) != 0) return {-2, 0};
  return {mode, mask[0]};
}
}  // namespace

TEST_CASE(a_driver_allocated_slab_is_placed_by_the_thread_policy_for_the_call_only) {
  if (thread_policy().first == -2) {
    std::printf("  (get_mempolicy is not allowed here: skipped)\n");
    return;
  }
  CHECK(thread_policy().first == 0);  // MPOL_DEFAULT
  std::vector<std::string> notes;
  {
    gpu_offload::ThreadPrefersNode prefer(0, kMiB, &notes);
    CHECK(thread_policy() == std::make_pair(1, 1ul));  // MPOL_PREFERRED, node 0: what cudaHostAlloc faults in
    // Pages first touched by this thread now come from node 0.
    auto* p = static_cast<char*>(mmap(nullptr, kMiB, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
    p[0] = 1;
    CHECK(node_of_page(reinterpret_cast<std::uintptr_t>(p)) == 0);
    munmap(p, kMiB);
  }
  CHECK(thread_policy().first == 0 && notes.empty());  // the thread's own policy again
  {
    gpu_offload::ThreadPrefersNode none(HostArena::kAnyNode, kMiB, &notes);  // no node: nothing asked
    CHECK(thread_policy().first == 0);
  }
  {
    gpu_offload::ThreadPrefersNode missing(1000, kMiB, &notes);  // a node this machine lacks
    CHECK(thread_policy().first == 0);
  }
  CHECK(notes.size() == 1 && notes[0].find("could not place a slab") != std::string::npos &&
        notes[0].find("node 1000") != std::string::npos);
}

TEST_CASE(process_host_memory_counts_every_arena) {
  const auto before = gpu_offload::process_host_memory();
  {
    HostArena a(0, kMiB, PinMode::kNone), b(0, kMiB, PinMode::kNone);
    a.allocate(kMiB);
    b.allocate(2 * kMiB);
    const auto during = gpu_offload::process_host_memory();
    CHECK(during.pageable_bytes == before.pageable_bytes + 3 * kMiB);
    CHECK(during.pinned_bytes == before.pinned_bytes);
    std::size_t by_node = 0;
    for (const auto& [node, bytes] : during.bytes_by_numa_node) by_node += bytes;
    CHECK(by_node == during.pageable_bytes + during.pinned_bytes);
  }
  CHECK(gpu_offload::process_host_memory().pageable_bytes == before.pageable_bytes);
}

namespace {
HostArena* g_forking_arena = nullptr;
int g_fork_child_status = -1;

// Runs inside trim(), with the arena's mutex held: forks, and the child uses the arena.
void fork_while_locked(std::uintptr_t, std::size_t) {
  const pid_t pid = fork();
  if (pid == 0) {
    alarm(30);  // a mutex still held would block the child forever
    const auto s = g_forking_arena->stats();
    const auto p = g_forking_arena->allocate(4096);
    g_forking_arena->free(p);
    _exit(s.num_slabs == 1 ? 0 : 2);
  }
  int status = 0;
  waitpid(pid, &status, 0);
  g_fork_child_status = status;
}
}  // namespace

TEST_CASE(a_forked_child_can_use_an_arena_whose_mutex_another_thread_held) {
  HostArena arena(0, 2 * kMiB, PinMode::kNone);
  arena.free(arena.allocate(kMiB));
  g_forking_arena = &arena;
  gpu_offload::testing::before_slab_release = fork_while_locked;
  arena.trim();
  gpu_offload::testing::before_slab_release = nullptr;
  CHECK(WIFEXITED(g_fork_child_status) && WEXITSTATUS(g_fork_child_status) == 0);
  CHECK(arena.stats().capacity_bytes == 0);
}

TEST_CASE(trim_since_gives_back_only_the_slabs_made_after) {
  HostArena arena(0, 2 * kMiB, PinMode::kNone);
  arena.reserve(kMiB);  // slab 0: pinned ahead, empty, to be kept
  const auto kept = arena.stats().capacity_bytes;
  const auto first = arena.stats().num_slab_allocations;
  arena.free(arena.allocate(3 * kMiB));  // slab 1: made for one request, empty again
  auto s = arena.stats();
  CHECK(s.num_slabs == 2);
  const std::size_t made = s.capacity_bytes - kept;
  CHECK(made >= 3 * kMiB);
  CHECK(arena.trim(first) == made);
  s = arena.stats();
  CHECK(s.num_slabs == 1 && s.capacity_bytes == kept);
  CHECK(arena.trim() == kept);
}

TEST_CASE(sizes_past_int64_are_refused_before_rounding_can_wrap_them) {
  HostArena arena(0, 2 * kMiB, PinMode::kNone);
  CHECK_THROWS(arena.allocate(SIZE_MAX));  // rounded up, it used to wrap to a one-block region
  CHECK_THROWS(arena.reserve(SIZE_MAX - 4095));
  CHECK_THROWS(arena.allocate(std::size_t{1} << 63));
  CHECK(arena.stats().capacity_bytes == 0);
}

// GPU_OFFLOAD_NUM_THREADS, read by configured_threads() at each call (the pool reads it once, at its first
// use): a positive integer, at most 16 taken; anything else refused with the value named. (test_cli runs one
// bad value end to end, through `info` and a first Arena.)
TEST_CASE(a_thread_count_is_a_positive_integer_or_refused) {
  const char* before = std::getenv("GPU_OFFLOAD_NUM_THREADS");
  const std::string saved = before != nullptr ? before : "";
  auto with = [](const char* value) {
    setenv("GPU_OFFLOAD_NUM_THREADS", value, 1);
    return gpu_offload::ThreadPool::configured_threads();
  };
  CHECK(with("1") == 1);
  CHECK(with("3") == 3);
  CHECK(with("16") == 16);
  CHECK(with("64") == 16);  // capped, not refused
  CHECK(with("") == std::min<std::size_t>(std::max(1u, std::thread::hardware_concurrency()), 16));  // unset
  for (const char* bad : {"abc", "0", "-2", "4x", " 4", "+4", "1e3", "9999999999"}) {
    std::string what;
    try {
      with(bad);
    } catch (const gpu_offload::Error& e) {
      what = e.what();
    }
    CHECK(what.find("GPU_OFFLOAD_NUM_THREADS='" + std::string(bad) + "' is not a positive integer") != std::string::npos);
  }
  if (before != nullptr) {
    setenv("GPU_OFFLOAD_NUM_THREADS", saved.c_str(), 1);
  } else {
    unsetenv("GPU_OFFLOAD_NUM_THREADS");
  }
}

int main() { return check::run_all(); }
