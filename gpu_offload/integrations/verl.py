"""Drop-ins for verl: its twelve offload helpers by their own names, and DetachActorWorker's numbered slots.

**The offload helpers.** verl's trainers free the GPU between phases with the functions of
``verl/utils/fsdp_utils.py`` and ``verl/utils/megatron_utils.py`` (0.9.1). Each has the same name,
parameters and meaning here, through the pinned arena (one batched copy per call, the same tensor objects
afterwards, storages released and re-allocated in place) instead of per-tensor ``.to(..., non_blocking=True)``
into freshly allocated host memory or one pinned buffer per DDP bucket::

    from gpu_offload.integrations.verl import offload_fsdp_model_to_cpu, load_fsdp_model_to_gpu  # etc.

=====================================================  ===================================================
``offload_fsdp_model_to_cpu(model, empty_cache=True)``  FSDP1 flat parameters, FSDP2 / plain modules: the
``load_fsdp_model_to_gpu(model)``                       rank's shards and buffers (gradients as verl: left
``offload_fsdp2_model_to_cpu(model, empty_cache=True)`` on the device for FSDP1, moved for FSDP2/plain)
``load_fsdp2_model_to_gpu(model)``
``offload_fsdp_optimizer(optimizer)``                   every optimizer state tensor (``device_id`` is
``load_fsdp_optimizer(optimizer, device_id)``           accepted: the state returns to where it was)
``offload_megatron_model_to_cpu(models)``               DDP chunks: ``param_data`` (or the parameters)
``load_megatron_model_to_gpu(models, load_grad=True,    copied, ``grad_data`` released without a copy and
load_frozen_params=True)``                              zeroed on load (``load_grad=False``: left
                                                        released), frozen parameters moved (kept on the
                                                        host with ``load_frozen_params=False``); other
                                                        chunks: parameters and gradients moved
``offload_megatron_copy_params(optimizers)``            the fp32 ``shard_fp32_from_float16_groups``
``load_megatron_copy_params(optimizers)``
``offload_megatron_optimizer(optimizers)``              the fp32 masters and the inner optimizer's state
``load_megatron_optimizer(optimizers)``                 (``exp_avg``, ``exp_avg_sq``, ``master_param``,
                                                        ``step``), and the loss scale
=====================================================  ===================================================

All run under ``torch.no_grad()``, as verl's do. As there, moving what is already where it is sent is a
no-op (a load of a model that was never offloaded, a second offload). Keyword-only extras: ``grads`` (the
``gpu_offload.offload`` word; the defaults are verl's) and ``arena``. verl 0.9.1 moved
``copy_megatron_model_to_cpu`` / ``restore_megatron_model_from_cpu`` to ``verl/utils/megatron_utils.py``
too; their drop-ins are in ``gpu_offload.integrations.megatron``.

**The slots (DetachActorWorker).**

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
import sys
from typing import Any, Hashable, Optional, Sequence

import torch

from .. import api
from .. import registry as _registry
from .._errors import OffloadError
from ..adapters import gradient_tensors, megatron as _meg, named_tensors
from ..arena import Arena
from ..snapshot import Snapshot
from ..storages import unwrap

logger = logging.getLogger("gpu_offload")

__all__ = [
    "GpuOffloadSlotsMixin",
    "load_fsdp2_model_to_gpu",
    "load_fsdp_model_to_gpu",
    "load_fsdp_optimizer",
    "load_megatron_copy_params",
    "load_megatron_model_to_gpu",
    "load_megatron_optimizer",
    "offload_fsdp2_model_to_cpu",
    "offload_fsdp_model_to_cpu",
    "offload_fsdp_optimizer",
    "offload_megatron_copy_params",
    "offload_megatron_model_to_cpu",
    "offload_megatron_optimizer",
]

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


# -- verl's offload helpers --------------------------------------------------------------------------------


def _key(t: torch.Tensor) -> int:
    return unwrap(t).untyped_storage()._cdata


def _offload(target: Any, *, grads: str, empty_cache: bool, arena: Optional[Arena]) -> None:
    """gpu_offload.offload, with what is offloaded (or holds no memory) already skipped, as verl's helpers skip
    what is on the host already."""
    state = named_tensors(target, include_grads=False)
    with _registry.lock:
        partly = any(_key(t) in _registry.entries for _, t in state)
    if not partly:  # the common case: the target itself (its plan is cached, its modules guarded)
        if any(unwrap(t).untyped_storage().nbytes() for _, t in state) or (grads != "keep" and any(
                unwrap(t).untyped_storage().nbytes() for _, t in gradient_tensors(target))):
            api.offload(target, grads=grads, empty_cache=empty_cache, arena=arena)
        return
    # Partly offloaded already (e.g. load_megatron_model_to_gpu(..., load_frozen_params=False)): the rest, as
    # a mapping of its tensors.
    with _registry.lock:
        live = {n: t for n, t in state if _key(t) not in _registry.entries and unwrap(t).untyped_storage().nbytes()}
        if grads == "copy":
            live.update((n, t) for n, t in gradient_tensors(target)
                        if _key(t) not in _registry.entries and unwrap(t).untyped_storage().nbytes())
    if live:
        api.offload(live, empty_cache=False, arena=arena)
    if grads == "drop":
        with _registry.lock:
            api._drop(api._grads_to_drop(gradient_tensors(target), {_key(t) for _, t in state}))
    with _registry.lock:  # the hooks, for what of the target is offloaded now (its parts offloaded apart)
        _registry.guard(target, [k for k in map(_key, (t for _, t in state)) if k in _registry.entries])
    if empty_cache:
        api._empty_cache(sorted({unwrap(t).device for _, t in state}, key=str))


def _reload(target: Any) -> None:
    """gpu_offload.reload of whatever in the target is offloaded; nothing offloaded: a no-op."""
    named = named_tensors(target, include_grads=True, reshard=False)
    with _registry.lock:
        if not any(_key(t) in _registry.entries for _, t in named):
            return
    api.reload(target)
    _registry.unguard(target)


def _model_grads(model: torch.nn.Module) -> str:
    # verl's FSDP1 path moves the flat parameters alone (handle.flat_param_to): gradients stay. Its FSDP2 and
    # plain path is model.to("cpu"), which moves the gradients with the parameters.
    from ..adapters import fsdp as _fsdp

    return "keep" if _fsdp.is_fsdp1(model) else "copy"


@torch.no_grad()
def offload_fsdp_model_to_cpu(model: torch.nn.Module, empty_cache: bool = True, *, grads: Optional[str] = None,
                              arena: Optional[Arena] = None) -> None:
    """verl's ``offload_fsdp_model_to_cpu``: the rank's FSDP1 flat-parameter shards or FSDP2 / plain module
    state, and the buffers, into the arena; the device memory freed (and returned to the driver with
    ``empty_cache``). Gradients: ``grads`` (default as verl: kept on the device for FSDP1, moved for FSDP2 and
    plain modules; ``"drop"`` frees them, zeroed on load)."""
    _offload(model, grads=grads or _model_grads(model), empty_cache=empty_cache, arena=arena)


@torch.no_grad()
def offload_fsdp2_model_to_cpu(model: torch.nn.Module, empty_cache: bool = True, *, grads: Optional[str] = None,
                               arena: Optional[Arena] = None) -> None:
    """verl's ``offload_fsdp2_model_to_cpu`` (``model.to("cpu")`` there): FSDP2 or plain module state, buffers
    and (by default, as ``model.to`` does) gradients into the arena."""
    _offload(model, grads=grads or "copy", empty_cache=empty_cache, arena=arena)


@torch.no_grad()
def load_fsdp_model_to_gpu(model: torch.nn.Module) -> None:
    """verl's ``load_fsdp_model_to_gpu``: brings back what ``offload_fsdp_model_to_cpu`` moved, in place (the
    same flat parameters and DTensors); gradients it dropped come back zeroed. A no-op when nothing of the
    model is offloaded."""
    _reload(model)


@torch.no_grad()
def load_fsdp2_model_to_gpu(model: torch.nn.Module) -> None:
    """verl's ``load_fsdp2_model_to_gpu``: as ``load_fsdp_model_to_gpu``."""
    _reload(model)


@torch.no_grad()
def offload_fsdp_optimizer(optimizer: torch.optim.Optimizer, *, arena: Optional[Arena] = None) -> None:
    """verl's ``offload_fsdp_optimizer``: every tensor of the optimizer's state into the arena (an optimizer
    without state yet: a no-op). As verl's, it leaves the cache to the model's offload."""
    if not optimizer.state:
        return
    _offload(optimizer, grads="keep", empty_cache=False, arena=arena)


@torch.no_grad()
def load_fsdp_optimizer(optimizer: torch.optim.Optimizer, device_id: Any = None) -> None:
    """verl's ``load_fsdp_optimizer``: the state back where it was, in place. ``device_id`` is accepted for
    verl's signature; the state returns to the device it left."""
    if not optimizer.state:
        return
    _reload(optimizer)


def _chunk_list(models: Any) -> list[Any]:
    return list(models) if isinstance(models, (list, tuple)) else [models]


def _clear_te_fp8_workspaces(chunk: Any) -> None:
    # As verl 0.9.1: Transformer Engine's cached FP8 weight copies are no parameters or buffers, and are
    # rebuilt by the next forward.
    for sub in chunk.modules():
        workspaces = getattr(sub, "_fp8_workspaces", None)
        if isinstance(workspaces, dict):
            workspaces.clear()


@torch.no_grad()
def offload_megatron_model_to_cpu(models: Sequence[Any], *, arena: Optional[Arena] = None) -> None:
    """verl's ``offload_megatron_model_to_cpu``: for each DDP chunk the flat ``param_data`` (or, without the
    distributed optimizer, the parameters' own storages), the frozen parameters and the buffers are copied
    into the arena and released; ``grad_data`` is released **without a copy** (``grads="drop"``). Chunks
    that are not DDP-wrapped (a reference model) move their parameters and gradients. The cache is emptied."""
    chunks = _chunk_list(models)
    ddp = [c for c in chunks if _meg.is_megatron_ddp(c)]
    plain = [c for c in chunks if not _meg.is_megatron_ddp(c)]
    if ddp:
        _offload(ddp, grads="drop", empty_cache=False, arena=arena)
    if plain:
        _offload(plain, grads="copy", empty_cache=False, arena=arena)
    for chunk in chunks:
        _clear_te_fp8_workspaces(chunk)
    api._empty_cache([torch.device("cuda")])


@torch.no_grad()
def load_megatron_model_to_gpu(models: Sequence[Any], load_grad: bool = True, load_frozen_params: bool = True) -> None:
    """verl's ``load_megatron_model_to_gpu``: the chunks' parameters back in place (params stay views into
    ``param_data``); with ``load_grad`` the grad buffers re-allocated and zeroed (``main_grad`` stays a view),
    without it left released (pure inference); with ``load_frozen_params`` the frozen parameters too."""
    chunks = _chunk_list(models)
    parts: dict[str, torch.Tensor] = {}
    for i, chunk in enumerate(chunks):
        named = named_tensors(chunk, include_grads=False, reshard=False)
        if _meg.is_megatron_ddp(chunk):
            frozen = {_key(p) for p in chunk.parameters() if not p.requires_grad}
            trainable = {_key(p) for p in chunk.parameters() if p.requires_grad}
            parts.update((f"{i}.{n}", t) for n, t in named
                         if load_frozen_params or _key(t) not in frozen or _key(t) in trainable)
            if load_grad:
                parts.update((f"{i}.{n}", t) for n, t in gradient_tensors(chunk))
        else:  # verl moves a reference chunk's parameters and gradients back, whatever the flags
            parts.update((f"{i}.{n}", t) for n, t in named_tensors(chunk, include_grads=True, reshard=False))
    _reload(parts)
    _registry.unguard(chunks)
    api._empty_cache([torch.device("cuda")])


def _sub_optimizers(optimizers: Any) -> list[Any]:
    return [sub for opt in _chunk_list(optimizers) for sub in (getattr(opt, "chained_optimizers", None) or [opt])]


def _copy_params(optimizers: Any) -> list[torch.Tensor]:
    return [t for opt in _sub_optimizers(optimizers) for group in (getattr(opt, "shard_fp32_from_float16_groups",
                                                                           None) or []) for t in group if t is not None]


@torch.no_grad()
def offload_megatron_copy_params(optimizers: Any, *, arena: Optional[Arena] = None) -> None:
    """verl's ``offload_megatron_copy_params``: the distributed optimizer's fp32 master shards
    (``shard_fp32_from_float16_groups``) of every (chained) optimizer into the arena."""
    params = _copy_params(optimizers)
    if params:
        _offload(params, grads="keep", empty_cache=False, arena=arena)


@torch.no_grad()
def load_megatron_copy_params(optimizers: Any) -> None:
    """verl's ``load_megatron_copy_params``: the fp32 master shards back in place."""
    params = _copy_params(optimizers)
    if params:
        _reload(params)


def _free_megatron_scratch() -> None:
    # As verl: Transformer Engine's dummy weight-gradient cache and Megatron's global memory buffer are
    # scratch that the next step re-creates. Neither is imported here: only cleared where loaded.
    te = sys.modules.get("transformer_engine.pytorch.module.base")
    dummy = getattr(te, "_dummy_wgrads", None)
    if isinstance(dummy, dict):
        dummy.clear()
    ps = sys.modules.get("megatron.core.parallel_state")
    cached = getattr(getattr(ps, "_GLOBAL_MEMORY_BUFFER", None), "buffer", None)
    if isinstance(cached, dict):
        cached.clear()


@torch.no_grad()
def offload_megatron_optimizer(optimizers: Any, *, arena: Optional[Arena] = None) -> None:
    """verl's ``offload_megatron_optimizer``: every (chained) Megatron optimizer's device state into the arena:
    the fp32 masters (what ``offload_megatron_copy_params`` moves), the inner optimizer's state (Adam's
    ``exp_avg``, ``exp_avg_sq``, ``step``; ``master_param`` with the precision-aware optimizer) and the loss
    scale. Megatron's global memory buffer and Transformer Engine's dummy gradients are freed and the cache
    emptied, as verl does."""
    opts = _chunk_list(optimizers)
    if any(named_tensors(opt, include_grads=False) for opt in opts):
        _offload(opts, grads="keep", empty_cache=False, arena=arena)
    _free_megatron_scratch()
    api._empty_cache([torch.device("cuda")])


@torch.no_grad()
def load_megatron_optimizer(optimizers: Any) -> None:
    """verl's ``load_megatron_optimizer``: the state ``offload_megatron_optimizer`` moved, back in place."""
    _reload(_chunk_list(optimizers))
    api._empty_cache([torch.device("cuda")])
