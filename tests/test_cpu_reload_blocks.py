"""A reload's small CPU storages grow into shared blocks (the torch-aware helper's resize pass): one
allocation per block, yet every storage is still its own: its own bytes, aligned as c10 aligns them, freed,
resized and shared alone; a block goes with its last storage."""

from __future__ import annotations

import gc
import io
import os

import pytest
import torch

import gpu_offload as go
from gpu_offload import torch_ext

pytestmark = pytest.mark.skipif(not torch_ext.available(), reason=f"gpu_offload._torch_ext {torch_ext.status()}")

_PART_MAX = 64 * 1024  # csrc/torch_ext/target.cpp: kBlockPartBytes
_BLOCK_MAX = 120 * 1024  # kBlockBytes


def _blocks() -> int:
    gc.collect()
    return torch_ext.ext.num_cpu_blocks()


def _target(n: int = 64, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {f"t{i}": torch.randn(1 + (i * 37) % 300, generator=g) for i in range(n)}
    out["half"] = torch.randn(7, generator=g).half()
    base = torch.randn(6, 5, generator=g)
    out["base"], out["view"] = base, base[1:, 2:]  # a view: one storage for two tensors
    return out


def _cycle(target, arena) -> None:
    go.offload(target, arena=arena, empty_cache=False)
    go.reload(target)


def _storages(target) -> list[torch.UntypedStorage]:
    seen, out = set(), []
    for t in target.values():
        st = t.untyped_storage()
        if st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            out.append(st)
    return out


def test_reloaded_storages_share_blocks_and_keep_their_own_bytes():
    baseline = _blocks()
    target, arena = _target(), go.Arena()
    expected = {k: v.clone() for k, v in target.items()}
    view = target["view"]
    _cycle(target, arena)
    assert _blocks() > baseline, "the reload took no shared block"
    for k, v in target.items():
        assert torch.equal(v, expected[k]), k
    assert target["view"] is view and view.untyped_storage().data_ptr() == target["base"].untyped_storage().data_ptr()
    # Each its own part: aligned as c10's allocator aligns, and no two overlap.
    spans = sorted((st.data_ptr(), st.nbytes()) for st in _storages(target))
    assert all(p % 64 == 0 for p, _ in spans)
    for (p, n), (q, _) in zip(spans, spans[1:]):
        assert p + n <= q
    # A write to one reaches none of the others.
    target["t3"].add_(1)
    for k, v in target.items():
        assert torch.equal(v, expected[k] + (1 if k == "t3" else 0)), k
    del target, v, view
    assert _blocks() == baseline, "a block outlived its storages"


def test_cycles_leave_no_blocks_behind():
    baseline = _blocks()
    target, arena = _target(200), go.Arena()
    _cycle(target, arena)
    after_one = _blocks()
    for _ in range(10):
        _cycle(target, arena)
    assert _blocks() == after_one
    go.offload(target, arena=arena, empty_cache=False)
    assert _blocks() == baseline, "an offloaded target still holds its blocks"
    go.reload(target)
    del target
    assert _blocks() == baseline


def test_a_block_lives_while_any_of_its_storages_does():
    baseline = _blocks()
    target, arena = _target(), go.Arena()
    _cycle(target, arena)
    blocks = _blocks()
    keep = target["t5"]
    value = keep.clone()
    del target
    assert _blocks() == blocks  # t5's storage still uses its block
    assert torch.equal(keep, value)
    del keep
    assert _blocks() == baseline


def test_each_storage_still_resizes_shares_and_saves_on_its_own():
    target, arena = _target(), go.Arena()
    expected = {k: v.clone() for k, v in target.items()}
    _cycle(target, arena)
    grown = target["t1"].untyped_storage()
    old_bytes = grown.nbytes()
    grown.resize_(old_bytes + 4096)  # torch's resize: its own allocation, its bytes copied
    assert torch.equal(target["t1"], expected["t1"])
    target["t2"].share_memory_()  # moved to shared memory on its own
    assert target["t2"].is_shared() and torch.equal(target["t2"], expected["t2"])
    buf = io.BytesIO()
    torch.save(target, buf)
    buf.seek(0)
    loaded = torch.load(buf)
    for k, v in target.items():
        assert torch.equal(v, expected[k]), k
        assert torch.equal(loaded[k], expected[k]), k
    with pytest.raises(go.OffloadError, match="t2: its storage cannot be released and re-allocated"):
        go.offload(target, arena=arena)  # (shared memory cannot be grown back)
    rest = {k: v for k, v in target.items() if k != "t2"}
    _cycle(rest, arena)  # and the rest still cycles
    for k, v in target.items():
        assert torch.equal(v, expected[k]), k


def test_part_of_a_reloaded_target_offloads_and_reloads_alone():
    target, arena = _target(), go.Arena()
    expected = {k: v.clone() for k, v in target.items()}
    _cycle(target, arena)
    part = {k: target[k] for k in ("t0", "t7", "half")}
    go.offload(part, arena=arena, empty_cache=False)
    assert all(v.untyped_storage().nbytes() == 0 for v in part.values())
    rest = {k: v for k, v in target.items() if k not in part}
    for k, v in rest.items():
        assert torch.equal(v, expected[k]), k
    rest["t9"].mul_(2)  # the rest is in use meanwhile
    go.reload(part)
    for k, v in target.items():
        assert torch.equal(v, expected[k] * (2 if k == "t9" else 1)), k


def test_large_storages_take_the_allocator_and_blocks_stay_bounded():
    baseline = _blocks()
    large = {"a": torch.randn(_PART_MAX // 4 + 1), "b": torch.randn(_PART_MAX // 2)}
    arena = go.Arena()
    _cycle(large, arena)
    assert _blocks() == baseline, "storages over the part size went into a block"
    del large
    # Many small ones: as many blocks as their bytes need, none over the bound.
    n, nbytes = 2048, 4096
    small = {f"s{i}": torch.full((nbytes // 4,), float(i)) for i in range(n)}
    _cycle(small, arena)
    per_block = _BLOCK_MAX // nbytes
    assert _blocks() - baseline == -(-n // per_block)
    for i in range(n):
        assert small[f"s{i}"][0].item() == float(i)
    del small
    assert _blocks() == baseline


def test_a_module_and_its_optimizer_reload_into_blocks():
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(16)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    params = [p.detach().clone() for p in model.parameters()]
    state = [v.clone() for s in opt.state.values() for v in s.values()]
    arena = go.Arena()
    for _ in range(3):
        _cycle([model, opt], arena)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), params))
    assert all(torch.equal(v, w) for v, w in zip((v for s in opt.state.values() for v in s.values()), state))
    model(torch.randn(2, 4)).sum().backward()  # and training goes on
    opt.step()


_OUT_OF_MEMORY_CHILD = r"""
import ctypes, resource, torch, gpu_offload as go
from gpu_offload import torch_ext

# Every block mapped on its own (M_MMAP_THRESHOLD under the block size), so that a freed block leaves the
# address space and an address-space limit can refuse the next ones (the heap would reuse them).
assert ctypes.CDLL("libc.so.6").mallopt(-3, 64 * 1024) == 1

def vm_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * resource.getpagesize()

target = {f"s{i}": torch.full((1024,), float(i)) for i in range(1024)}  # 4 MiB: 35 blocks
arena = go.Arena()
go.offload(target, arena=arena, empty_cache=False)
go.reload(target)
go.offload(target, arena=arena, empty_cache=False)  # the plan as a cycle finds it
soft, hard = resource.getrlimit(resource.RLIMIT_AS)
resource.setrlimit(resource.RLIMIT_AS, (vm_bytes() + (1 << 20), hard))  # room for 8 blocks, not 35
try:
    go.reload(target)
    print("reloaded")
except go.OffloadError as exc:
    print("refused", "still offloaded with its data intact" in str(exc))
except MemoryError:
    print("refused", True)
finally:
    resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
print("offloaded", go.is_offloaded(target), all(t.untyped_storage().nbytes() == 0 for t in target.values()))
print("blocks", torch_ext.ext.num_cpu_blocks())  # (none: the blocks allocated before the failure were freed)
go.reload(target)
print("intact", all(bool((target[f"s{i}"] == float(i)).all()) for i in range(1024)))
"""


@pytest.mark.skipif("libasan" in os.environ.get("LD_PRELOAD", ""),
                    reason="AddressSanitizer reserves its shadow memory up front: an address-space limit stalls it")
def test_a_block_that_cannot_be_allocated_leaves_the_target_offloaded():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _OUT_OF_MEMORY_CHILD], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.split("\n")
    # The blocks' allocation failed part-way, before any storage moved: those allocated were freed.
    assert lines[0] == "refused True", out.stdout
    assert lines[1] == "offloaded True True" and lines[2] == "blocks 0" and lines[3] == "intact True", out.stdout
