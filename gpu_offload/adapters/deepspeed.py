"""Device state of DeepSpeed engines, ZeRO optimizers (stages 0-3) and ZeRO-3 partitioned modules.

DeepSpeed is never imported here: an object can only be a DeepSpeed one if its module is already loaded,
so detection looks the classes up in ``sys.modules``. Attribute names are read from the installed
version; a layout this module does not know raises ``OffloadError`` naming the version (tested with
0.19.8).

What each stage keeps on the device, and what is named here (``[S]`` = the 16-bit model state,
``[H]`` = the fp32 masters, ``[O]`` = the inner optimizer's state, ``[G]`` = gradients, only with
``include_grads``):

* ZeRO 1/2 (``DeepSpeedZeroOptimizer``): ``bit16_groups_flat[i]`` [S], one flat buffer per parameter
  group that every model parameter's ``.data`` is a view into (so the module's parameters name the same
  storages); this rank's fp32 partition ``single_partition_of_fp32_groups[i]`` [H]; the inner torch
  optimizer's state keyed by that partition [O]; ``averaged_gradients`` (views into this rank's
  gradient partition), ``grads_in_partition`` and any ``.grad`` of a master or model parameter [G].
* ZeRO 3 (``DeepSpeedZeroOptimizer_Stage3``): each parameter's partition ``param.ds_tensor`` [S] (views
  into one ``lp_param_buffer``, as are ``fp16_partitioned_groups_flat[i]``); ``fp32_partitioned_groups_flat[i]``
  [H]; the inner optimizer's state keyed by those [O] (stage 3 empties the inner ``param_groups`` between
  steps, so the state is looked up by the masters, not by ``param_groups``); ``grad_partitions_flat_buffer``
  and ``averaged_gradients`` [G]. Parameters gathered at the time of a write (a restore or an offload:
  after a forward, and the persistent small parameters that stay gathered) are released first, as
  DeepSpeed's own ``offload_states`` does; the next forward gathers them again. Reads release nothing:
  the partitions are what a gathered copy is made from.
* Stage 0: the model's parameters; with bf16/fp16 ``FP16_UnfusedOptimizer``'s fp32 masters
  ``fp32_groups[g][i]`` [H] and the inner state [O]; in fp32 the optimizer is a plain torch optimizer.

Not named (scratch DeepSpeed re-creates, or state that is no tensor): the reduction buckets
(``ipg_buckets``), gathered full parameters, the loss scale and step counters (Python numbers).
Refused: ZeRO-Offload / ZeRO-Infinity configurations (``offload_optimizer`` / ``offload_param``: that state
already lives on the host or NVMe), hpZ secondary partitions (``zero_hpz_partition_size > 1``), and an
engine whose states DeepSpeed's own ``offload_states`` has moved (reload them first).
"""

from __future__ import annotations

import itertools
import logging
import sys
from typing import Any, Iterable

import torch

from .._errors import OffloadError
from .strategy import Strategy

logger = logging.getLogger(__name__)

__all__ = [
    "is_deepspeed_engine",
    "is_deepspeed_optimizer",
    "is_zero3_module",
    "is_deepspeed",
    "deepspeed_version",
    "deepspeed_state",
    "engine_named_tensors",
    "optimizer_named_tensors",
    "zero3_module_named_tensors",
    "deepspeed_shard_info",
    "release_gathered",
    "DEEPSPEED_ENGINE",
    "ZERO3_MODULE",
    "DEEPSPEED_OPTIMIZER",
]

_ENGINE = ("deepspeed.runtime.engine", "DeepSpeedEngine")
_BASE_OPT = ("deepspeed.runtime.base_optimizer", "DeepSpeedOptimizer")
_ZERO12 = ("deepspeed.runtime.zero.stage_1_and_2", "DeepSpeedZeroOptimizer")
_ZERO3 = ("deepspeed.runtime.zero.stage3", "DeepSpeedZeroOptimizer_Stage3")
_ZERO3_NO_OPT = ("deepspeed.runtime.zero.parameter_offload", "DeepSpeedZeRoOffload")
_UNFUSED = ("deepspeed.runtime.fp16.unfused_optimizer", "FP16_UnfusedOptimizer")

#: The state categories, by DeepSpeed's OffloadStateTypeEnum values.
CATEGORIES = ("lp_params", "hp_params", "optim_states", "lp_grads")

Named = list[tuple[str, torch.Tensor]]


def _isinstance(obj: Any, where: tuple[str, str]) -> bool:
    mod = sys.modules.get(where[0])
    cls = getattr(mod, where[1], None) if mod is not None else None
    return cls is not None and isinstance(obj, cls)


def deepspeed_version() -> str:
    """The installed (imported) DeepSpeed's version, or "not imported"."""
    mod = sys.modules.get("deepspeed")
    return str(getattr(mod, "__version__", "unknown")) if mod is not None else "not imported"


def _unsupported(what: str) -> OffloadError:
    return OffloadError(f"DeepSpeed {deepspeed_version()}: {what}; gpu_offload supports the layouts of "
                        "DeepSpeed 0.19 (tested with 0.19.8) and does not guess at others")


def _attr(obj: Any, name: str) -> Any:
    if not hasattr(obj, name):
        raise _unsupported(f"{type(obj).__name__} has no attribute {name!r} (an unknown layout)")
    return getattr(obj, name)


def is_deepspeed_engine(obj: Any) -> bool:
    """True for a ``deepspeed.DeepSpeedEngine`` (what ``deepspeed.initialize`` returns)."""
    return _isinstance(obj, _ENGINE)


def is_deepspeed_optimizer(obj: Any) -> bool:
    """True for any DeepSpeed optimizer wrapper (ZeRO 1/2/3, the fp16/bf16 wrappers of stage 0)."""
    return _isinstance(obj, _BASE_OPT) or _isinstance(obj, _ZERO3_NO_OPT)


def is_zero3_module(module: Any) -> bool:
    """True for a module whose parameters ZeRO-3 partitions (they carry ``ds_tensor``)."""
    if "deepspeed" not in sys.modules or not isinstance(module, torch.nn.Module):
        return False
    return any_zero3_param(module.parameters())


def any_zero3_param(params: Iterable[torch.Tensor]) -> bool:
    """Whether any of these parameters is one ZeRO-3 converted (it carries ``ds_tensor``)."""
    return any(map(hasattr, params, itertools.repeat("ds_tensor")))


def is_deepspeed(obj: Any) -> bool:
    """True for anything this module owns: an engine, a DeepSpeed optimizer or a ZeRO-3 module."""
    return is_deepspeed_engine(obj) or is_deepspeed_optimizer(obj) or is_zero3_module(obj)


# --------------------------------------------------------------------------------------------- checks


def _check_optimizer(opt: Any) -> None:
    """Refuses the configurations whose state is not (only) on the device, and DeepSpeed's own offload."""
    moved = getattr(opt, "offloaded_states", None)
    if moved:
        names = sorted(getattr(s, "value", str(s)) for s in moved)
        raise OffloadError(f"DeepSpeed's own offload_states() has moved {', '.join(names)} of this engine; call "
                           "engine.reload_states() before using gpu_offload on it")
    if _isinstance(opt, _ZERO12) and getattr(opt, "cpu_offload", False):
        raise _unsupported("ZeRO-Offload (offload_optimizer) keeps the fp32 state on the host already; "
                           "not supported")
    if _isinstance(opt, _ZERO3):
        if getattr(opt, "offload_optimizer", False) or getattr(opt, "offload_param", False):
            raise _unsupported("ZeRO-3 with offload_optimizer/offload_param keeps that state on the host or NVMe "
                               "already; not supported")
        if int(getattr(opt, "zero_hpz_partition_size", 1) or 1) > 1:
            raise _unsupported("ZeRO++ hierarchical partitioning (zero_hpz_partition_size > 1) is not supported")


def _stage(opt: Any) -> int:
    if _isinstance(opt, _ZERO3) or _isinstance(opt, _ZERO3_NO_OPT):
        return 3
    if _isinstance(opt, _ZERO12):
        return 2 if _attr(opt, "partition_gradients") else 1
    return 0


# ------------------------------------------------------------------------------------------- the state


def _inner_state(inner: Any, masters: list[torch.Tensor], prefix: str, out: Named) -> None:
    """The inner torch optimizer's state, looked up by the master tensors (numbered as listed)."""
    state = _attr(inner, "state")
    for i, master in enumerate(masters):
        entry = state.get(master)
        for key in sorted(entry or ()):
            value = entry[key]
            # "<key>_offload_buffer": the host copies DeepSpeed's own stage-3 offload_states keeps in the state
            # after its first use; not device state.
            if isinstance(value, torch.Tensor) and not key.endswith("_offload_buffer"):
                out.append((f"{prefix}state.{i}.{key}", value))


def _grad_list(value: Any, prefix: str, out: Named) -> None:
    if isinstance(value, torch.Tensor):
        out.append((prefix, value))
    elif isinstance(value, (list, tuple)):
        for i, g in enumerate(value):
            if isinstance(g, torch.Tensor):
                out.append((f"{prefix}.{i}", g))


def _optimizer_state(opt: Any, include_grads: bool) -> dict[str, Named]:
    """The optimizer's part of the state by category (names relative to the optimizer)."""
    _check_optimizer(opt)
    cats: dict[str, Named] = {c: [] for c in CATEGORIES}
    if _isinstance(opt, _ZERO3_NO_OPT):
        return cats  # ZeRO-3 without an optimizer: the state is the module's partitions
    if _isinstance(opt, _ZERO12):
        for i, flat in enumerate(_attr(opt, "bit16_groups_flat")):
            cats["lp_params"].append((f"bit16_groups_flat.{i}", flat))
        masters = list(_attr(opt, "single_partition_of_fp32_groups"))
        cats["hp_params"].extend((f"single_partition_of_fp32_groups.{i}", m) for i, m in enumerate(masters))
        _inner_state(_attr(opt, "optimizer"), masters, "", cats["optim_states"])
        if include_grads:
            grads = cats["lp_grads"]
            for g, value in sorted((_attr(opt, "averaged_gradients") or {}).items()):
                _grad_list(value, f"averaged_gradients.{g}", grads)
            _grad_list(getattr(opt, "grads_in_partition", None), "grads_in_partition", grads)
            grads.extend((f"single_partition_of_fp32_groups.{i}.grad", m.grad) for i, m in enumerate(masters)
                         if m.grad is not None)
        return cats
    if _isinstance(opt, _ZERO3):
        for i, flat in enumerate(_attr(opt, "fp16_partitioned_groups_flat")):
            cats["lp_params"].append((f"fp16_partitioned_groups_flat.{i}", flat))
        masters = list(_attr(opt, "fp32_partitioned_groups_flat"))
        cats["hp_params"].extend((f"fp32_partitioned_groups_flat.{i}", m) for i, m in enumerate(masters))
        _inner_state(_attr(opt, "optimizer"), masters, "", cats["optim_states"])
        if include_grads:
            grads = cats["lp_grads"]
            _grad_list(_attr(opt, "grad_partitions_flat_buffer"), "grad_partitions_flat_buffer", grads)
            for g, value in sorted((_attr(opt, "averaged_gradients") or {}).items()):
                _grad_list(value, f"averaged_gradients.{g}", grads)
            grads.extend((f"fp32_partitioned_groups_flat.{i}.grad", m.grad) for i, m in enumerate(masters)
                         if m.grad is not None)
        return cats
    if _isinstance(opt, _UNFUSED):
        masters = [m for group in _attr(opt, "fp32_groups") for m in group]
        for g, group in enumerate(_attr(opt, "fp32_groups")):
            for i, m in enumerate(group):
                cats["hp_params"].append((f"fp32_groups.{g}.{i}", m))
                if include_grads and m.grad is not None:
                    cats["lp_grads"].append((f"fp32_groups.{g}.{i}.grad", m.grad))
        _inner_state(_attr(opt, "optimizer"), masters, "", cats["optim_states"])
        return cats
    if isinstance(opt, torch.optim.Optimizer):  # stage 0 in fp32: DeepSpeed hands the torch optimizer back
        from . import torch_optimizer_tensors

        cats["optim_states"].extend(torch_optimizer_tensors(opt))
        return cats
    raise _unsupported(f"optimizer {type(opt).__module__}.{type(opt).__qualname__} is not supported (supported: "
                       "DeepSpeedZeroOptimizer, DeepSpeedZeroOptimizer_Stage3, FP16_UnfusedOptimizer, torch optimizers)")


def release_gathered(module: torch.nn.Module, optimizer: Any = None) -> None:
    """Releases the ZeRO-3 parameters gathered now (after a forward; the persistent ones), so that their
    partitions are the only copy. Local: no collective runs (a gathered parameter's partition is kept)."""
    gathered = [(n, p) for n, p in module.named_parameters() if hasattr(p, "ds_tensor")
                and getattr(getattr(p, "ds_status", None), "name", "NOT_AVAILABLE") != "NOT_AVAILABLE"]
    if not gathered:
        return
    busy = [n for n, p in gathered if getattr(p.ds_status, "name", "") == "INFLIGHT" or p.ds_active_sub_modules]
    if busy:
        raise OffloadError(f"ZeRO-3 parameter {busy[0]!r} (and {len(busy) - 1} more) is in use by a forward/backward "
                           "or a GatheredParameters context; snapshot, restore or offload between training steps")
    logger.debug("releasing %d gathered ZeRO-3 parameters before writing their partitions", len(gathered))
    if optimizer is not None and hasattr(optimizer, "empty_partition_cache"):
        optimizer.empty_partition_cache()  # what DeepSpeed's offload_states does: through the coordinator
    else:
        for _, p in gathered:
            p.partition()  # frees the gathered copy; the partition (ds_tensor) holds the data


def _zero3_module_state(module: torch.nn.Module, include_grads: bool) -> dict[str, Named]:
    cats: dict[str, Named] = {c: [] for c in CATEGORIES}
    for name, p in module.named_parameters(remove_duplicate=False):
        if hasattr(p, "ds_tensor"):
            if p.ds_tensor is None:
                raise _unsupported(f"ZeRO-3 parameter {name!r} has no partition (ds_tensor is None)")
            cats["lp_params"].append((f"{name}.ds_tensor", p.ds_tensor))
        else:  # a parameter ZeRO-3 does not manage: replicated, kept whole
            cats["lp_params"].append((name, p))
        if include_grads and p.grad is not None and p.grad.numel() > 0:
            cats["lp_grads"].append((f"{name}.grad", p.grad))
    cats["lp_params"].extend(module.named_buffers(remove_duplicate=False))
    return cats


def _module_state(module: torch.nn.Module, include_grads: bool) -> dict[str, Named]:
    if is_zero3_module(module):
        return _zero3_module_state(module, include_grads)
    from . import plain_module_tensors

    cats: dict[str, Named] = {c: [] for c in CATEGORIES}
    cats["lp_params"] = plain_module_tensors(module, include_grads=False)
    if include_grads:
        cats["lp_grads"] = [(f"{name}.grad", p.grad) for name, p in module.named_parameters(remove_duplicate=False)
                            if p.grad is not None]
    return cats


def deepspeed_state(target: Any, *, include_grads: bool, reshard: bool = True) -> dict[str, Named]:
    """The device state of an engine, a DeepSpeed optimizer or a ZeRO-3 module, by DeepSpeed's state
    categories (``lp_params``, ``hp_params``, ``optim_states``, ``lp_grads``), each a list of
    (name, tensor). For an engine the names start with ``module.`` and ``optimizer.``.

    reshard: release ZeRO-3 parameters gathered now (writes need it; reads pass False).
    """
    if is_deepspeed_engine(target):
        module = _attr(target, "module")
        opt = getattr(target, "optimizer", None)
        if opt is not None:
            _check_optimizer(opt)
        if reshard and is_zero3_module(module):
            release_gathered(module, opt)
        cats = {c: [(f"module.{n}", t) for n, t in items] for c, items in _module_state(module, include_grads).items()}
        if opt is not None:
            for c, items in _optimizer_state(opt, include_grads).items():
                cats[c].extend((f"optimizer.{n}", t) for n, t in items)
        return cats
    if is_deepspeed_optimizer(target):
        cats = _optimizer_state(target, include_grads)
        # The optimizer alone is its fp32 masters and their state: the 16-bit weights are the module's.
        cats["lp_params"] = []
        return cats
    if is_zero3_module(target):
        if reshard:
            release_gathered(target)
        return _module_state(target, include_grads)
    raise OffloadError(f"{type(target).__qualname__} is not a DeepSpeed engine, optimizer or ZeRO-3 module")


def _flatten(cats: dict[str, Named]) -> Named:
    return [item for c in CATEGORIES for item in cats[c]]


def engine_named_tensors(engine: Any, *, include_grads: bool, reshard: bool = True) -> Named:
    """An engine's device state: its module's (``module.<...>``) and its optimizer's (``optimizer.<...>``)."""
    return _flatten(deepspeed_state(engine, include_grads=include_grads, reshard=reshard))


def optimizer_named_tensors(opt: Any, *, include_grads: bool = False) -> Named:
    """A DeepSpeed optimizer's own state: fp32 master partitions and the inner state (grads if asked)."""
    return _flatten(deepspeed_state(opt, include_grads=include_grads))


def zero3_module_named_tensors(module: torch.nn.Module, *, include_grads: bool, reshard: bool = True) -> Named:
    """A ZeRO-3 module's device state: ``<name>.ds_tensor`` per parameter, then buffers (grads if asked)."""
    return _flatten(deepspeed_state(module, include_grads=include_grads, reshard=reshard))


def _named(obj: Any, *, include_grads: bool, reshard: bool = True) -> tuple[Named, Named]:
    cats = deepspeed_state(obj, include_grads=include_grads, reshard=reshard)
    return [item for c in CATEGORIES if c != "lp_grads" for item in cats[c]], cats["lp_grads"]


# ------------------------------------------------------------------------------------------ validation


def _coords(group: Any) -> tuple[int, int]:
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def _optimizer_info(opt: Any) -> dict[str, Any]:
    info: dict[str, Any] = {"optimizer": type(opt).__name__, "stage": _stage(opt)}
    if _isinstance(opt, _ZERO12):
        groups = _attr(opt, "real_dp_process_group")
        info["dp"] = [list(_coords(g)) for g in groups]
        info["lp_numels"] = [int(t.numel()) for t in _attr(opt, "bit16_groups_flat")]
        info["partition_numels"] = [int(t.numel()) for t in _attr(opt, "single_partition_of_fp32_groups")]
    elif _isinstance(opt, _ZERO3):
        info["dp"] = list(_coords(_attr(opt, "dp_process_group")))
        info["lp_numels"] = [int(t.numel()) for t in _attr(opt, "fp16_partitioned_groups_flat")]
        info["partition_numels"] = [int(t.numel()) for t in _attr(opt, "fp32_partitioned_groups_flat")]
    return info


def _zero3_module_info(module: torch.nn.Module) -> dict[str, Any]:
    world, rank = 1, 0
    parts: dict[str, int] = {}
    for name, p in module.named_parameters():
        if hasattr(p, "ds_tensor"):
            world, rank = _coords(getattr(p, "ds_process_group", None))
            parts[name] = int(p.ds_tensor.numel()) if p.ds_tensor is not None else -1
    return {"world_size": world, "rank": rank, "partition_numels": parts}


def deepspeed_shard_info(obj: Any) -> dict[str, Any]:
    """ZeRO stage, data-parallel rank and world size and partition sizes of an engine, optimizer or ZeRO-3
    module. Two snapshots restore into each other only when these dicts are equal; no collective runs."""
    if is_deepspeed_engine(obj):
        info: dict[str, Any] = {"kind": "deepspeed_engine", "stage": int(obj.zero_optimization_stage())}
        info["dp"] = list(_coords(getattr(obj, "data_parallel_group", None)))
        opt = getattr(obj, "optimizer", None)
        if opt is not None and not isinstance(opt, torch.optim.Optimizer):
            info["optimizer"] = _optimizer_info(opt)
        if is_zero3_module(obj.module):
            info["module"] = _zero3_module_info(obj.module)
        return info
    if is_deepspeed_optimizer(obj):
        return {"kind": "deepspeed_optimizer", **_optimizer_info(obj)}
    if is_zero3_module(obj):
        return {"kind": "deepspeed_zero3_module", **_zero3_module_info(obj)}
    raise OffloadError(f"{type(obj).__qualname__} is not a DeepSpeed engine, optimizer or ZeRO-3 module")


# -------------------------------------------------------------------------------------- the strategies

#: A DeepSpeed engine (its module and optimizer), a module whose parameters ZeRO-3 partitions, and a
#: DeepSpeed optimizer alone (its fp32 masters and inner state). Gradients are the ``lp_grads`` category.
DEEPSPEED_ENGINE = Strategy("deepspeed_engine", is_deepspeed_engine, _named, deepspeed_shard_info)
ZERO3_MODULE = Strategy("deepspeed_zero3_module", is_zero3_module, _named, deepspeed_shard_info)
DEEPSPEED_OPTIMIZER = Strategy("deepspeed_optimizer", is_deepspeed_optimizer, _named, deepspeed_shard_info)
