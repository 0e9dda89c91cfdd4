"""The public operations: snapshot, restore, offload, reload, is_offloaded.

Flow: target -> adapters (named tensors) -> storages (layout bound to live storages) -> cached copy plan
-> _C (arena region, batched copies). Everything is checked before the first byte moves.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Mapping
from typing import Any, Callable, Container, Iterator, Optional, Sequence

import torch

from . import _capture
from . import integrity as _integrity
from . import overlap as _overlap
from . import plan as _plan
from . import registry as _registry
from ._errors import OffloadError
from .adapters import gradient_tensors, named_tensors, shard_info
from .arena import Arena, Region, default_arena, wait_for
from .overlap import join
from .registry import Offloaded as _Offloaded
from .snapshot import Snapshot
from .storages import PLAIN_TENSOR_TYPES, UNREGROWABLE, bind, check_tensor, extent_problem, match, regrowable, unwrap

logger = logging.getLogger("gpu_offload")


def _log_rate(op: str, nbytes: int, start: float, num_tensors: int, num_storages: int, synchronous: bool) -> None:
    if logger.isEnabledFor(logging.DEBUG):
        seconds = time.perf_counter() - start
        rate = f", {nbytes / seconds / 1e9:.2f} GB/s" if synchronous and seconds > 0 else " (copies enqueued)"
        logger.debug("%s: %d tensors, %d storages, %d bytes in %.3f ms%s", op, num_tensors, num_storages, nbytes,
                     seconds * 1e3, rate)


def _resolve_live(target: Any, include_grads: bool, op: str, *, writes: bool = True,
                  hold: bool = False, bump_if: Optional[Callable[[_plan.TargetPlan], bool]] = None) -> _plan.Resolved:
    """The target's plan; refuses targets with offloaded storages or with memory released by someone else.
    Call with the registry lock held.

    writes: the call will write into the target's storages (FSDP units left unsharded are resharded
    first, so that a stale unsharded copy cannot shadow what is written). hold: the call resizes the live
    storages (offload) or keeps them alive past its return (an overlapped snapshot): a cached plan's check
    holds them for it. bump_if: resolve()'s (a cached plan it accepts has its versions bumped by its check).
    """
    named = named_tensors(target, include_grads=include_grads, reshard=writes)
    resolved = _plan.resolve(named, shard_info=lambda: shard_info(target, named), hold=hold, bump_if=bump_if)
    _refuse_offloaded(resolved, op)
    if not resolved.hit:
        problem = extent_problem(resolved.layout)
        if problem is not None:
            raise OffloadError(f"cannot {op}: {problem}")
    return resolved


def _refuse_offloaded(resolved: _plan.Resolved, op: str) -> None:
    problem = _offloaded_problem(resolved.plan)
    if problem is not None:
        raise OffloadError(f"cannot {op}: {problem}")


def _offloaded_problem(plan: _plan.TargetPlan) -> Optional[str]:
    """What of a plan's target is offloaded or released (the registry lock held), or None."""
    offloaded = plan.offloaded
    if offloaded is not None and 1 in offloaded.alive and _registry.registered(offloaded):  # through this plan
        return f"{offloaded.names[offloaded.alive.index(1)]} is offloaded; call gpu_offload.reload() first"
    # Nothing to look up in the common case of nothing offloaded; a plan found clear stays clear until
    # the next offload (only an offload makes a storage offloaded).
    if _registry.entries and plan.clear_of != _registry.generation:
        at = _registry.first_offloaded(plan.keys)
        if at is not None:
            return f"{plan.layout.storage_columns[0][at]} is offloaded; call gpu_offload.reload() first"
        plan.clear_of = _registry.generation
    if plan.released:  # emptied by an offload that is no longer registered, yet not reloaded
        name = plan.layout.storage_columns[0][plan.live[0]] if plan.live else "the target"
        return f"{name}: its memory was released and not brought back; reload it first"
    return None


def _empty_cache(devices: list[torch.device]) -> None:
    if any(d.type == "cuda" for d in devices) and torch.cuda.is_available():
        torch.cuda.empty_cache()


def snapshot(target: Any, *, include_grads: bool = False, arena: Optional[Arena] = None,
             checksum: bool = False, overlap: bool = False) -> Snapshot:
    """Copies the target's device state into pinned host memory, without changing the target.

    The copy is ordered after the work already enqueued on each device's current stream, and later work
    on that stream waits (on the GPU, not the CPU) until the copy has read the data: the snapshot is the
    state as of this call. Returns at once on a GPU; call `.wait()` for the host copy to be complete.
    CPU tensors are copied before this returns.

    Args:
        target: an nn.Module, an Optimizer, a Mapping of tensors, a tensor, or a list/tuple of these.
        include_grads: also copy parameters' `.grad` tensors (named "<param>.grad").
        arena: the arena to copy into (default: the shared default arena).
        checksum: also record a checksum of every storage, computed from the source as it is copied (on a
            GPU by a kernel enqueued just before the copy); `Snapshot.verify()`, `restore(verify=True)`
            and `load` check against it. See gpu_offload.integrity.
        overlap: let work enqueued after this call (a forward and backward, which read the parameters
            without changing them) run alongside the copy of the parameters and optimizer state instead of
            waiting for it. A forward does write module buffers in place (BatchNorm running statistics
            and num_batches_tracked, normalizers registered as buffers): those of the modules in the
            target are copied first, in a batch of their own that later work on the current stream does
            wait for (they are small). Tensors given in a Mapping are taken as the caller names them,
            not as buffers: snapshot the module itself if a forward writes some of them. The source
            storages are kept alive until the copy has read them. The next `optimizer.step()` of any
            optimizer, and any restore/offload/reload/swap, waits for the copy on the GPU first (each
            thread's current stream for itself), so the snapshot stays the state as of this call.
            Anything else that changes the parameters in place must call `gpu_offload.join()` on its
            stream first: an EMA update, Megatron's overlapped parameter all-gather, a manual
            `p.data.copy_()`. Gradients are written in place before the step (`GradScaler.unscale_`,
            `clip_grad_norm_`, the next backward), so `overlap=True` refuses `include_grads=True`.

    Raises:
        OffloadError: unsupported target or tensor, an offloaded target, `overlap=True` with
            `include_grads=True`, a current CUDA stream that is capturing a graph, or arena/host memory
            exhausted.
    """
    _capture.refuse("snapshot")
    if overlap and include_grads:
        raise OffloadError("snapshot(overlap=True) cannot include gradients: they are written in place "
                           "before the optimizer step (GradScaler.unscale_, clip_grad_norm_, the next "
                           "backward), which the overlap guard does not see; take the snapshot with "
                           "overlap=False, or without include_grads")
    start = time.perf_counter()
    arena = arena if arena is not None else default_arena()
    with _registry.lock:  # an offload in another thread cannot release the storages under the copy
        # (Overlapped: a cached target's check holds its storages, which the copies' bookkeeping keeps.)
        resolved = _resolve_live(target, include_grads, "snapshot", writes=False, hold=overlap)
        layout = resolved.layout
        if overlap:
            plans, buffers = resolved.plan.overlap_copies(_buffer_indices(target, resolved))
        else:
            plans, buffers = resolved.plan.copies(), None
        region = arena._allocate(layout.host_bytes, devices=layout.devices)
        try:
            # Integrity: the sums read the same data as the copy that follows (on a GPU: in stream order).
            sums = _integrity.compute(layout, resolved.plan.storage_ptrs) if checksum else None
            # Each event lands in the region's own list inside the call that enqueues its batch: whatever
            # interrupts this from here on, the region is not reused before the copy has written it.
            events = [] if buffers is None else buffers.run(True, region.ptr, record=(region._pending,))
            events += plans.run(True, region.ptr, stream_waits=not overlap, record=(region._pending,))
            snap = Snapshot(layout, region, events, sums, include_grads=include_grads)
        except BaseException as exc:
            region.release(_plan.enqueued(exc))  # copies another device enqueued finish first
            raise
    if overlap and events:
        try:
            # Later work does not wait for the copy: keep the sources alive until it has read them, and
            # tell the allocator in case someone releases their memory anyway (resize_(0)).
            _plan.mark_live_in_use(resolved, to_host=True)
            # (The storages the check held where it holds them: no Python object per storage.)
            _overlap.defer(events, resolved.held if resolved.held is not None else resolved.storages())
        except BaseException:
            snap.free()
            raise
    _log_rate("snapshot", layout.nbytes, start, layout.num_tensors, layout.num_storages, not events)
    snap._dtensor_specs = resolved.plan.dtensor_specs(resolved.wrapped)  # for Snapshot.state_dict() (DTensors wrapped again)
    if isinstance(target, torch.nn.Module):  # for save_state_dict: which names its state_dict() has
        snap._source = weakref.ref(target)
    return snap


def _modules_in(target: Any) -> Iterator[torch.nn.Module]:
    """The nn.Modules a target holds: itself, or in its lists, tuples and mappings (not submodules)."""
    if isinstance(target, torch.nn.Module):
        yield target
    elif isinstance(target, (list, tuple)):
        for item in target:
            yield from _modules_in(item)
    elif isinstance(target, Mapping) and not set(map(type, target.values())) <= PLAIN_TENSOR_TYPES:
        for value in target.values():
            yield from _modules_in(value)


def _buffer_indices(target: Any, resolved: _plan.Resolved) -> tuple[int, ...]:
    """The target's storages that hold buffers of its modules (a forward may write those in place)."""
    keys = {unwrap(b).untyped_storage()._cdata
            for module in _modules_in(target) for b in torch.nn.Module.buffers(module) if b is not None}
    if not keys:
        return ()
    return tuple(i for i, key in enumerate(resolved.plan.keys) if key in keys)


def restore(target: Any, snap: Snapshot, *, verify: bool = False) -> None:
    """Copies a snapshot back into the target's storages, in place.

    The target may be the object the snapshot was taken from or any target of the same layout (matched by
    names, e.g. a freshly built twin). Later work on the current stream sees the restored values.

    With `verify=True` (the snapshot must have checksums) the host copy is checked before anything is
    copied, and the restored storages are checked after the copy (on a GPU this waits for it).

    Raises:
        LayoutMismatchError: names, shapes, dtypes, devices or storage sizes differ (nothing is copied).
        OffloadError: the snapshot was freed, the target is offloaded, or the current CUDA stream is
            capturing a graph; with verify, a corrupt host copy (nothing is copied) or restored data that
            differs from the source (named in the message).
    """
    _capture.refuse("restore")
    if not isinstance(snap, Snapshot):
        raise OffloadError(f"restore needs a Snapshot, got {type(snap).__qualname__}")
    join()  # overlapped snapshots must have read the weights before they change
    start = time.perf_counter()
    snap._live()
    expected: Optional[list[int]] = None
    if verify:  # integrity: the host copy is checked before anything moves
        expected = snap.checksums
        if expected is None:
            raise OffloadError("restore(verify=True) needs a snapshot with checksums: take it with "
                               "snapshot(..., checksum=True)")
    with _registry.lock:  # an offload in another thread cannot release the storages under the copy
        # Autograd sees the in-place change, as with torch's own copy_: a backward through activations saved
        # before the restore raises instead of computing wrong gradients. Every version is bumped before the
        # copy, so that an interrupt landing right after it cannot leave written tensors unbumped (a failure in
        # between leaves them bumped and unchanged: a backward then refuses, it never computes wrong
        # gradients). A cached plan of the snapshot's own layout with nothing offloaded, where nothing is
        # verified (what can fail before the copy), is bumped by its check, in the same pass.
        resolved = _resolve_live(target, snap.include_grads, "restore", bump_if=None if verify else (
            lambda plan: plan.layout is snap.layout and _offloaded_problem(plan) is None))
        layout = resolved.layout
        mapping = match(snap.layout, layout)
        plans = resolved.plan.copies(None if mapping is None else list(map(snap.layout.storage_columns[3].__getitem__, mapping)))
        if verify:
            snap.verify()
        if not resolved.bumped:
            _plan.increment_version(resolved.tensors)
        # Ordered after the snapshot's own copy (on the GPU); the region has a user of its own for the copy,
        # so a free() from another thread cannot return it to the arena under the copy.
        region = snap._use()
        events: list[Any] = []
        try:
            # The region's list gets the event as the batch is enqueued: a free() cannot hand the region
            # out while this copy reads it, whatever interrupts the rest.
            events = plans.run(False, region.ptr, waits=snap._pending(), record=(region.pending,))
        except BaseException as exc:
            events = _plan.enqueued(exc)  # copies another device enqueued still read the region
            raise
        finally:
            snap._add_events(events)
            region.release(events)
    if expected is not None:  # integrity: and the restored device data after
        _integrity.verify_storages(layout, resolved.plan.storage_ptrs,
                                   expected if mapping is None else [expected[i] for i in mapping],
                                   "restored data differs from the snapshot's source")
    _log_rate("restore", layout.nbytes, start, layout.num_tensors, layout.num_storages, not events)


GRADS_POLICIES = ("keep", "copy", "drop")


def _grads_policy(grads: str, include_grads: bool) -> str:
    if grads not in GRADS_POLICIES:
        raise OffloadError(f"grads={grads!r}: expected one of {', '.join(map(repr, GRADS_POLICIES))}")
    if include_grads and grads == "drop":
        raise OffloadError("include_grads=True copies the gradients and grads='drop' releases them: pass one")
    return "copy" if include_grads else grads


def _modules_and_optimizers(target: Any) -> bool:
    """Whether a target is modules and torch optimizers only (itself, or a list, tuple or mapping of them):
    read without gradients, none of its tensors is some tensor's .grad."""
    items = target.values() if isinstance(target, Mapping) else target if isinstance(target, (list, tuple)) else (target,)
    return all(isinstance(x, (torch.nn.Module, torch.optim.Optimizer)) for x in items)


def _grads_to_drop(grads: Sequence[tuple[str, torch.Tensor]],
                   state: Container[int]) -> list[tuple[int, torch.UntypedStorage, str]]:
    """The gradient storages that hold memory and are not part of the state (storage keys `state`): (key,
    storage, name). Checked before anything moves (call with the registry lock held)."""
    out: list[tuple[int, torch.UntypedStorage, str]] = []
    seen: set[int] = set()
    for name, t in grads:
        plain = check_tensor(name, t)
        storage = plain.untyped_storage()
        key = storage._cdata
        # Never a storage the state shares (it is copied), nor one offloaded or dropped already.
        if key in state or key in seen or key in _registry.entries or storage.nbytes() == 0:
            continue
        seen.add(key)
        if not regrowable(storage):
            raise OffloadError(f"cannot drop {name}: {UNREGROWABLE}")
        out.append((key, storage, name))
    return out


def _drop_plan(grads: Any, state: _plan.TargetPlan) -> Optional[_plan.Resolved]:
    """The gradients' own plan, their storages held, where a drop can release all of its live storages in
    one pass (the helper recorded them, each resizable, none shared with the state, none offloaded or
    dropped already); None: the one-by-one way (call with the registry lock held)."""
    if not _plan.recording():
        return None
    try:
        resolved = _plan.resolve(grads, hold=True)
    except OffloadError:  # (the one-by-one way says what is wrong)
        return None
    plan = resolved.plan
    if plan.record is None or not plan.live or plan.released or plan.all_resizable(resolved) is not None:
        return None
    if not plan.apart_from(state) or _registry.offloaded_any(plan.live_columns()[0]):
        return None
    return resolved


def _drop_through_plan(resolved: _plan.Resolved) -> _registry.OffloadedSet:
    """_drop() of a gradients plan's live storages, in one C++ pass that also makes them refuse access;
    the set (no region) is registered first, as _drop's. Returns it."""
    plan = resolved.plan
    keys, nbytes, devices, _, names = plan.live_columns()
    watch = plan.watch(resolved)
    dropped = _registry.OffloadedSet(keys, nbytes, devices, [0] * len(keys), plan.live, names, None, [], None,
                                     storages=() if watch is not None else [resolved.storages()[i] for i in plan.live],
                                     watch=watch)
    _registry.add(dropped)
    if plan.refusals is None:
        plan.refusals = plan.messages("drop", _registry.drop_refusals)
    if not _plan.resize(resolved, release=True, refusals=plan.refusals):
        _registry.refuse(keys, names, plan.refusals)
    plan.dropped = dropped
    return dropped


def _drop(items: list[tuple[int, torch.UntypedStorage, str]]) -> None:
    """Releases gradient storages without a copy; reload re-allocates them zeroed. Their set (no region) is
    registered before any is released, so an interrupt leaves every storage either live or registered (a
    registered one that is still live is simply zeroed by reload). Call with the registry lock held."""
    if not items:
        return
    storages = [st for _, st, _ in items]
    n = len(items)
    _registry.add(_registry.OffloadedSet([k for k, _, _ in items], [st.nbytes() for st in storages],
                                         [st.device for st in storages], [0] * n, [0] * n,
                                         [name for _, _, name in items], None, [], None, storages=storages))
    for storage in storages:
        storage.resize_(0)
    # Touching one raises (with the helper), naming it, instead of reading released memory.
    names = [name for _, _, name in items]
    _registry.refuse(storages, names, _registry.drop_refusals(names))


def _log_kept_grads(target: Any, resolved: _plan.Resolved) -> None:
    grads = gradient_tensors(target)
    if not grads:
        return
    state = set(resolved.plan.keys)
    try:  # (the gradients' plan, where the helper records it: no Python call per gradient)
        found = _plan.resolve(grads) if _plan.recording() else None
    except OffloadError:
        found = None
    if found is not None and found.plan.record is not None:  # (its storages are distinct)
        sizes = [n for k, n in zip(found.plan.keys, found.layout.storage_columns[1]) if k not in state]
    else:
        kept: dict[int, int] = {}
        for _, t in grads:
            storage = unwrap(t).untyped_storage()
            if storage._cdata not in state:
                kept[storage._cdata] = storage.nbytes()
        sizes = list(kept.values())
    if any(sizes):
        logger.info("offload: %d bytes of gradients in %d storages stay on the device (grads='keep'); "
                    "grads='drop' releases them, grads='copy' moves them too", sum(sizes), len(sizes))


def offload(target: Any, *, empty_cache: bool = True, grads: str = "keep", include_grads: bool = False,
            arena: Optional[Arena] = None, checksum: bool = False) -> None:
    """Moves the target's device state into pinned host memory and frees the device memory.

    Each storage is copied, then released (`untyped_storage().resize_(0)`); tensors keep their identity,
    shape and views, and hold no memory until `reload`. On CUDA, `torch.cuda.empty_cache()` then returns
    the memory to the driver unless `empty_cache=False`.

    Gradients (plain `.grad`, FSDP1/FSDP2 sharded gradients, Megatron's grad buffers, DeepSpeed's gradient
    partitions) follow `grads`:

    * ``"keep"`` (the default): they stay on the device, untouched (logged at INFO with their size);
    * ``"copy"``: moved with the rest and brought back with their values (``include_grads=True`` says the
      same);
    * ``"drop"``: released without a copy (nothing is written to host memory for them); `reload`
      re-allocates them zeroed, in place (Megatron's `main_grad` views stay views), as verl, Megatron's
      `offload_grad_buffers()` and slime do with gradients that the next step recomputes.

    With `checksum=True` a checksum of every storage is taken from the source as it is copied out (the
    same sums as `snapshot(..., checksum=True)`), for `reload(..., verify=True)`.

    Using an offloaded module (calling it or any of its submodules, its forward or state_dict) or optimizer (step,
    state_dict) raises OffloadError until it is reloaded; with the torch-aware helper any other access to
    an offloaded tensor's data raises a RuntimeError naming it. Dropping an offloaded target (the last
    reference to its tensors) returns its host memory to the arena.

    Raises:
        OffloadError: already offloaded (offloading twice is an error), unsupported tensors, a storage
            that cannot be resized, an unknown `grads`, a current CUDA stream that is capturing a graph,
            or arena/host memory exhausted. Nothing has changed then.
    """
    _capture.refuse("offload")
    policy = _grads_policy(grads, include_grads)
    join()  # overlapped snapshots must have read the weights before they change
    start = time.perf_counter()
    arena = arena if arena is not None else default_arena()
    with _registry.lock:
        resolved = _resolve_live(target, policy == "copy", "offload", hold=True)
        plan, layout = resolved.plan, resolved.layout
        stuck = plan.all_resizable(resolved)
        if stuck is not None:
            raise OffloadError(f"cannot offload {stuck}: {UNREGROWABLE}")
        live = plan.live
        grads = gradient_tensors(target) if policy == "drop" else None
        # Gradients to release: through a plan of their own (one C++ pass) where all of its storages go,
        # else one by one (which also says what cannot be dropped).
        grads_plan = _drop_plan(grads, plan) if grads and live else None
        dropping = _grads_to_drop(grads, set(plan.keys)) if grads and grads_plan is None else []
        if not live:
            if not dropping:
                raise OffloadError("nothing to offload: the target holds no device memory")
            _drop(dropping)  # only gradients hold memory: nothing to copy
            if empty_cache:
                _empty_cache([st.device for _, st, _ in dropping])
            return
        plans = plan.copies()
        region = arena._allocate(layout.host_bytes, users=len(live), devices=layout.devices)
        try:
            sums = _integrity.compute(layout, plan.storage_ptrs) if checksum else None
            events = plans.run(True, region.ptr, record=(region._pending,))
        except BaseException as exc:
            region.release_all(_plan.enqueued(exc))  # after copies other devices enqueued
            raise
        try:
            keys, nbytes, devices, offsets, names = plan.live_columns()  # (an interrupt here frees the region)
            # Watched from here on (a storage that dies while offloaded gives its bytes back).
            watch = plan.watch(resolved)
            offloaded = _registry.OffloadedSet(keys, nbytes, devices, offsets, live, names, region, events, sums,
                                               storages=() if watch is not None else
                                               [resolved.storages()[i] for i in live], watch=watch)
            offloaded.holds_grads = policy == "copy" or not _modules_and_optimizers(target)
        except BaseException:
            region.release_all(events)
            raise
        try:
            _registry.add(offloaded)
            # The copies are enqueued before the memory is released and the current stream waits for them.
            # No block may be handed out again before its copy has read it, whichever stream allocated it:
            if empty_cache and events:
                # the empty_cache() below waits for the copies anyway (torch's caching allocator synchronizes
                # the events of blocks with a recorded stream before it frees any segment), so the host waits
                # here, before the release, and the storages go as plain frees: no copy-stream use each, which
                # costs an event recorded per freed block and queried at later allocations.
                wait_for(events)
            else:
                # the allocator is told (it would otherwise hand a block back to the stream that allocated
                # it, which need not be the current one).
                _plan.mark_live_in_use(resolved, to_host=True)
            # Touching offloaded state raises: the storages refuse access to their data (in the release's
            # own pass where the helper resizes, else one C++ call by key: the target's tensors hold them),
            # the target's modules and optimizers raise OffloadError when used.
            if plan.refusals is None:
                plan.refusals = plan.messages("offload", _registry.refusals)
            # The plan follows the target as it is now (released), and the reload goes through it.
            refused = _plan.resize(resolved, release=True, refusals=plan.refusals)
            plan.offloaded = offloaded
            if not refused:
                _registry.refuse(keys, names, plan.refusals)
            _registry.guard(target, keys)
        except BaseException:
            _undo_offload(resolved, offloaded, region, events)  # exception safety: the target is left as it was
            _registry.unguard(target)
            raise
        # Last, once nothing can fail: the gradients have no copy that an undo could put back.
        if grads_plan is not None:
            offloaded.dropped = _drop_through_plan(grads_plan)
        else:
            _drop(dropping)
    if policy == "keep" and logger.isEnabledFor(logging.INFO):
        _log_kept_grads(target, resolved)
    if empty_cache:
        _empty_cache(layout.devices + [st.device for _, st, _ in dropping] +
                     (grads_plan.layout.devices if grads_plan is not None else []))
    _log_rate("offload", layout.nbytes, start, layout.num_tensors, layout.num_storages, not events)


def reload(target: Any, *, verify: bool = False) -> None:
    """Brings an offloaded target back: the same storages are re-allocated and refilled in place, so every
    parameter, view and optimizer reference stays valid.

    With `verify=True` (the offload must have been taken with `checksum=True`) the host copy is checked
    before anything is copied back, and the reloaded device data after the copy (on a GPU this waits
    for it).

    Raises:
        OffloadError: nothing in the target is offloaded, or the device is out of memory (then the target
            stays offloaded with its data intact, and a retry after freeing memory succeeds); with verify,
            a corrupt host copy (named in the message; nothing is written and the target stays offloaded
            with its host copy as it is) or reloaded data that differs from the source; or the current
            CUDA stream is capturing a graph.

    The storages come back at new device addresses: a CUDA graph captured before the offload still
    points at the old ones and must be captured again after the reload.
    """
    _capture.refuse("reload")
    join()  # overlapped snapshots must have read the weights before they change
    start = time.perf_counter()
    named = None  # the target with its gradients, read where needed
    with _registry.lock:
        # The common case: the target as its offload left it, every storage of that offload still offloaded.
        # Read without its gradients first where no registered set holds any (the gradients stayed on the
        # device or were dropped): reading them is a pass over every parameter that this case never needs.
        resolved = _state_to_reload(target) if _registry.entries else None
        if resolved is None and _registry.entries:
            named = named_tensors(target, include_grads=True)
            resolved = _plan_to_reload(named)
        offloaded = resolved.plan.offloaded if resolved is not None else None
        if resolved is not None and offloaded is not None:
            _reload_through_plan(resolved, offloaded, verify)
            dropped = offloaded.dropped
            if dropped is not None and _registry.registered(dropped):  # and the gradients it dropped, zeroed
                # (Read with its gradients: a registered set of dropped ones holds gradients, so the state was
                # not read alone.)
                _regrow_dropped(named, dropped)
        else:
            named = named if named is not None else named_tensors(target, include_grads=True)
            records, bound = _reload_bound(named, verify)
    _registry.unguard(target)
    if resolved is not None and offloaded is not None:  # reloaded through the plan
        if verify:  # integrity: and the reloaded device data after
            storages = resolved.storages()
            _registry.verify_reloaded([(storages[i], offloaded.record(p)) for p, i in enumerate(resolved.plan.live)])
        _log_rate("reload", resolved.layout.nbytes, start, resolved.layout.num_tensors, len(offloaded.keys), True)
        return
    if verify:  # integrity: and the reloaded device data after
        _registry.verify_reloaded([(st, r) for _, st, r in records if r.region is not None])
    # The storages are live again at new addresses: remember the target's plan so that the next call on
    # it (a snapshot or the next offload) needs no fresh bind.
    _plan.remember(named, bound, shard_info=lambda: shard_info(target, named))
    _log_rate("reload", sum(r.nbytes for _, _, r in records), start, bound.layout.num_tensors, len(records), True)


def _reloadable(plan: _plan.TargetPlan) -> bool:
    """Whether a plan's offload is registered whole (every storage of it still offloaded): a reload can go
    through the plan."""
    offloaded = plan.offloaded
    return offloaded is not None and offloaded.whole and _registry.registered(offloaded)


def _state_to_reload(target: Any) -> Optional[_plan.Resolved]:
    """The plan the target's offload left, read and checked without the target's gradients, where that offload
    moved its state alone: no registered set holds a gradient (the registry lock held). None: ask
    _plan_to_reload with the gradients."""
    if _registry.others_hold_grads(None):  # (an offload with grads="copy", or of a gradient's own target)
        return None
    return _plan.cached(named_tensors(target), hold=True, accept=_reloadable)


def _plan_to_reload(named: Any) -> Optional[_plan.Resolved]:
    """The plan the target's offload left, checked against the target now, where the reload can go through
    it; None: the general way (the registry lock held). `named`: the target with its gradients."""
    resolved = _plan.cached(named, hold=True, accept=_reloadable)
    if resolved is not None or not getattr(named, "num_grads", 0):
        return resolved
    # The gradients stayed on the device (grads="keep") or were dropped (grads="drop", a set of their own): the
    # offload's plan is the state's, and going through it (then through the dropped ones' plan) misses
    # nothing while no other registered set may hold one of those gradients.
    return _plan.cached(named.state(), hold=True, accept=_reloadable_alone)


def _regrow_dropped(named: Any, dropped: _registry.OffloadedSet) -> None:
    """Re-allocates, zeroed, the gradients an offload(grads="drop") released with its state (the registry
    lock held; the state is back already): through their plan where it still fits them, else the general
    way. An error leaves them dropped and registered, for the next reload."""
    if not getattr(named, "num_grads", 0):  # (its gradients are gone: none of them is still the target's)
        return
    grads = named.grads()
    resolved = _plan.cached(grads, hold=True, accept=lambda plan: plan.dropped is dropped)
    if resolved is None:  # (replaced or changed since: whichever of them is still dropped)
        _reload_bound(grads, False, required=False)
        return
    plan = resolved.plan
    try:
        _plan.resize(resolved, release=False, refusals=plan.refusals)
    except BaseException as exc:
        _undo_reload_plan(resolved, dropped, [])  # (no copies: they stay dropped, refusing access)
        if isinstance(exc, (RuntimeError, MemoryError)):
            raise _reload_out_of_memory(exc, sum(dropped.nbytes), resolved.layout.devices) from exc
        raise
    _plan.zero_live(resolved)
    _registry.remove(dropped)
    dropped.forget(None)
    plan.dropped = None


def _reload_through_plan(resolved: _plan.Resolved, offloaded: _registry.OffloadedSet, verify: bool) -> None:
    """Reloads a target through the plan its offload left (the registry lock held): the storages are
    re-allocated in one call where the helper can (on a GPU, in parts: see plan.reload_parts), the plan
    refreshed, its copies run."""
    plan, region = resolved.plan, offloaded.region
    live = plan.live
    if verify:  # integrity: the host copy is checked before anything moves
        _registry.verify_host([offloaded.record(p) for p in range(len(live))])
    events: list[Any] = []
    allocating = True
    parts = plan.reload_parts()
    try:
        # The refusal is lifted in the resize's own pass where the helper resizes, else first in one C++
        # call by key (the target's tensors hold the storages).
        if not plan.resizes_in_one_pass:
            _registry.allow(offloaded.keys)
        if parts is None:
            _plan.resize(resolved, release=False, refusals=plan.refusals)
            allocating = False
            try:
                # One step (the assignment takes run's result directly): an interrupt cannot lose the events.
                events = plan.copies().run(False, region.ptr, waits=offloaded.events)
            except BaseException as exc:
                events = _plan.enqueued(exc)  # other devices' copies, still running
                raise
            finally:
                region._pending.extend(events)  # a region an interrupt leaves unreleased waits for them
        else:
            # In parts: each part's copies are enqueued before the next part is allocated, so the link works
            # while the host allocates (plan.RELOAD_FIRST_PART_BYTES). Each event goes into `events` and the
            # region's pending list inside the C call that enqueues its batch.
            for part in parts:
                allocating = True
                _plan.resize(resolved, release=False, refusals=plan.refusals, part=part)
                allocating = False
                plan.part_copies(*part).run(False, region.ptr, waits=offloaded.events,
                                            record=(events, region._pending))
    except BaseException as exc:
        _undo_reload_plan(resolved, offloaded, events)
        if allocating and isinstance(exc, (RuntimeError, MemoryError)):
            raise _reload_out_of_memory(exc, sum(offloaded.nbytes), resolved.layout.devices) from exc
        raise
    # Commit: the set leaves the registry in one step, then the region loses its users (an interrupt
    # between the two leaves a region that is freed when the set is dropped).
    _registry.remove(offloaded)
    offloaded.forget(None)
    region.release(events, count=len(live))


def _undo_reload_plan(resolved: _plan.Resolved, offloaded: _registry.OffloadedSet, events: list[Any]) -> None:
    """Releases the storages an interrupted fast reload allocated; the data stays in the arena and the
    target stays offloaded through its plan (a regrow of dropped gradients: they stay dropped, refusing
    access with their plan's messages)."""
    offloaded.events = list(offloaded.events) + list(events)
    storages = resolved.storages()
    grown = [i for i in resolved.plan.live if storages[i].nbytes() != 0]
    if events:  # the copies may still write these storages: the allocator must not hand them out before
        _plan.mark_in_use([_plan.storage_view(storages[i]) for i in grown], to_host=False)
    for i in grown:
        storages[i].resize_(0)
    resolved.plan.refresh(resolved.tensors, released=True)
    _registry.refuse(offloaded.keys, offloaded.names, resolved.plan.refusals)  # offloaded as before


def _reload_bound(named: Any, verify: bool,
                  required: bool = True) -> tuple[list[tuple[int, torch.UntypedStorage, _Offloaded]], Any]:
    """Reloads whatever of a target is offloaded, however it was offloaded (the registry lock held).
    required: nothing offloaded is an error (else nothing is done)."""
    bound = bind(named, _registry.sizes())
    records = [(k, st, _registry.entries[k]) for k, st in zip(bound.keys, bound.storages) if k in _registry.entries]
    if not records:
        if not required:
            return records, bound
        raise OffloadError("cannot reload: nothing in the target is offloaded")
    if verify:  # integrity: the host copy is checked before anything moves
        _registry.verify_host([r for _, _, r in records if r.region is not None])
    # Exception safety: nothing is committed (registry, regions) until every storage is allocated and
    # every copy enqueued; an error or interrupt before that frees what was allocated, and the target
    # stays offloaded with its data intact.
    by_region: dict[int, list[tuple[int, torch.UntypedStorage, _Offloaded]]] = {}
    for item in records:
        if item[2].region is not None:  # (gradients dropped by offload(grads="drop") have no copy)
            by_region.setdefault(id(item[2].region), []).append(item)
    enqueued: list[tuple[list[tuple[int, torch.UntypedStorage, _Offloaded]], list[Any]]] = []
    keys = [k for k, _, _ in records]
    allocating = True
    try:
        _registry.allow(keys)  # one C++ call; the storages are held by `records`
        for _, storage, record in records:
            storage.resize_(record.nbytes)
        allocating = False
        for _, storage, record in records:
            if record.region is None:  # dropped gradients come back zeroed (in stream order)
                _plan.storage_view(storage).zero_()
        for items in by_region.values():
            region = items[0][2].region
            assert region is not None
            entries = [(r.device, st.data_ptr(), r.host_offset, r.nbytes) for _, st, r in items]
            try:
                # One step (the append takes run's result directly): an interrupt cannot lose the events.
                enqueued.append((items, _plan.build_copies(entries).run(False, region.ptr,
                                                                         waits=items[0][2].events)))
            except BaseException as exc:
                enqueued.append((items, _plan.enqueued(exc)))  # other devices' copies, still running
                raise
            finally:
                region._pending.extend(enqueued[-1][1])  # a region an interrupt leaves unreleased waits for them
    except BaseException as exc:
        _undo_reload(records, enqueued)
        if allocating and isinstance(exc, (RuntimeError, MemoryError)):
            raise _reload_out_of_memory(exc, sum(r.nbytes for _, _, r in records), bound.layout.devices) from exc
        raise
    # Commit. Every entry leaves the registry in one step of C code (no interrupt falls in the middle),
    # then the regions lose their users; a region an interrupt leaves unreleased is freed when dropped.
    _registry.drop_keys(keys)
    for items, events in enqueued:
        items[0][2].region.release(events, count=len(items))  # type: ignore[union-attr]
    return records, bound


def discard(target: Any) -> None:
    """Drops the offloaded state of a target without bringing it back: its host bytes return to the arena
    and its storages stay empty (allocate new tensors, or load a snapshot into a rebuilt model). With the
    torch-aware helper those storages refuse access with an error that says so (a read of an empty storage
    under full-shape tensors would otherwise crash the process). Afterwards `is_offloaded(target)` is False
    and `reload(target)` raises.

    Raises:
        OffloadError: nothing in the target is offloaded.
    """
    named = named_tensors(target, include_grads=True, reshard=False)
    with _registry.lock:
        bound = bind(named, _registry.sizes())
        keys = [k for k in bound.keys if k in _registry.entries]
        if not keys:
            raise OffloadError("cannot discard: nothing in the target is offloaded")
        storages = [st for k, st in zip(bound.keys, bound.storages) if k in _registry.entries]
        groups = _registry.drop_keys(keys)  # one step of C code: all leave the registry, or none
        # Empty for good: they refuse access, saying so, until the caller gives the tensors new memory.
        # (After the entries: an interrupt between the two leaves them refusing access as offloaded.)
        _registry.refuse(storages, (), _registry.DISCARDED)
        nbytes = 0
        for owner, positions in groups:
            if owner.region is not None:  # (a dropped gradient has no host copy)
                owner.region.release(owner.events, count=len(positions))
            nbytes += sum(owner.nbytes[p] for p in positions)
    _registry.unguard(target)
    logger.debug("discard: %d storages, %d bytes", len(keys), nbytes)


# -- exception safety: undoing a half-done offload or reload ----------------------------------------------
def swap(out_target: Any, in_target: Any, *, empty_cache: bool = True, grads: str = "keep",
         include_grads: bool = False, arena: Optional[Arena] = None) -> None:
    """Offloads `out_target` while reloading `in_target` (e.g. the policy leaves as the reference model
    comes back). On a GPU the two batches run at once, device-to-host and host-to-device on the two copy
    engines; later work on the current stream waits for both. `grads` is `offload`'s, for `out_target`
    (gradients `in_target` dropped come back zeroed).

    The incoming storages are allocated before the outgoing ones are released (so that no block is
    written before it has been read), which needs room for both on the device. Where there is none, swap
    falls back to offload then reload, one after the other. CPU targets simply do the two in turn.

    Raises:
        OffloadError: `in_target` has nothing offloaded, `out_target` cannot be offloaded (then nothing
            has moved), or the device is out of memory even for the sequential fallback (then
            `out_target` is offloaded and `in_target` still offloaded, its data intact); or the current
            CUDA stream is capturing a graph.
    """
    _capture.refuse("swap")
    policy = _grads_policy(grads, include_grads)
    join()
    start = time.perf_counter()
    # Validate both before anything moves (in_target: by reload() itself, before it allocates).
    _resolve_live(out_target, policy == "copy", "swap out")
    named_in = named_tensors(in_target, include_grads=True)
    with _registry.lock:
        # Exactly what is offloaded now: put back as it was if the second half fails.
        before = _SwapIn.read(named_in)
    if before is None:
        raise OffloadError("cannot swap in: nothing in in_target is offloaded")
    try:
        with _plan.deferred_join() as in_flight:
            reload(in_target)  # allocates first: nothing is freed before the copies that read it
            try:
                offload(out_target, empty_cache=False, grads=policy, arena=arena)
            except BaseException:
                # As before the call. The reload's copies may not have arrived yet: the current stream waits
                # for them first, so that the offload reads (and then frees) filled blocks.
                _plan.join_now(in_flight)
                copied = before.copied()
                if copied:
                    offload(copied, empty_cache=False, arena=arena)
                with _registry.lock:
                    _drop([(st._cdata, st, n) for n, st in before.dropped()
                           if st._cdata not in _registry.entries and st.nbytes()])
                raise
    except OffloadError as exc:
        if not isinstance(exc.__cause__, (torch.OutOfMemoryError, MemoryError)):
            raise
        logger.debug("swap: no room for both targets (%s); offloading, then reloading", exc.__cause__)
        offload(out_target, empty_cache=empty_cache, grads=policy, arena=arena)
        reload(in_target)
        return
    if empty_cache:
        _empty_cache(before.devices)
    logger.debug("swap: %.3f ms to enqueue", (time.perf_counter() - start) * 1e3)


class _SwapIn:
    """What of swap()'s in_target is offloaded before the call (read with the registry lock held), to be put
    back if the offload half fails: copied() the tensors offloaded with a copy, dropped() the (name, storage)
    of each gradient dropped without one; devices, where they live.

    Where the target's state (or the state with its gradients) is offloaded whole through the plan its
    offload left, and no other registered set holds a gradient of it, that plan says it all and the rest is
    read only if needed (a swap of 65536 tensors spent 330 ms asking each tensor's storage of the registry,
    and 840 ms binding the target anew). Otherwise each tensor is asked."""

    def __init__(self, covered: Any, plan: Optional[_plan.TargetPlan], named: Any,
                 by_name: Optional[dict[str, torch.Tensor]], dropped_names: Sequence[str],
                 devices: list[torch.device]) -> None:
        self._covered, self._plan, self._named = covered, plan, named
        self._by_name, self._dropped_names, self.devices = by_name, dropped_names, devices

    @classmethod
    def read(cls, named: Any) -> Optional["_SwapIn"]:
        """None where nothing of `named` is offloaded."""
        if not _registry.entries:
            return None
        for covered, accept in ((named, _reloadable), (named.state() if getattr(named, "num_grads", 0) else None,
                                                      _reloadable_alone)):
            resolved = _plan.cached(covered, accept=accept) if covered is not None else None
            if resolved is not None:
                plan, offloaded = resolved.plan, resolved.plan.offloaded
                dropped = offloaded.dropped if offloaded.dropped is not None and _registry.registered(
                    offloaded.dropped) else None
                names = [n for n, a in zip(dropped.names, dropped.alive) if a] if dropped is not None else []
                devices = list(dict.fromkeys(plan.layout.devices + (dropped.devices if dropped is not None else [])))
                return cls(covered, plan, named, None, names, devices)
        # Each tensor asked of the registry (and the target bound: what is offloaded of it must lay out).
        bind(named, _registry.sizes())
        was_offloaded = {name: t for name, t in named if unwrap(t).untyped_storage()._cdata in _registry.entries}
        if not was_offloaded:
            return None
        was_dropped = [name for name, t in was_offloaded.items()
                       if _registry.entries[unwrap(t).untyped_storage()._cdata].region is None]
        return cls(None, None, named, was_offloaded, was_dropped,
                   list(dict.fromkeys(t.device for t in was_offloaded.values())))

    def copied(self) -> dict[str, torch.Tensor]:
        if self._by_name is not None:
            dropped = set(self._dropped_names)
            return {n: t for n, t in self._by_name.items() if n not in dropped}
        # The plan's tensors on its live storages (those its offload copied).
        live = set(self._plan.live)
        storage_of = self._plan.layout.tensor_columns()[0]
        return {n: t for n, t, j in zip(self._covered.names, self._covered.tensors, storage_of) if j in live}

    def dropped(self) -> list[tuple[str, torch.UntypedStorage]]:
        if not self._dropped_names:
            return []
        tensors = self._by_name if self._by_name is not None else dict(zip(self._named.names, self._named.tensors))
        return [(n, unwrap(tensors[n]).untyped_storage()) for n in sorted(self._dropped_names) if n in tensors]


def _reloadable_alone(plan: _plan.TargetPlan) -> bool:
    """_reloadable(), for a plan of a target's state read without its gradients: and no registered set but
    the one of the gradients its offload dropped may hold one of them (see _plan_to_reload)."""
    return _reloadable(plan) and not _registry.others_hold_grads(plan.offloaded, plan.offloaded.dropped)


def _reload_out_of_memory(exc: BaseException, nbytes: int, devices: Sequence[Any]) -> OffloadError:
    """The error of a reload whose allocation failed (both reload paths): what, where, and that nothing is lost."""
    return OffloadError(f"reload failed while allocating {nbytes} bytes on {', '.join(str(d) for d in devices)}: "
                        f"{exc}; the target is still offloaded with its data intact, free memory and call "
                        "reload() again")


def _undo_offload(resolved: _plan.Resolved, offloaded: _registry.OffloadedSet, region: Region,
                  events: list[Any]) -> None:
    """Puts back an offload interrupted after its copy: storages already released are re-allocated and
    refilled from the region (which the copy filled), the set unregistered, the region freed. Released
    storages are found by their size, so one released just before the interrupt is not missed."""
    _registry.remove(offloaded)
    offloaded.forget(None)
    _registry.allow(offloaded.keys)  # (before any resize: a refused storage cannot be resized)
    plan = resolved.plan
    specs, storages = resolved.layout.storages, resolved.storages()
    released = [(specs[i], storages[i]) for i in plan.live if storages[i].nbytes() != specs[i].nbytes]
    back: list[Any] = []
    if released:
        for spec, storage in released:
            storage.resize_(spec.nbytes)
        entries = [(spec.device, storage.data_ptr(), spec.host_offset, spec.nbytes) for spec, storage in released]
        try:
            back = _plan.build_copies(entries).run(False, region.ptr, waits=events, record=(region._pending,))
        except BaseException as exc:
            region.release_all(list(events) + _plan.enqueued(exc))
            raise
    region.release_all(list(events) + back)
    plan.refresh(resolved.tensors, released=False)
    logger.debug("offload interrupted: %d released storages put back", len(released))


def _undo_reload(records: list[tuple[int, torch.UntypedStorage, _Offloaded]],
                 enqueued: list[tuple[list[tuple[int, torch.UntypedStorage, _Offloaded]], list[Any]]]) -> None:
    """Releases the storages an interrupted reload allocated; their data stays in the arena. Copies already
    enqueued from a region are added to its records' events, so the region outlives them."""
    for items, events in enqueued:
        for _, _, record in items:
            record.events = list(record.events) + list(events)
        # The copies may still write these storages: the allocator must not hand them out before.
        _plan.mark_in_use([_plan.storage_view(st) for _, st, _ in items if st.nbytes() != 0], to_host=False)
    for _, storage, _ in records:
        if storage.nbytes() != 0:
            storage.resize_(0)
    # Offloaded as before, each with its own message: a dropped gradient (no host copy) says it was dropped.
    names = [r.name for _, _, r in records]
    messages = [dropped if r.region is None else offloaded for (_, _, r), dropped, offloaded
                in zip(records, _registry.drop_refusals(names), _registry.refusals(names))]
    _registry.refuse([st for _, st, _ in records], names, messages)


def is_offloaded(target: Any) -> bool:
    """True when any of the target's storages is offloaded by this process, so that `reload(target)` has
    something to bring back: a target offloaded whole, and one offloaded in part (`offload(model)`, then
    `is_offloaded([model, opt])`; a parameter replaced while its module was offloaded, whose other tensors
    still refuse access), so that `if is_offloaded(m): reload(m)` always leaves `m` usable."""
    named = named_tensors(target, include_grads=False, reshard=False)
    with _registry.lock:
        if not _registry.entries:
            return False
        resolved = _plan.cached(named)  # as its own offload left it: no per-storage look-up
        offloaded = resolved.plan.offloaded if resolved is not None else None
        if offloaded is not None and offloaded.whole and _registry.registered(offloaded):
            return True
        bound = bind(named)
        return any(k in _registry.entries for k in bound.keys)


def offloaded_bytes() -> int:
    """Bytes currently offloaded by this process, over all targets."""
    return _registry.total_bytes()
