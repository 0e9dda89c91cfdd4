"""Bookkeeping for snapshot(..., overlap=True): copies that later work has not been made to wait for yet.

Anything that may write the weights joins them first: every optimizer step (a global pre-hook, registered
on first use), and restore / offload / reload / swap.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from . import plan as _plan

_overlapped: list[Any] = []
_lock = threading.Lock()
_hook: Any = None


def join() -> None:
    """Makes the current streams wait (on the GPU, the CPU is not blocked) for the copies of every
    `snapshot(..., overlap=True)` still in flight. Called for you before each optimizer step and by
    restore/offload/reload/swap; call it yourself before changing the weights any other way."""
    with _lock:
        events, _overlapped[:] = list(_overlapped), []
    pending = [e for e in events if not e.query()]
    if pending:
        _plan.join(pending)


def _step_pre_hook(optimizer: Any, args: Any, kwargs: Any) -> None:
    join()


def defer(events: list[Any]) -> None:
    """Records copies that the next join() must wait for; installs the optimizer-step guard once."""
    global _hook
    with _lock:
        _overlapped.extend(events)
        if _hook is None:
            _hook = torch.optim.optimizer.register_optimizer_step_pre_hook(_step_pre_hook)
