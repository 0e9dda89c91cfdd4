// Shared by all of the torch-aware helper's translation units, and all that the ones reading no torch object
// include (module_walk.cpp, optimizer_walk.cpp, json_text.cpp): torch's headers (torch_ext.hpp) bring in
// ATen, 26-37 s of compile per file, which those files do not need.
#pragma once

#include <Python.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <memory>
#include <new>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

// CPython's dict version tags (PEP 509: renewed by every change of a dict's contents), where they mean what
// the recorded traversals rely on: CPython 3.11 and 3.12 with the GIL (3.13 keeps inline values beside a
// materialized __dict__, 3.14 retires the tag). module_tree.cpp and optimizer_tree.cpp.
#if PY_VERSION_HEX >= 0x030B0000 && PY_VERSION_HEX < 0x030D0000 && !defined(Py_GIL_DISABLED)
#define GPU_OFFLOAD_DICT_VERSION_TAGS 1
#else
#define GPU_OFFLOAD_DICT_VERSION_TAGS 0
#endif

namespace gpu_offload::torch_ext {

namespace py = pybind11;

#if GPU_OFFLOAD_DICT_VERSION_TAGS
#if defined(__GNUC__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"  // ma_version_tag: deprecated in 3.12, still kept
#endif
inline uint64_t version_of(PyObject* dict) { return reinterpret_cast<PyDictObject*>(dict)->ma_version_tag; }
#if defined(__GNUC__)
#pragma GCC diagnostic pop
#endif

// CPython 3.11's and 3.12's PyDictKeysObject head and a str-keyed table's entry, as their pycore_dict.h declares
// them (3.13 adds a mutex under free threading and moves the values; the version gate above excludes it).
struct DictKeys {
  Py_ssize_t dk_refcnt;
  uint8_t dk_log2_size;
  uint8_t dk_log2_index_bytes;
  uint8_t dk_kind;  // 0: DICT_KEYS_GENERAL, 1: DICT_KEYS_UNICODE, 2: DICT_KEYS_SPLIT
  uint32_t dk_version;
  Py_ssize_t dk_usable;
  Py_ssize_t dk_nentries;
};
struct DictUnicodeEntry {
  PyObject* me_key;
  PyObject* me_value;  // (a combined table's; a split table keeps its values in the dict's ma_values)
};
constexpr uint8_t kDictKeysUnicode = 1;
constexpr uint8_t kDictKeysSplit = 2;

inline const DictKeys* keys_of(PyObject* dict) {
  return reinterpret_cast<const DictKeys*>(reinterpret_cast<PyDictObject*>(dict)->ma_keys);
}

// A str-keyed table's entries: after the head and its index table of 2**dk_log2_index_bytes bytes.
inline const DictUnicodeEntry* unicode_entries(const DictKeys* keys) {
  return reinterpret_cast<const DictUnicodeEntry*>(reinterpret_cast<const char*>(keys) + sizeof(DictKeys) +
                                                   (size_t{1} << keys->dk_log2_index_bytes));
}

// Whether a lookup of a str in this dict runs no Python code: every key an exact str. CPython keeps such a
// dict's keys as a "unicode" or "split" table and compares a str with them by their characters; a key of any
// other type (a str subclass too) makes the table "general", where a lookup calls the stored key's __eq__,
// which may change or free anything, the dict being read included.
inline bool str_keyed(PyObject* dict) { return keys_of(dict)->dk_kind != 0; }

// Where an object of a managed-dict class (CPython 3.11 and 3.12) keeps its attributes, read without making
// anything (CPython's own _PyObject_GetDictPtr makes a dict from inline values: an allocation): its
// materialized dict, or else its inline values (either may be nullptr; both for an object of another class).
// The words before the object, as pycore_object.h reads them: 3.11 keeps the dict at -3 and the values at -4;
// 3.12 either at -3, the values stored one byte before their (aligned) address, so that the low bit tells them
// from a dict (_PyDictOrValues_SetValues stores values - 1, _PyDictOrValues_GetValues reads it + 1).
struct Attributes {
  PyObject* dict = nullptr;
  const void* values = nullptr;
};
inline Attributes attributes_of(PyObject* o) {
  if (o == nullptr || !PyType_HasFeature(Py_TYPE(o), Py_TPFLAGS_MANAGED_DICT)) return {};
  const uintptr_t* words = reinterpret_cast<const uintptr_t*>(o);
#if PY_VERSION_HEX < 0x030C0000
  return {reinterpret_cast<PyObject*>(words[-3]), reinterpret_cast<const void*>(words[-4])};
#else
  const uintptr_t w = words[-3];
  if (w & 1) return {nullptr, reinterpret_cast<const void*>(w + 1)};
  return {reinterpret_cast<PyObject*>(w), nullptr};
#endif
}

// The keys every instance of a managed-dict class shares while its attributes are inline values (no dict made
// for it), or nullptr.
inline const DictKeys* cached_keys(PyTypeObject* type) {
  if (!PyType_HasFeature(type, Py_TPFLAGS_HEAPTYPE)) return nullptr;
  const DictKeys* keys = reinterpret_cast<const DictKeys*>(reinterpret_cast<PyHeapTypeObject*>(type)->ht_cached_keys);
  return keys != nullptr && keys->dk_kind == kDictKeysSplit ? keys : nullptr;
}
#endif

// A vector sized ahead for the most it could hold (its untouched pages cost nothing), cut down to what it holds
// where that is far less: records keep their vectors for the target's life.
template <typename Vector>
void shrink_if_slack(Vector& v) {
  if (v.capacity() > v.size() + v.size() / 2 + 64) v.shrink_to_fit();
}

// An allocator whose resize() writes nothing into elements of a trivially constructible type: a record's
// vectors are sized by the calling thread and filled by the threads of a record in parts, each one writing
// (and so faulting in) its own slice of fresh pages.
template <typename T>
struct UninitializedAllocator : std::allocator<T> {
  template <typename U>
  struct rebind {
    using other = UninitializedAllocator<U>;
  };
  UninitializedAllocator() = default;
  template <typename U>
  UninitializedAllocator(const UninitializedAllocator<U>&) noexcept {}
  template <typename U>
  void construct(U* p) noexcept(std::is_nothrow_default_constructible_v<U>) {
    ::new (static_cast<void*>(p)) U;  // (default-initialized: nothing written for a trivial U)
  }
  template <typename U, typename... Args>
  void construct(U* p, Args&&... args) {
    ::new (static_cast<void*>(p)) U(std::forward<Args>(args)...);
  }
};
template <typename T>
using UninitializedVector = std::vector<T, UninitializedAllocator<T>>;

// A Python list's items without a copy (the caller holds the list); a TypeError for anything but a list.
struct Items {
  PyObject** data;
  Py_ssize_t size;
};

inline Items items_of(py::handle list) {
  if (!PyList_CheckExact(list.ptr())) throw py::type_error("expected a list");
  return {reinterpret_cast<PyListObject*>(list.ptr())->ob_item, PyList_GET_SIZE(list.ptr())};
}

// A list of n new references made by make(i) (nullptr from make: the Python error stands).
template <typename F>
py::list new_list(size_t n, F&& make) {
  py::list out(n);
  for (size_t i = 0; i < n; ++i) {
    PyObject* item = make(i);
    if (item == nullptr) throw py::error_already_set();
    PyList_SET_ITEM(out.ptr(), static_cast<Py_ssize_t>(i), item);
  }
  return out;
}

// is_tensor (torch_ext.hpp), out of line for the files that include no torch header.
bool is_tensor_object(PyObject* obj);

// A plain module's traversal walked through CPython's public API, nothing recorded (module_walk.cpp): (names,
// tensors, num_params, names_distinct), the names `previous` itself where they are those; None where the
// traversal is not a plain one (or a name is not ASCII).
py::object walk_module(py::handle root, py::handle module_type, py::tuple refused, py::handle previous);
// A torch optimizer's state traversal walked the same way (optimizer_walk.cpp): (names, tensors), the names
// `previous` itself where they are those; None where build_optimizer_tree would refuse it (or a key is not ASCII).
py::object walk_optimizer(py::handle optimizer, py::handle previous);
// The walks' shared ends: a list of these ASCII names, `previous` itself where it holds exactly them (the
// strings of those it holds at the same place kept otherwise); a list taking the objects' references.
py::object names_list_of(const std::vector<std::string>& names, py::handle previous);
py::list list_of(std::vector<py::object>& items);

// (json_text.cpp)
// json.dumps(mapping, sort_keys=True)'s text where each value's JSON is text_of(value), asked once per distinct
// value (by identity); None unless every key is a str json.dumps writes as is (printable ASCII, no quote or
// backslash).
py::object json_object_of_texts(py::handle mapping, py::handle text_of);
// [f"{prefix}.{n}" for n in names[start:stop]] (a list); None where the prefix or a name is not an exact str.
py::object prefixed_names(py::handle prefix, py::handle names, Py_ssize_t start, Py_ssize_t stop);

}  // namespace gpu_offload::torch_ext
