// A torch optimizer's state traversal (adapters.torch_optimizer_tensors: for each parameter of each group, in
// order, the tensors of its state by sorted key, "state.<parameter index>.<key>") walked in C++ through
// CPython's public API, each call, with nothing recorded: where the recorded traversal (optimizer_tree.cpp)
// cannot run (a CPython without the dict version tags it relies on: 3.13 and later), as module_walk.cpp does
// for a module. It reads what build_optimizer_tree reads and declines what that declines (a class that reads
// param_groups or state otherwise, a state that is not a dict or torch's defaultdict, a group or state that
// is not an exact dict, a state holding a list, tuple or dict), and holds everything it reads: the optimizer's
// __dict__, its groups, their params lists, each parameter and each state dict.
#include <Python.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <charconv>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "torch_ext.hpp"

namespace py = pybind11;

namespace gpu_offload::torch_ext {

namespace {

struct OptimizerNames {
  py::object param_groups = py::reinterpret_steal<py::object>(PyUnicode_InternFromString("param_groups"));
  py::object state = py::reinterpret_steal<py::object>(PyUnicode_InternFromString("state"));
  py::object params = py::reinterpret_steal<py::object>(PyUnicode_InternFromString("params"));
};

const OptimizerNames& optimizer_names() {
  static const OptimizerNames* n = new OptimizerNames();  // (never freed: lives as long as the interpreter)
  return *n;
}

// A dict's item, held, or an empty object (no error set).
py::object held_item(PyObject* dict, PyObject* key) {
  PyObject* value = PyDict_GetItemWithError(dict, key);
  if (value == nullptr) {
    PyErr_Clear();
    return py::object();
  }
  return py::reinterpret_borrow<py::object>(value);
}

// Parameter -> its state dict, by the parameter's address (the state dict's key is the parameter itself: what
// state.get(p) finds), without hashing each parameter through Tensor.__hash__, which is Python code.
class StateByAddress {
 public:
  explicit StateByAddress(size_t expected) {
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

 private:
  size_t slot_of(PyObject* key) const {  // (Fibonacci hashing: the product's top bits)
    return static_cast<size_t>((reinterpret_cast<uint64_t>(key) * 0x9E3779B97F4A7C15ull) >> shift_);
  }
  std::vector<std::pair<PyObject*, PyObject*>> slots_;
  size_t mask_;
  int shift_;
};

}  // namespace

py::object walk_optimizer(py::handle optimizer_handle, py::handle previous) {
#ifdef Py_GIL_DISABLED
  // (Without the GIL another thread may change a dict while PyDict_Next hands out borrowed items: Python walks.)
  (void)optimizer_handle, (void)previous;
  return py::none();
#endif
  PyObject* optimizer = optimizer_handle.ptr();
  PyTypeObject* type = Py_TYPE(optimizer);
  const OptimizerNames& names = optimizer_names();
  // param_groups and state read as plain instance attributes.
  if (type->tp_getattro != PyObject_GenericGetAttr || _PyType_Lookup(type, names.param_groups.ptr()) != nullptr ||
      _PyType_Lookup(type, names.state.ptr()) != nullptr) {
    return py::none();
  }
  py::object hold_optimizer = py::reinterpret_borrow<py::object>(optimizer_handle);
  py::object dict = py::reinterpret_steal<py::object>(PyObject_GenericGetDict(optimizer, nullptr));
  if (!dict || !PyDict_CheckExact(dict.ptr())) {
    PyErr_Clear();
    return py::none();
  }
  py::object groups = held_item(dict.ptr(), names.param_groups.ptr());
  py::object state = held_item(dict.ptr(), names.state.ptr());
  // The state: a dict or torch's defaultdict (a subclass with a `get` of its own would be asked otherwise).
  static PyObject* defaultdict = py::object(py::module_::import("collections").attr("defaultdict")).release().ptr();
  if (!groups || !PyList_CheckExact(groups.ptr()) || !state ||
      !(PyDict_CheckExact(state.ptr()) || Py_TYPE(state.ptr()) == reinterpret_cast<PyTypeObject*>(defaultdict))) {
    return py::none();
  }
  // The parameters of every group, in order, held.
  std::vector<py::object> held;  // the groups and their params lists
  std::vector<py::object> params;
  const Py_ssize_t num_groups = PyList_GET_SIZE(groups.ptr());
  for (Py_ssize_t g = 0; g < num_groups && g < PyList_GET_SIZE(groups.ptr()); ++g) {
    py::object group = py::reinterpret_borrow<py::object>(PyList_GET_ITEM(groups.ptr(), g));
    if (!PyDict_CheckExact(group.ptr())) return py::none();
    py::object listed = held_item(group.ptr(), names.params.ptr());
    if (!listed || !PyList_CheckExact(listed.ptr())) return py::none();
    for (Py_ssize_t k = 0; k < PyList_GET_SIZE(listed.ptr()); ++k) {
      params.push_back(py::reinterpret_borrow<py::object>(PyList_GET_ITEM(listed.ptr(), k)));
    }
    held.push_back(std::move(group));
    held.push_back(std::move(listed));
  }
  // Each parameter's state dict, held. (No Python code runs from here to the end: no lookup, no hash; an
  // allocation may run a finalizer, which cannot free what is held.)
  StateByAddress state_of(static_cast<size_t>(PyDict_GET_SIZE(state.ptr())));
  {
    Py_ssize_t pos = 0;
    PyObject *key, *value;
    while (PyDict_Next(state.ptr(), &pos, &key, &value)) state_of.insert(key, value);
  }
  std::vector<py::object> states(params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    if (PyObject* st = state_of.find(params[i].ptr())) states[i] = py::reinterpret_borrow<py::object>(st);
  }
  // Each state's tensors by sorted key; a state's keys are mostly the same str objects as the state before's,
  // in the same order, whose sorted order then serves again.
  std::vector<std::string> out_names;
  std::vector<py::object> out_tensors;
  out_names.reserve(3 * params.size());
  out_tensors.reserve(3 * params.size());
  std::vector<std::pair<PyObject*, PyObject*>> items;
  std::vector<PyObject*> last_keys;
  std::vector<size_t> order;
  char prefix[48] = "state.";
  for (size_t i = 0; i < params.size(); ++i) {
    PyObject* st = states[i].ptr();
    if (st == nullptr) continue;
    if (!PyDict_CheckExact(st)) return py::none();
    items.clear();
    Py_ssize_t pos = 0;
    PyObject *key, *value;
    while (PyDict_Next(st, &pos, &key, &value)) {
      // sorted(state): str keys (Python's sorted would refuse a mix), ASCII here (the Python walk otherwise).
      if (!PyUnicode_CheckExact(key) || !PyUnicode_IS_ASCII(key)) return py::none();
      items.emplace_back(key, value);
    }
    const bool same_keys = items.size() == last_keys.size() &&
                           std::equal(items.begin(), items.end(), last_keys.begin(),
                                      [](const auto& item, PyObject* k) { return item.first == k; });
    if (!same_keys) {
      last_keys.clear();
      for (const auto& item : items) last_keys.push_back(item.first);
      order.resize(items.size());
      for (size_t k = 0; k < order.size(); ++k) order[k] = k;
      std::sort(order.begin(), order.end(),
                [&](size_t x, size_t y) { return PyUnicode_Compare(items[x].first, items[y].first) < 0; });
    }
    char* end = std::to_chars(prefix + 6, prefix + sizeof(prefix) - 1, static_cast<int64_t>(i)).ptr;
    *end = '.';
    const size_t a = static_cast<size_t>(end - prefix) + 1;
    for (size_t k : order) {
      PyObject* v = items[k].second;
      // (Tensors in a list, tuple or dict, LBFGS's history, are named by the Python walk.)
      if (PyList_Check(v) || PyTuple_Check(v) || PyDict_Check(v)) return py::none();
      if (!is_tensor(v)) continue;
      std::string name(prefix, a);
      name.append(reinterpret_cast<const char*>(PyUnicode_1BYTE_DATA(items[k].first)),
                  static_cast<size_t>(PyUnicode_GET_LENGTH(items[k].first)));
      out_names.push_back(std::move(name));
      out_tensors.push_back(py::reinterpret_borrow<py::object>(v));
    }
  }
  return py::make_tuple(names_list_of(out_names, previous), list_of(out_tensors));
}

}  // namespace gpu_offload::torch_ext
