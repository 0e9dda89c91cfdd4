// Storage checksums: one 64-bit value per storage, the same on the host and on a GPU, so a sum computed by
// a kernel from the source as it was copied can be checked against the host copy later.
//
// The storage is read as little-endian 64-bit words w_i (the last one zero-padded) and
//   h = sum_i ((w_i XOR (i * kPositionMul)) * kWordMul)   (mod 2^64),   then   h ^= nbytes * kLengthMul.
// kWordMul is odd, so a change to one word (one flipped byte) always changes h; the position term makes two
// swapped words count differently; the sum reduces in any order, so threads and blocks split it freely.
// It is an integrity check against corruption, not a cryptographic hash.
//
// Declared without CUDA headers: checksum_cuda.cu implements the device entry, checksum.cpp stands in
// for it in a build without nvcc (as cuda_backend_stub.cpp does for the copy backend).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

// The term and the finish are shared with the kernel, so both sides compute the very same function.
#if defined(__CUDACC__)
#define GO_HOST_DEVICE __host__ __device__
#else
#define GO_HOST_DEVICE
#endif

namespace gpu_offload {

constexpr std::uint64_t kChecksumPositionMul = 0x9E3779B97F4A7C15ull;
constexpr std::uint64_t kChecksumWordMul = 0xBF58476D1CE4E5B9ull;
constexpr std::uint64_t kChecksumLengthMul = 0x94D049BB133111EBull;

// The contribution of word `index` holding `word`.
GO_HOST_DEVICE constexpr std::uint64_t checksum_term(std::uint64_t word, std::uint64_t index) {
  return (word ^ (index * kChecksumPositionMul)) * kChecksumWordMul;
}

// The final value from the sum of a storage's terms and its byte length.
GO_HOST_DEVICE constexpr std::uint64_t checksum_finish(std::uint64_t sum, std::uint64_t nbytes) {
  return sum ^ (nbytes * kChecksumLengthMul);
}

// How the kernel splits the work, written for host and device so the C++ tests can run the kernel's
// index arithmetic on a machine without a GPU. Storages are cut into chunks of kChunkBytes; a block takes
// a chunk, its threads stride over it with 16-byte loads (8-byte or byte loads where the storage is not
// aligned for them) and the block adds its sum into the storage's slot.
namespace checksum_detail {

constexpr std::uint64_t kChunkBytes = 1ull << 20;  // a multiple of 16: chunks start vector-aligned

GO_HOST_DEVICE constexpr std::uint64_t num_chunks(std::uint64_t nbytes) { return (nbytes + kChunkBytes - 1) / kChunkBytes; }

// The storage s with starts[s] <= chunk < starts[s + 1], where starts (n + 1 entries, ascending) holds
// each storage's first chunk and starts[n] the total; empty storages own no chunk.
GO_HOST_DEVICE inline std::uint64_t chunk_owner(const std::uint64_t* starts, std::uint64_t n, std::uint64_t chunk) {
  std::uint64_t lo = 0, hi = n;  // starts[lo] <= chunk < starts[hi]
  while (hi - lo > 1) {
    const std::uint64_t mid = (lo + hi) / 2;
    if (starts[mid] <= chunk) lo = mid; else hi = mid;
  }
  return lo;
}

GO_HOST_DEVICE inline std::uint64_t load_bytes(const unsigned char* p, std::uint64_t count) {
  std::uint64_t w = 0;  // little-endian, zero-padded
  for (std::uint64_t b = 0; b < count; ++b) w |= static_cast<std::uint64_t>(p[b]) << (8 * b);
  return w;
}

GO_HOST_DEVICE inline std::uint64_t load_word(const unsigned char* p) {  // p 8-byte aligned
#if defined(__CUDA_ARCH__)
  return *reinterpret_cast<const std::uint64_t*>(p);
#else
  std::uint64_t w;
  std::memcpy(&w, p, sizeof w);
  return w;
#endif
}

// The sum of the terms thread `thread` of `num_threads` takes from bytes [begin, end) of the storage at
// `ptr` (begin a multiple of 16). Aligned loads assume a little-endian machine, as GPUs and x86 are.
GO_HOST_DEVICE inline std::uint64_t chunk_share(std::uintptr_t ptr, std::uint64_t begin, std::uint64_t end,
                                                std::uint64_t thread, std::uint64_t num_threads) {
  const auto* base = reinterpret_cast<const unsigned char*>(ptr);
  std::uint64_t acc = 0;
  std::uint64_t word_begin = begin / 8;  // the first word the vector loop leaves
  if ((ptr & 15) == 0) {
    const std::uint64_t vend = end / 16;
#if defined(__CUDA_ARCH__)
#pragma unroll 4
#endif
    for (std::uint64_t v = begin / 16 + thread; v < vend; v += num_threads) {
#if defined(__CUDA_ARCH__)
      const ulonglong2 x = __ldg(reinterpret_cast<const ulonglong2*>(base) + v);
      acc += checksum_term(x.x, 2 * v) + checksum_term(x.y, 2 * v + 1);
#else
      acc += checksum_term(load_word(base + 16 * v), 2 * v) + checksum_term(load_word(base + 16 * v + 8), 2 * v + 1);
#endif
    }
    word_begin = 2 * vend;
  }
  const bool aligned8 = (ptr & 7) == 0;
  const std::uint64_t word_end = (end + 7) / 8;
  for (std::uint64_t w = word_begin + thread; w < word_end; w += num_threads) {
    const std::uint64_t at = 8 * w, count = end - at < 8 ? end - at : 8;
    const std::uint64_t word = aligned8 && count == 8 ? load_word(base + at) : load_bytes(base + at, count);
    acc += checksum_term(word, w);
  }
  return acc;
}

}  // namespace checksum_detail

// Sum of the terms of the bytes [0, nbytes) at `data`, which start at word `first_word` of their storage.
// nbytes may end mid-word (the storage's tail: zero-padded); data needs no alignment.
std::uint64_t checksum_partial(const void* data, std::size_t nbytes, std::uint64_t first_word);

// The checksum of one buffer, on the calling thread.
std::uint64_t checksum(const void* data, std::size_t nbytes);

// The checksums of n host buffers, split over the thread pool when they are large.
std::vector<std::uint64_t> checksum_host(const std::vector<std::uintptr_t>& ptrs, const std::vector<std::size_t>& sizes);

namespace cuda {

// Checksums being computed on a GPU: the kernel and the copy of the sums to the host are enqueued on a
// stream; wait() returns them once that work has run. Destroying a job before it finished is allowed.
class ChecksumJob {
 public:
  virtual ~ChecksumJob() = default;
  virtual bool query() const = 0;               // true once the sums are on the host; never blocks
  virtual std::vector<std::uint64_t> wait() = 0;  // blocks until then; the finished checksums
};

// Enqueues the checksum kernel over n device buffers of `device` on `stream` (a cudaStream_t as an
// integer; 0 is the legacy default stream): the sums are of the data as it is when the stream reaches the
// kernel, i.e. after the work enqueued before it. Throws Error in a build without CUDA.
std::shared_ptr<ChecksumJob> checksum_device_async(int device, const std::vector<std::uintptr_t>& ptrs,
                                                   const std::vector<std::size_t>& sizes, std::uintptr_t stream);

// The same, waited for.
std::vector<std::uint64_t> checksum_device(int device, const std::vector<std::uintptr_t>& ptrs,
                                           const std::vector<std::size_t>& sizes, std::uintptr_t stream);

}  // namespace cuda
}  // namespace gpu_offload
