"""Snapshot: a point-in-time copy of a target's storages in arena memory."""

from __future__ import annotations

import json
import weakref
from typing import Any, Optional

import torch

from . import _capture, _fork
from . import integrity as _integrity
from ._errors import OffloadError
from .arena import Arena, Lease, Region, _done, wait_for
from .storages import Layout


class Snapshot:
    """A non-destructive copy of a target's device state in pinned host memory.

    Returned by gpu_offload.snapshot() while the copy may still be in flight (on a GPU); `wait()` blocks
    until the host copy is complete. Restoring needs no wait: the restore is ordered after the copy on
    the GPU. Use as a context manager to free it at the end of a block.
    """

    # name -> DTensorSpec of the tensors that were DTensors at snapshot time (set by snapshot(); in memory
    # only, never saved: a loaded snapshot has none).
    _dtensor_specs: Optional[dict[str, Any]] = None
    # The module a snapshot was taken of, while it lives (set by snapshot(); a weak reference): its
    # state_dict() names are what gpu_offload.save_state_dict writes (not its non-persistent buffers).
    _source: Optional["weakref.ref[Any]"] = None

    def __init__(self, layout: Layout, region: Region, events: list[Any],
                 checksums: Optional[_integrity.Checksums] = None, include_grads: Optional[bool] = None) -> None:
        self._layout = layout
        self._region: Optional[Region] = region
        self._events = events  # copies writing the region (the snapshot) and reading it (restores)
        self._lock = _fork.new_lock()
        self._checksums = checksums  # taken from the source (snapshot(checksum=True)) or read from a file
        # Whether the snapshot holds gradients, as asked (None: unknown, e.g. a file that did not record it;
        # then guessed from the names).
        self._include_grads = include_grads

    # -- state ----------------------------------------------------------------------------------------
    @property
    def layout(self) -> Layout:
        return self._layout

    @property
    def nbytes(self) -> int:
        """Payload bytes: the sum of the sizes of the storages copied."""
        return self._layout.nbytes

    @property
    def num_storages(self) -> int:
        return self._layout.num_storages

    @property
    def num_tensors(self) -> int:
        return self._layout.num_tensors

    @property
    def names(self) -> list[str]:
        return list(self._layout.tensor_names)

    @property
    def include_grads(self) -> bool:
        """Whether the snapshot was taken with include_grads=True (restore then writes gradients too)."""
        return self._layout.has_grads if self._include_grads is None else self._include_grads

    @property
    def arena(self) -> Arena:
        return self._live().arena

    @property
    def freed(self) -> bool:
        return self._region is None

    def _live(self) -> Region:
        region = self._region
        if region is None:
            raise OffloadError("this snapshot was freed; it can no longer be used")
        return region

    def _use(self) -> Lease:
        """A user of the region of its own, for a copy about to read it: a free() from another thread
        meanwhile only drops the snapshot's own user, so the memory outlives the copy. The caller
        releases it (with the copy's events); a lease dropped unreleased (an interrupt) releases itself."""
        region = self._live()
        lease = Lease()
        if not region.acquire(lease):
            raise OffloadError("this snapshot was freed; it can no longer be used")
        return lease

    def _add_events(self, events: list[Any]) -> None:
        with self._lock:
            self._events = [e for e in self._events if not _done(e)] + list(events)

    def _pending(self) -> list[Any]:
        with self._lock:
            return list(self._events)

    # -- public ---------------------------------------------------------------------------------------
    def done(self) -> bool:
        """True once every copy into (and restore from) this snapshot has finished; never blocks."""
        self._live()
        _capture.refuse("query a snapshot (done())")
        return all(e.query() for e in self._pending())

    def wait(self) -> "Snapshot":
        """Blocks until the host copy is complete (and restores reading it have finished)."""
        self._live()
        _capture.refuse("wait for a snapshot")
        wait_for(self._pending())
        return self

    def free(self) -> None:
        """Returns the snapshot's arena space. Copies still in flight finish first (the space is reused
        only after them); any later use of the snapshot raises OffloadError. Freeing twice is a no-op."""
        with self._lock:
            region, pending = self._region, self._events
        if region is not None:
            region._drop(self, "_region", pending)  # the user and the reference go together, once
        self._events = []

    def tensors(self) -> dict[str, torch.Tensor]:
        """The snapshot's tensors as CPU tensors viewing the arena memory (after waiting for the copy).

        They alias the snapshot (writing to them changes it) and keep its memory alive: the arena space
        returns to the arena when the snapshot is freed (or dropped) *and* the last of these views is gone,
        so a view never shows another snapshot's bytes. Hold them only as long as needed.
        """
        self.wait()
        lease = self._use()
        view = lease.buffer(owner=lease)  # the views hold the lease: its user ends with the last of them
        bases: dict[int, torch.Tensor] = {}
        out: dict[str, torch.Tensor] = {}
        for spec in self._layout.tensors:
            storage = self._layout.storages[spec.storage]
            base = bases.get(spec.storage)
            if base is None:
                if storage.nbytes == 0:
                    base = torch.empty(0, dtype=torch.uint8)
                else:
                    base = torch.frombuffer(view, dtype=torch.uint8, count=storage.nbytes, offset=storage.host_offset)
                bases[spec.storage] = base
            itemsize = spec.dtype.itemsize
            typed = base[: base.numel() // itemsize * itemsize].view(spec.dtype)
            out[spec.name] = torch.as_strided(typed, spec.shape, spec.stride, spec.offset)
        return out

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The snapshot as a state dict for torch.distributed.checkpoint: names to host tensors (those of
        `tensors()`, after waiting for the copy), each one that was a DTensor at snapshot time wrapped again
        as a DTensor with the same mesh, placements and global shape, so that
        `dcp.save(snap.state_dict(), checkpoint_id=...)` writes a checkpoint that `dcp.load` reshards.

        That includes snapshots of FSDP2 (`fully_shard`) modules: their parameters are DTensors under
        their own names, each wrapping this rank's shard (a view of the host copy of its padded local
        storage), so every rank saves its shards and another world size loads them.

        The tensors alias the snapshot, as `tensors()` does: save before freeing it.

        Raises:
            OffloadError: the snapshot was freed; it is of an FSDP1, Megatron or DeepSpeed object (whose
                tensors are the rank's flat shards, not a state dict: snapshot `model.state_dict()` or
                `torch.distributed.checkpoint.state_dict.get_state_dict(model, optimizer)` instead); or it
                is of an FSDP2 module but taken with gradients, or loaded from a file (which keeps no
                DTensor specs).
        """
        info = self._layout.shard_info
        if info is not None:
            from .adapters import state_dict_kinds

            kinds = {str(part.get("kind")) for part in json.loads(info).values()}
            flat = sorted(kinds - state_dict_kinds())
            if flat:
                raise OffloadError(f"state_dict(): this snapshot is of a sharded object ({', '.join(flat)}), whose "
                                   "tensors are the rank's flat shards, not a state dict; snapshot "
                                   "model.state_dict() or get_state_dict(model, optimizer) to save it with "
                                   "torch.distributed.checkpoint")
            if self.include_grads:
                raise OffloadError("state_dict(): this snapshot of a sharded module holds gradients, which are "
                                   "no part of a state dict; take the snapshot without include_grads")
            if not self._dtensor_specs:
                raise OffloadError("state_dict(): this snapshot of a sharded module has no DTensor specs (a "
                                   "snapshot loaded from a file keeps none); restore it into the module and "
                                   "snapshot that")
        out = self.tensors()
        if self._dtensor_specs:
            from torch.distributed.tensor import DTensor

            # Built from the spec, not DTensor.from_local, which would move the host shard to the mesh's device.
            for name, spec in self._dtensor_specs.items():
                out[name] = DTensor(out[name], spec, requires_grad=False)
        return out

    # -- integrity (gpu_offload/integrity.py; files are gpu_offload.save / gpu_offload.load) ----------------
    @property
    def checksums(self) -> Optional[list[int]]:
        """One checksum per storage, of the source as it was copied (`snapshot(..., checksum=True)`) or as
        saved in a file; None when none was computed. Waits for sums still being computed on a GPU."""
        return None if self._checksums is None else self._checksums.result()

    def verify(self) -> "Snapshot":
        """Recomputes the checksums over the host copy (after waiting for it) and compares.

        Raises:
            OffloadError: a storage's host copy differs from its source (named in the message), the
                snapshot has no checksums, or it was freed.
        """
        self._live()
        expected = self.checksums
        if expected is None:
            raise OffloadError("this snapshot has no checksums to verify: take it with snapshot(..., checksum=True)")
        self.wait()
        region = self._use()
        try:
            _integrity.verify_host(self._layout, region.ptr, expected)
        finally:
            region.release()
        return self

    def __del__(self) -> None:
        # A dropped snapshot gives its space back, as a dropped CPU state dict would.
        try:
            self.free()
        except Exception:  # interpreter shutdown: the arena may already be gone
            pass

    def __copy__(self) -> "Snapshot":
        """copy.copy(snapshot): a second handle on the same host copy with a user of the region of its own,
        so that each is freed (or dropped) on its own; the memory returns once both are (and their views)."""
        region = self._live()
        new = Snapshot.__new__(Snapshot)
        new._region = None  # set before anything else: the copy's finalizer frees only a user of its own
        new.__dict__.update({k: v for k, v in self.__dict__.items() if k not in ("_region", "_lock", "_events")})
        new._lock = _fork.new_lock()
        new._events = self._pending()
        if not region.acquire(new, "_region"):
            raise OffloadError("this snapshot was freed; it can no longer be used")
        return new

    def __deepcopy__(self, memo: dict[int, Any]) -> "Snapshot":
        raise OffloadError("a Snapshot cannot be deep-copied: take another snapshot of the target, or copy its "
                           "tensors() (copy.copy gives a second handle on the same host copy)")

    def __reduce__(self) -> Any:
        # pickle, torch.save and copy.deepcopy would otherwise fail on the lock inside, or copy a view of
        # arena memory that the other process does not have.
        raise TypeError("a gpu_offload.Snapshot cannot be pickled (it is pinned host memory of this process): "
                        "write it with gpu_offload.save(snap, path) and read it with gpu_offload.load(path), or "
                        "gpu_offload.save_state_dict(snap, path) for a plain safetensors state dict")

    def __enter__(self) -> "Snapshot":
        return self

    def __exit__(self, *exc: object) -> None:
        self.free()

    def __repr__(self) -> str:
        state = "freed" if self._region is None else ("done" if all(e.query() for e in self._pending()) else "in flight")
        return (f"Snapshot({self.num_tensors} tensors, {self.num_storages} storages, {self.nbytes} bytes, "
                f"devices={[str(d) for d in self._layout.devices]}, {state})")
