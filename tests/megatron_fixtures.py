"""megatron-core DDP model chunks and Megatron optimizers on a CPU-only machine (gloo, no CUDA).

Recipe (megatron-core 0.16.1, torch 2.13 CPU wheel; ``pip install megatron-core==0.16.1``):

* ``torch.distributed.init_process_group("gloo")`` then ``parallel_state.initialize_model_parallel(1, 1)``:
  works unpatched (it creates gloo groups alongside the default backend's).
* ``DistributedDataParallel(...)`` allocates ``param_data``/``grad_data`` on
  ``torch.cuda.current_device()``: patch it to return ``torch.device("cpu")``.
* ``get_megatron_optimizer(...)`` and ``optimizer.step()`` create tensors with ``device="cuda"``
  (``found_inf``, ``_scale_one``, the FP32 optimizer's ``_scale``, the grad-norm buffers in clip_grads)
  and accept parameters only when ``param.type()`` is ``torch.cuda.{Float,Half,BFloat16}Tensor``: the
  ``CudaAsCpu`` torch-function mode below turns ``device="cuda"`` into the CPU, reports CPU tensors'
  ``type()`` as the CUDA type name and makes ``Tensor.cuda()`` a no-op.
* ``GPTModel`` forward enters ``get_cuda_rng_tracker().fork()`` (dropout RNG) and
  ``model_parallel_cuda_manual_seed`` reads the CUDA RNG: ``CudaRNGStatesTracker.add``/``fork`` are
  patched to record the name and to switch no RNG (dropout is 0 here, so nothing draws from it).
  ``TransformerConfig(use_cpu_initialization=True)`` makes weight init use the CPU generator, so
  ``torch.manual_seed`` gives bitwise-identical twins.
* a GPTModel forward needs the RNG-tracker patch; backward and ``finish_grad_sync`` need none. The
  distributed optimizer also runs on gloo with 2 ranks (reduce-scatter of grads, all-gather of params).

Use ``megatron_cpu()`` around building, forward and stepping; the engine calls under test run outside it.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from helpers_dist import QWEN2_TINY, batch, free_port

__all__ = [
    "CudaAsCpu",
    "backward",
    "build_chunk",
    "build_optimizer",
    "gpt_config",
    "logits",
    "megatron_cpu",
    "megatron_parallel",
    "megatron_world",
    "optimizer_step",
    "train_step",
]


def _is_cuda(device: Any) -> bool:
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


class CudaAsCpu(TorchFunctionMode):
    """Lets CUDA-only megatron code run on the CPU: ``device="cuda"`` -> CPU, ``t.type()`` -> CUDA name."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if _is_cuda(kwargs.get("device")):
            kwargs = {**kwargs, "device": "cpu"}
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name if args[0].is_cuda else name.replace("torch.", "torch.cuda.", 1)
        if func is torch.Tensor.cuda:
            return args[0]
        return func(*args, **kwargs)


def _tracker_add(self: Any, name: str, seed: int) -> None:
    self.seeds_.add(seed)
    self.states_[name] = None


@contextlib.contextmanager
def _tracker_fork(self: Any, name: str = "") -> Iterator[None]:
    yield


@contextlib.contextmanager
def megatron_cpu() -> Iterator[None]:
    """The patches that let megatron-core build and step DDP chunks and optimizers on the CPU."""
    from megatron.core.tensor_parallel import random as mrandom

    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch("torch.cuda.current_device", return_value=torch.device("cpu")))
        stack.enter_context(mock.patch.object(mrandom.CudaRNGStatesTracker, "add", _tracker_add))
        stack.enter_context(mock.patch.object(mrandom.CudaRNGStatesTracker, "fork", _tracker_fork))
        stack.enter_context(CudaAsCpu())
        yield


@contextlib.contextmanager
def megatron_parallel() -> Iterator[None]:
    """Megatron's parallel state (TP=PP=1, DP=world) over the existing gloo default group."""
    from megatron.core import parallel_state, tensor_parallel

    with megatron_cpu():
        parallel_state.initialize_model_parallel(1, 1)
        tensor_parallel.model_parallel_cuda_manual_seed(1234)
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()


@pytest.fixture
def megatron_world() -> Iterator[int]:
    """A one-rank gloo world with Megatron's parallel state, in this process; yields the world size."""
    pytest.importorskip("megatron.core")
    if dist.is_initialized():
        pytest.fail("a process group is already initialised in this process")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        with megatron_parallel():
            yield 1
    finally:
        dist.destroy_process_group()


def gpt_config(*, bf16: bool = False, config: dict[str, Any] | None = None) -> Any:
    """A TransformerConfig with Qwen2's shapes (RMSNorm, GQA, q/k/v bias, SwiGLU, RoPE), CPU-friendly."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    c = {**QWEN2_TINY, **(config or {})}
    return TransformerConfig(
        num_layers=c["num_hidden_layers"],
        hidden_size=c["hidden_size"],
        ffn_hidden_size=c["intermediate_size"],
        num_attention_heads=c["num_attention_heads"],
        num_query_groups=c["num_key_value_heads"],
        layernorm_epsilon=c["rms_norm_eps"],
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=True,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        use_cpu_initialization=True,
        bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
    )


def build_chunk(*, seed: int, use_distributed_optimizer: bool, bf16: bool = False, frozen: tuple[str, ...] = ()) -> Any:
    """One DDP-wrapped GPTModel chunk (tied embedding / output layer); same seed, bitwise-same chunk. The
    parameters named in `frozen` (GPTModel names) get requires_grad=False before wrapping: DDP leaves them
    out of its buffers, as with a LoRA base model."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    cfg = gpt_config(bf16=bf16)
    with megatron_cpu(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = GPTModel(
            cfg,
            get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=False),
            vocab_size=QWEN2_TINY["vocab_size"],
            max_sequence_length=QWEN2_TINY["max_position_embeddings"],
            share_embeddings_and_output_weights=True,
            position_embedding_type="rope",
            rotary_base=int(QWEN2_TINY["rope_theta"]),
        )
        for name, p in model.named_parameters():
            if name in frozen:
                p.requires_grad_(False)
        ddp_config = DistributedDataParallelConfig(
            use_distributed_optimizer=use_distributed_optimizer, grad_reduce_in_fp32=True
        )
        return DistributedDataParallel(cfg, ddp_config, model)


def build_optimizer(chunks: list[Any], *, use_distributed_optimizer: bool, bf16: bool = False) -> Any:
    """``get_megatron_optimizer`` (always a ChainedOptimizer in 0.16) over ``chunks``."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    config = OptimizerConfig(
        optimizer="adam",
        lr=1e-2,
        weight_decay=0.01,
        bf16=bf16,
        use_distributed_optimizer=use_distributed_optimizer,
        clip_grad=1.0,
    )
    with megatron_cpu():
        return get_megatron_optimizer(config, chunks)


def _forward(chunk: Any, ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
    pos = torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids)
    with megatron_cpu():  # the attention's dropout enters the CUDA RNG tracker
        return chunk(ids, pos, attention_mask=None, labels=labels)


def logits(chunks: list[Any], step: int = 999) -> list[torch.Tensor]:
    """Each chunk's logits on a fixed probe batch (no grad)."""
    ids = batch(step, 0)
    with torch.no_grad():
        return [_forward(c, ids).float().clone() for c in chunks]


def backward(chunks: list[Any], opt: Any, step: int, rank: int) -> torch.Tensor:
    """Zero the grad buffers and accumulate one batch's gradients into them (synced across DP ranks)."""
    for c in chunks:
        c.zero_grad_buffer()
    opt.zero_grad()
    ids = batch(step, rank)
    loss = sum(_forward(c, ids, labels=ids).float().mean() for c in chunks)
    loss.backward()
    for c in chunks:
        c.finish_grad_sync()
    return loss.detach()


def optimizer_step(opt: Any) -> None:
    with megatron_cpu():
        ok, _, _ = opt.step()
    assert ok, "megatron optimizer step was skipped"


def train_step(chunks: list[Any], opt: Any, step: int, rank: int = 0) -> torch.Tensor:
    """One full step over all chunks (summed LM losses); returns the loss."""
    loss = backward(chunks, opt, step, rank)
    optimizer_step(opt)
    return loss
