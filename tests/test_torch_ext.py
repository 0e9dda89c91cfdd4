"""The torch-aware helper (gpu_offload._torch_ext): loaded only into the torch it was built against, and the
batched storage-access refusal it provides."""

from __future__ import annotations

import importlib.util
import io
import logging
import os
import subprocess
import sys
import types

import pytest
import torch

import gpu_offload as go
from gpu_offload import torch_ext

_SPEC = importlib.util.find_spec("gpu_offload._torch_ext")
_BUILT = _SPEC is not None and _SPEC.origin is not None
needs_ext = pytest.mark.skipif(not torch_ext.available(), reason=f"gpu_offload._torch_ext {torch_ext.status()}")
needs_guard = pytest.mark.skipif(not torch_ext.access_guard_available(),
                                 reason="this torch cannot lift a storage-access refusal, or the helper is not loaded")


@pytest.mark.skipif(not _BUILT, reason="gpu_offload._torch_ext was not built (torch not importable at build time)")
def test_a_helper_built_for_this_torch_is_loaded():
    record = torch_ext.read_record(_SPEC.origin)
    assert record is not None, "the built helper must carry the torch it was built against"
    assert record["torch"] == torch.__version__  # make/CI build against the installed torch
    if os.environ.get("GPU_OFFLOAD_TORCH_EXT", "") != "0":
        assert torch_ext.available(), torch_ext.status()
        assert torch_ext.status().startswith("loaded")


@pytest.mark.skipif(not _BUILT, reason="gpu_offload._torch_ext was not built")
@pytest.mark.parametrize("field,value", [("torch", "2.0.0"), ("torch_git", "0" * 40), ("cxx11_abi", None)])
def test_a_helper_built_for_another_torch_is_not_loaded(monkeypatch, field, value):
    running = torch_ext._running()
    other = dict(running, **{field: (not running["cxx11_abi"]) if field == "cxx11_abi" else value})
    monkeypatch.setattr(torch_ext, "_running", lambda: other)
    ext, why = torch_ext._load()
    assert ext is None
    assert "built against torch" in why and "running torch" in why


def test_the_switch_turns_it_off(monkeypatch):
    monkeypatch.setenv("GPU_OFFLOAD_TORCH_EXT", "0")
    ext, why = torch_ext._load()
    assert ext is None and "GPU_OFFLOAD_TORCH_EXT=0" in why


def test_not_loaded_where_the_gil_is_off(monkeypatch):
    # (A free-threaded CPython run with PYTHON_GIL=0: the helper's passes read borrowed objects and unlocked
    # TensorImpls, which only the GIL makes safe.) Asked after the import, which is what turns the GIL back on.
    if torch_ext.read_record(getattr(torch_ext.ext, "__file__", "")) is None:
        pytest.skip(f"gpu_offload._torch_ext {torch_ext.status()}")
    asked = []
    monkeypatch.setattr(sys, "_is_gil_enabled", lambda: asked.append(1) or False, raising=False)
    ext, why = torch_ext._load()
    assert ext is None and "the GIL is disabled" in why and asked
    monkeypatch.setattr(sys, "_is_gil_enabled", lambda: True, raising=False)
    assert torch_ext._load()[0] is torch_ext.ext


def test_a_file_without_record_is_not_read_as_one(tmp_path):
    junk = tmp_path / "x.so"
    junk.write_bytes(b"\x7fELF" + b"\0" * 100)
    assert torch_ext.read_record(str(junk)) is None
    assert torch_ext.read_record(str(tmp_path / "missing.so")) is None


def _accesses(t: torch.Tensor, view: torch.Tensor) -> dict:
    return {"norm": lambda: t.norm(), "data_ptr": lambda: t.data_ptr(), "view sum": lambda: view.sum(),
            "storage data_ptr": lambda: t.untyped_storage().data_ptr(), "in-place add": lambda: t.add_(1),
            "torch.save": lambda: torch.save(t, io.BytesIO()), "repr": lambda: repr(t)}


@needs_guard
def test_refused_storages_raise_our_message_and_lifted_ones_work_again():
    a, b, c = torch.randn(10), torch.randn(3, 4), torch.arange(6.0)
    expected = [x.clone() for x in (a, b, c)]
    # One call for several storages, given as a tensor, an UntypedStorage and a _cdata.
    torch_ext.refuse_access([a, b.untyped_storage(), c.untyped_storage()._cdata], "offloaded: call reload()")
    for t, view in ((a, a[2:5]), (b, b.t()), (c, c.view(2, 3))):
        assert torch_ext.access_refused(t)
        assert t.untyped_storage().nbytes() == t.numel() * t.element_size()  # size untouched
        for what, access in _accesses(t, view).items():
            with pytest.raises(RuntimeError, match="offloaded: call reload"):
                access()
                pytest.fail(f"{what} did not raise")
    torch_ext.allow_access([a.untyped_storage()._cdata, b, c.untyped_storage()])
    for t, e in zip((a, b, c), expected):
        assert not torch_ext.access_refused(t)
        assert torch.equal(t, e)  # the data was not touched
    buf = io.BytesIO()
    torch.save(a, buf)
    assert torch.equal(torch.load(io.BytesIO(buf.getvalue())), expected[0])


@needs_guard
def test_a_bad_item_refuses_nothing():
    a = torch.randn(4)
    with pytest.raises(TypeError):
        torch_ext.refuse_access([a, "not a storage"], "no")
    assert not torch_ext.access_refused(a)
    a.norm()


def test_without_the_helper_refusal_says_it_is_unavailable(monkeypatch):
    monkeypatch.setattr(torch_ext, "ext", None)
    monkeypatch.setattr(torch_ext, "_status", "disabled (GPU_OFFLOAD_TORCH_EXT=0)")
    assert not torch_ext.access_guard_available()
    t = torch.randn(3)
    for call in (lambda: torch_ext.refuse_access([t], "x"), lambda: torch_ext.allow_access([t])):
        with pytest.raises(torch_ext.TorchExtUnavailable, match="GPU_OFFLOAD_TORCH_EXT=0"):
            call()
    t.norm()  # nothing was refused


@pytest.mark.parametrize("why", ["not built (torch was not importable when gpu_offload was built; ...)",
                                 "disabled (GPU_OFFLOAD_TORCH_EXT=0)", "loaded (built against torch x)"])
def test_an_offload_without_the_guard_says_so_once(monkeypatch, caplog, why):
    # Without refusals a direct read of an offloaded tensor reads released memory: said once per process, as a
    # warning where the helper is missing or this torch cannot lift a refusal, at debug level where the user
    # switched the helper off.
    from gpu_offload import registry
    loaded = why.startswith("loaded")
    monkeypatch.setattr(torch_ext, "ext", types.SimpleNamespace(ACCESS_GUARD=False) if loaded else None)
    monkeypatch.setattr(torch_ext, "_status", why)
    monkeypatch.setattr(registry, "_warned_unguarded", [False])
    models = [torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)]
    with caplog.at_level(logging.DEBUG, logger="gpu_offload"):
        for m in models:
            go.offload(m)
    go.reload(models)
    said = [r for r in caplog.records if "do not refuse access" in r.getMessage()]
    assert len(said) == 1, [r.getMessage() for r in said]
    if "=0" in why:
        assert said[0].levelno == logging.DEBUG
    else:
        assert said[0].levelno == logging.WARNING
        assert ("cannot lift a refusal" if loaded else "pip install --no-build-isolation") in said[0].getMessage()


def test_the_engine_works_with_the_helper_switched_off():
    code = ("import torch, gpu_offload as go\n"
            "from gpu_offload import torch_ext\n"
            "assert not torch_ext.available() and 'GPU_OFFLOAD_TORCH_EXT=0' in torch_ext.status()\n"
            "m = torch.nn.Linear(4, 3)\n"
            "w = m.weight.detach().clone()\n"
            "s = go.snapshot(m).wait()\n"
            "m.weight.data.zero_(); go.restore(m, s); assert torch.equal(m.weight, w)\n"
            "go.offload(m); go.reload(m); assert torch.equal(m.weight, w)\n")
    env = dict(os.environ, GPU_OFFLOAD_TORCH_EXT="0", CUDA_VISIBLE_DEVICES="")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr


class _Attrs:
    def __init__(self, count: int) -> None:
        for i in range(count):  # (past 30 attributes CPython gives an instance its own dict, below inline values)
            setattr(self, f"a{i}", i)


class _Shadowing(_Attrs):
    def __init__(self, count: int) -> None:
        self.__dict__.update((f"a{i}", i) for i in range(count))  # (a1 in its dict, shadowed by the property)

    @property
    def a1(self) -> int:
        raise AssertionError("the class attribute's code ran")


class _Dynamic(_Attrs):
    def __getattr__(self, name: str) -> object:
        return "dynamic"


@needs_ext
def test_instance_attrs_reads_plain_instance_attributes_and_declines_the_rest():
    ext = torch_ext.ext
    objs = [_Attrs(3), _Attrs(40), _Attrs(5), _Attrs(31)]
    assert ext.instance_attrs(objs, "a2") == [2, 2, 2, 2]
    assert ext.instance_attrs([], "a0") == []
    assert ext.instance_attrs(objs, "a35") is None  # (absent from some)
    assert ext.instance_attrs(objs + [_Shadowing(2)], "a1") is None  # (a class attribute of that name)
    assert ext.instance_attrs([_Dynamic(2)], "a1") is None  # (its own attribute lookup)
    assert ext.instance_attrs([object()], "a0") is None
    with pytest.raises(TypeError):
        ext.instance_attrs(tuple(objs), "a0")


@needs_ext
def test_instance_attrs_reads_a_remembered_entry_only_where_it_holds_that_attribute():
    # Objects of 40 attributes keep them in dicts of their own, each at the entry it was set at: the entry
    # found in one object is read directly in the next where it holds that very name, and nothing else is.
    ext = torch_ext.ext
    assert ext.COMBINED_KEYS == bool(ext.MODULE_TREE)  # (the layout probe passes where the records run)

    def made(order: list[int], **extra: object) -> _Attrs:
        obj = _Attrs(0)
        for i in order:
            setattr(obj, f"a{i}", i)
        for k, v in extra.items():
            setattr(obj, k, v)
        return obj

    same = list(range(40))
    moved = made(list(reversed(same)))  # a5 at another entry
    deleted = made(same)
    del deleted.a5  # its entry now empty
    readded = made(same)
    del readded.a5
    readded.a5 = "again"  # at the end
    replaced = made(same)
    replaced.a5 = "new value"  # the same entry, another value
    other_key = made(same)
    other_key.__dict__[5] = "an int key"  # a table that is no longer str-keyed
    small = made([5, 1])  # (inline values)
    objs = [made(same), moved, made(same), readded, made(same), replaced, other_key, made(same), small, made(same)]
    assert ext.instance_attrs(objs, "a5") == [5, 5, 5, "again", 5, "new value", 5, 5, 5, 5]
    assert ext.instance_attrs([made(same), deleted], "a5") is None  # (absent: the entry left empty)
    assert ext.instance_attrs([made(same), made(same, a5=1)], "a5") == [5, 1]  # (set again: its entry, the value now)


class _Small:  # (few attributes: kept as inline values, indexed as the class's shared keys)
    def __init__(self, **attrs: object) -> None:
        for k, v in attrs.items():
            setattr(self, k, v)


class _SmallToo(_Small):
    pass


@needs_ext
def test_instance_attrs_reads_inline_values_at_a_remembered_index_only_where_the_class_keys_hold_that_name():
    # Objects of few attributes keep them as inline values, indexed as their class's shared keys: the index
    # found in one object is read directly in the next of its class where that class's keys hold that very
    # name there; a deleted value, a dict made since, another class's order are each read as Python reads them.
    ext = torch_ext.ext
    assert ext.INLINE_VALUES == bool(ext.MODULE_TREE)  # (the layout probe passes where the records run)
    plain = [_Small(a=0, b=i, c=2) for i in range(6)]
    assert ext.instance_attrs(plain, "b") == list(range(6))
    deleted = _Small(a=0, b=1, c=2)
    del deleted.b  # (its value cleared in place: the index still names b)
    assert ext.instance_attrs([plain[0], deleted], "b") is None
    readded = _Small(a=0, b=1, c=2)
    del readded.b
    readded.b = "again"
    with_dict = _Small(a=0, b="dict", c=2)
    assert with_dict.__dict__["b"] == "dict"  # (a dict made: the values move into it)
    with_dict.z = "more"
    other_order = _SmallToo(c=2, z=9, b="other class")  # (another class: b at another index)
    late = _Small(a=0, c=2)
    late.b = "set last"  # (its own insertion order; the index is the class's)
    objs = [plain[1], readded, plain[2], with_dict, plain[3], other_order, plain[4], late, plain[5]]
    assert ext.instance_attrs(objs, "b") == [1, "again", 2, "dict", 3, "other class", 4, "set last", 5]
    assert ext.instance_attrs(objs, "b") == [getattr(o, "b") for o in objs]
    assert ext.instance_attrs([plain[0], _Small(a=0)], "b") is None  # (absent: not in its values)


@needs_ext
def test_module_kinds_is_the_python_scan():
    ext = torch_ext.ext

    class Picked(torch.nn.Linear):
        pass

    class PickedToo(Picked):
        pass

    mods = [torch.nn.Linear(1, 1), Picked(1, 1), torch.nn.ReLU(), torch.nn.Linear(1, 1), PickedToo(1, 1),
            torch.nn.ReLU(), Picked(1, 1)]
    kinds, at = ext.module_kinds(mods, Picked)
    want = dict(zip(map(type, mods), mods))
    assert kinds == list(want.values()) and all(a is b for a, b in zip(kinds, want.values()))
    assert at == [i for i, m in enumerate(mods) if issubclass(type(m), Picked)] == [1, 4, 6]
    assert ext.module_kinds([], Picked) == ([], [])
    assert ext.module_kinds(mods, torch.nn.Conv2d)[1] == []


@needs_ext
def test_same_object_sets_compares_identities_as_sets():
    ext = torch_ext.ext
    a, b, c = torch.ones(1), torch.ones(1), torch.ones(1)  # (equal values, distinct objects)
    assert ext.same_object_sets([a, b], [b, a, c], 2)
    assert not ext.same_object_sets([a, b], [b, a, c], 3)
    assert ext.same_object_sets([a, b, a], [b, a], 2)  # (sets: a repeat is one)
    assert not ext.same_object_sets([a, c], [a, b], 2)
    assert ext.same_object_sets([a, b], [a, b], 99) and ext.same_object_sets([], [], 0)


@needs_ext
def test_prefixed_names_joins_as_an_f_string_does():
    ext = torch_ext.ext
    names = ["w", "state.0.exp_avg", "深.b", "", "x" * 300, "é"]
    for prefix in ["0", "opt", "", "深", "a.b"]:
        for start, stop in [(0, len(names)), (1, 4), (3, 3), (0, 0)]:
            assert ext.prefixed_names(prefix, names, start, stop) == [f"{prefix}.{n}" for n in names[start:stop]]
    class Sub(str):
        pass
    assert ext.prefixed_names(Sub("p"), names, 0, 1) is None  # (the caller's f-string then)
    assert ext.prefixed_names("p", ["a", Sub("b")], 0, 2) is None
    assert ext.prefixed_names("p", ["a", 1], 0, 1) == ["p.a"]  # (only the range is read)
    for start, stop in [(-1, 1), (2, 1), (0, 7)]:
        with pytest.raises(ValueError):
            ext.prefixed_names("p", names, start, stop)
    with pytest.raises(TypeError):
        ext.prefixed_names("p", tuple(names), 0, 1)


class _Wrapper(torch.Tensor):
    __slots__ = ["_spec"]


class _Loose(torch.Tensor):  # (its attributes in its dict: no plain slot)
    pass


@needs_ext
def test_wrapper_slots_reads_the_slots_of_wrappers_alone():
    ext = torch_ext.ext
    plain, param = torch.ones(2), torch.nn.Parameter(torch.ones(2))
    set_, unset = torch.ones(2).as_subclass(_Wrapper), torch.ones(2).as_subclass(_Wrapper)
    set_._spec = spec = object()
    got = ext.wrapper_slots(["p", "q", "w", "u"], [plain, param, set_, unset], "_spec")
    assert got == {"w": spec} and got["w"] is spec  # (a plain tensor has none, an unset slot is absent)
    want = {n: t._spec for n, t in zip("pqwu", [plain, param, set_, unset])
            if type(t) not in (torch.Tensor, torch.nn.Parameter) and hasattr(t, "_spec")}
    assert got == want
    loose = torch.ones(2).as_subclass(_Loose)
    loose._spec = spec
    assert ext.wrapper_slots(["l"], [loose], "_spec") is None  # (the caller's Python reads it)
    with pytest.raises(ValueError):
        ext.wrapper_slots(["a"], [plain, plain], "_spec")


@needs_ext
def test_the_shared_keys_layout_probe_passes_where_the_traversal_record_runs():
    # module_tree.cpp reads split instance dicts' shared keys tables and values arrays as CPython 3.11 and 3.12
    # lay them out; a probe at import (two instances of a class made for it) checks that reading, and where it
    # fails every walk looks its dicts up instead. Where the record runs at all, the probe must pass: a
    # failure here means a CPython whose layout the reads do not know.
    assert torch_ext.ext.SHARED_KEYS == bool(torch_ext.ext.MODULE_TREE)


# -- any_attribute: hasattr over many objects in one pass ---------------------------------------------------
class _Lookup(torch.nn.Parameter):
    def __getattr__(self, name):  # (reads attributes its own way: hasattr calls it)
        if name == "ds_tensor" and getattr(self, "answer", False):
            return 1
        raise AttributeError(name)


class _Raises(torch.nn.Parameter):
    @property
    def ds_tensor(self):  # (an error other than AttributeError: hasattr lets it through)
        raise KeyError("ds_tensor")


@needs_ext
def test_any_attribute_answers_what_hasattr_answers():
    ext = torch_ext.ext

    def fresh(n=6):
        return [torch.nn.Parameter(torch.ones(2)) for _ in range(n)]

    def agrees(ts, count, name="ds_tensor"):
        got = ext.any_attribute(ts, count, name)
        assert got is any(hasattr(t, name) for t in ts[:count]), got
        return got

    ts = fresh()
    assert agrees(ts, 6) is False
    ts[1].other = 1  # (another attribute)
    assert agrees(ts, 6) is False
    ts[4].__dict__["ds_tensor"] = torch.empty(0)  # (in a materialized dict)
    assert agrees(ts, 6) is True and agrees(ts, 4) is False  # (only the first `count` are asked)
    del ts[4].__dict__["ds_tensor"]
    assert agrees(ts, 6) is False
    ts[2].ds_tensor = torch.empty(0)  # (wherever CPython keeps it: inline values or a dict)
    assert agrees(ts, 6) is True and agrees(ts, 2) is False
    assert agrees(ts, 100) is True  # (a count past the end: the whole list)
    assert agrees(fresh(2) + ["not a tensor", object()], 4) is False
    looks = [_Lookup(torch.ones(1)) for _ in range(3)]
    assert agrees(looks, 3) is False  # (its own __getattr__ asked, as hasattr asks it)
    looks[2].answer = True
    assert agrees(looks, 3) is True
    plain = fresh(2)
    try:
        torch.nn.Parameter.ds_tensor = None  # (a class attribute: hasattr is True for every one)
        assert agrees(plain, 2) is True
    finally:
        del torch.nn.Parameter.ds_tensor
    assert agrees(plain, 2) is False
    with pytest.raises(KeyError):  # (as hasattr raises it)
        ext.any_attribute(fresh(1) + [_Raises(torch.ones(1))], 2, "ds_tensor")
    with pytest.raises(TypeError):
        ext.any_attribute(plain, 2, b"ds_tensor")
    with pytest.raises(TypeError):
        ext.any_attribute(tuple(plain), 2, "ds_tensor")


@needs_ext
def test_any_attribute_survives_a_lookup_that_empties_the_list():
    # A __getattr__ may run any code, the caller's list's mutation included: each item is read afresh and held
    # across its lookup, so the pass ends where the list now ends and nothing is read from a freed item.
    ts: list = []

    class Clears(torch.nn.Parameter):
        def __getattr__(self, name):
            ts.clear()
            raise AttributeError(name)

    ts.extend([torch.nn.Parameter(torch.ones(1)), Clears(torch.ones(1))] + [torch.nn.Parameter(torch.ones(1)) for _ in range(20)])
    ts[5].ds_tensor = 1  # (never reached: the list is empty by then)
    assert torch_ext.ext.any_attribute(ts, 22, "ds_tensor") is False and ts == []


@needs_ext
def test_zero3_conversion_is_asked_in_one_pass_and_answers_as_the_python_read(monkeypatch):
    import types

    from gpu_offload import adapters
    from gpu_offload.adapters import deepspeed

    m = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    params = list(m.parameters())
    monkeypatch.delitem(sys.modules, "deepspeed", raising=False)
    params[3].ds_tensor = torch.empty(0)
    assert not adapters._converted_by_zero3(params, 4)  # (DeepSpeed not imported: not asked)
    monkeypatch.setitem(sys.modules, "deepspeed", types.ModuleType("deepspeed"))
    asked: list[object] = []
    python_read = deepspeed.any_zero3_param
    monkeypatch.setattr(deepspeed, "any_zero3_param", lambda ps: asked.append(ps) or python_read(ps))
    assert adapters._converted_by_zero3(params, 4) is True and adapters._converted_by_zero3(params, 3) is False
    assert not asked  # (a list: the helper's pass answered)
    assert adapters._converted_by_zero3(tuple(params), 4) is True and len(asked) == 1  # (else hasattr in Python)
    del params[3].ds_tensor
    assert adapters._converted_by_zero3(params, 4) is False
