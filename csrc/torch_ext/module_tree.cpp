// A plain nn.Module's traversal (named_parameters, then named_buffers, remove_duplicate=False), recorded so
// that the next call can tell in one pass whether it is still the same, without walking it in Python.
//
// The traversal depends on the modules' classes (their named_modules, named_parameters, ...) and on three
// dicts per module: _parameters, _buffers, _modules. CPython gives every dict a version tag, a global counter
// value renewed by every change of its contents (PEP 509: set, delete, clear, update, pop, ...), and a class
// one that is renewed when the class or a base changes. So a module is unchanged when its class is the same
// with the same tag, its __dict__ is the same dict with the same tag (or, after an unrelated attribute
// changed, e.g. `training`, still binds the same three dicts and sets none of the traversal's methods on the
// instance), and those three dicts carry their recorded tags, or (_parameters and _buffers) still hold their
// recorded items, the same key objects bound to the same values in order (FSDP2 swaps each parameter out and
// back every step). Nothing a module can do to its parameters (setattr, register_*, del, writing into
// _parameters directly, replacing the dict, swapping __class__) escapes that, and torch's registration hooks,
// which miss `del` and direct dict writes, are not needed.
//
// Lookups are made only in dicts whose every key is an exact str (str_keyed), where they run no code; a
// module whose __dict__ holds another key is walked in Python.
//
// Only where the tags mean this: CPython 3.11 and 3.12 with the GIL (3.13 keeps inline values beside a
// materialized __dict__ and 3.14 retires the tag); elsewhere build_module_tree() says "unsupported" and the
// caller walks the module each call, in C++ through the public API (module_walk.cpp) where it can.
#include <Python.h>
#include <pybind11/pybind11.h>

#include <torch/csrc/autograd/python_variable.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "torch_ext.hpp"
#include "traversal.hpp"

#define GPU_OFFLOAD_MODULE_TREE GPU_OFFLOAD_DICT_VERSION_TAGS

namespace py = pybind11;

namespace gpu_offload::torch_ext {

#if GPU_OFFLOAD_MODULE_TREE
namespace {


struct ModuleFacts {
  PyObject* module;  // compared, and followed only once its parent's _modules was found unchanged
  PyTypeObject* type;
  unsigned int type_tag;
  PyObject* dict;  // the module's __dict__
  uint64_t dict_version;
  PyObject* parts[3];  // _parameters, _buffers, _modules
  uint64_t part_versions[3];
  // _parameters' and _buffers' items as recorded: [entries_at[p], entries_at[p] + num_entries[p]) of the
  // tree's entries.
  int32_t entries_at[2];
  int32_t num_entries[2];
};

// One item of a module's _parameters or _buffers as recorded: its key (a reference held by the tree, so that
// an equal address is that very str) and its value (compared only: None or a tensor).
struct Entry {
  PyObject* key;
  PyObject* value;
};


struct Interned {
  PyObject* parts[3];
  PyObject* methods[4];
  Interned() {
    for (int i = 0; i < 3; ++i) parts[i] = PyUnicode_InternFromString(kModuleParts[i]);
    for (int i = 0; i < 4; ++i) methods[i] = PyUnicode_InternFromString(kModuleMethods[i]);
  }
};

const Interned& interned() {
  static const Interned* names = new Interned();  // never freed: lives as long as the interpreter
  return *names;
}

// Whether an instance __dict__ shadows one of the traversal's methods (false with an error cleared too).
bool shadows_methods(PyObject* dict) {
  for (PyObject* name : interned().methods) {
    PyObject* found = PyDict_GetItemWithError(dict, name);  // borrowed
    if (found != nullptr) return true;
    if (PyErr_Occurred()) {
      PyErr_Clear();
      return true;
    }
  }
  return false;
}

// One of a module's three parts from its __dict__, where it is an exact dict (an OrderedDict's order is not
// its table's), else nullptr with no error set. Borrowed.
PyObject* part_of(PyObject* dict, PyObject* name) {
  PyObject* part = PyDict_GetItemWithError(dict, name);
  if (part == nullptr) {
    PyErr_Clear();
    return nullptr;
  }
  return PyDict_CheckExact(part) ? part : nullptr;
}

// Instances of one class keep their attributes under one shared keys table ("split" dicts, PEP 412), each its
// values in an array of its own. A walk reads such a table once: where the three parts sit in it, and whether
// none of its keys is one of the traversal's methods; every instance then finds its parts at those slots of
// its values, where lookups (7 a module, as many again to warm the next ones) were a third of the walk. A
// shared table only grows (a key an instance sets that it lacks is appended; one an instance deletes stays,
// its value NULL), so its entry count says whether it is still as read. Kept for one walk only, during which
// no Python code runs and every table read stays alive (the dicts it reads hold them).
class SharedKeysTables {
 public:
  struct Table {
    const DictKeys* keys;
    Py_ssize_t num_entries;
    Py_ssize_t at[3];  // each part's entry
    bool plain;  // each part has an entry, and no method does
  };

  // The facts of a split dict's table where it is plain, else nullptr (the dict is looked up in).
  const Table* of(PyObject* dict) {
    if (!layout_checked() || reinterpret_cast<PyDictObject*>(dict)->ma_values == nullptr) return nullptr;
    const DictKeys* keys = keys_of(dict);
    if (keys->dk_kind != kDictKeysSplit) return nullptr;
    for (const Table& t : tables_) {
      if (t.keys == keys && t.num_entries == keys->dk_nentries) return t.plain ? &t : nullptr;
    }
    if (tables_.size() >= kMaxTables) return nullptr;  // (a model of few classes has few tables: past that, look up)
    if (tables_.empty()) tables_.reserve(kMaxTables);  // (once, at the first: the pointers given stay valid)
    tables_.push_back(read(keys));
    return tables_.back().plain ? &tables_.back() : nullptr;
  }

  // The value a split dict holds for part p (nullptr: not set on this instance).
  static PyObject* slot(PyObject* dict, const Table& t, int p) {
    // (3.11's and 3.12's PyDictValues: the values array itself, opaque outside CPython.)
    return reinterpret_cast<PyObject**>(reinterpret_cast<PyDictObject*>(dict)->ma_values)[t.at[p]];
  }

  // part_of() through a table's facts: the part where it is an exact dict, else nullptr.
  static PyObject* part(PyObject* dict, const Table& t, int p) {
    PyObject* found = slot(dict, t, p);
    return found != nullptr && PyDict_CheckExact(found) ? found : nullptr;
  }

  // part() where the dict's table is plain (`t`, from of()), else part_of()'s lookup, made at a remembered
  // entry where the dict is a combined table (see combined()).
  PyObject* part_or_lookup(PyObject* dict, const Table* t, int p) {
    if (t != nullptr) return part(dict, *t, p);
    if (PyObject* found = combined(dict, p)) return PyDict_CheckExact(found) ? found : nullptr;
    PyObject* found = part_of(dict, interned().parts[p]);
    if (found != nullptr) learn(dict, p, found);
    return found;
  }

  // A module whose __dict__ is a combined table of its own (an instance that was given attributes its class's
  // shared table lacks after its dict was made: FSDP2's managed modules, each with two more) is looked up in,
  // three lookups each visit and as many again to warm the next. Modules made alike hold a part at the same
  // entry of their tables: the entry where the last one held it is read directly, where it holds that very
  // name (the interned key the class's code set it under; any other key is looked up). Borrowed, or nullptr.
  PyObject* combined(PyObject* dict, int p) const {
    const Py_ssize_t at = combined_at_[p];
    if (at < 0 || reinterpret_cast<PyDictObject*>(dict)->ma_values != nullptr) return nullptr;
    const DictKeys* keys = keys_of(dict);
    if (keys->dk_kind != kDictKeysUnicode || at >= keys->dk_nentries) return nullptr;
    const DictUnicodeEntry& e = unicode_entries(keys)[at];
    return e.me_key == interned().parts[p] ? e.me_value : nullptr;  // (a deleted entry: both null)
  }

  // Where a combined table holds part p (found by lookup), remembered for the next dict (none where not found).
  void learn(PyObject* dict, int p, PyObject* found) {
    combined_at_[p] = -1;
    if (!combined_layout_ok_ || reinterpret_cast<PyDictObject*>(dict)->ma_values != nullptr) return;
    const DictKeys* keys = keys_of(dict);
    if (keys->dk_kind != kDictKeysUnicode) return;
    const DictUnicodeEntry* entries = unicode_entries(keys);
    for (Py_ssize_t i = 0; i < keys->dk_nentries; ++i) {
      if (entries[i].me_key == interned().parts[p] && entries[i].me_value == found) {
        combined_at_[p] = i;
        return;
      }
    }
  }

  // Whether this CPython lays split dicts out as DictKeys and the values array read here assume: checked
  // once, at the helper's import (shared_keys_layout_ok), on instances of a class made for it; false keeps
  // every walk on plain lookups.
  static bool& layout_checked() {
    static bool ok = false;
    return ok;
  }

  static bool probe_layout();

 private:
  static constexpr size_t kMaxTables = 64;

  static Table read(const DictKeys* keys) {
    Table t{keys, keys->dk_nentries, {-1, -1, -1}, true};
    // (CPython caps a shared table at 30 entries; anything past a small bound is not read here.)
    if (t.num_entries < 0 || t.num_entries > 64) {
      t.plain = false;
      return t;
    }
    const DictUnicodeEntry* entries = unicode_entries(keys);
    auto same = [](PyObject* key, PyObject* name) {
      // (Exact strs compare by their characters, no Python code: an equal str that is not the interned one
      // is still that name.)
      return key == name || PyUnicode_Compare(key, name) == 0;
    };
    for (Py_ssize_t i = 0; i < t.num_entries; ++i) {
      PyObject* key = entries[i].me_key;
      if (key == nullptr || !PyUnicode_CheckExact(key)) {
        t.plain = false;
        break;
      }
      for (int p = 0; p < 3; ++p) {
        if (same(key, interned().parts[p])) t.at[p] = i;
      }
      for (PyObject* method : interned().methods) {
        if (same(key, method)) t.plain = false;
      }
    }
    for (int p = 0; p < 3; ++p) t.plain = t.plain && t.at[p] >= 0;
    return t;
  }

  std::vector<Table> tables_;
  Py_ssize_t combined_at_[3] = {-1, -1, -1};  // each part's entry in the last combined table it was found in
  const bool combined_layout_ok_ = combined_keys_layout_ok();  // (probed at the helper's import)
};

// A module's three parts from its __dict__ (exact dicts, borrowed), through `tables` where its table is plain
// (then no method is shadowed), else looked up. false: a part is missing or not an exact dict, or (looked up)
// a method is shadowed.
bool parts_of(PyObject* dict, SharedKeysTables& tables, PyObject* parts[3]) {
  const SharedKeysTables::Table* t = tables.of(dict);
  for (int p = 0; p < 3; ++p) {
    if ((parts[p] = tables.part_or_lookup(dict, t, p)) == nullptr) return false;
  }
  return t != nullptr || !shadows_methods(dict);
}

}  // namespace

class ModuleTree {
 public:
  std::vector<ModuleFacts> modules;
  std::vector<Entry> entries;
  std::vector<py::object> keys;  // the entries' keys, held
  // The traversal's tensors as recorded (parameters, then buffers): borrowed, and read only once every
  // module's dicts were found unchanged (then those dicts hold exactly these objects).
  std::vector<PyObject*> tensors;
  size_t num_tensors = 0;
  size_t num_params = 0;
  // Whether the traversal's names are distinct by construction, with their "<name>.grad"s too (see
  // traversal_key_ok): then bind() need not hash every name to find out.
  bool names_distinct = false;
  // tensors_with_grads(): the names it answered last (the traversal's, then "<name>.grad" of each parameter
  // that had a grad), for that set of parameters (`grads_of`) under that traversal's names (`base`), so that a
  // call finding the same set answers with the same list (the plan cache then compares names by identity);
  // and each "<name>.grad" made so far, by parameter index.
  py::object base;
  py::object names_with_grads;
  std::vector<int32_t> grads_of;
  std::vector<py::object> grad_names;
};

namespace {

// The methods a plain traversal goes through, as nn.Module defines them.
class Builder {
 public:
  Builder(PyTypeObject* module_type, std::vector<PyTypeObject*> refused, bool with_modules)
      : module_type_(module_type), classes_(module_type, std::move(refused)), with_modules_(with_modules) {}

  // false: not a plain traversal (the caller walks the module in Python). The module's prefix is `prefix`,
  // or, where it is nullptr, path_: while every name on the way down is ASCII (the usual case) a module's
  // prefix is bytes in one buffer, and only its tensors' names become str objects.
  bool visit(PyObject* module, PyObject* prefix, int depth, bool root) {
    if (depth > 256) return false;  // a cycle, or deeper than any model: Python decides
    PyTypeObject* type = Py_TYPE(module);
    if (!PyType_IsSubtype(type, module_type_) || !classes_.plain(type, root)) return false;
    unsigned int tag = type->tp_version_tag;
    if (tag == 0) return false;
    PyObject** dict_ptr = _PyObject_GetDictPtr(module);
    if (dict_ptr == nullptr || *dict_ptr == nullptr || !PyDict_CheckExact(*dict_ptr)) {
      PyErr_Clear();
      return false;
    }
    PyObject* dict = *dict_ptr;
    if (!str_keyed(dict)) return false;  // (its lookups could run code: the Python walk reads it)
    py::object hold_dict = py::reinterpret_borrow<py::object>(dict);  // (for the version check below)
    ModuleFacts facts{module, type, tag, dict, version_of(dict), {}, {}, {}, {}};
    if (!parts_of(dict, tables_, facts.parts)) return false;
    for (int p = 0; p < 3; ++p) {
      facts.part_versions[p] = version_of(facts.parts[p]);
      prefetch_table(reinterpret_cast<PyDictObject*>(facts.parts[p])->ma_keys);
    }
    // (Nothing in a str-keyed __dict__'s lookups runs Python code; should something have changed it, the
    // parts found before are not trusted.)
    if (version_of(dict) != facts.dict_version) return false;
    // Each item of _parameters and _buffers recorded, and each tensor among them named, in one pass of each.
    // named_parameters and named_buffers walk the same modules in the same order (pre-order): each module's
    // buffers are gathered with its parameters, while its dicts are at hand, and listed after all of them.
    for (int p = 0; p < 2; ++p) {
      facts.entries_at[p] = static_cast<int32_t>(tree_.entries.size());
      if (PyDict_GET_SIZE(facts.parts[p]) != 0 &&
          !members(facts.parts[p], prefix, p == 0 ? param_names_ : buffer_names_, p == 0 ? params_ : buffers_)) {
        return false;
      }
      facts.num_entries[p] = static_cast<int32_t>(tree_.entries.size()) - facts.entries_at[p];
    }
    if (distinct_ && PyDict_GET_SIZE(facts.parts[0]) != 0 && PyDict_GET_SIZE(facts.parts[1]) != 0) {
      distinct_ = disjoint(facts.parts[0], facts.parts[1]);  // (a parameter and a buffer of one name)
    }
    tree_.modules.push_back(facts);
    if (with_modules_) add_module(module, prefix);
    // The children, in order, each held (a reference taken) until the siblings before it are visited.
    const size_t first_kid = kids_.size();
    Py_ssize_t pos = 0;
    PyObject *name, *child;
    while (PyDict_Next(facts.parts[2], &pos, &name, &child)) {
      if (child == Py_None) continue;
      if (!PyUnicode_CheckExact(name)) return false;
      distinct_ = distinct_ && traversal_key_ok(name);
      kids_.emplace_back(name, child);
    }
    // (A child under the key of one of the module's own tensors: "<key>.<its tensor>" may then be another
    // name's, or a "<key>.grad". Register_* and add_module refuse that; a write into the dicts does not.)
    if (distinct_ && PyDict_GET_SIZE(facts.parts[2]) != 0 &&
        (PyDict_GET_SIZE(facts.parts[0]) != 0 || PyDict_GET_SIZE(facts.parts[1]) != 0)) {
      distinct_ = disjoint(facts.parts[2], facts.parts[0]) && disjoint(facts.parts[2], facts.parts[1]);
    }
    const size_t num_kids = kids_.size() - first_kid;
    for (size_t k = 0; k < num_kids; ++k) {
      if (k + 8 < num_kids) __builtin_prefetch(kids_[first_kid + k + 8].second, 1);
      held_.push_back(py::reinterpret_borrow<py::object>(kids_[first_kid + k].first));
      held_.push_back(py::reinterpret_borrow<py::object>(kids_[first_kid + k].second));
    }
    Sizes before_first{};
    for (size_t k = 0; k < num_kids; ++k) {
      warm_ahead(first_kid, num_kids, k);
      if (k == 0) before_first = sizes();
      if (k == 1) reserve_like_first(before_first, num_kids - 1);
      // (kids_ may grow, and move, while a child is visited: copied out first.)
      const auto [kid_name, kid] = kids_[first_kid + k];
      if (prefix == nullptr && PyUnicode_IS_ASCII(kid_name)) {
        const size_t at = path_.size();
        if (at != 0) path_.push_back('.');
        path_.append(reinterpret_cast<const char*>(PyUnicode_1BYTE_DATA(kid_name)),
                     static_cast<size_t>(PyUnicode_GET_LENGTH(kid_name)));
        const bool ok = visit(kid, nullptr, depth + 1, false);
        path_.resize(at);
        if (!ok) return false;
        continue;
      }
      py::object child_prefix = join_prefix(prefix, kid_name);
      if (!visit(kid, child_prefix.ptr(), depth + 1, false)) return false;
    }
    kids_.resize(first_kid);
    held_.resize(held_.size() - 2 * num_kids);
    return true;
  }

  py::object result() {
    const size_t num_params = params_.size();
    py::list names(num_params + buffers_.size()), tensors(num_params + buffers_.size());
    tree_.num_tensors = num_params + buffers_.size();
    tree_.num_params = num_params;
    tree_.names_distinct = distinct_;
    tree_.tensors.reserve(tree_.num_tensors);
    for (const py::object& t : params_) tree_.tensors.push_back(t.ptr());
    for (const py::object& t : buffers_) tree_.tensors.push_back(t.ptr());
    // The lists take the builder's references (no second reference taken and the first dropped).
    auto give = [](py::list& list, size_t at, std::vector<py::object>& from) {
      for (size_t i = 0; i < from.size(); ++i) PyList_SET_ITEM(list.ptr(), at + i, from[i].release().ptr());
      from.clear();
    };
    give(names, 0, param_names_);
    give(names, num_params, buffer_names_);
    give(tensors, 0, params_);
    give(tensors, num_params, buffers_);
    // (Where reserve_like_first guessed far too much.)
    shrink_if_slack(tree_.modules);
    shrink_if_slack(tree_.entries);
    shrink_if_slack(tree_.keys);
    auto* tree = new ModuleTree(std::move(tree_));
    py::object handle = py::cast(tree, py::return_value_policy::take_ownership);
    if (!with_modules_) return py::make_tuple(handle, names, tensors, num_params);
    first_visits();
    py::list paths(module_paths_.size()), modules(modules_.size());
    give(paths, 0, module_paths_);
    give(modules, 0, modules_);
    return py::make_tuple(handle, names, tensors, num_params, paths, modules);
  }

 private:
  // Memory-bound (a module, its __dict__ and three dicts, each scattered, then each dict's table): while
  // child k is visited, the objects of the next children are asked for in stages, each a few children
  // ahead of the one that reads what it asked for. Prefetches only: visit() reads and checks everything
  // itself, so a hint that went wrong costs a miss, nothing else.
  void warm_ahead(size_t first, size_t n, size_t k) {
    constexpr size_t kObject = 10, kDict = 8, kDictTable = 6, kParts = 4, kPartTables = 2, kValues = 1;
    auto kid = [&](size_t ahead) { return kids_[first + k + ahead].second; };
    if (k + kObject < n) {
      char* object = reinterpret_cast<char*>(kid(kObject));
      __builtin_prefetch(object);
      __builtin_prefetch(object - 3 * sizeof(PyObject*));  // (a managed __dict__'s pointer)
    }
    if (k + kDict < n) {
      if (PyObject* dict = instance_dict(kid(kDict))) __builtin_prefetch(dict);
    }
    if (k + kDictTable < n) {
      if (PyObject* dict = instance_dict(kid(kDictTable))) {
        prefetch_table(reinterpret_cast<PyDictObject*>(dict)->ma_keys);
        __builtin_prefetch(reinterpret_cast<PyDictObject*>(dict)->ma_values);
      }
    }
    // The stages that look the parts up (each for itself; visit() too) do so only in a dict where that runs
    // no code (str_keyed); visit() refuses the others.
    if (k + kParts < n) {
      if (PyObject* dict = keyed_dict(kid(kParts))) {
        const SharedKeysTables::Table* shared = tables_.of(dict);
        for (int p = 0; p < 3; ++p) {
          PyObject* part = shared != nullptr ? SharedKeysTables::slot(dict, *shared, p) : tables_.combined(dict, p);
          if (part == nullptr && shared == nullptr) part = PyDict_GetItemWithError(dict, interned().parts[p]);  // borrowed
          if (part == nullptr) PyErr_Clear();
          else __builtin_prefetch(part);  // (its type not checked: that would wait for the object)
        }
      }
    }
    if (k + kPartTables < n) {
      if (PyObject* dict = keyed_dict(kid(kPartTables))) {
        const SharedKeysTables::Table* shared = tables_.of(dict);
        for (int p = 0; p < 3; ++p) {
          if (PyObject* part = tables_.part_or_lookup(dict, shared, p)) {
            prefetch_table(reinterpret_cast<PyDictObject*>(part)->ma_keys);
          }
        }
      }
    }
    if (k + kValues < n) {  // (the first few tensors of _parameters: visit asks each for its type)
      if (PyObject* dict = keyed_dict(kid(kValues))) {
        if (PyObject* part = tables_.part_or_lookup(dict, tables_.of(dict), 0)) {
          Py_ssize_t pos = 0;
          PyObject *name, *value;
          for (int i = 0; i < 4 && PyDict_Next(part, &pos, &name, &value); ++i) __builtin_prefetch(value);
        }
      }
    }
  }

  // How much the record holds so far, vector by vector (see reserve_like_first).
  struct Sizes {
    size_t modules, entries, params, buffers, visits;
  };

  Sizes sizes() const {
    return {tree_.modules.size(), tree_.entries.size(), params_.size(), buffers_.size(), modules_.size()};
  }

  // Room for `more` siblings recorded like the first one was (from `at`, the sizes before it). Models repeat
  // their blocks (layers, experts), so this sizes each vector once where growing it by doubling copied it
  // and touched fresh pages each time (the record of 65536 one-tensor modules: about 11 ms less, 5484 -> 512
  // page faults). A guess too small leaves the vectors to grow as before; one too large is bounded by the
  // first child's size, and cut down at the end.
  void reserve_like_first(const Sizes& at, size_t more) {
    if (more < 3) return;  // (two siblings say little of the rest)
    const Sizes now = sizes();
    auto room = [more](auto& v, size_t was, size_t is) { v.reserve(is + (is - was) * more); };
    room(tree_.modules, at.modules, now.modules);
    room(tree_.entries, at.entries, now.entries);
    room(tree_.keys, at.entries, now.entries);
    room(params_, at.params, now.params);
    room(param_names_, at.params, now.params);
    room(buffers_, at.buffers, now.buffers);
    room(buffer_names_, at.buffers, now.buffers);
    if (with_modules_) {
      room(modules_, at.visits, now.visits);
      room(module_paths_, at.visits, now.visits);
    }
  }

  // A dict's key table: its header, indices and first entries (a module's dicts are small).
  static void prefetch_table(const void* keys) {
    __builtin_prefetch(keys);
    __builtin_prefetch(static_cast<const char*>(keys) + 64);
  }

  // A module's exact-dict __dict__, or nullptr (no error set). As visit() finds it (CPython keeps a class's
  // instance dicts before the object, "managed").
  static PyObject* instance_dict(PyObject* module) {
    PyObject** dict_ptr = _PyObject_GetDictPtr(module);
    if (dict_ptr == nullptr || *dict_ptr == nullptr) {
      PyErr_Clear();
      return nullptr;
    }
    return PyDict_CheckExact(*dict_ptr) ? *dict_ptr : nullptr;
  }

  // instance_dict(), where a lookup in it runs no code (else nullptr).
  static PyObject* keyed_dict(PyObject* module) {
    PyObject* dict = instance_dict(module);
    return dict != nullptr && str_keyed(dict) ? dict : nullptr;
  }

  // "prefix.name" for an ASCII prefix (`a` bytes) and an ASCII name, in one allocation straight from the
  // bytes; the name itself under an empty prefix.
  static py::object join_ascii(const char* prefix, size_t a, PyObject* name) {
    if (a == 0) return py::reinterpret_borrow<py::object>(name);
    const size_t b = static_cast<size_t>(PyUnicode_GET_LENGTH(name));
    PyObject* full = PyUnicode_New(static_cast<Py_ssize_t>(a + 1 + b), 127);
    if (full == nullptr) throw py::error_already_set();
    char* out = reinterpret_cast<char*>(PyUnicode_1BYTE_DATA(full));
    std::memcpy(out, prefix, a);
    out[a] = '.';
    std::memcpy(out + a + 1, PyUnicode_1BYTE_DATA(name), b);
    return py::reinterpret_steal<py::object>(full);
  }

  py::object join(PyObject* prefix, PyObject* name) {
    // "prefix.name" in one allocation (two PyUnicode_Concat calls made a string each; a traversal makes
    // one name per tensor, and one per module whose prefix is not ASCII).
    const Py_ssize_t a = PyUnicode_GET_LENGTH(prefix), b = PyUnicode_GET_LENGTH(name);
    if (a == 0) return py::reinterpret_borrow<py::object>(name);
    const Py_UCS4 widest = std::max(PyUnicode_MAX_CHAR_VALUE(prefix), PyUnicode_MAX_CHAR_VALUE(name));
    if (widest < 128) {  // ASCII, the usual case: plain bytes
      return join_ascii(reinterpret_cast<const char*>(PyUnicode_1BYTE_DATA(prefix)), static_cast<size_t>(a), name);
    }
    PyObject* full = PyUnicode_New(a + 1 + b, widest);
    if (full == nullptr) throw py::error_already_set();
    if (PyUnicode_CopyCharacters(full, 0, prefix, 0, a) < 0 || PyUnicode_WriteChar(full, a, '.') < 0 ||
        PyUnicode_CopyCharacters(full, a + 1, name, 0, b) < 0) {
      Py_DECREF(full);
      throw py::error_already_set();
    }
    return py::reinterpret_steal<py::object>(full);
  }

  // "prefix.name", the prefix as visit() has it (nullptr: path_, made a str only for a name not ASCII).
  py::object join_prefix(PyObject* prefix, PyObject* name) {
    if (prefix != nullptr) return join(prefix, name);
    if (PyUnicode_IS_ASCII(name)) return join_ascii(path_.data(), path_.size(), name);
    PyObject* path = PyUnicode_FromStringAndSize(path_.data(), static_cast<Py_ssize_t>(path_.size()));
    if (path == nullptr) throw py::error_already_set();
    py::object path_object = py::reinterpret_steal<py::object>(path);
    return join(path_object.ptr(), name);
  }

  // A traversal's name is its modules' keys and its tensor's key joined by "."; while no key is empty or holds
  // a "." (traversal_key_ok), the keys can be read back from a name, so two names are equal only where the keys
  // on their paths are, which a dict's distinct keys rule out but for the cases disjoint() is asked about.
  // Whether no key of `a` is one of `b`'s (both exact dicts; false where b's lookups could run code).
  static bool disjoint(PyObject* a, PyObject* b) {
    if (!str_keyed(b)) return false;
    Py_ssize_t pos = 0;
    PyObject *key, *value;
    while (PyDict_Next(a, &pos, &key, &value)) {
      if (!PyUnicode_CheckExact(key)) return false;
      const int found = PyDict_Contains(b, key);
      if (found != 0) {
        if (found < 0) PyErr_Clear();
        return false;
      }
    }
    return true;
  }

  // with_modules: each visit's (path, module), later reduced to named_modules()' items (first_visits). The
  // path is the prefix the module is visited under: `prefix`, or path_ where that is nullptr.
  void add_module(PyObject* module, PyObject* prefix) {
    if (prefix != nullptr) {
      module_paths_.push_back(py::reinterpret_borrow<py::object>(prefix));
    } else {
      PyObject* path = PyUnicode_FromStringAndSize(path_.data(), static_cast<Py_ssize_t>(path_.size()));
      if (path == nullptr) throw py::error_already_set();
      module_paths_.push_back(py::reinterpret_steal<py::object>(path));
    }
    modules_.push_back(py::reinterpret_borrow<py::object>(module));
  }

  // Keeps each module's first visit only, in order (named_modules() yields a module reached again once, and
  // not its children again: they were reached under its first visit too). A module reached twice is rare: a
  // sorted copy of the pointers tells whether any was before a set is made.
  void first_visits() {
    std::vector<PyObject*> sorted;
    sorted.reserve(modules_.size());
    for (const py::object& m : modules_) sorted.push_back(m.ptr());
    std::sort(sorted.begin(), sorted.end());
    if (std::adjacent_find(sorted.begin(), sorted.end()) == sorted.end()) return;
    std::unordered_set<PyObject*> seen;
    size_t kept = 0;
    for (size_t i = 0; i < modules_.size(); ++i) {
      if (!seen.insert(modules_[i].ptr()).second) continue;
      if (kept != i) {
        modules_[kept] = std::move(modules_[i]);
        module_paths_[kept] = std::move(module_paths_[i]);
      }
      ++kept;
    }
    modules_.resize(kept);
    module_paths_.resize(kept);
  }

  // A module's _parameters or _buffers: each item recorded (the tree's entries), and each tensor named under
  // `prefix` (nullptr: path_), as visit() reads it.
  bool members(PyObject* dict, PyObject* prefix, std::vector<py::object>& names, std::vector<py::object>& values) {
    Py_ssize_t pos = 0;
    PyObject *name, *value;
    while (PyDict_Next(dict, &pos, &name, &value)) {
      tree_.entries.push_back({name, value});
      tree_.keys.push_back(py::reinterpret_borrow<py::object>(name));
      if (value == Py_None) continue;
      if (!PyUnicode_CheckExact(name) || !is_tensor(value)) return false;
      distinct_ = distinct_ && traversal_key_ok(name);
      names.push_back(join_prefix(prefix, name));
      values.push_back(py::reinterpret_borrow<py::object>(value));
    }
    return true;
  }

  PyTypeObject* module_type_;
  PlainModuleClasses classes_;  // (refusing the classes whose instances make the module another strategy's)
  SharedKeysTables tables_;
  ModuleTree tree_;
  std::vector<std::pair<PyObject*, PyObject*>> kids_;  // (name, child) of the modules being visited, a stack
  std::vector<py::object> held_;  // kids_' references
  std::string path_;  // the prefix of the module being visited, while it is ASCII (see visit)
  bool distinct_ = true;  // (see ModuleTree::names_distinct)
  std::vector<py::object> param_names_, params_, buffer_names_, buffers_;
  // with_modules: named_modules() (each module once, at its first visit, pre-order): paths and modules.
  bool with_modules_;
  std::vector<py::object> module_paths_, modules_;
};

bool SharedKeysTables::probe_layout() {
  try {
    // Two instances of a class made here, each given the three parts in order: their __dict__s (split,
    // made when first asked for) share one keys table whose entries are the three names, and each finds its
    // own values at those slots.
    py::object type = py::reinterpret_borrow<py::object>(reinterpret_cast<PyObject*>(&PyType_Type));
    py::object base = py::reinterpret_borrow<py::object>(reinterpret_cast<PyObject*>(&PyBaseObject_Type));
    py::object cls = type("_gpu_offload_layout_probe", py::make_tuple(base), py::dict());
    py::object a = cls(), b = cls();
    py::object values[2][3];
    for (int k = 0; k < 2; ++k) {
      for (int p = 0; p < 3; ++p) {
        values[k][p] = py::dict();
        py::setattr(k == 0 ? a : b, interned().parts[p], values[k][p]);
      }
    }
    py::object dicts[2] = {a.attr("__dict__"), b.attr("__dict__")};
    for (const py::object& d : dicts) {
      if (!PyDict_CheckExact(d.ptr()) || reinterpret_cast<PyDictObject*>(d.ptr())->ma_values == nullptr) return false;
    }
    const DictKeys* keys = keys_of(dicts[0].ptr());
    if (keys != keys_of(dicts[1].ptr()) || keys->dk_kind != kDictKeysSplit || keys->dk_nentries != 3) return false;
    const Table t = read(keys);
    if (!t.plain || t.at[0] != 0 || t.at[1] != 1 || t.at[2] != 2) return false;
    for (int k = 0; k < 2; ++k) {
      for (int p = 0; p < 3; ++p) {
        if (part(dicts[k].ptr(), t, p) != values[k][p].ptr()) return false;
      }
    }
    return true;
  } catch (const py::error_already_set&) {
    PyErr_Clear();
    return false;
  }
}

}  // namespace

bool module_tree_supported() { return true; }

bool shared_keys_layout_ok() {
  static const bool ok = SharedKeysTables::layout_checked() = SharedKeysTables::probe_layout();
  return ok;
}

py::object build_module_tree(py::handle root, py::handle module_type, py::tuple refused, bool with_modules) {
  if (!PyType_Check(module_type.ptr())) throw py::type_error("module_type must be torch.nn.Module");
  std::vector<PyTypeObject*> refused_types;
  for (py::handle t : refused) {
    if (!PyType_Check(t.ptr())) throw py::type_error("refused: classes only");
    refused_types.push_back(reinterpret_cast<PyTypeObject*>(t.ptr()));
  }
  Builder b(reinterpret_cast<PyTypeObject*>(module_type.ptr()), std::move(refused_types), with_modules);
  if (!b.visit(root.ptr(), nullptr, 0, true)) return py::none();
  return b.result();
}

namespace {

// Whether a _parameters or _buffers dict whose tag moved still holds its recorded items: the same key objects
// (held by the tree: an equal address is that str) bound to the same values, in the same order. FSDP2 writes
// each parameter's slot twice a step (the unsharded tensor in, the sharded DTensor back), and anyone may
// write a slot with what it holds already: the traversal is the same. A value compared equal is the live
// object the dict holds now, so the recorded pointer to it is exact. (PyDict_Next runs no Python code.)
bool same_items(PyObject* part, const Entry* entries, int32_t n) {
  if (PyDict_GET_SIZE(part) != n) return false;
  Py_ssize_t pos = 0;
  PyObject *key, *value;
  for (int32_t i = 0; PyDict_Next(part, &pos, &key, &value); ++i) {
    if (key != entries[i].key || value != entries[i].value) return false;
  }
  return true;
}

// A module's __dict__ that is another dict, or was written (e.g. `training`): whether it still binds the
// recorded three dicts and shadows no method; if so it is recorded anew. (Out of the check's loop: rare.)
[[gnu::noinline]] bool same_parts(ModuleFacts& m, PyObject* dict, SharedKeysTables& tables) {
  // (A dict whose lookups could run code is not looked up in: the traversal is recorded again, and the
  // builder refuses it. Code run here could change or free what this check has already passed.)
  PyObject* parts[3];
  if (!PyDict_CheckExact(dict) || !str_keyed(dict) || !parts_of(dict, tables, parts)) return false;
  for (int p = 0; p < 3; ++p) {
    if (parts[p] != m.parts[p]) return false;
  }
  m.dict = dict;  // the same three dicts are bound: the change was elsewhere (e.g. `training`)
  m.dict_version = version_of(dict);
  return true;
}

// Whether one recorded module is unchanged (see the top of this file). Its pointer is the caller's root, or
// held by a _modules dict found unchanged before it (pre-order), so following it is safe.
inline bool module_unchanged(ModuleFacts& m, const std::vector<Entry>& entries, SharedKeysTables& tables) {
  PyTypeObject* type = Py_TYPE(m.module);
  if (type != m.type || type->tp_version_tag != m.type_tag) return false;
  PyObject** dict_ptr = _PyObject_GetDictPtr(m.module);
  if (dict_ptr == nullptr || *dict_ptr == nullptr) {
    PyErr_Clear();
    return false;
  }
  PyObject* dict = *dict_ptr;
  if ((dict != m.dict || version_of(dict) != m.dict_version) && !same_parts(m, dict, tables)) return false;
  // (A dict found unchanged is alive: the unchanged __dict__ above holds it.)
  for (int p = 0; p < 3; ++p) {
    const uint64_t version = version_of(m.parts[p]);
    if (version == m.part_versions[p]) continue;
    if (p == 2 || !same_items(m.parts[p], entries.data() + m.entries_at[p], m.num_entries[p])) return false;
    m.part_versions[p] = version;  // written, yet holding what it held: tagged anew
  }
  return true;
}

// Memory-bound (a module, its class, its __dict__ and three dicts, scattered): ask for the next modules'
// objects a few records ahead (a prefetch never faults, even on a pointer that went stale).
inline void prefetch_module(const ModuleFacts& m) {
  __builtin_prefetch(m.module);
  __builtin_prefetch(m.dict);
  __builtin_prefetch(m.parts[0]);
  __builtin_prefetch(m.parts[1]);
  __builtin_prefetch(m.parts[2]);
}

// Whether every recorded module is unchanged, in pre-order (each module's pointer is held by its parent's
// _modules dict, found unchanged just before).
bool walk(ModuleTree& tree, PyObject* root) {
  if (tree.modules.empty() || tree.modules[0].module != root) return false;
  const size_t n = tree.modules.size();
  constexpr size_t kAhead = 4;
  SharedKeysTables tables;  // (read only where a __dict__ changed, e.g. `training`: a table a class)
  for (size_t i = 0; i < n; ++i) {
    if (i + kAhead < n) prefetch_module(tree.modules[i + kAhead]);
    if (!module_unchanged(tree.modules[i], tree.entries, tables)) return false;
  }
  return true;
}

}  // namespace

bool check_module_tree(const ModuleTree& tree, py::handle root) {
  // A __dict__ that changed but binds the same parts is re-tagged: mutable state behind a const handle.
  return walk(const_cast<ModuleTree&>(tree), root.ptr());
}

// The recorded tensors into a list's first slots, each a new reference (the unchanged dicts hold them: alive).
static void put_tensors(const ModuleTree& tree, PyObject** items) {
  const size_t n = tree.tensors.size();
  constexpr size_t kAhead = 24;  // (memory-bound: each object's refcount, a few ahead)
  for (size_t i = 0; i < n; ++i) {
    if (i + kAhead < n) __builtin_prefetch(tree.tensors[i + kAhead], 1);
    Py_INCREF(tree.tensors[i]);
    items[i] = tree.tensors[i];
  }
}

// The traversal's tensors, read again from the unchanged dicts (the tree keeps no tensor alive), or None
// when `root` changed.
py::object tree_tensors(const ModuleTree& tree, py::handle root) {
  if (!walk(const_cast<ModuleTree&>(tree), root.ptr())) return py::none();
  py::list out(tree.tensors.size());
  put_tensors(tree, reinterpret_cast<PyListObject*>(out.ptr())->ob_item);
  return std::move(out);
}

// The traversal with its gradients, as the Python walk names them with include_grads: the parameters and
// buffers, then the .grad of each parameter (in order, a tied one under each of its names) that has one;
// None when `root` changed. `names`: the traversal's names (build_module_tree's list). Answers (tensors,
// names), the names being `names` itself where no parameter has a grad.
py::object tree_tensors_with_grads(ModuleTree& tree, py::handle root, py::handle names) {
  if (!PyList_CheckExact(names.ptr()) || static_cast<size_t>(PyList_GET_SIZE(names.ptr())) != tree.tensors.size()) {
    throw py::value_error("tensors_with_grads: names must be the traversal's names list");
  }
  if (!walk(tree, root.ptr())) return py::none();
  const size_t n = tree.tensors.size(), num_params = tree.num_params;
  std::vector<int32_t> grads_of;
  std::vector<py::object> grads;
  // Memory-bound, a chain of three objects per parameter: its Python object, its TensorImpl, the TensorImpl's
  // autograd meta (which holds the grad). Each is asked for ahead, the next further ahead than the one it
  // is reached from, as any_grad does (65536 parameters with grads: about 6.5 -> 4.5 ms).
  constexpr size_t kAhead = 8;
  for (size_t i = 0; i < num_params; ++i) {
    if (i + 3 * kAhead < num_params) __builtin_prefetch(tree.tensors[i + 3 * kAhead]);
    if (i + 2 * kAhead < num_params && is_tensor(tree.tensors[i + 2 * kAhead])) {
      __builtin_prefetch(THPVariable_Unpack(tree.tensors[i + 2 * kAhead]).unsafeGetTensorImpl());
    }
    if (i + kAhead < num_params && is_tensor(tree.tensors[i + kAhead])) {
      const c10::AutogradMetaInterface* meta =
          THPVariable_Unpack(tree.tensors[i + kAhead]).unsafeGetTensorImpl()->autograd_meta();
      if (meta != nullptr) __builtin_prefetch(meta);
    }
    PyObject* p = tree.tensors[i];
    if (!is_tensor(p)) return py::none();  // (cannot be: the unchanged dicts hold what was recorded)
    // TensorImpl::grad(), not Tensor::grad(): the same tensor, without the non-leaf warning.
    const at::Tensor& grad = THPVariable_Unpack(p).unsafeGetTensorImpl()->grad();
    if (!grad.defined()) continue;
    grads_of.push_back(static_cast<int32_t>(i));
    grads.push_back(py::reinterpret_steal<py::object>(THPVariable_Wrap(grad)));  // (p.grad's own object)
  }
  py::list out(n + grads.size());
  PyObject** items = reinterpret_cast<PyListObject*>(out.ptr())->ob_item;
  put_tensors(tree, items);
  for (size_t k = 0; k < grads.size(); ++k) items[n + k] = grads[k].release().ptr();
  if (grads_of.empty()) return py::make_tuple(out, names);
  if (!(tree.base.ptr() == names.ptr() && tree.grads_of == grads_of && tree.names_with_grads)) {
    if (tree.base.ptr() != names.ptr()) tree.grad_names.clear();  // (names of another traversal's list)
    tree.grad_names.resize(num_params);
    py::list named(n + grads_of.size());
    PyObject** name_items = reinterpret_cast<PyListObject*>(named.ptr())->ob_item;
    PyObject** base_items = reinterpret_cast<PyListObject*>(names.ptr())->ob_item;
    for (size_t i = 0; i < n; ++i) {
      Py_INCREF(base_items[i]);
      name_items[i] = base_items[i];
    }
    static PyObject* suffix = PyUnicode_InternFromString(".grad");  // (never freed: the interpreter's)
    for (size_t k = 0; k < grads_of.size(); ++k) {
      py::object& grad_name = tree.grad_names[static_cast<size_t>(grads_of[k])];
      if (!grad_name) {
        PyObject* joined = PyUnicode_Concat(base_items[grads_of[k]], suffix);
        if (joined == nullptr) throw py::error_already_set();
        grad_name = py::reinterpret_steal<py::object>(joined);
      }
      name_items[n + k] = grad_name.inc_ref().ptr();
    }
    tree.base = py::reinterpret_borrow<py::object>(names);
    tree.grads_of = std::move(grads_of);
    tree.names_with_grads = std::move(named);
  }
  return py::make_tuple(out, tree.names_with_grads);
}

void bind_module_tree(py::module_& m) {
  py::class_<ModuleTree>(m, "ModuleTree")
      .def("check", &check_module_tree, py::arg("root"),
           "Whether `root` is the module this traversal was recorded from and nothing it depends on changed.")
      .def("tensors", &tree_tensors, py::arg("root"),
           "The traversal's tensors (parameters, then buffers), read from the unchanged module; None if it changed.")
      .def("tensors_with_grads", &tree_tensors_with_grads, py::arg("root"), py::arg("names"),
           "(tensors, names) of the traversal with its gradients, as the Python walk with include_grads names them "
           "(parameters, buffers, then each parameter's .grad as \"<name>.grad\"); None if `root` changed. "
           "`names`: the traversal's names; answered as is where no parameter has a grad, and the same list "
           "again while the same parameters have one.")
      .def_property_readonly("num_modules", [](const ModuleTree& t) { return t.modules.size(); })
      .def_property_readonly("names_distinct", [](const ModuleTree& t) { return t.names_distinct; },
                             "Whether the traversal's names, and each with \".grad\" appended, are distinct by how "
                             "they were made (no key empty or holding a \".\", no child under a tensor's key, no "
                             "parameter and buffer of one name): bind() need not check them.");
}

#else  // no usable dict version tags: no recorded traversal

class ModuleTree {};
bool module_tree_supported() { return false; }
bool shared_keys_layout_ok() { return false; }
py::object build_module_tree(py::handle, py::handle, py::tuple, bool) { return py::none(); }
bool check_module_tree(const ModuleTree&, py::handle) { return false; }
void bind_module_tree(py::module_& m) {
  py::class_<ModuleTree>(m, "ModuleTree")
      .def("check", &check_module_tree, py::arg("root"))
      .def("tensors", [](const ModuleTree&, py::handle) { return py::none(); }, py::arg("root"))
      .def("tensors_with_grads", [](const ModuleTree&, py::handle, py::handle) { return py::none(); },
           py::arg("root"), py::arg("names"))
      .def_property_readonly("names_distinct", [](const ModuleTree&) { return false; });
}

#endif

}  // namespace gpu_offload::torch_ext
