"""The offload registry: which storages are offloaded, and where their bytes are in the arena.

Keyed by storage identity rather than by target, so that a list is its parts: offload([model, opt]) then
is_offloaded(model) or reload([model, opt]) with a new list just work. Every read and write holds `lock`.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import torch

from .arena import Region


@dataclass
class Offloaded:
    """Where an offloaded storage's bytes are. Holding the storage keeps its identity (the key) unique."""

    storage: torch.UntypedStorage
    nbytes: int
    device: torch.device
    region: Region
    host_offset: int
    events: list[Any]  # the D2H copy that filled the region


entries: dict[int, Offloaded] = {}
lock = threading.RLock()


def sizes() -> dict[int, int]:
    """Offloaded storage sizes by key (what bind() needs to lay out an offloaded target)."""
    with lock:
        return {k: r.nbytes for k, r in entries.items()}


def total_bytes() -> int:
    with lock:
        return sum(r.nbytes for r in entries.values())
