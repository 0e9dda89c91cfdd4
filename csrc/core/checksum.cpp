#include "checksum.hpp"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <string>

#include "errors.hpp"
#include "thread_pool.hpp"

namespace gpu_offload {
namespace {

// Below this the checksums are computed on the calling thread: waking the pool costs more than it saves.
constexpr std::size_t kParallelMinBytes = 4u << 20;
constexpr std::size_t kShardMinBytes = 1u << 20;

inline std::uint64_t load_le64(const unsigned char* p) {
  std::uint64_t w;
  std::memcpy(&w, p, sizeof w);  // unaligned-safe; compiles to one load
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
  w = __builtin_bswap64(w);  // the words are little-endian by definition, on every host
#endif
  return w;
}

inline std::size_t round_up8(std::size_t n) { return (n + 7) / 8 * 8; }

}  // namespace

std::uint64_t checksum_partial(const void* data, std::size_t nbytes, std::uint64_t first_word) {
  const auto* p = static_cast<const unsigned char*>(data);
  const std::size_t full = nbytes / 8;
  // Four independent accumulators keep the multipliers busy; the sum is order-free, so this is exact.
  std::uint64_t a0 = 0, a1 = 0, a2 = 0, a3 = 0;
  std::uint64_t i = first_word;
  std::size_t k = 0;
  for (; k + 4 <= full; k += 4, i += 4) {
    a0 += checksum_term(load_le64(p + 8 * k), i);
    a1 += checksum_term(load_le64(p + 8 * k + 8), i + 1);
    a2 += checksum_term(load_le64(p + 8 * k + 16), i + 2);
    a3 += checksum_term(load_le64(p + 8 * k + 24), i + 3);
  }
  for (; k < full; ++k, ++i) a0 += checksum_term(load_le64(p + 8 * k), i);
  const std::size_t rest = nbytes - 8 * full;
  if (rest != 0) {
    unsigned char tail[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    std::memcpy(tail, p + 8 * full, rest);
    a0 += checksum_term(load_le64(tail), i);
  }
  return a0 + a1 + a2 + a3;
}

std::uint64_t checksum(const void* data, std::size_t nbytes) {
  GO_CHECK(data != nullptr || nbytes == 0, "null pointer for a buffer of " + std::to_string(nbytes) + " bytes");
  return checksum_finish(nbytes == 0 ? 0 : checksum_partial(data, nbytes, 0), nbytes);
}

std::vector<std::uint64_t> checksum_host(const std::vector<std::uintptr_t>& ptrs, const std::vector<std::size_t>& sizes) {
  GO_CHECK(ptrs.size() == sizes.size(), "checksum arrays differ in length: " + std::to_string(ptrs.size()) +
                                            " pointers, " + std::to_string(sizes.size()) + " sizes");
  const std::size_t n = sizes.size();
  // Each storage is laid end to end, padded to whole words, so that shard boundaries (multiples of 8 in
  // this concatenation) fall on word boundaries of every storage.
  std::size_t total = 0;
  for (std::size_t i = 0; i < n; ++i) {
    GO_CHECK(sizes[i] == 0 || ptrs[i] != 0, "null pointer for storage " + std::to_string(i));
    total += round_up8(sizes[i]);
  }
  std::vector<std::uint64_t> sums(n, 0);
  auto& pool = ThreadPool::instance();
  const std::size_t shards = total < kParallelMinBytes ? 1 : std::min<std::size_t>(pool.num_threads(), total / kShardMinBytes);
  if (shards <= 1) {
    for (std::size_t i = 0; i < n; ++i) {
      if (sizes[i] != 0) sums[i] = checksum_partial(reinterpret_cast<const void*>(ptrs[i]), sizes[i], 0);
    }
  } else {
    std::unique_ptr<std::atomic<std::uint64_t>[]> acc(new std::atomic<std::uint64_t>[n]);
    for (std::size_t i = 0; i < n; ++i) acc[i].store(0, std::memory_order_relaxed);
    const std::size_t per_shard = round_up8(total / shards);
    pool.parallel_for(shards, [&](std::size_t s) {
      const std::size_t begin = std::min(total, per_shard * s);
      const std::size_t end = s + 1 == shards ? total : std::min(total, per_shard * (s + 1));
      std::size_t pos = 0;
      for (std::size_t i = 0; i < n && pos < end; ++i) {
        const std::size_t padded = round_up8(sizes[i]);
        const std::size_t a = std::max(begin, pos), b = std::min(end, pos + padded);
        if (a < b) {
          const std::size_t lo = a - pos, hi = std::min(b - pos, sizes[i]);
          if (lo < hi) {
            const auto* p = reinterpret_cast<const unsigned char*>(ptrs[i]) + lo;
            acc[i].fetch_add(checksum_partial(p, hi - lo, lo / 8), std::memory_order_relaxed);
          }
        }
        pos += padded;
      }
    });
    for (std::size_t i = 0; i < n; ++i) sums[i] = acc[i].load(std::memory_order_relaxed);
  }
  for (std::size_t i = 0; i < n; ++i) sums[i] = checksum_finish(sums[i], sizes[i]);
  return sums;
}

namespace cuda {

std::vector<std::uint64_t> checksum_device(int device, const std::vector<std::uintptr_t>& ptrs,
                                           const std::vector<std::size_t>& sizes, std::uintptr_t stream) {
  return checksum_device_async(device, ptrs, sizes, stream)->wait();
}

#ifndef GPU_OFFLOAD_WITH_CUDA
// Stand-in for checksum_cuda.cu in a build without nvcc.
std::shared_ptr<ChecksumJob> checksum_device_async(int, const std::vector<std::uintptr_t>&,
                                                   const std::vector<std::size_t>&, std::uintptr_t) {
  GO_FAIL("gpu_offload was built without CUDA: rebuild with GPU_OFFLOAD_CUDA=1 to checksum device memory");
}
#endif

}  // namespace cuda
}  // namespace gpu_offload
