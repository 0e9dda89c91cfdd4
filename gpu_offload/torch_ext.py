"""The torch-aware helper, gpu_offload._torch_ext, and its pure-Python fallbacks.

The core (_C) takes pointers and byte counts and never sees torch. A few things only torch's C++ reaches
cheaply: checking all of a target's tensors in one call, or making storages refuse access. Those live in a
second, optional extension built against one torch (setup.py: when torch is importable at build time). It is
loaded only when the running torch is the one it was built against (version, git commit and C++ ABI, read
from the binary before it is loaded), never touches CUDA, and is never needed for correctness: without it
every caller takes its pure-Python path.

    GPU_OFFLOAD_TORCH_EXT=0   do not load it (pure Python everywhere)

Nor is it loaded where the GIL is off (a free-threaded CPython run with PYTHON_GIL=0): its passes rely on it.

`status()` says which it is and why; `gpu-offload info` prints it.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import sys
from types import ModuleType
from typing import Any, Optional, Sequence, Union

import torch

logger = logging.getLogger("gpu_offload")

_MARKER = b"gpu_offload_torch_ext_record:"


class TorchExtUnavailable(RuntimeError):
    """A function that needs the torch-aware helper (or torch's own equivalent) where neither is there."""


def _running() -> dict[str, Any]:
    return {"torch": torch.__version__, "torch_git": getattr(torch.version, "git_version", None) or "",
            "cxx11_abi": bool(torch._C._GLIBCXX_USE_CXX11_ABI)}


def read_record(path: str) -> Optional[dict[str, Any]]:
    """The torch a built _torch_ext was built against, read from the file without loading it."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        return None
    at = data.find(_MARKER)
    if at < 0:
        return None
    end = data.find(b"\0", at)
    try:
        record = json.loads(data[at + len(_MARKER):end if end >= 0 else None].decode())
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


def _load() -> tuple[Optional[ModuleType], str]:
    if os.environ.get("GPU_OFFLOAD_TORCH_EXT", "").strip().lower() in ("0", "off", "false", "no"):
        return None, "disabled (GPU_OFFLOAD_TORCH_EXT=0)"
    spec = importlib.util.find_spec("gpu_offload._torch_ext")
    if spec is None or not spec.origin:
        return None, ("not built (torch was not importable when gpu_offload was built; reinstall with "
                      "pip install --no-build-isolation)")
    record = read_record(spec.origin)
    running = _running()
    if record is None:
        return None, f"not loaded: {spec.origin} carries no build record"
    if {k: record.get(k) for k in running} != running:
        return None, (f"not loaded: built against torch {record.get('torch')} ({record.get('torch_git', '')[:12]}, "
                      f"C++11 ABI {int(bool(record.get('cxx11_abi')))}), running torch {running['torch']} "
                      f"({running['torch_git'][:12]}, C++11 ABI {int(running['cxx11_abi'])}); reinstall gpu_offload "
                      "against this torch to use it")
    try:
        from . import _torch_ext  # type: ignore[attr-defined]
    except ImportError as exc:
        return None, f"not loaded: {exc}"
    # Its passes read objects borrowed and TensorImpls unlocked, which only the GIL makes safe. A free-threaded
    # CPython turns the GIL back on to import a module that has not declared it can run without (this one
    # has not), unless told not to (PYTHON_GIL=0, -X gil=0): then the pure-Python paths run. (Asked after the
    # import, which is what turns it back on.)
    if not _gil_enabled():
        return None, ("not loaded: the GIL is disabled (PYTHON_GIL=0 or -X gil=0 on a free-threaded CPython), "
                      "and its passes rely on it")
    return _torch_ext, f"loaded (built against torch {record['torch']})"


def _gil_enabled() -> bool:
    is_enabled = getattr(sys, "_is_gil_enabled", None)  # (3.13+; every earlier CPython has the GIL)
    return True if is_enabled is None else bool(is_enabled())


ext, _status = _load()
if ext is None:
    logger.debug("gpu_offload._torch_ext %s; pure-Python fallbacks in use", _status)


def status() -> str:
    """Whether the helper is loaded, and if not, why."""
    return _status


def available() -> bool:
    return ext is not None


# -- refusing access to storages ---------------------------------------------------------------------------
# An offloaded storage has no memory behind it: any access to it must raise a clear error instead of reading
# freed memory. torch can mark a StorageImpl so (its data-pointer accessors then throw a RuntimeError with a
# given message) and lift the mark again, from C++ only (torch._C has a per-storage setter but, up to 2.13 at
# least, no way back); the helper does either for N storages in one call.
def access_guard_available() -> bool:
    """Whether refuse_access/allow_access work here (the helper is loaded and this torch can lift a refusal)."""
    return ext is not None and bool(ext.ACCESS_GUARD)


def _require_guard(what: str) -> Any:
    if ext is None:
        raise TorchExtUnavailable(f"cannot {what} storage access: gpu_offload._torch_ext is {_status}")
    if not ext.ACCESS_GUARD:
        raise TorchExtUnavailable(f"cannot {what} storage access: torch {torch.__version__} cannot lift a refusal "
                                  "(no StorageImpl::clear_data_ptr_access_error_msg_)")
    return ext


def refuse_access(storages: Sequence[Any], message: Union[str, Sequence[str]]) -> None:
    """Makes each storage refuse any access to its data (a read, a write, data_ptr(), torch.save, printing)
    with a RuntimeError carrying `message` (one for all, or a list: one per storage), until allow_access. The
    data and the size are not touched.

    storages: tensors (their storage), UntypedStorages, or storages' `_cdata` (the caller keeps those
    storages alive through the call); all are read before any is marked. One C++ call for all of them.
    Raises TorchExtUnavailable where the helper is not loaded (see status())."""
    _require_guard("refuse").refuse_access(storages, message if isinstance(message, str) else list(message))


def allow_access(storages: Sequence[Any]) -> None:
    """Lifts refuse_access from each storage (same items as refuse_access; a storage not refused is left as
    it is). Raises TorchExtUnavailable where the helper is not loaded."""
    _require_guard("allow").allow_access(storages)


def access_refused(storage: Any) -> bool:
    """Whether a storage (a tensor's, an UntypedStorage, a `_cdata`) refuses access now."""
    return bool(_require_guard("inspect").access_refused(storage))
