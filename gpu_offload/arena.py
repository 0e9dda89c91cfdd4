"""Arena: pinned host memory, pinned once and reused by every snapshot and offload that uses it."""

from __future__ import annotations

import atexit
import collections
import ctypes
import logging
import os
import re
import resource
import weakref
from typing import Any, Iterable, Optional, Sequence, Union

from . import _capture, _env, _fork, _topology
from ._bytes import MAX_BYTES, parse_bytes, parse_bytes_or_fraction
from ._errors import OffloadError
from ._ext import _C  # type: ignore[attr-defined]

logger = logging.getLogger("gpu_offload")

_MIB = 1 << 20
_DEFAULT_MIN_SLAB_BYTES = 256 * _MIB
_PIN_MODES = ("auto", "none", "hostalloc", "register")


def _size(value: Any, what: str) -> Any:
    """A byte count given as a string ("1GiB", "512 MiB", "8e9": the units the environment variables
    accept) as an int; anything else as it is, for the caller's own checks."""
    return parse_bytes(value, what) if isinstance(value, str) else value


def _env_int(name: str) -> Optional[int]:
    """A byte count from the environment (8000000000, 8e9, 8GiB); None when unset or empty."""
    value = os.environ.get(name)
    if value is None or value == "":
        return None
    return parse_bytes(value, name)


_warned_query = False


def _done(event: Any) -> bool:
    """Whether a copy's event has completed. A query that raises (an event recorded in a CUDA graph capture,
    a device in an error state) counts as not complete: the region stays deferred instead of every later
    call of the arena raising."""
    global _warned_query
    try:
        return bool(event.query())
    except Exception as exc:
        if not _warned_query:
            _warned_query = True
            logger.warning("gpu_offload: an event query failed (%s); the region it guards stays reserved", exc)
        return False


def wait_for(events: Iterable[Any]) -> None:
    """Blocks the host until these copy events have completed (None entries skipped; the thread sleeps:
    the engine's events are blocking-sync ones). An event's error propagates."""
    for e in events:
        if e is not None:
            e.synchronize()


def _drop_done(events: list[Any]) -> None:
    """Removes completed events from a list in place, leaving any appended meanwhile (the engine appends to
    a region's list from C code, outside the arena's lock). Under capture nothing is queried."""
    if events and not _capture.capturing():
        for e in [e for e in events if _done(e)]:
            events.remove(e)


_DEFAULT_LEDGER_DIR = "/dev/shm"
_node_configured = False
_node_lock = _fork.new_lock()
_logged_notes: set[str] = set()


def node_budget_from_env() -> tuple[Optional[int], str]:
    """GPU_OFFLOAD_NODE_MAX_BYTES (bytes, or a fraction of the host's memory: MemTotal, or the memory
    cgroup's limit where one applies) and GPU_OFFLOAD_LEDGER_DIR, as the arenas read them."""
    text = os.environ.get("GPU_OFFLOAD_NODE_MAX_BYTES")
    directory = os.environ.get("GPU_OFFLOAD_LEDGER_DIR") or _DEFAULT_LEDGER_DIR
    if text is None or text == "":
        return None, directory
    budget = parse_bytes_or_fraction(text, "GPU_OFFLOAD_NODE_MAX_BYTES", int(_C.host_memory_limit()))
    if not os.path.isdir(directory):
        raise OffloadError(f"GPU_OFFLOAD_LEDGER_DIR={directory!r} is not a folder: the node's ledger (what every "
                           "process of the node has pinned) lives there; name a folder all of them can write")
    return budget, directory


def _configure_node() -> None:
    """Tells the core the node's budget and where its ledger is: once per process, before the first slab."""
    global _node_configured
    if _node_configured:
        return
    with _node_lock:
        if not _node_configured:
            budget, directory = node_budget_from_env()
            _C.node_ledger_configure(directory, budget or 0)
            if budget:
                logger.debug("node host-memory budget %d bytes, ledger in %s", budget, directory)
            _node_configured = True


def _log_notes(notes: Sequence[str]) -> None:
    """The core's notes (a slab that could not be placed on its node), one log line per kind."""
    for note in notes:
        kind = re.sub(r"[0-9]+ bytes \([^)]*\)|[0-9]+ of [0-9]+", "", note)
        if kind not in _logged_notes:
            _logged_notes.add(kind)
            logger.warning("%s", note)


def _env_arena_bytes(name: str) -> Optional[int]:
    """GPU_OFFLOAD_ARENA_MAX_BYTES or GPU_OFFLOAD_MIN_SLAB_BYTES: a positive whole number of bytes, or None
    when unset; refused naming the variable otherwise."""
    try:
        value = _env_int(name)
    except OffloadError as exc:
        text = os.environ.get(name, "")
        if name == "GPU_OFFLOAD_ARENA_MAX_BYTES" and re.fullmatch(r"\s*[0-9]*\.[0-9]+\s*", text):
            raise OffloadError(f"{exc}; a cap that is a fraction of the node's memory is GPU_OFFLOAD_NODE_MAX_BYTES "
                               f"(e.g. GPU_OFFLOAD_NODE_MAX_BYTES={text.strip()}), one budget for every process of "
                               "the node") from None
        raise
    if value == 0:
        raise OffloadError(f"{name}={os.environ.get(name)!r} must be positive (unset it for "
                           f"{'no cap' if name == 'GPU_OFFLOAD_ARENA_MAX_BYTES' else 'the default'})")
    return value


class Region:
    """A block of arena memory shared by the storages of one snapshot or one offload.

    Released when its last user lets go; copies still reading or writing it (their events) are waited
    for lazily, so releasing never blocks the caller. The region owns its memory from the moment the
    arena hands it out: one dropped without being released (an interrupt between the allocation and the
    code that would release it) returns its memory at the arena's next call after it is garbage collected.
    """

    __slots__ = ("arena", "_box", "nbytes", "_users", "_pending", "__weakref__")

    def __init__(self, arena: "Arena", nbytes: int, users: int = 1) -> None:
        self._pending: list[Any] = []  # copies known to use the region, for a region freed by the collector
        self.arena = arena
        self.nbytes = nbytes
        self._users = users
        self._box: list[int] = []  # the pointer, once allocated (a list so that C code can fill it, see _allocate)

    @property
    def ptr(self) -> int:
        if self.arena._left_in_parent:
            raise OffloadError(_LEFT_IN_PARENT)
        return self._box[0]

    def release(self, pending: Sequence[Any] = (), count: int = 1) -> None:
        """Drops one user (or `count`); the last one returns the memory once `pending` events have completed."""
        with self.arena._lock:
            self._users -= count
            if self._users > 0:
                # Kept for the last user: e.g. a freed snapshot's restores, while views still hold it.
                # (Completed copies are dropped: a snapshot restored every step keeps no growing list.)
                _drop_done(self._pending)
                known = {id(e) for e in self._pending}
                self._pending.extend(e for e in pending if e is not None and id(e) not in known)
                return
            self.arena._free_box(self._box, list(self._pending) + list(pending))

    def release_all(self, pending: Sequence[Any] = ()) -> None:
        """Returns the memory whatever the number of users (a failed offload gives its region back)."""
        with self.arena._lock:
            if self._users <= 0:
                return
            self._users = 0
            self.arena._free_box(self._box, list(self._pending) + list(pending))

    @property
    def in_use(self) -> bool:
        """True until the last user has released the region."""
        return self._users > 0

    def acquire(self, owner: Any = None, attr: str = "region") -> bool:
        """Adds a user (a copy about to read the region, views over it); False once it was released.

        With an owner, the user is handed to it (`owner.<attr> = region`) in the same step, with no
        interpreter step between the count and the store where an interrupt could fall and lose it.
        """
        with self.arena._lock:
            if self._users <= 0:
                return False
            self._users += 1
            if owner is not None:
                setattr(owner, attr, self)
            return True

    def _drop(self, holder: Any, attr: str = "region", pending: Sequence[Any] = ()) -> None:
        """Ends the user that `holder.<attr>` holds (a lease, a snapshot), at most once however often it is
        called (release(), then a finalizer): the count and the holder's reference go in one step, with no
        interpreter step between them where an interrupt could fall."""
        with self.arena._lock:
            if getattr(holder, attr, None) is not self:
                return
            # Kept first for the last user (e.g. a freed snapshot's restores, while views still hold it);
            # completed copies are dropped, so a snapshot restored every step keeps no growing list.
            # (In place: the engine appends to this list from C code as it enqueues.)
            _drop_done(self._pending)
            known = {id(e) for e in self._pending}
            self._pending.extend(e for e in pending if e is not None and id(e) not in known)
            self._users -= 1
            setattr(holder, attr, None)
            if self._users <= 0:
                self.arena._free_box(self._box, list(self._pending))

    def buffer(self, owner: object) -> Any:
        """A writable buffer over the region that keeps `owner` alive while anything (e.g. a tensor made
        with torch.frombuffer) still refers to it."""
        buf = (ctypes.c_char * self.nbytes).from_address(self.ptr)
        buf._owner = owner  # type: ignore[attr-defined]
        return buf


class Lease:
    """One user of a region, owned from the moment it exists (`Region.acquire(lease)` counts the user and
    stores the region here in one step), released once: by `release()`, or when the lease is dropped (an
    interrupt between the acquisition and the code that would release it). Reads like the region for the
    copy that holds it (`ptr`, `buffer`); copies it should outlive go to `release(pending)`.
    """

    __slots__ = ("region", "pending", "__weakref__")

    def __init__(self) -> None:
        self.region: Optional[Region] = None
        self.pending: list[Any] = []  # recorded before the release, so that a finalizer still waits for them

    @property
    def ptr(self) -> int:
        region = self.region
        if region is None:
            raise OffloadError("internal error: a released lease on an arena region was used")
        return region.ptr

    def buffer(self, owner: object) -> Any:
        region = self.region
        if region is None:
            raise OffloadError("internal error: a released lease on an arena region was used")
        return region.buffer(owner)

    def release(self, pending: Sequence[Any] = ()) -> None:
        self.pending.extend(pending)
        region = self.region
        if region is not None:
            region._drop(self, "region", self.pending)

    def __del__(self) -> None:
        region = getattr(self, "region", None)
        if region is not None:
            region._drop(self, "region", self.pending)


class Arena:
    """Pinned host memory for snapshots and offloads.

    Memory is page-locked (when a CUDA device answers) in large slabs, on first need, and reused: after
    the first cycle a training loop pins nothing more. Regions are best-fit with coalescing.

    Args:
        max_bytes: hard cap on the pinned bytes, an int or a string with a unit ("8GiB", "512MiB", "2GB");
            a request past it raises OffloadError. None: no cap (pinning beyond the machine's available
            memory is still refused).
        min_slab_bytes: the size shared slabs grow to (default 256 MiB; an int or a string with a unit). A
            region that fits in no free block gets a slab of its own size (rounded to 4 KiB, to 2 MiB from
            256 MiB on), or, when it is under 1/64 of the arena so far, a shared slab as large as the arena
            (doubling it) up to this size: a first small snapshot pins a few pages, not 256 MiB.
        pin: "auto" (page-locked when CUDA is available), "none", "hostalloc" (cudaHostAlloc) or
            "register" (parallel first touch, then cudaHostRegister; the fastest way to pin).
    """

    def __init__(self, max_bytes: Union[int, str, None] = None, *, min_slab_bytes: Union[int, str, None] = None,
                 pin: str = "auto") -> None:
        max_bytes = _size(max_bytes, "max_bytes")
        min_slab_bytes = _size(min_slab_bytes, "min_slab_bytes")
        if max_bytes is not None and (not isinstance(max_bytes, int) or isinstance(max_bytes, bool) or
                                      not 0 < max_bytes <= MAX_BYTES):
            raise OffloadError(f"max_bytes must be an int from 1 to 2**63-1 or None, got {max_bytes!r}")
        if min_slab_bytes is None:
            min_slab_bytes = _DEFAULT_MIN_SLAB_BYTES
        if not isinstance(min_slab_bytes, int) or isinstance(min_slab_bytes, bool) or not 0 < min_slab_bytes <= MAX_BYTES:
            raise OffloadError(f"min_slab_bytes must be an int from 1 to 2**63-1, got {min_slab_bytes!r}")
        if pin not in _PIN_MODES:
            raise OffloadError(f"pin must be one of {', '.join(_PIN_MODES)}, got {pin!r}")
        if max_bytes is not None:
            min_slab_bytes = min(min_slab_bytes, max_bytes)
        _configure_node()  # GPU_OFFLOAD_NODE_MAX_BYTES is checked (and refused) here, before any slab
        self._impl = _C.HostArena(max_bytes or 0, min_slab_bytes, pin)
        self._lock = _fork.new_lock(reentrant=True)
        self._deferred: list[tuple[list[int], list[Any]]] = []  # regions waiting for their copies to finish
        # Every region handed out, by the id of a weak reference to it: (reference, its box, its events). A
        # region dropped unreleased is found through _dead, where the reference's callback (deque.append, C
        # code: no interpreter step an interrupt could fall into, unlike a __del__) puts it when the region
        # is collected; the next call of the arena frees what its box still holds (see _reap).
        self._owned: dict[int, tuple["weakref.ref[Region]", list[int], list[Any]]] = {}
        self._dead: "collections.deque[weakref.ref[Region]]" = collections.deque()
        self._left_in_parent = False  # in a forked child: the pinned slabs were not inherited
        _live.add(self)

    # -- public ---------------------------------------------------------------------------------------
    @property
    def capacity_bytes(self) -> int:
        """Bytes of host memory the arena holds (pinned where pinning is on)."""
        return int(self._impl.stats()["capacity_bytes"])

    @property
    def used_bytes(self) -> int:
        """Bytes handed out to live snapshots and offloaded storages (alignment included)."""
        self._reap(block=False)
        return int(self._impl.stats()["used_bytes"])

    @property
    def max_bytes(self) -> Optional[int]:
        cap = int(self._impl.stats()["max_bytes"])
        return cap or None

    @property
    def pin_mode(self) -> str:
        """How slabs are pinned: auto (not decided yet), none, hostalloc or register."""
        return str(self._impl.pin_mode)

    def reserve(self, num_bytes: Union[int, str], device: Any = None) -> None:
        """Pins ahead so that a region of `num_bytes` (an int, or a string with a unit: "8GiB") can later be
        handed out without pinning; for a CUDA `device` (a torch.device, "cuda:1"), on that GPU's NUMA node."""
        num_bytes = _size(num_bytes, "num_bytes")
        if not isinstance(num_bytes, int) or not 0 <= num_bytes <= MAX_BYTES:  # past it the core's sizes wrap
            raise OffloadError(f"num_bytes must be an int from 0 to 2**63-1, got {num_bytes!r}")
        if num_bytes:
            self._reap(block=False)
            node = _topology.numa_node_for([_as_device(device)]) if device is not None else _topology.UNKNOWN
            try:
                self._impl.reserve(num_bytes, node)
            finally:
                _log_notes(self._impl.take_notes())

    def trim(self) -> int:
        """Returns slabs with nothing in them to the system; returns the bytes released."""
        self._reap(block=True)
        return int(self._impl.trim())

    def _slabs_made(self) -> int:
        """Slabs created so far (their numbers, in creation order): for _trim_since."""
        return int(self._impl.stats()["num_slab_allocations"])

    def _trim_since(self, slabs_made: int) -> int:
        """Returns to the system the empty slabs created since _slabs_made() said `slabs_made` (what one call
        pinned for itself), keeping the older ones (reserve()); the bytes released."""
        self._reap(block=True)
        return int(self._impl.trim(slabs_made))

    def stats(self) -> dict[str, Any]:
        """Capacity, use, slab count, free blocks, slabs ever pinned, seconds spent pinning, and the
        capacity by the NUMA node its pages are on (`bytes_by_numa_node`, -1: unknown); `max_bytes` is None
        for an arena without a cap."""
        self._reap(block=False)
        stats = dict(self._impl.stats())
        stats["max_bytes"] = stats["max_bytes"] or None
        stats["pin_mode"] = self.pin_mode
        return stats

    def __reduce__(self) -> Any:
        raise TypeError("a gpu_offload.Arena cannot be pickled: it is this process's pinned host memory; "
                        "make a new Arena in the other process")

    def __repr__(self) -> str:
        s = self._impl.stats()
        return (f"Arena(used_bytes={s['used_bytes']}, capacity_bytes={s['capacity_bytes']}, "
                f"max_bytes={s['max_bytes'] or None}, pin_mode={self.pin_mode!r})")

    # -- used by the engine ---------------------------------------------------------------------------
    def _allocate(self, num_bytes: int, users: int = 1, devices: Iterable[Any] = (),
                  numa_node: Optional[int] = None) -> Region:
        """A region of num_bytes for a call on `devices` (its slab on the first GPU's NUMA node, or on
        `numa_node` when given)."""
        if self._left_in_parent:
            raise OffloadError(_LEFT_IN_PARENT)
        self._reap(block=False)
        node = _topology.numa_node_for(devices) if numa_node is None else numa_node
        # The region exists before its memory: C code (map, extend) stores the pointer in it, so no
        # interrupt can fall between the allocation and its owner (the allocation releases the GIL, and
        # a signal handler runs as soon as it returns).
        region = Region(self, num_bytes, users)
        ref = weakref.ref(region, self._dead.append)
        self._owned[id(ref)] = (ref, region._box, region._pending)  # before the memory: nothing to lose before
        try:
            region._box.extend(map(self._impl.allocate, (num_bytes,), (node,)))
        except OffloadError:
            # Regions still waiting on in-flight copies may be what stands in the way: wait, then retry.
            if not self._deferred and not self._dead:
                raise
            self._reap(block=True)
            region._box.extend(map(self._impl.allocate, (num_bytes,), (node,)))
        finally:
            notes = self._impl.take_notes()
            if notes:
                _log_notes(notes)
        return region

    def _free_box(self, box: list[int], pending: Sequence[Any]) -> None:
        """Returns a region's memory (now, or once `pending` copies finished). The pointer leaves the
        region's box inside C code (map, list.pop), so an interrupt can neither lose it nor free it twice."""
        if _capture.capturing():  # no query may run in a capturing thread: defer all, reap later
            events = [e for e in pending if e is not None]
        else:
            events = [e for e in pending if e is not None and not _done(e)]
        with self._lock:
            if not box:
                return
            if events:
                moved: list[int] = []
                self._deferred.append((moved, events))
                moved.extend(map(list.pop, [box]))
            else:
                self._free_now(box)

    def _free_now(self, box: list[int]) -> None:
        collections.deque(map(self._impl.free, map(list.pop, [box])), maxlen=0)

    def _reap(self, block: bool) -> None:
        if _retired:
            _reap_retired()
        with self._lock:
            # Regions collected since the last call: free what their boxes still hold. Each step can be
            # interrupted and done again (an empty box frees nothing), and a region collected meanwhile is
            # appended behind the one being looked at.
            while self._dead:
                key = id(self._dead[0])
                entry = self._owned.get(key)
                if entry is not None:
                    self._free_box(entry[1], entry[2])
                    del self._owned[key]
                self._dead.popleft()
            if not self._deferred or _capture.capturing():
                return
            still: list[tuple[list[int], list[Any]]] = []
            for box, events in self._deferred:
                if block:
                    for e in events:
                        try:
                            e.synchronize()
                        except Exception:  # judged by _done below: the region stays deferred
                            pass
                if all(map(_done, events)):
                    if box:
                        self._free_now(box)
                else:
                    still.append((box, events))
            self._deferred[:] = still

    def __del__(self) -> None:
        # Regions freed lazily may still be read or written by copies in flight: their slabs must outlive
        # those copies (unpinning or unmapping memory under DMA corrupts it or faults the device). An arena
        # dropped with such frees pending hands its C++ arena to _retired, released once they completed.
        impl = getattr(self, "_impl", None)
        deferred: list[tuple[list[int], list[Any]]] = getattr(self, "_deferred", [])
        # Regions collected with the arena (one reference cycle) or since its last call: their copies too.
        orphans = [(box, events) for _, box, events in getattr(self, "_owned", {}).values() if box]
        if impl is not None and (deferred or orphans):
            _retired.append((impl, deferred, orphans))


# Arenas dropped while copies still used some of their regions: (C++ arena, deferred, orphans), the lists
# themselves. Appended to by Arena.__del__ only (which may run inside any allocation); reaped by any arena's
# next call and, at exit, after waiting for the copies.
_retired: list[tuple[Any, list[tuple[list[int], list[Any]]], list[tuple[list[int], list[Any]]]]] = []


def _reap_retired(block: bool = False) -> None:
    """Releases the memory of dropped arenas whose copies have all completed (block: waits for them first)."""
    for _ in range(len(_retired)):
        try:
            entry = _retired.pop(0)
        except IndexError:  # another thread took the last one
            return
        events = [e for _, evs in (*entry[1], *entry[2]) for e in evs if e is not None]
        if block and not _capture.capturing():
            for e in events:
                try:
                    e.synchronize()
                except Exception:
                    pass
        if not _capture.capturing() and all(map(_done, events)):
            continue  # dropped here: the C++ arena unpins and unmaps its slabs
        _retired.append(entry)


def _drain_at_exit() -> None:
    # Before the interpreter tears the arenas down: their slabs must not be unpinned under copies in flight.
    try:
        for arena in list(_live):
            arena._reap(block=True)
        _reap_retired(block=True)
    except Exception:  # interpreter shutdown: nothing left to report to
        pass


_live: "weakref.WeakSet[Arena]" = weakref.WeakSet()
atexit.register(_drain_at_exit)


def _as_device(device: Any) -> Any:
    import torch

    return torch.device(device) if isinstance(device, str) else device


_default_arena: Optional[Arena] = None
_default_lock = _fork.new_lock()

# -- fork ---------------------------------------------------------------------------------------------------
_LEFT_IN_PARENT = ("this arena's memory is pinned and stayed in the parent process: a forked child does not inherit "
                   "pinned slabs (MADV_DONTFORK), nor the snapshots and offloaded state in them; use a new Arena "
                   "in the child (the default arena is a new one there)")


def _after_fork_in_child() -> None:
    """Arenas whose memory the child did not inherit refuse every use; the default arena starts afresh."""
    global _default_arena
    for arena in list(_live):
        if arena._impl.pin_mode in ("hostalloc", "register") and int(arena._impl.stats()["capacity_bytes"]):
            arena._left_in_parent = True
    if _default_arena is not None and _default_arena._left_in_parent:
        _default_arena = None


_fork.in_child(_after_fork_in_child)


def default_arena() -> Arena:
    """The arena shared by every call that names none; created on first use.

    Configured from the environment: GPU_OFFLOAD_ARENA_MAX_BYTES (cap), GPU_OFFLOAD_MIN_SLAB_BYTES,
    GPU_OFFLOAD_PIN (auto, none, hostalloc, register). Every arena, this one or not, also answers to the
    node's budget (GPU_OFFLOAD_NODE_MAX_BYTES, GPU_OFFLOAD_LEDGER_DIR).
    """
    global _default_arena
    with _default_lock:
        if _default_arena is None:
            _default_arena = Arena(
                _env_arena_bytes("GPU_OFFLOAD_ARENA_MAX_BYTES"),
                min_slab_bytes=_env_arena_bytes("GPU_OFFLOAD_MIN_SLAB_BYTES"),
                pin=os.environ.get("GPU_OFFLOAD_PIN", "auto"),
            )
            logger.debug("default arena created: %r", _default_arena)
            for line in _env.describe_unknown():  # a typo (GPU_OFFLOAD_MAX_BYTES) is otherwise ignored unseen
                logger.warning("%s", line)
        return _default_arena


def memory_stats() -> dict[str, Any]:
    """Host memory this process and the node's processes hold, as the arenas see it.

    Returns a dict:
        "process": this process's arenas: `pinned_bytes` (page-locked), `registered_bytes` (the part pinned
            with cudaHostRegister), `pageable_bytes` (slabs not page-locked), `bytes_by_numa_node` (node ->
            bytes, -1 where the kernel does not say), and the default arena's `used_bytes`,
            `capacity_bytes` and `largest_free_bytes` (0 before it is first used);
        "node": `max_bytes` (GPU_OFFLOAD_NODE_MAX_BYTES, or None), `reserved_bytes` (by every live process
            of the node that has a budget), `by_pid` (PID -> bytes, largest first) and `ledger` (the file);
        "memlock_limit_bytes": the soft `ulimit -l` (None: unlimited).
    """
    _configure_node()
    process: dict[str, Any] = dict(_C.process_host_memory())
    arena = _default_arena
    stats = arena._impl.stats() if arena is not None else {}
    process["used_bytes"] = int(stats.get("used_bytes", 0))
    process["capacity_bytes"] = int(stats.get("capacity_bytes", 0))
    process["largest_free_bytes"] = int(stats.get("largest_free_block_bytes", 0))
    state = _C.node_ledger_state()
    node = {
        "max_bytes": int(state["max_bytes"]) or None,
        "reserved_bytes": int(state["reserved_bytes"]),
        "by_pid": {int(pid): int(n) for pid, n in sorted(state["by_pid"].items(), key=lambda kv: -kv[1])},
        "ledger": state["path"] or None,
    }
    soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return {"process": process, "node": node,
            "memlock_limit_bytes": None if soft == resource.RLIM_INFINITY else int(soft)}
