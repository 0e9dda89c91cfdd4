"""Host memory on a shared node: the node-wide budget across processes, NUMA placement of slabs, the first
slab sized to the request, memory_stats() and the pinning error. The C++ tests (csrc/tests/test_ledger.cpp)
cover the ledger itself: fork, SIGKILL, eight processes of random reserves and releases."""

from __future__ import annotations

import ctypes
import json
import logging
import multiprocessing as mp
import os
import random
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

import gpu_offload as go
from conftest import node_budget
from gpu_offload import _topology
from gpu_offload import arena as _arena
from gpu_offload._ext import _C

_MIB = 1 << 20
_TIMEOUT = 240  # seconds a spawned rank may take to answer (importing torch on a busy machine)


# ----------------------------------------------------------------------------------- the node's budget

_SNAPSHOT_BYTES = 3 * _MIB  # each rank's snapshot: a first slab of exactly this size
_BUDGET = 7 * _MIB  # room for two of them, not three


def _rank(conn: Any, env: dict[str, str]) -> None:
    """One rank: snapshots on command, reports what happened."""
    os.environ.update(env)
    import gpu_offload as go  # after the environment: the budget is read when the first arena is made

    state = {"w": torch.ones(_SNAPSHOT_BYTES, dtype=torch.uint8)}
    snap = None
    conn.send(("ready", os.getpid()))
    while True:
        cmd = conn.recv()
        if cmd == "snapshot":
            try:
                snap = go.snapshot(state)
                conn.send(("ok", None))
            except go.OffloadError as exc:
                conn.send(("refused", str(exc)))
        elif cmd == "free":
            assert snap is not None
            snap.free()
            go.default_arena().trim()  # the slab goes back, and its share of the budget with it
            conn.send(("freed", None))
        elif cmd == "stats":
            conn.send(("stats", go.memory_stats()))
        else:
            return


def _answer(conn: Any) -> tuple[str, Any]:
    if not conn.poll(_TIMEOUT):
        raise AssertionError("a rank did not answer")
    return conn.recv()


def test_four_ranks_under_a_budget_for_two(tmp_path: Path) -> None:
    env = {"GPU_OFFLOAD_NODE_MAX_BYTES": str(_BUDGET), "GPU_OFFLOAD_LEDGER_DIR": str(tmp_path),
           "GPU_OFFLOAD_PIN": "none"}
    ctx = mp.get_context("spawn")
    ranks = []
    try:
        for _ in range(4):
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(target=_rank, args=(theirs, env), daemon=True)
            proc.start()
            ranks.append((proc, ours))
        pids = [_answer(conn)[1] for _, conn in ranks]
        for _, conn in ranks:  # all four at once: the ledger's lock decides
            conn.send("snapshot")
        results = [_answer(conn) for _, conn in ranks]
        ok = [i for i, (what, _) in enumerate(results) if what == "ok"]
        refused = [i for i, (what, _) in enumerate(results) if what == "refused"]
        assert len(ok) == 2 and len(refused) == 2, results
        for i in refused:
            message = results[i][1]
            assert "node host-memory budget exceeded" in message and f"budget of {_BUDGET} bytes" in message
            assert "GPU_OFFLOAD_NODE_MAX_BYTES" in message
            assert f"this process (pid {pids[i]}) holds 0 bytes" in message
            for j in ok:  # the users holding the budget, by PID and size
                assert f"pid {pids[j]} holds {_SNAPSHOT_BYTES} bytes" in message, message
        # One user frees (and trims): a refused rank now succeeds.
        ranks[ok[0]][1].send("free")
        assert _answer(ranks[ok[0]][1])[0] == "freed"
        ranks[refused[0]][1].send("snapshot")
        assert _answer(ranks[refused[0]][1])[0] == "ok"
        ranks[refused[1]][1].send("snapshot")
        assert _answer(ranks[refused[1]][1])[0] == "refused"
        # One user is SIGKILLed: its share is back at the next reservation.
        victim = ranks[ok[1]][0]
        assert victim.pid is not None
        os.kill(victim.pid, signal.SIGKILL)
        victim.join(_TIMEOUT)
        ranks[refused[1]][1].send("snapshot")
        assert _answer(ranks[refused[1]][1]) == ("ok", None)
        ranks[refused[1]][1].send("stats")
        stats = _answer(ranks[refused[1]][1])[1]
        assert stats["node"]["max_bytes"] == _BUDGET
        assert stats["node"]["reserved_bytes"] == 2 * _SNAPSHOT_BYTES
        assert set(stats["node"]["by_pid"]) == {pids[refused[0]], pids[refused[1]]}
        assert stats["process"]["pageable_bytes"] == _SNAPSHOT_BYTES == stats["process"]["capacity_bytes"]
    finally:
        for proc, conn in ranks:
            if proc.is_alive():
                try:
                    conn.send("exit")
                except OSError:
                    pass
                proc.join(30)
                if proc.is_alive():
                    proc.kill()


def test_a_budget_as_a_fraction_of_the_host_and_bad_settings(monkeypatch: pytest.MonkeyPatch,
                                                             tmp_path: Path) -> None:
    total = int(_C.host_memory_limit())
    assert total > 0
    monkeypatch.setenv("GPU_OFFLOAD_LEDGER_DIR", str(tmp_path))
    for text, expected in (("0.5", total // 2), (" .25 ", total // 4), ("1.0", total), ("64MiB", 64 * _MIB),
                           ("8e9", 8 * 10**9)):
        monkeypatch.setenv("GPU_OFFLOAD_NODE_MAX_BYTES", text)
        assert _arena.node_budget_from_env() == (expected, str(tmp_path))
    for text, match in (("1.5", "at most 1"), ("0.0", "above 0"), ("0", "must be positive"), ("lots", "not a number")):
        monkeypatch.setenv("GPU_OFFLOAD_NODE_MAX_BYTES", text)
        with pytest.raises(go.OffloadError, match=match):
            _arena.node_budget_from_env()
    monkeypatch.setenv("GPU_OFFLOAD_NODE_MAX_BYTES", "1GiB")
    monkeypatch.setenv("GPU_OFFLOAD_LEDGER_DIR", str(tmp_path / "missing"))
    with pytest.raises(go.OffloadError, match="GPU_OFFLOAD_LEDGER_DIR=.* is not a folder"):
        _arena.node_budget_from_env()
    monkeypatch.delenv("GPU_OFFLOAD_NODE_MAX_BYTES")
    assert _arena.node_budget_from_env() == (None, str(tmp_path / "missing"))  # no budget: the folder is not used


def test_a_request_over_the_budget_changes_nothing_and_an_arena_gives_empty_slabs_back(tmp_path: Path) -> None:
    arena = go.Arena(min_slab_bytes=_MIB, pin="none")
    state = {"w": torch.ones(_MIB, dtype=torch.uint8)}
    with node_budget(tmp_path, 3 * _MIB):
        first = go.snapshot(state, arena=arena)
        first.free()  # its slab stays, empty
        held = go.snapshot({"w": torch.ones(_MIB, dtype=torch.uint8)}, arena=arena)  # reuses it
        with pytest.raises(go.OffloadError, match="node host-memory budget exceeded") as info:
            go.snapshot({"w": torch.ones(3 * _MIB, dtype=torch.uint8)}, arena=arena)
        assert f"this process (pid {os.getpid()}) holds {_MIB} bytes" in str(info.value)
        assert arena.capacity_bytes == _MIB and go.memory_stats()["node"]["reserved_bytes"] == _MIB
        held.free()
        # Refused with an empty slab in the way: the arena gives it back and takes a slab that fits.
        big = go.snapshot({"w": torch.ones(3 * _MIB, dtype=torch.uint8)}, arena=arena)
        assert arena.capacity_bytes == 3 * _MIB and arena.stats()["num_slabs"] == 1
        big.free()
        arena.trim()
        assert go.memory_stats()["node"]["reserved_bytes"] == 0


# ----------------------------------------------------------------------------------------------- NUMA

_libc = ctypes.CDLL(None, use_errno=True)
_SYS_GET_MEMPOLICY = {"x86_64": 239, "aarch64": 236}.get(os.uname().machine)
_SYS_MOVE_PAGES = {"x86_64": 279, "aarch64": 239}.get(os.uname().machine)
_MPOL_PREFERRED, _MPOL_F_ADDR = 1, 2


def _policy(addr: int) -> tuple[int, int]:
    """The kernel's policy for the page at addr: (mode, first word of the node mask)."""
    mode, mask = ctypes.c_int(-1), (ctypes.c_ulong * 16)()
    rc = _libc.syscall(_SYS_GET_MEMPOLICY, ctypes.byref(mode), mask, ctypes.c_ulong(1025), ctypes.c_void_p(addr),
                       ctypes.c_ulong(_MPOL_F_ADDR))
    if rc != 0:
        pytest.skip(f"get_mempolicy is not allowed here: {os.strerror(ctypes.get_errno())}")
    return mode.value, mask[0]


def _page_nodes(addr: int, nbytes: int) -> set[int]:
    """The NUMA nodes the range's pages are on, every page asked (move_pages without moving)."""
    n = nbytes // 4096
    pages = (ctypes.c_void_p * n)(*[addr + 4096 * i for i in range(n)])
    status = (ctypes.c_int * n)()
    rc = _libc.syscall(_SYS_MOVE_PAGES, 0, ctypes.c_ulong(n), pages, None, status, 0)
    assert rc == 0, os.strerror(ctypes.get_errno())
    return set(status)


@pytest.fixture
def sysfs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """A stand-in sysfs with one GPU at PCI address 0000:3b:00.0 on a one-node machine; returns a function
    that writes the GPU's numa_node (None: no such file)."""
    if _SYS_GET_MEMPOLICY is None:
        pytest.skip("syscall numbers for this architecture are not listed")
    device = tmp_path / "bus" / "pci" / "devices" / "0000:3b:00.0"
    device.mkdir(parents=True)
    (tmp_path / "devices" / "system" / "node").mkdir(parents=True)
    (tmp_path / "devices" / "system" / "node" / "has_memory").write_text("0\n")
    monkeypatch.setenv("GPU_OFFLOAD_SYSFS_ROOT", str(tmp_path))
    monkeypatch.setattr(_topology, "pci_address", lambda index: "0000:3b:00.0")  # what the driver would say
    _topology.clear_cache()
    _arena._logged_notes.clear()  # each test sees its own first log line

    def set_node(text: str | None) -> None:
        if text is None:
            (device / "numa_node").unlink(missing_ok=True)
        else:
            (device / "numa_node").write_text(text)
        _topology.clear_cache()

    yield set_node
    _topology.clear_cache()


def test_slabs_for_a_gpu_on_node_0_are_bound_to_node_0(sysfs: Any) -> None:
    sysfs("0\n")
    gpu = torch.device("cuda", 0)  # a device object only: nothing here touches CUDA
    arena = go.Arena(min_slab_bytes=2 * _MIB, pin="none")
    plain = arena._allocate(_MIB)
    assert _policy(plain.ptr)[0] == 0  # MPOL_DEFAULT: a region for no GPU is not placed
    region = arena._allocate(_MIB, devices=[gpu])
    assert _policy(region.ptr) == (_MPOL_PREFERRED, 1)  # node 0, asked before the pages were touched
    assert _page_nodes(region.ptr, _MIB) == {0}
    arena.reserve(4 * _MIB, device="cuda:0")  # the public way to pin ahead for a GPU
    assert arena.stats()["bytes_by_numa_node"] == {0: arena.capacity_bytes}
    assert go.memory_stats()["process"]["bytes_by_numa_node"].get(0, 0) >= arena.capacity_bytes
    region.release()
    plain.release()


@pytest.mark.parametrize("content", ["-1\n", None, "garbage"], ids=["minus-one", "absent", "garbage"])
def test_an_unknown_node_falls_back_with_one_log_line(sysfs: Any, content: str | None,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    sysfs(content)
    arena = go.Arena(min_slab_bytes=_MIB, pin="none")
    with caplog.at_level(logging.INFO, logger="gpu_offload"):
        regions = [arena._allocate(2 * _MIB, devices=[torch.device("cuda", 0)]) for _ in range(2)]
    lines = [r.getMessage() for r in caplog.records if "NUMA node unknown" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith("cuda:0: NUMA node unknown"), lines
    assert "numa_node" in lines[0]
    assert all(_policy(r.ptr)[0] == 0 for r in regions)  # left to the kernel
    for r in regions:
        r.release()


def test_a_node_the_machine_lacks_falls_back_with_one_log_line(sysfs: Any, caplog: pytest.LogCaptureFixture) -> None:
    sysfs("7\n")  # sysfs names a node the kernel has no memory on
    arena = go.Arena(min_slab_bytes=_MIB, pin="none")
    with caplog.at_level(logging.INFO, logger="gpu_offload"):
        regions = [arena._allocate(2 * _MIB, devices=[torch.device("cuda", 0)]) for _ in range(2)]
    lines = [r.getMessage() for r in caplog.records if "could not place" in r.getMessage()]
    assert len(lines) == 1 and "NUMA node 7" in lines[0] and "mbind" in lines[0], lines
    assert arena.stats()["num_slabs"] == 2 and all(_policy(r.ptr)[0] == 0 for r in regions)
    for r in regions:
        r.release()


# ------------------------------------------------------------------------------------ no surprise peaks

_FIRST_SNAPSHOT = textwrap.dedent("""
    import json, time, torch
    import torch.distributed.fsdp  # noqa: F401  imported first: the figure is the arena's, not the adapters'
    import gpu_offload as go

    def rss():
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))

    model = torch.nn.Linear(16, 16)
    before, start = rss(), time.perf_counter()
    snap = go.snapshot(model).wait()
    seconds, after = time.perf_counter() - start, rss()
    print(json.dumps({"rss_growth": after - before, "seconds": seconds, "nbytes": snap.nbytes,
                      "capacity": go.default_arena().capacity_bytes}))
""")


def test_a_first_snapshot_of_a_1kb_model_grows_rss_by_under_16_mib() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPU_OFFLOAD_")}
    env["GPU_OFFLOAD_PIN"] = "none"  # pages are touched either way; none is what runs here
    out = subprocess.run([sys.executable, "-c", _FIRST_SNAPSHOT], env=env, capture_output=True, text=True,
                         timeout=_TIMEOUT)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["nbytes"] == (16 * 16 + 16) * 4
    assert got["capacity"] == 4096  # one page, not GPU_OFFLOAD_MIN_SLAB_BYTES
    assert got["rss_growth"] < 16 * _MIB, got


def test_the_arena_stays_within_1_02x_its_payload_plus_one_slab() -> None:
    # A 10 GB arena of 256 MiB slabs at 1/64 of the scale: 160 MiB of payload in slabs of 4 MiB, regions of
    # 4 KiB to 16 MiB in random order, no frees. Sizes are whole pages, so that what is measured is the slab
    # policy (a region's own slab is rounded up to a page; at 10 GB that is under 0.2%).
    min_slab = 4 * _MIB
    arena = go.Arena(min_slab_bytes=min_slab, pin="none")
    rng = random.Random(24)
    payload, snaps = 0, []
    while payload < 160 * _MIB:
        nbytes = 4096 * int(2 ** rng.uniform(0, 12))
        snaps.append(go.snapshot({"t": torch.empty(nbytes, dtype=torch.uint8)}, arena=arena))
        payload += nbytes
        assert arena.capacity_bytes <= 1.02 * payload + min_slab, (len(snaps), arena.capacity_bytes, payload)
    assert arena.used_bytes == payload
    for s in snaps:
        s.free()


_PEAKS = textwrap.dedent("""
    import json, os, tempfile, torch
    import torch.distributed.fsdp  # noqa: F401  (see above)
    import gpu_offload as go

    def reset_peak():
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")

    def peak_growth(fn):
        with open("/proc/self/status") as f:
            before = next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmRSS:"))
        reset_peak()
        result = fn()
        with open("/proc/self/status") as f:
            peak = next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmHWM:"))
        return peak - before, result

    n = 24 << 20
    state = {"a": torch.ones(n // 2, dtype=torch.uint8), "b": torch.ones(n // 2, dtype=torch.uint8)}
    out = {}
    out["snapshot"], snap = peak_growth(lambda: go.snapshot(state))
    folder = tempfile.TemporaryDirectory()  # removed when the child exits
    path = os.path.join(folder.name, "s.safetensors")
    out["save"], _ = peak_growth(lambda: go.save(snap, path))
    snap.free()
    out["offload"], _ = peak_growth(lambda: go.offload(state))  # into the freed region
    out["reload"], _ = peak_growth(lambda: go.reload(state))
    out["load"], loaded = peak_growth(lambda: go.load(path))
    out["capacity"] = go.default_arena().capacity_bytes
    print(json.dumps(out))
""")


def test_no_call_holds_a_second_host_copy() -> None:
    # Peak RSS during each call (VmHWM, reset before it): the arena's region and, for reload, the storages
    # coming back; never a staging copy on top.
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPU_OFFLOAD_")}
    env["GPU_OFFLOAD_PIN"] = "none"
    out = subprocess.run([sys.executable, "-c", _PEAKS], env=env, capture_output=True, text=True, timeout=_TIMEOUT)
    if "clear_refs" in out.stderr:
        pytest.skip("this kernel does not let a process reset its peak RSS")
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    n, slack = 24 * _MIB, 4 * _MIB
    assert got["capacity"] <= 2 * n + 2 * _MIB, got  # the snapshot's region, then the load's
    assert got["snapshot"] <= n + slack, got
    assert got["save"] <= slack and got["offload"] <= slack, got
    assert got["reload"] <= n + slack, got
    assert got["load"] <= n + slack, got


# ------------------------------------------------------------------------------------- visible, clear


def test_memory_stats_says_what_this_process_and_the_node_hold() -> None:
    arena = go.default_arena()
    snap = go.snapshot({"t": torch.ones(_MIB, dtype=torch.uint8)})
    stats = go.memory_stats()
    process, node = stats["process"], stats["node"]
    assert set(process) >= {"pinned_bytes", "registered_bytes", "pageable_bytes", "used_bytes", "capacity_bytes",
                            "largest_free_bytes", "bytes_by_numa_node"}
    assert process["used_bytes"] == arena.used_bytes >= _MIB
    assert process["capacity_bytes"] == arena.capacity_bytes
    assert process["largest_free_bytes"] == arena.stats()["largest_free_block_bytes"]
    total = process["pinned_bytes"] + process["pageable_bytes"]
    assert total >= arena.capacity_bytes and sum(process["bytes_by_numa_node"].values()) == total
    if arena.pin_mode == "none":
        assert process["pinned_bytes"] == process["registered_bytes"] == 0
    assert set(node) == {"max_bytes", "reserved_bytes", "by_pid", "ledger"}
    soft = __import__("resource").getrlimit(__import__("resource").RLIMIT_MEMLOCK)[0]
    assert stats["memlock_limit_bytes"] == (None if soft == __import__("resource").RLIM_INFINITY else soft)
    json.dumps(stats)  # plain data
    snap.free()


def test_a_pinning_failure_says_what_to_change() -> None:
    if not go.build_info()["cuda"] or go.cuda_available():
        pytest.skip("needs a CUDA build on a machine where pinning fails (no device here)")
    arena = go.Arena(pin="hostalloc")
    with pytest.raises(go.OffloadError) as info:
        arena.reserve(4096)
    message = str(info.value)
    assert "pinning a slab of 4 KiB" in message and "ulimit -l" in message
    assert "GPU_OFFLOAD_PIN=none" in message and "--ulimit memlock=-1" in message
    assert arena.capacity_bytes == 0 and go.memory_stats()["node"]["reserved_bytes"] == 0


def test_info_shows_the_budget_the_gpus_nodes_and_memory_stats(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPU_OFFLOAD_")}
    env.update(GPU_OFFLOAD_NODE_MAX_BYTES="0.5", GPU_OFFLOAD_LEDGER_DIR=str(tmp_path), COLUMNS="200")
    out = subprocess.run([sys.executable, "-m", "gpu_offload", "info"], env=env, capture_output=True, text=True,
                         timeout=_TIMEOUT)
    assert out.returncode == 0, out.stderr
    assert "node budget" in out.stdout and "GiB" in out.stdout
    assert "NUMA" in out.stdout and str(tmp_path) in out.stdout
    # A bad value is refused with the arena's message (in this process: the same code, without a torch import).
    from gpu_offload import cli

    monkeypatch.setenv("GPU_OFFLOAD_NODE_MAX_BYTES", "1.5")
    assert cli.main(["info"]) == 2
    assert "GPU_OFFLOAD_NODE_MAX_BYTES='1.5'" in capsys.readouterr().err


def test_info_dict_has_the_facts_as_data(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from gpu_offload import cli

    info = cli.info_dict()
    assert info["node_budget"]["max_bytes"] == _arena.node_budget_from_env()[0]
    assert set(info["memory"]) == {"process", "node", "memlock_limit_bytes"}
    assert isinstance(info["gpus"], list) and isinstance(info["numa_nodes"], list)


@pytest.mark.cuda
def test_bench_reports_the_limit_from_local_and_remote_memory() -> None:
    from gpu_offload import bench

    layout = bench.load_layout("tiny4k", scale=bench.default_scale("tiny4k", torch.device("cuda")))
    b = bench.Bench(layout, torch.device("cuda"), repeats=1)
    bench.measure_limits(b)
    rows = bench.measure_numa_limits(b)
    if len(_topology.online_nodes()) < 2 or _topology.gpu_numa_node(torch.cuda.current_device()) < 0:
        assert rows == []
        return
    assert [(r.method.split(" memory")[0], r.direction) for r in rows] == [
        ("limit from local", "d2h"), ("limit from local", "h2d"), ("limit from remote", "d2h"),
        ("limit from remote", "h2d")]
    assert all(r.ratio is not None and r.gbps > 0 for r in rows)
