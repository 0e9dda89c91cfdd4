#include "copy_plan.hpp"

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__)
#include <emmintrin.h>
#endif
#include <string>

#include "errors.hpp"
#include "thread_pool.hpp"

namespace gpu_offload {
namespace {

// Below this a batch is copied on the calling thread: waking the pool costs more than it saves.
constexpr std::size_t kParallelMinBytes = 4u << 20;

}  // namespace

CopyPlan::CopyPlan(int device, std::vector<std::uintptr_t> device_ptrs, std::vector<std::size_t> host_offsets,
                   std::vector<std::size_t> sizes, std::size_t gather_max_bytes)
    : device_(device),
      device_ptrs_(std::move(device_ptrs)),
      host_offsets_(std::make_shared<const std::vector<std::size_t>>(std::move(host_offsets))),
      sizes_(std::make_shared<const std::vector<std::size_t>>(std::move(sizes))),
      gather_max_bytes_(device >= 0 ? gather_max_bytes : 0) {
  const std::vector<std::size_t>& offsets = *host_offsets_;
  const std::vector<std::size_t>& sizes_of = *sizes_;
  GO_CHECK(device_ptrs_.size() == sizes_of.size() && offsets.size() == sizes_of.size(),
           "plan arrays differ in length: " + std::to_string(device_ptrs_.size()) + " pointers, " +
               std::to_string(offsets.size()) + " offsets, " + std::to_string(sizes_of.size()) + " sizes");
  GO_CHECK(device_ >= -1, "device must be -1 (host) or a CUDA device index, got " + std::to_string(device_));
  check_device_ptrs();
  for (std::size_t i = 0; i < sizes_of.size(); ++i) {
    total_bytes_ += sizes_of[i];
    host_extent_bytes_ = std::max(host_extent_bytes_, offsets[i] + sizes_of[i]);
    if (sizes_of[i] != 0 && sizes_of[i] <= gather_max_bytes_) ++num_kernel_copies_;
  }
}

CopyPlan CopyPlan::with_device_ptrs(std::vector<std::uintptr_t> device_ptrs) const {
  GO_CHECK(device_ptrs.size() == sizes_->size(), "plan arrays differ in length: " + std::to_string(device_ptrs.size()) +
                                                     " pointers for " + std::to_string(sizes_->size()) + " copies");
  CopyPlan out;
  out.device_ = device_;
  out.device_ptrs_ = std::move(device_ptrs);
  out.host_offsets_ = host_offsets_;
  out.sizes_ = sizes_;
  out.total_bytes_ = total_bytes_;  // (what the shared sizes and offsets sum to)
  out.host_extent_bytes_ = host_extent_bytes_;
  out.gather_max_bytes_ = gather_max_bytes_;
  out.num_kernel_copies_ = num_kernel_copies_;
  out.check_device_ptrs();
  return out;
}

void CopyPlan::check_device_ptrs() const {
  const std::vector<std::size_t>& sizes_of = *sizes_;
  for (std::size_t i = 0; i < sizes_of.size(); ++i) {
    GO_CHECK(sizes_of[i] == 0 || device_ptrs_[i] != 0, "null storage pointer for copy " + std::to_string(i));
  }
}

namespace {

// The start of the next source, asked for while the current one is copied: many small storages lie apart
// in memory, and the hardware prefetcher starts over at each (65536 x 2 KiB ran at half a contiguous copy).
inline void prefetch_head(const void* src, std::size_t size) {
  constexpr std::size_t kHeadBytes = 2048, kLine = 64;
  const char* p = static_cast<const char*>(src);
  const std::size_t head = std::min(size, kHeadBytes);
  for (std::size_t off = 0; off < head; off += kLine) __builtin_prefetch(p + off);
}

// A batch this large does not stay in the caches: it is written with streaming stores, as glibc's memcpy
// writes one large copy. Many small pieces, each copied with memcpy, each paid the read of its destination
// lines first (65536 x 2 KiB: half the speed of one contiguous copy of the same bytes).
#if defined(__x86_64__)
inline void stream_copy(char* dst, const char* src, std::size_t n) {
  constexpr std::size_t kMinBytes = 256;
  if (n < kMinBytes) {
    std::memcpy(dst, src, n);
    return;
  }
  const std::size_t head = (16 - (reinterpret_cast<std::uintptr_t>(dst) & 15)) & 15;
  std::memcpy(dst, src, head);
  dst += head;
  src += head;
  n -= head;
  const std::size_t body = n & ~std::size_t{63};
  for (std::size_t i = 0; i < body; i += 64) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 16));
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 32));
    const __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 48), d);
  }
  std::memcpy(dst + body, src + body, n - body);
}
inline void stream_fence() { _mm_sfence(); }
#else
inline void stream_copy(char* dst, const char* src, std::size_t n) { std::memcpy(dst, src, n); }
inline void stream_fence() {}
#endif

// One memcpy batch of n pieces, piece i being dst(i) <- src(i), sizes[i] bytes (the addresses computed as
// they are needed: a plan run makes no array of them).
template <typename Dst, typename Src>
void copy_pieces(Dst&& dst, Src&& src, const std::size_t* sizes, std::size_t n) {
  std::size_t total = 0;
  for (std::size_t i = 0; i < n; ++i) total += sizes[i];
  auto& pool = ThreadPool::instance();
  const std::size_t shards = total < kParallelMinBytes ? 1 : std::min<std::size_t>(pool.num_threads(), total / (1u << 20));
  if (shards <= 1) {
    // A small batch is many tiny pieces, each apart from the last (65536 storages of 16 bytes): both ends
    // of a piece a few ahead are asked for, or each memcpy waits for two misses in turn.
    constexpr std::size_t kAhead = 8;
    for (std::size_t i = 0; i < n; ++i) {
      if (i + kAhead < n) {
        __builtin_prefetch(src(i + kAhead));
        __builtin_prefetch(dst(i + kAhead), 1);
      }
      if (sizes[i] != 0) std::memcpy(dst(i), src(i), sizes[i]);
    }
    return;
  }
  // Shard s copies the bytes [s*total/shards, (s+1)*total/shards) of the concatenated batch, so one huge
  // storage is split as evenly as many small ones.
  pool.parallel_for(shards, [&](std::size_t s) {
    const std::size_t begin = total / shards * s, end = s + 1 == shards ? total : total / shards * (s + 1);
    std::size_t pos = 0;
    for (std::size_t i = 0; i < n && pos < end; ++i) {
      const std::size_t a = std::max(begin, pos), b = std::min(end, pos + sizes[i]);
      if (a < b) {
        if (i + 1 < n) prefetch_head(src(i + 1), sizes[i + 1]);
        stream_copy(static_cast<char*>(dst(i)) + (a - pos), static_cast<const char*>(src(i)) + (a - pos), b - a);
      }
      pos += sizes[i];
    }
    stream_fence();  // (the streaming stores are weakly ordered: visible before the shard reports done)
  });
}

}  // namespace

void parallel_memcpy(void* const* dst, const void* const* src, const std::size_t* sizes, std::size_t n) {
  copy_pieces([dst](std::size_t i) { return dst[i]; }, [src](std::size_t i) { return src[i]; }, sizes, n);
}

void CopyPlan::run_host(Direction direction, std::uintptr_t host_base) const {
  const std::size_t* offsets = host_offsets_->data();
  const std::uintptr_t* devs = device_ptrs_.data();
  auto host = [=](std::size_t i) { return reinterpret_cast<void*>(host_base + offsets[i]); };
  auto dev = [=](std::size_t i) { return reinterpret_cast<void*>(devs[i]); };
  if (direction == Direction::kToHost) {
    copy_pieces(host, dev, sizes_->data(), sizes_->size());
  } else {
    copy_pieces(dev, host, sizes_->data(), sizes_->size());
  }
}

cuda::EventPtr CopyPlan::run(Direction direction, std::uintptr_t host_base, std::uintptr_t stream,
                             const std::vector<cuda::EventPtr>& waits, bool stream_waits) const {
  GO_CHECK(host_base != 0 || total_bytes_ == 0, "null host region");
  if (device_ < 0) {
    for (const auto& w : waits) {
      if (w) w->synchronize();
    }
    run_host(direction, host_base);
    return nullptr;
  }
  // The kernel reaches host memory through its mapped address: only a pinned, mapped region qualifies, and
  // only where the device has the kernel loaded.
  const bool use_kernel = num_kernel_copies_ != 0 && cuda::can_gather(device_, host_base);
  cuda::Batch batch;
  batch.to_host = direction == Direction::kToHost;
  batch.host_base = host_base;
  const std::vector<std::size_t>& sizes = *sizes_;
  const std::vector<std::size_t>& offsets = *host_offsets_;
  batch.engine.dst.reserve(sizes.size());
  batch.engine.src.reserve(sizes.size());
  batch.engine.sizes.reserve(sizes.size());
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    if (sizes[i] == 0) continue;  // nothing to move
    auto* host = reinterpret_cast<void*>(host_base + offsets[i]);
    auto* dev = reinterpret_cast<void*>(device_ptrs_[i]);
    cuda::CopyList& list = use_kernel && sizes[i] <= gather_max_bytes_ ? batch.kernel : batch.engine;
    if (batch.to_host) {
      list.push(host, dev, sizes[i]);
    } else {
      list.push(dev, host, sizes[i]);
    }
  }
  return cuda::copy_batch(device_, batch, stream, waits, stream_waits);
}

}  // namespace gpu_offload
