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

#include "py_objects.hpp"
#include "traversal.hpp"

namespace py = pybind11;

namespace gpu_offload::torch_ext {

namespace {

// A dict's item, held, or an empty object (no error set).
py::object held_item(PyObject* dict, PyObject* key) {
  PyObject* value = PyDict_GetItemWithError(dict, key);
  if (value == nullptr) {
    PyErr_Clear();
    return py::object();
  }
  return py::reinterpret_borrow<py::object>(value);
}

}  // namespace

py::object walk_optimizer(py::handle optimizer_handle, py::handle previous) {
#ifdef Py_GIL_DISABLED
  // (Without the GIL another thread may change a dict while PyDict_Next hands out borrowed items: Python walks.)
  (void)optimizer_handle, (void)previous;
  return py::none();
#endif
  PyObject* optimizer = optimizer_handle.ptr();
  PyTypeObject* type = Py_TYPE(optimizer);
  const OptimizerKeys& names = optimizer_keys();
  if (!plain_optimizer_class(type)) return py::none();
  py::object hold_optimizer = py::reinterpret_borrow<py::object>(optimizer_handle);
  py::object dict = py::reinterpret_steal<py::object>(PyObject_GenericGetDict(optimizer, nullptr));
  if (!dict || !PyDict_CheckExact(dict.ptr())) {
    PyErr_Clear();
    return py::none();
  }
  py::object groups = held_item(dict.ptr(), names.param_groups);
  py::object state = held_item(dict.ptr(), names.state);
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
    py::object listed = held_item(group.ptr(), names.params);
    if (!listed || !PyList_CheckExact(listed.ptr())) return py::none();
    for (Py_ssize_t k = 0; k < PyList_GET_SIZE(listed.ptr()); ++k) {
      params.push_back(py::reinterpret_borrow<py::object>(PyList_GET_ITEM(listed.ptr(), k)));
    }
    held.push_back(std::move(group));
    held.push_back(std::move(listed));
  }
  // Each parameter's state dict, held. (No Python code runs from here to the end: no lookup, no hash; an
  // allocation may run a finalizer, which cannot free what is held.)
  AddressIndex state_of(static_cast<size_t>(PyDict_GET_SIZE(state.ptr())));
  {
    Py_ssize_t pos = 0;
    PyObject *key, *value;
    while (PyDict_Next(state.ptr(), &pos, &key, &value)) state_of.insert(key, value);
  }
  std::vector<py::object> states(params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    if (PyObject* st = state_of.find(params[i].ptr())) states[i] = py::reinterpret_borrow<py::object>(st);
  }
  // Each state's tensors by sorted key.
  std::vector<std::string> out_names;
  std::vector<py::object> out_tensors;
  out_names.reserve(3 * params.size());
  out_tensors.reserve(3 * params.size());
  SortedStateKeys keys;
  char prefix[48] = "state.";
  for (size_t i = 0; i < params.size(); ++i) {
    PyObject* st = states[i].ptr();
    if (st == nullptr) continue;
    if (!PyDict_CheckExact(st)) return py::none();
    // (str keys, ASCII here: the Python walk names the others.)
    if (!keys.read(st, /*ascii_only=*/true)) return py::none();
    char* end = std::to_chars(prefix + 6, prefix + sizeof(prefix) - 1, static_cast<int64_t>(i)).ptr;
    *end = '.';
    const size_t a = static_cast<size_t>(end - prefix) + 1;
    for (size_t k : keys.order()) {
      const auto [key, v] = keys.item(k);
      // (Tensors in a list, tuple or dict, LBFGS's history, are named by the Python walk.)
      if (PyList_Check(v) || PyTuple_Check(v) || PyDict_Check(v)) return py::none();
      if (!is_tensor_object(v)) continue;
      std::string name(prefix, a);
      name.append(reinterpret_cast<const char*>(PyUnicode_1BYTE_DATA(key)), static_cast<size_t>(PyUnicode_GET_LENGTH(key)));
      out_names.push_back(std::move(name));
      out_tensors.push_back(py::reinterpret_borrow<py::object>(v));
    }
  }
  return py::make_tuple(names_list_of(out_names, previous), list_of(out_tensors));
}

}  // namespace gpu_offload::torch_ext
