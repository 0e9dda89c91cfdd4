"""The shortcuts that keep per-call host work low, and that none of them can be fooled.

A cached call skips work that a fresh one does: the target's plan is reused after one check of all its
tensors (TargetRecord in C++, or the per-tensor Python check), a plain module's traversal is reused while
its dicts are unchanged (ModuleTree), a flat dict is read in one C++ pass, an offloaded target reloads
through the plan its offload left, a plan found clear of offloaded storages is not looked up again until
the next offload, and offload/reload resize and watch storages in one C++ call. Each test changes what a
shortcut depends on, in a way a user (or another library) can, and checks that the next call sees the
target as it is now: the bytes copied are the new ones, or the call refuses. Every test runs with the
torch-aware helper and with the pure-Python fallback (conftest.checks).
"""

from __future__ import annotations

import collections
import gc
import logging
import os
import sys
from typing import Any

import pytest
import torch

import gpu_offload as go
from conftest import assert_bitwise_equal
from gpu_offload import adapters, plan, torch_ext
from gpu_offload.adapters import named_tensors, plain_module_tensors

pytestmark = pytest.mark.usefixtures("checks")
CHECKS_WALK = True  # (conftest.checks: each test also runs with modules walked each call, and with checks in parts)

needs_ext = pytest.mark.skipif(not torch_ext.available(), reason=f"gpu_offload._torch_ext {torch_ext.status()}")


def _hits() -> int:
    return plan.cache_info()["hits"]


def _warm(target, arena) -> None:
    """Two snapshots: the plan is cached, and the second call is served from it."""
    go.snapshot(target, arena=arena).free()
    hits = _hits()
    go.snapshot(target, arena=arena).free()
    assert _hits() == hits + 1


def _snapshot_matches(target, arena) -> None:
    """A snapshot of the target holds exactly its current tensors' bytes, under their current names."""
    named = list(named_tensors(target))
    snap = go.snapshot(target, arena=arena).wait()
    try:
        got = snap.tensors()
        assert list(got) == [n for n, _ in named]
        for name, t in named:
            assert_bitwise_equal(got[name], t.detach())
    finally:
        snap.free()


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = torch.nn.Linear(3, 2)
        self.experts = torch.nn.ModuleList(torch.nn.Linear(2, 2, bias=False) for _ in range(3))
        self.register_buffer("scale", torch.ones(2))


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(Block(), Block())


# -- the module traversal ------------------------------------------------------------------------------------
def _replace_param(m):
    m[0].inner.weight = torch.nn.Parameter(torch.randn(2, 3))


def _write_parameters_dict(m):
    m[0].inner._parameters["weight"] = torch.nn.Parameter(torch.randn(2, 3))


def _pop_parameter(m):
    m[1].experts[2]._parameters.pop("weight")


def _delete_parameter(m):
    del m[1].inner.bias


def _set_parameter_none(m):
    m[1].inner.bias = None


def _register_parameter(m):
    m[0].experts[0].register_parameter("extra", torch.nn.Parameter(torch.randn(5)))


def _write_buffers_dict(m):
    m[1]._buffers["scale"] = torch.full((2,), 7.0)


def _register_buffer(m):
    m[1].experts[1].register_buffer("running", torch.randn(4))


def _replace_child(m):
    m[0].experts[1] = torch.nn.Linear(2, 2, bias=False)


def _write_modules_dict(m):
    m[1]._modules["inner"] = torch.nn.Linear(3, 2)


def _append_child(m):
    m[0].experts.append(torch.nn.Linear(2, 2, bias=False))


def _swap_parameters_dict(m):
    m[0].inner.__dict__["_parameters"] = {"weight": torch.nn.Parameter(torch.randn(2, 3))}


def _swap_instance_dict(m):
    child = m[0].inner
    child.__dict__ = dict(child.__dict__, _parameters={"weight": torch.nn.Parameter(torch.randn(2, 3))})


class RenamedLinear(torch.nn.Linear):
    def named_parameters(self, prefix="", recurse=True, remove_duplicate=True):  # type: ignore[override]
        for name, p in super().named_parameters(prefix, recurse, remove_duplicate):
            yield name.replace("weight", "kernel"), p


def _swap_class(m):
    m.__class__ = type("Wrapped", (torch.nn.Sequential,), {
        "named_parameters": lambda self, prefix="", recurse=True, remove_duplicate=True: iter(
            [(n + "_x", p) for n, p in torch.nn.Sequential.named_parameters(self, prefix, recurse, remove_duplicate)])})


def _instance_method(m):
    original = m.named_parameters
    m.named_parameters = lambda *a, **kw: iter([(n + "_y", p) for n, p in original(*a, **kw)])


def _patch_class_method(m):
    # Undone by the test's monkeypatch: returns the patcher.
    return lambda mp: mp.setattr(torch.nn.Sequential, "named_parameters", lambda self, *a, **kw: iter(
        [(n + "_z", p) for n, p in torch.nn.Module.named_parameters(self, *a, **kw)]))


def _tie_weights(m):
    m[1].experts[0].weight = m[0].experts[0].weight


def _train_mode(m):
    m.eval()  # __dict__ changes (training), the traversal does not: still served from the record


def _reorder_parameters(m):
    params = m[0].inner._parameters
    params["weight"] = params.pop("weight")  # the same objects, now after the bias


def _fill_a_none_slot(m):
    m[0].experts[1]._parameters["bias"] = torch.nn.Parameter(torch.randn(2))  # (bias=False left None there)


def _swap_out_and_back(m):
    # What FSDP2 does to every parameter each step: another tensor in, the same one back. The traversal is
    # the same (the record is kept, see test_a_slot_written_back_with_what_it_held_keeps_the_record).
    params, buffers = m[1].experts[2]._parameters, m[0]._buffers
    weight, scale = params["weight"], buffers["scale"]
    params["weight"], buffers["scale"] = torch.nn.Parameter(torch.randn(2, 2)), torch.zeros(2)
    params["weight"], buffers["scale"] = weight, scale


def _rekey_a_parameter(m):
    params = m[1].inner._parameters
    weight = params.pop("weight")
    bias = params.pop("bias")
    params["kernel"], params["bias"] = weight, bias


MODULE_CHANGES = [_replace_param, _write_parameters_dict, _pop_parameter, _delete_parameter, _set_parameter_none,
                  _register_parameter, _write_buffers_dict, _register_buffer, _replace_child, _write_modules_dict,
                  _append_child, _swap_parameters_dict, _swap_instance_dict, _swap_class, _instance_method,
                  _patch_class_method, _tie_weights, _train_mode, _reorder_parameters, _fill_a_none_slot,
                  _swap_out_and_back, _rekey_a_parameter]


@pytest.mark.parametrize("change", MODULE_CHANGES, ids=[c.__name__.lstrip("_") for c in MODULE_CHANGES])
def test_a_module_traversal_is_never_served_stale(arena, monkeypatch, change):
    m = _model()
    _warm(m, arena)
    patcher = change(m)
    if patcher is not None:
        patcher(monkeypatch)
    # What torch's own traversal says now is what the engine reads, and what a snapshot holds.
    truth = [(n, id(t)) for n, t in plain_module_tensors(m, include_grads=False)]
    assert [(n, id(t)) for n, t in named_tensors(m)] == truth
    _snapshot_matches(m, arena)
    assert [(n, id(t)) for n, t in named_tensors(m)] == truth  # and again, once recorded anew


def _wide_model() -> torch.nn.Module:
    # More children per module than the recorded traversal reads ahead (it asks for the next children's
    # objects while visiting one), with holes, buffers, a nested child and a tied weight among them.
    torch.manual_seed(0)
    experts = torch.nn.ModuleList(torch.nn.Linear(2, 2, bias=i % 3 == 0) for i in range(40))
    experts[7] = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.BatchNorm1d(3))
    experts[11].weight = experts[4].weight
    experts._modules["hole"] = None
    experts.register_module("after_hole", torch.nn.Linear(2, 1))
    return torch.nn.Sequential(experts, torch.nn.Linear(2, 2))


@pytest.mark.parametrize("at", [0, 5, 7, 33, 39])
def test_a_wide_module_is_read_as_torch_reads_it_and_a_change_at_any_child_is_seen(arena, at):
    m = _wide_model()
    for _ in range(2):  # recorded, then served from the record
        truth = [(n, id(t)) for n, t in plain_module_tensors(m, include_grads=False)]
        assert [(n, id(t)) for n, t in named_tensors(m)] == truth
    _snapshot_matches(m, arena)
    m[0][at] = torch.nn.Linear(2, 2)
    truth = [(n, id(t)) for n, t in plain_module_tensors(m, include_grads=False)]
    assert [(n, id(t)) for n, t in named_tensors(m)] == truth
    _snapshot_matches(m, arena)


def test_a_recorded_traversal_names_tensors_as_torch_does_whatever_the_characters(arena):
    # The record builds ASCII prefixes in a byte buffer and falls back to str objects at the first name
    # that is not ASCII (a module's or a tensor's, at any depth, 1- to 4-byte characters).
    m = torch.nn.Module()
    m.ascii = torch.nn.Linear(2, 2)
    m.add_module("é", torch.nn.Linear(2, 2))
    m.add_module("深", torch.nn.ModuleDict({"plain": torch.nn.Linear(2, 1), "𝛼": torch.nn.Linear(1, 1)}))
    m.ascii.register_buffer("β", torch.ones(1))
    m.ascii.add_module("kid", torch.nn.Module())
    m.ascii.kid.register_parameter("γ", torch.nn.Parameter(torch.ones(2)))
    m.ascii.kid.register_parameter("delta", torch.nn.Parameter(torch.ones(2)))
    m.register_parameter("ω", torch.nn.Parameter(torch.ones(3)))
    truth = [(n, id(t)) for n, t in plain_module_tensors(m, include_grads=False)]
    assert any(not n.isascii() for n, _ in truth) and any("." in n and n.isascii() for n, _ in truth)
    for _ in range(2):  # recorded, then served from the record
        assert [(n, id(t)) for n, t in named_tensors(m)] == truth
    _snapshot_matches(m, arena)


@needs_ext
def test_a_recorded_traversal_gives_named_modules_as_torch_does(checks):
    # build_module_tree(with_modules=True), which FSDP2's first record reads its groups and paths from instead of
    # walking the modules in Python: each module once, under the path it is first reached by, its children not
    # again where it is reached a second time; names not ASCII at any depth; a None child skipped.
    if checks != "helper" or not torch_ext.ext.MODULE_TREE:
        pytest.skip("the helper's records only")
    shared = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Sequential(torch.nn.Linear(2, 1)))
    m = torch.nn.Module()
    m.first = torch.nn.ModuleDict({"a": shared, "深": torch.nn.Linear(1, 1)})
    m.add_module("é", torch.nn.ModuleList([torch.nn.Linear(1, 1), shared]))  # shared reached again
    m.add_module("gone", None)
    m.last = shared[1]  # a child of the shared module, reached a third way
    for module in (m, shared, torch.nn.Linear(2, 2)):
        built = torch_ext.ext.build_module_tree(module, torch.nn.Module, (), True)
        truth = list(module.named_modules())
        assert list(zip(built[4], built[5])) == truth
        assert [id(x) for _, x in zip(built[4], built[5])] == [id(x) for _, x in truth]
        assert built[1] == [n for n, _ in plain_module_tensors(module, include_grads=False)]
    assert len(torch_ext.ext.build_module_tree(m, torch.nn.Module, ())) == 4  # (without: the 4-tuple as before)


def _uneven_siblings(first_big: bool) -> torch.nn.Module:
    # The record sizes its columns from a module's first child when it has four or more (models repeat their
    # blocks), and cuts down what goes unused: a first child far larger than its siblings, or far smaller.
    big = torch.nn.Sequential(*(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2)) for _ in range(30)))
    small = [torch.nn.Linear(1, 1, bias=False) for _ in range(5)]
    kids = [big, *small] if first_big else [*small, big]
    return torch.nn.Sequential(torch.nn.ModuleList(kids), torch.nn.Linear(1, 1))


@needs_ext
@pytest.mark.parametrize("first_big", [True, False], ids=["first child big", "first child small"])
def test_a_record_of_uneven_siblings_reads_as_torch_and_sees_a_change_in_the_last(arena, checks, first_big):
    if checks != "helper" or not torch_ext.ext.MODULE_TREE:
        pytest.skip("the helper's records only")
    m = _uneven_siblings(first_big)
    built = torch_ext.ext.build_module_tree(m, torch.nn.Module, (), True)
    assert built[1] == [n for n, _ in plain_module_tensors(m, include_grads=False)]
    assert [id(t) for t in built[2]] == [id(t) for _, t in plain_module_tensors(m, include_grads=False)]
    assert list(zip(built[4], built[5])) == list(m.named_modules())
    assert built[0].check(m)
    for _ in range(2):  # recorded, then served from the record
        truth = [(n, id(t)) for n, t in plain_module_tensors(m, include_grads=False)]
        assert [(n, id(t)) for n, t in named_tensors(m)] == truth
    _snapshot_matches(m, arena)
    m[0][5] = torch.nn.Linear(1, 1)  # the last sibling
    assert not built[0].check(m)
    truth = [(n, id(t)) for n, t in plain_module_tensors(m, include_grads=False)]
    assert [(n, id(t)) for n, t in named_tensors(m)] == truth
    _snapshot_matches(m, arena)


class _KeyThatFrees:
    """A key of another type, hashed as the str `name` is: put first in a dict, it is met by a lookup of `name`
    before `name` itself, and that lookup asks its __eq__. Once armed, that __eq__ calls `free` once, which puts
    a copy in the dict's place (the dict itself, referenced by nobody else, is freed in the middle of the lookup
    reading it), and answers False.

    Armed only around the helper's own calls: CPython 3.11's attribute specializer makes the same kind of
    lookup in a dict it does not hold (specialize.c, specialize_dict_access), so a Python walk meeting an armed
    key may crash inside CPython itself, whatever this project does."""

    def __init__(self, name: str) -> None:
        self.name, self.free, self.fired = name, None, 0

    def __hash__(self) -> int:
        return hash(self.name)

    def __eq__(self, other: object) -> bool:
        if other == self.name and self.free is not None:
            free, self.free = self.free, None
            self.fired += 1
            free()
        return False


@needs_ext
@pytest.mark.parametrize("name", ["_parameters", "_buffers", "_modules"])
def test_a_module_dict_whose_lookups_run_code_is_not_looked_up_in(arena, checks, name):
    # The record's walk looks each child's parts up (ahead of visiting it too, for prefetches), and a check
    # of a recorded traversal looks them up again in a __dict__ that changed. A lookup meeting this key would
    # run Python code that frees the dict being read (a segfault, before): such a dict is not looked up in.
    # The record refuses it, and the Python walk reads the module.
    if checks != "helper" or not torch_ext.ext.MODULE_TREE:
        pytest.skip("the helper's records only")
    experts = torch.nn.ModuleList(torch.nn.Linear(2, 2) for _ in range(24))
    m = torch.nn.Sequential(experts)
    tree = torch_ext.ext.build_module_tree(m, torch.nn.Module, ())[0]
    key = _KeyThatFrees(name)
    object.__setattr__(experts[12], "__dict__", {key: None, **experts[12].__dict__})
    key.free = lambda: object.__setattr__(experts[12], "__dict__", dict(experts[12].__dict__))
    assert tree.tensors(m) is None  # the recorded check: the changed __dict__ is not looked up in
    assert torch_ext.ext.build_module_tree(m, torch.nn.Module, ()) is None  # nor by the record's walk
    assert key.fired == 0
    key.free = None
    truth = [(n, id(t)) for n, t in plain_module_tensors(m, include_grads=False)]
    for _ in range(2):
        assert [(n, id(t)) for n, t in named_tensors(m)] == truth
    _snapshot_matches(m, arena)


def _experts_of_a_class_of_their_own(n: int = 24) -> tuple[type, torch.nn.Module]:
    # A class made here: its instances' __dict__s share one keys table (PEP 412) that no other test grows.
    expert = type("Expert", (torch.nn.Linear,), {})
    return expert, torch.nn.Sequential(torch.nn.ModuleList(expert(2, 2) for _ in range(n)), torch.nn.Linear(2, 1))


@needs_ext
@pytest.mark.parametrize("where", ["on an instance in the model", "on an instance outside it"])
def test_a_method_set_on_one_instance_is_seen_through_the_shared_keys_table(arena, checks, where):
    # The record's walk reads a class's shared keys table once: where the three parts sit in it, and whether
    # one of the traversal's methods is among its keys; each instance then finds its parts at those slots. A
    # method set on any instance adds its key to the table: the instance that set it is refused (the Python
    # walk reads the model), and its siblings, holding no value under it, are read as torch reads them.
    if checks != "helper" or not torch_ext.ext.MODULE_TREE:
        pytest.skip("the helper's records only")
    expert, m = _experts_of_a_class_of_their_own()
    assert torch_ext.ext.build_module_tree(m, torch.nn.Module, ()) is not None  # (the table read clean first)
    other = m[0][17] if where == "on an instance in the model" else expert(2, 2)
    original = other.named_parameters
    other.named_parameters = lambda *a, **kw: iter([(n + "_y", p) for n, p in original(*a, **kw)])
    built = torch_ext.ext.build_module_tree(m, torch.nn.Module, ())
    assert (built is None) == (where == "on an instance in the model")
    truth = [(n, id(t)) for n, t in plain_module_tensors(m, include_grads=False)]
    if built is not None:
        assert [(n, id(t)) for n, t in zip(built[1], built[2])] == truth
    for _ in range(2):
        assert [(n, id(t)) for n, t in named_tensors(m)] == truth
    _snapshot_matches(m, arena)


@needs_ext
@pytest.mark.parametrize("change", ["_parameters an OrderedDict", "_modules a dict subclass",
                                    "40 more attributes", "attributes set in another order"])
def test_one_instance_unlike_its_siblings_is_read_as_torch_reads_it(arena, checks, change):
    # Each instance's parts are found at the slots its class's shared table gives them, and taken only as
    # exact dicts: one whose part is another mapping is refused (the Python walk reads the model); one whose
    # __dict__ left the shared table (too many attributes) or holds its keys in another order is looked up
    # in as before. Either way the engine reads what torch's own walk says, and sees a change made after.
    import collections

    if checks != "helper" or not torch_ext.ext.MODULE_TREE:
        pytest.skip("the helper's records only")
    expert, m = _experts_of_a_class_of_their_own()
    odd = m[0][9]
    if change == "_parameters an OrderedDict":
        odd.__dict__["_parameters"] = collections.OrderedDict(odd._parameters)
    elif change == "_modules a dict subclass":
        odd.__dict__["_modules"] = type("Modules", (dict,), {})(odd._modules)
    elif change == "40 more attributes":
        for i in range(40):
            setattr(odd, f"extra_{i}", i)
    else:
        late = expert.__new__(expert)  # its attributes in reverse order, then the parts last
        attributes = dict(odd.__dict__)
        for name in reversed(list(attributes)):
            object.__setattr__(late, name, attributes[name])
        m[0][9] = late
    built = torch_ext.ext.build_module_tree(m, torch.nn.Module, ())
    assert (built is None) == change.startswith("_")
    if built is not None:
        truth = [(n, id(t)) for n, t in plain_module_tensors(m, include_grads=False)]
        assert [(n, id(t)) for n, t in zip(built[1], built[2])] == truth
    for _ in range(2):
        truth = [(n, id(t)) for n, t in plain_module_tensors(m, include_grads=False)]
        for _ in range(2):
            assert [(n, id(t)) for n, t in named_tensors(m)] == truth
        _snapshot_matches(m, arena)
        m[0][9].weight = torch.nn.Parameter(torch.randn(2, 2))  # and a change at it is seen


@needs_ext
def test_modules_with_dicts_of_their_own_are_read_at_a_remembered_entry_only_where_it_holds_that_part(arena, checks):
    # FSDP2 gives each module it manages two attributes after its __dict__ was made, which then becomes a table
    # of its own (not the class's shared one). The record's walk reads such a module's parts at the entries
    # where the last such module held them, where the entry holds that very (interned) name: a table in
    # another order, a part deleted and set again (its entry moved), an equal key that is another str object,
    # are each looked up, and the traversal is torch's.
    if checks != "helper" or not torch_ext.ext.MODULE_TREE:
        pytest.skip("the helper's records only")
    expert, m = _experts_of_a_class_of_their_own(32)
    for e in m[0]:
        assert e.__dict__ is not None  # (made: nn.Module's register_parameter asks for it anyway)
        e._is_managed, e._uses_orig = True, True  # as fully_shard's are
    reordered, moved, other_key = m[0][5], m[0][11], m[0][20]
    object.__setattr__(reordered, "__dict__", dict(reversed(list(reordered.__dict__.items()))))
    parameters = moved.__dict__.pop("_parameters")
    moved.__dict__["_parameters"] = parameters  # (its entry now last; the old one empty)
    key = "".join(["_param", "eters"])
    assert key == "_parameters" and key is not "_parameters"  # noqa: F632 (another str object, equal)
    object.__setattr__(other_key, "__dict__", {(key if k == "_parameters" else k): v for k, v in other_key.__dict__.items()})
    other_key.weight = torch.nn.Parameter(torch.randn(2, 2))  # (found through the equal key)
    built = torch_ext.ext.build_module_tree(m, torch.nn.Module, ())
    assert built is not None
    truth = [(n, id(t)) for n, t in plain_module_tensors(m, include_grads=False)]
    assert [(n, id(t)) for n, t in zip(built[1], built[2])] == truth
    for _ in range(2):
        assert [(n, id(t)) for n, t in named_tensors(m)] == truth
    _snapshot_matches(m, arena)
    for odd in (reordered, moved, other_key):  # a change at each is seen by the recorded check
        odd.weight = torch.nn.Parameter(torch.randn(2, 2))
        m.train(not m.training)  # (every __dict__ written: the parts looked up again)
        truth = [(n, id(t)) for n, t in plain_module_tensors(m, include_grads=False)]
        assert [(n, id(t)) for n, t in named_tensors(m)] == truth
        _snapshot_matches(m, arena)


def _crafted_duplicates(kind: str) -> torch.nn.Module:
    # Names a traversal makes twice, through writes into a module's dicts (register_* and add_module refuse each).
    m = torch.nn.Module()
    m.register_parameter("w", torch.nn.Parameter(torch.ones(2)))
    if kind == "a key holding a dot":
        m.add_module("a", torch.nn.Module())
        m.a.register_parameter("b", torch.nn.Parameter(torch.ones(2)))
        m._parameters["a.b"] = torch.nn.Parameter(torch.ones(3))  # "a.b", as the child's
    elif kind == "an empty key":
        child = torch.nn.Module()
        child.register_parameter("w", torch.nn.Parameter(torch.ones(2)))
        m._modules[""] = child  # its "w" is named "w", as the root's
    elif kind == "a parameter and a buffer of one name":
        m._buffers["w"] = torch.ones(2)
    else:  # a child under a parameter's key: its "grad" is named as the parameter's gradient
        child = torch.nn.Module()
        child._parameters["grad"] = torch.nn.Parameter(torch.ones(2))
        m._modules["w"] = child
        m.w.grad = torch.ones(2)
    return m


@needs_ext
@pytest.mark.parametrize("kind", ["a key holding a dot", "an empty key", "a parameter and a buffer of one name",
                                  "a child under a parameter's key"])
def test_a_recorded_traversal_vouches_for_distinct_names_only_where_they_are(arena, checks, kind):
    # A fresh bind of a recorded traversal does not check its names again where the record says they are
    # distinct by how they were made (each key non-empty without a ".", no child under a tensor's key, no
    # parameter and buffer of one name): anything else is checked, and a name made twice refused as before.
    if checks != "helper" or not torch_ext.ext.MODULE_TREE:
        pytest.skip("the helper's records only")
    m = _crafted_duplicates(kind)
    assert torch_ext.ext.build_module_tree(m, torch.nn.Module, ())[0].names_distinct is False
    with_grads = kind == "a child under a parameter's key"
    if not with_grads:
        with pytest.raises(go.OffloadError, match="duplicate tensor name"):
            go.snapshot(m, arena=arena)
    else:
        go.snapshot(m, arena=arena).free()  # (its names without the gradients are distinct)
    with pytest.raises(go.OffloadError, match="duplicate tensor name"):
        go.offload(m, arena=arena, grads="copy")
    assert not go.is_offloaded(m)
    # A model whose names are distinct, odd as they are (a tied weight, a module reached twice, names not
    # ASCII, a parameter and a buffer in one module, a None slot), is vouched for, and read as torch reads it.
    shared = torch.nn.Linear(2, 2)
    ok = torch.nn.Sequential(shared, torch.nn.ModuleDict({"深": shared, "b": torch.nn.BatchNorm1d(2)}))
    ok[1]["b"].register_parameter("unused", None)
    ok[0].weight.grad = torch.ones(2, 2)
    assert torch_ext.ext.build_module_tree(ok, torch.nn.Module, ())[0].names_distinct is True
    _snapshot_matches(ok, arena)
    go.offload(ok, arena=arena, grads="copy")
    go.reload(ok)


@pytest.mark.parametrize("kind", ["dict", "list"])
def test_parts_names_are_vouched_for_only_where_no_prefix_can_join_two(arena, checks, kind):
    # A target of several recorded parts ([model, optimizer], a dict of them) joins each part's names under
    # its key: distinct, without a check, where each part's are and no key holds a "." (a name's key is then
    # what comes before its first "."). A key with a "." may make another part's name, which is refused.
    one, other = torch.nn.Module(), torch.nn.Module()
    one.register_parameter("w", torch.nn.Parameter(torch.ones(2)))
    other.add_module("b", torch.nn.Module())
    other.b.register_parameter("w", torch.nn.Parameter(torch.zeros(2)))
    if kind == "dict":
        with pytest.raises(go.OffloadError, match="duplicate tensor name"):
            go.snapshot({"a.b": one, "a": other}, arena=arena)  # "a.b.w" twice
        target: Any = {"a": one, "b": other}
    else:
        target = [one, other]
    for _ in range(2):
        _snapshot_matches(target, arena)
    # An optimizer's names ("state.<index>.<key>") are distinct by how they are made, its keys odd or not; the
    # record reads each state by sorted key, whether its keys are the state before's objects in its order
    # (that order then serves again), in another order, equal strs that are other objects, or other keys.
    params = [torch.nn.Parameter(torch.ones(2)) for _ in range(7)]
    opt = torch.optim.SGD(params, lr=0.1)
    opt.state[params[0]] = {"1.x": torch.ones(1), "x": torch.zeros(1)}
    opt.state[params[1]] = {"1.x": torch.full((1,), 4.0), "x": torch.full((1,), 5.0)}
    opt.state[params[2]] = {"x": torch.full((1,), 2.0), "1.x": torch.full((1,), 3.0), "step": 3}
    opt.state[params[3]] = {"".join(["1", ".x"]): torch.ones(1), "".join("x"): torch.ones(1)}
    opt.state[params[5]] = {"x": torch.full((1,), 2.0), "深": torch.full((1,), 3.0)}
    opt.state[params[6]] = {}
    named = named_tensors(opt)
    _same_pairs(named, _walked(opt))
    assert [n for n, _ in named] == ["state.0.1.x", "state.0.x", "state.1.1.x", "state.1.x", "state.2.1.x",
                                     "state.2.x", "state.3.1.x", "state.3.x", "state.5.x", "state.5.深"]
    both = {"m": one, "o": opt} if kind == "dict" else [one, opt]
    for _ in range(2):
        _snapshot_matches(both, arena)


def test_a_module_with_grads_reads_them_in_every_call(arena):
    m = _model()
    _warm(m, arena)
    names = [n for n, _ in named_tensors(m, include_grads=True)]
    assert not any(n.endswith(".grad") for n in names)
    m[0].inner.weight.grad = torch.ones(2, 3)
    named = named_tensors(m, include_grads=True)
    assert [n for n, _ in named][-1] == "0.inner.weight.grad"
    snap = go.snapshot(m, include_grads=True, arena=arena).wait()
    assert torch.equal(snap.tensors()["0.inner.weight.grad"], torch.ones(2, 3))
    snap.free()
    # A grad that appears at any parameter of the recorded traversal is seen (the same pass that reads the
    # tensors asks each parameter for one, its objects prefetched a few ahead).
    params = list(m.named_parameters())
    for position in (1, len(params) // 2, len(params) - 1):
        for p in m.parameters():
            p.grad = None
        assert not any(n.endswith(".grad") for n, _ in named_tensors(m, include_grads=True))
        name, p = params[position]
        p.grad = torch.full_like(p, 2.0)
        assert [n for n, _ in named_tensors(m, include_grads=True)][-1] == f"{name}.grad"


def test_a_slot_written_back_with_what_it_held_keeps_the_record(checks):
    if checks != "helper" or not torch_ext.ext.MODULE_TREE:
        pytest.skip("the recorded traversal needs the helper (and Python 3.11/3.12)")
    m = _model()
    first = named_tensors(m)
    _swap_out_and_back(m)
    m[0].experts[0]._parameters["bias"] = None  # (None written over None)
    again = named_tensors(m)
    assert again.names is first.names and [id(t) for t in again.tensors] == [id(t) for t in first.tensors]
    assert named_tensors(m).names is first.names  # (tagged anew: the next call compares no items)


def test_an_unchanged_module_is_served_from_its_record(arena, checks):
    if checks != "helper" or not torch_ext.ext.MODULE_TREE:
        pytest.skip("the recorded traversal needs the helper (and Python 3.11/3.12)")
    m = _model()
    first = named_tensors(m)
    again = named_tensors(m)
    assert again.names is first.names  # the recorded names, not a new walk
    assert [id(t) for t in again.tensors] == [id(t) for t in first.tensors]


def test_a_stale_traversal_would_be_caught_by_these_tests(arena, monkeypatch):
    # The check above can fail: an engine that kept reading a traversal recorded before the change (replayed
    # here) copies the replaced parameter, and _snapshot_matches says so.
    m = _model()
    stale = named_tensors(m)
    _replace_param(m)
    monkeypatch.setattr(go.api, "named_tensors", lambda *a, **kw: stale)
    with pytest.raises(AssertionError):
        _snapshot_matches(m, arena)


# -- the per-call check of a cached plan ----------------------------------------------------------------------
def _data_other_storage(t):
    t.data = torch.randn_like(t)


def _data_view_of_same_storage(t):
    t.data = t.data.flatten()[1:]  # the same storage, from its second element


def _transpose(t):
    with torch.no_grad():
        t.t_()


def _dtype_view(t):
    t.data = t.data.view(torch.float16)


def _set_to_other_storage(t):
    with torch.no_grad():
        t.set_(torch.randn(t.shape))


def _as_strided(t):
    with torch.no_grad():
        t.as_strided_((t.shape[1], t.shape[0]), (1, t.shape[1]))


def _storage_grown(t):
    t.untyped_storage().resize_(t.untyped_storage().nbytes() + 64)


def _storage_reallocated(t):
    # Released and allocated again, maybe at the same address; another size than before.
    st = t.untyped_storage()
    n = st.nbytes()
    st.resize_(0)
    st.resize_(n + 16)


def _swap_tensors(t):
    try:
        torch.utils.swap_tensors(t, torch.nn.Parameter(torch.randn_like(t)))
    except RuntimeError as exc:  # the pure-Python plan keeps a weak reference to every tensor
        assert plan._ext is None and "weakref" in str(exc), exc
        pytest.skip("swap_tensors refuses tensors a pure-Python plan watches")


TENSOR_CHANGES = [_data_other_storage, _data_view_of_same_storage, _transpose, _dtype_view, _set_to_other_storage,
                  _as_strided, _storage_grown, _storage_reallocated, _swap_tensors]


@pytest.mark.parametrize("kind", ["dict", "module"])
@pytest.mark.parametrize("change", TENSOR_CHANGES, ids=[c.__name__.lstrip("_") for c in TENSOR_CHANGES])
def test_a_changed_tensor_is_never_served_from_the_cache(arena, kind, change):
    # The changed tensor is not the target's first (whose storage the plan's weak reference watches).
    m = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(4, 6))
    target = m if kind == "module" else {"other": torch.randn(5), "weight": m[1].weight, "bias": m[1].bias}
    _warm(target, arena)
    change(m[1].weight)
    hits = _hits()
    _snapshot_matches(target, arena)
    assert _hits() == hits  # a fresh plan
    _snapshot_matches(target, arena)  # which is then cached and right


def test_a_storage_refilled_at_the_same_address_and_size_is_the_same_storage(arena):
    # Not a change at all: the plan stays valid and copies the memory that is there now.
    t = torch.randn(100)
    target = {"t": t}
    _warm(target, arena)
    with torch.no_grad():
        t.copy_(torch.arange(100.0))
    _snapshot_matches(target, arena)


# -- a flat dict read in one pass --------------------------------------------------------------------------
class MyTensor(torch.Tensor):
    pass


class Key(str):
    pass


def _dicts():
    a, b = torch.randn(3), torch.randn(4)
    from collections import OrderedDict

    od = OrderedDict([("b", b), ("a", a)])
    od.move_to_end("b")  # its own order, not its table's
    return [("plain", {"a": a, "b": b}), ("ordered", od), ("subclass value", {"a": a, "b": b.as_subclass(MyTensor)}),
            ("str subclass key", {Key("a"): a, "b": b}), ("int key", {0: a, 1: b}),
            ("parameter", {"a": torch.nn.Parameter(a)}), ("nested", {"a": a, "sub": {"b": b}})]


@pytest.mark.parametrize("name,target", _dicts(), ids=[n for n, _ in _dicts()])
def test_a_dict_is_read_as_the_python_path_reads_it(name, target, monkeypatch):
    got = [(n, id(t)) for n, t in named_tensors(target)]
    monkeypatch.setattr(adapters, "_ext", None)
    assert got == [(n, id(t)) for n, t in named_tensors(target)]


def test_a_dict_changed_between_calls_is_read_again(arena):
    target = {"a": torch.randn(3), "b": torch.randn(4)}
    _warm(target, arena)
    target["b"] = torch.randn(4)
    _snapshot_matches(target, arena)
    target["c"] = torch.randn(2)
    _snapshot_matches(target, arena)
    del target["a"]
    _snapshot_matches(target, arena)


@needs_ext
def test_a_dicts_keys_list_is_reused_only_while_its_keys_are_the_same_objects(arena, checks):
    if checks == "python":
        pytest.skip("the helper's reading of a dict only")
    # The keys list of the last read of a dict is the next read's names, where its keys are those very
    # objects in that order (no key touched, the plan's names found by identity); any other dict, or one
    # whose keys changed in any way, is read afresh, and the plan bound again where its names differ.
    a, b = torch.randn(3), torch.randn(4)
    target = {"alpha": a, "beta": b}
    first = named_tensors(target).names
    assert named_tensors(target).names is first
    _warm(target, arena)
    equal_key = "".join(["be", "ta"])  # equal, another object
    assert id(equal_key) != id(first[1])
    target[equal_key] = target.pop("beta")
    got = named_tensors(target).names
    assert got is not first and got == ["alpha", "beta"]
    target["alpha"] = target.pop("alpha")  # the same key objects, reordered
    got = named_tensors(target).names
    assert got == ["beta", "alpha"]
    _snapshot_matches(target, arena)
    target[Key("gamma")] = torch.randn(2)  # not a str: the general path
    assert named_tensors(target).names == ["beta", "alpha", "gamma"]
    # A crafted list never stands for other keys: of another length, or other objects.
    d = {"xy": a}
    assert torch_ext.ext.plain_items(d, ["xy", "z"])[0] == ["xy"]
    other = torch_ext.ext.plain_items(d, ["".join(["x", "y"])])[0]
    assert other == ["xy"] and id(other[0]) == id(next(iter(d)))
    assert torch_ext.ext.plain_items({"xy": a, "z": 3}, None) is None
    # Dicts that come and go with reused ids read their own keys.
    for i in range(20):
        fresh = {f"k{i}": a, f"j{i}": b}
        assert named_tensors(fresh).names == [f"k{i}", f"j{i}"]
        del fresh


# -- offloaded state ----------------------------------------------------------------------------------------
def test_an_offloaded_storage_is_seen_through_a_cached_plan_of_another_target(arena):
    m = torch.nn.Linear(4, 4)
    _warm(m, arena)  # the module's plan is cached and found clear of offloaded storages
    go.offload({"w": m.weight}, arena=arena)
    with pytest.raises(go.OffloadError, match="^cannot snapshot: weight is offloaded"):  # (as this target names it)
        go.snapshot(m, arena=arena)
    go.reload({"w": m.weight})
    _snapshot_matches(m, arena)


def test_an_offloaded_target_refuses_through_its_own_plan(arena):
    m = _model()
    _warm(m, arena)
    go.offload(m, arena=arena)
    for call in (lambda: go.snapshot(m, arena=arena), lambda: go.offload(m, arena=arena)):
        with pytest.raises(go.OffloadError, match="is offloaded"):
            call()
    assert go.is_offloaded(m)
    go.reload(m)
    assert not go.is_offloaded(m)


def test_a_discarded_target_is_refused_with_the_reason(arena):
    target = {"a": torch.randn(4), "b": torch.randn(3)}
    _warm(target, arena)
    go.offload(target, arena=arena)
    go.discard(target)
    assert not go.is_offloaded(target) and arena.used_bytes == 0
    with pytest.raises(go.OffloadError, match="released outside gpu_offload"):
        go.snapshot(target, arena=arena)
    with pytest.raises(go.OffloadError, match="nothing in the target is offloaded"):
        go.reload(target)


@pytest.mark.parametrize("how", ["parameter replaced", "data swapped", "reloaded through another target"])
def test_a_target_changed_while_offloaded_reloads_what_it_holds_now(arena, how):
    m = _model()
    expected = {n: t.detach().clone() for n, t in named_tensors(m)}
    go.offload(m, arena=arena)
    if how == "parameter replaced":
        m[0].inner.weight = torch.nn.Parameter(torch.full((2, 3), 5.0))
        expected["0.inner.weight"] = torch.full((2, 3), 5.0)
    elif how == "data swapped":
        m[1].inner.bias.data = torch.full((2,), 6.0)
        expected["1.inner.bias"] = torch.full((2,), 6.0)
    else:
        go.reload(dict(m.named_parameters()))  # the parameters come back; the buffers stay offloaded
        assert go.is_offloaded(m)  # (in part: reload has its buffers to bring back)
    go.reload(m)
    for name, t in named_tensors(m):
        assert_bitwise_equal(t.detach(), expected[name])
    assert not go.is_offloaded(m)
    go.snapshot(m, arena=arena).free()
    with pytest.raises(go.OffloadError, match="nothing in the target is offloaded"):
        go.reload(m)
    import gc

    gc.collect()
    go.offloaded_bytes()  # takes the registry lock: dead storages' records are dropped
    assert go.offloaded_bytes() == 0 and arena.used_bytes == 0


def test_a_model_dropped_while_offloaded_returns_its_arena_memory(arena):
    m = _model()
    go.offload(m, arena=arena)
    assert arena.used_bytes > 0
    del m
    import gc

    gc.collect()
    assert go.offloaded_bytes() == 0  # (the lock drops the records of storages that died)
    assert arena.used_bytes == 0


def test_offload_reload_cycles_stay_on_the_plan_and_bitwise_right(arena):
    m = _model()
    expected = {n: t.detach().clone() for n, t in named_tensors(m)}
    go.snapshot(m, arena=arena).free()
    misses = plan.cache_info()["misses"]
    for _ in range(3):
        go.offload(m, arena=arena)
        assert go.is_offloaded(m)
        go.reload(m)
    assert plan.cache_info()["misses"] == misses  # neither offload nor reload bound the target again
    for name, t in named_tensors(m):
        assert_bitwise_equal(t.detach(), expected[name])
    assert arena.used_bytes == 0


# -- the helper's batched operations ------------------------------------------------------------------------
@needs_ext
def test_a_record_refuses_to_resize_or_watch_tensors_that_moved():
    a, b = torch.randn(8), torch.randn(3)
    record = torch_ext.ext.record([a, b])
    assert record.check([a, b])
    a.data = torch.randn(8)  # (another thread, between the check and the resize)
    before = [t.untyped_storage().nbytes() for t in (a, b)]
    with pytest.raises(ValueError, match="changed"):
        record.resize_live([a, b], True)
    with pytest.raises(ValueError, match="changed"):
        record.watch_live([a, b])
    assert [t.untyped_storage().nbytes() for t in (a, b)] == before


@needs_ext
def test_storages_held_by_the_check_are_the_checked_ones_and_are_resized_once():
    # check_held() holds the live storages it found, for the call's watch and resize: a tensor moved to another
    # storage in between (another thread) leaves the checked storage to be resized (it cannot have died: it is
    # held), and the new one alone; the held storages serve one resize.
    a, b, empty = torch.randn(8), torch.randn(3), torch.empty(0)
    record = torch_ext.ext.record([a, b, empty])
    assert record.check_held([a, b.t(), empty]) is None  # what check() refuses
    held = record.check_held([a, b, empty])
    assert held.num_held == 2 and not held.spent  # (the empty storage is not live)
    checked = a.untyped_storage()
    a.data = torch.randn(8)
    del checked  # only the held reference keeps it now
    watch = record.watch_live([a, b, empty], held)
    record.resize_live([a, b, empty], True, False, held)
    assert held.spent and held.num_held == 0
    assert a.untyped_storage().nbytes() == 32 and b.untyped_storage().nbytes() == 0
    assert watch.dead() == [0]  # the checked storage died with its last reference, the held one
    # Spent, or another record's: reached through the tensors again (and their change seen).
    with pytest.raises(ValueError, match="changed"):
        record.resize_live([a, b, empty], False, False, held)
    c = torch.randn(3)
    held_elsewhere = torch_ext.ext.record([c]).check_held([c])
    assert held_elsewhere.num_held == 1
    with pytest.raises(ValueError, match="changed"):
        record.resize_live([a, b, empty], False, False, held_elsewhere)
    assert b.untyped_storage().nbytes() == 0


@needs_ext
def test_record_streams_live_checks_every_stream_before_recording_and_has_nothing_to_do_on_the_cpu(monkeypatch):
    # The offload's record_stream of every live CUDA storage, in one pass (the GPU tests show the allocator
    # honours it): the streams are checked first, whatever the storages' devices; CPU storages have none.
    a, b = torch.randn(8), torch.randn(3)
    record = torch_ext.ext.record([a, b])
    held = record.check_held([a, b])
    assert record.record_streams_live([a, b], held, {}) == 0
    assert record.record_streams_live([a, b], None, {}) == 0
    assert not held.spent and held.num_held == 2  # (recording spends nothing)
    cuda = 1  # torch's DeviceType.CUDA
    for bad, error in [({0: (7, 1, cuda)}, ValueError),  # another device's stream under index 0
                       ({0: (7, 0, 0)}, ValueError),  # a CPU "stream"
                       ({-1: (7, -1, cuda)}, ValueError),
                       ({0: "stream"}, TypeError), ({"0": (7, 0, cuda)}, TypeError), ({0: (7, 0)}, TypeError)]:
        with pytest.raises(error, match="record_streams_live"):
            record.record_streams_live([a, b], held, bad)
    assert record.record_streams_live([a, b], held, {0: (7, 0, cuda)}) == 0  # a well-formed one: unused here
    monkeypatch.setattr(plan, "copy_stream", lambda *args: pytest.fail("a copy stream asked for a CPU target"))
    resolved = plan.resolve(named_tensors({"a": a, "b": b}), hold=True)
    plan.mark_live_in_use(resolved, to_host=True)  # CPU only: nothing to record, no stream made


@needs_ext
def test_an_offload_and_reload_resize_the_storages_their_check_held(arena, monkeypatch, checks):
    if checks == "python":
        pytest.skip("the helper's records only")
    m = _model()
    expected = {n: t.detach().clone() for n, t in named_tensors(m)}
    _warm(m, arena)
    seen: list[Any] = []
    resize_live = torch_ext.ext.TargetRecord.resize_live
    monkeypatch.setattr(torch_ext.ext.TargetRecord, "resize_live",
                        lambda rec, ts, release, refuse=False, held=None:
                        (seen.append(None if held is None else held.num_held), resize_live(rec, ts, release, refuse, held))[1])
    go.offload(m, arena=arena)
    go.reload(m)
    assert seen == [len(plan.lookup(*plan._split(named_tensors(m))).live)] * 2
    for name, t in named_tensors(m):
        assert_bitwise_equal(t.detach(), expected[name])


@needs_ext
def test_a_record_rearms_its_last_watch_only_while_it_still_holds_every_storage():
    # An offload+reload cycle re-arms the record's last watch instead of taking and dropping a weak reference
    # per storage; a watch still watching, or one that lost a position (a death, a forget), is not reused,
    # and a re-armed one still sees a death.
    ts = [torch.randn(4), torch.randn(2)]
    record = torch_ext.ext.record(ts)
    first = record.watch_live(ts)
    assert record.watch_live(ts) is not first  # still watching: a new one
    second = record.watch_live(ts)
    second.forget_all()
    assert second.num_watched == 0
    again = record.watch_live(ts)
    assert again is second and again.num_watched == 2 and again.dead() == []
    ts[1].data = torch.randn(2)  # its old storage dies while re-armed
    assert again.dead() == [1] and again.num_watched == 1
    ts2 = [torch.randn(3), torch.randn(5)]
    record2 = torch_ext.ext.record(ts2)
    w = record2.watch_live(ts2)
    w.forget([0])  # one position forgotten: its reference went
    w.forget_all()
    assert record2.watch_live(ts2) is not w
    # A plain StorageWatch (not a record's) drops its references at forget_all, as before.
    plain_watch = torch_ext.ext.StorageWatch(ts2)
    plain_watch.forget_all()
    assert plain_watch.num_watched == 0 and plain_watch.dead() == []


@needs_ext
def test_a_target_dropped_after_some_cycles_returns_its_bytes(arena, checks):
    # The second and later offloads watch through the re-armed watch of the first: dropping the target
    # while offloaded still gives its bytes back.
    m = _model()
    _warm(m, arena)
    watches = []
    for _ in range(3):
        go.offload(m, arena=arena)
        watches.append(plan.lookup(*plan._split(named_tensors(m))).offloaded._watch)
        go.reload(m)
    if checks != "python":
        assert watches[0] is not None and watches.count(watches[0]) == 3  # one watch, re-armed
    go.offload(m, arena=arena)
    assert go.offloaded_bytes() > 0 and arena.used_bytes > 0
    del m
    gc.collect()
    go.is_offloaded({})  # (any call that takes the lock drops what died)
    assert go.offloaded_bytes() == 0 and arena.used_bytes == 0


@needs_ext
def test_the_batched_calls_accept_no_bare_storage_keys():
    t = torch.randn(4)
    with pytest.raises(TypeError):
        torch_ext.ext.resize_storages([t.untyped_storage()._cdata], [0])
    with pytest.raises(TypeError):
        torch_ext.ext.StorageWatch([t.untyped_storage()._cdata])
    assert t.untyped_storage().nbytes() == 16


@needs_ext
def test_the_resize_cuda_storages_get_runs_on_cpu_storages_too():
    # resize_live resizes a CUDA storage through its own allocator under a device guard (no libtorch_cuda in
    # the helper); the same code on CPU storages: released to 0, grown from 0, refused otherwise.
    ts = [torch.randn(5), torch.randn(2, 3)]
    torch_ext.ext.resize_storages(ts, [0, 0], through_allocator=True)
    assert [t.untyped_storage().nbytes() for t in ts] == [0, 0]
    assert [t.untyped_storage().data_ptr() for t in ts] == [0, 0]
    torch_ext.ext.resize_storages(ts, [20, 24], through_allocator=True)
    assert [t.untyped_storage().nbytes() for t in ts] == [20, 24]
    assert all(t.untyped_storage().data_ptr() != 0 for t in ts)
    ts[0].fill_(1.5)
    ts[1].copy_(torch.arange(6.0).view(2, 3))
    assert ts[0].tolist() == [1.5] * 5 and ts[1].sum().item() == 15.0
    with pytest.raises(ValueError, match="grows only from 0 bytes"):
        torch_ext.ext.resize_storages(ts[:1], [40], through_allocator=True)
    fixed = torch.from_numpy(__import__("numpy").zeros(4, dtype="float32"))  # not resizable
    with pytest.raises(RuntimeError, match="not resizable"):
        torch_ext.ext.resize_storages([fixed], [0], through_allocator=True)
    assert fixed.untyped_storage().nbytes() == 16


@needs_ext
@pytest.mark.skipif(not torch_ext.access_guard_available(), reason="this torch cannot lift a refusal")
def test_the_refusal_messages_move_between_the_record_and_the_storages_and_none_is_lost():
    # resize_live(refuse=True) moves each message into its storage at a release and back at the growth; a
    # refusal lifted by someone else (allow_access) takes its message with it, and the next release copies
    # it again from the list given.
    ts = [torch.randn(3), torch.randn(2)]
    values = [t.clone() for t in ts]
    record = torch_ext.ext.record(ts)
    record.set_refusals(["gpu_offload: a is offloaded", "gpu_offload: b is offloaded"])
    for _ in range(3):
        record.resize_live(ts, True, True)
        for t, name in zip(ts, "ab"):
            with pytest.raises(RuntimeError, match=f"^gpu_offload: {name} is offloaded$"):
                t.sum()
        record.resize_live(ts, False, True)
        assert not any(torch_ext.access_refused(t) for t in ts)
    record.resize_live(ts, True, True)
    torch_ext.allow_access(ts)  # not through the record: the messages go
    torch_ext.ext.resize_storages(ts, [12, 8])
    for t, v in zip(ts, values):
        t.copy_(v)
    record.refresh(ts)
    record.resize_live(ts, True, True)
    with pytest.raises(RuntimeError, match="^gpu_offload: b is offloaded$"):
        ts[1].sum()
    record.resize_live(ts, False, True)
    with pytest.raises(TypeError):
        record.set_refusals(["one", 2])
    with pytest.raises(ValueError, match="1 messages for 2 live storages"):
        record.set_refusals(["one"])
    assert record.refusals == ["gpu_offload: a is offloaded", "gpu_offload: b is offloaded"]


@needs_ext
def test_a_record_follows_its_storages_through_resize_live():
    ts = [torch.randn(5), torch.randn(2, 3), torch.empty(0)]
    values = [t.clone() for t in ts]
    record = torch_ext.ext.record(ts)
    record.resize_live(ts, True)
    assert [t.untyped_storage().nbytes() for t in ts] == [0, 0, 0]
    assert record.check(ts)  # the record is the target as it is now
    record.resize_live(ts, False)
    assert [t.untyped_storage().nbytes() for t in ts] == [20, 24, 0]
    assert record.check(ts)
    for t, v in zip(ts[:2], values[:2]):
        t.copy_(v)
    watch = record.watch_live(ts)
    assert len(watch) == 2 and watch.dead() == []
    ts[0].data = torch.randn(5)  # its old storage dies
    assert watch.dead() == [0] and watch.num_watched == 1


# -- restore bumps every version once, before its copy ----------------------------------------------------------
def _versions(target) -> list[int]:
    return [t._version for _, t in named_tensors(target)]


@pytest.mark.parametrize("how", ["cached", "twin", "verify"])
def test_a_restore_bumps_every_version_once_before_its_copy(arena, checks, monkeypatch, how):
    # A cached plan of the snapshot's own layout is bumped by its check, in its pass; a twin (another plan,
    # matched by names) and a verified restore are bumped in a pass of their own. Each version moves by one,
    # and is already moved when the copy starts.
    model = _model()
    snap = go.snapshot(model, arena=arena, checksum=how == "verify").wait()
    target = _model() if how == "twin" else model
    go.restore(target, snap, verify=how == "verify")  # (a first call: the twin's plan is made)
    before = _versions(target)
    seen: list[list[int]] = []
    run = plan.CopyPlans.run

    def copy_after_looking(self, *args, **kwargs):
        seen.append(_versions(target))
        return run(self, *args, **kwargs)

    monkeypatch.setattr(plan.CopyPlans, "run", copy_after_looking)
    hits = _hits()
    go.restore(target, snap, verify=how == "verify")
    assert _hits() == hits + 1
    assert seen == [[v + 1 for v in before]] and _versions(target) == [v + 1 for v in before]
    snap.free()


def test_an_interrupt_right_after_a_restores_copy_leaves_its_tensors_bumped(arena, checks, monkeypatch):
    model = _model()
    snap = go.snapshot(model, arena=arena).wait()
    expected = {n: t.detach().clone() for n, t in named_tensors(model)}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1)
    before = _versions(model)
    run = plan.CopyPlans.run

    def interrupted(self, *args, **kwargs):  # the signal lands as run() returns: its result is lost
        run(self, *args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(plan.CopyPlans, "run", interrupted)
    with pytest.raises(KeyboardInterrupt):
        go.restore(model, snap)
    monkeypatch.undo()
    for name, t in named_tensors(model):  # written, and autograd told so
        assert_bitwise_equal(t.detach(), expected[name])
    assert _versions(model) == [v + 1 for v in before]
    snap.free()


def _refused_as_offloaded(model, snap, arena):
    go.offload(model, arena=arena)
    try:
        with pytest.raises(go.OffloadError, match="is offloaded"):
            go.restore(model, snap)
    finally:
        go.reload(model)


def _refused_as_another_layout(model, snap, arena):
    model[1].inner.weight = torch.nn.Parameter(torch.randn(4, 3))  # (a changed target: another plan)
    with pytest.raises(go.LayoutMismatchError):
        go.restore(model, snap)


def _refused_as_corrupt(model, snap, arena):
    snap.tensors()["0.inner.bias"].view(torch.uint8)[0] ^= 1  # (a bit flipped in the host copy)
    with pytest.raises(go.OffloadError, match="corrupt"):
        go.restore(model, snap, verify=True)


@pytest.mark.parametrize("refusal", [_refused_as_offloaded, _refused_as_another_layout, _refused_as_corrupt])
def test_a_restore_refused_before_its_copy_bumps_no_version(arena, checks, refusal):
    model = _model()
    snap = go.snapshot(model, arena=arena, checksum=True).wait()
    go.restore(model, snap)  # (the plan is cached: the next restore's check would bump)
    tensors = [t for _, t in named_tensors(model)]  # (a replaced one is still looked at: it moved no version either)
    before = [t._version for t in tensors]
    refusal(model, snap, arena)
    assert [t._version for t in tensors] == before
    snap.free()


@needs_ext
def test_same_views_ignores_the_storages_memory_and_nothing_else():
    base = torch.randn(6)
    ts = [base, base[2:], torch.randn(2, 3)]
    record = torch_ext.ext.record(ts)
    base.untyped_storage().resize_(0)  # (what an offload does: the storage holds nothing)
    assert not record.check(ts) and record.same_views(ts)
    base.untyped_storage().resize_(24)
    for change in (lambda: ts[2].t_(), lambda: setattr(ts[2], "data", torch.randn(2, 3)),
                   lambda: ts.__setitem__(1, base[1:]), lambda: ts[2].set_(torch.randn(2, 3).untyped_storage())):
        fresh = [base, base[2:], torch.randn(2, 3)]
        ts[:] = fresh
        record = torch_ext.ext.record(ts)
        assert record.same_views(ts)
        change()
        assert not record.same_views(ts)


@needs_ext
def test_a_records_check_bumps_only_once_every_tensor_passed(checks):
    if checks == "python":
        pytest.skip("the helper's records only")
    ts = [torch.randn(3) for _ in range(9)]
    record = torch_ext.ext.record(ts)
    before = [t._version for t in ts]
    assert record.check(ts) and [t._version for t in ts] == before  # (no bump asked)
    ts[6].data = torch.randn(3)  # another storage (no version moves)
    assert not record.check(ts, True) and [t._version for t in ts] == before
    with torch.inference_mode():
        ts.append(torch.randn(2))  # an inference tensor has no version counter: skipped
    fresh = torch_ext.ext.record(ts)
    assert fresh.check(ts, True) and [t._version for t in ts[:-1]] == [v + 1 for v in before]


# -- a check in parts, on threads of their own ------------------------------------------------------------------
@pytest.fixture
def in_parts(checks):
    """Every record's check split into three parts (two on threads of their own), however few its tensors.
    (These tests ask records directly: once, not in each of `checks`' modes.)"""
    if checks != "helper":
        pytest.skip("records asked directly: once")
    record_type = getattr(torch_ext.ext, "TargetRecord", None)
    if record_type is None or not hasattr(record_type, "set_check_parts"):
        pytest.skip("this helper checks in one part")
    _, per_thread = record_type.check_parts()
    record_type.set_check_parts(3, 1)
    try:
        yield record_type
    finally:
        record_type.set_check_parts(0, per_thread)


def _nine_tensors() -> list[torch.Tensor]:
    base = torch.randn(12)
    # (Views of one storage in the first and the last part: its storage's facts are checked with the first.)
    return [base[:4], torch.randn(3), torch.randn(2, 2), torch.randn(5), torch.randn(3), torch.randn(1),
            torch.randn(2), torch.randn(4), base[4:]]


_CHANGES = {
    ".data": lambda ts, i: setattr(ts[i], "data", torch.randn(ts[i].shape)),
    "replaced": lambda ts, i: ts.__setitem__(i, ts[i].clone()),
    "t_": lambda ts, i: ts[i].t_() if ts[i].dim() == 2 else ts[i].unsqueeze_(0),
    "offset": lambda ts, i: ts[i].set_(ts[i].untyped_storage(), ts[i].storage_offset() + 1, (ts[i].numel() - 1,)),
    "dtype view": lambda ts, i: setattr(ts[i], "data", ts[i].view(torch.int32)),
    "resized": lambda ts, i: ts[i].untyped_storage().resize_(ts[i].untyped_storage().nbytes() + 4),
    "conj": lambda ts, i: setattr(ts[i], "data", ts[i].to(torch.complex64).conj()),
}


@needs_ext
@pytest.mark.parametrize("change", list(_CHANGES))
def test_a_check_in_parts_sees_a_change_in_every_part(in_parts, change):
    # Three parts of three tensors: a change at any position is found, by whichever thread checks it, and a
    # part that passed does not make the whole pass. check_held answers as check does.
    for i in range(9):
        ts = _nine_tensors()
        record = torch_ext.ext.record(ts)
        assert record.check(ts) and record.check_held(ts) is not None and record.check(ts, True)
        _CHANGES[change](ts, i)
        assert not record.check(ts), (change, i)
        assert record.check_held(ts) is None, (change, i)
        assert not record.check(ts, True), (change, i)


@needs_ext
def test_a_check_in_parts_bumps_every_version_once_as_one_part_does(in_parts):
    ts = _nine_tensors()
    with torch.inference_mode():
        ts.insert(4, torch.randn(2))  # (no counter: skipped, in the middle part)
    record = torch_ext.ext.record(ts)
    counted = [t for i, t in enumerate(ts) if i != 4]
    before = [t._version for t in counted]
    assert record.check(ts, True)
    in_parts.set_check_parts(1, 1)
    assert record.check(ts, True)
    # The two views of `base` (first and last part) share one counter: each check bumps it once per view.
    expected = [v + 2 * (2 if i in (0, 8) else 1) for i, v in enumerate(before)]
    assert [t._version for t in counted] == expected


@needs_ext
def test_a_check_in_parts_holds_the_live_storages_in_order(in_parts):
    ts = _nine_tensors()
    ts[5].untyped_storage().resize_(0)  # (held nothing when recorded: not live, not held)
    ts[5] = ts[5].detach()
    ts[5].set_(ts[5].untyped_storage(), 0, (0,))
    record = torch_ext.ext.record(ts)
    held = record.check_held(ts)
    assert held is not None
    # Released through what the check held, in one pass: exactly the live storages, in their order.
    record.resize_live(ts, True, False, held)
    assert [t.untyped_storage().nbytes() for t in ts] == [0] * len(ts)
    record.resize_live(ts, False, False, None)
    assert [t.untyped_storage().nbytes() for t in ts] == [48, 12, 16, 20, 12, 0, 8, 16, 48]


@needs_ext
@pytest.mark.skipif(not hasattr(torch, "_lazy_clone"), reason="this torch has no copy-on-write storages")
def test_a_check_in_parts_leaves_a_copy_on_write_storage_to_the_calling_thread(arena, in_parts):
    # Materializing a storage shared copy-on-write allocates and copies: a part's thread answers "unsure" and
    # the whole check runs again on the caller's thread, which gives the tensor memory of its own.
    target = {f"t{i}": torch.zeros(100) for i in range(9)}
    snap = go.snapshot(target, arena=arena)
    go.restore(target, snap)  # (cached: the next restore is the record's check)
    with torch.no_grad():
        target["t8"].fill_(1.0)
    clone = torch._lazy_clone(target["t8"])
    go.restore(target, snap)
    snap.free()
    assert all(bool((t == 0).all()) for t in target.values()) and bool((clone == 1).all())


def _mixed_tensors() -> list[torch.Tensor]:
    base = torch.arange(24.0)
    with torch.inference_mode():
        inference = torch.ones(3)
    return [base[:6].view(2, 3), torch.tensor(5.0), torch.zeros(0), torch.randn(2, 3, 4).transpose(0, 2),
            torch.ones(7, dtype=torch.bfloat16), base[6:], torch.randn(4, 4).t(), inference,
            torch.empty(5, dtype=torch.int8)[1:], base, torch.nn.Parameter(torch.randn(3, 1))]


@needs_ext
def test_a_record_made_in_parts_is_the_record_made_in_one(in_parts):
    # Made in parts on threads (each thread a slice of the tensors' facts and their dims, this thread the
    # storages in order): the same layout, columns, storages and checks as the record one thread makes.
    ts = _mixed_tensors()
    for threads in (2, 3, 4, 11):
        in_parts.set_check_parts(threads, 1)
        made = torch_ext.ext.record(ts)
        in_parts.set_check_parts(1, 1)
        one = torch_ext.ext.record(ts)
        assert made.same_layout(one) and one.same_layout(made)
        assert made.tensor_columns() == one.tensor_columns()
        assert (made.keys(), made.storage_nbytes(), made.first_tensor(), made.live()) == (
            one.keys(), one.storage_nbytes(), one.first_tensor(), one.live())
        assert made.check(ts) and made.same_views(ts) and made.all_resizable == one.all_resizable
    in_parts.set_check_parts(3, 1)
    for bad in (torch.ones(2).as_subclass(type("Sub", (torch.Tensor,), {})), torch.ones(2, dtype=torch.complex64).conj(),
                3):
        assert torch_ext.ext.record(ts[:5] + [bad] + ts[5:]) is None  # (refused, as one thread refuses it)


@needs_ext
@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork here")
def test_a_forked_child_checks_in_parts_on_threads_of_its_own(in_parts, arena):
    # The parts' threads live for one call: a child forked after checks in parts starts its own, and sees a
    # change in the last part as the parent would.
    target = {f"t{i}": torch.full((5,), float(i)) for i in range(9)}
    snap = go.snapshot(target, arena=arena).wait()
    go.restore(target, snap)  # (cached: the check in parts, on threads, in the parent)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            with torch.no_grad():
                for t in target.values():
                    t.zero_()
            hits, misses = plan._stats["hits"], plan._stats["misses"]
            go.restore(target, snap)  # (the cached plan: its check in parts, in the child)
            same = all(bool((t == float(i)).all()) for i, t in enumerate(target.values()))
            served = plan._stats["hits"] == hits + 1
            target["t8"].data = torch.zeros(5)  # (another storage: the record must not serve it)
            go.restore(target, snap)
            seen = plan._stats["misses"] == misses + 1 and bool((target["t8"] == 8.0).all())
            code = 0 if same and served and seen else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    snap.free()
    assert os.waitstatus_to_exitcode(status) == 0


@needs_ext
def test_check_parts_come_from_the_copy_threads_setting_and_refuse_nonsense(in_parts, monkeypatch):
    # threads 0: read again from GPU_OFFLOAD_NUM_THREADS at the next check, as the copy pool reads it (at most
    # 16); what the pool refuses counts as the cores here (the pool says what is wrong at the first copy).
    cores = min(os.cpu_count() or 1, 16)
    got = {}
    for value in ("3", "40", "0", "two", "", None):
        if value is None:
            monkeypatch.delenv("GPU_OFFLOAD_NUM_THREADS", raising=False)
        else:
            monkeypatch.setenv("GPU_OFFLOAD_NUM_THREADS", value)
        in_parts.set_check_parts(0, 8192)
        got[value] = in_parts.check_parts()
    assert got == {"3": (3, 8192), "40": (16, 8192), "0": (cores, 8192), "two": (cores, 8192), "": (cores, 8192),
                   None: (cores, 8192)}
    in_parts.set_check_parts(5, 7)
    for threads, per in ((-1, 8192), (65, 8192), (2, 0)):
        with pytest.raises(ValueError, match="check threads"):
            in_parts.set_check_parts(threads, per)
    assert in_parts.check_parts() == (5, 7)  # (a refused setting changes nothing)


# -- the cost of a changed target is in the debug log ----------------------------------------------------------
def test_a_call_that_finds_a_changed_target_logs_its_cost(arena, caplog):
    target = {"a": torch.randn(4), "b": torch.randn(3)}
    _warm(target, arena)
    with caplog.at_level(logging.DEBUG, logger="gpu_offload"):
        go.snapshot(target, arena=arena).free()
        assert not [r for r in caplog.records if r.getMessage().startswith("plan:")]
        target["b"] = torch.randn(3)
        go.snapshot(target, arena=arena).free()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("plan:")]
    assert len(lines) == 1 and "changed target of 2 tensors" in lines[0] and " ms" in lines[0], lines


# -- GPU_OFFLOAD_TORCH_EXT=0: the whole engine on its pure-Python paths, in a fresh process ---------------------
def test_with_the_helper_switched_off_every_path_is_pure_python_and_still_sees_every_change(checks):
    # The `checks` fixture switches the helper off inside this process; this runs a process where it was
    # never loaded, as a user who sets the variable gets, through the same changes and a full cycle.
    if checks != "python":
        pytest.skip("runs its own process, once")
    import os
    import subprocess
    import sys
    import textwrap
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    code = textwrap.dedent("""
        import torch
        import gpu_offload as go
        from gpu_offload import adapters, plan, registry, torch_ext
        from gpu_offload.adapters import named_tensors, plain_module_tensors

        assert torch_ext.ext is None and "GPU_OFFLOAD_TORCH_EXT=0" in torch_ext.status(), torch_ext.status()
        assert plan._ext is None and registry._ext is None and adapters._ext is None
        arena = go.Arena()
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 2))
        d = {"a": torch.randn(5), "b": torch.randn(2, 3)}

        def matches(target):
            truth = (plain_module_tensors(target, include_grads=False) if isinstance(target, torch.nn.Module)
                     else list(target.items()))
            snap = go.snapshot(target, arena=arena).wait()
            got = snap.tensors()
            assert list(got) == [n for n, _ in truth], (list(got), truth)
            for n, t in truth:
                assert torch.equal(got[n], t.detach()), n
            snap.free()

        hits = plan.cache_info()["hits"]
        for target in (m, d):
            matches(target); matches(target)  # the second from the cached plan
        assert plan.cache_info()["hits"] == hits + 2
        m[0]._parameters["weight"] = torch.nn.Parameter(torch.randn(2, 3))  # straight into _parameters
        matches(m)
        m[1].weight.data = torch.randn(2, 2)  # .data to another storage
        matches(m)
        d["b"].t_()
        matches(d)
        expected = {n: t.detach().clone() for n, t in named_tensors(m)}
        for _ in range(2):
            go.offload(m, arena=arena)
            assert go.is_offloaded(m)
            try:
                go.snapshot(m, arena=arena)
            except go.OffloadError:
                pass
            else:
                raise AssertionError("a snapshot of an offloaded module was not refused")
            go.reload(m)
        for n, t in named_tensors(m):
            assert torch.equal(t.detach(), expected[n]), n
        snap = go.snapshot(d, arena=arena).wait()
        values = {k: v.clone() for k, v in d.items()}
        for v in d.values():
            v.zero_()
        go.restore(d, snap)
        snap.free()
        assert all(torch.equal(d[k], values[k]) for k in d)
        assert arena.used_bytes == 0
        print("ok")
    """)
    env = dict(os.environ, GPU_OFFLOAD_TORCH_EXT="0", PYTHONPATH=f"{root}:{root / 'tests'}")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240, cwd=root, env=env)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stdout + out.stderr


@pytest.mark.parametrize("where", ["root", "child"])
def test_a_module_class_with_its_own_traversal_is_read_as_torch_reads_it(arena, where):
    # A class that overrides named_parameters: as the root its override is the traversal (not recorded); as a
    # child torch's traversal never calls it. Either way the engine reads what torch's own walk says.
    torch.manual_seed(0)
    m = RenamedLinear(3, 2) if where == "root" else torch.nn.Sequential(RenamedLinear(3, 2), torch.nn.Linear(2, 2))
    truth = [(n, id(t)) for n, t in plain_module_tensors(m, include_grads=False)]
    assert any("kernel" in n for n, _ in truth) == (where == "root")
    for _ in range(2):
        assert [(n, id(t)) for n, t in named_tensors(m)] == truth
        _snapshot_matches(m, arena)


# -- gradients: read with the recorded traversal, and a reload through the offload's plan --------------------
def _grads_walked(m: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    params = list(m.named_parameters(remove_duplicate=False))
    return (params + list(m.named_buffers(remove_duplicate=False))
            + [(f"{n}.grad", p.grad) for n, p in params if p.grad is not None])


def _same_pairs(named, expected) -> None:
    assert [n for n, _ in named] == [n for n, _ in expected]
    assert all(a is b for (_, a), (_, b) in zip(named, expected))


def test_a_recorded_traversal_reads_the_gradients_as_the_python_walk_names_them(checks):
    # include_grads through the record: each parameter's .grad after the state, under "<name>.grad", a tied
    # parameter's under each of its names; the same names list while the same parameters have one, and the
    # current grad objects every call (replaced, dropped, added).
    m = _model()
    m[1].inner = m[0].inner  # tied: two names for one module's parameters
    named_tensors(m)  # recorded
    none = named_tensors(m, include_grads=True)
    _same_pairs(none, _grads_walked(m))
    assert none.num_grads == 0
    for p in [m[0].inner.weight, m[0].experts[1].weight]:
        p.grad = torch.randn_like(p)
    first = named_tensors(m, include_grads=True)
    _same_pairs(first, _grads_walked(m))
    assert first.num_grads == 3  # (the tied weight's grad under both names)
    helper = checks == "helper" and adapters._ext is not None and adapters._ext.MODULE_TREE
    again = named_tensors(m, include_grads=True)
    assert again.tensors is not first.tensors
    assert again.names is first.names or not helper
    m[0].experts[1].weight.grad = torch.zeros(2, 2)  # replaced: the new object, the same names
    third = named_tensors(m, include_grads=True)
    assert third.names is first.names or not helper
    _same_pairs(third, _grads_walked(m))
    m[0].inner.weight.grad = None  # dropped: names without it
    m[0].experts[0].weight.grad = torch.ones(2, 2)  # and another added
    fourth = named_tensors(m, include_grads=True)
    _same_pairs(fourth, _grads_walked(m))
    assert fourth.num_grads == 2
    _same_pairs(fourth.state(), list(named_tensors(m)))
    _replace_param(m)  # the traversal changed: walked again, still as Python names them
    _same_pairs(named_tensors(m, include_grads=True), _grads_walked(m))


def _reload_binds(monkeypatch) -> list[int]:
    from gpu_offload import api

    calls: list[int] = []
    general = api._reload_bound
    monkeypatch.setattr(api, "_reload_bound", lambda named, verify: (calls.append(len(named)), general(named, verify))[1])
    return calls


def _with_grads(m: torch.nn.Module) -> None:
    for p in m.parameters():
        p.grad = torch.randn_like(p)


def test_gradients_kept_on_the_device_do_not_take_the_reload_off_its_plan(arena, monkeypatch):
    # offload(grads="keep") of a module whose parameters have grads: the reload goes through the plan the
    # offload left (the state's), without a bind, and the grads are untouched; the state comes back.
    m = _model()
    _with_grads(m)
    expected = {n: t.detach().clone() for n, t in named_tensors(m, include_grads=True)}
    calls = _reload_binds(monkeypatch)
    for _ in range(3):
        go.offload(m, arena=arena)
        assert not go.is_offloaded([p.grad for p in m.parameters()])
        go.reload(m)
    assert calls == []
    for name, t in named_tensors(m, include_grads=True):
        assert_bitwise_equal(t.detach(), expected[name])
    assert arena.used_bytes == 0


def test_a_reload_looks_for_gradients_another_offload_holds(arena, monkeypatch):
    # A gradient offloaded on its own (another target, which may hold gradients): a reload of the module
    # brings it back with the state, the general way, as before the shortcut.
    m = _model()
    _with_grads(m)
    grad = m[0].inner.weight.grad
    expected = grad.clone()
    go.offload(m, arena=arena)
    go.reload(m)  # (the plans made)
    calls = _reload_binds(monkeypatch)
    go.offload(m, arena=arena)
    go.offload({"g": grad}, arena=arena)
    go.reload(m)
    assert calls == [len(named_tensors(m, include_grads=True))]
    assert not go.is_offloaded({"g": grad})
    assert_bitwise_equal(grad, expected)
    # Other modules' state offloaded beside it holds no gradient: the plan again.
    other = _model()
    go.offload(other, arena=arena)
    go.offload(m, arena=arena)
    calls.clear()
    go.reload(m)
    assert calls == []
    go.reload(other)


def _reads(monkeypatch) -> list[bool]:
    """The include_grads of every read of a target the engine's calls make from here on."""
    import gpu_offload.api as api

    seen: list[bool] = []
    real = api.named_tensors

    def spy(target, **kw):
        seen.append(kw.get("include_grads", False))
        return real(target, **kw)

    monkeypatch.setattr(api, "named_tensors", spy)
    return seen


@pytest.mark.parametrize("policy", ["keep", "drop"])
def test_a_reload_reads_the_gradients_only_where_it_needs_them(arena, monkeypatch, policy):
    # The shortcut: where no registered set holds a gradient, the reload reads the state alone (a pass over
    # every parameter's .grad saved). Dropped gradients are a set of their own: read with the state, once.
    m = _model()
    _with_grads(m)
    expected = {n: t.detach().clone() for n, t in named_tensors(m, include_grads=True)}
    go.offload(m, arena=arena, grads=policy)
    go.reload(m)  # (the plans made)
    go.offload(m, arena=arena, grads=policy)
    reads = _reads(monkeypatch)
    go.reload(m)
    assert reads == ([False] if policy == "keep" else [True])
    for name, t in named_tensors(m, include_grads=True):
        want = expected[name] if policy == "keep" or not name.endswith(".grad") else torch.zeros_like(t)
        assert_bitwise_equal(t.detach(), want)
    # Where a set may hold gradients (copied with the state, or offloaded on their own) it reads them first.
    go.offload(m, arena=arena, grads="copy")
    reads.clear()
    go.reload(m)
    assert reads == [True]
    go.offload(m, arena=arena)
    go.offload({"g": m[0].inner.weight.grad}, arena=arena)
    reads.clear()
    go.reload(m)
    assert reads == [True] and not go.is_offloaded({"g": m[0].inner.weight.grad})
    assert arena.used_bytes == 0


def test_gradients_copied_with_the_state_come_back_through_their_plan(arena, monkeypatch):
    m = _model()
    _with_grads(m)
    expected = {n: t.detach().clone() for n, t in named_tensors(m, include_grads=True)}
    go.offload(m, arena=arena, grads="copy")
    go.reload(m)
    calls = _reload_binds(monkeypatch)
    for _ in range(2):
        go.offload(m, arena=arena, grads="copy")
        assert go.is_offloaded([p.grad for p in m.parameters()])
        go.reload(m)
    assert calls == []
    for name, t in named_tensors(m, include_grads=True):
        assert_bitwise_equal(t.detach(), expected[name])


def _storage_keys(ts) -> list[int]:
    return [t.untyped_storage()._cdata for t in ts]


def test_dropped_gradients_come_back_zeroed_through_their_plan(arena, monkeypatch, checks):
    # offload(grads="drop"): the gradients are released through a plan of their own and come back zeroed
    # through it at the reload of their module: the same tensors on the same storages, no bind.
    m = _model()
    _with_grads(m)
    grads = [p.grad for p in m.parameters()]
    keys = _storage_keys(grads)
    expected = {n: t.detach().clone() for n, t in named_tensors(m)}
    calls = _reload_binds(monkeypatch)
    for cycle in range(3):
        for g in grads:
            g.fill_(cycle + 1.0)
        go.offload(m, grads="drop", arena=arena)
        assert all(g.untyped_storage().nbytes() == 0 for g in grads)
        assert go.offloaded_bytes() == sum(t.untyped_storage().nbytes() for t in expected.values())
        go.reload(m)
        assert [p.grad for p in m.parameters()] == grads and _storage_keys(grads) == keys
        assert all(torch.equal(g, torch.zeros_like(g)) for g in grads)
        for name, t in named_tensors(m):
            assert_bitwise_equal(t.detach(), expected[name])
    assert go.offloaded_bytes() == 0 and arena.used_bytes == 0
    if checks != "python":
        assert calls == []


def test_gradients_found_apart_from_one_state_are_asked_again_of_a_state_sharing_one(arena, checks):
    # The gradients' plan remembers the state's plan it was found apart from (no storage shared), and that
    # answer is for that plan alone: a new state that shares a gradient's storage (a parameter made a view
    # of it) is asked again, so that gradient is copied with the state and comes back as it was, not zeroed.
    m = _model()
    _with_grads(m)
    m[1].extra = torch.nn.Parameter(torch.zeros(3), requires_grad=False)  # (state without a grad)
    for _ in range(2):  # (the gradients' plan cached, found apart from the state's)
        go.offload(m, grads="drop", arena=arena)
        go.reload(m)
    grads = [p.grad for p in m.parameters() if p.grad is not None]
    for g in grads:
        g.normal_()
    shared = m[0].inner.weight.grad
    before = shared.detach().clone()
    m[1].extra = torch.nn.Parameter(shared.detach().view(-1), requires_grad=False)  # (its storage)
    now = [p.grad for p in m.parameters() if p.grad is not None]
    assert len(now) == len(grads) and all(a is b for a, b in zip(now, grads))  # (the same gradients' plan)
    go.offload(m, grads="drop", arena=arena)
    go.reload(m)
    assert torch.equal(m[0].inner.weight.grad, before) and torch.equal(m[1].extra, before.view(-1))
    assert all(torch.equal(g, torch.zeros_like(g)) for g in grads if g is not shared)
    assert go.offloaded_bytes() == 0


@needs_ext
def test_a_dropped_gradient_refuses_access_either_way(arena, monkeypatch, checks):
    # Touching a dropped gradient raises, naming it (it used to read released memory), through the
    # gradients' plan and one by one alike.
    from gpu_offload import api

    if checks == "python":
        pytest.skip("refusing access is the helper's")
    for one_by_one in (False, True):
        if one_by_one:
            monkeypatch.setattr(api, "_drop_plan", lambda grads, state: None)
        m = _model()
        _with_grads(m)
        go.offload(m, grads="drop", arena=arena)
        with pytest.raises(RuntimeError, match=r"0\.inner\.weight\.grad was dropped by offload"):
            m[0].inner.weight.grad.sum()
        go.reload(m)
        assert torch.equal(m[0].inner.weight.grad, torch.zeros(2, 3))


def test_a_general_reload_that_fails_leaves_dropped_gradients_saying_so(arena, monkeypatch, checks):
    # Gradients dropped one by one are reloaded the general way with the state; a copy that fails there
    # undoes the reload, and each storage refuses again with its own message, not the offloaded one.
    from gpu_offload import api
    from conftest import inject_failure

    if checks == "python":
        pytest.skip("refusing access is the helper's")
    monkeypatch.setattr(api, "_drop_plan", lambda grads, state: None)
    m = _model()
    _with_grads(m)
    go.offload(m, grads="drop", arena=arena)
    inject_failure(monkeypatch, plan.CopyPlans, "run", 1, KeyboardInterrupt)
    with pytest.raises(KeyboardInterrupt):
        go.reload(m)
    monkeypatch.undo()
    with pytest.raises(RuntimeError, match=r"0\.inner\.weight\.grad was dropped by offload"):
        m[0].inner.weight.grad.sum()
    with pytest.raises(RuntimeError, match=r"0\.inner\.weight is offloaded"):
        m[0].inner.weight.sum()
    go.reload(m)
    assert torch.equal(m[0].inner.weight.grad, torch.zeros(2, 3))


def test_a_gradient_replaced_while_dropped_is_left_as_it_is(arena, checks):
    m = _model()
    _with_grads(m)
    go.offload(m, grads="drop", arena=arena)
    new = torch.full((2, 3), 7.0)
    m[0].inner.weight.grad = new
    go.reload(m)
    assert m[0].inner.weight.grad is new and torch.equal(new, torch.full((2, 3), 7.0))
    assert all(torch.equal(p.grad, torch.zeros_like(p)) for p in m.parameters() if p.grad is not new)
    gc.collect()
    assert not go.is_offloaded(m) and go.offloaded_bytes() == 0


def test_a_dropped_gradients_regrow_that_fails_leaves_them_dropped_for_the_next_reload(arena, monkeypatch, checks):
    m = _model()
    _with_grads(m)
    go.offload(m, grads="drop", arena=arena)
    go.reload(m)
    expected = {n: t.detach().clone() for n, t in named_tensors(m)}
    go.offload(m, grads="drop", arena=arena)
    resize = plan.resize

    def failing(resolved, release, refusals=None):
        if not release and resolved.plan.dropped is not None:
            raise MemoryError("out of memory (injected)")
        return resize(resolved, release, refusals)

    monkeypatch.setattr(plan, "resize", failing)
    if checks != "python":
        with pytest.raises(go.OffloadError, match="out of memory"):
            go.reload(m)
        assert all(p.grad.untyped_storage().nbytes() == 0 for p in m.parameters())
        for name, t in named_tensors(m):  # the state is back
            assert_bitwise_equal(t.detach(), expected[name])
    else:  # (no gradients' plan without the helper: one by one, the general way)
        go.reload(m)
    monkeypatch.setattr(plan, "resize", resize)
    if checks != "python":
        go.reload(m)  # the gradients, the general way
    assert all(torch.equal(p.grad, torch.zeros_like(p)) for p in m.parameters())
    assert go.offloaded_bytes() == 0


# -- a torch optimizer's traversal, and targets of several recorded parts --------------------------------------
def _walked(target, include_grads=False) -> list[tuple[str, torch.Tensor]]:
    out: list = []
    grads: list = []
    adapters._collect(target, "", include_grads, out, grads, top=True)
    return out + grads


def _agrees(target, include_grads=False):
    named = named_tensors(target, include_grads=include_grads)
    _same_pairs(named, _walked(target, include_grads))
    return named


def _optimizer_read_by_helper() -> bool:
    """Whether a torch optimizer's traversal is read by the helper here: recorded, or walked (walk_optimizer)."""
    ext = adapters._ext
    return ext is not None and (ext.OPTIMIZER_TREE or hasattr(ext, "walk_optimizer"))


def _stepped() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    m = _model()
    opt = torch.optim.AdamW([{"params": list(m[0].parameters())}, {"params": list(m[1].parameters()), "lr": 0.1}])
    _with_grads(m)
    opt.step()
    return m, opt


@needs_ext
@pytest.mark.parametrize("where", ["the optimizer's __dict__", "a param group"])
def test_an_optimizer_dict_whose_lookups_run_code_is_not_looked_up_in(checks, where):
    # As test_a_module_dict_whose_lookups_run_code_is_not_looked_up_in, for the optimizer's record: its
    # __dict__ (looked up for param_groups and state) or a group (looked up for params). It was a segfault.
    if checks != "helper" or not torch_ext.ext.MODULE_TREE:
        pytest.skip("the helper's records only")
    m, opt = _stepped()
    tree = torch_ext.ext.build_optimizer_tree(opt)[0]
    if where == "a param group":
        key = _KeyThatFrees("params")
        opt.param_groups[1] = {key: None, **opt.param_groups[1]}
        free = lambda: opt.param_groups.__setitem__(1, dict(opt.param_groups[1]))  # noqa: E731
    else:
        key = _KeyThatFrees("param_groups")
        object.__setattr__(opt, "__dict__", {key: None, **opt.__dict__})
        free = lambda: object.__setattr__(opt, "__dict__", dict(opt.__dict__))  # noqa: E731
    key.free = free
    assert tree.tensors(opt) is None
    assert torch_ext.ext.build_optimizer_tree(opt) is None
    assert key.fired == 0
    key.free = None
    _agrees(opt)
    _agrees([m, opt])


def test_an_optimizer_state_holding_tensors_in_lists_names_each_and_is_walked_every_call(arena, checks):
    # LBFGS keeps its history as lists of tensors under a state key: each is named by its path below the key,
    # and such a state is never recorded (a list grows without the state dict changing), so an append
    # between two calls is seen by the second.
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(8))
    target = torch.randn(8)
    opt = torch.optim.LBFGS([p], history_size=3, max_iter=4)

    def closure():
        opt.zero_grad()
        loss = ((p - target) ** 2).sum()
        loss.backward()
        return loss

    opt.step(closure)
    state = opt.state[p]
    state["nested"] = {"b": (torch.ones(1),), "a": [[torch.zeros(2)]]}
    names = [n for n, _ in _agrees(opt)]
    assert {"state.0.d", "state.0.old_dirs.0", "state.0.nested.a.0.0", "state.0.nested.b.0"} <= set(names)
    assert names.index("state.0.nested.a.0.0") < names.index("state.0.nested.b.0")
    if checks != "python" and torch_ext.ext.OPTIMIZER_TREE:
        assert torch_ext.ext.build_optimizer_tree(opt) is None
    if checks != "python":
        assert torch_ext.ext.walk_optimizer(opt) is None  # (a state holding lists: the Python walk names them)
    snap = go.snapshot(opt, arena=arena).wait()
    history = [t.clone() for t in state["old_dirs"]]
    for t in state["old_dirs"]:
        t.add_(1.0)
    go.restore(opt, snap)
    assert all(torch.equal(a, b) for a, b in zip(history, state["old_dirs"]))
    state["old_dirs"].append(torch.full((8,), 7.0))  # (the list grew; the state dict did not change)
    assert "state.0.old_dirs.%d" % (len(state["old_dirs"]) - 1) in [n for n, _ in _agrees(opt)]
    with pytest.raises(go.LayoutMismatchError, match="not in snapshot: state.0.old_dirs"):
        go.restore(opt, snap)
    snap.free()
    before = {n: t.clone() for n, t in named_tensors(opt)}
    go.offload(opt, arena=arena)
    assert all(t.untyped_storage().nbytes() == 0 for t in state["old_dirs"])
    go.reload(opt)
    assert all(torch.equal(before[n], t) for n, t in named_tensors(opt))
    state["cycle"] = []
    state["cycle"].append(state["cycle"])
    with pytest.raises(go.OffloadError, match="more than 16 deep"):
        named_tensors(opt)


class _PropertyGroups(torch.optim.SGD):
    @property
    def param_groups(self):  # (what accelerate's AcceleratedOptimizer does: another object's groups)
        return self.__dict__["_groups"]

    @param_groups.setter
    def param_groups(self, value):
        self.__dict__["_groups"] = value


@pytest.mark.parametrize("change", [
    "lr", "replace value", "add key", "drop key", "state of a new parameter", "append to params",
    "replace in params", "replace params list", "add group", "replace state", "replace param_groups",
    "clear state", "load_state_dict", "non-ascii key", "nothing",
])
def test_a_recorded_optimizer_traversal_sees_every_change(checks, change):
    m, opt = _stepped()
    first = _agrees(opt)
    p, q = m[0].inner.weight, m[1].inner.weight
    extra = torch.nn.Parameter(torch.randn(3))
    if change == "lr":
        opt.param_groups[1]["lr"] = 0.5
    elif change == "replace value":
        opt.state[p]["exp_avg"] = torch.zeros_like(p)
    elif change == "add key":
        opt.state[p]["aaa"] = torch.ones(1)
    elif change == "non-ascii key":
        opt.state[p]["momentum_\u00e9\u4e2d"] = torch.ones(1)
    elif change == "drop key":
        del opt.state[q]["exp_avg_sq"]
    elif change == "state of a new parameter":
        opt.param_groups[0]["params"].append(extra)
        first = _agrees(opt)
        opt.state[extra]["exp_avg"] = torch.zeros(3)
    elif change == "append to params":
        opt.param_groups[0]["params"].append(extra)
    elif change == "replace in params":
        opt.param_groups[0]["params"][0] = extra
    elif change == "replace params list":
        opt.param_groups[0]["params"] = list(reversed(opt.param_groups[0]["params"]))
    elif change == "add group":
        opt.add_param_group({"params": [extra]})
        opt.state[extra]["momentum"] = torch.zeros(3)
    elif change == "replace state":
        from collections import defaultdict

        opt.state = defaultdict(dict, {k: dict(v) for k, v in opt.state.items()})
        opt.state[p]["exp_avg"] = torch.zeros_like(p)
    elif change == "replace param_groups":
        opt.param_groups = [opt.param_groups[1], opt.param_groups[0]]
    elif change == "clear state":
        opt.state.clear()
    elif change == "load_state_dict":
        sd = opt.state_dict()
        sd["state"][0] = {k: v.clone() for k, v in sd["state"][0].items()}
        opt.load_state_dict(sd)  # new state dicts; parameter 0's tensors new ones
    after = _agrees(opt)
    if change in ("lr", "nothing"):  # nothing the traversal reads: the same names list, the same tensors
        assert after.tensors == first.tensors
        assert after.names is first.names or not _optimizer_read_by_helper()
    else:
        assert [n for n, _ in after] != [n for n, _ in first] or any(a is not b for a, b in zip(after.tensors, first.tensors))


class _CountingState(dict):
    def get(self, key, default=None):  # (a state whose lookups are its own: asked, not read around)
        return super().get(key, default)


def test_an_optimizer_whose_class_reads_param_groups_otherwise_is_walked(checks):
    m = _model()
    opt = _PropertyGroups(m.parameters(), lr=0.1, momentum=0.9)
    _with_grads(m)
    opt.step()
    _agrees(opt)
    if checks != "python" and adapters._ext.OPTIMIZER_TREE:
        assert opt not in adapters._optimizer_trees and adapters._ext.build_optimizer_tree(opt) is None
    if checks != "python":
        assert adapters._ext.walk_optimizer(opt) is None
    # A state that is neither a dict nor torch's defaultdict: walked too.
    m, opt = _stepped()
    opt.state = _CountingState(opt.state)
    _agrees(opt)
    if checks != "python" and adapters._ext.OPTIMIZER_TREE:
        assert adapters._ext.build_optimizer_tree(opt) is None
    if checks != "python":
        assert adapters._ext.walk_optimizer(opt) is None


@pytest.mark.parametrize("grads", [False, True])
def test_a_target_of_recorded_parts_is_named_as_the_walk_names_it(checks, grads):
    m, opt = _stepped()
    other = _model()
    for target in ([m, opt], (opt, m, other), {"model": m, "optimizer": opt}, [m, m]):
        first = _agrees(target, grads)
        again = _agrees(target, grads)
        # The same names list again where every part was read by the helper: a recorded or walked module (not
        # with gradients to name where it is walked) and a recorded optimizer (Python 3.11/3.12).
        ext = adapters._ext
        helper_read = _optimizer_read_by_helper() and (ext.MODULE_TREE or not grads)
        assert again.names is first.names or not helper_read
    # A part that changes is seen; a part that is not recorded (a tensor, a mapping of tensors) is walked.
    _replace_param(m)
    _agrees([m, opt], grads)
    opt.param_groups[0]["params"].append(torch.nn.Parameter(torch.randn(2)))
    _agrees([m, opt], grads)
    _agrees([m, torch.randn(3)], grads)
    _agrees({"model": m, "extra": torch.randn(3)}, grads)
    _agrees([m, {"w": torch.randn(2)}], grads)
    # Cycles through them: the bytes come back.
    target = [m, opt]
    expected = [t.detach().clone() for _, t in named_tensors(target, include_grads=True)]
    for policy in ("keep", "copy", "drop"):
        go.offload(target, grads=policy)
        go.reload(target)
    for (name, t), e in zip(named_tensors(target, include_grads=True), expected):
        assert_bitwise_equal(t.detach(), torch.zeros_like(e) if name.endswith(".grad") else e)


@needs_ext
def test_a_module_holding_another_strategys_class_is_not_recorded(monkeypatch, checks):
    # FSDP's recognizers walk every submodule in Python; the record's walk refuses their classes instead
    # (fsdp.wrapper_classes()): a module with one anywhere is the strategy's, not a plain one.
    from gpu_offload.adapters import fsdp

    if checks == "python" or not torch_ext.ext.MODULE_TREE:
        pytest.skip("the helper's records only")
    m = _model()
    assert torch_ext.ext.build_module_tree(m, torch.nn.Module, (torch.nn.ModuleList,)) is None
    assert torch_ext.ext.build_module_tree(m, torch.nn.Module, ()) is not None
    monkeypatch.setattr(fsdp, "wrapper_classes", lambda: (Block,))
    named_tensors(m)
    assert m not in adapters._trees
    monkeypatch.undo()
    named_tensors(m)
    assert m in adapters._trees


@needs_ext
def test_data_ptrs_in_one_pass_are_what_data_ptr_says_and_zero_for_offloaded_storages(arena, checks):
    # plan.data_ptrs (the Python plans' check, of FSDP2's DTensor shards for one): one C++ pass giving each
    # data_ptr(), and 0 where the storage refuses access, without an exception per offloaded item.
    if checks == "python":
        pytest.skip("the helper's pass")
    base = torch.arange(12, dtype=torch.float32)
    items = [base, base[3:], base.view(3, 4)[:, 1], torch.empty(0), base[12:], torch.nn.Parameter(torch.ones(2)),
             base.untyped_storage(), torch.zeros(2, dtype=torch.float64)[1:]]
    assert torch_ext.ext.data_ptrs_or_zero(items) == [x.data_ptr() for x in items]
    target = {"a": torch.randn(4), "b": torch.randn(3)}
    keep = list(target.values())
    go.offload(target, arena=arena)
    offloaded = keep + [t.untyped_storage() for t in keep]
    if torch_ext.access_guard_available():
        with pytest.raises(RuntimeError):
            keep[0].data_ptr()
    assert torch_ext.ext.data_ptrs_or_zero(offloaded) == [0] * 4
    assert plan.data_ptrs(offloaded + items) == [0] * 4 + [x.data_ptr() for x in items]
    go.reload(target)
    assert torch_ext.ext.data_ptrs_or_zero(keep) == [t.data_ptr() for t in keep]
    class Sub(torch.Tensor):
        pass
    assert torch_ext.ext.data_ptrs_or_zero([torch.ones(2).as_subclass(Sub)]) is None  # (the Python loop's)
    assert torch_ext.ext.data_ptrs_or_zero([3]) is None


@pytest.mark.skipif(not hasattr(torch, "_lazy_clone"), reason="this torch has no copy-on-write storages")
@pytest.mark.parametrize("cached", [True, False])
def test_a_restore_never_writes_into_memory_shared_copy_on_write(arena, cached):
    # torch._lazy_clone shares a storage's memory until either side writes: same StorageImpl, address and
    # size, so the cached check sees no change. The address must be the tensor's own before a byte lands.
    a = torch.zeros(1000)
    target = {"a": a}
    snap = go.snapshot(target, arena=arena)
    if cached:
        go.restore(target, snap)
    with torch.no_grad():
        a.fill_(1.0)
    b = torch._lazy_clone(a)
    go.restore(target, snap)
    snap.free()
    assert bool((a == 0).all()) and bool((b == 1).all())


def test_a_read_that_found_nothing_sharded_answers_the_shard_info_the_recognizers_give(arena, monkeypatch):
    # named_tensors() marks a read unsharded where it found every part a flat dict, a plain module or a torch
    # optimizer; shard_info() then answers None without asking again. It must be what they answer, and a part
    # they would call sharded (here ZeRO-3's mark on a parameter) must never be marked so.
    import types

    from gpu_offload.adapters import deepspeed, shard_info

    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 2))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    targets = {"dict": {"a": torch.ones(2), "b": torch.zeros(3)}, "module": model, "optimizer": opt,
               "[module, optimizer]": [model, opt], "(module,)": (model,)}
    for name, target in targets.items():
        for _ in range(2):  # (recorded, then served from the record)
            named = named_tensors(target)
            assert shard_info(target) is None, name
            assert shard_info(target, named) is None, name
        ext = adapters._ext
        optimizer_read = _optimizer_read_by_helper()
        module_read = ext is not None and (ext.MODULE_TREE or hasattr(ext, "walk_module"))
        expected = {"dict": True, "module": module_read, "optimizer": optimizer_read,
                    "[module, optimizer]": module_read and optimizer_read, "(module,)": module_read}[name]
        if expected:
            assert named.unsharded, name  # (else the shortcut would never be taken: this test could not fail)
    mixed = [model, {"t": torch.ones(1)}]  # (a list holding a dict: read by the Python walk, not known)
    assert not named_tensors(mixed).unsharded
    monkeypatch.setitem(sys.modules, "deepspeed", types.ModuleType("deepspeed"))
    monkeypatch.setattr(deepspeed, "is_zero3_module", lambda obj: obj is model)
    model[1].weight.ds_tensor = torch.empty(0)  # (as ZeRO-3 marks what it converted in place)
    for target in (model, [model, opt]):
        assert not named_tensors(target).unsharded


# -- walk_module: the traversal walked each call, where none is recorded (Python 3.13 and later) -------------
class _OwnNamedParameters(torch.nn.Module):
    def named_parameters(self, *args, **kwargs):  # (reads its parameters its own way)
        return super().named_parameters(*args, **kwargs)


@needs_ext
def test_walk_module_names_what_torch_names_or_declines(checks):
    if checks != "helper":
        pytest.skip("the helper's walk, asked directly: once")
    walk = torch_ext.ext.walk_module

    def agrees(m):
        got = walk(m, torch.nn.Module, (), None)
        want = plain_module_tensors(m, include_grads=False)
        assert got is not None
        names, tensors, num_params, _ = got
        assert names == [n for n, _ in want] and len(tensors) == len(want)
        assert all(a is b for a, (_, b) in zip(tensors, want))
        assert num_params == len(list(m.named_parameters(remove_duplicate=False)))
        return got

    m = _model()
    first = agrees(m)
    assert walk(m, torch.nn.Module, (), first[0])[0] is first[0]  # (the same names: the same list)
    m[1].inner.bias = None  # (a None entry: skipped, as torch skips it)
    m[0].register_buffer("extra", torch.zeros(1))
    shared = torch.nn.Linear(2, 2)
    m.append(shared)
    m.append(shared)  # (reached twice: named twice, as remove_duplicate=False names it)
    m[0].experts[1].weight = m[0].experts[0].weight  # (tied)
    changed = agrees(m)
    again = walk(m, torch.nn.Module, (), first[0])  # (other names: a new list, the unchanged names' strings kept)
    assert again[0] is not first[0] and again[0] == changed[0] and again[0][0] is first[0][0]
    distinct = agrees(torch.nn.Sequential(torch.nn.Linear(2, 2)))[3]
    assert distinct is True
    odd = torch.nn.Module()
    odd.register_parameter("a", torch.nn.Parameter(torch.ones(1)))
    odd._parameters["a.b"] = torch.nn.Parameter(torch.ones(1))  # (a key with a ".": names may collide)
    assert agrees(odd)[3] is False
    # Declined (the Python walk decides): what build_module_tree declines too, and names that are not ASCII.
    declined = []
    own = _OwnNamedParameters()
    own.lin = torch.nn.Linear(2, 2)
    declined.append(own)
    shadow = torch.nn.Sequential(torch.nn.Linear(2, 2))
    shadow.named_modules = lambda *a, **k: iter(())  # (set on the instance: it shadows the class's)
    declined.append(shadow)
    ordered = torch.nn.Linear(2, 2)
    ordered._parameters = collections.OrderedDict(ordered._parameters)
    declined.append(ordered)
    cycle = torch.nn.Sequential(torch.nn.Linear(2, 2))
    cycle._modules["back"] = cycle
    declined.append(cycle)
    wide = torch.nn.Module()
    wide.register_parameter("poids_é", torch.nn.Parameter(torch.ones(1)))
    declined.append(wide)
    not_tensor = torch.nn.Linear(2, 2)
    not_tensor._buffers["junk"] = 3
    declined.append(not_tensor)
    for m in declined:
        assert walk(m, torch.nn.Module, (), None) is None, m
    assert walk(_model(), torch.nn.Module, (Block,), None) is None  # (a refused class anywhere)


def _count_calls(monkeypatch, name: str) -> list[int]:
    """The helper's function `name`, wrapped to note each call (a list that grows by one per call)."""
    calls: list[int] = []
    monkeypatch.setattr(torch_ext.ext, name, lambda *a, f=getattr(torch_ext.ext, name): calls.append(1) or f(*a))
    return calls


@needs_ext
@pytest.mark.parametrize("change", MODULE_CHANGES, ids=[c.__name__.lstrip("_") for c in MODULE_CHANGES])
def test_a_module_is_walked_each_call_where_no_traversal_is_recorded(arena, monkeypatch, checks, change):
    # As on Python 3.13: no record, a C++ walk each call, and every change seen at the next call.
    if checks != "walk":
        pytest.skip("the walk without a record")
    walked = _count_calls(monkeypatch, "walk_module")
    m = _model()
    _warm(m, arena)
    assert walked and m not in adapters._trees
    patcher = change(m)
    if patcher is not None:
        patcher(monkeypatch)
    truth = [(n, id(t)) for n, t in plain_module_tensors(m, include_grads=False)]
    assert [(n, id(t)) for n, t in named_tensors(m)] == truth
    _snapshot_matches(m, arena)


@needs_ext
def test_walk_optimizer_names_what_the_python_walk_names_or_declines(checks):
    if checks != "helper":
        pytest.skip("the helper's walk, asked directly: once")
    walk = torch_ext.ext.walk_optimizer
    m, opt = _stepped()
    extra = torch.nn.Parameter(torch.randn(3))  # (a second group, one parameter without state)
    opt.add_param_group({"params": [extra]})
    opt.state[m[0].inner.weight]["a_scalar"] = 3.5  # (not a tensor: skipped, as the Python walk skips it)
    first = walk(opt, None)
    want = _walked(opt)
    assert first is not None and first[0] == [n for n, _ in want]
    assert all(a is b for a, (_, b) in zip(first[1], want))
    assert walk(opt, first[0])[0] is first[0]  # (the same names: the same list)
    opt.state[extra]["exp_avg"] = torch.zeros(3)  # (now it has state: its names join)
    again = walk(opt, first[0])
    assert again[0] is not first[0] and again[0] == [n for n, _ in _walked(opt)]
    opt.state[extra]["pas_é"] = torch.zeros(1)  # (a key that is not ASCII: the Python walk)
    assert walk(opt, None) is None


@pytest.mark.parametrize("change", ["nothing", "state replaced", "param group added", "parameter's state cleared"])
def test_an_optimizer_is_walked_each_call_where_no_traversal_is_recorded(arena, monkeypatch, checks, change):
    if checks != "walk":
        pytest.skip("the walk without a record")
    walked = _count_calls(monkeypatch, "walk_optimizer")
    m, opt = _stepped()
    target = [m, opt]
    _warm(target, arena)
    assert walked and opt not in adapters._optimizer_trees
    p = m[0].inner.weight
    if change == "state replaced":
        opt.state[p]["exp_avg"] = torch.full_like(p, 7.0)
    elif change == "param group added":
        extra = torch.nn.Parameter(torch.randn(2))
        opt.add_param_group({"params": [extra]})
        opt.state[extra]["exp_avg"] = torch.ones(2)
    elif change == "parameter's state cleared":
        opt.state[p].clear()
    _agrees(opt)
    _snapshot_matches(target, arena)


class _MutatesOnCompare:
    """A dict key hashed as `name`: when a lookup of that name compares with it (armed), it runs `act`, as any
    key's __eq__ may run any code in the middle of a walk."""

    def __init__(self, name: str, act) -> None:
        self.name, self.act, self.armed, self.fired = name, act, False, 0

    def __hash__(self) -> int:
        return hash(self.name)

    def __eq__(self, other) -> bool:
        if self.armed:
            self.fired += 1
            self.act()
        return False


@needs_ext
@pytest.mark.parametrize("name", ["named_modules", "_parameters"])
def test_code_run_mid_walk_cannot_free_what_walk_module_reads(checks, name):
    # A key's __eq__, run by a lookup in a child's __dict__, drops every child of the root and collects: the walk
    # holds each module, dict and tensor it reads, so it answers the module as it found it, or declines.
    if checks != "helper":
        pytest.skip("the helper's walk, asked directly: once")
    root = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)) for _ in range(4)])
    before = plain_module_tensors(root, include_grads=False)

    def drop_all():
        root._modules.clear()
        gc.collect()

    key = _MutatesOnCompare(name, drop_all)
    child = root[1]
    if name == "_parameters":  # (inserted first, so that the lookup of the name meets it before the name itself)
        items = dict(child.__dict__)
        child.__dict__.clear()
        child.__dict__[key] = 1
        child.__dict__.update(items)
    else:
        child.__dict__[key] = 1
    del child
    before_ids = [id(t) for _, t in before]
    key.armed = True
    got = torch_ext.ext.walk_module(root, torch.nn.Module, (), None)
    assert key.fired >= 1  # (else this test tests nothing)
    if got is not None:
        names, tensors, _, _ = got
        assert len(names) == len(tensors) and [id(t) for t in tensors] == before_ids
        assert all(t.sum().item() == t.detach().sum().item() for t in tensors)  # (alive: readable)


@needs_ext
def test_code_run_mid_walk_cannot_free_what_walk_optimizer_reads(checks):
    if checks != "helper":
        pytest.skip("the helper's walk, asked directly: once")
    m, opt = _stepped()

    def drop_all():
        opt.param_groups.clear()
        opt.state.clear()
        gc.collect()

    key = _MutatesOnCompare("params", drop_all)
    group = opt.param_groups[0]
    opt.param_groups[0] = {key: 1, **group}  # (the key first: the lookup of "params" meets it first)
    key.armed = True
    got = torch_ext.ext.walk_optimizer(opt, None)
    assert key.fired >= 1
    key.armed = False
    if got is not None:  # (the groups list and the state were emptied in place: what the Python walk reads now)
        assert [id(t) for t in got[1]] == [id(t) for _, t in _walked(opt)]
        assert all(torch.isfinite(t).all() for t in got[1])
