// A plain nn.Module's traversal (named_parameters, then named_buffers, remove_duplicate=False) walked in C++
// through CPython's public API, each call, with nothing recorded. It serves where the recorded traversal
// (module_tree.cpp) cannot run: a CPython whose dicts lack the version tags that record relies on (3.13 and
// later) or whose layout its probes did not recognize. There a cached call on a plain module walked the module
// in Python (named_parameters, named_buffers and the strategy recognizers): 30 Y for 65536 nn.Linear.
//
// What the walk reads, it holds: each module, its __dict__, its three dicts and every key and tensor found is a
// strong reference before the next lookup. A lookup in a dict whose keys are not all str may run Python code
// (a key's __eq__), which may change the module; it cannot free what the walk is reading, and the walk then
// answers what it read, as the Python walk would have.
//
// The names are built as bytes and compared with the names the caller got last time (`previous`): where
// every one is the same, that very list is answered, and the plan cache finds the target's plan by the
// names' identity, as it does for a recorded traversal's list.
//
// With the GIL only: a free-threaded CPython (Py_GIL_DISABLED) walks in Python, since another thread may then
// change a dict while PyDict_Next hands out its items borrowed. So does optimizer_walk.cpp.
#include <Python.h>
#include <pybind11/pybind11.h>

#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "py_objects.hpp"
#include "traversal.hpp"

namespace py = pybind11;

namespace gpu_offload::torch_ext {

namespace {

struct ModuleNames {
  py::object parts[3];
  py::object methods[4];
  ModuleNames() {
    for (int i = 0; i < 3; ++i) {
      parts[i] = py::reinterpret_steal<py::object>(PyUnicode_InternFromString(kModuleParts[i]));
    }
    for (int i = 0; i < 4; ++i) {
      methods[i] = py::reinterpret_steal<py::object>(PyUnicode_InternFromString(kModuleMethods[i]));
    }
  }
};

const ModuleNames& module_names() {
  static const ModuleNames* n = new ModuleNames();  // (never freed: lives as long as the interpreter)
  return *n;
}

class Walker {
 public:
  Walker(PyTypeObject* module_type, std::vector<PyTypeObject*> refused)
      : module_type_(module_type), classes_(module_type, std::move(refused)) {}

  // false: not a plain traversal, or a name that is not ASCII (the caller walks the module in Python).
  bool visit(PyObject* module, int depth, bool root) {
    if (depth > 256) return false;  // a cycle, or deeper than any model: Python decides (and raises)
    PyTypeObject* type = Py_TYPE(module);
    if (!PyType_IsSubtype(type, module_type_) || !classes_.plain(type, root)) return false;
    py::object dict = py::reinterpret_steal<py::object>(PyObject_GenericGetDict(module, nullptr));
    if (!dict || !PyDict_CheckExact(dict.ptr())) {
      PyErr_Clear();
      return false;
    }
    for (const py::object& method : module_names().methods) {
      const int found = PyDict_Contains(dict.ptr(), method.ptr());
      if (found != 0) {
        if (found < 0) PyErr_Clear();
        return false;
      }
    }
    py::object parts[3];
    for (int p = 0; p < 3; ++p) {
      PyObject* part = PyDict_GetItemWithError(dict.ptr(), module_names().parts[p].ptr());  // (borrowed)
      if (part == nullptr || !PyDict_CheckExact(part)) {  // (an OrderedDict's order is not its table's)
        PyErr_Clear();
        return false;
      }
      parts[p] = py::reinterpret_borrow<py::object>(part);
    }
    // Each module's buffers are gathered with its parameters, in the same pre-order, and listed after all of
    // them: named_parameters and named_buffers walk the same modules in the same order.
    if (!members(parts[0].ptr(), param_names_, params_) || !members(parts[1].ptr(), buffer_names_, buffers_)) {
      return false;
    }
    if (distinct_ && PyDict_GET_SIZE(parts[0].ptr()) != 0 && PyDict_GET_SIZE(parts[1].ptr()) != 0) {
      distinct_ = disjoint(parts[0].ptr(), parts[1].ptr());  // (a parameter and a buffer of one name)
    }
    // The children, held, then visited in order (a visit may run code that changes this module's _modules:
    // the ones read here are visited, as a Python generator over the dict would have raised instead).
    const Py_ssize_t num_kids = PyDict_GET_SIZE(parts[2].ptr());
    if (num_kids == 0) return true;  // (a leaf)
    std::vector<std::pair<py::object, py::object>> kids;
    kids.reserve(static_cast<size_t>(num_kids));
    Py_ssize_t pos = 0;
    PyObject *key, *child;
    while (PyDict_Next(parts[2].ptr(), &pos, &key, &child)) {
      if (child == Py_None) continue;
      if (!PyUnicode_CheckExact(key) || !PyUnicode_IS_ASCII(key)) return false;
      distinct_ = distinct_ && traversal_key_ok(key);
      kids.emplace_back(py::reinterpret_borrow<py::object>(key), py::reinterpret_borrow<py::object>(child));
    }
    // (A child under the key of one of the module's own tensors: "<key>.<its tensor>" may then be another
    // name's. register_* and add_module refuse that; a write into the dicts does not.)
    if (distinct_ && !kids.empty() &&
        (PyDict_GET_SIZE(parts[0].ptr()) != 0 || PyDict_GET_SIZE(parts[1].ptr()) != 0)) {
      distinct_ = disjoint(parts[2].ptr(), parts[0].ptr()) && disjoint(parts[2].ptr(), parts[1].ptr());
    }
    for (size_t k = 0; k < kids.size(); ++k) {
      if (k + 2 < kids.size()) {  // (a sibling's header and the words before it, where its dict is kept: asked ahead)
        const char* ahead = reinterpret_cast<const char*>(kids[k + 2].second.ptr());
        __builtin_prefetch(ahead);
        __builtin_prefetch(ahead - 32);
      }
      const py::object& kid_key = kids[k].first;
      const py::object& kid = kids[k].second;
      const size_t at = path_.size();
      if (at != 0) path_.push_back('.');
      path_.append(reinterpret_cast<const char*>(PyUnicode_1BYTE_DATA(kid_key.ptr())),
                   static_cast<size_t>(PyUnicode_GET_LENGTH(kid_key.ptr())));
      const bool ok = visit(kid.ptr(), depth + 1, false);
      path_.resize(at);
      if (!ok) return false;
    }
    return true;
  }

  // (names, tensors, num_params, distinct): the names list `previous` itself where it holds exactly these names.
  py::tuple result(py::handle previous) {
    const size_t num_params = params_.size();
    std::vector<std::string> all_names = std::move(param_names_);
    all_names.insert(all_names.end(), std::make_move_iterator(buffer_names_.begin()),
                     std::make_move_iterator(buffer_names_.end()));
    std::vector<py::object> tensors = std::move(params_);
    tensors.insert(tensors.end(), std::make_move_iterator(buffers_.begin()), std::make_move_iterator(buffers_.end()));
    return py::make_tuple(names_list_of(all_names, previous), list_of(tensors), num_params, distinct_);
  }

 private:
  // A module's _parameters or _buffers: each tensor, held, and its name ("<path>.<key>"), as named_* yield them.
  bool members(PyObject* dict, std::vector<std::string>& out_names, std::vector<py::object>& out_values) {
    if (PyDict_GET_SIZE(dict) == 0) return true;  // (most modules' _buffers, and a container's _parameters)
    Py_ssize_t pos = 0;
    PyObject *key, *value;
    while (PyDict_Next(dict, &pos, &key, &value)) {
      if (value == Py_None) continue;
      if (!PyUnicode_CheckExact(key) || !PyUnicode_IS_ASCII(key) || !is_tensor_object(value)) return false;
      distinct_ = distinct_ && traversal_key_ok(key);
      std::string name;
      const size_t b = static_cast<size_t>(PyUnicode_GET_LENGTH(key));
      name.reserve(path_.size() + 1 + b);
      name = path_;
      if (!name.empty()) name.push_back('.');
      name.append(reinterpret_cast<const char*>(PyUnicode_1BYTE_DATA(key)), b);
      out_names.push_back(std::move(name));
      out_values.push_back(py::reinterpret_borrow<py::object>(value));
    }
    return true;
  }

  // Whether no key of `a` is one of `b`'s (false where it cannot be told).
  static bool disjoint(PyObject* a, PyObject* b) {
    Py_ssize_t pos = 0;
    PyObject *key, *value;
    while (PyDict_Next(a, &pos, &key, &value)) {
      if (!PyUnicode_CheckExact(key)) return false;
      py::object held = py::reinterpret_borrow<py::object>(key);
      const int found = PyDict_Contains(b, key);
      if (found != 0) {
        if (found < 0) PyErr_Clear();
        return false;
      }
    }
    return true;
  }

  PyTypeObject* module_type_;
  PlainModuleClasses classes_;  // (refusing the classes whose instances make the module another strategy's)
  std::string path_;  // the prefix of the module being visited
  bool distinct_ = true;  // (see ModuleTree::names_distinct)
  std::vector<std::string> param_names_, buffer_names_;
  std::vector<py::object> params_, buffers_;
};

}  // namespace

py::object names_list_of(const std::vector<std::string>& names, py::handle previous) {
  const size_t n = names.size();
  // Each previous name that is these very bytes is kept (no string made for it).
  const bool listed = PyList_CheckExact(previous.ptr());
  const Py_ssize_t old_size = listed ? PyList_GET_SIZE(previous.ptr()) : 0;
  auto same = [&](size_t i) {
    PyObject* old = PyList_GET_ITEM(previous.ptr(), static_cast<Py_ssize_t>(i));
    const std::string& name = names[i];
    return PyUnicode_CheckExact(old) && PyUnicode_IS_ASCII(old) &&
           static_cast<size_t>(PyUnicode_GET_LENGTH(old)) == name.size() &&
           std::memcmp(PyUnicode_1BYTE_DATA(old), name.data(), name.size()) == 0;
  };
  bool all_same = listed && old_size == static_cast<Py_ssize_t>(n);
  for (size_t i = 0; all_same && i < n; ++i) all_same = same(i);
  if (all_same) return py::reinterpret_borrow<py::object>(previous);
  return new_list(n, [&](size_t i) -> PyObject* {
    if (static_cast<Py_ssize_t>(i) < old_size && same(i)) {
      PyObject* old = PyList_GET_ITEM(previous.ptr(), static_cast<Py_ssize_t>(i));
      Py_INCREF(old);
      return old;
    }
    return PyUnicode_FromStringAndSize(names[i].data(), static_cast<Py_ssize_t>(names[i].size()));
  });
}

py::list list_of(std::vector<py::object>& items) {
  py::list out(items.size());
  for (size_t i = 0; i < items.size(); ++i) {
    PyList_SET_ITEM(out.ptr(), static_cast<Py_ssize_t>(i), items[i].release().ptr());
  }
  items.clear();
  return out;
}

py::object walk_module(py::handle root, py::handle module_type, py::tuple refused, py::handle previous) {
  if (!PyType_Check(module_type.ptr())) throw py::type_error("walk_module: module_type must be a class");
#ifdef Py_GIL_DISABLED
  // (Without the GIL another thread may change a dict while PyDict_Next hands out borrowed items: Python walks.)
  (void)root, (void)refused, (void)previous;
  return py::none();
#endif
  std::vector<PyTypeObject*> refused_types;
  std::vector<py::object> held;  // (the refused classes, alive through the walk)
  for (py::handle cls : refused) {
    if (!PyType_Check(cls.ptr())) throw py::type_error("walk_module: refused must hold classes");
    refused_types.push_back(reinterpret_cast<PyTypeObject*>(cls.ptr()));
    held.push_back(py::reinterpret_borrow<py::object>(cls));
  }
  py::object hold_root = py::reinterpret_borrow<py::object>(root);
  Walker walker(reinterpret_cast<PyTypeObject*>(module_type.ptr()), std::move(refused_types));
  if (!walker.visit(root.ptr(), 0, true)) return py::none();
  return walker.result(previous);
}

}  // namespace gpu_offload::torch_ext
