"""Drop-in for verl's Megatron helpers `copy_megatron_model_to_cpu` / `restore_megatron_model_from_cpu`.

The seed copies each DDP buffer's `param_data` (or each parameter of a chunk that is not DDP-wrapped)
with `.cpu().clone().pin_memory()`: a pageable copy, then a second pinned one, on every call. These do
the same job through the arena: one batched copy per call, pinned memory reused, the params staying
views into `param_data`. The state object is a `gpu_offload.Snapshot`; drop it (or `.free()` it) to give
the memory back.

MIS (multiple importance sampling) pattern from the fully-async trainer:

    v1 = copy_megatron_model_to_cpu(models)   # after step 1
    ...train...
    v2 = copy_megatron_model_to_cpu(models)   # save the current weights
    restore_megatron_model_from_cpu(models, v1)
    old_log_prob = compute_log_prob(models, batch)
    restore_megatron_model_from_cpu(models, v2)  # back to the current weights
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from .. import api
from .._errors import OffloadError
from ..arena import Arena
from ..snapshot import Snapshot


def _chunks(models: Any) -> list[Any]:
    if isinstance(models, (list, tuple)):
        if not models:
            raise OffloadError("no model chunks given")
        return list(models)
    return [models]


def copy_megatron_model_to_cpu(models: Sequence[Any], *, include_grads: bool = False,
                               arena: Optional[Arena] = None) -> Snapshot:
    """Non-destructive copy of every model chunk (DDP buffers' `param_data`, or the parameters of chunks
    that are not DDP-wrapped) into pinned host memory. Returns the state for
    `restore_megatron_model_from_cpu`."""
    return api.snapshot(_chunks(models), include_grads=include_grads, arena=arena)


def restore_megatron_model_from_cpu(models: Sequence[Any], cpu_state: Snapshot) -> None:
    """Copies a state from `copy_megatron_model_to_cpu` back into the chunks, in place (the parameters stay
    views into their buffers). Raises LayoutMismatchError, before anything is copied, if the chunks'
    buffers differ from the state's."""
    if not isinstance(cpu_state, Snapshot):
        raise OffloadError("cpu_state must come from gpu_offload.integrations.megatron.copy_megatron_model_to_cpu, "
                           f"got {type(cpu_state).__qualname__}")
    api.restore(_chunks(models), cpu_state)
