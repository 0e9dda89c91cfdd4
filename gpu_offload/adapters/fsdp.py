"""Device state of FSDP-wrapped modules: which (name, tensor) pairs a rank owns.

FSDP1 (``FullyShardedDataParallel``) keeps, per FSDP unit, one ``FlatParameter`` whose data outside a
forward/backward *is* the rank's padded local shard (``flat_param._local_shard`` shares its storage once
FSDP has lazily initialised; before that the flat parameter itself is the shard). With
``use_orig_params=True`` the original parameters are views into that same storage, so the flat parameter
alone covers them. The all-gather buffer ``_full_param_padded`` and the mixed-precision ``_mp_shard`` are
scratch that FSDP frees itself and are never reported.

FSDP2 (``fully_shard``) keeps, per parameter, a padded 1-D ``FSDPParam._sharded_param_data``; the
parameter's DTensor ``_local_tensor`` is a narrow view of it, so its storage is the one to move. The
parameters are named as the DTensors they are, under their own names: a snapshot of an FSDP2 module is
its state dict, which ``Snapshot.state_dict()`` hands to torch.distributed.checkpoint as DTensors.

Both versions leave the *root* unit unsharded after a forward (the root is not resharded until backward),
most visibly after a ``no_grad`` forward. The next forward then reuses the unsharded copy without an
all-gather, so a restore that only wrote the shard would be silently ignored and an offload would leave the
unsharded copy on the device. The functions here therefore reshard such idle units first; resharding only
frees memory locally and runs no collective.

Only local shards are touched: no ``summon_full_params``, no collective.
"""

from __future__ import annotations

import functools
import itertools
import json
import logging
import sys
from typing import Any, Iterable, Iterator, Union

import torch
from torch import nn

from .. import torch_ext as _torch_ext
from .._errors import OffloadError
from .strategy import Strategy

logger = logging.getLogger(__name__)

_ext: Any = _torch_ext.ext  # the torch-aware helper, or None (pure-Python paths)

__all__ = [
    "is_fsdp1",
    "fsdp1_named_tensors",
    "is_fsdp2",
    "fsdp2_named_tensors",
    "fsdp_shard_info",
    "FSDP1",
    "FSDP2",
]

# FSDP1 inserts this attribute name between a wrapper and its wrapped module; stripping it gives the
# user's module paths, which are identical on every rank and on a freshly wrapped twin.
_FSDP1_PREFIX = "_fsdp_wrapped_module."


def _fsdp_loaded() -> bool:
    # An FSDP object exists only once its package is imported: until then nothing is FSDP, and importing it
    # to find out would load torch.distributed.fsdp (and sympy with it) for a model that uses no FSDP.
    return "torch.distributed.fsdp" in sys.modules or "torch.distributed._composable.fsdp" in sys.modules


def _fsdp1_class() -> type | None:
    if not _fsdp_loaded() or not torch.distributed.is_available():
        return None
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # pragma: no cover - builds without FSDP
        return None
    return FullyShardedDataParallel


def _fsdp2_class() -> type | None:
    if not _fsdp_loaded() or not torch.distributed.is_available():
        return None
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        try:  # torch < 2.6 only exposes it under the private package
            from torch.distributed._composable.fsdp import FSDPModule  # type: ignore[no-redef]
        except ImportError:
            return None
    return FSDPModule


def wrapper_classes() -> tuple[type, ...]:
    """The classes whose instances anywhere in a module make it FSDP's (FSDP1's wrapper, FSDP2's
    FSDPModule); none while FSDP is not imported."""
    return tuple(c for c in (_fsdp1_class(), _fsdp2_class()) if c is not None)


def _contains(module: nn.Module, cls: type | None) -> bool:
    return cls is not None and isinstance(module, nn.Module) and any(isinstance(m, cls) for m in module.modules())


def is_fsdp1(module: nn.Module) -> bool:
    """True when ``module`` is, or contains, a ``FullyShardedDataParallel`` instance."""
    return _contains(module, _fsdp1_class())


def is_fsdp2(module: nn.Module) -> bool:
    """True when ``module`` is, or contains, a module passed to ``fully_shard`` (an ``FSDPModule``)."""
    return _contains(module, _fsdp2_class())


def _clean(name: str) -> str:
    return name.replace(_FSDP1_PREFIX, "").replace("._fsdp_wrapped_module", "")


def _one_of_each_class(module: nn.Module) -> list[nn.Module]:
    """One submodule (or the module itself) of each class found in it: what the wrapper checks ask is
    decided by the class alone (isinstance), so asking each module of a 65536-expert model again is waste."""
    return list({type(m): m for m in module.modules()}.values())


def _has(kinds: list[nn.Module], cls: type | None) -> bool:
    return cls is not None and any(isinstance(m, cls) for m in kinds)


def _reject_other_wrappers(module: nn.Module, strategy: str, kinds: list[nn.Module]) -> None:
    """Raise when ``module`` mixes ``strategy`` with a wrapper whose state this adapter would miss.
    kinds: _one_of_each_class(module)."""
    found = []
    if strategy != "fsdp1" and _has(kinds, _fsdp1_class()):
        found.append("FullyShardedDataParallel (FSDP1)")
    if strategy != "fsdp2" and _has(kinds, _fsdp2_class()):
        found.append("fully_shard (FSDP2)")
    if _has(kinds, torch.nn.parallel.DistributedDataParallel):
        found.append("torch DistributedDataParallel")
    from .megatron import is_megatron_ddp  # never imports megatron itself

    if any(is_megatron_ddp(m) for m in kinds):
        found.append("a megatron-core data-parallel wrapper")
    if found:
        raise OffloadError(
            f"module mixes {strategy.upper()} with {', '.join(found)}; one snapshot target must use a single "
            "data-parallel strategy (pass the parts separately)"
        )


def _plain_tensors(
    managed: set[int], include_grads: bool, params: list[tuple[str, nn.Parameter]],
    buffers: Iterable[tuple[str, torch.Tensor]],
) -> tuple[list[tuple[str, torch.Tensor]], list[tuple[str, torch.Tensor]]]:
    """Parameters no FSDP unit manages (ignored or outside every unit) plus all buffers: replicated state;
    and their gradients. DTensors are listed as such (the core copies their local shards). params, buffers:
    the module's named_parameters and named_buffers (remove_duplicate=False)."""
    out: list[tuple[str, torch.Tensor]] = []
    grads: list[tuple[str, torch.Tensor]] = []
    # Every name of a tied tensor is listed, as the core does for plain modules, so that a twin is checked
    # to be tied the same way.
    for name, p in params:
        if id(p) in managed:
            continue
        out.append((_clean(name), p))
        if include_grads and p.grad is not None:
            grads.append((f"{_clean(name)}.grad", p.grad))
    for name, b in buffers:
        out.append((_clean(name), b))
    return out, grads


# ----------------------------------------------------------------------------------------------- FSDP1


def _fsdp1_units(module: nn.Module) -> Iterator[tuple[str, Any, Any]]:
    """Yield (clean path, FSDP state, FlatParamHandle) of every FSDP1 unit that manages parameters."""
    cls = _fsdp1_class()
    for name, m in module.named_modules():
        if cls is None or not isinstance(m, cls):
            continue
        # torch >= 2.1 keeps one handle per unit; older releases a list.
        handle = getattr(m, "_handle", None)
        if handle is None:
            handles = getattr(m, "_handles", None) or []
            if len(handles) > 1:
                raise OffloadError(f"FSDP unit {name!r} has {len(handles)} flat parameters; unsupported")
            handle = handles[0] if handles else None
        if handle is not None:
            yield _clean(name).rstrip("."), m, handle


def _fsdp1_ensure_sharded(path: str, state: Any, handle: Any, free_unsharded: bool = True) -> None:
    """Leave the unit with its flat parameter on the local shard and (with free_unsharded) no unsharded
    copy allocated."""
    fp = handle.flat_param
    if not handle.uses_sharded_strategy or not hasattr(fp, "_local_shard"):
        # NO_SHARD has no separate full buffer; before lazy init the flat parameter *is* the shard.
        return
    on_shard = fp.untyped_storage()._cdata == fp._local_shard.untyped_storage()._cdata
    # After a forward the root points back at its shard but keeps the all-gathered buffer allocated, and
    # the next forward reuses that buffer without an all-gather (FlatParamHandle.needs_unshard()).
    full = [getattr(fp, a, None) for a in ("_full_param_padded", "_full_prec_full_param_padded")]
    if on_shard and (not free_unsharded or not any(t is not None and t.untyped_storage().size() > 0 for t in full)):
        return  # reads need only the shard; writes also need the stale unsharded copy gone
    idle_state = getattr(state, "training_state", None)
    idle_handle = getattr(handle, "_training_state", None)
    if getattr(idle_state, "name", "IDLE") != "IDLE" or getattr(idle_handle, "name", "IDLE") != "IDLE":
        raise OffloadError(
            f"FSDP unit {path or '<root>'!r} is unsharded inside forward/backward or summon_full_params "
            f"({idle_state}, {idle_handle}); snapshot, restore or offload it between training steps"
        )
    logger.debug("resharding idle unsharded FSDP1 unit %r before taking its shard", path or "<root>")
    try:
        from torch.distributed.fsdp._runtime_utils import _reshard
    except ImportError:  # pragma: no cover - the same steps as torch's private helper
        handle.reshard(True)
        handle.post_reshard()
        handle._prefetched = False
    else:
        _reshard(state, handle, True)


def fsdp1_named_tensors(module: nn.Module, *, include_grads: bool, reshard: bool = True) -> list[tuple[str, torch.Tensor]]:
    """This rank's FSDP1 device state: every unit's local flat-parameter shard, then plain params and buffers.

    Names follow the core's plain-module convention with FSDP's wrapper prefix removed:
    ``<unit path>._flat_param`` (``_flat_param`` for the root unit), the ordinary names of parameters
    outside every unit and of buffers, and ``<name>.grad`` for gradients with ``include_grads``.
    """
    state, grads = _fsdp1_named(module, include_grads=include_grads, reshard=reshard)
    return state + grads


def _fsdp1_named(module: nn.Module, *, include_grads: bool,
                 reshard: bool) -> tuple[list[tuple[str, torch.Tensor]], list[tuple[str, torch.Tensor]]]:
    kinds = _one_of_each_class(module)
    if not _has(kinds, _fsdp1_class()):
        raise OffloadError(f"{type(module).__name__} contains no FullyShardedDataParallel unit")
    _reject_other_wrappers(module, "fsdp1", kinds)
    out: list[tuple[str, torch.Tensor]] = []
    grads: list[tuple[str, torch.Tensor]] = []
    managed: set[int] = set()
    for path, state, handle in _fsdp1_units(module):
        _fsdp1_ensure_sharded(path, state, handle, free_unsharded=reshard)
        fp = handle.flat_param
        name = f"{path}._flat_param" if path else "_flat_param"
        out.append((name, fp))
        managed.add(id(fp))
        # With use_orig_params the originals are views into the shard (or empty on this rank), and their
        # gradients views into the flat gradient.
        for attr in ("_params", "_shared_params"):
            for p in getattr(fp, attr, None) or ():
                managed.add(id(p))
        if include_grads and fp.grad is not None:
            grads.append((f"{name}.grad", fp.grad))
    plain, plain_grads = _plain_tensors(managed, include_grads, list(module.named_parameters(remove_duplicate=False)),
                                        module.named_buffers(remove_duplicate=False))
    return out + plain, grads + plain_grads


# ----------------------------------------------------------------------------------------------- FSDP2


def _fsdp2_groups(module: nn.Module, paths: dict[int, str] | None = None) -> Iterator[tuple[str, nn.Module, Any]]:
    """Yield (module path, FSDPModule, FSDPParamGroup) for every ``fully_shard`` module in ``module``.
    paths: filled with every module's path by id (the same walk), where given."""
    return _groups_of(module.named_modules(), paths)


def _groups_of(named_modules: Iterable[tuple[str, nn.Module]],
               paths: dict[int, str] | None) -> Iterator[tuple[str, nn.Module, Any]]:
    cls = _fsdp2_class()
    seen: set[int] = set()
    for name, m in named_modules:
        if paths is not None:
            paths[id(m)] = name
        if cls is None or not isinstance(m, cls):
            continue
        state = m._get_fsdp_state()  # type: ignore[attr-defined]
        groups = getattr(state, "_fsdp_param_groups", None)
        if groups is None:  # torch < 2.9 keeps at most one group per state
            group = getattr(state, "_fsdp_param_group", None)
            groups = [group] if group is not None else []
        for g in groups:
            # fully_shard([a, b]) shares one state (and its groups) between several modules.
            if id(g) not in seen:
                seen.add(id(g))
                yield name, m, g  # type: ignore[misc]


def _fsdp2_scan(module: nn.Module, paths: dict[int, str] | None = None,
                named_modules: tuple[list[str], list[nn.Module]] | None = None
                ) -> tuple[list[nn.Module], list[tuple[str, nn.Module, Any]]]:
    """_one_of_each_class(module) and list(_fsdp2_groups(module, paths)) in one walk of the modules (a walk in
    Python costs about 2 us a module: a 65536-expert model's first call made seven). named_modules: what
    module.named_modules() yields, as (paths, modules), where the caller has it (a recorded traversal's): the
    module is not walked, and the few FSDP modules are picked out by class at C speed (no Python per module)."""
    if named_modules is not None and paths is None:
        names, modules = named_modules
        cls = _fsdp2_class()
        if _ext is not None and cls is not None and type(modules) is list:
            # (The helper's pass over the modules' headers: 65793 of them, 1 ms against 8 in Python.)
            last_of_kinds, at = _ext.module_kinds(modules, cls)
            return last_of_kinds, list(_groups_of(((names[i], modules[i]) for i in at), None))
        types = list(map(type, modules))  # (one pass over the modules' objects: each read is a cache miss)
        kinds = dict(zip(types, modules))  # (the last module of each class, as the walk keeps)
        sharded = {kind for kind in kinds if cls is not None and issubclass(kind, cls)}
        # (A generator: no list of pairs alive at once, which could start the garbage collector.)
        picked = ((names[i], modules[i])
                  for i in itertools.compress(range(len(types)), map(sharded.__contains__, types)))
        return list(kinds.values()), list(_groups_of(picked, None))
    found: dict[type, nn.Module] = {}
    walked = module.named_modules() if named_modules is None else zip(*named_modules)

    def walk() -> Iterator[tuple[str, nn.Module]]:
        for name, m in walked:
            found[type(m)] = m
            yield name, m

    groups = list(_groups_of(walk(), paths))
    return list(found.values()), groups


def is_fsdp2_root(module: nn.Module) -> bool:
    """Whether the module itself was passed to ``fully_shard`` (FSDP2), asked of its class alone."""
    cls = _fsdp2_class()
    return cls is not None and isinstance(module, cls)


#: What a recorded traversal keeps of an FSDP2 model's groups (group_refs): their paths, a weak reference to
#: each FSDPParamGroup, and where its FSDPModule sits in the group's `modules` (-1: not there, then a weak
#: reference to the module follows in `others`).
GroupRefs = tuple[list[str], list[Any], list[int], list[Any]]


def group_refs(module: nn.Module, groups: list[tuple[str, nn.Module, Any]] | None = None) -> GroupRefs:
    """(paths, weak references to the FSDPParamGroups, ...) of every group in ``module`` (GroupRefs): what a
    recorded traversal keeps (a group references its modules, which a strong reference from the record would
    keep alive; so would the root's state, which every module's hooks reach). The module is found through
    its group (`group.modules`), so that a model's first call makes one weak reference per group, not two
    and a tuple: 257 groups made 771 objects the collector tracks, and past 700 its young generation is
    collected, visiting the call's lists of 65536 tensors and modules (6.5 ms). groups:
    list(_fsdp2_groups(module)), where the caller just walked it."""
    import weakref

    found = groups if groups is not None else list(_fsdp2_groups(module))
    paths, refs, at, others = [], [], [], []
    for path, m, g in found:
        paths.append(path)
        refs.append(weakref.ref(g))
        mine = getattr(g, "modules", ())
        k = next((i for i, x in enumerate(mine) if x is m), -1) if type(mine) in (tuple, list) else -1
        at.append(k)
        if k < 0:
            others.append(weakref.ref(m))
    return paths, refs, at, others


def live_groups(refs: GroupRefs) -> list[tuple[str, nn.Module, Any]] | None:
    """The groups of group_refs(), as (path, FSDPModule, FSDPParamGroup), or None where one of them is gone
    (or no longer holds its module)."""
    paths, groups, at, others = refs
    out = []
    more = iter(others)
    for path, ref, k in zip(paths, groups, at):
        g = ref()
        if g is None:
            return None
        if k >= 0:
            mine = getattr(g, "modules", ())
            m = mine[k] if type(mine) in (tuple, list) and k < len(mine) else None
        else:
            m = next(more)()
        if m is None:
            return None
        out.append((path, m, g))
    return out


def reshard_idle(groups: list[tuple[str, nn.Module, Any]]) -> bool:
    """What _fsdp2_named does to each group before naming its parameters: reshards an idle unsharded one.
    Whether any was (its registered parameters changed)."""
    resharded = False
    for path, m, group in groups:
        if not group.is_sharded:
            _fsdp2_ensure_sharded(path, m, group)
            resharded = True
    return resharded


def unsharded_grads_pending(groups: list[tuple[str, nn.Module, Any]]) -> bool:
    """Whether any parameter of the groups holds a gradient accumulated unsharded without gradient sync
    (what _fsdp2_named names "<name>.grad_unsharded", by the same rule: the accumulated gradient where an
    FSDPParam has one, else its unsharded parameter's .grad). Memory-bound, about 0.5 us per parameter after a
    training step: a pass over the FSDPParams for the accumulated gradients, then one for the unsharded
    parameters' grads (a C++ pass measured no faster, a call per parameter 1.7x slower)."""
    for _, _, group in groups:
        params = group.fsdp_params
        try:  # (the attribute read directly, a fifth cheaper than getattr with a default)
            accumulated = [fp.unsharded_accumulated_grad for fp in params]
        except AttributeError:  # (as _fsdp2_named reads it: a torch without the attribute has none)
            accumulated = [getattr(fp, "unsharded_accumulated_grad", None) for fp in params]
        if accumulated.count(None) != len(params):
            return True
        for fp in params:
            unsharded = fp.__dict__.get("_unsharded_param")
            if unsharded is not None and unsharded.grad is not None:
                return True
    return False


def _fsdp2_ensure_sharded(path: str, module: nn.Module, group: Any) -> None:
    if group.is_sharded:
        return
    if getattr(group._training_state, "name", "IDLE") != "IDLE":
        raise OffloadError(
            f"fully_shard module {path or '<root>'!r} is in {group._training_state}; snapshot, restore or "
            "offload it between training steps"
        )
    logger.debug("resharding idle unsharded FSDP2 module %r before taking its shards", path or "<root>")
    group.reshard()  # what FSDPModule.reshard() does for each group: a local free, no collective


def fsdp2_named_tensors(module: nn.Module, *, include_grads: bool, reshard: bool = True) -> list[tuple[str, torch.Tensor]]:
    """This rank's FSDP2 device state: each parameter (a DTensor, whose local shard is a narrow view of its
    padded ``_sharded_param_data``: the whole storage is copied), then plain params and buffers.

    Names are the ordinary parameter and buffer names (every name of a tied one), so a snapshot's tensors
    are the module's state dict; with ``include_grads`` ``<name>.grad`` for the sharded gradient (FSDP2
    puts a group's gradients in one storage) and ``<name>.grad_unsharded`` for gradients accumulated
    unsharded while gradient sync is off.
    """
    state, grads = _fsdp2_named(module, include_grads=include_grads, reshard=reshard)
    return state + grads


def _fsdp2_named(module: nn.Module, *, include_grads: bool, reshard: bool = True
                 ) -> tuple[list[tuple[str, torch.Tensor]], list[tuple[str, torch.Tensor]]]:
    # `reshard` is accepted for symmetry with FSDP1 and ignored (see fsdp2_prepare).
    kinds, groups = _fsdp2_scan(module)
    fsdp2_prepare(module, kinds, groups)
    params = list(module.named_parameters(remove_duplicate=False))
    return fsdp2_name(groups, params, module.named_buffers(remove_duplicate=False), include_grads)


def fsdp2_prepare(module: nn.Module, kinds: list[nn.Module], groups: list[tuple[str, nn.Module, Any]]) -> bool:
    """What naming an FSDP2 module's tensors asks first, _fsdp2_scan's findings given: that it is one and mixes
    no other wrapper (else OffloadError), and every group sharded (an idle unsharded one is resharded: while a
    group is unsharded its registered parameters are the unsharded tensors, so the shards could not be named
    the same way, for a read or a write). The module's parameters are to be read after this. Whether a group
    was resharded (parameters read before this are not the ones to name)."""
    if not _has(kinds, _fsdp2_class()):
        raise OffloadError(f"{type(module).__name__} contains no fully_shard module")
    _reject_other_wrappers(module, "fsdp2", kinds)
    return reshard_idle(groups)


def fsdp2_name(groups: list[tuple[str, nn.Module, Any]], params: list[tuple[str, nn.Parameter]],
               buffers: Iterable[tuple[str, torch.Tensor]], include_grads: bool
               ) -> tuple[list[tuple[str, torch.Tensor]], list[tuple[str, torch.Tensor]]]:
    """(state, grads) of an FSDP2 module (see fsdp2_named_tensors) from its groups (fsdp2_prepare()d), its
    named_parameters and named_buffers (remove_duplicate=False), walked or recorded."""
    by_param: dict[int, Any] = {}
    for _, _, group in groups:
        for fsdp_param in group.fsdp_params:
            by_param[id(fsdp_param.sharded_param)] = fsdp_param
    out: list[tuple[str, torch.Tensor]] = []
    grads: list[tuple[str, torch.Tensor]] = []
    managed: set[int] = set()
    for name, p in params:
        fsdp_param = by_param.get(id(p))
        if fsdp_param is None:
            continue
        managed.add(id(p))
        out.append((name, p))
        if include_grads:
            if p.grad is not None:
                grads.append((f"{name}.grad", p.grad))
            # Without gradient sync FSDP2 accumulates unsharded gradients, in reduce_dtype or on the
            # unsharded parameter, which outlive the reshard.
            acc = getattr(fsdp_param, "unsharded_accumulated_grad", None)
            if acc is None:
                unsharded = fsdp_param.__dict__.get("_unsharded_param")
                acc = unsharded.grad if unsharded is not None else None
            if acc is not None:
                grads.append((f"{name}.grad_unsharded", acc))
    missing = len(by_param) - len(managed)
    if missing:
        raise OffloadError(
            f"{missing} fully_shard parameter(s) are not registered on the module, so they cannot be named"
        )
    plain, plain_grads = _plain_tensors(managed, include_grads, params, buffers)
    return out + plain, grads + plain_grads


# ------------------------------------------------------------------------------------------ validation


def _group_coords(pg: Any) -> tuple[int, int]:
    import torch.distributed as dist

    if pg is None or not dist.is_initialized():
        return 1, 0
    return dist.get_world_size(pg), dist.get_rank(pg)


def fsdp_shard_info(module: nn.Module) -> dict[str, Any]:
    """World size, rank and per-unit (FSDP1) or per-parameter (FSDP2) local shard layout of ``module``.

    Two snapshots restore into each other only when these dicts are equal; no collective is run.
    """
    info: dict[str, Any]
    # (One walk answers which wrappers, by class, and, for FSDP2, every module's path and the groups.)
    paths: dict[int, str] = {}
    kinds, groups = _fsdp2_scan(module, paths)
    fsdp1, fsdp2 = _has(kinds, _fsdp1_class()), _has(kinds, _fsdp2_class())
    if fsdp1 and not fsdp2:
        units: dict[str, Any] = {}
        world, rank = 1, 0
        for path, state, handle in _fsdp1_units(module):
            world, rank = _group_coords(getattr(state, "process_group", None))
            fp = handle.flat_param
            units[path] = {
                "strategy": getattr(handle._sharding_strategy, "name", str(handle._sharding_strategy)),
                "sharded_numel": int(fp._sharded_size.numel()) if hasattr(fp, "_sharded_size") else fp.numel(),
                "unsharded_numel": int(fp._unpadded_unsharded_size.numel()),
                "padding": int(getattr(fp, "_shard_numel_padded", 0)),
                "dtype": str(fp.dtype),
            }
        info = {"kind": "fsdp1", "world_size": world, "rank": rank, "flat_params": units}
    elif fsdp2 and not fsdp1:
        info = fsdp2_shard_info(groups, paths)
    else:
        raise OffloadError(f"{type(module).__name__} is not (only) FSDP1 or FSDP2")
    return info


#: Every module's path by id: a dict (_fsdp2_scan's), or the modules' ids as native words (the helper's
#: object_ids) beside their paths, as a recorded traversal keeps them.
ModulePaths = Union[dict[int, str], tuple[bytes, list[str]]]


def _paths_dict(paths: ModulePaths) -> dict[int, str]:
    """ModulePaths as a dict (the Python pass's form)."""
    if isinstance(paths, dict):
        return paths
    ids, names = paths
    out: dict[int, str] = {}
    for key, name in zip(memoryview(ids).cast("N"), names):
        out.setdefault(key, name)  # (a module reached twice: its first path, as named_modules() gives it)
    return out


def fsdp2_params_of(groups: list[tuple[str, nn.Module, Any]]) -> list[Any]:
    """The FSDPParams of the groups, in their order."""
    # (Each group's list extended at C speed: a comprehension over 65536 of them took 3 ms.)
    return list(itertools.chain.from_iterable(group.fsdp_params for _, _, group in groups))


def fsdp2_shard_info(groups: list[tuple[str, nn.Module, Any]], paths: ModulePaths) -> dict[str, Any]:
    """fsdp_shard_info() of an FSDP2 module from its groups and every module's path by id (ModulePaths)."""
    return fsdp2_shard_info_and_shards(fsdp2_params_of(groups), paths)[0]


def fsdp2_shard_info_and_shards(fsdp_params: list[Any], paths: ModulePaths
                                ) -> tuple[dict[str, Any], list[torch.Tensor] | None]:
    """fsdp2_shard_info() from the groups' FSDPParams (fsdp2_params_of) and, where the helper read them, their
    padded shards (_sharded_param_data, in that order), which a recorded shard info is kept for; else None."""
    # Named through the owning module rather than named_parameters(): that would show an unsharded
    # root's plain tensors, and this function must not reshard (it only reads). The groups are all found
    # (the walk filled `paths`) before the first is read.
    # The per-parameter reads in the helper where they are plain ones (1.4 us a parameter in Python, each read
    # a cache miss; there the misses of a few parameters overlap), else in Python.
    got = _ext.fsdp2_layouts(fsdp_params, paths) if _ext is not None and fsdp_params else None
    if got is None:
        return _fsdp2_shard_info(fsdp_params, _paths_dict(paths)), None
    names, index, firsts, shards = got
    # (The layouts' dicts made from their first parameters, as the Python loop makes them.)
    layouts = [_fsdp2_layout(fsdp_params[i], shards[i].dtype) for i in firsts]
    params = dict(zip(names, map(layouts.__getitem__, index)))
    # The world and rank are the mesh's of the parameter the last name was last given to, as in that loop.
    last = fsdp_params[-1]
    if len(params) != len(names):  # (a name given twice: the dict's last key may have come earlier)
        owner = dict(zip(names, fsdp_params))
        last = owner[next(reversed(owner))]
    mesh = last.mesh_info.mesh
    return {"kind": "fsdp2", "world_size": mesh.size(), "rank": mesh.get_rank(), "params": params}, shards


def _fsdp2_layout(fp: Any, dtype: torch.dtype) -> dict[str, Any]:
    """One FSDPParam's layout, as fsdp2_shard_info writes it."""
    return {
        "global_shape": list(fp._orig_size),
        "padded_local_shape": list(fp.padded_sharded_param_size),
        "placements": [str(pl) for pl in fp._sharding_spec.placements],
        "dtype": str(dtype),
    }


def _fsdp2_shard_info(fsdp_params: list[Any], paths: dict[int, str]) -> dict[str, Any]:
    """fsdp2_shard_info() read in Python."""
    params: dict[str, Any] = {}
    world, rank = 1, 0
    for fp in fsdp_params:
        info_ = fp._module_info
        path = paths.get(id(info_.module), "?")
        params[f"{path}.{info_.param_name}" if path else info_.param_name] = fp
    # A model's parameters share a few meshes and layouts: each mesh's coordinates are read once (a mesh's
    # size and rank cost microseconds each), and parameters of one layout (shape, padded shard, placements,
    # dtype) share one dict, made once (only ever compared and dumped, see shard_info_json).
    coords: dict[int, tuple[int, int]] = {}
    layouts: dict[tuple[Any, ...], dict[str, Any]] = {}
    # (The values are replaced in place, the dict's size unchanged: no list of 65536 pairs made first, whose
    # tuples, alive together, would each count towards the garbage collector's next pass.)
    for name, fp in params.items():
        mesh = fp.mesh_info.mesh
        found = coords.get(id(mesh))  # (every mesh is alive for the whole loop: ids are not reused)
        if found is None:
            found = coords[id(mesh)] = (mesh.size(), mesh.get_rank())
        world, rank = found
        dtype = fp._sharded_param_data.dtype
        key = (fp._orig_size, fp.padded_sharded_param_size, fp._sharding_spec.placements, dtype)
        layout = layouts.get(key)
        if layout is None:
            layout = layouts[key] = _fsdp2_layout(fp, dtype)
        params[name] = layout
    return {"kind": "fsdp2", "world_size": world, "rank": rank, "params": params}


def shard_info_json(info: dict[str, Any]) -> str:
    """``json.dumps(info, sort_keys=True, default=str)``, the text a layout keeps and compares, of one part's
    shard info; made without the encoder walking an FSDP2 info's per-parameter dicts (about 2 us each), whose
    few distinct layouts are dumped once and joined under the sorted names."""
    params = info.get("params") if info.get("kind") == "fsdp2" else None
    if not isinstance(params, dict) or not all(type(k) is str for k in info):
        return json.dumps(info, sort_keys=True, default=str)
    dump = functools.partial(json.dumps, sort_keys=True, default=str)
    # (The helper's join: the names sorted as bytes, the text written once, 5-6 ms for 65536 of them where
    # Python's join took 35-55. It checks the names itself, answering None for any but a plain str.)
    joined = _ext.json_object_of_texts(params, dump) if _ext is not None else None
    if joined is None:
        if not all(type(k) is str for k in params):
            return json.dumps(info, sort_keys=True, default=str)
        encode = json.encoder.encode_basestring_ascii  # (what dumps writes a str with: ensure_ascii)
        texts: dict[int, str] = {}
        items: list[str] = []
        for name in sorted(params):  # (names alone: a sorted list of pairs would be one tracked tuple each)
            layout = params[name]
            text = texts.get(id(layout))
            if text is None:  # (the layouts are alive, held by params: ids are not reused)
                text = texts[id(layout)] = dump(layout)
            items.append(f"{encode(name)}: {text}")
        joined = "{" + ", ".join(items) + "}"
    return joined_json({key: joined if key == "params" else dump(info[key]) for key in info})


def joined_json(texts: dict[str, str]) -> str:
    """``json.dumps(d, sort_keys=True)`` of a dict with str keys whose values' JSON texts are `texts`."""
    encode = json.encoder.encode_basestring_ascii  # (what dumps writes a str with: ensure_ascii)
    parts = ["{"]
    for key in sorted(texts):  # (pieces joined once: a part's text, megabytes for a large model, copied once)
        parts += (", " if len(parts) > 1 else "", encode(key), ": ", texts[key])
    parts.append("}")
    return "".join(parts)


# -------------------------------------------------------------------------------------- the strategies

#: FSDP1 (its flat parameters are shards, not a state dict) and FSDP2 (its parameters are DTensors under
#: their own names: a snapshot is a reshardable state dict).
FSDP1 = Strategy("fsdp1", lambda obj: isinstance(obj, nn.Module) and is_fsdp1(obj), _fsdp1_named, fsdp_shard_info)
FSDP2 = Strategy("fsdp2", lambda obj: isinstance(obj, nn.Module) and is_fsdp2(obj), _fsdp2_named, fsdp_shard_info,
                 state_dict=True)
