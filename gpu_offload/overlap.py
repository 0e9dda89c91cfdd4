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

from . import _capture, _fork
from . import plan as _plan
from ._errors import OffloadError


@dataclass
class _Entry:
    events: list[Any]  # one per device
    sources: Any  # the source storages (a list, or the helper's HeldStorages): alive until the copies have read them
    joined: set[tuple[int, int]] = field(default_factory=set)  # (device, torch's own stream) already waiting


_pending: list[_Entry] = []
_lock = _fork.new_lock()
_hook: Any = None


def _current_stream(device: int) -> int:
    return _plan.current_stream(device)


def _stream_lasts(device: int) -> bool:
    """Whether the current stream lives as long as the process: torch's default stream and pool streams do
    (their stream_id is 0 or odd). An external one (torch.cuda.ExternalStream over another library's) may
    be destroyed and its handle reused by a new stream, which must then wait too: it is not remembered."""
    try:
        stream_id = torch.cuda.current_stream(device).stream_id
    except Exception:  # no torch CUDA (the simulated driver's tests): remember nothing
        return False
    return stream_id == 0 or bool(stream_id & 1)


def _in_flight(entry: _Entry) -> list[Any]:
    return [e for e in entry.events if not e.query()]


def join() -> None:
    """Makes the current streams wait (on the GPU, the CPU is not blocked) for the copies of every
    `snapshot(..., overlap=True)` still in flight. Called for you before each optimizer step and by
    restore/offload/reload/swap; call it yourself before changing the weights any other way (an EMA
    update, an overlapped parameter all-gather, a manual copy into a parameter).

    Per stream: each thread's current stream waits for itself; entries are dropped only once their
    copies have completed, never because one stream has waited for them.

    Under CUDA graph capture (a captured optimizer step) a stream cannot wait for a copy outside the
    graph: join then passes when every copy has completed and raises OffloadError otherwise."""
    if not _pending:  # the common case: nothing overlapped in flight
        return
    if _capture.capturing():
        _join_capturing()
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
                    if _stream_lasts(event.device):  # a handle that cannot be reused by another stream
                        entry.joined.add(key)
                    todo.append(event)
        _pending[:] = still
        if todo:
            _plan.join(todo)


def _join_capturing() -> None:
    # The events were recorded outside the capture: the core queries them in relaxed capture mode, which
    # does not invalidate the capture (a query in the default mode would end it).
    with _lock:
        running = [e for entry in _pending for e in _in_flight(entry)]
        if not running:
            _pending[:] = []
            return
    raise OffloadError(f"gpu_offload.join() (also run before every optimizer step) under CUDA graph capture: "
                       f"{len(running)} copies of snapshot(overlap=True) may still be reading the weights, and "
                       f"a captured stream cannot wait for them; {_capture.ADVICE}")


def _step_pre_hook(optimizer: Any, args: Any, kwargs: Any) -> None:
    join()


def defer(events: Sequence[Any], sources: Any = ()) -> None:
    """Records copies that the next join() on each stream must wait for, with their source storages (kept
    alive until the copies have completed: a sequence of them, or anything that holds them, as the
    helper's HeldStorages does); installs the optimizer-step guard once."""
    global _hook
    with _lock:
        _pending[:] = [e for e in _pending if _in_flight(e)]  # bounded even when nothing ever joins
        _pending.append(_Entry(list(events), list(sources) if isinstance(sources, (list, tuple)) else sources))
        if _hook is None:
            # From the submodule itself: torch 2.13's torch.optim no longer has it as an attribute.
            from torch.optim.optimizer import register_optimizer_step_pre_hook

            _hook = register_optimizer_step_pre_hook(_step_pre_hook)


def pending() -> int:
    """Overlapped snapshots whose copies have not been seen complete yet (for tests and debugging)."""
    with _lock:
        return len(_pending)
