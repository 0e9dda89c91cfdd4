"""Drop-ins for DeepSpeed's ``engine.offload_states()`` / ``engine.reload_states()``.

OpenRLHF and other DeepSpeed trainers free the GPU for generation with::

    engine.offload_states()            # DeepSpeed >= 0.16
    ...generate with vLLM...
    engine.reload_states()

DeepSpeed's own (0.19.8) pins new host buffers on every call for stages 1/2 (per engine on first use for
stage 3), copies tensor group by tensor group, asserts FusedAdam for stage 3, and (stage 3) drops the
reduction bucket. These take the same arguments
and do the same job through gpu_offload: one batched copy into the shared pinned arena, the same tensor
objects afterwards (storages are released and re-allocated in place), any optimizer, stages 0-3::

    from gpu_offload.integrations.deepspeed import offload_states, reload_states
    offload_states(engine)
    reload_states(engine)

What each of DeepSpeed's ``OffloadStateTypeEnum`` values selects (see gpu_offload.adapters.deepspeed):

=========================  ===========================================================================
``lp_params``              the 16-bit (or fp32 when training in fp32) model weights: ZeRO 1/2
                           ``bit16_groups_flat``, ZeRO-3 ``ds_tensor`` partitions (``lp_param_buffer``),
                           stage 0 the parameters; and the module's buffers. ZeRO-3 parameters gathered
                           now (the persistent ones below ``stage3_param_persistence_threshold``, whole
                           on every rank) are released first, and only then: without ``lp_params`` they
                           stay as they are, ready for a forward
``hp_params``              the fp32 master partitions (``single_partition_of_fp32_groups``,
                           ``fp32_partitioned_groups_flat``, stage-0 ``fp32_groups``)
``optim_states``           the inner optimizer's state (Adam's moments and step), any optimizer
``lp_grads``               gradients: ``averaged_gradients`` / ``grads_in_partition`` (ZeRO 1/2),
                           ``grad_partitions_flat_buffer`` (ZeRO-3), any ``.grad``
``contiguous_grad_buffer`` ZeRO-3's reduction bucket: released and re-allocated *without* its contents
                           (it is scratch; DeepSpeed does the same); nothing for other stages
=========================  ===========================================================================

``include=None`` selects all of them. Values may be the enum members or their strings.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any, Container, Optional

import torch

from .. import api
from .. import registry as _registry
from .._errors import OffloadError
from ..adapters import deepspeed as _ds
from ..arena import Arena
from ..storages import unwrap

logger = logging.getLogger("gpu_offload")

__all__ = ["offload_states", "reload_states", "STATE_TYPES"]

#: DeepSpeed's OffloadStateTypeEnum values, in the order DeepSpeed lists them.
STATE_TYPES = ("optim_states", "hp_params", "lp_params", "lp_grads", "contiguous_grad_buffer")

# engine -> [(storage, nbytes)] of the reduction buckets released by offload_states (not copied).
_released_buckets: "weakref.WeakKeyDictionary[Any, list[tuple[torch.UntypedStorage, int]]]" = weakref.WeakKeyDictionary()


def _selected(include: Optional[Container[Any]]) -> set[str]:
    if include is None:
        return set(STATE_TYPES)
    if isinstance(include, (str, bytes)):
        raise OffloadError("include must be a collection of OffloadStateTypeEnum values, e.g. "
                           "[OffloadStateTypeEnum.optim_states], not a single string")
    chosen = {str(getattr(v, "value", v)) for v in include}
    unknown = chosen - set(STATE_TYPES)
    if unknown:
        raise OffloadError(f"unknown offload state type(s) {sorted(unknown)}; expected OffloadStateTypeEnum values "
                           f"{list(STATE_TYPES)}")
    return chosen


def _buckets(engine: Any) -> list[torch.Tensor]:
    opt = getattr(engine, "optimizer", None)
    buckets = getattr(opt, "ipg_buckets", None)
    if not _ds._isinstance(opt, _ds._ZERO3) or not isinstance(buckets, dict):
        return []
    return [b.buffer for b in buckets.values() if isinstance(getattr(b, "buffer", None), torch.Tensor)]


def offload_states(engine: Any, include: Optional[Container[Any]] = None, device: Any = "cpu",
                   pin_memory: bool = True, non_blocking: bool = False, *, arena: Optional[Arena] = None) -> None:
    """Moves the selected states of a DeepSpeed engine into the pinned arena and frees their device memory.

    Same arguments as ``DeepSpeedEngine.offload_states``: ``include`` (OffloadStateTypeEnum values; None:
    all), ``device`` (only the CPU), ``pin_memory`` and ``non_blocking`` (accepted; the arena is always
    pinned and the copies are always ordered on the current stream). ``arena``: where the copy goes. As
    DeepSpeed's own, ``device=OffloadDeviceEnum.none`` ("none") moves nothing and logs a warning.

    Raises:
        OffloadError: not a DeepSpeed engine, a device other than the CPU (or none), an unsupported layout,
            or arena / host memory exhausted (then nothing has moved). States already offloaded are skipped,
            as DeepSpeed's own does.
    """
    if not _ds.is_deepspeed_engine(engine):
        raise OffloadError(f"offload_states needs a DeepSpeedEngine, got {type(engine).__qualname__}")
    if str(getattr(device, "value", device)) == "none":
        logger.warning("offload_states: no device specified for offloading states (device=none): nothing moved")
        return
    if str(getattr(device, "value", device)) != "cpu":
        raise OffloadError(f"offload_states moves states to the CPU only, got device={device!r}")
    chosen = _selected(include)
    # Gathered ZeRO-3 parameters (the persistent small ones, kept whole on every rank, and any a forward
    # left gathered) are 16-bit weights: released only when lp_params is asked for, so that a forward
    # with the weights kept (OpenRLHF during generation) finds them as they were.
    cats = _ds.deepspeed_state(engine, include_grads="lp_grads" in chosen, reshard="lp_params" in chosen)
    named = {name: t for c in _ds.CATEGORIES if c in chosen for name, t in cats[c]}
    # Only storages that hold memory (a released ZeRO-3 gathered copy, an unused grad list entry, ...).
    with _registry.lock:
        named = {n: t for n, t in named.items()
                 if unwrap(t).untyped_storage().nbytes() > 0 and _registry.storage_key(t) not in _registry.entries}
    if named:
        api.offload(named, include_grads=False, arena=arena)
        # Using the engine (a forward, step()) raises OffloadError until reload_states, as after offload(engine).
        with _registry.lock:
            _registry.guard(engine, [_registry.storage_key(t) for t in named.values()])
    if "contiguous_grad_buffer" in chosen:
        released = _released_buckets.setdefault(engine, [])
        for buf in _buckets(engine):
            storage = buf.untyped_storage()
            if storage.nbytes():
                released.append((storage, storage.nbytes()))
                storage.resize_(0)  # scratch: its contents are not kept, as DeepSpeed's own does
    if not named:  # as DeepSpeed's own: states already offloaded are skipped
        logger.debug("offload_states: the selected states hold no device memory (offloaded already?)")


def reload_states(engine: Any, non_blocking: bool = False) -> None:
    """Brings back what ``offload_states`` moved: the same tensors, refilled in place; the ZeRO-3 reduction
    bucket re-allocated. ``non_blocking`` is accepted for DeepSpeed's signature (copies are stream-ordered).
    As DeepSpeed's own, an engine with nothing offloaded is left as it is.

    Raises:
        OffloadError: not a DeepSpeed engine, or the device is out of memory (then the engine stays offloaded
            with its data intact; free memory and call again).
    """
    if not _ds.is_deepspeed_engine(engine):
        raise OffloadError(f"reload_states needs a DeepSpeedEngine, got {type(engine).__qualname__}")
    buckets = _released_buckets.pop(engine, [])
    try:
        if _offloaded_any(engine):
            api.reload(engine)
        elif not buckets:
            logger.debug("reload_states: nothing of this engine is offloaded")
            return
        for storage, nbytes in buckets:
            storage.resize_(nbytes)
    except BaseException:
        if buckets and any(s.nbytes() == 0 for s, _ in buckets):
            _released_buckets[engine] = [(s, n) for s, n in buckets if s.nbytes() == 0]
        raise


def _offloaded_any(engine: Any) -> bool:
    named = _ds.engine_named_tensors(engine, include_grads=True, reshard=False)
    with _registry.lock:
        return any(unwrap(t).untyped_storage()._cdata in _registry.entries for _, t in named)
