"""Arena: pinned host memory, pinned once and reused by every snapshot and offload that uses it."""

from __future__ import annotations

import collections
import ctypes
import logging
import os
import threading
from typing import Any, Optional, Sequence, Union

from . import _env
from ._bytes import parse_bytes
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


class Region:
    """A block of arena memory shared by the storages of one snapshot or one offload.

    Released when its last user lets go; copies still reading or writing it (their events) are waited
    for lazily, so releasing never blocks the caller. The region owns its memory from the moment the
    arena hands it out: one dropped without being released (an interrupt between the allocation and the
    code that would release it) returns its memory when it is garbage collected.
    """

    __slots__ = ("arena", "_box", "nbytes", "_users", "_pending")

    def __init__(self, arena: "Arena", nbytes: int, users: int = 1) -> None:
        self._pending: list[Any] = []  # copies known to use the region, for a region freed by the collector
        self.arena = arena
        self.nbytes = nbytes
        self._users = users
        self._box: list[int] = []  # the pointer, once allocated (a list so that C code can fill it, see _allocate)

    @property
    def ptr(self) -> int:
        return self._box[0]

    def release(self, pending: Sequence[Any] = (), count: int = 1) -> None:
        """Drops one user (or `count`); the last one returns the memory once `pending` events have completed."""
        with self.arena._lock:
            self._users -= count
            if self._users > 0:
                # Kept for the last user: e.g. a freed snapshot's restores, while views still hold it.
                # (Completed copies are dropped: a snapshot restored every step keeps no growing list.)
                self._pending = [e for e in self._pending if not e.query()]
                known = {id(e) for e in self._pending}
                self._pending.extend(e for e in pending if e is not None and id(e) not in known and not e.query())
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

    def acquire(self) -> bool:
        """Adds a user (a copy about to read the region, views over it); False once it was released."""
        with self.arena._lock:
            if self._users <= 0:
                return False
            self._users += 1
            return True

    def buffer(self, owner: object) -> Any:
        """A writable buffer over the region that keeps `owner` alive while anything (e.g. a tensor made
        with torch.frombuffer) still refers to it."""
        buf = (ctypes.c_char * self.nbytes).from_address(self.ptr)
        buf._owner = owner  # type: ignore[attr-defined]
        return buf

    def __del__(self) -> None:
        # Owned memory nobody released: hand it back at the arena's next call (not here: a collector
        # run may interrupt the arena's own bookkeeping).
        box = getattr(self, "_box", None)  # None: interrupted in __init__, before any memory
        if box:
            self.arena._orphans.append((box, list(self._pending)))


class Arena:
    """Pinned host memory for snapshots and offloads.

    Memory is page-locked (when a CUDA device answers) in large slabs, on first need, and reused: after
    the first cycle a training loop pins nothing more. Regions are best-fit with coalescing.

    Args:
        max_bytes: hard cap on the pinned bytes, an int or a string with a unit ("8GiB", "512MiB", "2GB");
            a request past it raises OffloadError. None: no cap (pinning beyond the machine's available
            memory is still refused).
        min_slab_bytes: smallest slab pinned at a time (default 256 MiB; an int or a string with a unit);
            a larger request gets a slab of its own size, rounded to 2 MiB.
        pin: "auto" (page-locked when CUDA is available), "none", "hostalloc" (cudaHostAlloc) or
            "register" (parallel first touch, then cudaHostRegister; the fastest way to pin).
    """

    def __init__(self, max_bytes: Union[int, str, None] = None, *, min_slab_bytes: Union[int, str, None] = None,
                 pin: str = "auto") -> None:
        max_bytes = _size(max_bytes, "max_bytes")
        min_slab_bytes = _size(min_slab_bytes, "min_slab_bytes")
        if max_bytes is not None and (not isinstance(max_bytes, int) or max_bytes <= 0):
            raise OffloadError(f"max_bytes must be a positive int or None, got {max_bytes!r}")
        if min_slab_bytes is None:
            min_slab_bytes = _DEFAULT_MIN_SLAB_BYTES
        if not isinstance(min_slab_bytes, int) or min_slab_bytes <= 0:
            raise OffloadError(f"min_slab_bytes must be a positive int, got {min_slab_bytes!r}")
        if pin not in _PIN_MODES:
            raise OffloadError(f"pin must be one of {', '.join(_PIN_MODES)}, got {pin!r}")
        if max_bytes is not None:
            min_slab_bytes = min(min_slab_bytes, max_bytes)
        self._impl = _C.HostArena(max_bytes or 0, min_slab_bytes, pin)
        self._lock = threading.RLock()
        self._deferred: list[tuple[list[int], list[Any]]] = []  # regions waiting for their copies to finish
        self._orphans: list[tuple[list[int], list[Any]]] = []  # regions dropped unreleased (Region.__del__)

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

    def reserve(self, num_bytes: Union[int, str]) -> None:
        """Pins ahead so that a region of `num_bytes` (an int, or a string with a unit: "8GiB") can later be
        handed out without pinning."""
        num_bytes = _size(num_bytes, "num_bytes")
        if not isinstance(num_bytes, int) or num_bytes < 0:
            raise OffloadError(f"num_bytes must be a non-negative int, got {num_bytes!r}")
        if num_bytes:
            self._reap(block=False)
            self._impl.reserve(num_bytes)

    def trim(self) -> int:
        """Returns slabs with nothing in them to the system; returns the bytes released."""
        self._reap(block=True)
        return int(self._impl.trim())

    def stats(self) -> dict[str, Any]:
        """Capacity, use, slab count, free blocks, slabs ever pinned and seconds spent pinning; `max_bytes` is
        None for an arena without a cap."""
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
    def _allocate(self, num_bytes: int, users: int = 1) -> Region:
        self._reap(block=False)
        # The region exists before its memory: C code (map, extend) stores the pointer in it, so no
        # interrupt can fall between the allocation and its owner (the allocation releases the GIL, and
        # a signal handler runs as soon as it returns).
        region = Region(self, num_bytes, users)
        try:
            region._box.extend(map(self._impl.allocate, (num_bytes,)))
        except OffloadError:
            # Regions still waiting on in-flight copies may be what stands in the way: wait, then retry.
            if not self._deferred and not self._orphans:
                raise
            self._reap(block=True)
            region._box.extend(map(self._impl.allocate, (num_bytes,)))
        return region

    def _free_box(self, box: list[int], pending: Sequence[Any]) -> None:
        """Returns a region's memory (now, or once `pending` copies finished). The pointer leaves the
        region's box inside C code (map, list.pop), so an interrupt can neither lose it nor free it twice."""
        events = [e for e in pending if e is not None and not e.query()]
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
        with self._lock:
            while self._orphans:
                box, events = self._orphans.pop()
                self._free_box(box, events)
            if not self._deferred:
                return
            still: list[tuple[list[int], list[Any]]] = []
            for box, events in self._deferred:
                if block:
                    for e in events:
                        e.synchronize()
                if all(e.query() for e in events):
                    if box:
                        self._free_now(box)
                else:
                    still.append((box, events))
            self._deferred = still


_default_arena: Optional[Arena] = None
_default_lock = threading.Lock()


def default_arena() -> Arena:
    """The arena shared by every call that names none; created on first use.

    Configured from the environment: GPU_OFFLOAD_ARENA_MAX_BYTES (cap), GPU_OFFLOAD_MIN_SLAB_BYTES,
    GPU_OFFLOAD_PIN (auto, none, hostalloc, register).
    """
    global _default_arena
    with _default_lock:
        if _default_arena is None:
            _default_arena = Arena(
                _env_int("GPU_OFFLOAD_ARENA_MAX_BYTES"),
                min_slab_bytes=_env_int("GPU_OFFLOAD_MIN_SLAB_BYTES"),
                pin=os.environ.get("GPU_OFFLOAD_PIN", "auto"),
            )
            logger.debug("default arena created: %r", _default_arena)
            for line in _env.describe_unknown():  # a typo (GPU_OFFLOAD_MAX_BYTES) is otherwise ignored unseen
                logger.warning("%s", line)
        return _default_arena
