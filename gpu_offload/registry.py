"""The offload registry: which storages are offloaded, and where their bytes are in the arena.

Keyed by storage identity rather than by target, so that a list is its parts: offload([model, opt]) then
is_offloaded(model) or reload([model, opt]) with a new list just work. Every read and write holds `lock`.

The registry holds no storage: each entry watches its storage through a weak reference, and when the
storage dies (the model was dropped, a parameter replaced while offloaded) the entry is dropped and its
host bytes go back to the arena, at the next call that takes the lock.

Offloaded modules also get a forward pre-hook (`guard`) that raises a clear OffloadError instead of
torch's "out of bounds for storage of size 0"; reload and discard remove it, so nothing offloaded costs
nothing.
"""

from __future__ import annotations

import _thread
import functools
import weakref
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch

from . import _fork
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
    region: Region
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


class _Lock(_thread.RLock):
    """The registry's re-entrant lock; taking it first drops the entries of storages that died.

    Owned from the moment it is taken, whatever interrupts: the acquisition's result lands in a list inside
    C code (map, extend), so an interrupt right after it is seen by the handler below and released, and
    the release is RLock's own `__exit__` (C code, which no signal handler can interrupt before it
    releases). Unheld again in a forked child (gpu_offload._fork).
    """

    def __enter__(self) -> "_Lock":
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
    with lock:
        return sum(r.nbytes for r in entries.values())


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
    actual = _C.checksum_host([r.region.ptr + r.host_offset for r in records], [r.nbytes for r in records])
    _integrity.check(_specs(records), expected, actual,
                     "cannot reload: the offloaded host copy is corrupt (nothing was copied back; the target is "
                     "still offloaded)")


def verify_reloaded(items: list[tuple[torch.UntypedStorage, Offloaded]]) -> None:
    """Checks reloaded device storages against the sums taken when they were offloaded."""
    records = [r for _, r in items]
    _integrity.verify_storages(_specs(records), [st.data_ptr() for st, _ in items], _expected(records),
                               "reloaded data differs from the offloaded source")


# -- using an offloaded module: a clear error ---------------------------------------------------------------
_guards: "weakref.WeakKeyDictionary[torch.nn.Module, Any]" = weakref.WeakKeyDictionary()


def top_modules(target: Any) -> Iterator[torch.nn.Module]:
    """The nn.Modules a target names at its top level (the target itself, or the items of a list/tuple):
    plain modules and FSDP/Megatron/DeepSpeed wrappers alike."""
    if isinstance(target, torch.nn.Module):
        yield target
    elif isinstance(target, (list, tuple)):
        for item in target:
            if isinstance(item, torch.nn.Module):
                yield item


def _holds_offloaded(module: torch.nn.Module) -> bool:
    with lock:
        if not entries:
            return False
        # Through nn.Module's own methods: wrappers may shadow them (Megatron's DDP has a `buffers` list).
        for t in [*torch.nn.Module.parameters(module), *torch.nn.Module.buffers(module)]:
            if unwrap(t).untyped_storage()._cdata in entries:
                return True
    return False


def _forward_guard(module: torch.nn.Module, args: Any) -> None:
    if _holds_offloaded(module):
        raise OffloadError(f"cannot run {type(module).__name__} (id {id(module):#x}): its state is offloaded; "
                           "call gpu_offload.reload() on it first")
    unguard([module])  # reloaded some other way (e.g. through a mapping of its tensors): nothing to guard


def guard(target: Any) -> None:
    """Installs the forward guard on the target's top-level modules (once per module)."""
    for module in top_modules(target):
        with lock:
            if module not in _guards:
                _guards[module] = module.register_forward_pre_hook(_forward_guard, prepend=True)


def unguard(target: Any) -> None:
    """Removes the guard from the target's top-level modules that hold nothing offloaded any more."""
    for module in top_modules(target):
        with lock:
            handle = _guards.get(module)
            if handle is not None and not _holds_offloaded(module):
                handle.remove()
                del _guards[module]
