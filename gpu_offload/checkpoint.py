"""Staging for torch.distributed.checkpoint through the arena: `ArenaStager`.

`dcp.async_save` first stages the state dict (a copy in host memory that training cannot change), then
writes the copy from a background thread. `ArenaStager` stages with one batched, stream-ordered snapshot
into the pinned arena (every tensor of the state dict at once, DTensor local shards included): the arena
is pinned once, by the first checkpoint, and every later one copies into the same memory:

    from gpu_offload.checkpoint import ArenaStager

    stager = ArenaStager()
    future = dcp.async_save(state_dict, checkpoint_id=path, async_stager=stager)
    ...                                   # training goes on while the checkpoint is written
    future.result()
    stager.close()

Lifetime: the staged tensors view an arena region, and the region goes back to the arena (never unpinned)
when DCP lets go of the staged state dict, i.e. when the write has finished (its future done and the
staged dict no longer referenced), so the next save reuses it. Supported by torch 2.11 to 2.13, whose
`async_save` calls `stage()` and, when that returns a state dict (not a future), `synchronize_staging()`
if `should_synchronize_after_execute`.
"""

from __future__ import annotations

import copy
import gc
import logging
from collections import OrderedDict
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Optional, Union

import torch

from . import _capture, _fork, api
from ._errors import OffloadError
from .arena import Arena, Region, default_arena
from .storages import PLAIN_TENSOR_TYPES

try:
    from torch.distributed.checkpoint.staging import AsyncStager
except ImportError as _exc:  # pragma: no cover - builds without torch.distributed
    raise ImportError("gpu_offload.checkpoint needs torch.distributed.checkpoint, which this torch build "
                      f"does not have ({_exc})") from None

logger = logging.getLogger("gpu_offload")

__all__ = ["ArenaStager", "flatten_state_dict"]

# Leaves that need no copy to be training-safe.
_IMMUTABLE = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size)


def flatten_state_dict(state_dict: Any) -> tuple[dict[str, torch.Tensor], Callable[[dict[str, torch.Tensor]], Any]]:
    """Splits a (nested) state dict into its tensors, by unique dotted name, and a function that builds a
    state dict of the same structure (dicts, lists, tuples) from tensors with those names. Non-tensor
    values are deep-copied into the rebuilt structure (so that training cannot change them before they are
    written), as DCP's own stager does."""
    if (type(state_dict) is dict and set(map(type, state_dict)) <= {str}
            and set(map(type, state_dict.values())) <= PLAIN_TENSOR_TYPES):
        # A flat dict of plain tensors (a model's state_dict()): its keys are the snapshot's names and the
        # staged dict is the snapshot's state_dict() itself, with no per-tensor work here.
        return state_dict, lambda staged: staged
    tensors: dict[str, torch.Tensor] = {}

    def name_for(path: str) -> str:
        # The snapshot names a tensor by its key with trailing dots stripped ("tensor" if empty): keep
        # names that it leaves as they are, and unique (a key with a dot in it may meet a nested path).
        base = path if path and not path.endswith(".") else f"{path}#"
        name, i = base, 1
        while name in tensors:
            name, i = f"{base}#{i}", i + 1
        return name

    def walk(obj: Any, path: str) -> Callable[[dict[str, torch.Tensor]], Any]:
        if isinstance(obj, torch.Tensor):
            name = name_for(path)
            tensors[name] = obj
            return lambda staged: staged[name]
        if isinstance(obj, Mapping):
            items = [(k, walk(v, f"{path}.{k}" if path else str(k))) for k, v in obj.items()]
            cls = type(obj) if type(obj) in (dict, OrderedDict) else dict
            return lambda staged: cls((k, f(staged)) for k, f in items)
        if isinstance(obj, (list, tuple)) and type(obj) in (list, tuple):
            parts = [walk(v, f"{path}.{i}" if path else str(i)) for i, v in enumerate(obj)]
            cls = type(obj)
            return lambda staged: cls(f(staged) for f in parts)
        value = obj if isinstance(obj, _IMMUTABLE) else copy.deepcopy(obj)
        return lambda staged: value

    build = walk(state_dict, "")
    return tensors, build


class ArenaStager(AsyncStager):
    """A DCP `AsyncStager` that stages through a gpu_offload arena: pass it as `async_stager=` to
    `torch.distributed.checkpoint.async_save`.

    `stage(state_dict)` copies every tensor of the state dict (plain tensors and the local shards of
    DTensors, on CUDA or the CPU, in nested dicts and lists) into one arena region with one batched
    snapshot, in stream order, and returns a state dict of the same structure whose tensors are host
    views of that region: DTensors come back as DTensors with the same mesh, placements and global shape
    (their local tensors on the host), so DCP writes each rank's shards as usual; non-tensor values are
    deep-copied. The region returns to the arena (it stays pinned) once DCP has finished with the staged
    state dict, and the next stage reuses it: in steady state nothing is pinned and host memory is
    bounded by the saves in flight.

    Args:
        arena: the arena to stage into (default: the shared default arena).
        overlap: return from `stage()` (and so from `async_save`) before the copy ends, with a future that
            completes when it has (DCP then returns an `AsyncSaveResponse` whose `staging_completion` is that
            moment). As with `snapshot(..., overlap=True)`, a forward and backward may run beside the copy
            and the next `optimizer.step()` waits for it on the GPU; anything else that changes the weights
            in place must call `gpu_offload.join()` first. Without overlap, `stage()` returns once the host
            copy is complete. On the CPU the copy is complete when `stage()` returns either way.

    Raises (from `stage`, before anything is written):
        OffloadError: a tensor on the meta device or of an unsupported kind, an offloaded tensor (reload
            it first), or the arena's cap or the machine's memory exceeded. The arena is then as it was.
    """

    def __init__(self, arena: Optional[Arena] = None, *, overlap: bool = False) -> None:
        if arena is not None and not isinstance(arena, Arena):
            raise OffloadError(f"ArenaStager: arena must be a gpu_offload.Arena or None, got {type(arena).__qualname__}")
        self._arena = arena
        self._overlap = bool(overlap)
        # async_save calls synchronize_staging() after stage() only for a stager that returns a state dict;
        # ours is complete by then, so there is nothing to wait for.
        self._synchronize_after_execute = False
        self._executor: Optional[ThreadPoolExecutor] = None
        self._pending: list[Future] = []  # overlapped stages not yet complete (futures; weakly held results)
        # The regions of this stager's stages, with their payload bytes: a staged dict's views hold its
        # region (not the Snapshot object), so a region in use is a staged dict still referenced.
        self._staged: list[tuple[Region, int]] = []
        self._lock = _fork.new_lock()
        self._closed = False

    # -- AsyncStager ------------------------------------------------------------------------------------
    @property
    def arena(self) -> Arena:
        return self._arena if self._arena is not None else default_arena()

    def stage(self, state_dict: Any) -> Union[Any, "Future[Any]"]:
        """Copies the state dict's tensors into the arena; returns the staged state dict (or, with
        overlap=True, a future of it). See the class docstring."""
        if self._closed:
            raise OffloadError("ArenaStager: stage() after close()")
        _capture.refuse("ArenaStager.stage")
        with self._lock:  # a finished stage's future holds its staged dict: let it go before allocating
            self._pending = [f for f in self._pending if not f.done()]
        self._reclaim()
        tensors, build = flatten_state_dict(state_dict)
        if not tensors:
            staged = build({})
            return _done(staged) if self._overlap else staged
        try:
            snap = api.snapshot(tensors, arena=self.arena, overlap=self._overlap)
        except OffloadError as exc:
            raise OffloadError(f"ArenaStager: cannot stage the state dict ({len(tensors)} tensors): {exc}") from exc
        with self._lock:
            self._staged = [(r, n) for r, n in self._staged if r.in_use] + [(snap._live(), snap.nbytes)]
        logger.debug("ArenaStager: staged %d tensors, %d storages, %d bytes", snap.num_tensors, snap.num_storages,
                     snap.nbytes)
        if not self._overlap:
            return build(snap.state_dict())
        if snap.done():  # the CPU path, or a copy already finished
            return _done(build(snap.state_dict()))
        with self._lock:
            if self._closed:  # close() ran meanwhile: no new thread after it (the snapshot is freed with `snap`)
                raise OffloadError("ArenaStager: stage() after close()")
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gpu_offload-stager")
            # The worker holds the snapshot only until the staged dict (whose views keep it) is built.
            future = self._executor.submit(lambda s=snap: build(s.state_dict()))
            del snap
            self._pending.append(future)
        return future

    def synchronize_staging(self) -> None:
        """Waits until every stage() of this stager has finished copying (a no-op without overlap, where
        stage() returns a complete copy)."""
        with self._lock:
            pending, self._pending = self._pending, []
        for f in pending:
            f.exception()  # waits; the error, if any, is the future's to report

    def close(self) -> None:
        """Waits for staging copies in flight, stops the stager's thread and drops everything the stager
        holds. The arena space of a save whose write is still running returns when that write finishes
        (DCP still reads it); the rest is back in the arena now. Idempotent."""
        self.synchronize_staging()
        with self._lock:
            self._closed = True
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True)
        self._reclaim()

    def _reclaim(self) -> None:
        """Frees the staged state dicts of earlier saves that only a reference cycle still holds. A failed
        write's exception holds its frames, and DCP's frames hold the exception (`all_reduce`), so after the
        caller drops the future and the exception only the cycle collector can free them, which many
        trainers turn off; it is run here, when this stager's staged memory is still held, so that the
        space is back before the stager takes more (at the next stage()) or lets go (close())."""
        with self._lock:
            held = any(r.in_use for r, _ in self._staged)
        if held:
            gc.collect()

    # -- introspection ----------------------------------------------------------------------------------
    @property
    def staged_bytes(self) -> int:
        """Payload bytes of the staged state dicts that are still referenced (by DCP or by the caller)."""
        with self._lock:
            return sum(n for r, n in self._staged if r.in_use)

    def __enter__(self) -> "ArenaStager":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"ArenaStager(overlap={self._overlap}, staged_bytes={self.staged_bytes}, arena={self.arena!r})"


def _done(value: Any) -> "Future[Any]":
    f: Future = Future()
    f.set_result(value)
    return f
