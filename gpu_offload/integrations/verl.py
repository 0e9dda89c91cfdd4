"""Drop-in for verl's DetachActorWorker: numbered CPU copies of the actor's weights.

verl's separated / fully-async trainers call `save_model_to_cpu(n)`, `restore_model_from_cpu(n)` and
`clear_cpu_model(n)` on the actor workers (fsdp, fsdp2 and megatron strategies) to keep several versions
of the policy beside the live one. Its own implementations copy tensor by tensor into pageable memory;
this mixin keeps each slot as a `gpu_offload.Snapshot` in the pinned arena (the rank's own shards only,
whatever the strategy) with the same names and meanings:

    class MyActorWorker(GpuOffloadSlotsMixin, ActorRolloutRefWorker):
        save_model_to_cpu = register(dispatch_mode=Dispatch.ONE_TO_ALL)(GpuOffloadSlotsMixin.save_model_to_cpu)
        restore_model_from_cpu = register(dispatch_mode=Dispatch.ONE_TO_ALL)(GpuOffloadSlotsMixin.restore_model_from_cpu)
        clear_cpu_model = register(dispatch_mode=Dispatch.ONE_TO_ALL)(GpuOffloadSlotsMixin.clear_cpu_model)

(verl's `register` decorator is what makes Ray dispatch a method to every rank; it is verl's, so the
worker applies it.) The module is found under the attributes verl's workers use (`actor_module_fsdp`,
`actor.engine.module`, `actor.actor_module`, `actor_module`); override `gpu_offload_target()` otherwise. A
DeepSpeed engine found there stands for its module (the slots are weights: ZeRO-3 partitions, not the optimizer).
"""

from __future__ import annotations

import logging
from typing import Any, Hashable, Optional

from .. import api
from .._errors import OffloadError
from ..arena import Arena
from ..snapshot import Snapshot

logger = logging.getLogger("gpu_offload")

_TARGET_PATHS = ("actor_module_fsdp", "actor.engine.module", "actor.actor_module", "actor_module")


def _lookup(obj: Any, path: str) -> Any:
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


class GpuOffloadSlotsMixin:
    """save_model_to_cpu / restore_model_from_cpu / clear_cpu_model over numbered snapshot slots."""

    #: Arena for the slots (None: the shared default arena).
    gpu_offload_arena: Optional[Arena] = None

    def gpu_offload_target(self) -> Any:
        """What the slots copy: the actor module (or the list of Megatron model chunks)."""
        for path in _TARGET_PATHS:
            target = _lookup(self, path)
            if target is not None:
                from ..adapters.deepspeed import is_deepspeed_engine

                return target.module if is_deepspeed_engine(target) else target
        raise OffloadError(f"{type(self).__qualname__}: no actor module found under {', '.join(_TARGET_PATHS)}; "
                           "override gpu_offload_target()")

    @property
    def cpu_saved_models(self) -> dict[Hashable, Snapshot]:
        """The slots, by number (the attribute verl's workers use)."""
        slots = self.__dict__.get("_gpu_offload_slots")
        if slots is None:
            slots = self.__dict__["_gpu_offload_slots"] = {}
        return slots

    @cpu_saved_models.setter
    def cpu_saved_models(self, slots: dict[Hashable, Snapshot]) -> None:
        # verl code paths reset the slots with `self.cpu_saved_models = {}`: free what is dropped.
        old = self.__dict__.get("_gpu_offload_slots") or {}
        new = dict(slots)
        if any(not isinstance(v, Snapshot) for v in new.values()):
            raise OffloadError("cpu_saved_models holds gpu_offload Snapshots (from save_model_to_cpu) only")
        kept = {id(v) for v in new.values()}
        for snap in old.values():
            if id(snap) not in kept:
                snap.free()
        self.__dict__["_gpu_offload_slots"] = new

    def save_model_to_cpu(self, n: Hashable) -> None:
        """Copies the current weights into slot n (replacing what it held). Non-destructive; returns once
        the copy is enqueued, ordered before any later change to the weights."""
        snap = api.snapshot(self.gpu_offload_target(), arena=self.gpu_offload_arena)
        old = self.cpu_saved_models.pop(n, None)
        self.cpu_saved_models[n] = snap
        if old is not None:
            old.free()

    def restore_model_from_cpu(self, n: Hashable) -> None:
        """Copies slot n back into the live weights, in place. The slot is kept. As in verl, a slot that
        was never saved is a no-op (logged)."""
        snap = self.cpu_saved_models.get(n)
        if snap is None:
            logger.warning("restore_model_from_cpu(%r): no such slot; nothing restored", n)
            return
        api.restore(self.gpu_offload_target(), snap)

    def clear_cpu_model(self, n: Hashable) -> None:
        """Frees slot n's pinned memory (no-op for an unknown slot)."""
        snap = self.cpu_saved_models.pop(n, None)
        if snap is not None:
            snap.free()
