"""Bookkeeping for snapshot(..., overlap=True): copies that later work may not have been made to wait for.

Each overlapped snapshot leaves an entry: its copy events, the source storages (kept alive until the
copies have read them), and the (device, stream) pairs already made to wait for it. join() makes the
calling thread's current streams wait for every entry still in flight that they have not waited for yet,
and drops entries only once their copies have completed: a join on one stream (one thread's optimizer
step) never hides a copy from another stream (another thread's step, or a side stream).

Who joins: every optimizer step (a global pre-hook, registered on first use) and restore / offload /
reload / swap. Anything else that writes the weights or the sources in place must call join() first:
GradScaler.unscale_ and clip_grad_norm_ (gradients, which is why overlap refuses include_grads), an EMA
update, Megatron's overlapped parameter all-gather, a manual `p.data.copy_()`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from . import _fork
from . import plan as _plan


@dataclass
class _Entry:
    events: list[Any]  # one per device
    sources: list[Any]  # the source storages: alive until the copies have read them
    joined: set[tuple[int, int]] = field(default_factory=set)  # (device, stream) already waiting


_pending: list[_Entry] = []
_lock = _fork.new_lock()
_hook: Any = None


def _current_stream(device: int) -> int:
    return torch.cuda.current_stream(device).cuda_stream


def _in_flight(entry: _Entry) -> list[Any]:
    return [e for e in entry.events if not e.query()]


def join() -> None:
    """Makes the current streams wait (on the GPU, the CPU is not blocked) for the copies of every
    `snapshot(..., overlap=True)` still in flight. Called for you before each optimizer step and by
    restore/offload/reload/swap; call it yourself before changing the weights any other way (an EMA
    update, an overlapped parameter all-gather, a manual copy into a parameter).

    Per stream: each thread's current stream waits for itself; entries are dropped only once their
    copies have completed, never because one stream has waited for them."""
    if not _pending:  # the common case: nothing overlapped in flight
        return
    with _lock:
        todo: list[Any] = []
        still: list[_Entry] = []
        for entry in _pending:
            running = _in_flight(entry)
            if not running:
                continue  # complete: dropped, and its sources with it
            still.append(entry)
            for event in running:
                key = (event.device, _current_stream(event.device))
                if key not in entry.joined:
                    entry.joined.add(key)
                    todo.append(event)
        _pending[:] = still
        if todo:
            _plan.join(todo)


def _step_pre_hook(optimizer: Any, args: Any, kwargs: Any) -> None:
    join()


def defer(events: Sequence[Any], sources: Sequence[Any] = ()) -> None:
    """Records copies that the next join() on each stream must wait for, with their source storages (kept
    alive until the copies have completed); installs the optimizer-step guard once."""
    global _hook
    with _lock:
        _pending[:] = [e for e in _pending if _in_flight(e)]  # bounded even when nothing ever joins
        _pending.append(_Entry(list(events), list(sources)))
        if _hook is None:
            _hook = torch.optim.optimizer.register_optimizer_step_pre_hook(_step_pre_hook)


def pending() -> int:
    """Overlapped snapshots whose copies have not been seen complete yet (for tests and debugging)."""
    with _lock:
        return len(_pending)
