// Shared by the torch-aware helper's translation units that read torch's objects (py_objects.hpp: by all).
#pragma once

#include "py_objects.hpp"  // (first: Python.h, pybind11 and the standard headers both use)

#include <c10/core/Device.h>
#include <c10/core/StorageImpl.h>
#include <c10/util/intrusive_ptr.h>
#include <c10/util/typeid.h>
#include <torch/csrc/autograd/python_variable.h>

#include <stdexcept>

namespace c10 {
struct StorageImpl;
struct TensorImpl;
}  // namespace c10

namespace gpu_offload::torch_ext {

// THPVariable_Check without PyObject_IsInstance for a subclass's object: torch's check asks the metaclass's
// __instancecheck__ for anything but a plain Tensor or Parameter, a generic call that costs hundreds of ns (a
// DTensor's: the per-parameter passes over FSDP2 models spent most of their time in it). Decided by the
// type's MRO alone: an object whose type derives from torch.Tensor is a THPVariable; one that only claims
// to be a tensor through __instancecheck__ is not, and is refused, as unpacking it must be.
inline bool is_tensor(PyObject* obj) {
  return THPVariable_CheckExact(obj) ||
         (THPVariableClass != nullptr &&
          PyType_IsSubtype(Py_TYPE(obj), reinterpret_cast<PyTypeObject*>(THPVariableClass)));
}

// The StorageImpl behind a tensor, an UntypedStorage or a storage's _cdata (see torch_ext.cpp).
c10::StorageImpl* storage_of(PyObject* item);
// Every item of a sequence through storage_of, all resolved before the caller changes any storage (a bad
// item leaves every storage as it was). keys_allowed: a bare _cdata is accepted too (else a TypeError).
std::vector<c10::StorageImpl*> storages_of(PyObject* items, bool keys_allowed);

// One storage refusing data-pointer access with `message`, or lifted again (no-ops where this torch cannot
// lift a refusal: see kAccessGuard in torch_ext.cpp, which the Python side checks first).
void refuse_access_of(c10::StorageImpl* storage, const std::string& message);
void allow_access_of(c10::StorageImpl* storage);
// The same, moving the message into the storage (`message` is left empty) and, when lifting, back out of it
// into an empty `message` (where this torch gives the slot; a copy otherwise).
void refuse_access_moving(c10::StorageImpl* storage, std::string& message);
void allow_access_moving(c10::StorageImpl* storage, std::string& message);
// Asks for the line a refusal (or its lifting) of `storage` writes, its extra meta (made if absent, as the
// refusal would). A prefetch: the storage must be alive, nothing else changes.
void prefetch_refusal(c10::StorageImpl* storage);

// Not something the helper records (a subclass, a tensor without plain strided storage): the caller's
// pure-Python path handles it.
struct NotPlain : std::runtime_error {
  using std::runtime_error::runtime_error;
};

class StorageWatch;

// A record's live storages held (strong references) from the check that found them to be the recorded
// ones until the caller's resize and watch, which then need not reach them again through the tensors.
// Between the two the caller runs Python (copies, registry): another thread may move a tensor to another
// storage then, and the held one is what the checked state had (the offload is of the state as checked).
// A resize spends it (each reference goes as its storage is resized).
struct HeldStorages {
  uint64_t record_id;
  std::vector<c10::intrusive_ptr<c10::StorageImpl>> refs;
  bool spent = false;
  // The first live storage not yet resized: a resize in parts (resize_live's begin and end) goes on from
  // here, and only a HeldStorages still at 0 serves anything else.
  size_t next = 0;
};

// What a cached plan remembers about a target's tensors and storages (target.cpp).
class TargetRecord {
 public:
  explicit TargetRecord(py::handle list);  // throws NotPlain
  // storages.bind()'s pass for a list of plain tensors under distinct names: (record, then the layout's
  // storage columns: each storage's first tensor, size, device index (-1: CPU) and host offset; the host bytes,
  // and the first tensor reaching past its storage or -1), or None where the Python bind must decide (and
  // word the error).
  static py::object bind(py::handle names, py::handle tensors, int64_t large_alignment, int64_t small_alignment,
                         int64_t small_storage_bytes, bool names_distinct);
  // The tensors as recorded: (storage index, offset, shape, stride, dtype) lists (a layout's tensor columns,
  // made when someone reads them: they never change).
  py::tuple tensor_columns() const;
  // Whether `list` holds the same tensor objects, each on the same storage, viewing it the same way, and
  // each storage still has the same memory, size and device.
  // With `bump`, once every tensor passed, each one's version counter is bumped too, as an in-place write
  // does (torch.autograd.graph.increment_version): through the TensorImpls just found to be the list's, in
  // the same call (nothing else runs in between), without reading each tensor's object again.
  bool check(py::handle list, bool bump = false) const;
  // check() without the storages' memory and sizes: the same tensor objects on the same storages (StorageImpls),
  // viewing them the same way (shape, strides, offset, dtype), whatever their storages hold now.
  bool same_views(py::handle list) const;
  // Whether this record's tensors lay their storages out as `other`'s did when it was made: the same number
  // of tensors, each on the storage of the same index (so the same grouping and first tensors), with the
  // same offset, shape, strides and dtype; each storage of the same recorded size on the same device. What a
  // layout is made of besides the names: a record of new tensor objects that answers true has the other's
  // layout under the same names. Reads the records' facts only (`other`'s tensors and storages may be dead).
  bool same_layout(const TargetRecord& other) const;
  // Whether the two records were made of the same storages (StorageImpl addresses), in order: new tensor
  // objects viewing the storages another record's tensors viewed (a state_dict()'s detached ones). `other`'s
  // storages may be dead: an address then matches only if it was reused.
  bool same_storages(const TargetRecord& other) const;
  // The same check, holding the live storages for resize_live and watch_live: a HeldStorages, or None
  // where check() would answer false.
  py::object check_held(py::handle list) const;
  // Re-reads every storage's memory, size, device and resizability (after the caller resized them);
  // false (nothing read) when `list` is not the recorded tensors on the recorded storages.
  bool refresh(py::handle list);
  py::list keys() const;  // StorageImpl addresses, as storage._cdata
  py::list storage_nbytes() const;
  py::list storage_data_ptrs() const;
  py::bytes storage_data_ptrs_bytes() const;  // the same as native uint64s (for CopyPlan.with_device_ptrs)
  // Whether every storage that holds bytes has memory at an address (what storage_data_ptrs() would say).
  bool all_sized_have_memory() const;
  py::list first_tensor() const;
  // The live storages (those that held memory when recorded), in order, resized to 0 (release) or back
  // to their recorded sizes, or watched.
  // `held`: a HeldStorages of this record from check_held() on `list`. Its storages are the ones checked,
  // and they are the ones resized or watched, even if another thread has since moved a tensor (its
  // assignment then counts as coming after this call). Without `held` (None, spent, or another record's),
  // the storages are reached through `list` and checked to be the recorded ones: ValueError, nothing
  // changed, when a tensor moved to another storage since the last check.
  // With `refuse`, each storage also refuses access (release: after it is resized) or has the refusal
  // lifted (before it is resized back), in the same pass, with the messages of set_refusals().
  // begin, end: only the live storages [begin, end) (end -1: to the last), a part of a resize made in
  // order (a reload that enqueues each part's copies before it allocates the next); `held` serves the
  // parts while each begins where the last ended.
  void resize_live(py::handle list, bool release, bool refuse, py::handle held, int64_t begin = 0,
                   int64_t end = -1);
  // One message per live storage, kept for resize_live(..., refuse=true).
  void set_refusals(py::list messages);
  bool has_refusals() const { return !parked_.empty(); }
  py::list refusals() const { return messages_; }
  // A StorageWatch over the live storages. The record keeps the last one it made, and hands the same one out
  // again, re-armed, when it watches nothing now (its set was reloaded) and still has a weak reference to
  // each of these storages: the cycle then takes and drops no reference per storage.
  py::object watch_live(py::handle list, py::handle held);
  py::list live() const;  // (first tensor index, recorded nbytes) of each live storage
  // Zeroes the live storages that hold memory (gradients a drop released, grown again): the CPU ones here;
  // answers the tensors the caller zeroes with torch for the CUDA ones (each one's first tensor, which views
  // all of it), or None, nothing zeroed, where one of those does not (or the tensors changed).
  py::object zero_live(py::handle list, py::handle held);
  // Tensor.record_stream(streams[device]) for each live CUDA storage that holds memory (those `held`
  // holds, if given), in one pass: the caching allocator then hands none of their blocks out again, once
  // freed, before the work enqueued on that stream so far has finished. `streams`: {device index:
  // (stream_id, device_index, device_type)}, all checked before the first record. Returns how many.
  size_t record_streams_live(py::handle list, py::handle held, py::dict streams) const;
  bool all_resizable() const { return all_resizable_; }
  // The checks' threads: `threads` at most (0: GPU_OFFLOAD_NUM_THREADS, else the cores; at most 16), each with
  // `min_tensors_per_thread` tensors at least (fewer: fewer threads; one below twice that).
  static void set_check_parts(int threads, int64_t min_tensors_per_thread);
  static py::tuple check_parts();  // (threads, min_tensors_per_thread) as the next check reads them
  size_t num_tensors() const { return tensors_.size(); }
  size_t num_storages() const { return storages_.size(); }

 private:
  // (Trivially constructible, the dtype as its ScalarType: see UninitializedAllocator.)
  struct TensorFacts {
    PyObject* obj;  // compared, never followed
    PyTypeObject* type;
    c10::TensorImpl* impl;
    int32_t storage;
    bool first;  // the first tensor on its storage: the storage's facts are checked with it
    bool inference;  // an inference tensor (it has no version counter; fixed for a TensorImpl's life)
    c10::ScalarType dtype;
    int32_t dim;
    int32_t dims_at;  // sizes then strides in dims_
    int64_t offset;
  };
  static_assert(std::is_trivially_default_constructible_v<TensorFacts>, "see UninitializedAllocator");
  struct StorageFacts {
    c10::StorageImpl* impl;
    void* data;
    size_t nbytes;
    c10::Device device;
    bool resizable;  // regrowable(): resizable, with an allocator to grow it back from
    size_t recorded_nbytes;  // as recorded (refresh() leaves it)
  };
  // memory: also each storage's memory, size, device and resizability (check()); else only what views it.
  // A tensor's version counter as check() bumps it: the TensorImpl's member, and the object it points to.
  struct Counter {
    c10::VariableVersion* version;
    const void* object;  // (read while the check had the TensorImpl's line: only asked for ahead, never read)
  };
  // counters: where not nullptr, each checked tensor's Counter (none for an inference tensor), in order, in
  // one vector per part of the check.
  template <bool kHold>
  bool check_impl(py::handle list, std::vector<c10::intrusive_ptr<c10::StorageImpl>>* held, bool memory = true,
                  std::vector<std::vector<Counter>>* counters = nullptr) const;
  // check_impl's pass over tensors [begin, end). worker: on a thread of a check in parts (no GIL of its own):
  // kUnsure where only the calling thread may go on (see check_impl).
  enum class Verdict { kSame, kChanged, kUnsure };
  template <bool kHold>
  Verdict check_range(const Items& items, Py_ssize_t begin, Py_ssize_t end, bool memory, bool worker,
                      std::vector<c10::intrusive_ptr<c10::StorageImpl>>* held, std::vector<Counter>* counters) const;
  std::vector<c10::StorageImpl*> live_storages(py::handle list) const;
  // `held` when it is this record's unspent HeldStorages, all of whose storages it still holds (`from`: or
  // those from `from` on, a resize in parts going on), else nullptr.
  HeldStorages* usable_held(py::handle held, size_t from = 0) const;
  // The held storages (when not nullptr), else live_storages(list).
  std::vector<c10::StorageImpl*> live_storages(py::handle list, HeldStorages* held) const;
  void summarize();  // all_resizable_ from the storages' facts
  bool covers(size_t i, size_t nbytes) const;  // tensor i views exactly nbytes from its storage's start, contiguously
  // resize_live's pass over `held`'s storages where it is not nullptr, else over `reached`.
  // Over the live storages [begin, end) only.
  void resize_each(const std::vector<c10::StorageImpl*>& reached, bool release, bool refuse, HeldStorages* held,
                   size_t begin, size_t end);
  // A record of many tensors is made in parts on threads (record_in_parts), else on the calling thread
  // (record_here). false: the calling thread's record must be made (a part found what only it may read, or
  // what it refuses with a message).
  bool record_in_parts(const Items& items, size_t parts);
  void record_here(const Items& items);
  UninitializedVector<TensorFacts> tensors_;
  UninitializedVector<int64_t> dims_;
  std::vector<StorageFacts> storages_;
  std::vector<int32_t> first_tensor_;  // one tensor index per storage
  std::vector<int32_t> live_;  // the storages that held memory when recorded
  // The refusal messages, one per live storage, or none: as given (a str each), and parked here while the
  // storages do not hold them (moved in at a release, back out at the growth; an empty one is copied
  // again from messages_, where someone else's call lifted the refusal and its message went with it).
  py::list messages_;
  std::vector<std::string> parked_;
  bool all_resizable_ = true;
  uint64_t id_;  // (for HeldStorages: an address may be another record's later)
  py::object watch_;  // the last StorageWatch made by watch_live (None before)
};

// Weak references to storages: which of them died, without a Python object or callback per storage.
class StorageWatch {
 public:
  explicit StorageWatch(py::handle storages);  // tensors or UntypedStorages
  // `storages`: alive, held by the caller. `rearmable`: forget_all() keeps the weak references (a record's
  // watch, see rearm()).
  explicit StorageWatch(const std::vector<c10::StorageImpl*>& storages, bool rearmable = false);
  std::vector<int64_t> dead();  // positions that died since the last call (no longer watched)
  void forget(const std::vector<int64_t>& positions);
  void forget_all();
  // Watches every position again, if this watch is rearmable, watches nothing now, and still holds a weak
  // reference to each of `storages` (alive, held by the caller), in order; else false, nothing changed.
  // (A weak reference keeps its StorageImpl's object, so an address that matches is that storage.)
  bool rearm(const std::vector<c10::StorageImpl*>& storages);
  size_t num_watched() const { return num_watched_; }
  size_t size() const { return refs_.size(); }

 private:
  std::vector<c10::weak_intrusive_ptr<c10::StorageImpl>> refs_;
  std::vector<uint8_t> watched_;
  size_t num_watched_ = 0;
  bool rearmable_ = false;
  size_t num_refs_ = 0;  // positions whose weak reference is still held
};

void resize_storages(py::handle storages, const std::vector<int64_t>& nbytes, bool through_allocator);
// The shared blocks a reload's small CPU storages grow into (resize_live), alive now.
int64_t num_cpu_blocks();
py::object plain_items(py::handle mapping, py::handle names);
bool any_grad(py::handle list, Py_ssize_t count);
// Whether any of the first `count` tensors has an instance attribute `name` (what hasattr() finds for an
// object whose class neither has the name nor reads attributes its own way): True or False, or None where
// that cannot be told without Python code (the caller then asks hasattr()).
bool any_attribute(py::handle list, Py_ssize_t count, py::handle name);
// data_ptr() of each plain tensor or UntypedStorage of a list, 0 for one whose storage holds no memory (an
// offloaded one, which refuses access in Python), without a Python call or an exception per item; None where
// an item is anything else (the caller's Python loop decides).
py::object data_ptrs_or_zero(py::handle list);
void bump_versions(py::handle list);
// The tensors holding the data: each tensor subclass that keeps a plain tensor in a `_local_tensor` slot (a
// DTensor) replaced by it; the list itself where every item is a plain tensor; None where an item is
// anything else (the caller's Python path decides).
py::object local_tensors(py::handle list);
// {name: t.<slot>} of each tensor that is not a plain one and has the slot set ({n: t._spec for a DTensor}), read
// from the class's member slot; None where such a class keeps no plain slot of that name.
py::object wrapper_slots(py::handle names, py::handle tensors, const char* slot);
// The items' addresses (id()), as native words: two lists hold the same objects iff these are equal.
py::bytes object_ids(py::handle list);

// A plain nn.Module tree's traversal (module_tree.cpp).
class ModuleTree;
bool module_tree_supported();
// Whether module_tree.cpp's shared keys tables read this CPython's split dicts as laid out (probed once).
bool shared_keys_layout_ok();
// (tree, names, tensors, num_params) | None; None too where a module is an instance of a `refused` class.
// with_modules: (tree, names, tensors, num_params, paths, modules), the last two named_modules()' items.
py::object build_module_tree(py::handle root, py::handle module_type, py::tuple refused, bool with_modules);
bool check_module_tree(const ModuleTree& tree, py::handle root);
void bind_module_tree(py::module_& m);

// A torch.optim.Optimizer's state traversal (optimizer_tree.cpp).
class OptimizerTree;
bool optimizer_tree_supported();
py::object build_optimizer_tree(py::handle optimizer);  // (tree, names, tensors) | None
void bind_optimizer_tree(py::module_& m);

// (fsdp2_params.cpp) Per-parameter reads of FSDP2's FSDPParams, staged so that their cache misses overlap.
// Whether a combined str-keyed dict's entries are laid out as its reads of remembered entries assume (probed
// once, at import: the probe makes Python objects, which a pass must not).
bool combined_keys_layout_ok();
// Whether an instance's inline values are indexed as its class's shared keys' entries, as its reads of them
// assume (probed once, at import, on instances of a class the probe makes).
bool inline_values_layout_ok();
// [getattr(o, name) for o in objs] where each is a plain instance attribute (see PlainAttr there); else None.
py::object instance_attrs(py::handle objs, const char* name);
// set(map(id, a)) == set(map(id, b[:count_b])), without touching the objects.
bool same_object_sets(py::handle a, py::handle b, Py_ssize_t count_b);
// (list(dict(zip(map(type, modules), modules)).values()), [i for i, m in enumerate(modules) if
// issubclass(type(m), cls)]) of a list of modules: one of each class (the last), and which are instances of cls.
py::tuple module_kinds(py::handle modules, py::handle cls);
// fsdp2_shard_info's per-parameter part: (names, layout index of each, first parameter of each layout, padded
// shards) | None.
py::object fsdp2_layouts(py::handle fsdp_params, py::handle module_paths);
// fsdp2_layouts' == of two placements tuples: (equal, how many item pairs it compared without ==).
py::tuple placements_equal(py::handle a, py::handle b);
// Whether this build has torch's C++ placement classes (their headers), which placements_equal compares.
bool cpp_placements();

}  // namespace gpu_offload::torch_ext
