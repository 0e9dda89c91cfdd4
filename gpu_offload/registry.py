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

Gradients released by `offload(grads="drop")` are registered too, in a set without a region: they have no
host copy, and reload re-allocates them zeroed.

Touching offloaded state raises instead of reading released memory: the storages refuse access to their data
(with the torch-aware helper), and offloaded modules and optimizers get hooks that raise OffloadError first
(see "touching offloaded state" below); reload and discard remove them, so nothing offloaded costs nothing.
"""

from __future__ import annotations

import _thread
import collections
import functools
import itertools
import logging
import weakref
from typing import Any, Iterator, Optional, Sequence, cast

import torch

from . import _fork, torch_ext
from . import integrity as _integrity
from ._errors import OffloadError
from ._ext import _C  # type: ignore[attr-defined]
from .arena import Region, wait_for
from .storages import Layout, StorageSpec, unwrap

logger = logging.getLogger("gpu_offload")

_ext: Any = torch_ext.ext  # the torch-aware helper, or None (pure-Python paths)


class OffloadedSet:
    """The storages one offload released, with their bytes in one region (the registry's unit).

    Positions that were reloaded, discarded or whose storage died are no longer `alive`; the region keeps
    one user per live position. `alive` is only ever replaced whole, in one step (see drop_keys)."""

    def __init__(self, keys: list[int], nbytes: list[int], devices: list[torch.device], host_offsets: list[int],
                 indices: list[int], names: list[str], region: Optional[Region], events: list[Any], checksums: Any,
                 storages: Sequence[Any] = (), watch: Any = None) -> None:
        self.keys = keys
        self.nbytes = nbytes
        self.devices = devices
        self.host_offsets = host_offsets
        self.indices = indices  # each storage's index in the offload's layout (its checksum's)
        self.names = names  # the first tensor that views each storage, for messages
        self.region = region  # None: gradients dropped by offload(grads="drop"), re-allocated zeroed by reload
        self.events = events  # the D2H copy that filled the region (and reloads that read it, once failed)
        self.checksums = checksums  # integrity.Checksums of the offload's layout, or None
        self.alive = bytearray(b"\x01") * len(keys)
        self._key_set: Optional[frozenset[int]] = None
        # Whether any of these storages may be some tensor's .grad: False only where the offload says its
        # target was modules and optimizers read without their gradients (see api.offload), so that a reload
        # of a target whose gradients stayed on the device need not look for them here.
        self.holds_grads = True
        # The set of the gradients the same offload dropped (grads="drop"), reloaded with this one.
        self.dropped: Optional["OffloadedSet"] = None
        # The storages are watched, not held: `watch` (a StorageWatch the caller made, e.g. from its plan's
        # record), else `storages` (tensors or UntypedStorages, held by the caller now): one C++ object with
        # the helper, a weakref per storage without it.
        self._watch: Any = watch
        self.dead_positions: list[int] = []  # reported dead by the watch, not dropped yet (see dead())
        self._refs: list[Any] = []
        if watch is None and _ext is not None:
            self._watch = _ext.StorageWatch(storages)
        elif watch is None:
            for pos, st in enumerate(storages):
                if isinstance(st, torch.Tensor):
                    st = st.untyped_storage()
                # torch keeps a storage's Python object alive as long as the storage itself, so a weak
                # reference to it dies with the storage. The callback is C code (dict.__setitem__ through
                # functools.partial: no interrupt can fall before it records) and holds no reference to the
                # set (no cycle through it).
                self._refs.append(weakref.ref(st, functools.partial(_dead.__setitem__, (id(self), pos))))

    @property
    def num_alive(self) -> int:
        return self.alive.count(1)

    def key_set(self) -> frozenset[int]:
        """Every key of the set, alive or not, as a frozenset (made at the first call, in C: the keys never
        change). A key not in it is not offloaded through this set."""
        made = self._key_set
        if made is None:
            made = self._key_set = frozenset(self.keys)
        return made

    @property
    def whole(self) -> bool:
        return 0 not in self.alive

    def record(self, pos: int) -> "Offloaded":
        return Offloaded(self, pos)

    def dead(self) -> list[int]:
        """Positions whose storage died and that are not dropped yet (prune drops them, then forgets them
        here). The helper's watch reports each death once; what it reports lands in this list inside C code
        (extend over map), so that no interrupt can lose a death between the report and the list."""
        if self._watch is not None:
            self.dead_positions.extend(itertools.chain.from_iterable(map(type(self._watch).dead, (self._watch,))))
        return self.dead_positions

    def forget(self, positions: Optional[Sequence[int]]) -> None:
        """Stops watching positions (None: all) that are no longer offloaded."""
        if self._watch is not None:
            if positions is None or 1 not in self.alive:
                self._watch.forget_all()
            else:
                self._watch.forget(list(positions))
        elif positions is None or 1 not in self.alive:
            self._refs = []


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
# Storages that died, from the weakref callbacks (no helper): (id of the set, position) -> the weakref. Weakref
# callbacks may run inside any allocation, even while this thread iterates the sets, so they only record here;
# the records are dropped under the lock (prune), and forgotten only once handled.
_dead: dict[tuple[int, int], "weakref.ref[Any]"] = {}
_index: Optional[dict[int, tuple[OffloadedSet, int]]] = None  # key -> (set, position), built on demand
# Counts offloads: a cached plan found clear of offloaded storages stays so until the next offload (api).
generation = 0


_version = 0  # bumped by every change of what is offloaded (the global hook's memo of clear modules)


def _changed() -> None:
    # Called before every change of _sets or of a set's `alive`: an interrupt between the two leaves an index
    # that is rebuilt, never a stale one.
    global _index, _version
    _index = None
    _version += 1


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


class _Lock(_thread.RLock):  # type: ignore[misc]  # final in the stubs, subclassable at run time
    """The registry's re-entrant lock; taking it (the outermost time) first drops the records of storages
    that died (not inside: a caller holding the lock may hold positions of the sets).

    Owned from the moment it is taken, whatever interrupts: the acquisition's result lands in a list inside
    C code (map, extend), so an interrupt right after it is seen by the handler below and released, and
    the release is RLock's own `__exit__` (C code, which no signal handler can interrupt before it
    releases). Unheld again in a forked child (gpu_offload._fork).
    """

    def __enter__(self) -> "_Lock":  # type: ignore[override]
        taken: list[bool] = []
        outer = not self._is_owned()  # (only this thread changes whether it owns the lock)
        try:
            taken.extend(map(_thread.RLock.acquire, (self,)))
            if outer:
                prune()
        except BaseException:
            if taken:
                self.release()
            raise
        return self


lock = _fork.track(_Lock())


def prune() -> None:
    """Drops the records of dead storages and releases their share of the region (call with the lock held).
    With the helper, one C++ pass over each set's weak references. Once nothing is offloaded, the global
    forward hook goes too (a model dropped while offloaded leaves it: every module call in the process would
    otherwise pass through it, and torch.compile warn of it, until one found nothing offloaded)."""
    if not _sets:
        _dead.clear()
        if _global_hook is not None:
            _remove_global_hook(force=True)
        return
    for s in list(_sets):
        dead = s.dead()
        if dead:
            n = len(dead)
            _release_positions(s, dead[:n])  # (positions dropped already are skipped: a retry after an interrupt)
            del dead[:n]
        elif 1 not in s.alive:  # left by an interrupted commit: nothing of it is offloaded
            remove(s)
    while _dead:
        item, ref = next(iter(_dead.items()))
        sid, pos = item
        s = next((x for x in _sets if id(x) == sid), None)
        # Not a set that died and whose id a new one took since: the weakref is the set's own.
        if s is not None and pos < len(s._refs) and s._refs[pos] is ref and s.alive[pos]:
            _release_positions(s, [pos])
        if _dead.get(item) is ref:  # forgotten only once handled
            del _dead[item]
    if not _sets and _global_hook is not None:
        _remove_global_hook(force=True)


def _release_positions(s: OffloadedSet, positions: list[int]) -> None:
    for owner, dropped in drop_keys([s.keys[p] for p in positions], only=s):
        if owner.region is not None:
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


def others_hold_grads(s: Optional[OffloadedSet], also: Optional[OffloadedSet] = None) -> bool:
    """Whether a registered set other than `s` (and `also`) may hold some tensor's gradient (call with the lock
    held); s=None: whether any does."""
    # (A loop, not any() over a generator: one closed early is finalized later, and an interrupt landing
    # in its close would be printed and dropped instead of reaching the caller.)
    for other in _sets:
        if other.holds_grads and other is not s and other is not also:
            return True
    return False


def registered(s: OffloadedSet) -> bool:
    """Whether a set is still registered (its live positions are offloaded)."""
    return s in _sets  # (identity: sets have no __eq__; C code, no generator an interrupt could land in)


def _in_no_set(keys: Sequence[int]) -> bool:
    """Whether no registered set was ever given one of these keys (each set's own frozenset, made once per
    set): then none of them is offloaded, and the index of every offloaded storage need not be asked. That
    index is remade after each change of the registry, at a tuple per storage (a swap of 65536 tensors spent
    73 ms remaking it). False says only "perhaps": a set keeps the keys of positions no longer alive."""
    for s in _sets:
        if not s.key_set().isdisjoint(keys):
            return False
    return True


def offloaded_any(keys: Sequence[int]) -> bool:
    """Whether any of these storage keys is offloaded (call with the lock held)."""
    return bool(_sets) and not _in_no_set(keys) and not _key_index().keys().isdisjoint(keys)


def first_offloaded(keys: Sequence[int]) -> Optional[int]:
    """The position in `keys` of the first of these storages that is offloaded, or None (call with the lock
    held). The caller names it as its own target does: an offload of another target named it otherwise
    (`offload(b)`, then `offload([a, b])`: "1.weight", not "weight")."""
    if not _sets or _in_no_set(keys):  # (mostly none is)
        return None
    index = _key_index()
    for i, key in enumerate(keys):
        if key in index:
            return i
    return None


def sizes() -> dict[int, int]:
    """Offloaded storage sizes by key (what bind() needs to lay out an offloaded target)."""
    with lock:
        return {k: s.nbytes[pos] for k, (s, pos) in _key_index().items()} if _sets else {}


def total_bytes() -> int:
    """Bytes held in host memory for offloaded storages (dropped gradients hold none)."""
    with lock:
        return sum(sum(itertools.compress(s.nbytes, s.alive)) for s in _sets if s.region is not None)


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
        wait_for(r.events)
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
#     torch touches anything, on an offloaded module and its submodules (forward and state_dict) and on its
#     optimizers (step and state_dict). Installed by offload, removed by reload and discard. Where the
#     storages refuse access (line 1), only the target's top-level modules get hooks of their own, and every
#     submodule is covered by one global forward pre-hook (torch.nn.modules.module's), installed while a
#     module is offloaded: hooking and unhooking each of a 65536-expert model's modules cost more than the
#     rest of its offload and reload together. A submodule's state_dict() or a direct call of its
#     .forward() then meets line 1: the tensors it reaches refuse access, naming themselves. Without the
#     helper every submodule is hooked, as that is the only line.
def _refusal(name: str) -> str:
    return (f"gpu_offload: {name} is offloaded (its data is in host memory and its device memory is released); "
            "call gpu_offload.reload() on its model or optimizer before using it")


def _drop_refusal(name: str) -> str:
    return (f"gpu_offload: {name} was dropped by offload(grads='drop') (its memory is released); "
            "gpu_offload.reload() of its model brings it back zeroed")


def drop_refusals(names: Sequence[str]) -> list[str]:
    """The messages dropped gradients' storages refuse access with."""
    return list(map(_drop_refusal, names))


def refusals(names: Sequence[str]) -> list[str]:
    """The messages refuse() gives the storages of these tensors (a plan keeps its own: see api)."""
    return list(map(_refusal, names))


def refuse(storages: Sequence[Any], names: Sequence[str], messages: Optional[str | list[str]] = None) -> None:
    """Makes offloaded storages (or their keys, which the caller keeps alive) refuse any access to their
    data, each naming its tensor, or with `messages` (one for all, or one per storage); one C++ call,
    nothing without the helper."""
    if storages and torch_ext.access_guard_available():
        torch_ext.refuse_access(storages, messages if messages is not None else refusals(names))
    elif storages:
        _warn_unguarded()


_warned_unguarded = [False]


def _warn_unguarded() -> None:
    """Says once per process that released storages do not refuse access here: calling an offloaded module
    raises (its hooks), but a direct read of one of its tensors reads through a null pointer."""
    if _warned_unguarded[0]:
        return
    _warned_unguarded[0] = True
    why = torch_ext.status()
    if "GPU_OFFLOAD_TORCH_EXT=0" in why:  # (the user's own choice: said at debug level only)
        logger.debug("offloaded storages do not refuse access (gpu_offload._torch_ext is %s)", why)
        return
    if torch_ext.available():  # (loaded into a torch that cannot lift a refusal)
        why, fix = f"torch {torch.__version__} cannot lift a refusal", "torch 2.6 or later can"
    else:
        why, fix = (f"gpu_offload._torch_ext is {why}", "reinstall gpu_offload into this environment with its torch "
                    "installed, e.g. pip install --no-build-isolation ., to make such reads raise")
    logger.warning("offloaded tensors do not refuse access in this process (%s): calling an offloaded module "
                   "raises, but reading one of its tensors directly (w.norm(), print(w)) reads released memory and "
                   "may crash; %s", why, fix)


# What discarded storages refuse access with: an empty storage under full-shape tensors would otherwise be
# read through a null pointer (torch's own resize_(0) leaves it so: a SIGSEGV at the next read).
DISCARDED = ("gpu_offload: this tensor's storage was emptied by gpu_offload.discard() (its memory is released and "
             "its values are gone); give the tensor new memory (p.data = torch.empty_like(p)) or load a snapshot "
             "into a rebuilt model")


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


def _own_keys(module: torch.nn.Module) -> Iterator[int]:
    """The storage keys of a module's own parameters and buffers (not its submodules')."""
    for t in [*module._parameters.values(), *module._buffers.values()]:
        if t is not None:
            yield storage_key(t)
            partition = getattr(t, "ds_tensor", None)
            if isinstance(partition, torch.Tensor):
                yield storage_key(partition)


def _global_forward_guard(module: torch.nn.Module, args: Any) -> None:
    """The global forward pre-hook (line 2 where the storages refuse access): every module call in the process
    passes here while a module is offloaded, so it looks at the module's own tensors only (a container's
    children check for themselves when it calls them), unless the module has pre-hooks of its own: those run
    next and may reach its submodules' tensors (FSDP2's unshard of a unit, ZeRO-3's gather), so all of them
    are looked at then. Nothing at all inside a compiled graph (dynamo traces this to nothing; the compiled
    code meets line 1)."""
    if torch.compiler.is_compiling():  # (first: dynamo would guard on _sets' length)
        return
    version = _version  # (read before the index: a change in between leaves a memo that is never matched)
    if _clear.get(module) == version and _sets:
        return  # found clear since the last change (a module with hooks would otherwise walk its subtree each call)
    keys = list(_keys_of(module) if module._forward_pre_hooks else _own_keys(module))
    index = _index  # (a built index is never changed, only replaced: read without the lock, which would prune)
    if _sets and index is not None and index.keys().isdisjoint(keys):
        _clear[module] = version
        return
    with lock:  # confirmed under the lock (after prune: a dead storage's address may be a new one's now)
        if not _sets:  # nothing offloaded (a model dropped while offloaded leaves the hook): it goes
            _remove_global_hook(force=True)
        elif not _key_index().keys().isdisjoint(keys):
            raise _offloaded_error(module, "run")
        else:
            _clear[module] = version


_global_hook: Optional[Any] = None  # the RemovableHandle of _global_forward_guard while installed
# Modules the global hook found clear of offloaded storages, with the _version they were found at (weakly).
_clear: "weakref.WeakKeyDictionary[torch.nn.Module, int]" = weakref.WeakKeyDictionary()


def _submodules_hooked() -> bool:
    """Whether every submodule gets hooks of its own (no storage refusal to fall back on), or the global hook
    covers them."""
    return not torch_ext.access_guard_available()


def _install_global_hook() -> None:
    global _global_hook
    # (A handle whose hook is gone, left by an interrupt inside _remove_global_hook, is replaced.)
    if _global_hook is None or _global_hook.id not in torch.nn.modules.module._global_forward_pre_hooks:
        _global_hook = torch.nn.modules.module.register_module_forward_pre_hook(_global_forward_guard)


def _remove_global_hook(force: bool = False) -> None:
    """Removes the global hook once no guarded module is left, or (force) once nothing is offloaded at all
    (call with the lock held; torch iterates a copy of the hooks, so the hook may remove itself)."""
    global _global_hook
    handle = _global_hook
    if handle is not None and (force or not any(isinstance(top, torch.nn.Module) for top in list(_guards.keys()))):
        # The hook first, then the handle: an interrupt in between leaves a handle of no hook, which the next
        # install replaces (the other order could leave a hook that no handle removes).
        handle.remove()
        _global_hook = None
        _clear.clear()


def _holds_offloaded(obj: Any) -> bool:
    with lock:
        if not _sets:
            return False
        index = _key_index()
        keys = _optimizer_keys(obj) if isinstance(obj, torch.optim.Optimizer) else _keys_of(obj)
        return any(k in index for k in keys)


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
        self.keys: list[list[int]] = []  # each offload's keys (its own list, not copied: one per offload)
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

    def __reduce__(self) -> Any:
        raise _pickle_error(self.module)


def _label(obj: Any) -> str:
    """A hooked module as the target names it: `Linear 'layers.0.proj' of Transformer` (found only for a
    message, so that hooking costs no names)."""
    forward = obj.__dict__.get("forward") if isinstance(obj, torch.nn.Module) else None
    top = forward.top() if isinstance(forward, _OffloadedForward) else None
    if top is None and isinstance(obj, torch.nn.Module):  # a submodule the global hook stopped: its target's
        top = next((t for t in list(_guards.keys()) if isinstance(t, torch.nn.Module) and
                    any(m is obj for m in torch.nn.Module.modules(t))), None)
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


class _LoadStateDictGuard:
    """An offloaded module's load_state_dict pre-hook (torch calls it without the module: it holds it weakly)."""

    __slots__ = ("module",)

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = weakref.ref(module)

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        module = self.module()
        if module is not None and _holds_offloaded(module):
            raise _offloaded_error(module, "load a state_dict into")

    def __reduce__(self) -> Any:
        raise _pickle_error(self.module)


def _pickle_error(ref: "weakref.ref[torch.nn.Module]") -> OffloadError:
    # Pickling (torch.save(module), copy.deepcopy) reaches an offloaded module's guards before its tensors,
    # which would refuse too: say what and why, not that a weak reference cannot be pickled.
    module = ref()
    if module is None:
        return OffloadError("cannot pickle an offloaded module's guard (its module is gone)")
    return _offloaded_error(module, "pickle")


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
    load = cast("collections.OrderedDict[int, Any]", module._load_state_dict_pre_hooks)
    forward[_HOOK_ID] = _module_forward_guard
    forward.move_to_end(_HOOK_ID, last=False)
    state[_HOOK_ID] = _module_state_dict_guard
    state.move_to_end(_HOOK_ID, last=False)
    # (load_state_dict would copy into the released storages: without the helper, through a null pointer)
    load[_HOOK_ID] = _LoadStateDictGuard(module)
    load.move_to_end(_HOOK_ID, last=False)
    attrs["forward"] = _OffloadedForward(module, top, own)
    return True


def _unhook_module(module: torch.nn.Module) -> None:
    attrs = module.__dict__
    forward = attrs.get("forward")
    if not isinstance(forward, _OffloadedForward):
        return
    module._forward_pre_hooks.pop(_HOOK_ID, None)
    module._state_dict_pre_hooks.pop(_HOOK_ID, None)
    module._load_state_dict_pre_hooks.pop(_HOOK_ID, None)
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
    if isinstance(top, torch.nn.Module):
        _remove_global_hook()


def guard(target: Any, keys: list[int]) -> None:
    """Hooks every module of the target's top-level modules (forward, state_dict) and its optimizers (step,
    state_dict), which offloaded the storages `keys`; call with the lock held."""
    each = _submodules_hooked()
    for top in top_modules(target):
        record = _guards.setdefault(top, _Guard())
        record.keys.append(keys)
        ref = weakref.ref(top)
        record.modules.extend(map(weakref.ref, [m for m in (_submodules(top) if each else [top])
                                                if _hook_module(m, ref)]))
        if not each:
            _install_global_hook()
    for optimizer in top_optimizers(target):
        record = _guards.setdefault(optimizer, _Guard())
        record.keys.append(keys)
        if not record.handles:
            record.handles = [optimizer.register_step_pre_hook(_optimizer_step_guard),
                              optimizer.register_state_dict_pre_hook(_optimizer_state_dict_guard, prepend=True)]


def unguard(target: Any) -> None:
    """Removes the hooks of the target's top-level objects whose offloaded storages are all back (or
    dropped). Where some remain, the hooks stay, and each hooked module checks for itself when called."""
    with lock:
        for top in [*top_modules(target), *top_optimizers(target)]:
            record = _guards.get(top)
            if record is not None and not offloaded_any(itertools.chain.from_iterable(record.keys)):
                _release(top)
