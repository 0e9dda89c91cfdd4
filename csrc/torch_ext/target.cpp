// Per-call checks of a target's tensors in one C++ pass, and batched storage operations (resize, watch).
//
// A TargetRecord is what a cached plan remembers about the tensors it was built from: for each tensor its
// Python object, its TensorImpl, its storage, offset, shape, strides and dtype; for each storage its
// StorageImpl, data pointer, size, device and resizability. check() answers whether a list of tensors is
// still exactly that, which is what the plan needs to be reused. A record holds no reference: recorded
// pointers are only compared with live ones, never followed, except a storage's whose tensor was just found
// to still use it (so it is alive). check_held() is the one exception: its HeldStorages holds strong
// references to the storages it checked, for the resize or watch that follows in the same call.
#include <Python.h>
#include <structmember.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <ATen/native/Resize.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/StorageImpl.h>
#include <c10/core/Stream.h>
#include <c10/core/TensorImpl.h>
#include <c10/core/impl/COW.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/Storage.h>
#include <torch/csrc/autograd/python_variable.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <memory>
#include <system_error>
#include <thread>
#include <optional>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "torch_ext.hpp"

namespace py = pybind11;

namespace gpu_offload::torch_ext {

namespace {

// Exact torch.Tensor / nn.Parameter (not a subclass whose storage may be something else, e.g. a DTensor).
bool plain_tensor(PyObject* obj) { return THPVariable_CheckExact(obj); }

// Whether a storage's memory is still to be materialized before it may be written: torch 2.13 and later give a
// StorageImpl a pluggable one-shot hook (has_materializer(), set by a copy-on-write clone among others), torch
// 2.11 and 2.12 mark a copy-on-write storage by its DataPtr's deleter alone. (A template, so that only the
// branch this torch has is compiled; C++17, which torch 2.11's extensions build with.)
template <typename S, typename = void>
struct HasMaterializer : std::false_type {};
template <typename S>
struct HasMaterializer<S, std::void_t<decltype(std::declval<S&>().has_materializer())>> : std::true_type {};

template <typename S>
bool must_materialize(S* s) {
  if constexpr (HasMaterializer<S>::value) {
    return s->has_materializer();
  } else {
    return c10::impl::cow::is_cow_data_ptr(s->_mutable_data_ptr_no_checks());
  }
}

void* data_of(c10::StorageImpl* s) {
  // The address only: no access check (a storage may refuse access). A storage that shares its memory
  // copy-on-write (torch._lazy_clone) first gets its own copy, as torch's mutable data_ptr() gives it: that
  // address is another tensor's too, and a restore or reload writing there would land in both. set_data_ptr()
  // is the one public call that materializes with no access check in every torch this builds against (the
  // names of the copy-on-write functions differ: materialize_cow_storage, then materialize_cow): the
  // materialized DataPtr is taken out and put straight back.
  if (C10_UNLIKELY(must_materialize(s))) s->set_data_ptr(s->set_data_ptr(at::DataPtr()));
  return s->_mutable_data_ptr_no_checks().get();
}

// A storage resized to 0 or, from 0, to n bytes, the two sizes offload and reload ask for (nothing to copy).
// CPU: torch's own resize_bytes_cpu (what UntypedStorage.resize_ calls). CUDA: what resize_bytes_cuda does
// for those sizes, through the storage's own allocator (torch's caching allocator, behind c10::Allocator)
// under a c10::DeviceGuard (c10's device-guard registry, which torch's CUDA library fills): this helper then
// links no libtorch_cuda and serves CPU and CUDA builds of a torch version alike. `through_allocator` takes
// that second way for a CPU storage too (the tests exercise it where there is no GPU).
// Whether resize_empty's allocator way can take a storage to `nbytes`: to 0, from 0, or to the size it holds
// (a reload finishing one an interrupt cut short).
bool resizes_empty(const c10::StorageImpl* s, size_t nbytes) {
  return nbytes == 0 || s->nbytes() == 0 || s->nbytes() == nbytes;
}

void resize_empty(c10::StorageImpl* s, size_t nbytes, bool through_allocator = false) {
  const c10::Device device = s->device();
  if (device.is_cpu() && !through_allocator) {
    at::native::resize_bytes_cpu(s, nbytes);
    return;
  }
  if (!device.is_cpu() && !device.is_cuda()) throw py::value_error("resize: CPU and CUDA storages only");
  if (!s->resizable()) throw std::runtime_error("Trying to resize storage that is not resizable");
  if (nbytes == 0) {
    s->set_data_ptr_noswap(at::DataPtr(nullptr, device));
    s->set_nbytes(0);
    return;
  }
  if (!resizes_empty(s, nbytes)) throw py::value_error("resize: a storage grows only from 0 bytes here");
  if (s->nbytes() == nbytes) return;
  c10::Allocator* allocator = s->allocator();
  if (allocator == nullptr) throw std::runtime_error("Trying to resize storage without an allocator");
  c10::DeviceGuard guard(device);
  at::DataPtr data = allocator->allocate(nbytes);  // (the caching allocator: on the current stream, as torch's)
  s->set_data_ptr_noswap(std::move(data));
  s->set_nbytes(nbytes);
}

bool one_pass_device(const c10::Device& device) { return device.is_cpu() || device.is_cuda(); }

// Whether a storage can be released and allocated again: resizable, with an allocator to grow it back from.
// A CPU storage moved to shared memory (share_memory_(), or one from another process) is resizable yet has
// none, and torch's resize_bytes_cpu would follow the null allocator.
bool regrowable(const c10::StorageImpl* s) { return s->resizable() && s->allocator() != nullptr; }

// A reload's small CPU storages share blocks: one allocation per block instead of one per storage. For a
// 16-byte storage, c10's allocator asks glibc for a 64-byte-aligned chunk (memalign splits a larger one),
// and the frees of a released target then make the next large request consolidate every chunk: about a
// quarter of an offload+reload of 65536 tiny tensors. Each storage gets its own 64-byte-aligned part of a
// block (the alignment c10's alloc_cpu gives), with a deleter that drops the block's count, so each storage
// is still freed, resized or shared on its own; the block goes back to the allocator with its last storage. Only
// storages up to kBlockPartBytes, in blocks up to kBlockBytes: under glibc's default mmap threshold (128
// KiB), so a block comes from the heap, which reuses the last offload's blocks unless it gave them back to
// the system (4 MiB blocks were mapped afresh, a page fault per 4 KiB at every reload until glibc raised its
// threshold), and a storage released alone holds at most that much.
constexpr size_t kBlockPartBytes = 64 * 1024;
constexpr size_t kBlockBytes = 120 * 1024;
constexpr size_t kBlockAlign = 64;

std::atomic<int64_t> g_num_blocks{0};  // blocks alive (num_cpu_blocks(), for the tests)

struct StorageBlock {
  StorageBlock() { g_num_blocks.fetch_add(1, std::memory_order_relaxed); }
  ~StorageBlock() { g_num_blocks.fetch_sub(1, std::memory_order_relaxed); }
  at::DataPtr memory;
  std::atomic<size_t> users{1};  // its parts in use, and one for the pass that hands them out
};

// A part's deleter: its block goes with its last part.
void release_block_part(void* ctx) {
  StorageBlock* block = static_cast<StorageBlock*>(ctx);
  if (block->users.fetch_sub(1, std::memory_order_acq_rel) == 1) delete block;
}

size_t round_up(size_t n, size_t to) { return (n + to - 1) / to * to; }

// The parts of a reload's small CPU storages (by the record's facts; each storage is checked again as
// it is resized), their blocks allocated up front: an allocation failure leaves every storage as it was.
class BlockParts {
 public:
  // `want[k]`: the size storage k grows to, 0 where it takes the allocator's own way.
  explicit BlockParts(const std::vector<size_t>& want) : part_(want.size(), nullptr), block_(want.size(), nullptr) {
    try {
      allocate(want);
    } catch (...) {
      release();  // (no destructor runs for an object whose constructor throws)
      throw;
    }
  }
  BlockParts(const BlockParts&) = delete;
  BlockParts& operator=(const BlockParts&) = delete;
  ~BlockParts() { release(); }
  bool has(size_t k) const { return part_[k] != nullptr; }
  // Storage k's part, counted as in use (the caller sets it on the storage).
  at::DataPtr take(size_t k, const c10::Device& device) {
    block_[k]->users.fetch_add(1, std::memory_order_relaxed);
    return at::DataPtr(part_[k], block_[k], &release_block_part, device);
  }

 private:
  void allocate(const std::vector<size_t>& want) {
    c10::Allocator* allocator = c10::GetCPUAllocator();
    size_t start = 0;
    while (start < want.size()) {
      size_t bytes = 0, end = start;
      for (; end < want.size(); ++end) {
        if (want[end] == 0) continue;
        const size_t part = round_up(want[end], kBlockAlign);
        if (bytes != 0 && bytes + part > kBlockBytes) break;
        bytes += part;
      }
      if (bytes != 0) {
        auto owned = std::make_unique<StorageBlock>();
        owned->memory = allocator->allocate(bytes);
        blocks_.push_back(owned.get());
        StorageBlock* block = owned.release();
        char* at = static_cast<char*>(block->memory.get());
        for (size_t k = start; k < end; ++k) {
          if (want[k] == 0) continue;
          part_[k] = at;
          block_[k] = block;
          at += round_up(want[k], kBlockAlign);
        }
      }
      start = end;
    }
  }
  // The pass's own counts go: a block none of whose parts was handed out is freed here.
  void release() {
    for (StorageBlock* block : blocks_) release_block_part(block);
    blocks_.clear();
  }
  std::vector<void*> part_;
  std::vector<StorageBlock*> block_;
  std::vector<StorageBlock*> blocks_;
};

// Storage -> index, open addressing: a record is made on every fresh bind, and a node-based map's allocation
// per storage was most of its cost.
class StorageIndex {
 public:
  explicit StorageIndex(size_t expected) {
    int bits = 4;
    while ((size_t{1} << bits) < 2 * expected) ++bits;
    slots_.assign(size_t{1} << bits, {nullptr, 0});
    mask_ = slots_.size() - 1;
    shift_ = 64 - bits;
  }
  // The index of `s`, or `fresh` (inserted) when it has none yet.
  std::pair<int32_t, bool> find_or_insert(c10::StorageImpl* s, int32_t fresh) {
    size_t i = slot_of(s);
    while (slots_[i].first != nullptr) {
      if (slots_[i].first == s) return {slots_[i].second, false};
      i = (i + 1) & mask_;
    }
    slots_[i] = {s, fresh};
    return {fresh, true};
  }
  // Asks for the slot `s` is looked up at first (the table is larger than the caches: a random access each).
  void prefetch(const c10::StorageImpl* s) const { __builtin_prefetch(&slots_[slot_of(s)], 1); }

 private:
  // Fibonacci hashing: the product's top bits.
  size_t slot_of(const c10::StorageImpl* s) const {
    return static_cast<size_t>((reinterpret_cast<uint64_t>(s) * 0x9E3779B97F4A7C15ull) >> shift_);
  }

  std::vector<std::pair<c10::StorageImpl*, int32_t>> slots_;
  size_t mask_;
  int shift_;
};

// The per-tensor passes are memory-bound: a tensor's Python object, TensorImpl and storage are scattered.
// Each pass asks for the object of the tensor 2 * kAhead ahead and the TensorImpl of the one kAhead ahead.
constexpr Py_ssize_t kAhead = 6;

// Every cache line of an object of type T at `p` (it may straddle one line more than its size needs).
template <typename T, int kWrite = 0>
inline void prefetch_whole(const void* p) {
  const char* c = static_cast<const char*>(p);
  for (size_t off = 0; off < sizeof(T); off += 64) __builtin_prefetch(c + off, kWrite);
  __builtin_prefetch(c + sizeof(T) - 1, kWrite);
}

// Asks for `far`'s object and `near`'s TensorImpl (either may be nullptr: past the end). Returns near's
// TensorImpl, or nullptr when near is not a tensor: only a tensor's object is unpacked (a prefetch never
// faults; reading a TensorImpl pointer out of another object would).
template <int kWrite = 0>
inline c10::TensorImpl* prefetch_tensor(PyObject* far, PyObject* near) {
  if (far != nullptr) __builtin_prefetch(far);
  if (near == nullptr || !is_tensor(near)) return nullptr;
  c10::TensorImpl* impl = THPVariable_Unpack(near).unsafeGetTensorImpl();
  __builtin_prefetch(impl, kWrite);
  return impl;
}

// items[i], or nullptr past the end.
inline PyObject* item_or_null(const Items& items, Py_ssize_t i) { return i < items.size ? items.data[i] : nullptr; }

PyObject* new_int(int64_t v) { return PyLong_FromLongLong(v); }

// Whether `names` is a list of distinct exact strs as long as the tensors (else the Python bind decides).
bool distinct_names(py::handle names, Py_ssize_t n) {
  if (!PyList_CheckExact(names.ptr()) || PyList_GET_SIZE(names.ptr()) != n) return false;
  PyObject** items = reinterpret_cast<PyListObject*>(names.ptr())->ob_item;
  size_t capacity = 16;
  while (capacity < 2 * static_cast<size_t>(n)) capacity *= 2;
  // Each slot keeps its name's hash: a probe compares the characters of names whose hashes are equal only.
  std::vector<std::pair<PyObject*, Py_hash_t>> slots(capacity, {nullptr, 0});
  constexpr Py_ssize_t kNameAhead = 8;  // (each name's object, scattered: its hash is cached in it)
  for (Py_ssize_t k = 0; k < n; ++k) {
    if (k + kNameAhead < n) __builtin_prefetch(items[k + kNameAhead]);
    PyObject* name = items[k];
    if (!PyUnicode_CheckExact(name)) return false;
    const Py_hash_t h = PyObject_Hash(name);  // (computed once, then cached in the str)
    if (h == -1) throw py::error_already_set();
    size_t i = static_cast<size_t>(h) & (capacity - 1);
    while (slots[i].first != nullptr) {
      if (slots[i].first == name) return false;
      if (slots[i].second == h) {
        const int same = PyUnicode_Compare(slots[i].first, name);
        if (same == -1 && PyErr_Occurred()) throw py::error_already_set();
        if (same == 0) return false;
      }
      i = (i + 1) & (capacity - 1);
    }
    slots[i] = {name, h};
  }
  return true;
}

// A check's per-tensor pass in parts, on threads of their own. The pass is bound by memory latency (a
// tensor's object, TensorImpl and storage are three scattered reads, and prefetching keeps only a few in
// flight per core), so a second core nearly halves it: a cached snapshot of 65536 tensors waits on this pass
// before its first copy, while the copy threads idle. The threads only read (no Python API, no reference
// count), under the GIL that this thread holds until they are joined: nothing can change what they read.
// Started per call and joined before it returns (nothing lives on for a fork to find); a thread that cannot
// be started leaves its part to this one.
std::atomic<int> g_check_threads{0};  // 0: not yet read
std::atomic<int64_t> g_min_tensors_per_thread{8192};  // below this, a second thread costs more than it saves

int check_threads() {
  int n = g_check_threads.load(std::memory_order_relaxed);
  if (n > 0) return n;
  // As the copy pool counts its threads (csrc/core/thread_pool.cpp): GPU_OFFLOAD_NUM_THREADS, else the cores,
  // at most 16. A value the pool refuses (it says so at the first copy) counts as the cores here.
  long want = static_cast<long>(std::max(1u, std::thread::hardware_concurrency()));
  if (const char* env = std::getenv("GPU_OFFLOAD_NUM_THREADS"); env != nullptr && *env != '\0') {
    char* end = nullptr;
    const long v = std::strtol(env, &end, 10);
    if (end != nullptr && *end == '\0' && v >= 1) want = v;
  }
  n = static_cast<int>(std::min<long>(want, 16));
  g_check_threads.store(n, std::memory_order_relaxed);
  return n;
}

size_t num_parts(Py_ssize_t n) {
  const int64_t per = std::max<int64_t>(1, g_min_tensors_per_thread.load(std::memory_order_relaxed));
  return static_cast<size_t>(std::max<int64_t>(1, std::min<int64_t>(check_threads(), n / per)));
}

// part(k, begin, end) for each of num_parts contiguous parts of [0, n), part 0 here; returns once all ran.
// `part` must not throw.
template <typename Part>
void run_parts(Py_ssize_t n, size_t parts, const Part& part) {
  const auto bound = [&](size_t k) { return static_cast<Py_ssize_t>(static_cast<__int128>(n) * k / parts); };
  std::vector<std::thread> threads;
  std::vector<size_t> here;  // parts whose thread could not be started
  threads.reserve(parts - 1);
  for (size_t k = 1; k < parts; ++k) {
    try {
      threads.emplace_back([&part, k, b = bound(k), e = bound(k + 1)] { part(k, b, e); });
    } catch (const std::system_error&) {
      here.push_back(k);
    }
  }
  part(0, bound(0), bound(1));
  for (size_t k : here) part(k, bound(k), bound(k + 1));
  for (std::thread& t : threads) t.join();
}


// Whether a tensor's TensorImpl is one a record takes: what storages.check_tensor() refuses, the Python bind
// then says (a TargetRecord is only of what it accepts).
bool recordable(c10::TensorImpl* impl) {
  return impl->has_storage() && impl->layout() == c10::kStrided && !impl->is_nested() &&
         !impl->has_symbolic_sizes_strides() && !impl->is_conj() && !impl->is_neg() && !impl->is_quantized() &&
         one_pass_device(impl->device()) && impl->dtype().isScalarType();
}

// A tensor's facts but its storage's (index, first), its sizes then strides appended to `dims` (dims_at: where
// they begin there). The one reading of a tensor for both ways of making a record.
template <typename Facts, typename Dims>
void read_tensor(PyObject* obj, c10::TensorImpl* impl, Facts& t, Dims& dims) {
  t.obj = obj;
  t.type = Py_TYPE(obj);
  t.impl = impl;
  t.inference = impl->is_inference();
  t.offset = impl->storage_offset();
  t.dtype = c10::typeMetaToScalarType(impl->dtype());
  t.dim = static_cast<int32_t>(impl->dim());
  t.dims_at = static_cast<int32_t>(dims.size());
  for (int64_t d : impl->sizes()) dims.push_back(d);
  for (int64_t d : impl->strides()) dims.push_back(d);
}

// The index of tensor i's storage `s`, and whether i is its first tensor: a storage met first is recorded
// (its memory read, a copy-on-write one materialized: the calling thread only), in the order of first tensors.
template <typename Storages, typename Ints>
std::pair<int32_t, bool> index_storage(StorageIndex& index_of, c10::StorageImpl* s, Py_ssize_t i, Storages& storages,
                                       Ints& first_tensor, Ints& live) {
  auto found = index_of.find_or_insert(s, static_cast<int32_t>(storages.size()));
  if (found.second) {
    storages.push_back({s, data_of(s), s->nbytes(), s->device(), regrowable(s), s->nbytes()});
    first_tensor.push_back(static_cast<int32_t>(i));
    if (s->nbytes() != 0) live.push_back(found.first);
  }
  return found;
}

}  // namespace

TargetRecord::TargetRecord(py::handle list) {
  Items items = items_of(list);
  static std::atomic<uint64_t> next_id{1};
  id_ = next_id.fetch_add(1, std::memory_order_relaxed);
  const size_t parts = num_parts(items.size);
  if (parts <= 1 || !record_in_parts(items, parts)) record_here(items);
  shrink_if_slack(storages_);
  shrink_if_slack(first_tensor_);
  shrink_if_slack(live_);
  shrink_if_slack(dims_);
  summarize();
}

void TargetRecord::record_here(const Items& items) {
  // Sized once (a storage per tensor at most; the dims as the first tensor has them) rather than grown by
  // doubling, each regrowth a copy into fresh pages (a bind of 65536 one-tensor storages: 15.5 -> 14.2 ms).
  // What is reserved and never written costs no page; what is far too much is cut down after the loop.
  const size_t n = static_cast<size_t>(items.size);
  tensors_.clear();
  dims_.clear();
  storages_.clear();
  first_tensor_.clear();
  live_.clear();
  tensors_.reserve(n);
  storages_.reserve(n);
  first_tensor_.reserve(n);
  live_.reserve(n);
  StorageIndex index_of(n);
  // Three stages ahead of the tensor read: its object (2 * kAhead), its whole TensorImpl (kAhead: the checks
  // below read lines past the first), then (kAhead / 2, once that TensorImpl's first line is in) its
  // StorageImpl and the index slot the storage is looked up at.
  c10::TensorImpl* staged[kAhead] = {};
  for (Py_ssize_t i = 0; i < items.size; ++i) {
    c10::TensorImpl* ahead = prefetch_tensor(item_or_null(items, i + 2 * kAhead), item_or_null(items, i + kAhead));
    if (ahead != nullptr) prefetch_whole<c10::TensorImpl>(ahead);
    staged[i % kAhead] = ahead;
    if (c10::TensorImpl* near = staged[(i + kAhead - kAhead / 2) % kAhead]; near != nullptr && i >= kAhead / 2) {
      // (A TensorImpl's storage member is there whether or not it has storage: null then, and a prefetch of
      // a null or stale address never faults.)
      const c10::StorageImpl* storage = near->unsafe_storage().unsafeGetStorageImpl();
      __builtin_prefetch(storage);
      index_of.prefetch(storage);
    }
    PyObject* obj = items.data[i];
    if (!plain_tensor(obj)) throw NotPlain("item " + std::to_string(i) + " is not a plain tensor");
    c10::TensorImpl* impl = THPVariable_Unpack(obj).unsafeGetTensorImpl();
    if (!recordable(impl)) {
      throw NotPlain("item " + std::to_string(i) + " has no plain strided CPU/CUDA storage (or a conjugate/negative bit)");
    }
    auto [index, fresh] = index_storage(index_of, impl->unsafe_storage().unsafeGetStorageImpl(), i, storages_,
                                        first_tensor_, live_);
    if (i == 0) dims_.reserve(2 * static_cast<size_t>(std::max<int64_t>(impl->dim(), 1)) * n);
    TensorFacts t{};
    read_tensor(obj, impl, t, dims_);
    t.storage = index;
    t.first = fresh;
    tensors_.push_back(t);
  }
}

bool TargetRecord::record_in_parts(const Items& items, size_t parts) {
  // 1. In parts, on threads: each tensor's facts but its storage's index, its StorageImpl, its sizes and
  //    strides into the part's own list. Reads only, as a check in parts (see run_parts); each thread writes
  //    its own slice of tensors_ (sized here without a write, so that each thread faults in its own pages).
  const Py_ssize_t n = items.size;
  tensors_.resize(static_cast<size_t>(n));
  UninitializedVector<c10::StorageImpl*> storage_of(static_cast<size_t>(n));
  enum class Read { kDone, kHere };  // kHere: the calling thread's record (it reads or refuses what a part may not)
  struct Part {
    Read read = Read::kHere;
    std::vector<int64_t> dims;
    Py_ssize_t begin = 0, end = 0;
    size_t dims_at = 0;
  };
  std::vector<Part> out(parts);
  run_parts(n, parts, [&](size_t k, Py_ssize_t begin, Py_ssize_t end) {
    Part& p = out[k];
    p.begin = begin;
    p.end = end;
    try {
      p.dims.reserve(4 * static_cast<size_t>(end - begin));  // (two dims each: a weight's)
      for (Py_ssize_t i = begin; i < end; ++i) {
        c10::TensorImpl* ahead = prefetch_tensor(item_or_null(items, i + 2 * kAhead), item_or_null(items, i + kAhead));
        if (ahead != nullptr) prefetch_whole<c10::TensorImpl>(ahead);
        PyObject* obj = items.data[i];
        if (!plain_tensor(obj)) return;
        c10::TensorImpl* impl = THPVariable_Unpack(obj).unsafeGetTensorImpl();
        // (A TensorImpl that dispatches to Python may answer its sizes, device or offset through Python.)
        if (impl->is_python_dispatch() || !recordable(impl)) return;
        TensorFacts& t = tensors_[static_cast<size_t>(i)];
        read_tensor(obj, impl, t, p.dims);  // (dims_at in the part's list, until 2.)
        t.storage = -1;
        t.first = false;
        storage_of[static_cast<size_t>(i)] = impl->unsafe_storage().unsafeGetStorageImpl();
      }
      p.read = Read::kDone;
    } catch (...) {
      p.read = Read::kHere;
    }
  });
  size_t num_dims = 0;
  for (Part& p : out) {
    if (p.read != Read::kDone || num_dims + p.dims.size() > static_cast<size_t>(INT32_MAX)) {
      tensors_.clear();
      return false;
    }
    p.dims_at = num_dims;
    num_dims += p.dims.size();
  }
  // 2. Here: the storages, in the order of their first tensors (a copy-on-write one materialized, as
  //    record_here does), and each tensor's storage index; its dims' place in dims_ as it goes.
  storages_.reserve(static_cast<size_t>(n));
  first_tensor_.reserve(static_cast<size_t>(n));
  live_.reserve(static_cast<size_t>(n));
  StorageIndex index_of(static_cast<size_t>(n));
  constexpr Py_ssize_t kStorageAhead = 8;
  size_t k = 0;
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (i + kStorageAhead < n) {
      const c10::StorageImpl* next = storage_of[static_cast<size_t>(i + kStorageAhead)];
      __builtin_prefetch(next);
      index_of.prefetch(next);
    }
    while (i >= out[k].end) ++k;
    auto [index, fresh] = index_storage(index_of, storage_of[static_cast<size_t>(i)], i, storages_, first_tensor_,
                                        live_);
    TensorFacts& t = tensors_[static_cast<size_t>(i)];
    t.storage = index;
    t.first = fresh;
    t.dims_at += static_cast<int32_t>(out[k].dims_at);
  }
  // 3. In parts again: each part's dims into dims_ (sized without a write), each thread faulting in its own.
  dims_.resize(num_dims);
  run_parts(static_cast<Py_ssize_t>(parts), parts, [&](size_t j, Py_ssize_t, Py_ssize_t) {
    const Part& p = out[j];
    if (!p.dims.empty()) std::memcpy(dims_.data() + p.dims_at, p.dims.data(), p.dims.size() * sizeof(int64_t));
  });
  return true;
}

py::object TargetRecord::bind(py::handle names, py::handle tensors, int64_t large_alignment, int64_t small_alignment,
                              int64_t small_storage_bytes, bool names_distinct) {
  std::unique_ptr<TargetRecord> record;
  try {
    record = std::make_unique<TargetRecord>(tensors);
  } catch (const NotPlain&) {
    return py::none();
  }
  const TargetRecord& r = *record;
  const size_t n = r.tensors_.size(), num_storages = r.storages_.size();
  if (names_distinct) {
    if (!PyList_CheckExact(names.ptr()) || PyList_GET_SIZE(names.ptr()) != static_cast<Py_ssize_t>(n)) return py::none();
  } else if (!distinct_names(names, static_cast<Py_ssize_t>(n))) {
    return py::none();
  }
  // Host offsets as storages.bind() lays them out; the first tensor (if any) that reaches past its storage.
  std::vector<int64_t> host_offsets(num_storages);
  int64_t host = 0;
  for (size_t j = 0; j < num_storages; ++j) {
    const int64_t nbytes = static_cast<int64_t>(r.storages_[j].nbytes);
    const int64_t to = nbytes >= small_storage_bytes ? large_alignment : small_alignment;
    host = (host + to - 1) / to * to;
    host_offsets[j] = host;
    host += nbytes;
  }
  int64_t extent_problem = -1;
  for (size_t i = 0; i < n && extent_problem < 0; ++i) {
    const TensorFacts& t = r.tensors_[i];
    const int64_t* dims = r.dims_.data() + t.dims_at;
    __int128 last = t.offset;
    bool empty = false;
    for (int32_t d = 0; d < t.dim; ++d) {
      if (dims[d] == 0) empty = true;
      last += static_cast<__int128>(dims[d] - 1) * dims[t.dim + d];
    }
    const __int128 need = empty ? 0 : (last + 1) * static_cast<__int128>(c10::elementSize(t.dtype));
    if (need > static_cast<__int128>(r.storages_[static_cast<size_t>(t.storage)].nbytes)) {
      extent_problem = static_cast<int64_t>(i);
    }
  }
  const auto& ss = r.storages_;
  // None where every tensor is the first on a storage of its own, in order (tensor i on storage i, the
  // usual model): the caller's range() then, and its tensor names are the storages'.
  bool identity = num_storages == n;
  for (size_t j = 0; identity && j < num_storages; ++j) identity = r.first_tensor_[j] == static_cast<int32_t>(j);
  py::object first = identity ? py::object(py::none())
                              : py::object(new_list(num_storages, [&](size_t j) { return new_int(r.first_tensor_[j]); }));
  py::list nbytes = new_list(num_storages, [&](size_t j) { return new_int(static_cast<int64_t>(ss[j].nbytes)); });
  py::list devices = new_list(num_storages, [&](size_t j) { return new_int(ss[j].device.is_cpu() ? -1 : ss[j].device.index()); });
  py::list hosts = new_list(num_storages, [&](size_t j) { return new_int(host_offsets[j]); });
  py::object owner = py::cast(record.release(), py::return_value_policy::take_ownership);
  return py::make_tuple(owner, first, nbytes, devices, hosts, host, extent_problem);
}

py::tuple TargetRecord::tensor_columns() const {
  const size_t n = tensors_.size();
  auto dims_tuple = [this](const TensorFacts& t, int32_t from) -> PyObject* {
    PyObject* out = PyTuple_New(t.dim);
    if (out == nullptr) return nullptr;
    const int64_t* dims = dims_.data() + t.dims_at + from;
    for (int32_t d = 0; d < t.dim; ++d) {
      PyObject* v = new_int(dims[d]);
      if (v == nullptr) {
        Py_DECREF(out);
        return nullptr;
      }
      PyTuple_SET_ITEM(out, d, v);
    }
    return out;
  };
  const auto& ts = tensors_;
  py::list storage = new_list(n, [&](size_t i) { return new_int(ts[i].storage); });
  py::list offsets = new_list(n, [&](size_t i) { return new_int(ts[i].offset); });
  py::list shapes = new_list(n, [&](size_t i) { return dims_tuple(ts[i], 0); });
  py::list strides = new_list(n, [&](size_t i) { return dims_tuple(ts[i], ts[i].dim); });
  py::list dtypes = new_list(n, [&](size_t i) -> PyObject* {
    PyObject* dtype = reinterpret_cast<PyObject*>(torch::getTHPDtype(ts[i].dtype));
    Py_XINCREF(dtype);
    return dtype;
  });
  return py::make_tuple(storage, offsets, shapes, strides, dtypes);
}

bool TargetRecord::same_layout(const TargetRecord& other) const {
  if (tensors_.size() != other.tensors_.size() || storages_.size() != other.storages_.size() ||
      dims_ != other.dims_ || first_tensor_ != other.first_tensor_ || live_ != other.live_) {
    return false;
  }
  for (size_t i = 0; i < tensors_.size(); ++i) {
    const TensorFacts &a = tensors_[i], &b = other.tensors_[i];
    if (a.storage != b.storage || a.dim != b.dim || a.dims_at != b.dims_at || a.offset != b.offset ||
        a.dtype != b.dtype) {
      return false;
    }
  }
  for (size_t j = 0; j < storages_.size(); ++j) {
    const StorageFacts &a = storages_[j], &b = other.storages_[j];
    if (a.recorded_nbytes != b.recorded_nbytes || a.device != b.device) return false;
  }
  return true;
}

bool TargetRecord::same_storages(const TargetRecord& other) const {
  if (storages_.size() != other.storages_.size()) return false;
  for (size_t j = 0; j < storages_.size(); ++j) {
    if (storages_[j].impl != other.storages_[j].impl) return false;
  }
  return true;
}

bool TargetRecord::same_views(py::handle list) const { return check_impl<false>(list, nullptr, /*memory=*/false); }

bool TargetRecord::check(py::handle list, bool bump) const {
  if (!bump) return check_impl<false>(list, nullptr);
  static_assert(sizeof(c10::VariableVersion) == sizeof(void*), "Counter::object reads VariableVersion's one pointer");
  // Each tensor's version counter, as the check reads its TensorImpl, for the bump once every tensor passed
  // (a check in parts: each part's, bumped by a thread of its own).
  std::vector<std::vector<Counter>> counters;
  if (!check_impl<false>(list, nullptr, /*memory=*/true, &counters)) return false;
  // Every TensorImpl is the one recorded, alive (its object in `list` holds it) and, the GIL held since the
  // check, still that object's, with the counter it had then. A counter is an object of its own
  // (VariableVersion's one intrusive_ptr) whose address the check read: each is asked for ahead, where a
  // bump through the TensorImpl waited for the TensorImpl's line and then the counter's, one tensor at a
  // time behind each locked increment (65536 tensors: the bump's share of check(bump=True) 0.68 -> 0.57 ms;
  // in a cached restore under perf, 13.3% -> 8.8% of the samples; the locked increments are most of the rest).
  // Views in two parts share a counter: the increment is atomic.
  const auto bump_part = [](const std::vector<Counter>& part) {
    const size_t n = part.size();
    constexpr size_t kCounterAhead = 16;
    for (size_t i = 0; i < n; ++i) {
      if (i + kCounterAhead < n) {
        __builtin_prefetch(part[i + kCounterAhead].version);  // (the pointer bump() reads again)
        __builtin_prefetch(part[i + kCounterAhead].object, 1);
      }
      part[i].version->bump();
    }
  };
  if (counters.size() == 1) {
    bump_part(counters[0]);
    return true;
  }
  // (bump() throws only for a counter-less tensor outside inference mode, which has none recorded here; a
  // part that threw anyway is bumped again on this thread, for torch's error.)
  std::vector<char> threw(counters.size(), 0);
  run_parts(static_cast<Py_ssize_t>(counters.size()), counters.size(), [&](size_t k, Py_ssize_t, Py_ssize_t) {
    try {
      bump_part(counters[k]);
    } catch (...) {
      threw[k] = 1;
    }
  });
  for (size_t k = 0; k < counters.size(); ++k) {
    if (threw[k]) bump_part(counters[k]);
  }
  return true;
}

py::object TargetRecord::check_held(py::handle list) const {
  auto held = std::make_unique<HeldStorages>();
  held->record_id = id_;
  held->refs.reserve(live_.size());
  if (!check_impl<true>(list, &held->refs)) return py::none();
  return py::cast(held.release(), py::return_value_policy::take_ownership);
}

void TargetRecord::set_check_parts(int threads, int64_t min_tensors_per_thread) {
  if (threads < 0 || threads > 64 || min_tensors_per_thread < 1) {
    throw py::value_error("check threads: 0 (as configured) to 64; at least 1 tensor per thread");
  }
  g_check_threads.store(threads, std::memory_order_relaxed);  // (0: read again from the environment)
  g_min_tensors_per_thread.store(min_tensors_per_thread, std::memory_order_relaxed);
}

py::tuple TargetRecord::check_parts() { return py::make_tuple(check_threads(), g_min_tensors_per_thread.load()); }

template <bool kHold>
bool TargetRecord::check_impl(py::handle list, std::vector<c10::intrusive_ptr<c10::StorageImpl>>* held, bool memory,
                              std::vector<std::vector<Counter>>* counters) const {
  if (!PyList_CheckExact(list.ptr())) return false;
  Items items = items_of(list);
  const Py_ssize_t n = items.size;
  if (n != static_cast<Py_ssize_t>(tensors_.size())) return false;
  const size_t parts = num_parts(n);
  if (parts > 1) {
    struct Part {
      Verdict verdict = Verdict::kUnsure;
      std::vector<c10::intrusive_ptr<c10::StorageImpl>> held;
      std::vector<Counter> counters;
    };
    std::vector<Part> out(parts);
    run_parts(n, parts, [&](size_t k, Py_ssize_t begin, Py_ssize_t end) {
      Part& p = out[k];
      try {
        if (counters != nullptr) p.counters.reserve(static_cast<size_t>(end - begin));
        p.verdict = check_range<kHold>(items, begin, end, memory, /*worker=*/true, &p.held,
                                       counters != nullptr ? &p.counters : nullptr);
      } catch (...) {  // (sizes() of a TensorImpl with a policy of its own may throw)
        p.verdict = Verdict::kUnsure;
      }
    });
    bool unsure = false;
    for (const Part& p : out) {
      if (p.verdict == Verdict::kChanged) return false;
      unsure = unsure || p.verdict == Verdict::kUnsure;
    }
    if (!unsure) {
      for (Part& p : out) {
        if constexpr (kHold) {
          held->insert(held->end(), std::make_move_iterator(p.held.begin()), std::make_move_iterator(p.held.end()));
        }
        if (counters != nullptr) counters->push_back(std::move(p.counters));
      }
      if constexpr (kHold) {
        if (held->size() != live_.size()) return false;  // (cannot differ: live_ is made the same way)
      }
      return true;
    }
    // Something only this thread may do (a copy-on-write storage to materialize, a TensorImpl whose sizes
    // are Python's): the whole pass again, here. (What the parts held is dropped with them.)
  }
  std::vector<Counter>* mine = nullptr;
  if (counters != nullptr) {
    counters->assign(1, {});
    mine = &counters->front();
    mine->reserve(static_cast<size_t>(n));
  }
  if (check_range<kHold>(items, 0, n, memory, /*worker=*/false, held, mine) != Verdict::kSame) return false;
  if constexpr (kHold) {
    if (held->size() != live_.size()) return false;  // (cannot differ: live_ is made the same way)
  }
  return true;
}

template <bool kHold>
TargetRecord::Verdict TargetRecord::check_range(const Items& items, Py_ssize_t begin, Py_ssize_t end, bool memory,
                                                bool worker,
                                                std::vector<c10::intrusive_ptr<c10::StorageImpl>>* held,
                                                std::vector<Counter>* counters) const {
  const Py_ssize_t n = items.size;
  const int64_t* dims = dims_.data();
  for (Py_ssize_t i = begin; i < end; ++i) {
    // (All of the TensorImpl ahead: storage, sizes and strides, offset, dtype and key set span three lines.)
    c10::TensorImpl* ahead = prefetch_tensor(item_or_null(items, i + 2 * kAhead), item_or_null(items, i + kAhead));
    if (ahead != nullptr) prefetch_whole<c10::TensorImpl>(ahead);
    if (i + kAhead < n) {
      const TensorFacts& next = tensors_[static_cast<size_t>(i + kAhead)];
      // (The recorded storage, all its lines: the check reads its size and flags past the first.)
      if (next.first) prefetch_whole<c10::StorageImpl>(storages_[static_cast<size_t>(next.storage)].impl);
    }
    const TensorFacts& t = tensors_[static_cast<size_t>(i)];
    PyObject* obj = items.data[i];
    // The same object of the same exact type (so it is a THPVariable), with the same TensorImpl (swap_tensors
    // exchanges them) ...
    if (obj != t.obj || Py_TYPE(obj) != t.type) return Verdict::kChanged;
    c10::TensorImpl* impl = THPVariable_Unpack(obj).unsafeGetTensorImpl();
    if (impl != t.impl || !impl->has_storage() || impl->has_symbolic_sizes_strides()) return Verdict::kChanged;
    // (A TensorImpl that dispatches to Python may answer its sizes through Python: not without the GIL.)
    if (worker && impl->is_python_dispatch()) return Verdict::kUnsure;
    // `.data = t.conj()` keeps the TensorImpl, storage and view but sets a conjugate (or negative) bit,
    // which bind() refuses.
    if (impl->is_conj() || impl->is_neg()) return Verdict::kChanged;
    // ... on the same storage, viewing it the same way (`.data =`, set_(), t_(), resize_(), as_strided_()
    // change these in place).
    c10::StorageImpl* storage = impl->unsafe_storage().unsafeGetStorageImpl();
    const StorageFacts& s = storages_[static_cast<size_t>(t.storage)];
    if (storage != s.impl) return Verdict::kChanged;
    if (impl->storage_offset() != t.offset || impl->dtype() != caffe2::TypeMeta::fromScalarType(t.dtype) ||
        impl->dim() != t.dim) {
      return Verdict::kChanged;
    }
    if (counters != nullptr && !t.inference) {
      // (An inference tensor has no counter, and bump_version() skips it: so does the bump.)
      auto& version = const_cast<c10::VariableVersion&>(impl->version_counter());
      counters->push_back({&version, *reinterpret_cast<void* const*>(&version)});
    }
    c10::IntArrayRef sizes = impl->sizes(), strides = impl->strides();
    const int64_t* rec = dims + t.dims_at;
    for (int32_t d = 0; d < t.dim; ++d) {
      if (sizes[d] != rec[d] || strides[d] != rec[t.dim + d]) return Verdict::kChanged;
    }
    // The storage, with its first tensor (so alive: this tensor is on it): same memory, same size (a
    // storage resized, or released and re-allocated, keeps its StorageImpl), same device, still resizable.
    if (t.first && memory) {
      // (Materializing a copy-on-write storage allocates and copies: this thread's work, not a part's.)
      if (worker && must_materialize(storage)) return Verdict::kUnsure;
      if (data_of(storage) != s.data || storage->nbytes() != s.nbytes || storage->device() != s.device ||
          regrowable(storage) != s.resizable) {
        return Verdict::kChanged;
      }
      // A live storage (live_ lists them in the order of their first tensors), while its line is at hand.
      if constexpr (kHold) {
        if (s.recorded_nbytes != 0) held->push_back(c10::intrusive_ptr<c10::StorageImpl>::reclaim_copy(storage));
      }
    }
  }
  return Verdict::kSame;
}

bool TargetRecord::refresh(py::handle list) {
  if (!PyList_CheckExact(list.ptr())) return false;
  Items items = items_of(list);
  if (items.size != static_cast<Py_ssize_t>(tensors_.size())) return false;
  for (size_t j = 0; j < storages_.size(); ++j) {
    PyObject* obj = items.data[first_tensor_[j]];
    const TensorFacts& t = tensors_[static_cast<size_t>(first_tensor_[j])];
    if (obj != t.obj || Py_TYPE(obj) != t.type) return false;
    c10::TensorImpl* impl = THPVariable_Unpack(obj).unsafeGetTensorImpl();
    if (impl != t.impl || !impl->has_storage()) return false;
    if (impl->unsafe_storage().unsafeGetStorageImpl() != storages_[j].impl) return false;
  }
  for (StorageFacts& s : storages_) {
    s.data = data_of(s.impl);
    s.nbytes = s.impl->nbytes();
    s.device = s.impl->device();
    s.resizable = regrowable(s.impl);
  }
  summarize();
  return true;
}

py::list TargetRecord::keys() const {
  py::list out(storages_.size());
  for (size_t j = 0; j < storages_.size(); ++j) {
    out[j] = py::reinterpret_steal<py::object>(PyLong_FromVoidPtr(storages_[j].impl));
  }
  return out;
}

py::list TargetRecord::storage_nbytes() const {
  py::list out(storages_.size());
  for (size_t j = 0; j < storages_.size(); ++j) out[j] = py::int_(storages_[j].nbytes);
  return out;
}

py::list TargetRecord::storage_data_ptrs() const {
  py::list out(storages_.size());
  for (size_t j = 0; j < storages_.size(); ++j) {
    out[j] = py::int_(reinterpret_cast<uintptr_t>(storages_[j].data));
  }
  return out;
}

py::bytes TargetRecord::storage_data_ptrs_bytes() const {
  // Written into the bytes object itself (no intermediate copy: a target may have many storages).
  const size_t n = storages_.size();
  PyObject* out = PyBytes_FromStringAndSize(nullptr, static_cast<Py_ssize_t>(n * sizeof(uint64_t)));
  if (out == nullptr) throw py::error_already_set();
  char* at = PyBytes_AS_STRING(out);
  for (size_t j = 0; j < n; ++j) {
    const uint64_t p = reinterpret_cast<uintptr_t>(storages_[j].data);
    std::memcpy(at + j * sizeof(uint64_t), &p, sizeof(p));
  }
  return py::reinterpret_steal<py::bytes>(out);
}

bool TargetRecord::all_sized_have_memory() const {
  for (const StorageFacts& s : storages_) {
    if (s.nbytes != 0 && s.data == nullptr) return false;
  }
  return true;
}

py::list TargetRecord::first_tensor() const {
  py::list out(first_tensor_.size());
  for (size_t j = 0; j < first_tensor_.size(); ++j) out[j] = py::int_(first_tensor_[j]);
  return out;
}

void TargetRecord::summarize() {
  // (Read on every offload: kept, not looped over each time. Resizability is re-read by refresh() and
  // compared by check().)
  all_resizable_ = true;
  for (const StorageFacts& s : storages_) all_resizable_ = all_resizable_ && s.resizable;
}

std::vector<c10::StorageImpl*> TargetRecord::live_storages(py::handle list) const {
  // Reached through the caller's tensors, not followed from the record: between the caller's check and
  // this call another thread may have moved a tensor to another storage and freed the recorded one.
  Items items = items_of(list);
  if (items.size != static_cast<Py_ssize_t>(tensors_.size())) {
    throw py::value_error("the target's tensors changed since it was checked");
  }
  std::vector<c10::StorageImpl*> out;
  out.reserve(live_.size());
  const size_t n = live_.size();
  auto first_of = [&](size_t k) -> PyObject* {
    return k < n ? items.data[first_tensor_[static_cast<size_t>(live_[k])]] : nullptr;
  };
  for (size_t k = 0; k < n; ++k) {
    prefetch_tensor(first_of(k + 2 * kAhead), first_of(k + kAhead));
    const int32_t j = live_[k];
    const int32_t i = first_tensor_[static_cast<size_t>(j)];
    PyObject* obj = items.data[i];
    const TensorFacts& t = tensors_[static_cast<size_t>(i)];
    if (obj != t.obj || Py_TYPE(obj) != t.type) throw py::value_error("the target's tensors changed since it was checked");
    c10::TensorImpl* impl = THPVariable_Unpack(obj).unsafeGetTensorImpl();
    if (impl != t.impl || !impl->has_storage() ||
        impl->unsafe_storage().unsafeGetStorageImpl() != storages_[static_cast<size_t>(j)].impl) {
      throw py::value_error("the target's tensors changed since it was checked");
    }
    out.push_back(storages_[static_cast<size_t>(j)].impl);
  }
  return out;
}

HeldStorages* TargetRecord::usable_held(py::handle held, size_t from) const {
  if (held.is_none() || !py::isinstance<HeldStorages>(held)) return nullptr;
  HeldStorages* h = held.cast<HeldStorages*>();
  return h->record_id == id_ && !h->spent && h->refs.size() == live_.size() && h->next == from ? h : nullptr;
}

std::vector<c10::StorageImpl*> TargetRecord::live_storages(py::handle list, HeldStorages* held) const {
  if (held == nullptr) return live_storages(list);
  std::vector<c10::StorageImpl*> out;
  out.reserve(held->refs.size());
  for (const auto& ref : held->refs) out.push_back(ref.get());
  return out;
}

void TargetRecord::set_refusals(py::list messages) {
  if (messages.size() != live_.size()) {
    throw py::value_error("set_refusals: " + std::to_string(messages.size()) + " messages for " +
                          std::to_string(live_.size()) + " live storages");
  }
  std::vector<std::string> parked;
  parked.reserve(messages.size());
  PyObject** items = reinterpret_cast<PyListObject*>(messages.ptr())->ob_item;
  for (size_t k = 0; k < messages.size(); ++k) {
    if (!PyUnicode_Check(items[k])) {
      throw py::type_error("set_refusals: message " + std::to_string(k) + " is not a str");  // (nothing set)
    }
    Py_ssize_t size = 0;
    const char* utf8 = PyUnicode_AsUTF8AndSize(items[k], &size);  // (an ASCII str's own bytes)
    if (utf8 == nullptr) throw py::error_already_set();
    parked.emplace_back(utf8, static_cast<size_t>(size));
  }
  messages_ = std::move(messages);
  parked_ = std::move(parked);
}

int64_t num_cpu_blocks() { return g_num_blocks.load(std::memory_order_relaxed); }

void TargetRecord::resize_live(py::handle list, bool release, bool refuse, py::handle held, int64_t begin,
                               int64_t end) {
  if (refuse && parked_.size() != live_.size()) throw py::value_error("resize_live: no refusals set");
  const int64_t num_live = static_cast<int64_t>(live_.size());
  if (end < 0) end = num_live;
  if (begin < 0 || begin > end || end > num_live) {
    throw py::value_error("resize_live: the part [" + std::to_string(begin) + ", " + std::to_string(end) +
                          ") is not within the " + std::to_string(num_live) + " live storages");
  }
  const size_t first = static_cast<size_t>(begin), last = static_cast<size_t>(end);
  HeldStorages* h = usable_held(held, first);
  // The held storages are read where they are held (no copy); without them, reached through the list.
  const std::vector<c10::StorageImpl*> reached = h != nullptr ? std::vector<c10::StorageImpl*>() : live_storages(list);
  for (size_t k = first; k < last; ++k) {
    // (The recorded device: these are the recorded storages, and a storage's device never changes. A CPU
    // storage is not read here, which would be a miss per storage before the resize's own.)
    const StorageFacts& facts = storages_[static_cast<size_t>(live_[k])];
    if (!one_pass_device(facts.device)) throw py::value_error("resize_live: CPU and CUDA storages only");
    const size_t want = facts.recorded_nbytes;
    c10::StorageImpl* impl = h != nullptr ? h->refs[k].get() : reached[k];
    if (!release && !facts.device.is_cpu() && !resizes_empty(impl, want)) {
      throw py::value_error("resize_live: a CUDA storage holds " + std::to_string(impl->nbytes()) +
                            " bytes, neither 0 nor its " + std::to_string(want));
    }
  }
  // What UntypedStorage.resize_ does (torch/csrc/StorageMethods.cpp; see resize_empty). Stops at the first
  // failure (a RuntimeError: out of memory) with the earlier storages resized: the caller undoes by size,
  // as after a Python loop. The record follows each storage as it is resized (what refresh() would read),
  // so it is exact even after a failure.
  try {
    resize_each(reached, release, refuse, h, first, last);
  } catch (const c10::OutOfMemoryError& e) {
    // torch.OutOfMemoryError, as UntypedStorage.resize_ raises it (swap() falls back on it), not pybind11's
    // RuntimeError.
    PyErr_SetString(py::module_::import("torch").attr("OutOfMemoryError").ptr(), e.what_without_backtrace());
    throw py::error_already_set();
  }
}

void TargetRecord::resize_each(const std::vector<c10::StorageImpl*>& reached, bool release, bool refuse,
                               HeldStorages* held, size_t begin, size_t end) {
  // Spent from here on, whatever happens: its references go one by one as their storages are resized (a
  // part that ends before the last storage gives it back for the next part, below).
  if (held != nullptr) held->spent = true;
  // (A held reference is reset once its storage is resized: those ahead are still there.)
  auto impl_at = [&](size_t k) { return held != nullptr ? held->refs[k].get() : reached[k]; };
  // Memory-bound for small storages: each StorageImpl is asked for 2 * kAhead ahead (all its lines: the
  // allocator, the access flags and the extra meta's pointer are past the first), then, kAhead ahead, what
  // the resize and the refusal touch beyond it: the extra meta a refusal writes and, for a CPU release, the
  // heap chunk's header that free() reads just before the memory.
  const size_t n = held != nullptr ? held->refs.size() : reached.size(), ahead = static_cast<size_t>(kAhead);
  // A reload's small CPU storages grow into shared blocks (BlockParts), allocated before any storage moves.
  std::optional<BlockParts> blocks;
  if (!release) {
    std::vector<size_t> want(n, 0);
    size_t eligible = 0;
    for (size_t k = begin; k < end; ++k) {
      const StorageFacts& facts = storages_[static_cast<size_t>(live_[k])];
      if (facts.device.is_cpu() && facts.resizable && facts.recorded_nbytes <= kBlockPartBytes) {
        want[k] = facts.recorded_nbytes;
        eligible += want[k] != 0;
      }
    }
    if (eligible > 1) blocks.emplace(want);
  }
  c10::Allocator* const cpu_allocator = blocks ? c10::GetCPUAllocator() : nullptr;
  for (size_t k = begin; k < end; ++k) {
    if (k + 2 * ahead < end) {
      prefetch_whole<c10::StorageImpl, 1>(impl_at(k + 2 * ahead));
    }
    if (k + ahead < end) {
      const StorageFacts& next = storages_[static_cast<size_t>(live_[k + ahead])];
      if (refuse) prefetch_refusal(impl_at(k + ahead));
      if (release && next.device.is_cpu() && next.data != nullptr) {
        __builtin_prefetch(static_cast<const char*>(next.data) - 2 * sizeof(size_t), 1);
      }
    }
    StorageFacts& facts = storages_[static_cast<size_t>(live_[k])];
    c10::StorageImpl* impl = impl_at(k);
    // A refused storage cannot be resized: the refusal is lifted first, and set again once released.
    if (refuse && !release) allow_access_moving(impl, parked_[k]);
    // (A part only where the storage is as its offload left it: empty, resizable, c10's CPU allocator's.)
    if (blocks && blocks->has(k) && impl->nbytes() == 0 && impl->resizable() && impl->allocator() == cpu_allocator) {
      impl->set_data_ptr_noswap(blocks->take(k, facts.device));
      impl->set_nbytes(facts.recorded_nbytes);
    } else {
      resize_empty(impl, release ? 0 : facts.recorded_nbytes);
    }
    facts.data = data_of(impl);
    facts.nbytes = impl->nbytes();
    if (refuse && release) {
      if (parked_[k].empty()) parked_[k] = messages_[k].cast<std::string>();
      refuse_access_moving(impl, parked_[k]);
    }
    // (The target's tensors hold it too: this only drops the check's reference, while its line is at hand.)
    if (held != nullptr) held->refs[k].reset();
  }
  if (held == nullptr) return;
  if (end < n) {
    held->next = end;  // (the storages from `end` on are still held, for the next part)
    held->spent = false;
  } else {
    held->refs.clear();  // (spent: num_held reads 0)
  }
}

py::object TargetRecord::watch_live(py::handle list, py::handle held) {
  const std::vector<c10::StorageImpl*> impls = live_storages(list, usable_held(held));
  if (watch_ && py::isinstance<StorageWatch>(watch_) && watch_.cast<StorageWatch*>()->rearm(impls)) return watch_;
  py::object made = py::cast(new StorageWatch(impls, /*rearmable=*/true), py::return_value_policy::take_ownership);
  watch_ = made;
  return made;
}

size_t TargetRecord::record_streams_live(py::handle list, py::handle held, py::dict streams) const {
  // The streams, by device index, all read and checked before the first record: a bad one records nothing.
  std::vector<std::optional<c10::Stream>> by_index;
  for (auto item : streams) {
    int64_t index = -1;
    std::tuple<int64_t, int64_t, int64_t> triple;  // (stream_id, device_index, device_type)
    try {
      index = item.first.cast<int64_t>();
      triple = item.second.cast<std::tuple<int64_t, int64_t, int64_t>>();
    } catch (const py::cast_error&) {
      throw py::type_error("record_streams_live: streams maps an int to a tuple of three ints; got " +
                           py::repr(item.first).cast<std::string>() + ": " + py::repr(item.second).cast<std::string>());
    }
    if (index < 0 || index >= 1024 || std::get<1>(triple) != index ||
        std::get<2>(triple) != static_cast<int64_t>(c10::DeviceType::CUDA)) {
      throw py::value_error("record_streams_live: streams maps a CUDA device index to that device's (stream_id, "
                            "device_index, device_type) of a CUDA stream; got " + py::repr(item.first).cast<std::string>() +
                            ": " + py::repr(item.second).cast<std::string>());
    }
    if (by_index.size() <= static_cast<size_t>(index)) by_index.resize(static_cast<size_t>(index) + 1);
    by_index[static_cast<size_t>(index)] = c10::Stream::unpack3(std::get<0>(triple), static_cast<c10::DeviceIndex>(index),
                                                              c10::DeviceType::CUDA);
  }
  bool any_cuda = false;
  for (const int32_t j : live_) {
    const c10::Device& device = storages_[static_cast<size_t>(j)].device;
    if (!device.is_cuda()) continue;
    any_cuda = true;
    const auto index = static_cast<size_t>(device.index());
    if (index >= by_index.size() || !by_index[index]) {
      throw py::value_error("record_streams_live: no stream given for cuda:" + std::to_string(device.index()));
    }
  }
  if (!any_cuda) return 0;  // (nothing to tell: CPU memory has no streams)
  // The storages checked (held), else reached through the tensors and checked to be the recorded ones.
  const std::vector<c10::StorageImpl*> impls = live_storages(list, usable_held(held));
  // Tensor.record_stream's own way (record_stream_cuda -> the caching allocator's recordStream), through
  // c10's device-guard registry, which torch's CUDA library fills: no libtorch_cuda linked here.
  const c10::impl::DeviceGuardImplInterface* guard = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
  size_t num_recorded = 0;
  const size_t n = impls.size(), ahead = static_cast<size_t>(kAhead);
  for (size_t k = 0; k < n; ++k) {
    if (k + ahead < n) __builtin_prefetch(impls[k + ahead]);  // (memory-bound: each StorageImpl scattered)
    const StorageFacts& facts = storages_[static_cast<size_t>(live_[k])];
    if (!facts.device.is_cuda()) continue;
    // The pointer only: a storage refusing access is still the allocator's block (none is refused here).
    const at::DataPtr& data = impls[k]->_mutable_data_ptr_no_checks();
    if (data.get() == nullptr) continue;  // no block (record_stream skips it too)
    guard->recordDataPtrOnStream(data, *by_index[static_cast<size_t>(facts.device.index())]);
    ++num_recorded;
  }
  return num_recorded;
}

bool TargetRecord::covers(size_t i, size_t nbytes) const {
  const TensorFacts& t = tensors_[i];
  if (t.offset != 0) return false;
  const int64_t* sizes = dims_.data() + t.dims_at;
  const int64_t* strides = sizes + t.dim;
  int64_t numel = 1, expected = 1;
  for (int32_t d = t.dim - 1; d >= 0; --d) {
    if (sizes[d] != 1 && strides[d] != expected) return false;
    expected *= sizes[d];
    numel *= sizes[d];
  }
  return static_cast<size_t>(numel) * c10::elementSize(t.dtype) == nbytes;
}

py::object TargetRecord::zero_live(py::handle list, py::handle held) {
  const std::vector<c10::StorageImpl*> impls = live_storages(list, usable_held(held));
  Items items = items_of(list);
  if (items.size != static_cast<Py_ssize_t>(tensors_.size())) {
    throw py::value_error("the target's tensors changed since it was checked");
  }
  // The CUDA ones first, all of them, before any CPU storage is written: each storage's first tensor, which
  // must still be the recorded one on this storage and view all of it, or nothing is zeroed here.
  py::list cuda;
  for (size_t k = 0; k < impls.size(); ++k) {
    const StorageFacts& facts = storages_[static_cast<size_t>(live_[k])];
    if (facts.device.is_cpu()) continue;
    const size_t i = static_cast<size_t>(first_tensor_[static_cast<size_t>(live_[k])]);
    PyObject* obj = items.data[i];
    const TensorFacts& t = tensors_[i];
    if (obj != t.obj || Py_TYPE(obj) != t.type) return py::none();
    c10::TensorImpl* impl = THPVariable_Unpack(obj).unsafeGetTensorImpl();
    if (impl != t.impl || !impl->has_storage() || impl->unsafe_storage().unsafeGetStorageImpl() != impls[k] ||
        impl->storage_offset() != t.offset || !covers(i, impls[k]->nbytes())) {
      return py::none();
    }
    cuda.append(py::reinterpret_borrow<py::object>(obj));
  }
  for (size_t k = 0; k < impls.size(); ++k) {
    if (!storages_[static_cast<size_t>(live_[k])].device.is_cpu()) continue;
    void* data = data_of(impls[k]);
    if (data != nullptr) std::memset(data, 0, impls[k]->nbytes());
  }
  return std::move(cuda);
}

py::list TargetRecord::live() const {
  py::list out(live_.size());
  for (size_t k = 0; k < live_.size(); ++k) {
    const size_t j = static_cast<size_t>(live_[k]);
    out[k] = py::make_tuple(first_tensor_[j], storages_[j].recorded_nbytes);
  }
  return out;
}

// -- batched storage operations ---------------------------------------------------------------------------

void resize_storages(py::handle storages, const std::vector<int64_t>& nbytes, bool through_allocator) {
  std::vector<c10::StorageImpl*> impls = storages_of(storages.ptr(), /*keys_allowed=*/false);
  if (impls.size() != nbytes.size()) throw py::value_error("resize_storages: one size per storage");
  for (size_t i = 0; i < impls.size(); ++i) {
    if (!impls[i]->device().is_cpu()) throw py::value_error("resize_storages: CPU storages only");
    if (nbytes[i] < 0) throw py::value_error("resize_storages: negative size");
    if (through_allocator && !resizes_empty(impls[i], static_cast<size_t>(nbytes[i]))) {
      throw py::value_error("resize_storages: through the allocator, a storage grows only from 0 bytes");
    }
  }
  for (size_t i = 0; i < impls.size(); ++i) resize_empty(impls[i], static_cast<size_t>(nbytes[i]), through_allocator);
}

StorageWatch::StorageWatch(py::handle storages)
    : StorageWatch(storages_of(storages.ptr(), /*keys_allowed=*/false)) {}

StorageWatch::StorageWatch(const std::vector<c10::StorageImpl*>& impls, bool rearmable) : rearmable_(rearmable) {
  refs_.reserve(impls.size());
  const size_t n = impls.size();
  for (size_t i = 0; i < n; ++i) {
    if (i + 8 < n) __builtin_prefetch(impls[i + 8], 1);
    // One weak reference taken directly (the caller holds the storage, so it is alive).
    c10::raw::weak_intrusive_ptr::incref(impls[i]);
    refs_.push_back(c10::weak_intrusive_ptr<c10::StorageImpl>::reclaim(impls[i]));
  }
  watched_.assign(refs_.size(), 1);
  num_watched_ = num_refs_ = refs_.size();
}

bool StorageWatch::rearm(const std::vector<c10::StorageImpl*>& impls) {
  if (!rearmable_ || num_watched_ != 0 || num_refs_ != refs_.size() || impls.size() != refs_.size()) return false;
  // (Two arrays of addresses, read in order: no storage is touched.)
  for (size_t i = 0; i < impls.size(); ++i) {
    if (refs_[i]._unsafe_get_target() != impls[i]) return false;
  }
  watched_.assign(refs_.size(), 1);
  num_watched_ = refs_.size();
  return true;
}

std::vector<int64_t> StorageWatch::dead() {
  std::vector<int64_t> out;
  if (num_watched_ == 0) return out;
  for (size_t i = 0; i < refs_.size(); ++i) {
    // (A watched storage's memory is alive: the weak reference keeps it. Its refcount is what expired() reads.)
    if (i + 8 < refs_.size() && watched_[i + 8]) __builtin_prefetch(refs_[i + 8]._unsafe_get_target());
    if (watched_[i] && refs_[i].expired()) {
      out.push_back(static_cast<int64_t>(i));
      watched_[i] = 0;
      refs_[i].reset();  // the StorageImpl's memory goes (a weak reference keeps it, not its data)
      --num_watched_;
      --num_refs_;
    }
  }
  return out;
}

void StorageWatch::forget(const std::vector<int64_t>& positions) {
  for (int64_t p : positions) {
    if (p < 0 || static_cast<size_t>(p) >= refs_.size()) throw py::index_error("StorageWatch.forget");
    if (watched_[static_cast<size_t>(p)]) {
      watched_[static_cast<size_t>(p)] = 0;
      refs_[static_cast<size_t>(p)].reset();
      --num_watched_;
      --num_refs_;
    }
  }
}

void StorageWatch::forget_all() {
  if (rearmable_) {
    // The weak references stay, for rearm(): they keep only the StorageImpls' objects, not their memory,
    // and go with the watch (or one at a time, at the death or forget of its position).
    std::fill(watched_.begin(), watched_.end(), 0);
    num_watched_ = 0;
    return;
  }
  for (size_t i = 0; i < refs_.size(); ++i) {
    if (i + 8 < refs_.size()) __builtin_prefetch(refs_[i + 8]._unsafe_get_target(), 1);  // (its weak count)
    watched_[i] = 0;
    refs_[i].reset();
  }
  num_watched_ = num_refs_ = 0;
}

// -- a flat mapping's items --------------------------------------------------------------------------------
py::object plain_items(py::handle mapping, py::handle names) {
  // (keys, values) of a dict whose keys are all str and values all plain tensors, in iteration order; None
  // otherwise (the caller's general path decides). An exact dict only: an OrderedDict's order is its own
  // linked list, not the table PyDict_Next walks.
  // `names`: the keys list of an earlier call (or None). Where the dict's keys are those very objects, in
  // order, it is answered as the keys (the same list): no key is touched, and a plan that kept the list
  // finds its names by identity.
  if (!PyDict_CheckExact(mapping.ptr())) return py::none();
  PyObject* d = mapping.ptr();
  const Py_ssize_t n = PyDict_GET_SIZE(d);
  bool reuse = PyList_CheckExact(names.ptr()) && PyList_GET_SIZE(names.ptr()) == n;
  PyObject** known = reuse ? reinterpret_cast<PyListObject*>(names.ptr())->ob_item : nullptr;
  py::list values(n);
  py::list keys;  // made at the first key that is not the known one (at once without known keys)
  PyObject** kout = nullptr;
  auto make_keys = [&](Py_ssize_t filled) {
    keys = py::list(n);
    kout = reinterpret_cast<PyListObject*>(keys.ptr())->ob_item;
    for (Py_ssize_t j = 0; j < filled; ++j) {  // (the known ones so far are these very keys)
      Py_INCREF(known[j]);
      kout[j] = known[j];
    }
  };
  if (!reuse) make_keys(0);
  // One pass (nothing in it runs Python code: the dict cannot change under it). A slot left empty by an
  // early return is NULL, which the list's deallocation skips.
  Py_ssize_t pos = 0, i = 0;
  PyObject *k, *v;
  while (PyDict_Next(d, &pos, &k, &v)) {
    if (i >= n || !plain_tensor(v)) return py::none();
    if (reuse && k != known[i]) {
      reuse = false;
      make_keys(i);
    }
    if (!reuse) {
      if (!PyUnicode_CheckExact(k)) return py::none();
      Py_INCREF(k);
      kout[i] = k;
    }
    Py_INCREF(v);
    PyList_SET_ITEM(values.ptr(), i, v);
    ++i;
  }
  if (i != n) return py::none();
  if (reuse) return py::make_tuple(names, values);
  return py::make_tuple(keys, values);
}

// torch.autograd.graph.increment_version(tensors) in one pass (torch's own converts the list to a vector of
// Tensors first): every tensor's version counter bumped, inference tensors (which have none) skipped.
void bump_versions(py::handle list) {
  Items items = items_of(list);
  for (Py_ssize_t i = 0; i < items.size; ++i) {
    if (!is_tensor(items.data[i])) throw py::type_error("bump_versions: expected tensors");
  }
  for (Py_ssize_t i = 0; i < items.size; ++i) {
    prefetch_tensor</*kWrite=*/1>(item_or_null(items, i + 2 * kAhead), item_or_null(items, i + kAhead));
    const at::Tensor& t = THPVariable_Unpack(items.data[i]);
    if (!t.defined() || t.is_inference()) continue;
    t.unsafeGetTensorImpl()->bump_version();
  }
}

// The slot a wrapper subclass keeps its local tensor in (a DTensor's `_local_tensor`, declared in __slots__):
// its offset in the object, found through the class's member descriptor (what `t._local_tensor` reads), or
// -1 where the class has no such plain slot.
Py_ssize_t member_slot(PyTypeObject* type, PyObject* name) {
  PyObject* descr = _PyType_Lookup(type, name);  // borrowed
  if (descr == nullptr || Py_TYPE(descr) != &PyMemberDescr_Type) return -1;
  const PyMemberDef* member = reinterpret_cast<PyMemberDescrObject*>(descr)->d_member;
  if (member->type != T_OBJECT_EX && member->type != T_OBJECT) return -1;
  return member->offset;
}

Py_ssize_t local_tensor_slot(PyTypeObject* type) {
  static PyObject* name = PyUnicode_InternFromString("_local_tensor");  // (never freed: the interpreter's)
  return member_slot(type, name);
}

py::object wrapper_slots(py::handle names, py::handle tensors, const char* slot) {
  const Items keys = items_of(names), items = items_of(tensors);
  if (keys.size != items.size) throw py::value_error("wrapper_slots: names and tensors differ in length");
  py::str name(slot);
  PyUnicode_InternInPlace(&name.ptr());
  py::dict out;
  PyTypeObject* known = nullptr;  // (the last class's slot, found again only when the class changes)
  Py_ssize_t offset = -1;
  for (Py_ssize_t i = 0; i < items.size; ++i) {
    if (i + kAhead < items.size) __builtin_prefetch(items.data[i + kAhead]);
    PyObject* obj = items.data[i];
    if (plain_tensor(obj)) continue;
    if (Py_TYPE(obj) != known) {
      known = Py_TYPE(obj);
      offset = member_slot(known, name.ptr());
    }
    if (offset < 0) return py::none();  // (not a plain slot: hasattr and the read are the caller's)
    PyObject* value = *reinterpret_cast<PyObject**>(reinterpret_cast<char*>(obj) + offset);
    if (value == nullptr) continue;  // (unset: hasattr is False)
    if (PyDict_SetItem(out.ptr(), keys.data[i], value) != 0) throw py::error_already_set();
  }
  return std::move(out);
}

py::object local_tensors(py::handle list) {
  Items items = items_of(list);
  if (std::all_of(items.data, items.data + items.size, plain_tensor)) {
    return py::reinterpret_borrow<py::object>(list);  // (all plain: the list itself)
  }
  py::list out(items.size);
  PyObject** slots = reinterpret_cast<PyListObject*>(out.ptr())->ob_item;
  // (The last class's slot, found again only when the class changes: a target's wrappers share one.)
  PyTypeObject* known = nullptr;
  Py_ssize_t offset = -1;
  for (Py_ssize_t i = 0; i < items.size; ++i) {
    PyObject* obj = items.data[i];
    if (!plain_tensor(obj)) {
      if (!is_tensor(obj)) return py::none();
      if (Py_TYPE(obj) != known) {
        known = Py_TYPE(obj);
        offset = local_tensor_slot(known);
      }
      if (offset < 0) return py::none();
      obj = *reinterpret_cast<PyObject**>(reinterpret_cast<char*>(obj) + offset);
      if (obj == nullptr || !plain_tensor(obj)) return py::none();  // (unset, or itself a wrapper)
    }
    Py_INCREF(obj);
    slots[i] = obj;
  }
  return std::move(out);
}

py::bytes object_ids(py::handle list) {
  Items items = items_of(list);
  PyObject* out = PyBytes_FromStringAndSize(nullptr, items.size * static_cast<Py_ssize_t>(sizeof(uintptr_t)));
  if (out == nullptr) throw py::error_already_set();
  std::memcpy(PyBytes_AS_STRING(out), items.data, static_cast<size_t>(items.size) * sizeof(uintptr_t));
  return py::reinterpret_steal<py::bytes>(out);
}

py::object data_ptrs_or_zero(py::handle list) {
  Items items = items_of(list);
  py::list out(items.size);
  PyObject** slots = reinterpret_cast<PyListObject*>(out.ptr())->ob_item;
  for (Py_ssize_t i = 0; i < items.size; ++i) {
    if (i + kAhead < items.size) __builtin_prefetch(items.data[i + kAhead]);
    PyObject* obj = items.data[i];
    uintptr_t ptr = 0;
    if (THPVariable_CheckExact(obj)) {
      const c10::TensorImpl* impl = THPVariable_Unpack(obj).unsafeGetTensorImpl();
      if (!impl->has_storage() || impl->layout() != c10::kStrided) return py::none();
      // Tensor.data_ptr(): the storage's memory plus the offset, null for an empty tensor.
      const void* data = impl->unsafe_storage().unsafeGetStorageImpl()->_mutable_data_ptr_no_checks().get();
      if (data != nullptr && !impl->is_empty()) {
        ptr = reinterpret_cast<uintptr_t>(data) + impl->itemsize() * static_cast<uintptr_t>(impl->storage_offset());
      }
    } else if (THPStorage_Check(obj)) {
      ptr = reinterpret_cast<uintptr_t>(data_of(THPStorage_Unpack(obj).unsafeGetStorageImpl()));
    } else {
      return py::none();
    }
    PyObject* value = PyLong_FromSize_t(ptr);
    if (value == nullptr) throw py::error_already_set();
    slots[i] = value;
  }
  return std::move(out);
}

// Whether any of the first `count` objects of a list has the attribute `name`: hasattr, in one pass. CPython's
// optional lookup is what hasattr calls, without the AttributeError that a miss through the generic getattr
// would make and clear. A class's own __getattr__ or a property runs as it would under hasattr, and an error
// other than AttributeError propagates as hasattr's would; since such code may change the list, each item is
// read afresh and held across its lookup.
bool any_attribute(py::handle list, Py_ssize_t count, py::handle name) {
  if (!PyList_CheckExact(list.ptr())) throw py::type_error("any_attribute: expected a list");
  if (!PyUnicode_CheckExact(name.ptr())) throw py::type_error("any_attribute: name must be a str");
  py::str interned = py::reinterpret_borrow<py::str>(name);
  PyUnicode_InternInPlace(&interned.ptr());
  constexpr Py_ssize_t kObjectsAhead = 8;  // (each object's header and the words before it, its dict or values)
  for (Py_ssize_t i = 0; i < count && i < PyList_GET_SIZE(list.ptr()); ++i) {
    if (i + kObjectsAhead < PyList_GET_SIZE(list.ptr())) {
      const char* ahead = reinterpret_cast<const char*>(PyList_GET_ITEM(list.ptr(), i + kObjectsAhead));
      __builtin_prefetch(ahead);
      __builtin_prefetch(ahead - 32);
    }
    py::object obj = py::reinterpret_borrow<py::object>(PyList_GET_ITEM(list.ptr(), i));
    PyObject* value = nullptr;
#if PY_VERSION_HEX >= 0x030D0000
    const int found = PyObject_GetOptionalAttr(obj.ptr(), interned.ptr(), &value);
#else
    const int found = _PyObject_LookupAttr(obj.ptr(), interned.ptr(), &value);
#endif
    if (found < 0) throw py::error_already_set();
    Py_XDECREF(value);
    if (found > 0) return true;
  }
  return false;
}

// Whether any of the first `count` tensors has a .grad (a module's parameters: their grads join the target
// with include_grads=True).
bool any_grad(py::handle list, Py_ssize_t count) {
  Items items = items_of(list);
  if (count > items.size) count = items.size;
  const Items first{items.data, count};
  // One stage further ahead than the other passes: the autograd meta is a third object per tensor.
  for (Py_ssize_t i = 0; i < count; ++i) {
    prefetch_tensor(item_or_null(first, i + 3 * kAhead), item_or_null(first, i + 2 * kAhead));
    if (i + kAhead < count && is_tensor(items.data[i + kAhead])) {
      __builtin_prefetch(THPVariable_Unpack(items.data[i + kAhead]).unsafeGetTensorImpl()->autograd_meta());
    }
    if (!is_tensor(items.data[i])) return true;  // not for us to decide: the caller's general path
    // TensorImpl::grad(), not Tensor::grad(): the same tensor, without the non-leaf warning.
    if (THPVariable_Unpack(items.data[i]).unsafeGetTensorImpl()->grad().defined()) return true;
  }
  return false;
}

}  // namespace gpu_offload::torch_ext
