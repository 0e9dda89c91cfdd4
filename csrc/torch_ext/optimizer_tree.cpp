// A torch.optim.Optimizer's state traversal (adapters.torch_optimizer_tensors: for each parameter of each
// group, in order, the tensors of its state by sorted key, named "state.<parameter index>.<key>"), recorded
// so that the next call can tell in one pass that it is still the same, without walking it in Python. A state
// holding a list, tuple or dict (which may hold tensors, and change without the state's tag) is not recorded.
//
// The traversal reads the optimizer's param_groups and state (instance attributes: a class that defines
// either, or its own attribute lookup, is not recorded), the param_groups list, each group's "params"
// list, the state dict, and each parameter's state dict. Dicts carry CPython's version tags (see
// module_tree.cpp); lists have none, so their items are compared. A group dict changes at every step (a
// scheduler writes "lr"): it is looked at again for its "params" list, which must be the recorded one with
// the recorded items. Lookups are made only in dicts whose every key is an exact str (str_keyed), where
// they run no code: an optimizer with another key in its __dict__, a group or a state is walked in Python.
// Only where the tags mean this (CPython 3.11 and 3.12 with the GIL); elsewhere
// build_optimizer_tree() says None and the caller walks the optimizer in Python every call, as before.
#include <Python.h>
#include <pybind11/pybind11.h>

#include <torch/csrc/autograd/python_variable.h>

#include <algorithm>
#include <charconv>
#include <cstring>
#include <string>
#include <vector>

#include "torch_ext.hpp"
#include "traversal.hpp"

#define GPU_OFFLOAD_OPTIMIZER_TREE GPU_OFFLOAD_DICT_VERSION_TAGS

namespace py = pybind11;

namespace gpu_offload::torch_ext {

#if GPU_OFFLOAD_OPTIMIZER_TREE
namespace {

// An object's instance __dict__ when it is an exact dict, else nullptr (no error set).
PyObject* instance_dict(PyObject* obj) {
  PyObject** dict_ptr = _PyObject_GetDictPtr(obj);
  if (dict_ptr == nullptr || *dict_ptr == nullptr) {
    PyErr_Clear();
    return nullptr;
  }
  return PyDict_CheckExact(*dict_ptr) ? *dict_ptr : nullptr;
}

PyObject* item_of(PyObject* dict, PyObject* key) {  // borrowed, or nullptr (no error set)
  PyObject* value = PyDict_GetItemWithError(dict, key);
  if (value == nullptr) PyErr_Clear();
  return value;
}

// "state.<index>.<key>" from the parameter's prefix "state.<index>." (`prefix`, `a` bytes): for an ASCII key
// in one allocation straight from the bytes (a name per state tensor: the most of a first call's own work),
// else through PyUnicode_FromFormat.
PyObject* state_name(const char* prefix, size_t a, int64_t index, PyObject* key) {
  if (!PyUnicode_IS_ASCII(key)) {
    PyObject* name = PyUnicode_FromFormat("state.%lld.%U", static_cast<long long>(index), key);
    if (name == nullptr) throw py::error_already_set();
    return name;
  }
  const Py_ssize_t b = PyUnicode_GET_LENGTH(key);
  PyObject* name = PyUnicode_New(static_cast<Py_ssize_t>(a) + b, 127);
  if (name == nullptr) throw py::error_already_set();
  char* out = reinterpret_cast<char*>(PyUnicode_1BYTE_DATA(name));
  std::memcpy(out, prefix, a);
  std::memcpy(out + a, PyUnicode_1BYTE_DATA(key), static_cast<size_t>(b));
  return name;
}

}  // namespace

class OptimizerTree {
 public:
  PyObject* optimizer = nullptr;  // compared, never followed
  PyTypeObject* type = nullptr;
  unsigned int type_tag = 0;
  PyObject* dict = nullptr;  // the optimizer's __dict__
  uint64_t dict_version = 0;
  PyObject* groups = nullptr;  // param_groups, a list
  std::vector<PyObject*> group_dicts;
  std::vector<uint64_t> group_versions;
  std::vector<PyObject*> params_lists;  // each group's "params"
  std::vector<size_t> params_at;  // where each group's parameters start in `params` (one more: the end)
  std::vector<PyObject*> params;
  PyObject* state = nullptr;
  uint64_t state_version = 0;
  std::vector<PyObject*> param_states;  // each parameter's state dict, or nullptr where it has none
  std::vector<uint64_t> param_state_versions;
  std::vector<PyObject*> tensors;  // the traversal's tensors, as recorded
};

namespace {

bool same_list_items(PyObject* list, const PyObject* const* recorded, size_t n) {
  if (!PyList_CheckExact(list) || static_cast<size_t>(PyList_GET_SIZE(list)) != n) return false;
  return n == 0 || std::memcmp(reinterpret_cast<PyListObject*>(list)->ob_item, recorded, n * sizeof(PyObject*)) == 0;
}

// Whether `tree` still describes `optimizer` (re-tagging dicts that changed elsewhere: a group's "lr", an
// attribute of the optimizer other than param_groups and state).
bool unchanged(OptimizerTree& t, PyObject* optimizer) {
  if (optimizer != t.optimizer) return false;
  PyTypeObject* type = Py_TYPE(optimizer);
  if (type != t.type || type->tp_version_tag != t.type_tag) return false;
  PyObject* dict = instance_dict(optimizer);
  if (dict == nullptr) return false;
  if (dict != t.dict || version_of(dict) != t.dict_version) {
    // (Only where a lookup runs no code, which could change or free what this check has already passed.)
    if (!str_keyed(dict) || item_of(dict, optimizer_keys().param_groups) != t.groups ||
        item_of(dict, optimizer_keys().state) != t.state) {
      return false;
    }
    t.dict = dict;
    t.dict_version = version_of(dict);
  }
  // (groups is alive: the unchanged __dict__ holds it; the group dicts are its items, compared.)
  if (!same_list_items(t.groups, t.group_dicts.data(), t.group_dicts.size())) return false;
  for (size_t g = 0; g < t.group_dicts.size(); ++g) {
    PyObject* group = t.group_dicts[g];
    if (version_of(group) != t.group_versions[g]) {
      if (!str_keyed(group) || item_of(group, optimizer_keys().params) != t.params_lists[g]) return false;
      t.group_versions[g] = version_of(group);
    }
    const size_t at = t.params_at[g];
    if (!same_list_items(t.params_lists[g], t.params.data() + at, t.params_at[g + 1] - at)) return false;
  }
  if (version_of(t.state) != t.state_version) return false;
  // (Each recorded state dict is alive: the unchanged state dict holds it.)
  const size_t n = t.param_states.size();
  constexpr size_t kAhead = 8;
  for (size_t i = 0; i < n; ++i) {
    if (i + kAhead < n && t.param_states[i + kAhead] != nullptr) __builtin_prefetch(t.param_states[i + kAhead]);
    if (t.param_states[i] != nullptr && version_of(t.param_states[i]) != t.param_state_versions[i]) return false;
  }
  return true;
}

py::list tensor_list(const OptimizerTree& t) {
  py::list out(t.tensors.size());
  PyObject** items = reinterpret_cast<PyListObject*>(out.ptr())->ob_item;
  for (size_t i = 0; i < t.tensors.size(); ++i) {
    Py_INCREF(t.tensors[i]);
    items[i] = t.tensors[i];
  }
  return out;
}

}  // namespace

bool optimizer_tree_supported() { return true; }

py::object build_optimizer_tree(py::handle optimizer_handle) {
  PyObject* optimizer = optimizer_handle.ptr();
  PyTypeObject* type = Py_TYPE(optimizer);
  if (!plain_optimizer_class(type) || type->tp_version_tag == 0) return py::none();
  auto tree = std::make_unique<OptimizerTree>();
  OptimizerTree& t = *tree;
  t.optimizer = optimizer;
  t.type = type;
  t.type_tag = type->tp_version_tag;
  t.dict = instance_dict(optimizer);
  // Looked up in only where that runs no code (str_keyed: every key an exact str); the others are walked in
  // Python, whose lookups hold what they read.
  if (t.dict == nullptr || !str_keyed(t.dict)) return py::none();
  t.dict_version = version_of(t.dict);
  t.groups = item_of(t.dict, optimizer_keys().param_groups);
  t.state = item_of(t.dict, optimizer_keys().state);
  // The state: a dict or torch's defaultdict (a subclass with a `get` of its own would be asked otherwise).
  static PyObject* defaultdict = py::object(py::module_::import("collections").attr("defaultdict")).release().ptr();
  if (t.groups == nullptr || !PyList_CheckExact(t.groups) || t.state == nullptr ||
      !(PyDict_CheckExact(t.state) || Py_TYPE(t.state) == reinterpret_cast<PyTypeObject*>(defaultdict))) {
    return py::none();
  }
  // Held while the traversal runs, and all it read checked again at the end: no lookup below runs Python
  // code, but an allocation may run the garbage collector, and with it any object's finalizer.
  py::object hold_dict = py::reinterpret_borrow<py::object>(t.dict);
  py::object hold_groups = py::reinterpret_borrow<py::object>(t.groups);
  py::object hold_state = py::reinterpret_borrow<py::object>(t.state);
  t.state_version = version_of(t.state);
  py::list names_out, tensors_out;
  std::vector<py::object> held;  // the groups, params lists and state dicts, while the lookups run
  AddressIndex state_of(static_cast<size_t>(PyDict_GET_SIZE(t.state)));
  {
    Py_ssize_t pos = 0;
    PyObject *key, *value;
    while (PyDict_Next(t.state, &pos, &key, &value)) state_of.insert(key, value);
  }
  const Py_ssize_t num_groups = PyList_GET_SIZE(t.groups);
  t.params_at.push_back(0);
  for (Py_ssize_t g = 0; g < num_groups; ++g) {
    PyObject* group = PyList_GET_ITEM(t.groups, g);
    if (!PyDict_CheckExact(group) || !str_keyed(group)) return py::none();
    PyObject* params = item_of(group, optimizer_keys().params);
    if (params == nullptr || !PyList_CheckExact(params)) return py::none();
    held.push_back(py::reinterpret_borrow<py::object>(group));
    held.push_back(py::reinterpret_borrow<py::object>(params));
    t.group_dicts.push_back(group);
    t.group_versions.push_back(version_of(group));
    t.params_lists.push_back(params);
    PyObject** listed = reinterpret_cast<PyListObject*>(params)->ob_item;
    t.params.insert(t.params.end(), listed, listed + PyList_GET_SIZE(params));
    t.params_at.push_back(t.params.size());
  }
  // Each parameter's state dict (a parameter's address alone: nothing of it is read).
  const size_t num_params = t.params.size();
  t.param_states.resize(num_params);
  t.param_state_versions.assign(num_params, 0);
  constexpr size_t kSlotAhead = 16;
  for (size_t i = 0; i < num_params; ++i) {
    if (i + kSlotAhead < num_params) state_of.prefetch(t.params[i + kSlotAhead]);
    t.param_states[i] = state_of.find(t.params[i]);
  }
  held.reserve(held.size() + num_params);
  t.tensors.reserve(3 * num_params);
  // Each state's tensors by sorted key. Memory-bound (a state dict, its table, its tensors, scattered): each
  // is asked for a few parameters ahead of its read, the dict furthest.
  constexpr size_t kDictAhead = 12, kTableAhead = 6, kValuesAhead = 3;
  auto exact_dict = [&](size_t i) -> PyObject* {
    PyObject* st = i < num_params ? t.param_states[i] : nullptr;
    return st != nullptr && PyDict_CheckExact(st) ? st : nullptr;
  };
  SortedStateKeys keys;  // one state's items, in sorted(state) order
  char prefix[48] = "state.";
  for (size_t i = 0; i < num_params; ++i) {
    if (i + kDictAhead < num_params && t.param_states[i + kDictAhead] != nullptr) {
      __builtin_prefetch(t.param_states[i + kDictAhead]);
    }
    if (PyObject* ahead = exact_dict(i + kTableAhead)) {
      const char* table = reinterpret_cast<const char*>(keys_of(ahead));
      __builtin_prefetch(table);
      __builtin_prefetch(table + 64);
    }
    if (PyObject* ahead = exact_dict(i + kValuesAhead); ahead != nullptr && str_keyed(ahead)) {
      Py_ssize_t pos = 0;
      PyObject *key, *value;
      while (PyDict_Next(ahead, &pos, &key, &value)) __builtin_prefetch(value);
    }
    PyObject* st = t.param_states[i];
    if (st == nullptr) continue;
    if (!PyDict_CheckExact(st) || !str_keyed(st)) return py::none();
    held.push_back(py::reinterpret_borrow<py::object>(st));
    t.param_state_versions[i] = version_of(st);
    if (!keys.read(st, /*ascii_only=*/false)) return py::none();
    char* end = std::to_chars(prefix + 6, prefix + sizeof(prefix) - 1, static_cast<int64_t>(i)).ptr;
    *end = '.';
    const size_t a = static_cast<size_t>(end - prefix) + 1;
    for (size_t k : keys.order()) {
      PyObject* v = keys.item(k).second;
      // (Tensors in a list, tuple or dict, LBFGS's history, are named by the Python walk; such a container
      // changes without its state dict's version tag, so a state holding one is never recorded.)
      if (PyList_Check(v) || PyTuple_Check(v) || PyDict_Check(v)) return py::none();
      if (!is_tensor(v)) continue;
      PyObject* name = state_name(prefix, a, static_cast<int64_t>(i), keys.item(k).first);
      if (PyList_Append(names_out.ptr(), name) < 0) {
        Py_DECREF(name);
        throw py::error_already_set();
      }
      Py_DECREF(name);
      if (PyList_Append(tensors_out.ptr(), v) < 0) throw py::error_already_set();
      t.tensors.push_back(v);
    }
  }
  shrink_if_slack(t.tensors);
  // Nothing a finalizer ran (see above) may have changed what was read.
  if (version_of(t.dict) != t.dict_version || version_of(t.state) != t.state_version) return py::none();
  for (size_t g = 0; g < t.group_dicts.size(); ++g) {
    if (version_of(t.group_dicts[g]) != t.group_versions[g]) return py::none();
  }
  for (size_t i = 0; i < t.param_states.size(); ++i) {
    if (t.param_states[i] != nullptr && version_of(t.param_states[i]) != t.param_state_versions[i]) return py::none();
  }
  if (!same_list_items(t.groups, t.group_dicts.data(), t.group_dicts.size())) return py::none();
  for (size_t g = 0; g < t.group_dicts.size(); ++g) {
    const size_t at = t.params_at[g];
    if (!same_list_items(t.params_lists[g], t.params.data() + at, t.params_at[g + 1] - at)) return py::none();
  }
  return py::make_tuple(py::cast(tree.release(), py::return_value_policy::take_ownership), names_out, tensors_out);
}

void bind_optimizer_tree(py::module_& m) {
  py::class_<OptimizerTree>(m, "OptimizerTree")
      .def(
          "tensors",
          [](OptimizerTree& t, py::handle optimizer) -> py::object {
            if (!unchanged(t, optimizer.ptr())) return py::none();
            return tensor_list(t);
          },
          py::arg("optimizer"),
          "The traversal's tensors, read from the unchanged optimizer; None if anything it depends on changed.")
      .def_property_readonly("num_params", [](const OptimizerTree& t) { return t.params.size(); });
}

#else  // no usable dict version tags: no recorded traversal

class OptimizerTree {};
bool optimizer_tree_supported() { return false; }
py::object build_optimizer_tree(py::handle) { return py::none(); }
void bind_optimizer_tree(py::module_& m) {
  py::class_<OptimizerTree>(m, "OptimizerTree")
      .def("tensors", [](const OptimizerTree&, py::handle) { return py::none(); }, py::arg("optimizer"));
}

#endif

}  // namespace gpu_offload::torch_ext
