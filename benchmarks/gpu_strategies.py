"""The strategies on a real device: FSDP1, FSDP1 (use_orig_params), FSDP2, megatron-core DDP and DeepSpeed ZeRO
1/2/3 at world size 1.

For each: train a step, snapshot v1, train, snapshot v2, restore v1 (probe logits must equal v1's), restore
v2, offload model + optimizer (device memory must drop by the offloaded bytes on CUDA), reload, train on
and compare losses bitwise with an untouched twin. Writes a JSON record of what ran and what held.

    python benchmarks/gpu_strategies.py --device cuda --json out/strategies.json     # NCCL, on a GPU
    python benchmarks/gpu_strategies.py --device cpu                                 # gloo, to try it here

DeepSpeed (skipped when it is not installed): per ZeRO stage, go.offload/go.reload of the engine and the
drop-ins offload_states/reload_states timed beside DeepSpeed's own engine.offload_states/reload_states on a
twin engine (same states: weights, fp32 masters, Adam state, gradients), with the device memory each frees and
a bitwise check that both engines train on identically. Stage 3 uses FusedAdam, which DeepSpeed's own
offload_states requires (compiled on first use).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import gpu_offload as go  # noqa: E402
from helpers_dist import batch, build_qwen2, free_port, lm_loss  # noqa: E402


def _allocated(device: torch.device) -> int:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return torch.cuda.memory_allocated(device)
    return 0


def _probe(model: Any, device: torch.device) -> torch.Tensor:
    with torch.no_grad():
        return model(batch(999).to(device)).float().cpu()


def _step(model: Any, opt: torch.optim.Optimizer, step: int, device: torch.device) -> float:
    opt.zero_grad(set_to_none=True)
    ids = batch(step).to(device)
    loss = lm_loss(model(ids), ids)
    loss.backward()
    opt.step()
    return loss.item()


def _wrap_fsdp1(model: torch.nn.Module, device: torch.device, orig: bool) -> torch.nn.Module:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    return FSDP(model.to(device), device_id=device if device.type == "cuda" else torch.device("cpu"),
                use_orig_params=orig)


def _wrap_fsdp2(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = model.to(device)
    mesh = init_device_mesh(device.type, (1,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def check_strategy(name: str, wrap: Callable[[torch.nn.Module], torch.nn.Module], device: torch.device) -> dict:
    record: dict[str, Any] = {"strategy": name, "device": str(device)}
    model = wrap(build_qwen2(seed=1))
    twin = wrap(build_qwen2(seed=1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    twin_opt = torch.optim.AdamW(twin.parameters(), lr=1e-2)
    losses = [_step(model, opt, 0, device)]
    twin_losses = [_step(twin, twin_opt, 0, device)]
    v1 = go.snapshot(model)
    out_v1 = _probe(model, device)
    losses.append(_step(model, opt, 1, device))
    twin_losses.append(_step(twin, twin_opt, 1, device))
    v2 = go.snapshot(model)
    out_v2 = _probe(model, device)
    go.restore(model, v1)
    record["restore_v1_bitwise"] = bool(torch.equal(_probe(model, device), out_v1))
    go.restore(model, v2)
    record["restore_v2_bitwise"] = bool(torch.equal(_probe(model, device), out_v2))
    record["snapshot_nbytes"] = v1.nbytes
    v1.free()
    v2.free()

    opt.zero_grad(set_to_none=True)
    before = _allocated(device)
    go.offload([model, opt])
    record["offloaded_bytes"] = go.offloaded_bytes()
    record["memory_allocated_drop"] = before - _allocated(device)
    record["is_offloaded"] = go.is_offloaded([model, opt])
    go.reload([model, opt])
    record["memory_allocated_back"] = _allocated(device) == before
    for step in range(2, 5):
        losses.append(_step(model, opt, step, device))
        twin_losses.append(_step(twin, twin_opt, step, device))
    record["losses"] = losses
    record["training_matches_twin_bitwise"] = losses == twin_losses
    record["ok"] = bool(record["restore_v1_bitwise"] and record["restore_v2_bitwise"] and record["is_offloaded"]
                        and record["training_matches_twin_bitwise"]
                        and (device.type != "cuda" or record["memory_allocated_drop"] >= record["offloaded_bytes"]))
    return record


def check_megatron(device: torch.device) -> dict:
    """megatron-core DDP (distributed optimizer) on the device; on the CPU with the test suite's patches."""
    record: dict[str, Any] = {"strategy": "megatron-ddp", "device": str(device)}
    try:
        import megatron.core
    except ImportError as exc:
        return {**record, "ran": False, "why": f"megatron-core not importable: {exc}"}
    record["megatron_core"] = getattr(megatron.core, "__version__", "?")
    from megatron.core import parallel_state, tensor_parallel

    if device.type == "cuda":
        ctx: Any = contextlib.nullcontext
    else:
        from megatron_fixtures import megatron_cpu as ctx
    with ctx():
        parallel_state.initialize_model_parallel(1, 1)
        tensor_parallel.model_parallel_cuda_manual_seed(1234)
    try:
        import megatron_fixtures as mf

        if device.type == "cuda":  # no patches on a GPU: the fixture's helpers minus the CPU context
            mf.megatron_cpu = contextlib.nullcontext  # type: ignore[assignment]
            cpu_batch = mf.batch
            mf.batch = lambda *a, **k: cpu_batch(*a, **k).to(device)  # type: ignore[assignment]
        chunks = [mf.build_chunk(seed=3, use_distributed_optimizer=True)]
        if device.type == "cuda":
            chunks = [c.cuda() for c in chunks]
        opt = mf.build_optimizer(chunks, use_distributed_optimizer=True)
        mf.train_step(chunks, opt, step=0)
        v1 = go.snapshot(chunks)
        out_v1 = mf.logits(chunks)
        mf.train_step(chunks, opt, step=1)
        v2 = go.snapshot(chunks)
        go.restore(chunks, v1)
        record["restore_v1_bitwise"] = all(torch.equal(a, b) for a, b in zip(mf.logits(chunks), out_v1))
        go.restore(chunks, v2)
        before = _allocated(device)
        go.offload([chunks, opt])
        record["offloaded_bytes"] = go.offloaded_bytes()
        record["memory_allocated_drop"] = before - _allocated(device)
        go.reload([chunks, opt])
        # grads="drop": the fp32 grad buffers leave too, without a copy (verl's offload_megatron_model_to_cpu).
        grad_bytes = sum(b.grad_data.untyped_storage().nbytes() for c in chunks for b in c.buffers)
        before = _allocated(device)
        go.offload([chunks, opt], grads="drop")
        record["grads_drop_offloaded_bytes"] = go.offloaded_bytes()
        record["grads_drop_memory_allocated_drop"] = before - _allocated(device)
        record["grad_buffer_bytes"] = grad_bytes
        go.reload([chunks, opt])
        record["grads_zeroed"] = all(not b.grad_data.any() for c in chunks for b in c.buffers)
        mf.train_step(chunks, opt, step=2)
        buf = chunks[0].buffers[0]
        record["params_still_views"] = all(p.untyped_storage().data_ptr() == buf.param_data.untyped_storage().data_ptr()
                                           for p in buf.params)
        record["ok"] = bool(record["restore_v1_bitwise"] and record["params_still_views"] and record["grads_zeroed"]
                            and record["grads_drop_offloaded_bytes"] == record["offloaded_bytes"]
                            and (device.type != "cuda" or record["grads_drop_memory_allocated_drop"]
                                 >= record["offloaded_bytes"] + grad_bytes))
    finally:
        parallel_state.destroy_model_parallel()
    return record


def _timed(fn: Callable[[], Any], device: torch.device) -> float:
    import time

    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def check_deepspeed(device: torch.device, stage: int, repeats: int = 3) -> dict:
    """go.offload/reload and the drop-ins against DeepSpeed's own offload_states/reload_states, one stage."""
    record: dict[str, Any] = {"strategy": f"deepspeed-zero{stage}", "device": str(device)}
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if device.type == "cuda" else "cpu")
    try:
        import deepspeed
    except ImportError as exc:
        return {**record, "ran": False, "why": f"deepspeed not importable: {exc}"}
    from gpu_offload.integrations.deepspeed import offload_states, reload_states

    record["deepspeed"] = deepspeed.__version__
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK=str(device.index or 0))
    # Big enough on a GPU to measure the link (about 0.1 B parameters: 2 GB of fp32 weights, masters, Adam, grads).
    config = {"hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 8, "num_attention_heads": 16,
              "num_key_value_heads": 4, "vocab_size": 32000} if device.type == "cuda" else None

    def engine() -> Any:
        model = build_qwen2(config, seed=1)  # fp32: the tiny Qwen2 computes its rotary tables in fp32
        ds_config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 10**9,
                     "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": stage != 3}},
                     "zero_optimization": {"stage": stage}}
        eng, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
        return eng

    def train(eng: Any, step: int) -> float:
        ids = batch(step, config=config).to(device)
        loss = lm_loss(eng(ids), ids)
        eng.backward(loss)
        eng.step()
        return loss.item()

    ours, theirs = engine(), engine()
    for step in range(2):
        train(ours, step), train(theirs, step)
    timings: dict[str, list[float]] = {k: [] for k in ("go_offload", "go_reload", "dropin_offload", "dropin_reload",
                                                      "ds_offload", "ds_reload")}
    for _ in range(repeats):
        before = _allocated(device)
        timings["go_offload"].append(_timed(lambda: go.offload(ours, include_grads=True), device))
        record["go_freed"] = before - _allocated(device)
        record["go_offloaded_bytes"] = go.offloaded_bytes()
        timings["go_reload"].append(_timed(lambda: go.reload(ours), device))
        timings["dropin_offload"].append(_timed(lambda: offload_states(ours), device))
        record["dropin_freed"] = before - _allocated(device)
        timings["dropin_reload"].append(_timed(lambda: reload_states(ours), device))
        before = _allocated(device)
        timings["ds_offload"].append(_timed(theirs.offload_states, device))
        record["ds_freed"] = before - _allocated(device)
        timings["ds_reload"].append(_timed(theirs.reload_states, device))
    record["seconds"] = timings  # first call of DeepSpeed's own allocates its pinned buffers
    record["best_seconds"] = {k: min(v) for k, v in timings.items()}
    losses = [(train(ours, step), train(theirs, step)) for step in range(2, 4)]
    record["losses"] = losses
    record["training_matches_bitwise"] = all(a == b for a, b in losses)
    record["ok"] = bool(record["training_matches_bitwise"])
    del ours, theirs
    return record


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    device = torch.device(args.device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        # (torch 2.11 refuses a device without an index here: "cuda" alone is the current one.)
        torch.cuda.set_device(device.index if device.index is not None else torch.cuda.current_device())
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    dist.init_process_group(backend, rank=0, world_size=1)
    checks: list[tuple[str, Callable[[], dict]]] = [
        ("fsdp1", lambda: check_strategy("fsdp1", lambda m: _wrap_fsdp1(m, device, False), device)),
        ("fsdp1-orig", lambda: check_strategy("fsdp1-use_orig_params", lambda m: _wrap_fsdp1(m, device, True), device)),
        ("fsdp2", lambda: check_strategy("fsdp2", lambda m: _wrap_fsdp2(m, device), device)),
        ("megatron", lambda: check_megatron(device)),
    ] + [(f"deepspeed-zero{s}", lambda s=s: check_deepspeed(device, s)) for s in (1, 2, 3)]
    records = []
    for name, fn in checks:
        try:
            rec = fn()
            rec.setdefault("ran", True)
        except Exception as exc:  # record and go on: one strategy failing must not hide the others
            rec = {"strategy": name, "ran": True, "ok": False, "error": f"{type(exc).__name__}: {exc}",
                   "traceback": traceback.format_exc()[-2000:]}
        records.append(rec)
        print(f"{rec['strategy']:<24} ran={rec.get('ran')} ok={rec.get('ok')} "
              f"{rec.get('error') or rec.get('why') or ''}", flush=True)
    dist.destroy_process_group()
    info = {"torch": torch.__version__, "build": go.build_info(), "backend": backend, "records": records}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(info, indent=1, default=str))
    return 0 if all(r.get("ok") or not r.get("ran") for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
