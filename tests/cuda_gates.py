"""Deterministic gates for the GPU tests: a CUDA stream held on a host-released wait.

A test that needs a copy held back (to do, meanwhile, what a user's code would do) puts a gate on the
stream the copy runs on: the stream runs nothing enqueued after the gate until the test calls release().
Unlike torch.cuda._sleep this assumes no clock rate: the copy is held exactly until the assertions are done.

The gate is `cuStreamWaitValue32` (driver API, through ctypes) on a word of pinned, mapped host memory that
release() sets; where the driver refuses stream memory operations, a one-thread CuPy kernel that spins on
the same word. While a stream is held, anything that waits for it on the host blocks (torch.cuda.synchronize,
torch.cuda.empty_cache, offload's default empty_cache=True, Snapshot.wait, torch.cuda.graph's entry): a test
releases first. A watchdog releases a forgotten gate after `timeout_s` and the gate then fails the test
instead of hanging the suite.

Two limits of the hardware, which the tests allow for:
* Streams share the device's hardware work queues (CUDA_DEVICE_MAX_CONNECTIONS of them, 32 in this session,
  set by conftest.py before CUDA starts). Work on a stream that shares the held stream's queue is held too.
  So a test that needs unrelated work to run while a copy is held checks that it did (`ran`) and skips,
  saying why, where it did not: it cannot test there. Correct code never depends on it.
* A kernel's first launch may load its module lazily, which can wait for the whole device. Tests run the
  operations they use inside a gate once before it (`warm`).
"""

from __future__ import annotations

import ctypes
import threading
import time
from typing import Any, Optional

import pytest
import torch

_WAIT_GEQ = 0  # CU_STREAM_WAIT_VALUE_GEQ
_MAX_GATES = 1024

_lock = threading.Lock()
_state: dict[str, Any] = {}


def _driver() -> Any:
    lib = _state.get("lib")
    if lib is None:
        try:
            lib = ctypes.CDLL("libcuda.so.1")
        except OSError as exc:
            pytest.skip(f"libcuda.so.1 cannot be loaded: {exc}")
        _state["lib"] = lib
    return lib


def _symbol(lib: Any, *names: str) -> Any:
    for name in names:
        fn = getattr(lib, name, None)
        if fn is not None:
            return fn
    raise AttributeError(f"none of {names} in libcuda")


def _word() -> tuple[int, int]:
    """A fresh zeroed 32-bit word of pinned, mapped host memory: (host address, device address)."""
    with _lock:
        words = _state.get("words")
        if words is None:
            torch.zeros(1, device="cuda")  # the primary context exists and is current in this thread
            # Never freed: freeing pinned memory synchronizes the device, and a stream may still wait on it.
            words = _state["words"] = torch.zeros(_MAX_GATES, dtype=torch.int32, pin_memory=True)
            _state["next"] = 0
        index = _state["next"]
        if index >= _MAX_GATES:
            raise RuntimeError("cuda_gates: out of gate words")
        _state["next"] = index + 1
    host = words.data_ptr() + 4 * index
    lib = _driver()
    get_ptr = _symbol(lib, "cuMemHostGetDevicePointer_v2", "cuMemHostGetDevicePointer")
    get_ptr.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_void_p, ctypes.c_uint]
    get_ptr.restype = ctypes.c_int
    dptr = ctypes.c_uint64()
    # With unified addressing the host address is the device address; ask the driver anyway.
    device = dptr.value if get_ptr(ctypes.byref(dptr), ctypes.c_void_p(host), 0) == 0 and dptr.value else host
    return host, device


def _wait_value(stream: int, device_ptr: int) -> int:
    lib = _driver()
    fn = _symbol(lib, "cuStreamWaitValue32_v2", "cuStreamWaitValue32")
    fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return int(fn(ctypes.c_void_p(stream), ctypes.c_uint64(device_ptr), ctypes.c_uint32(1), ctypes.c_uint(_WAIT_GEQ)))


_SPIN = r"""
extern "C" __global__ void gpu_offload_test_spin(unsigned long long flag) {
  volatile int* f = reinterpret_cast<volatile int*>(flag);
  while (*f == 0) { __nanosleep(1000); }
}
"""


def _spin_kernel(stream: int, device_ptr: int) -> None:
    try:
        import cupy
    except ImportError:
        pytest.skip("the driver refused cuStreamWaitValue32 and CuPy is not installed: no host-released gate here")
    kernel = _state.get("spin")
    if kernel is None:
        kernel = _state["spin"] = cupy.RawKernel(_SPIN, "gpu_offload_test_spin")
    with cupy.cuda.ExternalStream(stream):
        kernel((1,), (1,), (cupy.uint64(device_ptr),))


class HostGate:
    """Holds `stream` (a cudaStream_t as an int, or a torch stream) until release()."""

    def __init__(self, stream: Any, timeout_s: float = 60.0) -> None:
        handle = stream if isinstance(stream, int) else int(stream.cuda_stream)
        self._host, device_ptr = _word()
        self.how = "cuStreamWaitValue32"
        rc = _wait_value(handle, device_ptr)
        if rc != 0:
            self.how = f"spin kernel (cuStreamWaitValue32 returned {rc})"
            _spin_kernel(handle, device_ptr)
        self.by_watchdog = False
        self._released = False
        self._timer: Optional[threading.Timer] = threading.Timer(timeout_s, self._watchdog)
        self._timer.daemon = True
        self._timer.start()

    def _watchdog(self) -> None:
        self.by_watchdog = True
        self._open()

    def _open(self) -> None:
        self._released = True
        ctypes.c_int32.from_address(self._host).value = 1

    def open(self) -> None:
        """Lets the stream go on (whoever opened it first)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._open()

    def release(self) -> None:
        """Lets the stream go on; fails the test if the watchdog had to do it."""
        self.open()
        if self.by_watchdog:
            pytest.fail("a gate was released by its watchdog: the test waited on the host for a held stream")

    def open_after(self, seconds: float) -> threading.Timer:
        """Releases the stream from another thread after `seconds`: for a test whose own thread blocks until
        the held work has run (it then checks that it was released before that thread went on)."""
        timer = threading.Timer(seconds, self._open)
        timer.daemon = True
        timer.start()
        return timer

    @property
    def released(self) -> bool:
        return self._released

    def __enter__(self) -> "HostGate":
        return self

    def __exit__(self, *exc: object) -> None:
        self.open()
        if self.by_watchdog and exc[0] is None:
            pytest.fail("a gate was released by its watchdog: the test waited on the host for a held stream")


def hold(stream: Any, timeout_s: float = 60.0) -> HostGate:
    """A gate on `stream` (use as a context manager: it is released at the end of the block at the latest)."""
    return HostGate(stream, timeout_s)


def engine_stream(device: int, to_host: bool) -> int:
    """The engine's copy-engine stream of one direction on `device` (where its batches run; a batch that
    uses the gather kernel forks from it and joins it again, so holding it holds the whole batch)."""
    from gpu_offload._ext import _C

    return int(_C.engine_streams(device)[0 if to_host else 1])


def recorded(stream: Any = None) -> Any:
    """An event recorded now on `stream` (the current stream by default)."""
    event = torch.cuda.Event()
    event.record(stream)
    return event


def settle(event: Any, timeout_s: float = 1.0) -> bool:
    """Polls `event` until it completes or `timeout_s` passes; whether it completed. Gives work that
    wrongly runs ahead of a held copy the time to do so (a fill of a few hundred MiB takes well under a
    millisecond), and never blocks on the held stream itself."""
    deadline = time.monotonic() + timeout_s
    while not event.query():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True


def ran(what: str, timeout_s: float = 5.0) -> None:
    """Work just enqueued on the current stream, that the test needs to have run while a copy is held:
    waits for it (bounded) and skips the test where it did not run (see the module docstring)."""
    if not settle(recorded(), timeout_s):
        pytest.skip(f"{what} did not run while a copy was held (it shares a hardware work queue with the "
                    "held stream): this ordering cannot be tested on this process's stream layout")


def warm() -> None:
    """Runs, once per process, the torch operations the gated tests use, so that no kernel of theirs is
    first loaded while a stream is held."""
    if _state.get("warm"):
        return
    for dtype in (torch.float32, torch.uint8, torch.int64):
        t = torch.zeros(1 << 20, dtype=dtype, device="cuda")
        t.fill_(3)
        t.zero_()
        u = t.clone()
        u.copy_(t)
        bool((t == u).all())
        (t + 5).sum()
    torch.randn(1 << 20, device="cuda").mul_(2.0).add_(1.0)
    torch.full((1 << 20,), 12345.0, device="cuda")
    torch.cuda.synchronize()
    _state["warm"] = True
