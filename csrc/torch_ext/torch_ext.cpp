// gpu_offload._torch_ext: the thin torch-aware helper, for what only torch's C++ reaches. Built against one
// torch (its headers, C++ ABI and libraries) and loaded only by that torch (gpu_offload/torch_ext.py checks
// the version recorded at build time before it loads this file); everything here has a pure-Python
// fallback, and nothing here touches CUDA. The torch-free core (_C) does not depend on it.
#include <Python.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <c10/core/StorageImpl.h>
#include <torch/version.h>  // TORCH_VERSION_MAJOR, TORCH_VERSION_MINOR
#include <torch/csrc/Storage.h>
#include <torch/csrc/autograd/python_variable.h>

#include <cstddef>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "torch_ext.hpp"

#ifndef GPU_OFFLOAD_TORCH_EXT_RECORD
#error "GPU_OFFLOAD_TORCH_EXT_RECORD (JSON: the torch built against) must be defined by the build (setup.py)"
#endif

// The torch this was built against, read from the file by gpu_offload/torch_ext.py before it loads it
// (loading it into another torch could fail on symbols or, worse, load and misread torch's structs).
extern "C" __attribute__((used, visibility("default")))
const char gpu_offload_torch_ext_record[] = "gpu_offload_torch_ext_record:" GPU_OFFLOAD_TORCH_EXT_RECORD;

namespace py = pybind11;

namespace gpu_offload::torch_ext {

bool is_tensor_object(PyObject* obj) { return is_tensor(obj); }

c10::StorageImpl* storage_of(PyObject* item) {
  // A tensor (its storage), an UntypedStorage, or a storage's _cdata (the StorageImpl address: trusted,
  // the caller holds the storage). Tensors and storages are checked, so a wrong object is a TypeError.
  if (is_tensor(item)) {
    const at::Tensor& t = THPVariable_Unpack(item);
    if (!t.unsafeGetTensorImpl()->has_storage()) {
      throw py::type_error("a tensor without storage (sparse, nested, a wrapper subclass?)");
    }
    // unsafe_storage(): no access check (the storage may refuse access already).
    return t.unsafeGetTensorImpl()->unsafe_storage().unsafeGetStorageImpl();
  }
  if (THPStorage_Check(item)) {
    return THPStorage_Unpack(item).unsafeGetStorageImpl();
  }
  if (PyLong_Check(item)) {
    void* p = PyLong_AsVoidPtr(item);
    if (p == nullptr) {
      if (PyErr_Occurred()) throw py::error_already_set();
      throw py::value_error("storage key 0");
    }
    return static_cast<c10::StorageImpl*>(p);
  }
  throw py::type_error(std::string("expected a tensor, an UntypedStorage or a storage's _cdata, got ") +
                       Py_TYPE(item)->tp_name);
}

std::vector<c10::StorageImpl*> storages_of(PyObject* items, bool keys_allowed) {
  PyObject* seq = PySequence_Fast(items, "expected a sequence of tensors or storages");
  if (seq == nullptr) throw py::error_already_set();
  py::object hold = py::reinterpret_steal<py::object>(seq);
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
  PyObject** objs = PySequence_Fast_ITEMS(seq);
  std::vector<c10::StorageImpl*> out;
  out.reserve(static_cast<size_t>(n));
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (!keys_allowed && PyLong_Check(objs[i])) throw py::type_error("expected tensors or UntypedStorages, got an int");
    out.push_back(storage_of(objs[i]));
  }
  return out;
}

namespace {

// Refusing access: StorageImpl::release_data_and_set_meta_custom_data_ptr_error_msg_ (torch 2.6 and later; despite
// its name it only sets the flag and the message). Lifting it: clear_data_ptr_access_error_msg_, public from torch
// 2.12. Between the two (2.6-2.11, the torch of many RL stacks) there is no public call to lift a refusal, and
// without one an offloaded tensor that is touched reads released memory (a SIGSEGV on the CPU): there the lift
// does what 2.12's clear_data_ptr_access_error_msg_() does, verbatim: clears the private flag and the message,
// then refreshes the private summary of the checks. The two private members are named through an explicit
// instantiation, where the standard waives access checking ([temp.spec.general]/6); 2.6-2.11 have both, with
// these types (checked against each release's StorageImpl.h: 2.6, 2.8, 2.9, 2.10, 2.11).
template <typename S, typename = void>
struct has_refusal : std::false_type {};
template <typename S>
struct has_refusal<S, std::void_t<decltype(std::declval<S&>().release_data_and_set_meta_custom_data_ptr_error_msg_(
                          std::optional<std::string>()))>> : std::true_type {};
template <typename S, typename = void>
struct has_lift : std::false_type {};
template <typename S>
struct has_lift<S, std::void_t<decltype(std::declval<S&>().clear_data_ptr_access_error_msg_())>> : std::true_type {};

#if defined(TORCH_VERSION_MAJOR) && TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 6 && TORCH_VERSION_MINOR < 12
#define GPU_OFFLOAD_PRIVATE_LIFT 1
// Each Tag's get() answers the member pointer the instantiation below was given.
template <typename Tag, typename Tag::type kMember>
struct PrivateMember {
  friend typename Tag::type get(Tag) { return kMember; }
};
struct ThrowOnAccessFlag {
  using type = bool c10::StorageImpl::*;
  friend type get(ThrowOnAccessFlag);
};
struct RefreshDataPtrCheck {
  using type = void (c10::StorageImpl::*)();
  friend type get(RefreshDataPtrCheck);
};
template struct PrivateMember<ThrowOnAccessFlag, &c10::StorageImpl::throw_on_immutable_data_ptr_>;
template struct PrivateMember<RefreshDataPtrCheck, &c10::StorageImpl::refresh_has_data_ptr_check>;
#else
#define GPU_OFFLOAD_PRIVATE_LIFT 0
#endif

// Whether this torch can refuse access and lift the refusal again: the guard is compiled only where both work.
template <typename S>
constexpr bool access_guard_of() {
  return has_refusal<S>::value && (has_lift<S>::value || GPU_OFFLOAD_PRIVATE_LIFT);
}
constexpr bool kAccessGuard = access_guard_of<c10::StorageImpl>();

// StorageImpl::get_extra_meta() (public where the access guard is): the message's own slot, which a
// refusal can move a string into, and a lifting move it out of, instead of a copy and a free per storage
// per cycle (a third of an offload+reload of 65536 tiny tensors).
template <typename S, typename = void>
struct has_extra_meta : std::false_type {};
template <typename S>
struct has_extra_meta<S, std::void_t<decltype(std::declval<S&>().get_extra_meta().custom_data_ptr_error_msg_)>>
    : std::true_type {};

// Templates on the storage type, so that `if constexpr` discards the calls of members this torch lacks (in
// a plain function the discarded branch would still have to compile).
template <typename S>
void refuse_one(S* storage, const std::string& message) {
  if constexpr (access_guard_of<S>()) storage->release_data_and_set_meta_custom_data_ptr_error_msg_(message);
}

template <typename S>
void allow_one(S* storage) {
  if constexpr (has_lift<S>::value) {
    storage->clear_data_ptr_access_error_msg_();
  } else if constexpr (access_guard_of<S>()) {
#if GPU_OFFLOAD_PRIVATE_LIFT
    // (clear_data_ptr_access_error_msg_() of torch 2.12, on 2.6-2.11's members.)
    storage->*get(ThrowOnAccessFlag{}) = false;
    storage->get_extra_meta().custom_data_ptr_error_msg_ = std::nullopt;
    (storage->*get(RefreshDataPtrCheck{}))();
#endif
  }
}

template <typename S>
void refuse_one_moving(S* storage, std::string& message) {
  if constexpr (access_guard_of<S>() && has_extra_meta<S>::value) {
    storage->release_data_and_set_meta_custom_data_ptr_error_msg_(std::nullopt);  // the flag, no message yet
    auto& slot = storage->get_extra_meta().custom_data_ptr_error_msg_;
    slot.emplace();
    slot->swap(message);
  } else {
    refuse_one(storage, message);
  }
}

template <typename S>
void allow_one_moving(S* storage, std::string& message) {
  if constexpr (access_guard_of<S>() && has_extra_meta<S>::value) {
    auto& slot = storage->get_extra_meta().custom_data_ptr_error_msg_;
    if (slot && message.empty()) message.swap(*slot);
  }
  allow_one(storage);
}

template <typename S>
void prefetch_refusal_of(S* storage) {
  if constexpr (access_guard_of<S>() && has_extra_meta<S>::value) {
    __builtin_prefetch(&storage->get_extra_meta(), 1);
  }
}

}  // namespace

void prefetch_refusal(c10::StorageImpl* storage) { prefetch_refusal_of(storage); }
void refuse_access_of(c10::StorageImpl* storage, const std::string& message) { refuse_one(storage, message); }
void allow_access_of(c10::StorageImpl* storage) { allow_one(storage); }
void refuse_access_moving(c10::StorageImpl* storage, std::string& message) { refuse_one_moving(storage, message); }
void allow_access_moving(c10::StorageImpl* storage, std::string& message) { allow_one_moving(storage, message); }

namespace {

void require_access_guard() {
  if (!kAccessGuard) {
    throw std::runtime_error(
        "this torch's StorageImpl cannot refuse data-pointer access and lift the refusal again (torch 2.6 and "
        "later can)");
  }
}

}  // namespace
}  // namespace gpu_offload::torch_ext

PYBIND11_MODULE(_torch_ext, m) {
  using namespace gpu_offload::torch_ext;
  m.doc() = "gpu_offload's torch-aware helper (see gpu_offload.torch_ext)";
  m.attr("RECORD") = GPU_OFFLOAD_TORCH_EXT_RECORD;
  m.attr("CXX11_ABI") = static_cast<bool>(_GLIBCXX_USE_CXX11_ABI);
  m.attr("ACCESS_GUARD") = kAccessGuard;

  m.def(
      "refuse_access",
      [](const py::sequence& items, const std::string& message) {
        require_access_guard();
        for (c10::StorageImpl* s : storages_of(items.ptr(), true)) refuse_access_of(s, message);
      },
      py::arg("storages"), py::arg("message"),
      "Makes every storage refuse any data-pointer access (reads, writes, data_ptr(), torch.save) with a "
      "RuntimeError carrying `message`, in one call. Items: tensors, UntypedStorages, or storages' _cdata "
      "(the caller keeps those storages alive). The data is not touched.");
  m.def(
      "allow_access", [](const py::sequence& items) {
        require_access_guard();
        for (c10::StorageImpl* s : storages_of(items.ptr(), true)) allow_access_of(s);
      },
      py::arg("storages"), "Lifts refuse_access() from every storage, in one call.");
  m.def(
      "access_refused",
      [](py::handle item) {
        // The flag itself is private; a const data() call throws exactly when it is set.
        c10::StorageImpl* s = storage_of(item.ptr());
        try {
          (void)static_cast<const c10::StorageImpl*>(s)->data();
          return false;
        } catch (const c10::Error&) {
          return true;
        }
      },
      py::arg("storage"), "Whether a storage refuses data-pointer access.");

  // An overload of refuse_access, tried after the one above: a message of its own for each storage (the
  // offloaded tensor it names), still one call for all.
  m.def(
      "refuse_access",
      [](const py::sequence& items, const std::vector<std::string>& messages) {
        require_access_guard();
        const auto storages = storages_of(items.ptr(), true);
        if (messages.size() != storages.size()) {
          throw py::value_error("refuse_access: " + std::to_string(messages.size()) + " messages for " +
                                std::to_string(storages.size()) + " storages");
        }
        for (std::size_t i = 0; i < storages.size(); ++i) refuse_access_of(storages[i], messages[i]);
      },
      py::arg("storages"), py::arg("messages"));

  // -- per-call checks (target.cpp) ------------------------------------------------------------------
  py::class_<TargetRecord>(m, "TargetRecord")
      .def("check", &TargetRecord::check, py::arg("tensors"), py::arg("bump") = false,
           "Whether the tensors are still the recorded ones, unchanged; with bump, each one's version counter is "
           "then bumped (an in-place write), only if all of them are.")
      .def("same_views", &TargetRecord::same_views, py::arg("tensors"),
           "check() without the storages' memory and sizes: the same tensors on the same storages, viewing them "
           "the same way.")
      .def("same_layout", &TargetRecord::same_layout, py::arg("other"),
           "Whether this record's tensors lay their storages out as `other`'s did when it was made (the same "
           "storage grouping, views and dtypes, storage sizes and devices): under the same names, the same "
           "layout. Reads the two records only.")
      .def("same_storages", &TargetRecord::same_storages, py::arg("other"),
           "Whether the two records were made of the same storages, in order (reads the two records only).")
      .def("check_held", &TargetRecord::check_held, py::arg("tensors"),
           "check(), holding the live storages for resize_live and watch_live: a HeldStorages, or None where "
           "check() answers False.")
      .def("refresh", &TargetRecord::refresh, py::arg("tensors"))
      .def("keys", &TargetRecord::keys)
      .def("storage_nbytes", &TargetRecord::storage_nbytes)
      .def("storage_data_ptrs", &TargetRecord::storage_data_ptrs)
      .def("storage_data_ptrs_bytes", &TargetRecord::storage_data_ptrs_bytes)
      .def("all_sized_have_memory", &TargetRecord::all_sized_have_memory)
      .def("first_tensor", &TargetRecord::first_tensor)
      .def("tensor_columns", &TargetRecord::tensor_columns,
           "(storage index, offset, shape, stride, dtype) of each tensor, as recorded.")
      .def("resize_live", &TargetRecord::resize_live, py::arg("tensors"), py::arg("release"),
           py::arg("refuse") = false, py::arg("held") = py::none(), py::arg("begin") = 0, py::arg("end") = -1,
           "Resizes the recorded live storages of `tensors` to 0 (release) or back to their recorded sizes; with "
           "`refuse`, each also refuses access after its release, or has the refusal lifted before it grows "
           "(the messages of set_refusals), in the same pass. `held`: check_held()'s answer for `tensors` (the "
           "storages it holds are resized, without reaching them again; it is spent then). begin, end: only "
           "the live storages [begin, end) (end -1: to the last); `held` serves a resize in such parts while "
           "each part begins where the one before ended.")
      .def("set_refusals", &TargetRecord::set_refusals, py::arg("messages"),
           "One refusal message per live storage, for resize_live(..., refuse=True).")
      .def_property_readonly("has_refusals", &TargetRecord::has_refusals)
      .def_property_readonly("refusals", &TargetRecord::refusals)
      .def("watch_live", &TargetRecord::watch_live, py::arg("tensors"), py::arg("held") = py::none(),
           "A StorageWatch over the recorded live storages of `tensors` (those `held` holds, if given): the "
           "record's last one, re-armed, where it watches nothing now and still has each of these storages.")
      .def("record_streams_live", &TargetRecord::record_streams_live, py::arg("tensors"), py::arg("held"),
           py::arg("streams"),
           "Tensor.record_stream(streams[device]) for each recorded live CUDA storage of `tensors` that holds "
           "memory (those `held` holds, if given), in one pass; streams: {device index: (stream_id, "
           "device_index, device_type)}, checked before the first record. Returns how many were recorded.")
      .def("zero_live", &TargetRecord::zero_live, py::arg("tensors"), py::arg("held") = py::none(),
           "Zeroes the recorded live storages of `tensors` (those `held` holds, if given) that are CPU storages; "
           "answers the tensors to zero with torch for the CUDA ones (each one's first tensor, viewing all of it), "
           "or None, nothing zeroed, where one does not.")
      .def_static("set_check_parts", &TargetRecord::set_check_parts, py::arg("threads"),
                  py::arg("min_tensors_per_thread"),
                  "How a check splits its tensors over threads: `threads` at most (0: GPU_OFFLOAD_NUM_THREADS, "
                  "else the cores, at most 16), each with `min_tensors_per_thread` at least.")
      .def_static("check_parts", &TargetRecord::check_parts,
                  "(threads, min_tensors_per_thread) as the next check splits its tensors.")
      .def("live", &TargetRecord::live, "(first tensor index, recorded nbytes) of each live storage.")
      .def_property_readonly("all_resizable", &TargetRecord::all_resizable)
      .def_property_readonly("num_tensors", &TargetRecord::num_tensors)
      .def_property_readonly("num_storages", &TargetRecord::num_storages);
  m.def(
      "record",
      [](py::handle tensors) -> py::object {
        try {
          return py::cast(new TargetRecord(tensors), py::return_value_policy::take_ownership);
        } catch (const NotPlain&) {
          return py::none();
        }
      },
      py::arg("tensors"),
      "A TargetRecord of a list of plain tensors (exact torch.Tensor/Parameter with strided storage), or None.");
  m.def("bind", &TargetRecord::bind, py::arg("names"), py::arg("tensors"), py::arg("large_alignment"),
        py::arg("small_alignment"), py::arg("small_storage_bytes"), py::arg("names_distinct") = false,
        "storages.bind() of plain tensors in one pass: (record, each storage's first tensor (None: tensor i is the "
        "first on storage i, for every i), nbytes, device index and host offset, the host bytes, the first tensor "
        "reaching past its storage or -1), or None where the Python bind must decide. names_distinct: the names "
        "are known distinct (a ModuleTree's names_distinct), not checked again.");
  m.def("resize_storages", &resize_storages, py::arg("storages"), py::arg("nbytes"),
        py::arg("through_allocator") = false,
        "UntypedStorage.resize_(n) for many CPU storages (tensors or UntypedStorages) in one call (stops at "
        "the first failure); through_allocator: the way resize_live resizes a CUDA storage (to 0, or from 0).");
  m.def("num_cpu_blocks", &num_cpu_blocks,
        "How many shared blocks of small CPU storages (resize_live's reload) are alive: each goes with its last "
        "storage.");
  py::class_<HeldStorages>(m, "HeldStorages")
      .def_property_readonly("spent", [](const HeldStorages& h) { return h.spent; })
      .def_property_readonly("num_held", [](const HeldStorages& h) { return h.refs.size(); });
  py::class_<StorageWatch>(m, "StorageWatch")
      .def(py::init<py::handle>(), py::arg("storages"), "Watches tensors' or UntypedStorages' storages.")
      .def("dead", &StorageWatch::dead)
      .def("forget", &StorageWatch::forget, py::arg("positions"))
      .def("forget_all", &StorageWatch::forget_all)
      .def_property_readonly("num_watched", &StorageWatch::num_watched)
      .def("__len__", &StorageWatch::size);
  m.def("plain_items", &plain_items, py::arg("mapping"), py::arg("names") = py::none(),
        "(keys, values) of a dict of plain tensors under str keys, or None; `names` (an earlier call's keys) is "
        "answered as the keys where the dict's keys are those very objects, in order.");
  m.def("any_grad", &any_grad, py::arg("tensors"), py::arg("count"));
  m.def("any_attribute", &any_attribute, py::arg("objects"), py::arg("count"), py::arg("name"),
        "Whether any of the first `count` objects of a list has the attribute `name`: any(hasattr(...)) in one "
        "pass, with hasattr's answers and errors.");
  m.def("data_ptrs_or_zero", &data_ptrs_or_zero, py::arg("items"),
        "data_ptr() of each plain tensor or UntypedStorage in a list, 0 where the storage holds no memory; None "
        "where an item is something else.");
  m.def("local_tensors", &local_tensors, py::arg("tensors"),
        "The list with each DTensor (a subclass keeping a plain tensor in a `_local_tensor` slot) replaced by its "
        "local tensor; the list itself where all are plain tensors; None where an item is anything else.");
  m.def("wrapper_slots", &wrapper_slots, py::arg("names"), py::arg("tensors"), py::arg("slot"),
        "{name: getattr(t, slot)} of each tensor that is not a plain Tensor or Parameter and has the slot set, "
        "read from its class's member slot (a DTensor's _spec); None where such a class has no plain slot.");
  m.def("object_ids", &object_ids, py::arg("items"), "The items' id()s as native words, in one bytes object.");
  m.def("bump_versions", &bump_versions, py::arg("tensors"),
        "torch.autograd.graph.increment_version(tensors) for a list, in one pass.");
  m.attr("MODULE_TREE") = module_tree_supported();
  m.attr("CPP_PLACEMENTS") = cpp_placements();
  // (Probed here, at import: the probe makes Python objects, which a walk must not.)
  m.attr("SHARED_KEYS") = shared_keys_layout_ok();
  m.attr("COMBINED_KEYS") = combined_keys_layout_ok();
  m.attr("INLINE_VALUES") = inline_values_layout_ok();
  bind_module_tree(m);
  m.def("build_module_tree", &build_module_tree, py::arg("root"), py::arg("module_type"),
        py::arg("refused") = py::tuple(), py::arg("with_modules") = false,
        "(tree, names, tensors, num_params) of a plain module's named_parameters + named_buffers "
        "(remove_duplicate=False), or None where the traversal is not a plain one or a module is an instance "
        "of a `refused` class. with_modules: (tree, names, tensors, num_params, paths, modules), the last two "
        "what named_modules() yields (each module once, under the path it is first reached by).");
  m.def("walk_module", &walk_module, py::arg("root"), py::arg("module_type"), py::arg("refused") = py::tuple(),
        py::arg("previous") = py::none(),
        "(names, tensors, num_params, names_distinct) of a plain module's named_parameters + named_buffers "
        "(remove_duplicate=False), walked through CPython's public API with nothing recorded; `names` is "
        "`previous` itself where that list holds exactly these names. None where build_module_tree would refuse "
        "the module, or a name is not ASCII.");
  m.def("walk_optimizer", &walk_optimizer, py::arg("optimizer"), py::arg("previous") = py::none(),
        "(names, tensors) of a torch optimizer's state traversal (\"state.<index>.<key>\"), walked through CPython's "
        "public API with nothing recorded; `names` is `previous` itself where that list holds exactly these names. "
        "None where build_optimizer_tree would refuse the optimizer, or a key is not ASCII.");
  m.def("json_object_of_texts", &json_object_of_texts, py::arg("mapping"), py::arg("text_of"),
        "json.dumps(mapping, sort_keys=True) where each value's JSON is text_of(value), asked once per distinct "
        "value; None unless every key is a str written as is (printable ASCII, no quote or backslash).");
  m.def("prefixed_names", &prefixed_names, py::arg("prefix"), py::arg("names"), py::arg("start"), py::arg("stop"),
        "[f\"{prefix}.{n}\" for n in names[start:stop]] (a list), one allocation a name; None where the prefix or a "
        "name is not an exact str.");
  m.attr("OPTIMIZER_TREE") = optimizer_tree_supported();
  bind_optimizer_tree(m);
  m.def("build_optimizer_tree", &build_optimizer_tree, py::arg("optimizer"),
        "(tree, names, tensors) of a torch optimizer's state traversal (\"state.<index>.<key>\"), or None where "
        "its class reads param_groups or state otherwise, or the state is not plain dicts under str keys.");
  m.def("instance_attrs", &instance_attrs, py::arg("objs"), py::arg("name"),
        "[getattr(o, name) for o in objs] (a list) where each is a plain instance attribute (its type has no "
        "class attribute of that name nor its own attribute lookup), read a few objects ahead; else None.");
  m.def("same_object_sets", &same_object_sets, py::arg("a"), py::arg("b"), py::arg("count_b"),
        "set(map(id, a)) == set(map(id, b[:count_b])) for two lists, without touching their objects.");
  m.def("module_kinds", &module_kinds, py::arg("modules"), py::arg("cls"),
        "(the last module of each class, in the order the classes are first met; the indices of the modules "
        "whose class is a subclass of cls) of a list of modules, in one pass over their headers.");
  m.def("fsdp2_layouts", &fsdp2_layouts, py::arg("fsdp_params"), py::arg("module_paths"),
        "(names, layout index of each, first parameter of each layout, _sharded_param_data of each) of a list "
        "of FSDPParams, named as fsdp2_shard_info names them from module_paths (a dict id -> path, or (ids as "
        "native words, paths)); the layouts by global shape, padded local shape, padded shard dtype and "
        "placements (==). None where a read is not a plain one.");
  m.def("placements_equal", &placements_equal, py::arg("a"), py::arg("b"),
        "fsdp2_layouts' == of two placements tuples: (equal, how many item pairs it compared without ==).");
}
