"""Device state of megatron-core DDP model chunks and Megatron optimizers.

megatron-core is never imported here: an object can only be a Megatron wrapper if its module is already
loaded, so detection looks the classes up in ``sys.modules``.

``DistributedDataParallel`` keeps its trainable parameters in ``_ParamAndGradBuffer`` objects
(``ddp.buffers`` and, for expert-parallel parameters, ``ddp.expert_parallel_buffers``). Each buffer has a
flat ``grad_data`` (every ``param.main_grad`` is a view into it) and, only with
``use_distributed_optimizer``, a flat ``param_data`` that every ``param.data`` is a view into. Without
the distributed optimizer the parameters keep their own storages. Resizing a flat buffer's storage in place
keeps all those views valid, which is what Megatron's own ``offload_to_cpu`` relies on too.

The optimizers hold fp32 master copies (``shard_fp32_from_float16_groups`` in ``DistributedOptimizer``,
``fp32_from_float16_groups`` in ``Float16OptimizerWithFloat16Params``) and the inner torch optimizer's
state. fp32 model parameters (and ``shard_fp32_groups``, views into ``param_data``) belong to the model
and are not reported again here.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import torch

from .._errors import OffloadError
from .strategy import Strategy

logger = logging.getLogger(__name__)

__all__ = [
    "is_megatron_ddp",
    "megatron_ddp_named_tensors",
    "is_megatron_optimizer",
    "megatron_optimizer_named_tensors",
    "megatron_shard_info",
    "MEGATRON_DDP",
    "MEGATRON_OPTIMIZER",
]

_DDP_MODULE = "megatron.core.distributed.distributed_data_parallel"
_BASE_DP_MODULE = "megatron.core.distributed.data_parallel_base"
_TORCH_FSDP_MODULE = "megatron.core.distributed.torch_fully_sharded_data_parallel"
_OPT_MODULE = "megatron.core.optimizer.optimizer"
_DISTOPT_MODULE = "megatron.core.optimizer.distrib_optimizer"


def _cls(module: str, name: str) -> type | None:
    mod = sys.modules.get(module)
    return getattr(mod, name, None) if mod is not None else None


def _isinstance(obj: Any, module: str, name: str) -> bool:
    cls = _cls(module, name)
    return cls is not None and isinstance(obj, cls)


def is_megatron_ddp(obj: Any) -> bool:
    """True for a megatron-core data-parallel wrapper whose state this module owns.

    That is ``DistributedDataParallel`` and the other ``_BaseDataParallel`` wrappers (Megatron-FSDP), which
    ``megatron_ddp_named_tensors`` rejects. ``TorchFullyShardedDataParallel`` is left to the FSDP2 adapter
    since its state is torch ``fully_shard`` state.
    """
    if _isinstance(obj, _TORCH_FSDP_MODULE, "TorchFullyShardedDataParallel"):
        return False
    return _isinstance(obj, _DDP_MODULE, "DistributedDataParallel") or _isinstance(
        obj, _BASE_DP_MODULE, "_BaseDataParallel"
    )


def _ddp_buffers(ddp: Any) -> list[tuple[str, Any]]:
    return [
        (f"{attr}.{i}", buf)
        for attr in ("buffers", "expert_parallel_buffers")
        for i, buf in enumerate(getattr(ddp, attr, None) or [])
    ]


def megatron_ddp_named_tensors(ddp: Any, *, include_grads: bool) -> list[tuple[str, torch.Tensor]]:
    """One DDP model chunk's device state.

    Names: ``buffers.<i>.param_data`` (distributed optimizer only), then every parameter and buffer under
    its ordinary ``module.<...>`` name (parameters inside ``param_data`` are views of it, which the core
    handles by storage); with ``include_grads`` ``buffers.<i>.grad_data`` and ``<name>.grad`` for any
    parameter whose gradient lives outside the grad buffers.
    """
    state, grads = _ddp_named(ddp, include_grads=include_grads)
    return state + grads


def _ddp_named(ddp: Any, *, include_grads: bool,
               reshard: bool = True) -> tuple[list[tuple[str, torch.Tensor]], list[tuple[str, torch.Tensor]]]:
    # reshard: nothing is gathered outside a forward/backward (the distributed optimizer's all-gather
    # writes param_data itself).
    if not _isinstance(ddp, _DDP_MODULE, "DistributedDataParallel"):
        raise OffloadError(
            f"unsupported Megatron data-parallel wrapper {type(ddp).__module__}.{type(ddp).__qualname__}: only "
            "megatron.core.distributed.DistributedDataParallel is supported"
        )
    if getattr(ddp.ddp_config, "use_megatron_fsdp", False) or getattr(ddp.ddp_config, "use_custom_fsdp", False):
        raise OffloadError("megatron-core DDP configured with use_megatron_fsdp is not supported")
    out: list[tuple[str, torch.Tensor]] = []
    grads: list[tuple[str, torch.Tensor]] = []
    grad_storages: set[int] = set()
    for name, buf in _ddp_buffers(ddp):
        if buf.param_data is not None:
            out.append((f"{name}.param_data", buf.param_data))
        if include_grads and buf.grad_data is not None:
            grads.append((f"{name}.grad_data", buf.grad_data))
            grad_storages.add(buf.grad_data.untyped_storage()._cdata)
    # Every name of a tied parameter is listed, as the core does for plain modules.
    for name, p in ddp.named_parameters(remove_duplicate=False):
        out.append((name, p))
        # Megatron accumulates into param.main_grad (a grad_data view) and keeps .grad None; a .grad that
        # exists anyway (frozen-buffer edge cases, user code) is state too unless it is a grad_data view.
        if include_grads and p.grad is not None and p.grad.untyped_storage()._cdata not in grad_storages:
            grads.append((f"{name}.grad", p.grad))
    out.extend(ddp.named_buffers(remove_duplicate=False))
    return out, grads


def is_megatron_optimizer(obj: Any) -> bool:
    """True for any ``megatron.core.optimizer`` ``MegatronOptimizer`` (Chained, Distributed, Float16, FP32)."""
    return _isinstance(obj, _OPT_MODULE, "MegatronOptimizer")


def _inner_state(opt: Any, prefix: str, out: list[tuple[str, torch.Tensor]]) -> None:
    """The torch optimizer's state as ``state.<param index>.<key>``, params numbered in param_groups order."""
    inner = getattr(opt, "optimizer", None)
    if inner is None:
        return
    if type(inner).__name__ == "HybridDeviceOptimizer":
        # Its state lives in per-device sub-optimizers that it rebuilds; not covered here.
        raise OffloadError("Megatron optimizer CPU offload (HybridDeviceOptimizer) is not supported")
    index = 0
    for group in inner.param_groups:
        for p in group["params"]:
            state = inner.state.get(p)
            for key in sorted(state or ()):
                value = state[key]
                if isinstance(value, torch.Tensor):
                    out.append((f"{prefix}state.{index}.{key}", value))
            index += 1


def _collect(opt: Any, prefix: str, out: list[tuple[str, torch.Tensor]]) -> None:
    if _isinstance(opt, _OPT_MODULE, "ChainedOptimizer"):
        for i, sub in enumerate(opt.chained_optimizers):
            _collect(sub, f"{prefix}chained_optimizers.{i}.", out)
        return
    if getattr(opt, "is_stub_optimizer", False) or getattr(opt, "optimizer", None) is None:
        return  # no trainable parameters on this rank: nothing owned
    if _isinstance(opt, _DISTOPT_MODULE, "DistributedOptimizer"):
        if getattr(opt.ddp_config, "use_megatron_fsdp", False):
            raise OffloadError("DistributedOptimizer over Megatron-FSDP is not supported")
        masters = opt.shard_fp32_from_float16_groups
    elif _isinstance(opt, _OPT_MODULE, "Float16OptimizerWithFloat16Params"):
        masters = opt.fp32_from_float16_groups
    elif _isinstance(opt, _OPT_MODULE, "FP32Optimizer"):
        masters = []
    else:
        raise OffloadError(
            f"unsupported Megatron optimizer {type(opt).__module__}.{type(opt).__qualname__}: supported are "
            "ChainedOptimizer, DistributedOptimizer, Float16OptimizerWithFloat16Params and FP32Optimizer"
        )
    for g, group in enumerate(masters):
        for i, main_param in enumerate(group):
            if main_param is not None:  # None with the precision-aware optimizer (masters in its state)
                out.append((f"{prefix}main_params.{g}.{i}", main_param))
    _inner_state(opt, prefix, out)
    scaler = getattr(opt, "grad_scaler", None)
    scale = getattr(scaler, "_scale", None)
    if isinstance(scale, torch.Tensor):  # the dynamic fp16 loss scale changes with training
        out.append((f"{prefix}grad_scaler.scale", scale))


def megatron_optimizer_named_tensors(opt: Any) -> list[tuple[str, torch.Tensor]]:
    """A Megatron optimizer's device state: fp32 master (shard) params, inner optimizer state, loss scale.

    Names: ``[chained_optimizers.<i>.]main_params.<group>.<index>``, ``...state.<param index>.<key>``
    (the core's torch-optimizer convention) and ``...grad_scaler.scale``.
    """
    if not is_megatron_optimizer(opt):
        raise OffloadError(f"{type(opt).__qualname__} is not a Megatron optimizer")
    out: list[tuple[str, torch.Tensor]] = []
    _collect(opt, "", out)
    return out


def _optimizer_named(opt: Any, *, include_grads: bool,
                     reshard: bool = True) -> tuple[list[tuple[str, torch.Tensor]], list[tuple[str, torch.Tensor]]]:
    # The masters' gradients are views into the chunks' grad buffers (or copies made inside step()): they
    # belong to the model chunks.
    return megatron_optimizer_named_tensors(opt), []


def _group_coords(pg: Any) -> tuple[int, int]:
    if pg is None:
        return 1, 0
    return pg.size(), pg.rank()


def megatron_shard_info(obj: Any) -> dict[str, Any]:
    """Data-parallel size/rank and flat-buffer or master-shard sizes of a DDP chunk or Megatron optimizer.

    Two snapshots restore into each other only when these dicts are equal; no collective is run.
    """
    if _isinstance(obj, _DDP_MODULE, "DistributedDataParallel"):
        bufs = {}
        world, rank = 1, 0
        for name, buf in _ddp_buffers(obj):
            world, rank = _group_coords(buf.data_parallel_group)
            bufs[name] = {
                "numel": int(buf.numel),
                "numel_unpadded": int(buf.numel_unpadded),
                "param_dtype": str(buf.param_dtype),
                "grad_dtype": str(buf.grad_dtype),
                "has_param_data": buf.param_data is not None,
            }
        return {
            "kind": "megatron_ddp",
            "dp_world_size": world,
            "dp_rank": rank,
            "use_distributed_optimizer": bool(obj.ddp_config.use_distributed_optimizer),
            "buffers": bufs,
        }
    if is_megatron_optimizer(obj):
        parts = []
        for opt in getattr(obj, "chained_optimizers", None) or [obj]:
            entry: dict[str, Any] = {"type": type(opt).__name__}
            if _isinstance(opt, _DISTOPT_MODULE, "DistributedOptimizer") and not opt.is_stub_optimizer:
                entry["dp_world_size"], entry["dp_rank"] = _group_coords(opt.data_parallel_group)
            names = megatron_optimizer_named_tensors(opt)
            entry["numels"] = [int(t.numel()) for _, t in names]
            parts.append(entry)
        return {"kind": "megatron_optimizer", "optimizers": parts}
    raise OffloadError(f"{type(obj).__qualname__} is neither a megatron-core DDP chunk nor a Megatron optimizer")


# -------------------------------------------------------------------------------------- the strategies

#: DDP model chunks (flat param/grad buffers) and Megatron optimizers (fp32 masters, inner state).
MEGATRON_DDP = Strategy("megatron_ddp", is_megatron_ddp, _ddp_named, megatron_shard_info)
MEGATRON_OPTIMIZER = Strategy("megatron_optimizer", is_megatron_optimizer, _optimizer_named, megatron_shard_info)
