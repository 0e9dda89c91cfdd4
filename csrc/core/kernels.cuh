// The one source of the engine's two kernels (gather/scatter and checksum). Three compilers read it:
// nvcc builds it into the fatbin embedded in the module (kernels.cu), NVRTC compiles it at first use on a
// machine without a toolkit (its text is embedded too), and the host compiler includes it so that the
// simulated driver and the host checksum run the very same per-thread bodies. So: no #include (NVRTC has
// no standard headers), fixed-width types spelt out, and everything a GPU-only construct touches behind
// GO_KERNELS_DEVICE.
#pragma once

#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
#define GO_KERNELS_DEVICE 1
#define GO_KERNEL_FN __host__ __device__ inline
#else
#define GO_KERNEL_FN inline
#endif

namespace gpu_offload {
namespace kernels {

typedef unsigned long long u64;
typedef unsigned char u8;

// ---- gather/scatter ---------------------------------------------------------------------------------
// One piece of a gather/scatter: at most kGatherChunkBytes, so a large tensor spreads over many blocks.
struct Chunk {
  const u8* src;
  u8* dst;
  u64 num_bytes;
};
const u64 kGatherChunkBytes = 64 * 1024;
const unsigned kGatherThreads = 256;

GO_KERNEL_FN void copy16(u8* dst, const u8* src) {
#if defined(__CUDA_ARCH__)
  *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
#else
  __builtin_memcpy(dst, src, 16);
#endif
}

// Thread `t` of `n` copies its share of one chunk: 16-byte accesses where both ends are 16-byte aligned,
// bytes elsewhere. Through mapped pinned memory every access crosses the link, so wide accesses are what
// reach the limit.
GO_KERNEL_FN void gather_share(const Chunk& ch, u64 t, u64 n) {
  u64 done = 0;
  if (((reinterpret_cast<u64>(ch.src) | reinterpret_cast<u64>(ch.dst)) & 15) == 0) {
    const u64 n16 = ch.num_bytes / 16;
    for (u64 i = t; i < n16; i += n) copy16(ch.dst + 16 * i, ch.src + 16 * i);
    done = n16 * 16;
  }
  for (u64 i = done + t; i < ch.num_bytes; i += n) ch.dst[i] = ch.src[i];
}

// ---- checksum (see checksum.hpp for the function) -----------------------------------------------------
const u64 kChecksumPositionMul = 0x9E3779B97F4A7C15ull;
const u64 kChecksumWordMul = 0xBF58476D1CE4E5B9ull;
const u64 kChecksumLengthMul = 0x94D049BB133111EBull;
const u64 kChecksumChunkBytes = 1ull << 20;  // a multiple of 16: chunks start vector-aligned
const unsigned kChecksumThreads = 256;

// The contribution of word `index` holding `word`.
GO_KERNEL_FN constexpr u64 checksum_term(u64 word, u64 index) {
  return (word ^ (index * kChecksumPositionMul)) * kChecksumWordMul;
}

// The final value from the sum of a storage's terms and its byte length.
GO_KERNEL_FN constexpr u64 checksum_finish(u64 sum, u64 nbytes) { return sum ^ (nbytes * kChecksumLengthMul); }

GO_KERNEL_FN constexpr u64 checksum_num_chunks(u64 nbytes) {
  return (nbytes + kChecksumChunkBytes - 1) / kChecksumChunkBytes;
}

// One chunk of one storage, as the checksum kernel reads it (32 bytes): the storage's start (for alignment
// and word indices), the chunk's byte range in it, and padding.
struct SumChunk {
  u64 ptr;
  u64 begin;
  u64 end;
  u64 pad;
};

GO_KERNEL_FN u64 load_bytes(const u8* p, u64 count) {
  u64 w = 0;  // little-endian, zero-padded
  for (u64 b = 0; b < count; ++b) w |= static_cast<u64>(p[b]) << (8 * b);
  return w;
}

GO_KERNEL_FN u64 load_word(const u8* p) {  // p 8-byte aligned
#if defined(__CUDA_ARCH__)
  return *reinterpret_cast<const u64*>(p);
#else
  u64 w;
  __builtin_memcpy(&w, p, sizeof w);
  return w;
#endif
}

// The sum of the terms thread `thread` of `num_threads` takes from bytes [begin, end) of the storage at
// `ptr` (begin a multiple of 16). Aligned loads assume a little-endian machine, as GPUs and x86 are.
GO_KERNEL_FN u64 chunk_share(u64 ptr, u64 begin, u64 end, u64 thread, u64 num_threads) {
  const u8* base = reinterpret_cast<const u8*>(ptr);
  u64 acc = 0;
  u64 word_begin = begin / 8;  // the first word the vector loop leaves
  if ((ptr & 15) == 0) {
    const u64 vend = end / 16;
#if defined(__CUDA_ARCH__)
#pragma unroll 4
#endif
    for (u64 v = begin / 16 + thread; v < vend; v += num_threads) {
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
  const u64 word_end = (end + 7) / 8;
  for (u64 w = word_begin + thread; w < word_end; w += num_threads) {
    const u64 at = 8 * w, count = end - at < 8 ? end - at : 8;
    const u64 word = aligned8 && count == 8 ? load_word(base + at) : load_bytes(base + at, count);
    acc += checksum_term(word, w);
  }
  return acc;
}

}  // namespace kernels
}  // namespace gpu_offload

#if defined(GO_KERNELS_DEVICE)
// The entry points, unmangled so that the driver finds them by name in any of the three images.
extern "C" {

// A grid-stride loop hands chunks to blocks; thread 0 reads the chunk once over the link.
__global__ void __launch_bounds__(256) gather_chunks(const gpu_offload::kernels::Chunk* __restrict__ chunks,
                                                     unsigned long long num_chunks) {
  using namespace gpu_offload::kernels;
  __shared__ Chunk ch;
  for (u64 c = blockIdx.x; c < num_chunks; c += gridDim.x) {
    if (threadIdx.x == 0) ch = chunks[c];
    __syncthreads();
    gather_share(ch, threadIdx.x, blockDim.x);
    __syncthreads();  // `ch` is overwritten by the next chunk
  }
}

// Each block sums its chunks and writes one partial per chunk to mapped host memory (no atomics); the
// host adds a storage's partials. The sum is order-free, so the value is the host's exactly.
__global__ void __launch_bounds__(256) checksum_kernel(const gpu_offload::kernels::SumChunk* __restrict__ chunks,
                                                       unsigned long long num_chunks, unsigned long long* partials) {
  using namespace gpu_offload::kernels;
  __shared__ unsigned long long warp_sums[kChecksumThreads / 32];
  __shared__ SumChunk ch;
  for (u64 c = blockIdx.x; c < num_chunks; c += gridDim.x) {
    if (threadIdx.x == 0) ch = chunks[c];
    __syncthreads();
    unsigned long long acc = chunk_share(ch.ptr, ch.begin, ch.end, threadIdx.x, blockDim.x);
    for (int offset = 16; offset > 0; offset >>= 1) acc += __shfl_down_sync(0xffffffffu, acc, offset);
    const unsigned lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) warp_sums[warp] = acc;
    __syncthreads();
    if (warp == 0) {
      unsigned long long v = lane < blockDim.x / 32 ? warp_sums[lane] : 0ull;
      for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_down_sync(0xffffffffu, v, offset);
      if (lane == 0) partials[c] = v;
    }
    __syncthreads();  // warp_sums and ch are reused by the next chunk
  }
}

}  // extern "C"
#endif
