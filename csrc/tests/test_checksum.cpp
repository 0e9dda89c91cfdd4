#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "check.hpp"
#include "core/checksum.hpp"
#include "core/cuda_backend.hpp"

using namespace gpu_offload;

namespace {

// The definition, written out word by word with no shortcut: what every implementation must match.
std::uint64_t reference(const unsigned char* p, std::size_t n) {
  std::uint64_t h = 0;
  for (std::size_t i = 0; i * 8 < n; ++i) {
    std::uint64_t w = 0;
    for (std::size_t b = 0; b < 8 && i * 8 + b < n; ++b) w |= static_cast<std::uint64_t>(p[i * 8 + b]) << (8 * b);
    h += (w ^ (i * 0x9E3779B97F4A7C15ull)) * 0xBF58476D1CE4E5B9ull;
  }
  return h ^ (static_cast<std::uint64_t>(n) * 0x94D049BB133111EBull);
}

std::vector<unsigned char> pattern(std::size_t n, unsigned seed) {
  std::vector<unsigned char> v(n);
  std::uint64_t x = seed * 0x2545F4914F6CDD1Dull + 1;
  for (auto& b : v) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    b = static_cast<unsigned char>(x >> 32);
  }
  return v;
}

}  // namespace

TEST_CASE(matches_the_definition_for_every_small_size) {
  for (std::size_t n = 0; n <= 100; ++n) {
    auto v = pattern(n, static_cast<unsigned>(n));
    CHECK(checksum(v.data(), n) == reference(v.data(), n));
  }
}

TEST_CASE(known_values) {
  // Pinned so that any implementation (a kernel, another language) can be checked against them.
  CHECK(checksum(nullptr, 0) == 0);
  const unsigned char one[1] = {1};
  CHECK(checksum(one, 1) == (0xBF58476D1CE4E5B9ull ^ 0x94D049BB133111EBull));
  const unsigned char eight[8] = {1, 2, 3, 4, 5, 6, 7, 8};
  CHECK(checksum(eight, 8) == reference(eight, 8));
  CHECK(checksum(eight, 8) == ((0x0807060504030201ull * 0xBF58476D1CE4E5B9ull) ^ (8 * 0x94D049BB133111EBull)));
}

TEST_CASE(unaligned_starts_and_tails) {
  auto v = pattern(4096 + 64, 7);
  for (std::size_t start = 0; start < 16; ++start) {
    for (std::size_t n : {0u, 1u, 7u, 8u, 9u, 15u, 16u, 17u, 1000u, 4096u}) {
      CHECK(checksum(v.data() + start, n) == reference(v.data() + start, n));
    }
  }
}

TEST_CASE(one_flipped_bit_anywhere_is_seen) {
  auto v = pattern(1027, 3);
  const std::uint64_t h = checksum(v.data(), v.size());
  for (std::size_t i = 0; i < v.size(); ++i) {
    for (int bit = 0; bit < 8; ++bit) {
      v[i] ^= static_cast<unsigned char>(1u << bit);
      CHECK(checksum(v.data(), v.size()) != h);
      v[i] ^= static_cast<unsigned char>(1u << bit);
    }
  }
  CHECK(checksum(v.data(), v.size()) == h);
}

TEST_CASE(swapped_words_and_length_change_it) {
  auto v = pattern(64, 5);
  const std::uint64_t h = checksum(v.data(), v.size());
  auto swapped = v;
  std::memcpy(swapped.data(), v.data() + 8, 8);
  std::memcpy(swapped.data() + 8, v.data(), 8);
  CHECK(checksum(swapped.data(), swapped.size()) != h);
  // A trailing zero byte is zero padding to the words, but the length is mixed in.
  std::vector<unsigned char> a(9, 0), b(10, 0);
  CHECK(checksum(a.data(), 9) != checksum(b.data(), 10));
}

TEST_CASE(partial_sums_add_up_in_any_split) {
  auto v = pattern(10000, 11);
  const std::uint64_t whole = checksum_partial(v.data(), v.size(), 0);
  for (std::size_t cut = 0; cut <= v.size(); cut += 8 * 97) {
    const std::uint64_t sum = checksum_partial(v.data(), cut, 0) + checksum_partial(v.data() + cut, v.size() - cut, cut / 8);
    CHECK(sum == whole);
  }
}

TEST_CASE(host_batch_equals_one_by_one_small_and_parallel) {
  // Small storages (one thread) and a batch over the parallel threshold with odd sizes, so shard
  // boundaries fall inside storages and next to their padded tails.
  std::vector<std::size_t> sizes = {0, 1, 13, 4096, (9u << 20) + 5, 3, (2u << 20) + 1, 0, 777};
  std::vector<std::vector<unsigned char>> data;
  std::vector<std::uintptr_t> ptrs;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    data.push_back(pattern(sizes[i], static_cast<unsigned>(i + 1)));
    ptrs.push_back(sizes[i] ? reinterpret_cast<std::uintptr_t>(data[i].data()) : 0);
  }
  auto batch = checksum_host(ptrs, sizes);
  CHECK(batch.size() == sizes.size());
  for (std::size_t i = 0; i < sizes.size(); ++i) CHECK(batch[i] == reference(data[i].data(), sizes[i]));
  std::vector<std::uintptr_t> few_ptrs(ptrs.begin(), ptrs.begin() + 4);
  std::vector<std::size_t> few_sizes(sizes.begin(), sizes.begin() + 4);
  auto few = checksum_host(few_ptrs, few_sizes);
  for (std::size_t i = 0; i < few.size(); ++i) CHECK(few[i] == batch[i]);
}

// Runs the kernel's work split on the host: every chunk, every thread of a block, any grid size. What
// the GPU adds on top (the shuffle and shared-memory reduction, atomicAdd) is order-free.
std::vector<std::uint64_t> emulate_kernel(const std::vector<std::uintptr_t>& ptrs, const std::vector<std::size_t>& sizes,
                                          std::uint64_t grid, std::uint64_t threads) {
  namespace d = checksum_detail;
  const std::uint64_t n = sizes.size();
  std::vector<std::uint64_t> starts(n + 1, 0), sums(n, 0);
  for (std::uint64_t i = 0; i < n; ++i) starts[i + 1] = starts[i] + d::num_chunks(sizes[i]);
  for (std::uint64_t block = 0; block < grid; ++block) {
    for (std::uint64_t c = block; c < starts[n]; c += grid) {
      const std::uint64_t s = d::chunk_owner(starts.data(), n, c);
      CHECK(starts[s] <= c && c < starts[s + 1]);
      const std::uint64_t begin = (c - starts[s]) * d::kChunkBytes;
      const std::uint64_t end = std::min<std::uint64_t>(begin + d::kChunkBytes, sizes[s]);
      for (std::uint64_t t = 0; t < threads; ++t) sums[s] += d::chunk_share(ptrs[s], begin, end, t, threads);
    }
  }
  for (std::uint64_t i = 0; i < n; ++i) sums[i] = checksum_finish(sums[i], sizes[i]);
  return sums;
}

TEST_CASE(kernel_work_split_matches_the_definition) {
  // Storages 16-, 8- and 1-byte aligned, empty ones between, sizes on and around chunk boundaries.
  const std::size_t chunk = checksum_detail::kChunkBytes;
  std::vector<std::size_t> sizes = {0, 1, 17, chunk, chunk + 1, 0, 2 * chunk + 13, 5, 0, chunk - 3, 64};
  std::vector<std::size_t> misalign = {0, 0, 8, 1, 0, 0, 8, 3, 0, 16, 1};
  auto backing = pattern(8 * chunk, 21);
  std::vector<std::uintptr_t> ptrs;
  std::size_t at = 0;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    at = (at + 15) / 16 * 16 + misalign[i];
    ptrs.push_back(reinterpret_cast<std::uintptr_t>(backing.data() + at));
    at += sizes[i];
  }
  CHECK(at <= backing.size());
  std::vector<std::uint64_t> expected;
  for (std::size_t i = 0; i < sizes.size(); ++i) expected.push_back(reference(reinterpret_cast<const unsigned char*>(ptrs[i]), sizes[i]));
  CHECK(checksum_host(ptrs, sizes) == expected);
  for (std::uint64_t grid : {1u, 3u, 528u}) CHECK(emulate_kernel(ptrs, sizes, grid, 256) == expected);
  CHECK(emulate_kernel(ptrs, sizes, 2, 32) == expected);
}

TEST_CASE(rejects_bad_arguments) {
  CHECK_THROWS(checksum_host({1, 2}, {1}));
  CHECK_THROWS(checksum_host({0}, {16}));
  CHECK(checksum_host({}, {}).empty());
}

TEST_CASE(device_checksum_without_a_gpu_is_a_clear_error) {
  if (cuda::available()) {
    // On a GPU machine the kernel is checked against the host from Python (tests/test_integrity.py).
    CHECK(cuda::checksum_device(0, {}, {}, 0).empty());
    return;
  }
  unsigned char byte = 0;
  CHECK_THROWS(cuda::checksum_device(0, {reinterpret_cast<std::uintptr_t>(&byte)}, {1}, 0));
}

int main() { return check::run_all(); }
