// Storage checksums: one 64-bit value per storage, the same on the host and on a GPU, so a sum computed by
// a kernel from the source as it was copied can be checked against the host copy later.
//
// The storage is read as little-endian 64-bit words w_i (the last one zero-padded) and
//   h = sum_i ((w_i XOR (i * kPositionMul)) * kWordMul)   (mod 2^64),   then   h ^= nbytes * kLengthMul.
// kWordMul is odd, so a change to one word (one flipped byte) always changes h; the position term makes two
// swapped words count differently; the sum reduces in any order, so threads and blocks split it freely.
// It is an integrity check against corruption, not a cryptographic hash.
//
// Declared without CUDA headers: checksum_cuda.cpp implements the device entry through the driver table,
// checksum.cpp stands in for it in a CPU-only build (as cuda_backend_stub.cpp does for the copy backend).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

// The term, the finish and the kernel's per-thread work are in kernels.cuh, shared with the kernel (and
// the simulated driver), so every side computes the very same function.
#include "kernels.cuh"

namespace gpu_offload {

constexpr std::uint64_t kChecksumPositionMul = kernels::kChecksumPositionMul;
constexpr std::uint64_t kChecksumWordMul = kernels::kChecksumWordMul;
constexpr std::uint64_t kChecksumLengthMul = kernels::kChecksumLengthMul;
using kernels::checksum_finish;
using kernels::checksum_term;

// How the kernel splits the work, reachable from the host so the C++ tests can run the kernel's index
// arithmetic on a machine without a GPU. Storages are cut into chunks of kChunkBytes; a block takes a
// chunk, its threads stride over it with 16-byte loads (8-byte or byte loads where the storage is not
// aligned for them) and the block writes the chunk's sum into its slot.
namespace checksum_detail {

constexpr std::uint64_t kChunkBytes = kernels::kChecksumChunkBytes;
using kernels::chunk_share;
using kernels::load_bytes;
using kernels::load_word;
constexpr std::uint64_t num_chunks(std::uint64_t nbytes) { return kernels::checksum_num_chunks(nbytes); }

// The storage s with starts[s] <= chunk < starts[s + 1], where starts (n + 1 entries, ascending) holds
// each storage's first chunk and starts[n] the total; empty storages own no chunk.
inline std::uint64_t chunk_owner(const std::uint64_t* starts, std::uint64_t n, std::uint64_t chunk) {
  std::uint64_t lo = 0, hi = n;  // starts[lo] <= chunk < starts[hi]
  while (hi - lo > 1) {
    const std::uint64_t mid = (lo + hi) / 2;
    if (starts[mid] <= chunk) lo = mid; else hi = mid;
  }
  return lo;
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
