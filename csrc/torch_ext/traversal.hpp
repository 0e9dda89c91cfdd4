// What the recorded traversals (module_tree.cpp, optimizer_tree.cpp, on CPython 3.11/3.12) and the walks
// through the public API (module_walk.cpp, optimizer_walk.cpp, where no record runs) share: which classes
// traverse as nn.Module or a torch optimizer do, which names can be read back, a state dict's sorted keys,
// and an index of objects by address. Nothing here depends on CPython's dict layout.
#pragma once

#include <Python.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <unordered_map>
#include <utility>
#include <vector>

namespace gpu_offload::torch_ext {

// A module's attributes the traversal reads, and the methods it calls through each instance (one set on an
// instance shadows its class's: such a module is not a plain one).
inline const char* const kModuleParts[3] = {"_parameters", "_buffers", "_modules"};
inline const char* const kModuleMethods[4] = {"named_modules", "named_parameters", "named_buffers", "_named_members"};

// The keys of a torch optimizer's own state the traversals read (interned once, never freed: they live as
// long as the interpreter; first asked for with the GIL held).
struct OptimizerKeys {
  PyObject* param_groups = PyUnicode_InternFromString("param_groups");
  PyObject* state = PyUnicode_InternFromString("state");
  PyObject* params = PyUnicode_InternFromString("params");
};

inline const OptimizerKeys& optimizer_keys() {
  static const OptimizerKeys* keys = new OptimizerKeys();
  return *keys;
}

// A class attribute as the type's MRO has it (borrowed; also gives the class a version tag), or nullptr.
inline PyObject* class_attribute(PyTypeObject* type, const char* name) {
  PyObject* key = PyUnicode_InternFromString(name);
  if (key == nullptr) {
    PyErr_Clear();
    return nullptr;
  }
  PyObject* found = _PyType_Lookup(type, key);
  Py_DECREF(key);  // (interned: the interpreter keeps the string)
  return found;
}

// Which classes traverse as nn.Module's own methods do: the same named_modules and __getattribute__ (and, for
// the root, named_parameters, named_buffers and _named_members), no descriptor shadowing one of the three parts,
// and none of the `refused` classes (another strategy's). Asked once per class.
class PlainModuleClasses {
 public:
  PlainModuleClasses(PyTypeObject* module_type, std::vector<PyTypeObject*> refused)
      : refused_(std::move(refused)), getattribute_(class_attribute(module_type, "__getattribute__")) {
    for (int i = 0; i < 4; ++i) methods_[i] = class_attribute(module_type, kModuleMethods[i]);
  }

  bool plain(PyTypeObject* type, bool root) {
    auto it = known_.find(type);
    if (it != known_.end()) return root ? it->second.second : it->second.first;
    bool ok = class_attribute(type, kModuleMethods[0]) == methods_[0] &&
              class_attribute(type, "__getattribute__") == getattribute_;
    for (PyTypeObject* refused : refused_) ok = ok && !PyType_IsSubtype(type, refused);
    for (const char* part : kModuleParts) ok = ok && class_attribute(type, part) == nullptr;
    bool root_ok = ok;
    for (int i = 1; i < 4; ++i) root_ok = root_ok && class_attribute(type, kModuleMethods[i]) == methods_[i];
    known_[type] = {ok, root_ok};
    return root ? root_ok : ok;
  }

 private:
  std::vector<PyTypeObject*> refused_;
  PyObject* getattribute_;
  PyObject* methods_[4] = {};
  std::unordered_map<PyTypeObject*, std::pair<bool, bool>> known_;  // (as a child, as the root)
};

// Whether a key (an exact str) can be read back from a name joined by ".": not empty and holding no ".".
inline bool traversal_key_ok(PyObject* key) {
  const Py_ssize_t n = PyUnicode_GET_LENGTH(key);
  if (n == 0) return false;
  if (PyUnicode_IS_ASCII(key)) return std::memchr(PyUnicode_1BYTE_DATA(key), '.', static_cast<size_t>(n)) == nullptr;
  return PyUnicode_FindChar(key, '.', 0, n, 1) == -1;  // (-2, an error, cannot be: an exact str, in range)
}

// Whether an optimizer's class reads param_groups and state as plain instance attributes.
inline bool plain_optimizer_class(PyTypeObject* type) {
  return type->tp_getattro == PyObject_GenericGetAttr && class_attribute(type, "param_groups") == nullptr &&
         class_attribute(type, "state") == nullptr;
}

// Objects by address (what state.get(p) finds, the key being the parameter itself, without hashing each
// parameter through Tensor.__hash__, which is Python code). Open addressing: a node-based map spent an
// allocation per entry, and a lookup two misses. Borrowed values.
class AddressIndex {
 public:
  explicit AddressIndex(size_t expected) {
    int bits = 4;
    while ((size_t{1} << bits) < 2 * expected) ++bits;
    slots_.assign(size_t{1} << bits, {nullptr, nullptr});
    mask_ = slots_.size() - 1;
    shift_ = 64 - bits;
  }
  void insert(PyObject* key, PyObject* value) {  // (a dict's keys are distinct objects)
    size_t i = slot_of(key);
    while (slots_[i].first != nullptr) i = (i + 1) & mask_;
    slots_[i] = {key, value};
  }
  PyObject* find(PyObject* key) const {  // borrowed, or nullptr
    for (size_t i = slot_of(key); slots_[i].first != nullptr; i = (i + 1) & mask_) {
      if (slots_[i].first == key) return slots_[i].second;
    }
    return nullptr;
  }
  // Asks for the slot `key` is looked up at first (the table is larger than the caches: a random access each).
  void prefetch(PyObject* key) const { __builtin_prefetch(&slots_[slot_of(key)]); }

 private:
  size_t slot_of(PyObject* key) const {  // (Fibonacci hashing: the product's top bits)
    return static_cast<size_t>((reinterpret_cast<uint64_t>(key) * 0x9E3779B97F4A7C15ull) >> shift_);
  }
  std::vector<std::pair<PyObject*, PyObject*>> slots_;
  size_t mask_;
  int shift_;
};

// One optimizer state dict's (key, value) items in sorted(state) order. A state's keys are mostly the same str
// objects as the state before's, in the same order (an optimizer makes them alike): that state's sorted order
// then serves again.
class SortedStateKeys {
 public:
  // false: a key that is not an exact str (Python's sorted would refuse a mix), or not ASCII where asked.
  bool read(PyObject* state, bool ascii_only) {
    items_.clear();
    Py_ssize_t pos = 0;
    PyObject *key, *value;
    while (PyDict_Next(state, &pos, &key, &value)) {
      if (!PyUnicode_CheckExact(key) || (ascii_only && !PyUnicode_IS_ASCII(key))) return false;
      items_.emplace_back(key, value);
    }
    const bool same_keys = items_.size() == last_keys_.size() &&
                           std::equal(items_.begin(), items_.end(), last_keys_.begin(),
                                      [](const auto& item, PyObject* k) { return item.first == k; });
    if (!same_keys) {
      last_keys_.clear();
      for (const auto& item : items_) last_keys_.push_back(item.first);
      order_.resize(items_.size());
      for (size_t k = 0; k < order_.size(); ++k) order_[k] = k;
      std::sort(order_.begin(), order_.end(),
                [&](size_t x, size_t y) { return PyUnicode_Compare(items_[x].first, items_[y].first) < 0; });
    }
    return true;
  }
  const std::vector<size_t>& order() const { return order_; }
  const std::pair<PyObject*, PyObject*>& item(size_t k) const { return items_[k]; }

 private:
  std::vector<std::pair<PyObject*, PyObject*>> items_;
  std::vector<PyObject*> last_keys_;
  std::vector<size_t> order_;
};

}  // namespace gpu_offload::torch_ext
