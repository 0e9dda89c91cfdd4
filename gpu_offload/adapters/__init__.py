"""Adapters: which (name, tensor) pairs make up a target's device state.

A target is an nn.Module, a torch.optim.Optimizer, a Mapping of tensors (nested mappings and lists
allowed, e.g. a state dict), a bare tensor, or a list/tuple of these. A list is its parts: element i's names get the
prefix "i.". Modules and optimizers are asked of the strategy table (STRATEGIES, at the end): each adapter
module declares the kinds it owns as `Strategy` rows (adapters.strategy), and the first row that recognizes
an object names its state, its gradients and its shard layout:

* DeepSpeed engines, ZeRO-3 modules and ZeRO optimizers (stages 0-3): each rank's partitions (adapters.deepspeed);
* Megatron-core DDP: the flat param (and grad) buffers, and Megatron optimizers (adapters.megatron);
* FSDP1 (FullyShardedDataParallel): each rank's flat-parameter shards (adapters.fsdp);
* FSDP2 (fully_shard): the DTensor parameters, whose local shards are copied (adapters.fsdp);
* any other nn.Module and torch.optim.Optimizer (here).

Recognizing an object imports no framework (FSDP, DeepSpeed and Megatron are looked for in sys.modules).

Everything after this layer works on storages, so views, tied weights and flat buffers need no
special case here.
"""

from __future__ import annotations

import itertools
import sys
import weakref
from typing import Any, Iterable, Iterator, Mapping, Optional, Sequence

import torch

from .. import torch_ext as _torch_ext
from .._errors import OffloadError
from ..storages import PLAIN_TENSOR_TYPES
from . import deepspeed, fsdp, megatron
from .strategy import NamedTensors, Strategy

_ext: Any = _torch_ext.ext  # the torch-aware helper, or None (pure-Python paths)


class Named(Sequence[tuple[str, torch.Tensor]]):
    """A target's (name, tensor) pairs, kept as two parallel lists: a state dict with tens of thousands of
    tensors is read on every call, and building a tuple per entry costs more than the rest of a cached
    call (the garbage collector then also walks them)."""

    __slots__ = ("names", "tensors", "num_grads", "distinct", "unsharded")

    def __init__(self, names: list[str], tensors: list[torch.Tensor], num_grads: int = 0,
                 distinct: bool = False, unsharded: bool = False) -> None:
        self.names = names
        self.tensors = tensors
        # How many of the pairs, at the end, are gradients (named_tensors(include_grads=True)): the ones before
        # are what named_tensors(include_grads=False) answers (see state()). 0 where none or not known.
        self.num_grads = num_grads
        # True: the names are distinct by how they were made (a recorded traversal's, see ModuleTree's
        # names_distinct), so a fresh bind need not check them; False: not known.
        self.distinct = distinct
        # True: the read that made these pairs found every part of the target to be a flat dict of tensors, a
        # plain module or a torch optimizer, none of which has a shard layout (shard_info answers None without
        # asking the recognizers again); False: not known.
        self.unsharded = unsharded

    @classmethod
    def from_pairs(cls, pairs: Iterable[tuple[str, torch.Tensor]], num_grads: int = 0) -> "Named":
        pairs = list(pairs)
        return cls([n for n, _ in pairs], [t for _, t in pairs], num_grads)

    def state(self) -> "Named":
        """The pairs without the gradients (itself where there are none)."""
        if not self.num_grads:
            return self
        n = len(self.names) - self.num_grads
        return Named(self.names[:n], self.tensors[:n])

    def grads(self) -> "Named":
        """The gradients' pairs alone (none where there are none or they are not known)."""
        k = self.num_grads
        return Named(self.names[-k:], self.tensors[-k:]) if k else Named([], [])

    def __len__(self) -> int:
        return len(self.names)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return list(zip(self.names[i], self.tensors[i]))
        return self.names[i], self.tensors[i]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return zip(self.names, self.tensors)


def named_tensors(target: Any, *, include_grads: bool = False, reshard: bool = True) -> Named:
    """Flattens `target` into (name, tensor) pairs in a deterministic order: the device state, then (with
    include_grads) the gradients.

    reshard: let FSDP units left unsharded after a forward be resharded first (needed before writing into
    the shards; reads pass False so that an explicit unshard() is not undone).
    Raises OffloadError for an object that is none of the supported kinds.
    """
    if _ext is not None:
        if type(target) is dict:  # a flat dict of plain tensors under str keys, read in one C++ pass
            known = _dict_names.get(id(target))
            items = _ext.plain_items(target, known)
            if items is not None:
                if items[0] is not known:
                    _remember_dict_names(id(target), items[0])
                return Named(*items, unsharded=True)
        named = _recorded(target, include_grads)
        if named is not None:
            return named
    if isinstance(target, Mapping) and set(map(type, target.values())) <= PLAIN_TENSOR_TYPES:
        # A flat dict of plain tensors (a state dict): no per-item dispatch and no per-item tuple
        # (set(map(type, ...)) runs in C).
        if set(map(type, target)) <= {str}:
            return Named(list(target), list(target.values()), unsharded=True)
        return Named([str(k) for k in target], list(target.values()), unsharded=True)
    out: NamedTensors = []
    grads: NamedTensors = []
    _collect(target, "", include_grads, out, grads, top=True, reshard=reshard)
    return Named.from_pairs(out + grads, len(grads))


# The keys lists of the last flat dicts read, by id: the next call on the same dict answers with the same list
# where the keys are still those very objects (plain_items compares addresses, so a dict that took a dead
# one's id gets its own list), and the plan then finds its names by identity. Few and small: the key strings.
_dict_names: dict[int, list[str]] = {}
_DICT_NAMES_KEPT = 8


def _remember_dict_names(key: int, names: list[str]) -> None:
    try:
        _dict_names.pop(key, None)
        while len(_dict_names) >= _DICT_NAMES_KEPT:
            _dict_names.pop(next(iter(_dict_names)), None)
    except (RuntimeError, StopIteration):  # another thread's call changed it meanwhile (a cache only)
        pass
    _dict_names[key] = names


def gradient_tensors(target: Any) -> Named:
    """The target's gradients only, as `named_tensors(target, include_grads=True)` names them (what
    `offload(grads="drop")` releases). Reads: nothing is resharded."""
    if isinstance(target, Mapping) and set(map(type, target.values())) <= PLAIN_TENSOR_TYPES:
        return Named([], [])  # a mapping of tensors is all state
    named = _recorded(target, True) if _ext is not None else None  # (recorded: the grads are its tail)
    if named is not None:
        return named.grads()
    out: NamedTensors = []
    grads: NamedTensors = []
    _collect(target, "", True, out, grads, top=True, reshard=False)
    return Named.from_pairs(grads)


def strategy_of(obj: Any) -> Optional[Strategy]:
    """The first strategy of the table that recognizes `obj` (None: not a module or an optimizer)."""
    for strategy in STRATEGIES:
        if strategy.recognizes(obj):
            return strategy
    return None


def shard_info(target: Any, named: Optional[Named] = None) -> Optional[str]:
    """The shard layout of the sharded parts of a target (FSDP1, FSDP2, Megatron DDP chunks and
    optimizers, DeepSpeed), as canonical JSON keyed by part index (json.dumps(..., sort_keys=True)); None when
    nothing in it is sharded. named: what named_tensors() answered for the target in this call, where it
    already found that no part is sharded (a first call on a plain module then asks no recognizer again: with
    DeepSpeed or FSDP imported, that is the record's tensors read and ZeRO-3's question asked a second time)."""
    if named is not None and named.unsharded:
        return None
    info: dict[str, Any] = {}
    texts: dict[str, str] = {}  # each part's JSON
    kept = True  # every part's info is one a record kept (never changed once made)
    for i, part in enumerate(parts(target)):
        recorded = _recorded_fsdp2_shard_info(part)
        if recorded is not None:
            info[str(i)], texts[str(i)] = recorded
            continue
        strategy = _recorded_strategy(part) or strategy_of(part)
        if strategy is not None and strategy.shard_info is not None:
            part_info = strategy.shard_info(part)
            if part_info is not None:
                info[str(i)] = part_info
                texts[str(i)] = fsdp.shard_info_json(part_info)
                kept = False
    if not info:
        return None
    if not kept:
        return fsdp.joined_json(texts)
    # The same kept dicts under the same indices: the same JSON.
    key = tuple(info.items())
    last = _last_kept_shard_info[0]  # (one read: the pair another thread may replace whole)
    if last is not None and len(last[0]) == len(key) and all(
            a[0] == b[0] and a[1] is b[1] for a, b in zip(last[0], key)):
        return last[1]
    text = fsdp.joined_json(texts)
    _last_kept_shard_info[0] = (key, text)  # (holds the dicts: an equal identity is that very dict)
    return text


# The last JSON made of kept infos alone, with them: (((index, info), ...), text), or None.
_last_kept_shard_info: list[Any] = [None]


def state_dict_kinds() -> frozenset[str]:
    """The shard-info kinds whose snapshots are state dicts (see Strategy.state_dict)."""
    return frozenset(s.name for s in STRATEGIES if s.state_dict)


def parts(target: Any) -> list[Any]:
    """The objects a target is made of (a list's elements, recursively; otherwise the target itself)."""
    if isinstance(target, (list, tuple)):
        return [p for item in target for p in parts(item)]
    return [target]


def _collect(obj: Any, prefix: str, include_grads: bool, out: NamedTensors, grads: NamedTensors,
             top: bool = False, reshard: bool = True) -> None:
    if isinstance(obj, torch.Tensor):
        out.append((prefix.rstrip(".") or "tensor", obj))
        return
    if not isinstance(obj, torch.nn.Module):  # modules first: a module is never taken apart as a container
        if isinstance(obj, Mapping):
            for key, value in obj.items():
                if type(value) is torch.Tensor or isinstance(value, torch.nn.Parameter):  # the common case, inline
                    out.append((f"{prefix}{key}", value))
                else:
                    _collect(value, f"{prefix}{key}.", include_grads, out, grads, reshard=reshard)
            return
        if isinstance(obj, (list, tuple)):
            for i, value in enumerate(obj):
                _collect(value, f"{prefix}{i}.", include_grads, out, grads, reshard=reshard)
            return
        if _is_plain_value(obj) and not top:
            return
    strategy = strategy_of(obj)
    if strategy is not None:
        state, obj_grads = strategy.named(obj, include_grads=include_grads, reshard=reshard)
        out.extend((prefix + name, t) for name, t in state)
        grads.extend((prefix + name, t) for name, t in obj_grads)
    else:
        raise OffloadError(
            f"unsupported target {type(obj).__module__}.{type(obj).__qualname__}"
            f"{' at ' + prefix.rstrip('.') if prefix else ''}: expected an nn.Module, a torch.optim.Optimizer, "
            "a Mapping of tensors, a tensor, or a list/tuple of these"
        )


def _is_plain_value(obj: Any) -> bool:
    # Leaves of a state dict that carry no device data (hyper-parameters, step counts kept as numbers).
    return obj is None or isinstance(obj, (bool, int, float, complex, str, bytes, torch.dtype, torch.device))


def module_tensors(module: torch.nn.Module, *, include_grads: bool, reshard: bool = True) -> NamedTensors:
    """A module's parameters (and grads if asked) and buffers, through the strategy that wraps it."""
    strategy = strategy_of(module) or PLAIN_MODULE
    state, grads = strategy.named(module, include_grads=include_grads, reshard=reshard)
    return state + grads


# A plain module's traversal, recorded by the torch-aware helper (names kept; tensors read again each call
# from the module's unchanged dicts, so nothing here keeps a replaced parameter alive).
_trees: "weakref.WeakKeyDictionary[torch.nn.Module, tuple[Any, list[str], int]]" = weakref.WeakKeyDictionary()


def _recorded_module_tensors(module: torch.nn.Module, include_grads: bool) -> Optional[Named]:
    """The (name, tensor) pairs of a plain module (no strategy wrapper) without walking it in Python: its
    recorded traversal, if nothing it depends on changed (the modules' classes and their _parameters,
    _buffers and _modules dicts, see csrc/torch_ext/module_tree.cpp), else walked and recorded again in
    C++. None where that does not apply (the caller walks it in Python): no helper or Python without
    dict version tags, a strategy wrapper, a module whose parameters ZeRO-3 converted, anything but a plain
    traversal. With include_grads, each parameter's .grad follows, as the Python walk names them."""
    if not _ext.MODULE_TREE:
        return _walked_module_tensors(module, include_grads)
    entry = _trees.get(module)
    got = _tree_tensors(entry, module, include_grads) if entry is not None else None
    if got is None:
        # The strategy depends only on the modules' classes, which the record covers, and on whether
        # ZeRO-3 converted the parameters, asked below over the recorded ones (not in a Python walk).
        if _strategy_but_zero3(module, walk=False) is not PLAIN_MODULE:
            return None
        # (FSDP's recognizers walk every submodule in Python: the C++ walk refuses their classes instead.)
        built = _ext.build_module_tree(module, torch.nn.Module, fsdp.wrapper_classes())
        if built is None:
            return None
        tree, names, tensors, num_params = built
        entry = _trees[module] = (tree, names, num_params)
        got = (names, tensors)
        if include_grads and _ext.any_grad(tensors, num_params):
            got = _tree_tensors(entry, module, True)
            if got is None:  # (changed since it was just recorded: another thread)
                return None
    if _converted_by_zero3(got[1], entry[2]):  # (the record stays: the next call finds the same as cheaply)
        return None
    return Named(got[0], got[1], len(got[1]) - len(entry[1]), entry[0].names_distinct, unsharded=True)


# A plain module's names as walk_module last gave them, where no traversal is recorded: the next walk that finds
# the same names answers this very list, and the plan cache finds the target's plan by its identity.
_walked_names: "weakref.WeakKeyDictionary[torch.nn.Module, list[str]]" = weakref.WeakKeyDictionary()


def _walked_module_tensors(module: torch.nn.Module, include_grads: bool) -> Optional[Named]:
    """_recorded_module_tensors() where this Python has no recorded traversal (3.13 and later): the module walked
    in C++ through CPython's public API, each call (walk_module). None where that does not apply: a strategy
    wrapper, a module whose parameters ZeRO-3 converted, a traversal that is not a plain one, or gradients to
    name (the Python walk then)."""
    walk = getattr(_ext, "walk_module", None)
    if walk is None or _strategy_but_zero3(module, walk=False) is not PLAIN_MODULE:
        return None
    previous = _walked_names.get(module)
    got = walk(module, torch.nn.Module, fsdp.wrapper_classes(), previous)
    if got is None:
        return None
    names, tensors, num_params, distinct = got
    if (include_grads and _ext.any_grad(tensors, num_params)) or _converted_by_zero3(tensors, num_params):
        return None
    if names is not previous:
        _walked_names[module] = names
    return Named(names, tensors, 0, distinct, unsharded=True)


# An FSDP2 root's traversal, recorded the same way: (tree, names, num_params, its param groups). Its parameters
# are the DTensors FSDP2 registers while sharded, under their own names, then the buffers: a plain module's
# traversal, which the record's is checked to be when it is made. FSDP2 swaps each parameter's slot out and
# back every step (the record sees the same items again); the groups, weakly referenced (they reference the
# modules), are resharded where a forward left them unsharded, as the Python walk does.
_fsdp2_trees: "weakref.WeakKeyDictionary[torch.nn.Module, tuple[Any, list[str], int, fsdp.GroupRefs, dict[str, Any]]]" = (
    weakref.WeakKeyDictionary())


def _recorded_fsdp2_tensors(module: torch.nn.Module, include_grads: bool) -> Optional[Named]:
    """named_tensors() of a module passed to fully_shard, as fsdp2_named_tensors reads it, without walking it
    in Python: its recorded traversal while nothing it depends on changed; None where that does not apply
    (the caller walks it): no recorded traversal here, a module another strategy owns, parameters FSDP2
    does not manage (they come after the managed ones there), or unsharded gradients accumulated without
    gradient sync (named between the sharded ones there)."""
    if not _ext.MODULE_TREE:
        return _walked_fsdp2_tensors(module, include_grads)
    entry = _fsdp2_trees.get(module)
    got = None
    if entry is not None:
        groups = fsdp.live_groups(entry[3])
        if groups is not None:
            fsdp.reshard_idle(groups)  # (before the check: an unsharded group's slots hold other tensors)
            got = _tree_tensors(entry[:3], module, include_grads)
    if got is None:
        recorded = _record_fsdp2(module)
        if recorded is None:
            return None
        entry, tensors = recorded
        groups = fsdp.live_groups(entry[3])
        if groups is None:
            return None
        # (The tensors the record was made of; with the gradients, read through it.)
        got = _tree_tensors(entry[:3], module, True) if include_grads else (entry[1], tensors)
        if got is None:  # (changed since it was just recorded: another thread)
            return None
    if _converted_by_zero3(got[1], entry[2]) or (include_grads and fsdp.unsharded_grads_pending(groups)):
        return None
    # (The traversal's own names, as a plain module's: distinct where its record says they are.)
    return Named(got[0], got[1], len(got[1]) - len(entry[1]), entry[0].names_distinct)


def _fsdp2_refused() -> tuple[type, ...]:
    """The classes an FSDP2 root's C++ traversal (recorded or walked) refuses to walk through: FSDP1's wrapper and
    torch's DDP, whose state the FSDP2 naming would miss (the Python walk then raises saying so)."""
    return tuple(c for c in (fsdp._fsdp1_class(), torch.nn.parallel.DistributedDataParallel) if c is not None)


def _record_fsdp2(module: torch.nn.Module
                  ) -> Optional[tuple[tuple[Any, list[str], int, fsdp.GroupRefs, dict[str, Any]], list[torch.Tensor]]]:
    """Records an FSDP2 root's traversal in C++ and names its tensors from it as the Python walk does (what
    that checks and raises, this raises; idle groups are resharded, and the traversal recorded again where one
    was); keeps the record where it reads the same as that walk (the managed parameters, then the others and
    the buffers: the traversal's own order when every parameter is managed), and answers it with the tensors
    it was made of. The modules' paths stay in the record's dict until the first shard layout is computed from
    them (ids: nothing of the model is held)."""
    if _strategy_but_zero3(module, walk=False) is not PLAIN_MODULE:  # (FSDP's own recognizers aside)
        return None
    refused = _fsdp2_refused()
    built = _ext.build_module_tree(module, torch.nn.Module, refused, True)
    if built is None:
        return None
    kinds, groups = fsdp._fsdp2_scan(module, named_modules=(built[4], built[5]))
    # (A group resharded: its parameters' slots hold the shards again, and the record is made again.)
    if fsdp.fsdp2_prepare(module, kinds, groups) and not built[0].check(module):
        built = _ext.build_module_tree(module, torch.nn.Module, refused, True)
        if built is None:
            return None
    tree, names, tensors, num_params, paths, modules = built
    # Where the parameters are the groups' sharded ones, all of them, the walk names them in the traversal's
    # order, then the buffers: the record's. Else the walk's own naming decides (what it raises, this raises).
    if not _managed_first(groups, tensors, num_params):
        params = list(zip(names[:num_params], tensors[:num_params]))
        state, _ = fsdp.fsdp2_name(groups, params, zip(names[num_params:], tensors[num_params:]), False)
        if len(state) != len(names) or not all(a is b for a, b in zip(tensors, (t for _, t in state))):
            return None  # (a parameter no group manages before a managed one: named after them, out of order)
    kept: dict[str, Any] = {"paths": (_ext.object_ids(modules), paths)}  # (fsdp.ModulePaths: no int made per module)
    entry = _fsdp2_trees[module] = (tree, names, num_params, fsdp.group_refs(module, groups), kept)
    return entry, tensors


# An FSDP2 root's walk where no traversal is recorded (3.13 and later): (its groups' GroupRefs, the names
# walk_module last gave, the ids of the parameters that were then found to be the managed ones, first).
_walked_fsdp2: "weakref.WeakKeyDictionary[torch.nn.Module, tuple[fsdp.GroupRefs, list[str], bytes]]" = (
    weakref.WeakKeyDictionary())


def _walked_fsdp2_tensors(module: torch.nn.Module, include_grads: bool) -> Optional[Named]:
    """_recorded_fsdp2_tensors() where this Python has no recorded traversal (3.13 and later): the module walked
    in C++ each call (walk_module), as a plain one is, instead of FSDP2's walk in Python (about 1.2 s a call for
    65536 parameters). What that walk decides once, about FSDP's own objects, is kept while it holds: the
    groups (weakly), and that the first parameters the walk meets are the ones they manage, all of them (so
    that the walk's order is the one fsdp2_named_tensors names them in). A call that finds the same groups
    alive, the very names of the last walk and the same parameter objects first reads nothing in Python but
    the groups' reshard; any other walks the modules in Python first (FSDP2's checks, what they raise), once.
    None where that does not apply (the caller walks it in Python): gradients to name, a module walk_module
    declines, a parameter no group manages before a managed one."""
    walk = getattr(_ext, "walk_module", None)
    if walk is None or include_grads:
        return None
    refused = _fsdp2_refused()
    kept = _walked_fsdp2.get(module)  # (one read: replaced whole by another thread)
    groups = fsdp.live_groups(kept[0]) if kept is not None else None
    got = None
    if groups is not None:
        fsdp.reshard_idle(groups)  # (before the walk: an unsharded group's slots hold other tensors)
        got = walk(module, torch.nn.Module, refused, kept[1])
        if got is None:
            return None
        names, tensors, num_params, distinct = got
        if names is kept[1] and _ext.object_ids(tensors[:num_params]) == kept[2]:
            if _converted_by_zero3(tensors, num_params):
                return None
            return Named(names, tensors, 0, distinct)
    # FSDP2's own checks on a Python walk of the modules (a wrapper mixed in raises here as it does there), its
    # idle groups resharded, then the walk: the one above, where it ran and no group was resharded since.
    if _strategy_but_zero3(module, walk=False) is not PLAIN_MODULE:
        return None
    kinds, groups = fsdp._fsdp2_scan(module)
    if fsdp.fsdp2_prepare(module, kinds, groups) or got is None:
        got = walk(module, torch.nn.Module, refused, kept[1] if kept is not None else None)
        if got is None:
            return None
    names, tensors, num_params, distinct = got
    if not _managed_first(groups, tensors, num_params) or _converted_by_zero3(tensors, num_params):
        return None
    _walked_fsdp2[module] = (fsdp.group_refs(module, groups), names, _ext.object_ids(tensors[:num_params]))
    return Named(names, tensors, 0, distinct)


def _managed_first(groups: list[tuple[str, torch.nn.Module, Any]], tensors: list[torch.Tensor], num_params: int) -> bool:
    """Whether the first num_params tensors of a traversal are the groups' sharded parameters, all of them."""
    fsdp_params = fsdp.fsdp2_params_of(groups)
    sharded = _ext.instance_attrs(fsdp_params, "sharded_param")  # (65536 of them: 11 ms, 18 in Python)
    if sharded is None:
        sharded = [fp.sharded_param for fp in fsdp_params]
    return bool(_ext.same_object_sets(sharded, tensors, num_params))


def _recorded_fsdp2_shard_info(module: Any) -> Optional[tuple[dict[str, Any], str]]:
    """fsdp_shard_info() of an FSDP2 root whose recorded traversal is valid, and its JSON, as its record last
    computed them, while its parameters' FSDPParams are the same objects and their padded shards
    (`_sharded_param_data`) the same tensors on the same storages, viewed the same way, whatever memory an
    offload left them (one C++ check). The info is read from those and from what an FSDPParam keeps for its
    life: its original shape, placements and mesh. None where that does not apply (the caller computes it).
    Every plan miss of an FSDP2 target asks it: with gradients copied, each step (its new gradients are a new
    target), and computing it reads every parameter (in the helper, fsdp2_params.cpp, where it can)."""
    if _ext is None or not isinstance(module, torch.nn.Module) or not fsdp.is_fsdp2_root(module):
        return None
    entry = _fsdp2_trees.get(module)
    groups = fsdp.live_groups(entry[3]) if entry is not None else None
    if groups is None or not entry[0].check(module):
        return None
    params = fsdp.fsdp2_params_of(groups)
    ids = _ext.object_ids(params)
    kept = entry[4].get("shard_info")  # (one read: (ids, record, info, text), replaced whole by another thread)
    if kept is not None and kept[0] == ids and kept[1] is not None:
        shards = _ext.instance_attrs(params, "_sharded_param_data")
        if shards is None:
            shards = [fp._sharded_param_data for fp in params]
        if kept[1].same_views(shards):
            return kept[2], kept[3]
    # From the groups and the modules' paths as recorded (valid: the traversal checked unchanged; the record
    # was made only of an FSDP2 module mixing no other wrapper), where the record still has them.
    paths = entry[4].pop("paths", None)
    read = None
    if paths is not None:
        info, read = fsdp.fsdp2_shard_info_and_shards(params, paths)
    else:
        info = fsdp.fsdp_shard_info(module)
    # (The shards the info was read with, where the helper returned them: the record is of what was read.)
    shards = read if read is not None else [fp._sharded_param_data for fp in params]
    text = fsdp.shard_info_json(info)
    entry[4]["shard_info"] = (ids, _ext.record(shards), info, text)
    return info, text


def _tree_tensors(entry: tuple[Any, list[str], int], module: torch.nn.Module,
                  include_grads: bool) -> Optional[tuple[list[str], list[torch.Tensor]]]:
    """(names, tensors) from a recorded traversal, with the gradients where asked; None if it changed."""
    tree, names, _ = entry
    if include_grads:
        got = tree.tensors_with_grads(module, names)
        return None if got is None else (got[1], got[0])
    tensors = tree.tensors(module)
    return None if tensors is None else (names, tensors)


def _recorded(target: Any, include_grads: bool) -> Optional[Named]:
    """named_tensors() from recorded traversals (the helper's): of a plain module, a torch optimizer, or a
    list, tuple or dict of them; None where that does not apply."""
    if type(target) in (list, tuple, dict) and target:  # e.g. [model, optimizer]: each part recorded
        return _recorded_parts(target, include_grads)
    return _recorded_part(target, include_grads)


def _recorded_part(obj: Any, include_grads: bool) -> Optional[Named]:
    """named_tensors() of a plain module, a fully_shard (FSDP2) root or a torch optimizer from its recorded
    traversal, else None."""
    if isinstance(obj, torch.nn.Module):
        if fsdp.is_fsdp2_root(obj):
            return _recorded_fsdp2_tensors(obj, include_grads)
        return _recorded_module_tensors(obj, include_grads)
    if isinstance(obj, torch.optim.Optimizer):
        return _recorded_optimizer_tensors(obj)
    return None


# The names of the last lists and dicts of recorded parts read: (the parts' names lists, the joined names), by
# the joining's key. A call finding each part's names list to be the same object answers the same list (the
# plan then finds its names by identity). Few and small.
_joined_names: dict[tuple[Any, ...], tuple[tuple[list[str], ...], list[str]]] = {}
_JOINED_NAMES_KEPT = 8


def _prefixed(prefix: str, names: list[str], start: int, stop: int) -> list[str]:
    """[f"{prefix}.{n}" for n in names[start:stop]], in one pass of the helper where it makes them (a first call
    on [model, optimizer] names every tensor so: 130 ns a name in Python)."""
    got = _ext.prefixed_names(prefix, names, start, stop) if _ext is not None else None
    return got if got is not None else [f"{prefix}.{n}" for n in names[start:stop]]


def _recorded_parts(target: Any, include_grads: bool) -> Optional[Named]:
    """named_tensors() of a list, tuple or dict (str keys) of modules and torch optimizers that each have a
    recorded traversal: as _collect names them (each part's state under "<index or key>.", all the parts'
    states, then all their gradients), without walking any of them in Python; None where that does not
    apply."""
    if type(target) is dict:
        if not set(map(type, target)) <= {str}:
            return None
        prefixes, items = list(target), list(target.values())
    else:
        prefixes, items = list(map(str, range(len(target)))), list(target)
    parts: list[Named] = []
    for item in items:
        part = _recorded_part(item, include_grads)
        if part is None:
            return None
        parts.append(part)
    key = (include_grads, *prefixes, *map(len, (p.names for p in parts)), *map(id, (p.names for p in parts)))
    found = _joined_names.get(key)
    if found is not None and all(a is b.names for a, b in zip(found[0], parts)):
        names = found[1]
    else:
        names = []
        for prefix, p in zip(prefixes, parts):
            names += _prefixed(prefix, p.names, 0, len(p.names) - p.num_grads)
        for prefix, p in zip(prefixes, parts):
            if p.num_grads:
                names += _prefixed(prefix, p.names, len(p.names) - p.num_grads, len(p.names))
        try:
            while len(_joined_names) >= _JOINED_NAMES_KEPT:
                _joined_names.pop(next(iter(_joined_names)), None)
        except (RuntimeError, StopIteration):  # another thread's call changed it meanwhile (a cache only)
            pass
        _joined_names[key] = (tuple(p.names for p in parts), names)
    tensors: list[torch.Tensor] = []
    for p in parts:
        tensors.extend(p.tensors[:len(p.tensors) - p.num_grads] if p.num_grads else p.tensors)
    num_grads = 0
    for p in parts:
        if p.num_grads:
            tensors.extend(p.tensors[-p.num_grads:])
            num_grads += p.num_grads
    # Distinct where each part's are and no prefix holds a ".": a name's prefix is then what comes before its
    # first ".", so two parts' names differ there (a fresh bind then need not hash every name to find out).
    distinct = all(p.distinct for p in parts) and not any("." in prefix for prefix in prefixes)
    return Named(names, tensors, num_grads, distinct, unsharded=all(p.unsharded for p in parts))


# A torch optimizer's state traversal, recorded by the helper (names kept; tensors read again each call).
_optimizer_trees: "weakref.WeakKeyDictionary[torch.optim.Optimizer, tuple[Any, list[str]]]" = weakref.WeakKeyDictionary()


def _recorded_optimizer_tensors(optimizer: torch.optim.Optimizer) -> Optional[Named]:
    """torch_optimizer_tensors(optimizer) without walking it in Python: its recorded traversal while nothing it
    depends on changed (param_groups, each group's params, the state and each parameter's state, see
    csrc/torch_ext/optimizer_tree.cpp), else recorded again. None where that does not apply: no helper or
    Python without dict version tags, an optimizer another strategy owns, a class that reads param_groups
    or state otherwise."""
    if not getattr(_ext, "OPTIMIZER_TREE", False):
        return _walked_optimizer_tensors(optimizer)
    entry = _optimizer_trees.get(optimizer)
    tensors = entry[0].tensors(optimizer) if entry is not None else None
    if tensors is None:
        # (The strategies that own optimizers recognize them by class, which the record covers.)
        if strategy_of(optimizer) is not TORCH_OPTIMIZER:
            return None
        built = _ext.build_optimizer_tree(optimizer)
        if built is None:
            return None
        tree, names, tensors = built
        entry = _optimizer_trees[optimizer] = (tree, names)
    # ("state.<index>.<key>": the index, an int, is what comes before the key's "."; a state's keys differ.)
    return Named(entry[1], tensors, distinct=True, unsharded=True)


# An optimizer's state names as walk_optimizer last gave them, where no traversal is recorded (see _walked_names).
_walked_optimizer_names: "weakref.WeakKeyDictionary[torch.optim.Optimizer, list[str]]" = weakref.WeakKeyDictionary()


def _walked_optimizer_tensors(optimizer: torch.optim.Optimizer) -> Optional[Named]:
    """_recorded_optimizer_tensors() where this Python has no recorded traversal (3.13 and later): the state walked
    in C++ through CPython's public API, each call (walk_optimizer); None where that does not apply (another
    strategy's optimizer, a class or state it declines: the Python walk then)."""
    walk = getattr(_ext, "walk_optimizer", None)
    if walk is None or strategy_of(optimizer) is not TORCH_OPTIMIZER:
        return None
    previous = _walked_optimizer_names.get(optimizer)
    got = walk(optimizer, previous)
    if got is None:
        return None
    names, tensors = got
    if names is not previous:
        _walked_optimizer_names[optimizer] = names
    return Named(names, tensors, distinct=True, unsharded=True)


def _converted_by_zero3(tensors: Sequence[torch.Tensor], num_params: int) -> bool:
    """Whether ZeRO-3 converted any of a record's parameters (its first num_params tensors). ZeRO-3 converts
    them in place (their attributes, not the modules' dicts that the record covers): this is what
    is_zero3_module asks. hasattr in one C++ pass where the helper is built (65536 parameters: about 3 ms of
    hasattr calls from Python in a process that imported DeepSpeed, as OpenRLHF's do)."""
    if "deepspeed" not in sys.modules:
        return False
    if _ext is not None and type(tensors) is list:
        return _ext.any_attribute(tensors, num_params, "ds_tensor")
    return deepspeed.any_zero3_param(itertools.islice(tensors, num_params))


def _recorded_strategy(obj: Any) -> Optional[Strategy]:
    """strategy_of(obj) for a module whose recorded traversal is still valid, without the recognizers' Python
    walks: FSDP's of every submodule (FSDP is imported in any process that stepped an optimizer; the record
    refused its classes when it was made and sees any module's class change since) and ZeRO-3's of every
    parameter (asked over the recorded ones). None where that does not apply, or where neither is imported
    (the recognizers then ask the classes alone, cheaper than the record's check)."""
    if not isinstance(obj, torch.nn.Module) or _ext is None or not _ext.MODULE_TREE:
        return None
    if "deepspeed" not in sys.modules and not fsdp._fsdp_loaded():
        return None
    entry = _trees.get(obj)
    tensors = entry[0].tensors(obj) if entry is not None else None
    if tensors is None:
        return None
    # A record is made only of a module every recognizer but ZeRO-3's calls plain, and it covers the classes
    # they ask about: while it holds, the module is one of those two.
    return deepspeed.ZERO3_MODULE if _converted_by_zero3(tensors, entry[2]) else PLAIN_MODULE


def _strategy_but_zero3(obj: Any, walk: bool = True) -> Optional[Strategy]:
    """strategy_of(obj) without ZeRO-3's recognizer (the one that walks every parameter); without `walk`,
    without FSDP's either (they walk every submodule: the caller checks their classes itself)."""
    for strategy in STRATEGIES:
        if strategy is deepspeed.ZERO3_MODULE or (not walk and strategy in (fsdp.FSDP1, fsdp.FSDP2)):
            continue
        if strategy.recognizes(obj):
            return strategy
    return None


def plain_module_tensors(module: torch.nn.Module, *, include_grads: bool) -> NamedTensors:
    """Parameters and buffers under every name they have (tied weights appear under each name, so a
    twin model is checked to be tied the same way), then grads as "<name>.grad"."""
    params = list(module.named_parameters(remove_duplicate=False))
    out: NamedTensors = list(params)
    out.extend(module.named_buffers(remove_duplicate=False))
    if include_grads:
        out.extend((f"{name}.grad", p.grad) for name, p in params if p.grad is not None)
    return out


def _plain_module_named(module: torch.nn.Module, *, include_grads: bool,
                        reshard: bool = True) -> tuple[NamedTensors, NamedTensors]:
    params = list(module.named_parameters(remove_duplicate=False))
    out: NamedTensors = list(params)
    out.extend(module.named_buffers(remove_duplicate=False))
    grads = [(f"{name}.grad", p.grad) for name, p in params if p.grad is not None] if include_grads else []
    return out, grads


def optimizer_tensors(optimizer: Any, *, include_grads: bool = False) -> NamedTensors:
    """The optimizer's state tensors, named "state.<param index>.<key>" with parameters numbered in
    param_groups order, as torch's own state_dict() numbers them."""
    strategy = strategy_of(optimizer) or TORCH_OPTIMIZER
    state, grads = strategy.named(optimizer, include_grads=include_grads, reshard=True)
    return state + grads


def torch_optimizer_tensors(optimizer: torch.optim.Optimizer, prefix: str = "") -> NamedTensors:
    """A torch optimizer's state tensors, "state.<param index>.<key>", keys sorted; a tensor held in a list,
    tuple or dict under a key (LBFGS's history: "state.0.old_dirs.3") is named by its path below it."""
    out: NamedTensors = []
    index = 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state.get(p)
            if state:
                for key in sorted(state):
                    _state_value_tensors(state[key], f"{prefix}state.{index}.{key}", out, 0)
            index += 1
    return out


def _state_value_tensors(value: Any, name: str, out: NamedTensors, depth: int) -> None:
    """The tensors of one optimizer state value: itself, or those in the lists, tuples and dicts it holds."""
    if isinstance(value, torch.Tensor):
        out.append((name, value))
        return
    if not isinstance(value, (list, tuple, Mapping)):
        return  # (a number, a string: no device data)
    if depth >= 16:
        raise OffloadError(f"optimizer state {name} nests lists, tuples or dicts more than 16 deep (a cycle?)")
    if isinstance(value, Mapping):
        try:
            keys = sorted(value)
        except TypeError:  # (keys that do not compare: their order)
            keys = list(value)
        items: Iterable[tuple[Any, Any]] = ((k, value[k]) for k in keys)
    else:
        items = enumerate(value)
    for key, item in items:
        _state_value_tensors(item, f"{name}.{key}", out, depth + 1)


def _torch_optimizer_named(optimizer: Any, *, include_grads: bool,
                           reshard: bool = True) -> tuple[NamedTensors, NamedTensors]:
    # A torch optimizer holds no gradients of its own: they are its parameters' (the module's).
    return torch_optimizer_tensors(optimizer), []


#: A module no framework wraps: parameters and buffers under every name they have, then "<name>.grad".
PLAIN_MODULE = Strategy("module", lambda obj: isinstance(obj, torch.nn.Module), _plain_module_named)
#: A torch.optim.Optimizer: its state, "state.<param index>.<key>".
TORCH_OPTIMIZER = Strategy("torch_optimizer", lambda obj: isinstance(obj, torch.optim.Optimizer),
                           _torch_optimizer_named)

#: The strategy table, asked in order: the first that recognizes an object owns it. Wrappers come before
#: what they wrap (a DeepSpeed engine is a module; a ZeRO-3 module may sit inside other wrappers), and the
#: plain module and the torch optimizer last. Adding a strategy is adding a module that declares a
#: Strategy, and a row here.
STRATEGIES: tuple[Strategy, ...] = (
    deepspeed.DEEPSPEED_ENGINE,
    deepspeed.ZERO3_MODULE,
    megatron.MEGATRON_DDP,
    fsdp.FSDP1,
    fsdp.FSDP2,
    megatron.MEGATRON_OPTIMIZER,
    deepspeed.DEEPSPEED_OPTIMIZER,
    PLAIN_MODULE,
    TORCH_OPTIMIZER,
)
