"""The offload registry: which storages are offloaded, and where their bytes are in the arena.

Keyed by storage identity rather than by target, so that a list is its parts: offload([model, opt]) then
is_offloaded(model) or reload([model, opt]) with a new list just work. Every read and write holds `lock`.

Gradients released by `offload(grads="drop")` have entries too, without a region: they have no host copy,
and reload re-allocates them zeroed.

The registry holds no storage: each entry watches its storage through a weak reference, and when the
storage dies (the model was dropped, a parameter replaced while offloaded) the entry is dropped and its
host bytes go back to the arena, at the next call that takes the lock.

Touching offloaded state raises instead of reading released memory: the storages refuse access to their data
(with the torch-aware helper), and offloaded modules and optimizers get hooks that raise OffloadError first
(see "touching offloaded state" below); reload and discard remove them, so nothing offloaded costs nothing.
"""

from __future__ import annotations

import _thread
import collections
import functools
import weakref
from dataclasses import dataclass
from typing import Any, Iterator, Optional, cast

import torch

from . import _fork, torch_ext
from . import integrity as _integrity
from ._errors import OffloadError
from ._ext import _C  # type: ignore[attr-defined]
from .arena import Region
from .storages import Layout, StorageSpec, unwrap


@dataclass
class Offloaded:
    """Where an offloaded storage's bytes are."""

    nbytes: int
    device: torch.device
    region: Optional[Region]  # None: a gradient dropped by offload(grads="drop"), re-allocated zeroed by reload
    host_offset: int
    events: list[Any]  # the D2H copy that filled the region
    # Watches the storage: its callback drops the entry when the storage dies (a key, the StorageImpl
    # address, could otherwise be reused by a new storage).
    ref: Optional[weakref.ref] = None
    checksums: Any = None  # integrity.Checksums of the offload's layout (offload(checksum=True)), or None
    index: int = 0  # this storage's index in that layout
    name: str = ""  # the first tensor that views it, for messages


entries: dict[int, Offloaded] = {}
# Entries whose storage died: key -> the entry's weakref. Weakref callbacks may run inside any allocation, even while
# this thread iterates `entries`, so they only record here; the entries are dropped under the lock. The callback is
# C code (dict.__setitem__ through functools.partial), so no interrupt can fall before it records.
_dead: dict[int, "weakref.ref[Any]"] = {}


class _Lock(_thread.RLock):  # type: ignore[misc]  # final in the stubs, subclassable at run time
    """The registry's re-entrant lock; taking it first drops the entries of storages that died.

    Owned from the moment it is taken, whatever interrupts: the acquisition's result lands in a list inside
    C code (map, extend), so an interrupt right after it is seen by the handler below and released, and
    the release is RLock's own `__exit__` (C code, which no signal handler can interrupt before it
    releases). Unheld again in a forked child (gpu_offload._fork).
    """

    def __enter__(self) -> "_Lock":  # type: ignore[override]
        taken: list[bool] = []
        try:
            taken.extend(map(_thread.RLock.acquire, (self,)))
            prune()
        except BaseException:
            if taken:
                self.release()
            raise
        return self


lock = _fork.track(_Lock())


def prune() -> None:
    """Drops the entries of dead storages and releases their regions (call with the lock held)."""
    while _dead:
        # Forgotten only once handled: an interrupt in between leaves it to the next prune, not lost with an
        # entry whose key a new storage may take.
        key, ref = next(iter(_dead.items()))
        record = entries.get(key)
        if record is not None and record.ref is ref:  # not a new storage that took the same address since
            del entries[key]
            if record.region is not None:
                record.region.release(record.events)
        if _dead.get(key) is ref:
            del _dead[key]


def watch(key: int, storage: torch.UntypedStorage, record: Offloaded) -> None:
    """Adds an entry that is dropped when `storage` dies (torch keeps a storage's Python object alive as
    long as the storage itself, so a weak reference to it dies with the storage)."""
    record.ref = weakref.ref(storage, functools.partial(_dead.__setitem__, key))  # no cycle through the record
    entries[key] = record


def sizes() -> dict[int, int]:
    """Offloaded storage sizes by key (what bind() needs to lay out an offloaded target)."""
    with lock:
        return {k: r.nbytes for k, r in entries.items()}


def total_bytes() -> int:
    """Bytes held in host memory for offloaded storages (dropped gradients hold none)."""
    with lock:
        return sum(r.nbytes for r in entries.values() if r.region is not None)


# -- integrity: reload(verify=True) -------------------------------------------------------------------------
def _expected(records: list[Offloaded]) -> list[int]:
    missing = [r.name for r in records if r.checksums is None]
    if missing:
        raise OffloadError("reload(verify=True) needs an offload with checksums: offload(..., checksum=True) "
                           f"(none for {', '.join(missing[:5])}{' and more' if len(missing) > 5 else ''})")
    return [r.checksums.result()[r.index] for r in records]


def _specs(records: list[Offloaded]) -> Layout:
    return Layout((), tuple(StorageSpec(r.name, r.nbytes, r.device, r.host_offset) for r in records), 0)


def verify_host(records: list[Offloaded]) -> None:
    """Checks the host copies of offloaded storages against the sums taken from their sources (after
    waiting for the copies that filled them); raises OffloadError naming the corrupt ones."""
    expected = _expected(records)
    for r in records:
        for e in r.events:
            if e is not None:
                e.synchronize()
    actual = _C.checksum_host([r.region.ptr + r.host_offset for r in records if r.region is not None],
                              [r.nbytes for r in records if r.region is not None])
    _integrity.check(_specs(records), expected, actual,
                     "cannot reload: the offloaded host copy is corrupt (nothing was copied back; the target is "
                     "still offloaded)")


def verify_reloaded(items: list[tuple[torch.UntypedStorage, Offloaded]]) -> None:
    """Checks reloaded device storages against the sums taken when they were offloaded."""
    records = [r for _, r in items]
    _integrity.verify_storages(_specs(records), [st.data_ptr() for st, _ in items], _expected(records),
                               "reloaded data differs from the offloaded source")


# -- touching offloaded state: a clear error, never a crash ------------------------------------------------
# An offloaded storage holds no memory (resize_(0)) while its tensors keep their shapes: a kernel reading one
# would read through a null pointer (SIGSEGV; on a GPU an illegal address that ends the CUDA context). Two
# lines of defence:
#  1. At the data (with the torch-aware helper): every offloaded storage refuses any access to its data
#     pointer, with a message naming its tensor (c10::StorageImpl's data-pointer access error, the mechanism
#     FakeTensor uses). One C++ call refuses the storages of an offload, one lifts it at reload.
#  2. The friendly first line, and the only one without the helper: hooks that raise OffloadError before
#     torch touches anything, on every module of an offloaded module (forward and state_dict) and on its
#     optimizers (step and state_dict). Installed by offload, removed by reload and discard.
def _refusal(name: str) -> str:
    return (f"gpu_offload: {name} is offloaded (its data is in host memory and its device memory is released); "
            "call gpu_offload.reload() on its model or optimizer before using it")


def refuse(storages: list[torch.UntypedStorage], names: list[str]) -> None:
    """Makes offloaded storages refuse any access to their data, each naming its tensor (one C++ call;
    nothing without the helper)."""
    if storages and torch_ext.access_guard_available():
        torch_ext.refuse_access(storages, list(map(_refusal, names)))


def allow(storages: list[Any]) -> None:
    """Lifts refuse() (storages or their keys, which the caller keeps alive); one C++ call."""
    if storages and torch_ext.access_guard_available():
        torch_ext.allow_access(storages)


def storage_key(t: torch.Tensor) -> int:
    return unwrap(t).untyped_storage()._cdata


def _keys_of(module: torch.nn.Module) -> Iterator[int]:
    # Through nn.Module's own methods: wrappers may shadow them (Megatron's DDP has a `buffers` list). A
    # ZeRO-3 parameter is a placeholder; its partition (ds_tensor) is what holds the data.
    for t in [*torch.nn.Module.parameters(module), *torch.nn.Module.buffers(module)]:
        yield storage_key(t)
        partition = getattr(t, "ds_tensor", None)
        if isinstance(partition, torch.Tensor):
            yield storage_key(partition)


def _optimizer_keys(optimizer: torch.optim.Optimizer) -> Iterator[int]:
    for group in optimizer.param_groups:
        for p in group["params"]:
            yield storage_key(p)
    for state in optimizer.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor):
                yield storage_key(v)


def _holds_offloaded(obj: Any) -> bool:
    with lock:
        if not entries:
            return False
        keys = _optimizer_keys(obj) if isinstance(obj, torch.optim.Optimizer) else _keys_of(obj)
        return any(k in entries for k in keys)


def top_modules(target: Any) -> Iterator[torch.nn.Module]:
    """The nn.Modules a target names at its top level (the target itself, or the items of a list/tuple):
    plain modules and FSDP/Megatron/DeepSpeed wrappers alike."""
    for item in target if isinstance(target, (list, tuple)) else (target,):
        if isinstance(item, torch.nn.Module):
            yield item


def top_optimizers(target: Any) -> Iterator[torch.optim.Optimizer]:
    """The torch optimizers a target names at its top level, and those inside the wrappers it names (a
    DeepSpeed engine's or ZeRO optimizer's `.optimizer`, a Megatron optimizer's, a ChainedOptimizer's)."""
    def inner(obj: Any, depth: int) -> Iterator[torch.optim.Optimizer]:
        if isinstance(obj, torch.optim.Optimizer):
            yield obj
        elif depth:
            wrapped = obj.__dict__.get("optimizer") if hasattr(obj, "__dict__") else None
            if wrapped is None and isinstance(obj, torch.nn.Module):
                wrapped = getattr(obj, "optimizer", None)  # a DeepSpeed engine (a module attribute)
            if wrapped is not None:
                yield from inner(wrapped, depth - 1)
            for chained in getattr(obj, "chained_optimizers", None) or ():
                yield from inner(chained, depth - 1)

    for item in target if isinstance(target, (list, tuple)) else (target,):
        yield from inner(item, 3)


class _Guard:
    """What offload hooked for one top-level module or optimizer of a target, and the storages it offloaded."""

    __slots__ = ("keys", "modules", "handles")

    def __init__(self) -> None:
        self.keys: set[int] = set()
        self.modules: list[weakref.ref] = []  # weakly: a submodule removed meanwhile is not kept alive
        self.handles: list[Any] = []  # an optimizer's hook handles


_guards: "weakref.WeakKeyDictionary[Any, _Guard]" = weakref.WeakKeyDictionary()  # top-level objects
# Our key in modules' hook dicts: one id taken from torch's own counter, so it collides with no handle's.
_HOOK_ID = torch.utils.hooks.RemovableHandle.next_id
torch.utils.hooks.RemovableHandle.next_id += 1


class _OffloadedForward:
    """Stands in for an offloaded module's forward (an instance attribute over the class's), and marks the
    module as hooked. A torch.compile'd wrapper made before the offload skips module hooks (dynamo does not
    guard on them) but does guard on `forward`: it traces again, and this raises. Holds the module weakly
    (no cycle through its __dict__)."""

    __slots__ = ("module", "top", "own")

    def __init__(self, module: torch.nn.Module, top: "weakref.ref[torch.nn.Module]", own: Any) -> None:
        self.module = weakref.ref(module)
        self.top = top  # the target's module it was hooked under, for messages
        self.own = own  # a forward of its own in the instance's __dict__ (accelerate's hooks set one), or None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module = self.module()
        if module is None:
            raise OffloadError("internal error: the forward of a dropped module was called")
        _module_forward_guard(module, args)  # raises while offloaded; unhooks the module otherwise
        return module.forward(*args, **kwargs)


def _label(obj: Any) -> str:
    """A hooked module as the target names it: `Linear 'layers.0.proj' of Transformer` (found only for a
    message, so that hooking costs no names)."""
    forward = obj.__dict__.get("forward") if isinstance(obj, torch.nn.Module) else None
    top = forward.top() if isinstance(forward, _OffloadedForward) else None
    if top is None or top is obj:
        return type(obj).__name__
    name = next((n for n, m in torch.nn.Module.named_modules(top) if m is obj), "?")
    return f"{type(obj).__name__} {name!r} of {type(top).__name__}"


def _offloaded_error(obj: Any, what: str) -> OffloadError:
    return OffloadError(f"cannot {what} {_label(obj)} (id {id(obj):#x}): its state is offloaded; call "
                        "gpu_offload.reload() on it first")


def _module_forward_guard(module: torch.nn.Module, args: Any) -> None:
    if _holds_offloaded(module):
        raise _offloaded_error(module, "run")
    with lock:  # reloaded some other way (e.g. through a mapping of its tensors): nothing to guard
        if module in _guards:
            _release(module)
        else:
            _unhook_module(module)


def _module_state_dict_guard(module: torch.nn.Module, prefix: str, keep_vars: bool) -> None:
    if _holds_offloaded(module):
        raise _offloaded_error(module, "take the state_dict of")


def _optimizer_step_guard(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if _holds_offloaded(optimizer):
        raise _offloaded_error(optimizer, "step")
    with lock:  # reloaded some other way: no check at every step from now on
        _release(optimizer)


def _optimizer_state_dict_guard(optimizer: torch.optim.Optimizer) -> None:
    if _holds_offloaded(optimizer):
        raise _offloaded_error(optimizer, "take the state_dict of")


def _submodules(top: torch.nn.Module) -> list[torch.nn.Module]:
    """Every module under top (itself included), each once: nn.Module.modules() without its names (it
    builds a prefix string per module)."""
    out, seen, stack = [], set(), [top]
    while stack:
        module = stack.pop()
        if id(module) not in seen:
            seen.add(id(module))
            out.append(module)
            stack.extend(m for m in module._modules.values() if m is not None)
    return out


def _hook_module(module: torch.nn.Module, top: "weakref.ref[torch.nn.Module]") -> bool:
    """Hooks one module (False: it was hooked already). Straight into its hook dicts, first in line
    (prepend: before FSDP's or DeepSpeed's own pre-forward, which would gather the offloaded shards): a
    thousand modules cost a few thousand dict stores, not a thousand RemovableHandles."""
    attrs = module.__dict__
    own = attrs.get("forward")
    if isinstance(own, _OffloadedForward):
        return False
    # OrderedDicts (typed as dicts in torch's stubs)
    forward = cast("collections.OrderedDict[int, Any]", module._forward_pre_hooks)
    state = cast("collections.OrderedDict[int, Any]", module._state_dict_pre_hooks)
    forward[_HOOK_ID] = _module_forward_guard
    forward.move_to_end(_HOOK_ID, last=False)
    state[_HOOK_ID] = _module_state_dict_guard
    state.move_to_end(_HOOK_ID, last=False)
    attrs["forward"] = _OffloadedForward(module, top, own)
    return True


def _unhook_module(module: torch.nn.Module) -> None:
    attrs = module.__dict__
    forward = attrs.get("forward")
    if not isinstance(forward, _OffloadedForward):
        return
    module._forward_pre_hooks.pop(_HOOK_ID, None)
    module._state_dict_pre_hooks.pop(_HOOK_ID, None)
    if forward.own is None:
        del attrs["forward"]
    else:
        attrs["forward"] = forward.own


def _release(top: Any) -> None:
    record = _guards.pop(top, None)
    if record is None:
        return
    for handle in record.handles:
        handle.remove()
    for ref in record.modules:
        module = ref()
        if module is not None:
            _unhook_module(module)


def guard(target: Any, keys: list[int]) -> None:
    """Hooks every module of the target's top-level modules (forward, state_dict) and its optimizers (step,
    state_dict), which offloaded the storages `keys`; call with the lock held."""
    for top in top_modules(target):
        record = _guards.setdefault(top, _Guard())
        record.keys.update(keys)
        ref = weakref.ref(top)
        record.modules.extend(map(weakref.ref, [m for m in _submodules(top) if _hook_module(m, ref)]))
    for optimizer in top_optimizers(target):
        record = _guards.setdefault(optimizer, _Guard())
        record.keys.update(keys)
        if not record.handles:
            record.handles = [optimizer.register_step_pre_hook(_optimizer_step_guard),
                              optimizer.register_state_dict_pre_hook(_optimizer_state_dict_guard, prepend=True)]


def unguard(target: Any) -> None:
    """Removes the hooks of the target's top-level objects whose offloaded storages are all back (or
    dropped). Where some remain, the hooks stay, and each hooked module checks for itself when called."""
    with lock:
        for top in [*top_modules(target), *top_optimizers(target)]:
            record = _guards.get(top)
            if record is not None and entries.keys().isdisjoint(record.keys):
                _release(top)
