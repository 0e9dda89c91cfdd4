"""Helpers for distributed tests on the CPU: gloo ranks and a small Qwen2-shaped decoder.

``run_ranks(fn, world_size, *args)`` runs ``fn(rank, world_size, *args)`` on every rank of a fresh gloo
process group and returns the per-rank results in rank order. World size 1 runs in this process (cheap);
larger worlds are spawned (``fn`` must then be a module-level function of an importable module, e.g. a
test module, and its arguments and result picklable). An exception on any rank fails the call with that
rank's traceback; a rank that hangs (a collective with a missing peer) is killed after ``timeout``.

``build_qwen2(config)`` builds a decoder with Qwen2's shapes (token embedding, RMSNorm, grouped-query
attention with q/k/v biases and rotary embeddings, SwiGLU MLP, lm_head tied to the embedding) from a dict
like ``QWEN2_TINY``; nothing is downloaded.
"""

from __future__ import annotations

import datetime
import os
import socket
import sys
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

__all__ = [
    "QWEN2_TINY",
    "Qwen2ForCausalLM",
    "batch",
    "build_qwen2",
    "free_port",
    "lm_loss",
    "param_bytes",
    "run_ranks",
]

QWEN2_TINY: dict[str, Any] = {
    "vocab_size": 96,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "max_position_embeddings": 64,
    "tie_word_embeddings": True,
}

_PG_TIMEOUT = datetime.timedelta(seconds=60)


# ------------------------------------------------------------------------------------------ processes


def free_port() -> int:
    """A TCP port that was free a moment ago on localhost (the rendezvous port of one process group)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init(rank: int, world_size: int, port: int) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=_PG_TIMEOUT)


def _rank_main(rank: int, fn: Callable[..., Any], world_size: int, port: int, args: tuple, results: Any) -> None:
    # Two ranks share two cores: one intra-op thread each keeps them from oversubscribing the machine.
    torch.set_num_threads(1)
    _init(rank, world_size, port)
    try:
        value = fn(rank, world_size, *args)
        results.put((rank, value, None))
    except BaseException:
        results.put((rank, None, traceback.format_exc()))
        raise
    finally:
        dist.destroy_process_group()
    # The result is in the queue: leave without the interpreter's and native libraries' exit-time teardown,
    # which on a loaded machine has aborted a rank ("terminate called without an active exception") after
    # its work was done and checked.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 90.0) -> list[Any]:
    """Runs ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; returns the results by rank."""
    if world_size == 1:
        if dist.is_initialized():
            raise RuntimeError("a default process group already exists in this process")
        _init(0, 1, free_port())
        try:
            return [fn(0, 1, *args)]
        finally:
            dist.destroy_process_group()
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    procs = mp.start_processes(
        _rank_main,
        args=(fn, world_size, free_port(), args, results),
        nprocs=world_size,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + timeout
    try:
        while not procs.join(timeout=0.5):
            if time.monotonic() > deadline:
                name = getattr(fn, "__name__", fn)
                raise TimeoutError(f"{name} did not finish on {world_size} ranks in {timeout}s")
    except mp.ProcessRaisedException as exc:
        raise AssertionError(f"a rank failed:\n{exc}") from None
    finally:
        for p in procs.processes:
            if p.is_alive():
                p.kill()
    out: dict[int, Any] = {}
    while not results.empty():
        rank, value, error = results.get()
        if error is not None:
            raise AssertionError(f"rank {rank} failed:\n{error}")
        out[rank] = value
    return [out[r] for r in range(world_size)]


# ------------------------------------------------------------------------------------------ the model


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        var = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(var + self.eps)).to(x.dtype) * self.weight


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        # A buffer like Qwen2's, so that every strategy has unsharded module buffers to carry too.
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        t = torch.arange(seq_len, dtype=torch.float32, device=self.inv_freq.device)
        freqs = torch.outer(t, self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class Attention(nn.Module):
    def __init__(self, c: dict[str, Any]) -> None:
        super().__init__()
        self.heads, self.kv_heads = c["num_attention_heads"], c["num_key_value_heads"]
        self.head_dim = c["hidden_size"] // self.heads
        h = c["hidden_size"]
        self.q_proj = nn.Linear(h, self.heads * self.head_dim, bias=True)
        self.k_proj = nn.Linear(h, self.kv_heads * self.head_dim, bias=True)
        self.v_proj = nn.Linear(h, self.kv_heads * self.head_dim, bias=True)
        self.o_proj = nn.Linear(self.heads * self.head_dim, h, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        rep = self.heads // self.kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, c: dict[str, Any]) -> None:
        super().__init__()
        h, i = c["hidden_size"], c["intermediate_size"]
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, c: dict[str, Any]) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])
        self.mlp = MLP(c)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen2Model(nn.Module):
    def __init__(self, c: dict[str, Any]) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(c["vocab_size"], c["hidden_size"])
        self.layers = nn.ModuleList(DecoderLayer(c) for _ in range(c["num_hidden_layers"]))
        self.norm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])
        self.rotary_emb = RotaryEmbedding(c["hidden_size"] // c["num_attention_heads"], c["rope_theta"])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(ids)
        cos, sin = self.rotary_emb(ids.shape[1])
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.norm(x)


class Qwen2ForCausalLM(nn.Module):
    def __init__(self, c: dict[str, Any]) -> None:
        super().__init__()
        self.config = dict(c)
        self.model = Qwen2Model(c)
        self.lm_head = nn.Linear(c["hidden_size"], c["vocab_size"], bias=False)
        if c.get("tie_word_embeddings", True):
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model(ids))


def build_qwen2(
    config: dict[str, Any] | None = None, *, seed: int = 0, dtype: torch.dtype = torch.float32
) -> Qwen2ForCausalLM:
    """A freshly initialised Qwen2-shaped decoder; the same seed gives a bitwise-identical twin."""
    c = {**QWEN2_TINY, **(config or {})}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(c)
        # nn.Linear's default init is fine; give the norms non-trivial weights so they matter in tests.
        for m in model.modules():
            if isinstance(m, RMSNorm):
                nn.init.uniform_(m.weight, 0.5, 1.5)
    return model.to(dtype)


def batch(
    step: int, rank: int = 0, *, config: dict[str, Any] | None = None, batch_size: int = 2, seq_len: int = 8
) -> torch.Tensor:
    """Token ids for one step on one rank, the same on every call with the same arguments."""
    c = {**QWEN2_TINY, **(config or {})}
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, c["vocab_size"], (batch_size, seq_len), generator=g)


def lm_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy."""
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1))


def param_bytes(module: nn.Module) -> int:
    """Bytes of a module's unique parameters as built (before any sharding)."""
    return sum(p.numel() * p.element_size() for p in module.parameters())

