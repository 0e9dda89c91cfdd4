"""The package's exceptions. Every error raised for bad input or exhausted resources is an OffloadError."""

from __future__ import annotations


class OffloadError(RuntimeError):
    """Bad input, an exhausted resource (arena cap, host memory, device memory) or a failed copy.

    Raised before any byte moves wherever the problem can be seen up front; the target and the arena are
    then exactly as they were.
    """


class LayoutMismatchError(OffloadError):
    """A restore target whose tensors (names, shapes, dtypes, devices, storages) differ from the snapshot's."""
