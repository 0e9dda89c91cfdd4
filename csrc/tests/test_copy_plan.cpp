#include <algorithm>
#include <cstring>
#include <numeric>
#include <vector>

#include "check.hpp"
#include "core/arena.hpp"
#include "core/copy_plan.hpp"

using namespace gpu_offload;

TEST_CASE(host_round_trip_many_sizes) {
  // Storages of odd sizes (including 0 and a large one that the thread pool splits).
  std::vector<std::size_t> sizes = {0, 1, 3, 255, 4096, 12345, 9u << 20, 7};
  std::vector<std::vector<unsigned char>> storages;
  std::vector<std::uintptr_t> ptrs;
  std::vector<std::size_t> offsets;
  std::size_t off = 0;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    storages.emplace_back(sizes[i]);
    for (std::size_t j = 0; j < sizes[i]; ++j) storages[i][j] = static_cast<unsigned char>(i * 31 + j * 7);
    ptrs.push_back(reinterpret_cast<std::uintptr_t>(storages[i].data()));
    offsets.push_back(off);
    off += (sizes[i] + 255) / 256 * 256;
  }
  CopyPlan plan(-1, ptrs, offsets, sizes);
  CHECK(plan.total_bytes() == std::accumulate(sizes.begin(), sizes.end(), std::size_t(0)));
  HostArena arena(0, 1u << 20, PinMode::kNone);
  auto region = arena.allocate(plan.host_extent_bytes());
  CHECK(plan.run(Direction::kToHost, region, 0, {}, true) == nullptr);
  auto expected = storages;
  for (auto& s : storages) std::fill(s.begin(), s.end(), static_cast<unsigned char>(0));  // (memset of an empty one: null)
  plan.run(Direction::kToDevice, region, 0, {}, true);
  CHECK(storages == expected);
  arena.free(region);
}

TEST_CASE(parallel_memcpy_splits_exactly) {
  std::vector<unsigned char> a(33u << 20), b(33u << 20, 0);
  for (std::size_t i = 0; i < a.size(); ++i) a[i] = static_cast<unsigned char>(i * 2654435761u >> 24);
  void* dst[2] = {b.data(), b.data() + (1u << 20)};
  const void* src[2] = {a.data(), a.data() + (1u << 20)};
  std::size_t sizes[2] = {1u << 20, 32u << 20};
  parallel_memcpy(dst, src, sizes, 2);
  CHECK(a == b);
}

TEST_CASE(parallel_memcpy_of_many_small_misaligned_pieces) {
  // A batch large enough for the threads and the streaming stores, of pieces of every size from 0 up,
  // at every alignment of source and destination; the bytes between pieces are left as they were.
  constexpr std::size_t kPieces = 6000;
  std::vector<std::size_t> sizes(kPieces), src_at(kPieces), dst_at(kPieces);
  std::size_t s_end = 0, d_end = 0;
  for (std::size_t i = 0; i < kPieces; ++i) {
    sizes[i] = (i * 7919) % 2600;
    src_at[i] = s_end + i % 13;
    dst_at[i] = d_end + (i * 5) % 17;
    s_end = src_at[i] + sizes[i];
    d_end = dst_at[i] + sizes[i] + 3;
  }
  CHECK(std::accumulate(sizes.begin(), sizes.end(), std::size_t(0)) > (4u << 20));
  std::vector<unsigned char> a(s_end), b(d_end, 0xA5);
  for (std::size_t i = 0; i < a.size(); ++i) a[i] = static_cast<unsigned char>(i * 2654435761u >> 24);
  std::vector<void*> dst(kPieces);
  std::vector<const void*> src(kPieces);
  for (std::size_t i = 0; i < kPieces; ++i) {
    dst[i] = b.data() + dst_at[i];
    src[i] = a.data() + src_at[i];
  }
  parallel_memcpy(dst.data(), src.data(), sizes.data(), kPieces);
  std::vector<unsigned char> expected(d_end, 0xA5);
  for (std::size_t i = 0; i < kPieces; ++i) std::memcpy(expected.data() + dst_at[i], a.data() + src_at[i], sizes[i]);
  CHECK(b == expected);
}

TEST_CASE(rejects_inconsistent_arrays) {
  CHECK_THROWS(CopyPlan(-1, {1, 2}, {0}, {1, 1}));
  CHECK_THROWS(CopyPlan(-2, {}, {}, {}));
  CHECK_THROWS(CopyPlan(-1, {0}, {0}, {16}));
}

TEST_CASE(a_rebased_plan_copies_at_its_own_addresses_and_leaves_the_first_as_it_was) {
  // with_device_ptrs shares the offsets and sizes: both plans must still copy exactly their own storages.
  std::vector<unsigned char> a(24), b(24);
  for (std::size_t i = 0; i < a.size(); ++i) a[i] = static_cast<unsigned char>(i + 1);
  const std::vector<std::size_t> sizes = {16, 0, 8};
  CopyPlan first(-1, {reinterpret_cast<std::uintptr_t>(a.data()), 0, reinterpret_cast<std::uintptr_t>(a.data() + 16)},
                 {64, 96, 0}, sizes);
  CopyPlan rebased = first.with_device_ptrs(
      {reinterpret_cast<std::uintptr_t>(b.data()), 0, reinterpret_cast<std::uintptr_t>(b.data() + 16)});
  CHECK(rebased.num_copies() == 3 && rebased.total_bytes() == 24 && rebased.host_extent_bytes() == 96);
  HostArena arena(0, 1u << 20, PinMode::kNone);
  auto region = arena.allocate(first.host_extent_bytes());
  first.run(Direction::kToHost, region, 0, {}, true);
  rebased.run(Direction::kToDevice, region, 0, {}, true);
  CHECK(b == a);
  for (auto& x : b) x = 0;
  rebased.run(Direction::kToHost, region, 0, {}, true);  // zeros, through the rebased plan ...
  first.run(Direction::kToDevice, region, 0, {}, true);  // ... into the first plan's storages
  CHECK(a == std::vector<unsigned char>(24, 0));
  CHECK_THROWS(first.with_device_ptrs({1, 0}));  // one address per copy
  CHECK_THROWS(first.with_device_ptrs({1, 0, 0}));  // a null address for a copy of 8 bytes
  CHECK(first.with_device_ptrs({1, 0, 2}).total_bytes() == 24);  // (a copy of 0 bytes may have none)
  arena.free(region);
}

#ifndef GPU_OFFLOAD_TEST_NO_CUDA
TEST_CASE(device_plan_without_cuda_is_a_clear_error) {
  if (cuda::available()) return;  // covered by the Python CUDA tests on a GPU machine
  unsigned char byte = 0;
  CopyPlan plan(0, {reinterpret_cast<std::uintptr_t>(&byte)}, {0}, {1});
  HostArena arena(0, 1u << 20, PinMode::kNone);
  auto region = arena.allocate(1);
  CHECK_THROWS(plan.run(Direction::kToHost, region, 0, {}, true));
  arena.free(region);
}
#endif

int main() { return check::run_all(); }
