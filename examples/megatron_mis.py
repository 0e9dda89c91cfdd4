"""Off-policy correction (MIS) on a megatron-core model with copy_megatron_model_to_cpu / restore_...

verl's Megatron actor keeps the weights the rollout engine generated with (v1) in host memory while it
trains on; for every new batch it computes the old log-probs under v1:

    v1 = copy_megatron_model_to_cpu(models)           # at the weight sync
    ...train...
    v2 = copy_megatron_model_to_cpu(models)           # save the current weights
    restore_megatron_model_from_cpu(models, v1)       # v1 back in place
    old_log_prob = compute_log_prob(models, batch)
    restore_megatron_model_from_cpu(models, v2)       # back to the current weights, then train on

`gpu_offload.integrations.megatron` provides these two functions with verl's names: one batched copy into
the pinned arena per call, the parameters staying views into DDP's flat `param_data` buffer. This example
runs that loop on one DDP-wrapped `GPTModel` chunk (Qwen2-shaped: RMSNorm, grouped-query attention with
q/k/v biases, SwiGLU, RoPE, tied embedding) with the Megatron optimizer (the distributed optimizer by
default, so that the chunk's parameters live in `param_data`). At every step it checks that restoring v1
reproduces v1's log-probs on a fixed probe batch bitwise, and that restoring v2 reproduces v2's; it prints
the importance-ratio stats pi_v2 / pi_v1 of each batch, an OK line, and a JSON summary as the last line.
It exits with status 1 when a restore is not bitwise exact.

On the CPU (one gloo rank) megatron-core needs a few patches, in `_cpu_only()` below; they are used only
around building, forward passes and optimizer steps, never around the gpu_offload calls. **On a GPU none
of them is needed**: drop `_cpu_only()` and build the model on CUDA as usual.

    python examples/megatron_mis.py [--steps 4] [--no-distributed-optimizer]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import socket
import sys
import warnings
from typing import Any, Iterator
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from gpu_offload.integrations.megatron import copy_megatron_model_to_cpu, restore_megatron_model_from_cpu

VOCAB, HIDDEN, FFN, LAYERS, HEADS, KV_HEADS, MAX_SEQ = 128, 64, 128, 2, 4, 2, 64
SEQ, BATCH = 16, 4


# ------------------------------------------------------------------------------------- CPU-only patches


class _CudaNamesOnCpu(TorchFunctionMode):
    """Megatron's optimizer code is written for CUDA: it creates small tensors with device="cuda" (the
    found-inf flag, the loss-scale constants, the grad-norm buffers of gradient clipping) and accepts a
    parameter only if `param.type()` names a torch.cuda tensor type. On the CPU this mode sends
    device="cuda" to the CPU, reports CPU tensors under their CUDA type names, and makes `.cuda()` a no-op."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        device = kwargs.get("device")
        if (isinstance(device, str) and device.startswith("cuda")) or (
                isinstance(device, torch.device) and device.type == "cuda"):
            kwargs = {**kwargs, "device": "cpu"}
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name if args[0].is_cuda else name.replace("torch.", "torch.cuda.", 1)
        if func is torch.Tensor.cuda:
            return args[0]
        return func(*args, **kwargs)


def _record_rng_state(self: Any, name: str, seed: int) -> None:
    # model_parallel_cuda_manual_seed registers CUDA generator states; on the CPU only the name is kept.
    self.seeds_.add(seed)
    self.states_[name] = None


@contextlib.contextmanager
def _no_rng_switch(self: Any, name: str = "") -> Iterator[None]:
    # The attention's dropout forks the CUDA RNG; dropout is 0 here, so nothing draws from it.
    yield


@contextlib.contextmanager
def _cpu_only() -> Iterator[None]:
    """What megatron-core 0.16 needs to build, run and step a DDP chunk without CUDA. Not needed on a GPU."""
    from megatron.core.tensor_parallel import random as mrandom

    with contextlib.ExitStack() as stack:
        # DistributedDataParallel allocates its flat param/grad buffers on torch.cuda.current_device().
        stack.enter_context(mock.patch("torch.cuda.current_device", return_value=torch.device("cpu")))
        stack.enter_context(mock.patch.object(mrandom.CudaRNGStatesTracker, "add", _record_rng_state))
        stack.enter_context(mock.patch.object(mrandom.CudaRNGStatesTracker, "fork", _no_rng_switch))
        stack.enter_context(_CudaNamesOnCpu())
        yield


# --------------------------------------------------------------------------------------- model, steps


def build(use_distributed_optimizer: bool, lr: float) -> tuple[list[Any], Any]:
    """One DDP-wrapped GPTModel chunk (the list verl keeps as actor_module) and its Megatron optimizer."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=LAYERS, hidden_size=HIDDEN, ffn_hidden_size=FFN, num_attention_heads=HEADS,
        num_query_groups=KV_HEADS, normalization="RMSNorm", layernorm_epsilon=1e-6, gated_linear_unit=True,
        activation_func=F.silu, add_bias_linear=False, add_qkv_bias=True, attention_dropout=0.0,
        hidden_dropout=0.0,
        # The fused kernels are CUDA-only; the CPU path needs the unfused ones. The CPU generator for
        # init makes torch.manual_seed decide the weights.
        bias_activation_fusion=False, masked_softmax_fusion=False, bias_dropout_fusion=False,
        apply_rope_fusion=False, use_cpu_initialization=True,
    )
    with _cpu_only():
        torch.manual_seed(0)
        model = GPTModel(config, get_gpt_layer_local_spec(normalization="RMSNorm"), vocab_size=VOCAB,
                         max_sequence_length=MAX_SEQ, share_embeddings_and_output_weights=True,
                         position_embedding_type="rope", rotary_base=10000)
        ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=use_distributed_optimizer,
                                                   grad_reduce_in_fp32=True)
        models = [DistributedDataParallel(config, ddp_config, model)]
        opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=lr, weight_decay=0.0, clip_grad=1.0,
                                                     use_distributed_optimizer=use_distributed_optimizer), models)
    return models, opt


def _log_prob(models: list[Any], ids: torch.Tensor) -> torch.Tensor:
    """log pi(token t+1 | tokens <= t): GPTModel given labels returns the per-token cross entropy."""
    inputs, labels = ids[:, :-1], ids[:, 1:]
    positions = torch.arange(inputs.shape[1]).expand_as(inputs)
    with _cpu_only():
        return -models[0](inputs, positions, attention_mask=None, labels=labels).float()


def compute_log_prob(models: list[Any], ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return _log_prob(models, ids)


def update(models: list[Any], opt: Any, ids: torch.Tensor, old_log_prob: torch.Tensor,
           advantages: torch.Tensor) -> dict[str, float]:
    """One clipped importance-weighted policy-gradient step, the Megatron way: gradients accumulate in the
    DDP grad buffers, finish_grad_sync reduces them, the optimizer updates the parameters."""
    for m in models:
        m.zero_grad_buffer()
    opt.zero_grad()
    ratio = torch.exp(_log_prob(models, ids) - old_log_prob)
    loss = -(ratio.clamp(0.8, 1.2) * advantages[:, None]).mean()
    loss.backward()
    for m in models:
        m.finish_grad_sync()
    with _cpu_only():
        stepped, _, _ = opt.step()
    if not stepped:
        raise RuntimeError("the Megatron optimizer skipped its step")
    r = ratio.detach()
    return {"loss": loss.item(), "ratio_mean": r.mean().item(), "ratio_min": r.min().item(),
            "ratio_max": r.max().item()}


def rollout_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What the rollout engine would hand the trainer: token ids and one advantage per sequence."""
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g), torch.randn(BATCH, generator=g)


def params_are_buffer_views(models: list[Any]) -> bool:
    """With the distributed optimizer every parameter is a view into its buffer's param_data."""
    for m in models:
        for buf in m.buffers:
            if buf.param_data is not None:
                ptr = buf.param_data.untyped_storage().data_ptr()
                if any(p.untyped_storage().data_ptr() != ptr for p in buf.params):
                    return False
    return True


# --------------------------------------------------------------------------------------------- main


def run(args: argparse.Namespace) -> dict[str, Any]:
    from megatron.core import parallel_state, tensor_parallel

    with _cpu_only():
        parallel_state.initialize_model_parallel(1, 1)
        tensor_parallel.model_parallel_cuda_manual_seed(1234)
    try:
        models, opt = build(args.distributed_optimizer, args.lr)
        probe = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(999))

        v1 = copy_megatron_model_to_cpu(models)  # the weight sync: what the rollout engine generates with
        probe_v1 = compute_log_prob(models, probe)
        # The flat buffers by name; the parameters are listed too (as views into them, or on their own).
        names = [n for n in v1.names if ".module." not in n]
        what = ", ".join(names) or "the parameters, one storage each (no param_data without the distributed optimizer)"
        print(f"v1: {v1.nbytes} bytes in host memory, {v1.num_storages} storage(s): {what}")
        steps: list[dict[str, Any]] = []
        for step in range(args.steps):
            ids, advantages = rollout_batch(step)
            if step == 0:  # the weights are still v1
                old_log_prob = compute_log_prob(models, ids)
            else:
                probe_v2 = compute_log_prob(models, probe)
                v2 = copy_megatron_model_to_cpu(models)
                restore_megatron_model_from_cpu(models, v1)
                old_log_prob = compute_log_prob(models, ids)
                if not torch.equal(compute_log_prob(models, probe), probe_v1):
                    raise AssertionError(f"step {step}: restoring v1 does not reproduce v1's log-probs bitwise")
                restore_megatron_model_from_cpu(models, v2)
                if not torch.equal(compute_log_prob(models, probe), probe_v2):
                    raise AssertionError(f"step {step}: restoring v2 does not reproduce v2's log-probs bitwise")
                if torch.equal(probe_v2, probe_v1):
                    raise AssertionError(f"step {step}: training did not change the weights")
                if not params_are_buffer_views(models):
                    raise AssertionError(f"step {step}: parameters are no longer views into param_data")
                v2.free()  # its pinned region goes back to the arena for the next step's v2
            stats = update(models, opt, ids, old_log_prob, advantages)
            steps.append({"step": step, **stats})
            print(f"step {step}: importance ratio pi_v2/pi_v1 mean {stats['ratio_mean']:.6f} "
                  f"min {stats['ratio_min']:.6f} max {stats['ratio_max']:.6f}; loss {stats['loss']:+.5f}")
        summary = {"ok": True, "distributed_optimizer": args.distributed_optimizer, "v1_nbytes": v1.nbytes,
                   "v1_names": names, "param_bytes": sum(p.numel() * p.element_size() for p in models[0].parameters()),
                   "restores_checked": args.steps - 1, "steps": steps}
        v1.free()
        return summary
    finally:
        parallel_state.destroy_model_parallel()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4, help="training steps after the weight sync (>= 2)")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--no-distributed-optimizer", dest="distributed_optimizer", action="store_false",
                        help="plain DDP: the parameters keep their own storages (no param_data buffer)")
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps must be at least 2 (step 0 computes with v1 itself)")
    # megatron-core warns at import and build about missing Apex / Transformer Engine: noise here.
    for category in (UserWarning, DeprecationWarning, FutureWarning):
        warnings.filterwarnings("ignore", category=category)

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # a free port for the one-rank group
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        summary = run(args)
    except AssertionError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        dist.destroy_process_group()
    print(f"OK: {summary['restores_checked']} restores of v1 reproduced its log-probs bitwise "
          f"(v1 kept {summary['v1_nbytes']} bytes)")
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
