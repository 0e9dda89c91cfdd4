"""What an adapter module declares for each kind of object it owns: one row of the strategy table.

``adapters/__init__.py`` asks the table, in order, which strategy recognizes an object, then asks that one
strategy the same few questions about it. Recognizing must not import the framework: an object can only be
one of its kinds once the module defining the class is loaded, so a strategy looks in ``sys.modules``
first (a plain model then costs no import of FSDP, DeepSpeed or Megatron).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

NamedTensors = list[tuple[str, torch.Tensor]]

#: ``named(obj, include_grads=..., reshard=...)``: (the device state, the gradients), each a list of
#: (name, tensor); the gradients are empty unless include_grads.
NamedFn = Callable[..., tuple[NamedTensors, NamedTensors]]


@dataclass(frozen=True)
class Strategy:
    """One kind of object a framework wraps (a DeepSpeed engine, an FSDP1 module, a Megatron optimizer...).

    Attributes:
        name: short name, also the ``kind`` its shard info records.
        recognizes: whether an object is of this kind, without importing the framework.
        named: ``named(obj, *, include_grads, reshard)`` -> (state, grads). ``state`` is the object's
            device state (what a snapshot copies); ``grads`` the gradient tensors (what ``grads="copy"``
            copies and ``grads="drop"`` releases), only with ``include_grads``. ``reshard``: the call will
            write into the state, so gathered or unsharded copies that would shadow it (FSDP units left
            unsharded by a forward, gathered ZeRO-3 parameters) are released first; reads pass False.
        shard_info: the rank's shard layout as a JSON-able dict (None: not sharded), which two snapshots
            must share to restore into each other.
        state_dict: whether ``state``'s names and tensors are the object's state dict (the parameters'
            fully qualified names, DTensors where the parameters are), so that a snapshot of it can be
            saved with torch.distributed.checkpoint. False for flat buffers and partitions.
    """

    name: str
    recognizes: Callable[[Any], bool]
    named: NamedFn
    shard_info: Optional[Callable[[Any], Optional[dict[str, Any]]]] = None
    state_dict: bool = False
