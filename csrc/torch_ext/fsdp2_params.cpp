// Per-parameter reads of an FSDP2 model's FSDPParams (adapters/fsdp.py fsdp2_shard_info, adapters/__init__.py
// _record_fsdp2 and _recorded_fsdp2_shard_info), which a target's first snapshot asks once per parameter.
// They are memory-bound: an FSDPParam keeps 31 attributes in a dict table of its own, and each value read (its
// shapes, its sharding spec's placements, its module info's module and name, its padded shard's dtype) is
// another object, scattered. In Python a 65536-parameter model spent 1.3-1.5 us per parameter (111 ns with the
// same objects in cache). Here each parameter goes through stages a few parameters apart: its object's header,
// then its dict object, then the dict's table, then the values found in it (a lookup that takes no reference),
// are asked for (prefetched) before the read that takes references; then the objects those hold. A read then
// finds its lines in cache, and the misses of several parameters overlap. (An earlier try that prefetched the
// objects alone measured no faster than Python: every lookup missed in a different table, and taking a
// reference to a value is itself a miss.) fsdp2_shard_info of 65536 parameters: 175-225 ms in Python, 90-100
// here (the reads about 60 ms, the placements' == about 20). On a slower VM, with the placements' objects
// asked for ahead, comparing Shard pairs in C++ rather than through == took fsdp2_layouts from 117-183 ms
// to 97-156 (medians of 30 interleaved calls, in three runs: 15-21% less in each).
//
// Only plain attribute reads are made: an attribute read goes through PyObject_GenericGetAttr and only for a
// type that has no class attribute of that name (no descriptor, no __getattr__), so no Python code runs while
// the parameters are read. Anything else (a type with a property of that name, a value of an unexpected type)
// answers None and the caller's Python path reads it. The grouping of the layouts, after every read, compares
// placements with ==, which may run Python: everything it uses is then held (strong references) or copied.
#include <Python.h>
#include <pybind11/pybind11.h>

#include <c10/core/ScalarType.h>
#include <c10/core/TensorImpl.h>
#include <torch/csrc/autograd/python_variable.h>
#if __has_include(<torch/csrc/distributed/Placement.h>)
#include <torch/csrc/distributed/Placement.h>
#define GPU_OFFLOAD_CPP_PLACEMENTS 1
#else
#define GPU_OFFLOAD_CPP_PLACEMENTS 0
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <unordered_map>
#include <vector>

#include "torch_ext.hpp"

namespace py = pybind11;

namespace gpu_offload::torch_ext {

namespace {

// How many parameters apart the stages are (2, 4 and 8 measured alike on 65536 parameters).
constexpr Py_ssize_t kStage = 4;

// An owned reference (nullptr allowed: pybind11's object releases it at scope exit).
inline py::object owned(PyObject* o) { return py::reinterpret_steal<py::object>(o); }

// A Python object's header and the words before it (where CPython 3.11+ keeps an instance's dict or values
// pointer): what the next read of one of its attributes touches first.
inline void prefetch_object(PyObject* o) {
  if (o == nullptr) return;
  __builtin_prefetch(o);
  __builtin_prefetch(reinterpret_cast<const char*>(o) - 32);
}

#if GPU_OFFLOAD_DICT_VERSION_TAGS
// The lines an attribute read of `o` touches after its header: its dict's object (`keys`: and its table, where
// the dict object is already in cache) or its values.
inline void prefetch_attributes(PyObject* o, bool keys) {
  const Attributes a = attributes_of(o);
  if (a.values != nullptr) {
    __builtin_prefetch(a.values);
    __builtin_prefetch(static_cast<const char*>(a.values) + 64);
  }
  if (a.dict == nullptr) return;
  if (!keys) {
    __builtin_prefetch(a.dict);
    return;
  }
  if (Py_TYPE(a.dict) != &PyDict_Type) return;
  // (A table of up to 42 entries: its header, 64 index bytes and 24 bytes an entry, 18 lines.)
  const char* table = reinterpret_cast<const char*>(reinterpret_cast<PyDictObject*>(a.dict)->ma_keys);
  for (int line = 0; line < 18; ++line) __builtin_prefetch(table + 64 * line);
}
#endif

#if GPU_OFFLOAD_DICT_VERSION_TAGS
// The objects that the reads of these attributes of `o` will return, asked for: found in its materialized dict
// (whose table is in cache) without a reference taken (the read itself takes one, which is then no miss).
inline void prefetch_values(PyObject* o, PyObject* const* names, int count) {
  PyObject* dict = attributes_of(o).dict;
  if (dict == nullptr || Py_TYPE(dict) != &PyDict_Type || !str_keyed(dict)) return;
  for (int k = 0; k < count; ++k) {
    PyObject* value = PyDict_GetItemWithError(dict, names[k]);  // (a str-keyed table: no Python runs)
    if (value == nullptr) {
      PyErr_Clear();
      continue;
    }
    __builtin_prefetch(value);
    __builtin_prefetch(reinterpret_cast<const char*>(value) - 32);
  }
}
#endif

#if GPU_OFFLOAD_DICT_VERSION_TAGS
// Whether this CPython keeps an instance's inline values indexed as its class's shared keys' entries, as
// PlainAttr's reads of them assume: checked once, at the helper's import, on instances of a class made for it.
bool& inline_values_checked() {
  static bool ok = false;
  return ok;
}

// Whether this CPython keeps a combined str-keyed dict's entries as DictUnicodeEntry (key, value) after its
// index table, as PlainAttr's entry reads assume: checked once, at the helper's import, on a dict made for it.
bool& combined_layout_checked() {
  static bool ok = false;
  return ok;
}
#endif

// One attribute, by name, read as a plain instance attribute: new reference, or nullptr (no error set) where
// the object's type reads attributes another way (its own __getattribute__ or __getattr__, or a class attribute
// of that name, which could be a descriptor running Python) or the object has no such attribute. A type found
// plain is remembered (the parameters of a model share a few types).
//
// An FSDPParam keeps its 31 attributes in a dict table of its own (past the 30 a shared keys table holds), and
// every instance sets them in one order: each table has the attribute at the same entry. So the entry it was
// found at is remembered, and the next object's is read there directly where that entry holds this very key
// (identity: the interned name): no hashed lookup, and one line of the table read (instance_attrs of 65536
// FSDPParams: 9-14 -> 3-6 ms). Anything else reads through PyObject_GenericGetAttr, and learns the entry for
// the next object.
class PlainAttr {
 public:
  explicit PlainAttr(const char* name) : name_(owned(PyUnicode_InternFromString(name))) {
    if (!name_) throw py::error_already_set();
  }

  PyObject* name() const { return name_.ptr(); }

  PyObject* operator()(PyObject* obj) {
    PyTypeObject* type = Py_TYPE(obj);
    if (type != plain_type_) {
      if (type->tp_getattro != PyObject_GenericGetAttr || _PyType_Lookup(type, name_.ptr()) != nullptr) return nullptr;
      plain_type_ = type;
    }
    if (PyObject* found = at_entry(obj)) {
      Py_INCREF(found);
      return found;
    }
    PyObject* value = PyObject_GenericGetAttr(obj, name_.ptr());
    if (value == nullptr) {
      PyErr_Clear();  // (AttributeError: absent; the caller answers None)
      return nullptr;
    }
    learn(obj, value);
    return value;
  }

 private:
#if GPU_OFFLOAD_DICT_VERSION_TAGS
  // The materialized dict that holds the object's attributes (where no inline values are left), else nullptr.
  static PyObject* dict_of(PyObject* obj) {
    const Attributes a = attributes_of(obj);
    PyObject* dict = a.values == nullptr ? a.dict : nullptr;
    return dict != nullptr && Py_TYPE(dict) == &PyDict_Type ? dict : nullptr;
  }

  // The value at the remembered entry of the object's dict, or of its inline values, where that entry holds
  // this very name (borrowed), else nullptr. Only for an object whose type reads it as a plain instance
  // attribute: its dict or values decide then. (Inline values are indexed as the class's shared keys are,
  // as CPython's own read does: the entry of the name there, the value at that index, nullptr if deleted;
  // every instance's values array has room for every entry those keys can hold.)
  PyObject* at_entry(PyObject* obj) const {
    const Attributes a = attributes_of(obj);
    if (a.values != nullptr) {
      if (values_at_ < 0 || !inline_values_checked()) return nullptr;
      const DictKeys* keys = cached_keys(Py_TYPE(obj));
      if (keys == nullptr || values_at_ >= keys->dk_nentries || unicode_entries(keys)[values_at_].me_key != name_.ptr()) {
        return nullptr;
      }
      return static_cast<PyObject* const*>(a.values)[values_at_];
    }
    PyObject* dict = at_ >= 0 && a.dict != nullptr && Py_TYPE(a.dict) == &PyDict_Type ? a.dict : nullptr;
    if (dict == nullptr) return nullptr;
    const DictKeys* keys = keys_of(dict);
    if (keys->dk_kind != kDictKeysUnicode || at_ >= keys->dk_nentries) return nullptr;
    const DictUnicodeEntry& e = unicode_entries(keys)[at_];
    return e.me_key == name_.ptr() ? e.me_value : nullptr;  // (a deleted entry: key and value both null)
  }

  // Where `value` sits in the object's dict, remembered for the next object (none where not found there).
  void learn(PyObject* obj, PyObject* value) {
    const Attributes a = attributes_of(obj);
    if (a.values != nullptr) {
      values_at_ = -1;
      const DictKeys* keys = inline_values_checked() ? cached_keys(Py_TYPE(obj)) : nullptr;
      if (keys == nullptr) return;
      const DictUnicodeEntry* entries = unicode_entries(keys);
      for (Py_ssize_t i = 0; i < keys->dk_nentries; ++i) {
        if (entries[i].me_key == name_.ptr() && static_cast<PyObject* const*>(a.values)[i] == value) {
          values_at_ = i;
          return;
        }
      }
      return;
    }
    at_ = -1;
    PyObject* dict = combined_layout_checked() ? dict_of(obj) : nullptr;
    if (dict == nullptr || keys_of(dict)->dk_kind != kDictKeysUnicode) return;
    const DictKeys* keys = keys_of(dict);
    const DictUnicodeEntry* entries = unicode_entries(keys);
    for (Py_ssize_t i = 0; i < keys->dk_nentries; ++i) {
      if (entries[i].me_key == name_.ptr() && entries[i].me_value == value) {
        at_ = i;
        return;
      }
    }
  }
#else
  PyObject* at_entry(PyObject*) const { return nullptr; }
  void learn(PyObject*, PyObject*) {}
#endif

 public:
  // The value the next read of `obj` would find at a remembered entry (borrowed, no reference taken), else
  // nullptr: what a stage ahead of the read asks for, without a hashed lookup.
  PyObject* peek(PyObject* obj) const { return Py_TYPE(obj) == plain_type_ ? at_entry(obj) : nullptr; }

 private:

  py::object name_;
  PyTypeObject* plain_type_ = nullptr;
  Py_ssize_t at_ = -1;  // the entry the last object's dict held it at (-1: none known)
  Py_ssize_t values_at_ = -1;  // the index the last object's inline values held it at (-1: none known)
};

// A tuple of ints (a torch.Size) appended to `dims`; false where it is anything else.
bool append_dims(PyObject* size, std::vector<int64_t>& dims) {
  if (size == nullptr || !PyTuple_Check(size)) return false;
  const Py_ssize_t n = PyTuple_GET_SIZE(size);
  dims.push_back(n);
  for (Py_ssize_t d = 0; d < n; ++d) {
    PyObject* v = PyTuple_GET_ITEM(size, d);
    if (!PyLong_CheckExact(v)) return false;
    const long long x = PyLong_AsLongLong(v);
    if (x == -1 && PyErr_Occurred()) {
      PyErr_Clear();
      return false;
    }
    dims.push_back(x);
  }
  return true;
}

// The dtype of a plain tensor (torch.Tensor or nn.Parameter, not a subclass), or -1.
int scalar_type_of(PyObject* obj) {
  if (obj == nullptr || !THPVariable_CheckExact(obj)) return -1;
  return static_cast<int>(THPVariable_Unpack(obj).scalar_type());
}

// One parameter's reads: its name, its layout's dims (global shape then padded local shape, each as its
// length then its sizes, in a shared vector), its shard's dtype, and its placements (held).
struct Param {
  py::object name;
  size_t dims_at = 0, num_dims = 0;
  int dtype = -1;
  py::object placements;
};

// The FSDPParam-level objects of one parameter, read by the first stage and kept (held) for the second.
struct Fetched {
  py::object module_info, spec, orig, padded, shard, module, param_name;
};

// == of two parameters' placements (their sharding specs' tuples), as Python answers it, for the grouping of
// the layouts. Through the bound __eq__ each comparison of two Shard(0)s costs about 0.4 us (pybind11's
// dispatch), a fifth of fsdp2_layouts on 65536 parameters, every parameter having placements objects of its
// own, and most of that the misses on its scattered objects. Two items of the same class whose == is known to
// be its C++ class's (DTensor's Shard and Replicate, where no Python class defines __eq__ before torch's
// binding, torch's headers have the class and pybind11 hands over the C++ object) are compared here, their
// objects asked for a few parameters ahead; any other pair through ==.
class PlacementsEqual {
 public:
  PlacementsEqual() {
#if GPU_OFFLOAD_CPP_PLACEMENTS
    py::object types = owned(PyImport_GetModule(py::str("torch.distributed.tensor.placement_types").ptr()));
    if (!types) {
      PyErr_Clear();  // (not imported: no placements of its classes to compare)
      return;
    }
    shard_ = own_eq_type(types, "Shard");
    replicate_ = own_eq_type(types, "Replicate");
#endif
  }

  // 1, 0, or -1 with a Python error set (what PyObject_RichCompareBool answers).
  int operator()(PyObject* a, PyObject* b) {
    if (a == b) return 1;
    if (!PyTuple_CheckExact(a) || !PyTuple_CheckExact(b)) return PyObject_RichCompareBool(a, b, Py_EQ);
    const Py_ssize_t n = PyTuple_GET_SIZE(a);
    if (PyTuple_GET_SIZE(b) != n) return 0;
    for (Py_ssize_t k = 0; k < n; ++k) {  // (a tuple's ==: its items', in order, each as == answers it)
      PyObject* x = PyTuple_GET_ITEM(a, k);
      PyObject* y = PyTuple_GET_ITEM(b, k);
      if (x == y) continue;
      int eq = known(x, y);
      if (eq == kUnknown) eq = PyObject_RichCompareBool(x, y, Py_EQ);
      if (eq != 1) return eq;
    }
    return 1;
  }

  // Asks for the C++ object behind a placement this compares (a pybind11 instance's value, held apart).
  void prefetch(PyObject* item) const {
#if GPU_OFFLOAD_CPP_PLACEMENTS
    if (reinterpret_cast<PyObject*>(Py_TYPE(item)) != shard_.ptr()) return;
    const auto* instance = reinterpret_cast<const py::detail::instance*>(item);
    if (instance->simple_layout) __builtin_prefetch(instance->simple_value_holder[0]);
#else
    (void)item;
#endif
  }

  // How many item pairs were compared here rather than through == (the tests see the path taken).
  size_t num_known() const { return num_known_; }

 private:
  static constexpr int kUnknown = -2;

  int known(PyObject* x, PyObject* y) {
    PyTypeObject* type = Py_TYPE(x);
    if (type != Py_TYPE(y)) return kUnknown;
    // (Replicate needs no header of torch's, but only where torch has the C++ placements is the base that
    // first defines its __eq__ known to be torch's binding: hence both inside the gate.)
    if (reinterpret_cast<PyObject*>(type) == replicate_.ptr()) {
      ++num_known_;
      return 1;  // (a Replicate holds nothing: all are equal)
    }
#if GPU_OFFLOAD_CPP_PLACEMENTS
    if (reinterpret_cast<PyObject*>(type) == shard_.ptr()) {
      py::detail::make_caster<torch::distributed::Shard> cx, cy;
      if (!cx.load(x, false) || !cy.load(y, false) || cx.value == nullptr || cy.value == nullptr) {
        shard_ = py::object();  // (pybind11 does not hand it over here: == from now on)
        return kUnknown;
      }
      ++num_known_;
      return *static_cast<const torch::distributed::Shard*>(cx.value) ==
             *static_cast<const torch::distributed::Shard*>(cy.value);
    }
#endif
    return kUnknown;
  }

  // The module's class of that name, where the first class along its MRO that defines __eq__ is its own base
  // (the C++ class, bound by torch: == compares as the C++ operator== does); else none.
  static py::object own_eq_type(const py::object& module, const char* name) {
    PyObject* found = PyObject_GetAttrString(module.ptr(), name);
    if (found == nullptr) {
      PyErr_Clear();
      return py::object();
    }
    py::object type = owned(found);
    if (!PyType_Check(found)) return py::object();
    auto* cls = reinterpret_cast<PyTypeObject*>(found);
    PyObject* mro = cls->tp_mro;
    if (mro == nullptr || !PyTuple_Check(mro) || cls->tp_base == nullptr) return py::object();
    for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(mro); ++k) {
      auto* owner = reinterpret_cast<PyTypeObject*>(PyTuple_GET_ITEM(mro, k));
      if (owner->tp_dict != nullptr && PyDict_GetItemString(owner->tp_dict, "__eq__") != nullptr) {
        return owner == cls->tp_base ? type : py::object();
      }
    }
    return py::object();
  }

  py::object shard_, replicate_;
  size_t num_known_ = 0;
};

// Module paths by module address: an open-addressed table (a sort of 65793 of them took 3-4 ms; this fills
// in one pass). Keys are addresses, never 0; values borrowed.
class PathsById {
 public:
  void reserve(size_t n) {
    size_t capacity = 16;
    int bits = 4;
    while (capacity < 2 * n) capacity *= 2, ++bits;
    slots_.assign(capacity, {0, nullptr});
    mask_ = capacity - 1;
    shift_ = 64 - bits;
  }

  // Adds id -> path unless id is there already (the first path stays).
  void add_first(uintptr_t id, PyObject* path) {
    if (2 * (size_ + 1) > slots_.size()) grow();
    for (size_t at = index(id);; at = (at + 1) & mask_) {
      if (slots_[at].first == id) return;
      if (slots_[at].first == 0) {
        slots_[at] = {id, path};
        ++size_;
        return;
      }
    }
  }

  // The slot find(id) reads first, asked for ahead of it.
  void prefetch(uintptr_t id) const {
    if (!slots_.empty()) __builtin_prefetch(&slots_[index(id)]);
  }

  PyObject* find(uintptr_t id) const {
    if (slots_.empty() || id == 0) return nullptr;
    for (size_t at = index(id);; at = (at + 1) & mask_) {
      if (slots_[at].first == id) return slots_[at].second;
      if (slots_[at].first == 0) return nullptr;
    }
  }

 private:
  // (Fibonacci hashing: the product's top bits.)
  size_t index(uintptr_t id) const { return static_cast<size_t>((static_cast<uint64_t>(id) * 0x9E3779B97F4A7C15ull) >> shift_); }

  void grow() {
    std::vector<std::pair<uintptr_t, PyObject*>> old = std::move(slots_);
    reserve(std::max<size_t>(8, old.size()));
    size_ = 0;
    for (const auto& [id, path] : old) {
      if (id != 0) add_first(id, path);
    }
  }

  std::vector<std::pair<uintptr_t, PyObject*>> slots_;
  size_t mask_ = 0;
  int shift_ = 60;
  size_t size_ = 0;
};

// path + "." + name (new reference), in one allocation where both are ASCII.
PyObject* joined_name(PyObject* path, PyObject* name) {
  if (PyUnicode_IS_ASCII(path) && PyUnicode_IS_ASCII(name)) {
    const Py_ssize_t a = PyUnicode_GET_LENGTH(path), b = PyUnicode_GET_LENGTH(name);
    PyObject* out = PyUnicode_New(a + 1 + b, 127);
    if (out == nullptr) throw py::error_already_set();
    Py_UCS1* data = PyUnicode_1BYTE_DATA(out);
    std::memcpy(data, PyUnicode_1BYTE_DATA(path), static_cast<size_t>(a));
    data[a] = '.';
    std::memcpy(data + a + 1, PyUnicode_1BYTE_DATA(name), static_cast<size_t>(b));
    return out;
  }
  py::object head = owned(PyUnicode_Concat(path, py::str(".").ptr()));
  if (!head) throw py::error_already_set();
  PyObject* out = PyUnicode_Concat(head.ptr(), name);
  if (out == nullptr) throw py::error_already_set();
  return out;
}

}  // namespace

bool combined_keys_layout_ok() {
#if GPU_OFFLOAD_DICT_VERSION_TAGS
  static const bool ok = [] {
    try {
      // A dict of str keys, as an instance's materialized __dict__ is: a combined "unicode" table whose entries
      // hold the keys and values in insertion order.
      py::dict d;
      py::object keys[6], values[6];
      for (int i = 0; i < 6; ++i) {
        keys[i] = owned(PyUnicode_InternFromString(("gpu_offload_probe_" + std::to_string(i)).c_str()));
        values[i] = py::int_(1000 + i);
        d[keys[i]] = values[i];
      }
      const DictKeys* table = keys_of(d.ptr());
      if (reinterpret_cast<PyDictObject*>(d.ptr())->ma_values != nullptr || table->dk_kind != kDictKeysUnicode ||
          table->dk_nentries != 6) {
        return false;
      }
      const DictUnicodeEntry* entries = unicode_entries(table);
      for (int i = 0; i < 6; ++i) {
        if (entries[i].me_key != keys[i].ptr() || entries[i].me_value != values[i].ptr()) return false;
      }
      return true;
    } catch (const py::error_already_set&) {
      PyErr_Clear();
      return false;
    }
  }();
  combined_layout_checked() = ok;
  return ok;
#else
  return false;
#endif
}

bool inline_values_layout_ok() {
#if GPU_OFFLOAD_DICT_VERSION_TAGS
  static const bool ok = [] {
    try {
      // Instances of a class made here, as a dataclass's or FSDP's objects are: their attributes set one by one
      // (no __dict__ asked for), kept as inline values indexed as the class's shared keys' entries.
      py::object cls = py::reinterpret_borrow<py::object>(reinterpret_cast<PyObject*>(&PyType_Type))(
          "gpu_offload_inline_values_probe", py::tuple(), py::dict());
      const DictKeys* keys = nullptr;
      for (int round = 0; round < 2; ++round) {  // (the second instance: the keys already hold every name)
        py::object obj = cls();
        py::object names[6], values[6];
        for (int i = 0; i < 6; ++i) {
          names[i] = owned(PyUnicode_InternFromString(("gpu_offload_probe_" + std::to_string(i)).c_str()));
          values[i] = py::int_(2000 + 10 * round + i);
          if (PyObject_SetAttr(obj.ptr(), names[i].ptr(), values[i].ptr()) != 0) throw py::error_already_set();
        }
        PyTypeObject* type = reinterpret_cast<PyTypeObject*>(cls.ptr());
        const Attributes a = attributes_of(obj.ptr());
        if (!PyType_HasFeature(type, Py_TPFLAGS_HEAPTYPE) || a.values == nullptr || a.dict != nullptr) return false;
        keys = reinterpret_cast<const DictKeys*>(reinterpret_cast<PyHeapTypeObject*>(type)->ht_cached_keys);
        if (keys == nullptr || keys->dk_kind != kDictKeysSplit || keys->dk_nentries != 6) return false;
        const DictUnicodeEntry* entries = unicode_entries(keys);
        for (int i = 0; i < 6; ++i) {
          if (entries[i].me_key != names[i].ptr() || static_cast<PyObject* const*>(a.values)[i] != values[i].ptr()) {
            return false;
          }
        }
      }
      return true;
    } catch (const py::error_already_set&) {
      PyErr_Clear();
      return false;
    }
  }();
  inline_values_checked() = ok;
  return ok;
#else
  return false;
#endif
}

py::object instance_attrs(py::handle objs, const char* name) {
  const Items items = items_of(objs);
  PlainAttr attr(name);
  py::list out(items.size);
  PyObject** slots = reinterpret_cast<PyListObject*>(out.ptr())->ob_item;
  for (Py_ssize_t i = 0; i < items.size; ++i) {
    if (i + kStage < items.size) prefetch_object(items.data[i + kStage]);
    PyObject* value = attr(items.data[i]);
    if (value == nullptr) return py::none();
    slots[i] = value;
  }
  return std::move(out);
}

bool same_object_sets(py::handle a, py::handle b, Py_ssize_t count_b) {
  const Items x = items_of(a), y = items_of(b);
  if (count_b < 0 || count_b > y.size) count_b = y.size;
  // (The same objects in the same order, as an FSDP2 model's groups list its parameters in the traversal's
  // order: equal sets without sorting either.)
  if (x.size == count_b && std::equal(x.data, x.data + x.size, y.data)) return true;
  std::vector<PyObject*> u(x.data, x.data + x.size), v(y.data, y.data + count_b);
  for (auto* s : {&u, &v}) {
    std::sort(s->begin(), s->end());
    s->erase(std::unique(s->begin(), s->end()), s->end());
  }
  return u == v;
}

py::tuple module_kinds(py::handle modules, py::handle cls) {
  const Items items = items_of(modules);
  // (type, its last module), in the order each type is first met: few types, the last one met tried first.
  std::vector<std::pair<PyTypeObject*, PyObject*>> kinds;
  std::vector<size_t> kind_of(static_cast<size_t>(items.size));
  size_t last = 0;
  for (Py_ssize_t i = 0; i < items.size; ++i) {
    if (i + 16 < items.size) __builtin_prefetch(items.data[i + 16]);  // (its header: where its type is)
    PyTypeObject* type = Py_TYPE(items.data[i]);
    if (kinds.empty() || kinds[last].first != type) {
      last = 0;
      while (last < kinds.size() && kinds[last].first != type) ++last;
      if (last == kinds.size()) kinds.emplace_back(type, nullptr);
    }
    kinds[last].second = items.data[i];
    kind_of[static_cast<size_t>(i)] = last;
  }
  // Which types are subclasses of cls: asked once each, after the pass (issubclass may run Python; the
  // modules list is the caller's, and nothing read above is used but the types, held below).
  std::vector<py::object> held;
  held.reserve(kinds.size());
  for (const auto& k : kinds) held.push_back(py::reinterpret_borrow<py::object>(reinterpret_cast<PyObject*>(k.first)));
  py::list last_of_kind = new_list(kinds.size(), [&](size_t k) {
    Py_INCREF(kinds[k].second);
    return kinds[k].second;
  });
  std::vector<char> picked_kind(kinds.size());
  bool any = false;
  for (size_t k = 0; k < kinds.size(); ++k) {
    const int sub = PyObject_IsSubclass(held[k].ptr(), cls.ptr());
    if (sub < 0) throw py::error_already_set();
    picked_kind[k] = static_cast<char>(sub);
    any = any || sub == 1;
  }
  py::list picked;
  if (any) {
    for (size_t i = 0; i < kind_of.size(); ++i) {
      if (picked_kind[kind_of[i]]) picked.append(py::int_(i));
    }
  }
  return py::make_tuple(last_of_kind, picked);
}

py::object fsdp2_layouts(py::handle fsdp_params, py::handle module_paths) {
#if !GPU_OFFLOAD_DICT_VERSION_TAGS
  (void)fsdp_params;
  (void)module_paths;
  return py::none();  // (a CPython whose instance layout these reads were not measured on: the Python path)
#else
  const Items fps = items_of(fsdp_params);
  // The paths by module address (a lookup per parameter, no int made for it): from a dict of id() -> path, or
  // from (the modules' ids as native words, their paths), as a recorded traversal keeps them. A module
  // reached twice is named by its first path, as named_modules() and a dict of them name it.
  PathsById paths;  // (borrowed: the caller holds them)
  PyObject* given = module_paths.ptr();
  if (PyDict_CheckExact(given)) {
    paths.reserve(static_cast<size_t>(PyDict_GET_SIZE(given)));
    Py_ssize_t pos = 0;
    PyObject *key, *value;
    while (PyDict_Next(given, &pos, &key, &value)) {
      if (!PyLong_CheckExact(key) || !PyUnicode_CheckExact(value)) return py::none();
      const uintptr_t id = reinterpret_cast<uintptr_t>(PyLong_AsVoidPtr(key));
      if (PyErr_Occurred()) {
        PyErr_Clear();
        return py::none();
      }
      paths.add_first(id, value);
    }
  } else if (PyTuple_CheckExact(given) && PyTuple_GET_SIZE(given) == 2 && PyBytes_CheckExact(PyTuple_GET_ITEM(given, 0)) &&
             PyList_CheckExact(PyTuple_GET_ITEM(given, 1))) {
    PyObject* ids = PyTuple_GET_ITEM(given, 0);
    const Items names = items_of(PyTuple_GET_ITEM(given, 1));
    if (PyBytes_GET_SIZE(ids) != names.size * static_cast<Py_ssize_t>(sizeof(uintptr_t))) return py::none();
    paths.reserve(static_cast<size_t>(names.size));
    for (Py_ssize_t k = 0; k < names.size; ++k) {
      uintptr_t id;
      std::memcpy(&id, PyBytes_AS_STRING(ids) + k * static_cast<Py_ssize_t>(sizeof(uintptr_t)), sizeof(id));
      if (!PyUnicode_CheckExact(names.data[k])) return py::none();
      paths.add_first(id, names.data[k]);
    }
  } else {
    return py::none();
  }
  PlainAttr module_info_of("_module_info"), spec_of("_sharding_spec"), orig_of("_orig_size"),
      padded_of("padded_sharded_param_size"), shard_of("_sharded_param_data"), module_of("module"),
      param_name_of("param_name"), placements_of("placements");
  py::object unknown = owned(PyUnicode_InternFromString("?"));
  if (!unknown) throw py::error_already_set();

  const Py_ssize_t n = fps.size;
  std::vector<Param> params(static_cast<size_t>(n));
  std::vector<py::object> shards(static_cast<size_t>(n));  // (each padded shard, returned: the caller records them)
  std::vector<int64_t> dims;
  dims.reserve(static_cast<size_t>(n) * 6);
  // Each parameter goes through the stages below, stage k kStage parameters behind stage k + 1: each stage
  // reads what the one before asked for (now in cache) and asks for what the next reads.
  constexpr Py_ssize_t kStages = 6;
  PyObject* const fp_names[] = {module_info_of.name(), spec_of.name(), orig_of.name(), padded_of.name(),
                                shard_of.name()};
  PlainAttr* const fp_attrs[] = {&module_info_of, &spec_of, &orig_of, &padded_of, &shard_of};
  std::vector<Fetched> ring(static_cast<size_t>(kStages * kStage));
  auto slot = [&](Py_ssize_t i) -> Fetched& { return ring[static_cast<size_t>(i % (kStages * kStage))]; };
  auto fp_at = [&](Py_ssize_t i) { return i >= 0 && i < n ? fps.data[i] : nullptr; };
  for (Py_ssize_t i = -kStages * kStage; i < n + kStage; ++i) {
    prefetch_object(fp_at(i + 5 * kStage));  // its header and the words before it
    prefetch_attributes(fp_at(i + 4 * kStage), false);  // its dict object
    prefetch_attributes(fp_at(i + 3 * kStage), true);  // its dict's table
    if (PyObject* fp = fp_at(i + 2 * kStage)) {  // its attributes' objects: at their remembered entries, or looked up
      bool found = true;
      for (PlainAttr* attr : fp_attrs) {
        PyObject* value = attr->peek(fp);
        found = found && value != nullptr;
        if (value != nullptr) prefetch_object(value);
      }
      if (!found) prefetch_values(fp, fp_names, 5);
    }
    if (PyObject* fp = fp_at(i + kStage + kStage / 2)) {  // its attributes read; what they keep asked for
      Fetched& f = slot(i + kStage + kStage / 2);
      f.module_info = owned(module_info_of(fp));
      f.spec = owned(spec_of(fp));
      f.orig = owned(orig_of(fp));
      f.padded = owned(padded_of(fp));
      f.shard = owned(shard_of(fp));
      if (!f.module_info || !f.spec || !f.orig || !f.padded || !f.shard) return py::none();
      prefetch_attributes(f.module_info.ptr(), true);
      prefetch_attributes(f.spec.ptr(), true);
      if (THPVariable_CheckExact(f.shard.ptr())) __builtin_prefetch(THPVariable_Unpack(f.shard.ptr()).unsafeGetTensorImpl());
    }
    if (fp_at(i) != nullptr) {  // everything read; the name's parts asked for
      Fetched& f = slot(i);
      Param& p = params[static_cast<size_t>(i)];
      p.dims_at = dims.size();
      if (!append_dims(f.orig.ptr(), dims) || !append_dims(f.padded.ptr(), dims)) return py::none();
      p.num_dims = dims.size() - p.dims_at;
      p.dtype = scalar_type_of(f.shard.ptr());
      p.placements = owned(placements_of(f.spec.ptr()));
      if (p.dtype < 0 || !p.placements || !PyTuple_Check(p.placements.ptr())) return py::none();
      f.module = owned(module_of(f.module_info.ptr()));
      f.param_name = owned(param_name_of(f.module_info.ptr()));
      if (!f.module || !f.param_name || !PyUnicode_CheckExact(f.param_name.ptr())) {
        return py::none();
      }
      __builtin_prefetch(f.param_name.ptr());
      __builtin_prefetch(reinterpret_cast<const char*>(f.param_name.ptr()) + 64);
      paths.prefetch(reinterpret_cast<uintptr_t>(f.module.ptr()));
    }
    if (fp_at(i - kStage) != nullptr) {  // the name: f"{path}.{param_name}" if path else param_name
      Fetched& f = slot(i - kStage);
      Param& p = params[static_cast<size_t>(i - kStage)];
      PyObject* path = unknown.ptr();  // ("?": a module the paths do not know, as fsdp2_shard_info names it)
      if (PyObject* found = paths.find(reinterpret_cast<uintptr_t>(f.module.ptr()))) path = found;
      p.name = PyUnicode_GET_LENGTH(path) == 0 ? std::move(f.param_name) : owned(joined_name(path, f.param_name.ptr()));
      shards[static_cast<size_t>(i - kStage)] = std::move(f.shard);
      f = Fetched{};
    }
  }

  // The layouts: parameters of one global shape, padded local shape, dtype and placements (==) share one.
  // Grouped by the first three, hashed; the placements compared with those of each layout of the group.
  auto key_of = [&](const Param& p) {
    uint64_t h = 1469598103934665603ull ^ static_cast<uint64_t>(p.dtype);
    for (size_t k = 0; k < p.num_dims; ++k) h = (h ^ static_cast<uint64_t>(dims[p.dims_at + k])) * 1099511628211ull;
    return h;
  };
  auto same_shape = [&](const Param& a, const Param& b) {
    return a.dtype == b.dtype && a.num_dims == b.num_dims &&
           std::equal(dims.begin() + static_cast<std::ptrdiff_t>(a.dims_at),
                      dims.begin() + static_cast<std::ptrdiff_t>(a.dims_at + a.num_dims),
                      dims.begin() + static_cast<std::ptrdiff_t>(b.dims_at));
  };
  PlacementsEqual placements_equal;
  std::unordered_map<uint64_t, std::vector<size_t>> by_key;  // hash -> layout indices
  std::vector<size_t> firsts;  // (each layout's first parameter)
  std::vector<size_t> index(static_cast<size_t>(n));
  size_t last = SIZE_MAX;  // (consecutive parameters mostly share a layout: that one is tried first)
  for (Py_ssize_t i = 0; i < n; ++i) {
    // (Each parameter's placements tuple, then its items, asked for ahead of their comparison.)
    if (i + 2 * kStage < n) __builtin_prefetch(params[static_cast<size_t>(i + 2 * kStage)].placements.ptr());
    auto each_item_ahead = [&](Py_ssize_t ahead, auto&& prefetch) {  // (a tuple's first four items)
      if (i + ahead >= n) return;
      PyObject* tuple = params[static_cast<size_t>(i + ahead)].placements.ptr();
      for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(tuple) && k < 4; ++k) prefetch(PyTuple_GET_ITEM(tuple, k));
    };
    each_item_ahead(kStage, prefetch_object);
    each_item_ahead(kStage / 2, [&](PyObject* item) { placements_equal.prefetch(item); });
    const Param& p = params[static_cast<size_t>(i)];
    auto same = [&](size_t l) {
      const Param& q = params[firsts[l]];
      if (!same_shape(p, q)) return false;
      const int eq = placements_equal(p.placements.ptr(), q.placements.ptr());
      if (eq < 0) throw py::error_already_set();
      return eq == 1;
    };
    size_t found = SIZE_MAX;
    if (last != SIZE_MAX && same(last)) {
      found = last;
    } else {
      std::vector<size_t>& candidates = by_key[key_of(p)];
      for (size_t l : candidates) {
        if (l != last && same(l)) {
          found = l;
          break;
        }
      }
      if (found == SIZE_MAX) {
        found = firsts.size();
        firsts.push_back(static_cast<size_t>(i));
        candidates.push_back(found);
      }
    }
    last = found;
    index[static_cast<size_t>(i)] = found;
  }
  const size_t count = static_cast<size_t>(n);
  return py::make_tuple(new_list(count, [&](size_t i) { return params[i].name.release().ptr(); }),
                        new_list(count, [&](size_t i) { return PyLong_FromSize_t(index[i]); }),
                        new_list(firsts.size(), [&](size_t l) { return PyLong_FromSize_t(firsts[l]); }),
                        new_list(count, [&](size_t i) { return shards[i].release().ptr(); }));
#endif
}

bool cpp_placements() { return GPU_OFFLOAD_CPP_PLACEMENTS != 0; }

py::tuple placements_equal(py::handle a, py::handle b) {
  PlacementsEqual equal;
  const int eq = equal(a.ptr(), b.ptr());
  if (eq < 0) throw py::error_already_set();
  return py::make_tuple(eq == 1, equal.num_known());
}

}  // namespace gpu_offload::torch_ext
