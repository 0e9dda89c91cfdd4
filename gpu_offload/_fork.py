"""Locks that a forked child can take: gpu_offload's locks are made here and reset in the child.

os.fork() copies the whole process but only the thread that calls it: a lock another thread of the parent
held at that moment stays held in the child, by no one, and the child's first call that needs it would
block forever. Every lock gpu_offload takes comes from `new_lock` and is re-initialised, unheld, in the
child (os.register_at_fork); the C++ arena resets its own (pthread_atfork). What else a child may use is
in docs/concepts.md ("Fork").
"""

from __future__ import annotations

import os
import threading
import weakref
from typing import Any, Callable

_locks: "weakref.WeakSet[Any]" = weakref.WeakSet()
_in_child: list[Callable[[], None]] = []


def new_lock(reentrant: bool = False) -> Any:
    """A threading.Lock (or RLock) that is unheld again in a forked child."""
    lock = threading.RLock() if reentrant else threading.Lock()
    _locks.add(lock)
    return lock


def track(lock: Any) -> Any:
    """Resets an existing lock object (with `_at_fork_reinit`, as threading's own) in a forked child."""
    _locks.add(lock)
    return lock


def in_child(fn: Callable[[], None]) -> None:
    """Runs fn in a forked child, after the locks are reset."""
    _in_child.append(fn)


def _after_fork_in_child() -> None:
    for lock in list(_locks):
        lock._at_fork_reinit()
    for fn in _in_child:
        fn()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
