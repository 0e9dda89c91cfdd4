"""Megatron-core adapters (placeholder until the strategy work lands: detection only)."""

from __future__ import annotations

from typing import Any

import torch


def is_megatron_ddp(obj: Any) -> bool:
    return False


def megatron_ddp_named_tensors(ddp: Any, *, include_grads: bool) -> list[tuple[str, torch.Tensor]]:
    raise NotImplementedError


def is_megatron_optimizer(obj: Any) -> bool:
    return False


def megatron_optimizer_named_tensors(opt: Any) -> list[tuple[str, torch.Tensor]]:
    raise NotImplementedError
