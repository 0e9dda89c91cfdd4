"""The offload registry: which storages are offloaded, and where their bytes are in the arena.

One OffloadedSet per offload call: the storages it released, their sizes and places in one region, and a
watch on them. Lookups are still by storage identity, so that a list is its parts: offload([model, opt])
then is_offloaded(model) or reload([model, opt]) with a new list just work (`entries`, a mapping from a
storage's key to its record, built from the sets when first asked after a change). The common cycle,
offload(target) then reload(target), touches no per-storage Python object: it adds one set and removes it.
Every read and write holds `lock`.

The registry holds no storage: each set watches its storages through weak references (in one C++ object
with the torch-aware helper; a weakref per storage without it), and when a storage dies (the model was
dropped, a parameter replaced while offloaded) its record is dropped and its share of the region goes back
to the arena, at the next call that takes the lock.

Offloaded modules also get a forward pre-hook (`guard`) that raises a clear OffloadError instead of
torch's "out of bounds for storage of size 0"; reload and discard remove it, so nothing offloaded costs
nothing.
"""

from __future__ import annotations

import collections
import itertools
import threading
import weakref
from typing import Any, Iterator, Optional, Sequence

import torch

from . import integrity as _integrity
from . import torch_ext as _torch_ext
from ._errors import OffloadError
from ._ext import _C  # type: ignore[attr-defined]
from .arena import Region
from .storages import Layout, StorageSpec, unwrap

_ext: Any = _torch_ext.ext  # the torch-aware helper, or None (pure-Python paths)


class OffloadedSet:
    """The storages one offload released, with their bytes in one region (the registry's unit).

    Positions that were reloaded, discarded or whose storage died are no longer `alive`; the region keeps
    one user per live position. `alive` is only ever replaced whole, in one step (see drop_keys)."""

    def __init__(self, keys: list[int], nbytes: list[int], devices: list[torch.device], host_offsets: list[int],
                 indices: list[int], names: list[str], region: Region, events: list[Any], checksums: Any,
                 storages: Sequence[Any] = (), watch: Any = None) -> None:
        self.keys = keys
        self.nbytes = nbytes
        self.devices = devices
        self.host_offsets = host_offsets
        self.indices = indices  # each storage's index in the offload's layout (its checksum's)
        self.names = names  # the first tensor that views each storage, for messages
        self.region = region
        self.events = events  # the D2H copy that filled the region (and reloads that read it, once failed)
        self.checksums = checksums  # integrity.Checksums of the offload's layout, or None
        self.alive = bytearray(b"\x01") * len(keys)
        # The storages are watched, not held: `watch` (a StorageWatch the caller made, e.g. from its plan's
        # record), else `storages` (tensors or UntypedStorages, held by the caller now): one C++ object with
        # the helper, a weakref per storage without it.
        self._watch: Any = watch
        self._refs: list[Any] = []
        if watch is None and _ext is not None:
            self._watch = _ext.StorageWatch(storages)
        elif watch is None:
            for pos, st in enumerate(storages):
                if isinstance(st, torch.Tensor):
                    st = st.untyped_storage()
                # torch keeps a storage's Python object alive as long as the storage itself, so a weak
                # reference to it dies with the storage. No cycle through the set.
                self._refs.append(weakref.ref(st, _on_death(weakref.ref(self), pos)))

    @property
    def num_alive(self) -> int:
        return self.alive.count(1)

    @property
    def whole(self) -> bool:
        return 0 not in self.alive

    def record(self, pos: int) -> "Offloaded":
        return Offloaded(self, pos)

    def dead(self) -> list[int]:
        """Positions whose storage died since the last call (still counted alive until dropped)."""
        if self._watch is not None:
            return [p for p in self._watch.dead() if self.alive[p]]
        return []

    def forget(self, positions: Optional[Sequence[int]]) -> None:
        """Stops watching positions (None: all) that are no longer offloaded."""
        if self._watch is not None:
            if positions is None or 1 not in self.alive:
                self._watch.forget_all()
            else:
                self._watch.forget(list(positions))
        elif positions is None or 1 not in self.alive:
            self._refs = []


def _on_death(set_ref: "weakref.ref[OffloadedSet]", pos: int) -> Any:
    def callback(_: Any) -> None:
        # Weakref callbacks may run inside any allocation, even while this thread iterates the sets: they
        # only append here; the record is dropped under the lock.
        target = set_ref()
        if target is not None:
            _dead.append((target, pos))
    return callback


class Offloaded:
    """One offloaded storage: a view of its position in an OffloadedSet."""

    __slots__ = ("owner", "pos")

    def __init__(self, owner: OffloadedSet, pos: int) -> None:
        self.owner = owner
        self.pos = pos

    nbytes = property(lambda self: self.owner.nbytes[self.pos])
    device = property(lambda self: self.owner.devices[self.pos])
    region = property(lambda self: self.owner.region)
    host_offset = property(lambda self: self.owner.host_offsets[self.pos])
    checksums = property(lambda self: self.owner.checksums)
    index = property(lambda self: self.owner.indices[self.pos])
    name = property(lambda self: self.owner.names[self.pos])

    @property
    def events(self) -> list[Any]:
        return self.owner.events

    @events.setter
    def events(self, value: list[Any]) -> None:
        self.owner.events = list(value)  # shared by the set: every copy reading the region is waited for


_sets: list[OffloadedSet] = []
_dead: list[tuple[OffloadedSet, int]] = []  # from the weakref callbacks (no helper)
_index: Optional[dict[int, tuple[OffloadedSet, int]]] = None  # key -> (set, position), built on demand
# Counts offloads: a cached plan found clear of offloaded storages stays so until the next offload (api).
generation = 0


def _changed() -> None:
    # Called before every change of _sets or of a set's `alive`: an interrupt between the two leaves an index
    # that is rebuilt, never a stale one.
    global _index
    _index = None


def _key_index() -> dict[int, tuple[OffloadedSet, int]]:
    global _index
    index = _index
    if index is None:
        index = {}
        for s in _sets:
            alive = s.alive
            if 0 not in alive:
                index.update(zip(s.keys, zip(itertools.repeat(s), range(len(s.keys)))))
            else:
                for pos, key in enumerate(s.keys):
                    if alive[pos]:
                        index[key] = (s, pos)
        _index = index
    return index


class _Entries:
    """The offloaded storages by key (StorageImpl address): `key in entries`, `entries[key]` (an Offloaded),
    `entries.pop(key)` (no longer offloaded; the caller releases its region user). Call with the lock held."""

    def __bool__(self) -> bool:
        return bool(_sets)

    def __len__(self) -> int:
        return len(_key_index()) if _sets else 0

    def __contains__(self, key: object) -> bool:
        return bool(_sets) and key in _key_index()

    def __getitem__(self, key: int) -> Offloaded:
        owner, pos = _key_index()[key]
        return Offloaded(owner, pos)

    def get(self, key: int, default: Any = None) -> Any:
        found = _key_index().get(key) if _sets else None
        return default if found is None else Offloaded(*found)

    def pop(self, key: int, *default: Any) -> Any:
        found = _key_index().get(key) if _sets else None
        if found is None:
            if default:
                return default[0]
            raise KeyError(key)
        drop_keys([key])
        return Offloaded(*found)

    def __iter__(self) -> Iterator[int]:
        return iter(list(_key_index()) if _sets else [])

    def keys(self) -> list[int]:
        return list(_key_index()) if _sets else []

    def items(self) -> list[tuple[int, Offloaded]]:
        return [(k, Offloaded(*v)) for k, v in _key_index().items()] if _sets else []

    def values(self) -> list[Offloaded]:
        return [Offloaded(*v) for v in _key_index().values()] if _sets else []


entries = _Entries()


class _Lock:
    """The registry's re-entrant lock; taking it (the outermost time) first drops the records of storages
    that died."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._depth = 0  # of the thread that holds it

    def __enter__(self) -> "_Lock":
        self._lock.acquire()
        self._depth += 1
        if self._depth == 1:
            try:
                prune()
            except BaseException:
                self._depth -= 1
                self._lock.release()
                raise
        return self

    def __exit__(self, *exc: object) -> None:
        self._depth -= 1
        self._lock.release()


lock = _Lock()


def prune() -> None:
    """Drops the records of dead storages and releases their share of the region (call with the lock held).
    With the helper, one C++ pass over each set's weak references."""
    if not _sets:
        _dead.clear()
        return
    for s in list(_sets):
        dead = s.dead()
        if dead:
            _release(s, dead)
        elif 1 not in s.alive:  # left by an interrupted commit: nothing of it is offloaded
            remove(s)
    while _dead:
        s, pos = _dead.pop()
        if s in _sets and s.alive[pos]:
            _release(s, [pos])


def _release(s: OffloadedSet, positions: list[int]) -> None:
    for owner, dropped in drop_keys([s.keys[p] for p in positions], only=s):
        owner.region.release(owner.events, count=len(dropped))


def drop_keys(keys: Sequence[int], only: Optional[OffloadedSet] = None) -> list[tuple[OffloadedSet, list[int]]]:
    """Marks these storages as no longer offloaded (those that are; of set `only`, if given), and returns,
    per set, the positions dropped: their region users are the caller's to release. Call with the lock held.

    Every set's new `alive` is computed first and all are put in place by one call of C code, so that an
    interrupt leaves either all of them offloaded or none; emptied sets are unregistered after that."""
    index = _key_index() if _sets else {}
    by_set: dict[int, tuple[OffloadedSet, list[int]]] = {}
    for key in keys:
        found = index.get(key)
        if found is not None and (only is None or found[0] is only):
            by_set.setdefault(id(found[0]), (found[0], []))[1].append(found[1])
    groups = list(by_set.values())
    if not groups:
        return []
    alive = []
    for owner, positions in groups:
        if len(positions) == len(owner.keys):
            alive.append(bytearray(len(owner.keys)))
        else:
            new = bytearray(owner.alive)
            for p in positions:
                new[p] = 0
            alive.append(new)
    owners = [g[0] for g in groups]
    _changed()
    collections.deque(map(setattr, owners, itertools.repeat("alive"), alive), maxlen=0)  # the commit
    for owner, positions in groups:
        if 1 not in owner.alive:
            remove(owner)
        owner.forget(positions)
    return groups


def add(s: OffloadedSet) -> None:
    """Registers an offload's set (call with the lock held)."""
    global generation
    generation += 1
    _changed()
    _sets.append(s)


def remove(s: OffloadedSet) -> bool:
    """Unregisters a set in one step (its region users are the caller's to release); False if it was not
    registered."""
    _changed()
    try:
        _sets.remove(s)
    except ValueError:
        return False
    return True


def registered(s: OffloadedSet) -> bool:
    """Whether a set is still registered (its live positions are offloaded)."""
    return any(x is s for x in _sets)


def offloaded_name(keys: Sequence[int]) -> Optional[str]:
    """The name of the first of these storages that is offloaded, or None (call with the lock held)."""
    if not _sets:
        return None
    index = _key_index()
    if index.keys().isdisjoint(keys):
        return None
    for key in keys:
        found = index.get(key)
        if found is not None:
            return found[0].names[found[1]]
    return None


def sizes() -> dict[int, int]:
    """Offloaded storage sizes by key (what bind() needs to lay out an offloaded target)."""
    with lock:
        return {k: s.nbytes[pos] for k, (s, pos) in _key_index().items()} if _sets else {}


def total_bytes() -> int:
    with lock:
        return sum(sum(itertools.compress(s.nbytes, s.alive)) for s in _sets)


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
        if not _sets:
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
