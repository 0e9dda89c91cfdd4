"""The examples run as programs (a subprocess each, as a user runs them) and do what they say.

Each example prints a JSON summary as its last line; the checks read it and the human-readable lines.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"


def run_example(name: str, *args: str, timeout: float) -> subprocess.CompletedProcess:
    """Runs examples/<name> with this interpreter; kills its whole process group on timeout (a Ray example
    leaves no raylet behind)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPU_OFFLOAD_")}
    env["PYTHONUNBUFFERED"] = "1"
    proc = subprocess.Popen([sys.executable, str(EXAMPLES / name), *args], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{name} did not finish in {timeout}s\nstdout:\n{out[-3000:]}\nstderr:\n{err[-3000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def summary(proc: subprocess.CompletedProcess) -> dict:
    assert proc.returncode == 0, (
        f"exit {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_policy_snapshot() -> None:
    proc = run_example("policy_snapshot.py", "--steps", "30", timeout=120)
    s = summary(proc)
    ratios, losses, moved = s["ratios"], s["losses"], s["offloaded_bytes"]
    assert len(ratios) == len(losses) == len(moved) == 30

    # Step 0: the previous policy is the current one, so the ratio is exactly 1 for every sample.
    assert ratios[0] == {"mean": 1.0, "min": 1.0, "max": 1.0}
    assert "step   0 " in proc.stdout and "ratio mean 1.000000 min 1.000000 max 1.000000" in proc.stdout
    # Afterwards the restored old weights differ from the current ones: had restore done nothing (or
    # restored the wrong snapshot), the ratio would still be exactly 1.
    assert all(r["min"] < 1.0 < r["max"] for r in ratios[1:])
    assert all(0.5 < r["mean"] < 1.5 for r in ratios)

    # Training works through the offload/reload and restore cycles: the loss goes down.
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < first - 0.1, losses

    # What left the device: the parameters at step 0 (Adam has no state yet), then parameters plus Adam's
    # two moments and its step counters.
    params = s["param_bytes"]
    assert moved[0] == params
    assert all(3 * params <= m <= 3 * params + 1024 for m in moved[1:]), (params, moved)


def test_ray_fsdp2_offload() -> None:
    pytest.importorskip("ray", reason="ray is not installed (pip install ray, or the package's 'test' extra)")
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    # The example starts a local Ray instance (ray.init(num_cpus=2, include_dashboard=False)) and shuts it
    # down; two actors are the two ranks of a gloo process group.
    proc = run_example("ray_fsdp2_offload.py", "--world-size", "2", timeout=240)
    s = summary(proc)
    assert s["ok"] is True
    assert s["world_size"] == 2 and len(s["ranks"]) == 2
    full = s["full_param_bytes"]
    shard_total = 0
    for r in s["ranks"]:
        # Each rank moved its own shard of the parameters and of AdamW's state, not the whole model.
        assert r["offloaded_bytes"] > 0
        assert r["offloaded_bytes"] == r["snapshot_nbytes"] == r["param_storage_bytes"] + r["optimizer_storage_bytes"]
        assert full // 2 <= r["param_storage_bytes"] <= full // 2 + 4096, (r, full)
        assert 2 * r["param_storage_bytes"] <= r["optimizer_storage_bytes"] <= 2 * r["param_storage_bytes"] + 1024
        # FSDP2's sharded storage really was released, and came back bitwise identical.
        assert r["held_after_offload"] == 0
        assert r["offloaded_after_reload"] == 0
        assert r["bitwise_equal"] is True
        shard_total += r["param_storage_bytes"]
        assert f"rank {r['rank']}: offloaded {r['offloaded_bytes']} bytes" in proc.stdout
        assert f"rank {r['rank']}: gloo on node" in proc.stdout
    assert full <= shard_total <= full + 8192
    # Training went on after the round trip on every rank.
    assert len(s["losses"]) == 4 and all(len(step) == 2 and all(x > 0 for x in step) for step in s["losses"])


def test_verl_fsdp2_worker() -> None:
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    # Two gloo ranks spawned by the example itself; 2 windows of 3 local steps (the defaults).
    proc = run_example("verl_fsdp2_worker.py", timeout=180)
    s = summary(proc)
    assert s["ok"] is True and s["world_size"] == 2 and len(s["ranks"]) == 2
    full, buffers = s["full_param_bytes"], s["buffer_bytes"]
    for r in s["ranks"]:
        rank = r["rank"]
        assert f"rank {rank}: OK: 4 restores of v1 reproduced its log-probs bitwise" in proc.stdout
        assert r["restores_checked"] == 4
        # A slot is this rank's shard (exactly half: every dimension of the model is even) plus the
        # replicated buffers, for every slot number; not the whole model.
        assert r["slot_bytes"] == full // 2 + buffers, (r["slot_bytes"], full, buffers)
        assert all(step["slot_bytes"] == r["slot_bytes"] for step in r["steps"])
        assert f"rank {rank}: window 1 local step 3: slot 3 keeps {r['slot_bytes']} bytes" in proc.stdout
        steps = r["steps"]
        assert len(steps) == 6
        for step in steps:
            if step["local_step"] == 1:  # old log-probs from the current weights: the ratio is 1
                assert abs(step["ratio_min"] - 1) < 1e-6 and abs(step["ratio_max"] - 1) < 1e-6, step
            else:  # old log-probs from the restored v1: had the restore done nothing, the ratio would be 1
                assert step["ratio_min"] < 1 < step["ratio_max"], step
                assert 0.5 < step["ratio_mean"] < 1.5, step


@pytest.mark.parametrize("flags", [[], ["--no-distributed-optimizer"]], ids=["distopt", "ddp"])
def test_megatron_mis(flags: list[str]) -> None:
    pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install megatron-core)")
    proc = run_example("megatron_mis.py", *flags, timeout=180)
    s = summary(proc)
    assert s["ok"] is True and s["restores_checked"] == 3 and len(s["steps"]) == 4
    assert "OK: 3 restores of v1 reproduced its log-probs bitwise" in proc.stdout
    params = s["param_bytes"]
    if s["distributed_optimizer"]:
        # One flat param_data buffer (padded) holds every parameter; the copy is that one storage.
        assert s["v1_names"] == ["0.buffers.0.param_data"]
        assert params <= s["v1_nbytes"] <= params + 4096, (s["v1_nbytes"], params)
        assert "1 storage(s): 0.buffers.0.param_data" in proc.stdout
    else:
        # Plain DDP: the parameters keep their own storages (the tied output weight counted once).
        assert s["v1_names"] == [] and s["v1_nbytes"] == params
    first, *later = s["steps"]
    assert first["ratio_min"] == first["ratio_max"] == 1.0
    assert "step 0: importance ratio pi_v2/pi_v1 mean 1.000000 min 1.000000 max 1.000000" in proc.stdout
    for step in later:
        assert step["ratio_min"] < 1 < step["ratio_max"] and 0.5 < step["ratio_mean"] < 1.5, step
        assert f"step {step['step']}: importance ratio pi_v2/pi_v1 mean {step['ratio_mean']:.6f}" in proc.stdout


def test_async_checkpoint() -> None:
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    # Two gloo ranks spawned by the example; a checkpoint every 3 of 12 steps (the defaults).
    proc = run_example("async_checkpoint.py", timeout=240)
    s = summary(proc)
    assert s["ok"] is True and s["world_size"] == 2 and len(s["ranks"]) == 2
    for r in s["ranks"]:
        rank = r["rank"]
        # The last checkpoint, loaded into a fresh model, is the state at its save although training went on.
        assert r["verified"] is True and r["changed_since"] is True
        assert f"rank {rank}: OK: " in proc.stdout and "bitwise the state at its save" in proc.stdout
        saves = r["saves"]
        assert [x["step"] for x in saves] == [3, 6, 9]
        # Each save stages this rank's shards (about half of the model and AdamW state), into an arena that
        # neither grows nor allocates after the first save.
        assert all(x["staged_bytes"] == saves[0]["staged_bytes"] > 0 for x in saves)
        assert {(x["arena_capacity"], x["slab_allocations"]) for x in saves} == {
            (saves[0]["arena_capacity"], saves[0]["slab_allocations"])}
        assert len(r["losses"]) == 12 and all(x > 0 for x in r["losses"])
        assert f"rank {rank}: step 9: checkpoint of {saves[-1]['staged_bytes']} bytes staged" in proc.stdout
    total = sum(r["saves"][0]["staged_bytes"] for r in s["ranks"])
    assert abs(s["ranks"][0]["saves"][0]["staged_bytes"] - total / 2) < total / 8


@pytest.mark.parametrize("flags", [[], ["--stage", "2", "--bf16"]], ids=["zero3-fp32", "zero2-bf16"])
def test_deepspeed_offload(flags: list[str]) -> None:
    pytest.importorskip("deepspeed", reason="deepspeed is not installed (the package's 'deepspeed' extra)")
    # The op DeepSpeed compiles on its first initialize is cached where the DeepSpeed tests cache it.
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / "build" / "torch_extensions"))
    proc = run_example("deepspeed_offload.py", *flags, timeout=300)
    s = summary(proc)
    assert s["ok"] is True and len(s["steps"]) == 4
    first, *later = s["steps"]
    assert first["ratio_min"] == first["ratio_max"] == 1.0
    assert "step 0: " in proc.stdout and "ratio mean 1.000000 min 1.000000 max 1.000000" in proc.stdout
    for step in s["steps"]:
        # Weights, masters, Adam state and grads left (nothing of them held) and came back bitwise.
        assert step["held_after_offload"] == 0 and step["bitwise_after_reload"] is True, step
    # From step 1 on Adam's two moments are offloaded too.
    assert all(step["offloaded_bytes"] > first["offloaded_bytes"] for step in later)
    for step in later:  # had the restore of the old policy done nothing, the ratio would be exactly 1
        assert step["ratio_min"] < 1 < step["ratio_max"] and 0.5 < step["ratio_mean"] < 1.5, step
