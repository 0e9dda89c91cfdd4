"""Touching offloaded state raises a clear error that names the tensor or module and says to reload, and never
crashes: a kernel reading an offloaded storage (it holds no memory) would read through a null pointer.

Every case runs in a child process, which reports what each use raised: before these guards most of them died
with SIGSEGV there (on a GPU: an illegal address that ends the CUDA context). Two lines of defence are tested:
the storages themselves refusing access (with the torch-aware helper, gpu_offload._torch_ext) and the hooks on
modules and optimizers (with the helper switched off, GPU_OFFLOAD_TORCH_EXT=0, they are the only line).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

import gpu_offload as go
from gpu_offload import registry as _registry
from gpu_offload import torch_ext
from conftest import inject_resize_failure

_ROOT = Path(__file__).resolve().parent.parent
needs_guard = pytest.mark.skipif(not torch_ext.access_guard_available(),
                                 reason=f"gpu_offload._torch_ext {torch_ext.status()}, or this torch cannot lift a refusal")

# What the child runs before its cases: each case is a statement; what it raises is reported as
# "Type: first line of the message", or "no error".
_PRELUDE = """
import io, json, os, sys, tempfile, traceback
import torch, gpu_offload as go
from gpu_offload import torch_ext
results = {}

def case(name, fn):
    try:
        fn()
        results[name] = "no error"
    except Exception as exc:
        results[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    print(name, "->", results[name], file=sys.stderr, flush=True)

def report(**extra):
    print("RESULTS " + json.dumps({"cases": results, **extra}), flush=True)
"""


def _child(body: str, env: dict[str, str] | None = None, timeout: int = 600) -> dict[str, Any]:
    """Runs the cases in a child process; a crash (a signal) fails the test with what the child printed."""
    code = _PRELUDE + textwrap.dedent(body)
    full_env = {**os.environ, "PYTHONPATH": f"{_ROOT}{os.pathsep}{_ROOT / 'tests'}", "CUDA_VISIBLE_DEVICES": "",
                **(env or {})}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, env=full_env,
                         cwd=_ROOT)
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULTS ")]
    assert out.returncode == 0 and lines, (
        f"the child {'died of signal ' + str(-out.returncode) if out.returncode < 0 else 'failed'}:\n"
        f"{out.stderr[-4000:]}")
    return json.loads(lines[-1][len("RESULTS "):])


def _check(results: dict[str, str], expected: dict[str, str]) -> None:
    wrong = {name: results.get(name) for name, pattern in expected.items()
             if results.get(name) is None or not re.search(pattern, results[name])}
    assert not wrong, "\n".join(f"{n}: got {r!r}, expected /{expected[n]}/" for n, r in wrong.items())


# -- a plain model and its optimizer --------------------------------------------------------------------------
_PLAIN = """
torch.manual_seed(0)
m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2))
opt = torch.optim.Adam(m.parameters())
x = torch.randn(3, 8)
m(x).sum().backward()
opt.step()
m(x).sum().backward()  # gradients present: the step below has work to do
compiled = torch.compile(m, backend="aot_eager")  # made (and run) before the offload
want = compiled(x).detach().clone()
before = {k: v.clone() for k, v in m.state_dict().items()}
sd = m.state_dict()  # taken before the offload: its tensors share the offloaded storages
folder = tempfile.TemporaryDirectory()  # removed when the child exits
path = os.path.join(folder.name, "sd.pt")
go.offload([m, opt])
assert not torch_ext.available() or all(torch_ext.access_refused(p) for p in m.parameters())

case("module", lambda: m(x))
case("submodule", lambda: m[2](torch.randn(3, 8)))
case("compiled", lambda: compiled(x))
case("direct forward", lambda: m[1].forward(x))
case("step", lambda: opt.step())
case("state_dict", lambda: m.state_dict())
case("submodule state_dict", lambda: m[0].state_dict())
case("optimizer state_dict", lambda: opt.state_dict())
case("load_state_dict", lambda: m.load_state_dict(before))
case("submodule load_state_dict", lambda: m[0].load_state_dict({k[2:]: v for k, v in before.items() if k.startswith("0.")}))
case("pickle", lambda: torch.save(m, io.BytesIO()))
"""

_PLAIN_DATA = """
case("norm", lambda: m[0].weight.norm())
case("print", lambda: repr(m[2].bias))
case("in-place", lambda: m[0].weight.data.add_(1))
case("optimizer state", lambda: next(iter(opt.state.values()))["exp_avg"].sum())
case("torch.save", lambda: torch.save(sd, path))
def load():
    if os.path.exists(path):
        torch.load(path)
case("load what torch.save left", load)
"""

_PLAIN_END = """
go.reload([m, opt])
same = all(torch.equal(m.state_dict()[k], v) for k, v in before.items())
report(same=same, compiled_after=bool(torch.equal(compiled(x), want)), hooks=[len(mod._forward_pre_hooks) for mod in m.modules()],
       own_forward=["forward" in vars(mod) for mod in m.modules()],
       load_hooks=[len(mod._load_state_dict_pre_hooks) for mod in m.modules()])
"""

_FRIENDLY = {
    "module": r"^OffloadError: cannot run Sequential \(id .*\): its state is offloaded; call gpu_offload\.reload\(\)",
    "submodule": r"^OffloadError: cannot run Linear '2' of Sequential .*offloaded; call gpu_offload\.reload\(\)",
    "compiled": r"^OffloadError: cannot run Sequential .*offloaded; call gpu_offload\.reload\(\)",
    "direct forward": r"^OffloadError: cannot run LayerNorm '1' of Sequential .*reload\(\)",
    "step": r"^OffloadError: cannot step Adam .*offloaded; call gpu_offload\.reload\(\)",
    "state_dict": r"^OffloadError: cannot take the state_dict of Sequential .*reload\(\)",
    "submodule state_dict": r"^OffloadError: cannot take the state_dict of Linear '0' of Sequential .*reload\(\)",
    "optimizer state_dict": r"^OffloadError: cannot take the state_dict of Adam .*reload\(\)",
    "load_state_dict": r"^OffloadError: cannot load a state_dict into Sequential .*reload\(\)",
    "submodule load_state_dict": r"^OffloadError: cannot load a state_dict into Linear '0' of Sequential .*reload\(\)",
    "pickle": r"^OffloadError: cannot pickle Sequential \(id .*\): its state is offloaded; call gpu_offload\.reload\(\)",
}


def _plain_checks(result: dict[str, Any]) -> None:
    assert result["same"], "the reloaded values differ from the offloaded ones"
    assert result["compiled_after"], "the compiled wrapper gives other values after the reload"
    assert result["hooks"] == [0] * len(result["hooks"]) and not any(result["own_forward"]), result  # all gone
    assert not any(result["load_hooks"]), result


@needs_guard
def test_every_use_of_an_offloaded_model_and_optimizer_raises_naming_it():
    # With the helper, submodules have no hooks of their own: calling one meets the global forward pre-hook
    # (OffloadError, as above); a direct .forward() or a submodule's state_dict meets the storages, which
    # refuse access naming the tensor.
    result = _child(_PLAIN + _PLAIN_DATA + """
case("submodule state_dict used", lambda: m[0].state_dict()["weight"].sum())
""" + _PLAIN_END)
    data = r"^RuntimeError: gpu_offload: {} is offloaded .*call gpu_offload\.reload\(\)"
    _check(result["cases"], {
        **_FRIENDLY,
        "direct forward": data.format(re.escape("0.1.weight")),
        "submodule state_dict": r"^no error$",
        # (torch's load_state_dict reports the copy's error under its own first line)
        "submodule load_state_dict": r"^RuntimeError: Error\(s\) in loading state_dict for Linear",
        "submodule state_dict used": data.format(re.escape("0.0.weight")),
        "norm": data.format(re.escape("0.0.weight")),
        "print": data.format(re.escape("0.2.bias")),
        "in-place": data.format(re.escape("0.0.weight")),
        "optimizer state": data.format(r"1\.state\.\d\.exp_avg"),
        "torch.save": data.format(re.escape("0.0.weight")),
        # Whatever torch.save wrote before it raised is no checkpoint: it does not load as one.
        "load what torch.save left": r"^(RuntimeError|EOFError|UnpicklingError|PicklingError|OSError|ValueError)",
    })
    _plain_checks(result)


def test_without_the_helper_the_hooks_still_raise_first():
    # The hooks are the only line then: every use that goes through a module, an optimizer or a state_dict
    # raises OffloadError before torch touches the data. (Direct reads of an offloaded tensor need the helper.)
    result = _child(_PLAIN + _PLAIN_END, env={"GPU_OFFLOAD_TORCH_EXT": "0"})
    _check(result["cases"], _FRIENDLY)
    _plain_checks(result)


# -- the guard's own invariants, in this process ----------------------------------------------------------------
@needs_guard
def test_reload_lifts_the_refusal_in_one_call_and_a_failed_reload_keeps_it(arena, monkeypatch):
    state = {"w": torch.randn(64), "v": torch.arange(10.0)}
    state["view"] = state["v"][2:5]
    want = {k: v.clone() for k, v in state.items()}
    go.offload(state, arena=arena)
    assert all(torch_ext.access_refused(t) for t in state.values())
    calls: list[int] = []
    allow = torch_ext.allow_access
    monkeypatch.setattr(torch_ext, "allow_access", lambda items: (calls.append(len(items)), allow(items))[1])
    # A reload that fails after the refusal is lifted (the device is out of memory) refuses again.
    with monkeypatch.context() as m:  # (one storage per resize_, or many in the helper's one call)
        inject_resize_failure(m, 1, MemoryError)
        with pytest.raises(go.OffloadError, match="still offloaded"):
            go.reload(state)
    assert go.is_offloaded(state) and all(torch_ext.access_refused(t) for t in state.values())
    with pytest.raises(RuntimeError, match=r"gpu_offload: w is offloaded"):
        state["w"].sum()
    calls.clear()
    passes: list[bool] = []  # the helper's resize passes that lift the refusal as they go
    resize_live = torch_ext.ext.TargetRecord.resize_live
    monkeypatch.setattr(torch_ext.ext.TargetRecord, "resize_live",
                        lambda rec, ts, release, refuse=False, held=None:
                        (passes.append(refuse), resize_live(rec, ts, release, refuse, held))[1])
    go.reload(state)
    # One call for both storages: allow_access, or the resize's own pass.
    assert (calls, passes) in (([2], []), ([2], [False]), ([], [True])), (calls, passes)
    assert not any(torch_ext.access_refused(t) for t in state.values())
    for k, v in want.items():
        assert torch.equal(state[k], v)
    # discard leaves empty storages that refuse access, saying so; new memory for a tensor is the way back
    go.offload(state, arena=arena)
    go.discard(state)
    assert all(torch_ext.access_refused(t) for t in state.values())
    with pytest.raises(RuntimeError, match=r"emptied by gpu_offload\.discard\(\)"):
        state["w"].sum()
    state["w"].data = torch.zeros_like(state["w"])
    assert float(state["w"].sum()) == 0.0
    assert arena.used_bytes == 0


@needs_guard
def test_an_interrupt_anywhere_in_offload_or_reload_leaves_the_refusal_and_the_registry_agreeing(arena):
    import conftest
    from conftest import count_points, interrupt_at

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    want = {k: v.clone() for k, v in model.state_dict().items()}
    params = list(model.parameters())

    def agree(k: int) -> None:
        where = f"interrupt {k} ({conftest.last_point})"
        with _registry.lock:
            offloaded = [_registry.storage_key(p) in _registry.entries for p in params]
        for p, off in zip(params, offloaded):
            refused, held = torch_ext.access_refused(p), p.untyped_storage().nbytes()
            # Refused exactly while offloaded and empty; offloaded with its memory only in reload's last step
            # (copied back, not yet out of the registry): readable, and a reload finishes it.
            assert (refused and off and not held) or (not refused and held), f"{where}: {refused=} {off=} {held=}"
        if any(offloaded):
            go.reload(model)
        assert all(torch.equal(model.state_dict()[n], v) for n, v in want.items()), f"{where}: values"
        assert not any(torch_ext.access_refused(p) for p in params)

    offload, reload = (lambda: go.offload(model, arena=arena)), (lambda: go.reload(model))
    points = count_points(offload)
    reload()
    assert points > 20
    for k in range(1, points + 1):
        interrupt_at(k, offload)
        agree(k)
    offload()
    points = count_points(reload)
    for k in range(1, points + 1):
        offload()
        interrupt_at(k, reload)
        agree(k)


@pytest.mark.parametrize("helper", [True, False], ids=["global hook", "every module hooked"])
def test_hooks_are_one_per_module_and_go_with_the_reload(arena, monkeypatch, helper):
    if helper and not torch_ext.access_guard_available():
        pytest.skip(f"gpu_offload._torch_ext {torch_ext.status()}")
    monkeypatch.setattr(_registry, "_submodules_hooked", lambda: not helper)
    global_hooks = torch.nn.modules.module._global_forward_pre_hooks
    ours = _registry._global_forward_guard
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Sequential(torch.nn.ReLU(), torch.nn.Linear(4, 2)))
    model[1][0].forward = lambda x: x.clamp(min=0)  # a forward of its own (as accelerate's hooks set): kept
    own = model[1][0].forward
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    other = torch.nn.Linear(4, 4)  # not offloaded: runs under the global hook
    go.offload([model, opt], arena=arena)
    # Only the top module has hooks of its own where one global hook covers the submodules.
    hooked = [len(m._forward_pre_hooks) == 1 and len(m._state_dict_pre_hooks) == 1 and
              len(m._load_state_dict_pre_hooks) == 1 for m in model.modules()]
    assert hooked == ([True] + [False] * 4 if helper else [True] * 5)
    assert list(global_hooks.values()).count(ours) == (1 if helper else 0)
    assert len(opt._optimizer_step_pre_hooks) == 1
    with pytest.raises(go.OffloadError, match=r"cannot run Linear '1\.1' of Sequential"):
        model[1][1](torch.ones(1, 4))
    assert other(torch.ones(1, 4)).shape == (1, 4)
    go.reload([model, opt])
    assert ours not in global_hooks.values()
    assert all(not m._forward_pre_hooks and not m._state_dict_pre_hooks and not m._load_state_dict_pre_hooks
               for m in model.modules())
    assert not opt._optimizer_step_pre_hooks and not opt._optimizer_state_dict_pre_hooks
    assert model[1][0].forward is own and ["forward" in vars(m) for m in model.modules()] == [False, False, False, True, False]
    assert model(torch.ones(1, 4)).shape == (1, 2)


@needs_guard
def test_the_global_hook_walks_a_hooked_module_once_per_change(arena, monkeypatch):
    # A module with pre-hooks of its own (a ZeRO-3 or FSDP unit not offloaded, run while another model is)
    # has its whole subtree looked at, once: then it is known clear until what is offloaded changes.
    walks: list[int] = []
    keys_of = _registry._keys_of
    monkeypatch.setattr(_registry, "_keys_of", lambda m: (walks.append(id(m)), keys_of(m))[1])
    offloaded = torch.nn.Linear(4, 4)
    other = torch.nn.Sequential(torch.nn.Linear(4, 4))
    other.register_forward_pre_hook(lambda m, args: None)
    go.offload(offloaded, arena=arena)
    try:
        for _ in range(3):
            other(torch.ones(1, 4))
        assert walks.count(id(other)) == 1
        extra = {"t": torch.randn(8)}
        go.offload(extra, arena=arena)  # a change: looked at again
        other(torch.ones(1, 4))
        assert walks.count(id(other)) == 2
        go.reload(extra)
        with pytest.raises(go.OffloadError, match="cannot run Linear"):
            offloaded(torch.ones(1, 4))
    finally:
        go.reload(offloaded)


@needs_guard
def test_the_global_hook_goes_when_an_offloaded_model_is_dropped(arena):
    import gc
    ours = _registry._global_forward_guard
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    go.offload(model, arena=arena)
    assert ours in torch.nn.modules.module._global_forward_pre_hooks.values()
    del model
    gc.collect()
    other = torch.nn.Linear(4, 4)
    other(torch.ones(1, 4))  # the hook finds nothing offloaded and removes itself
    assert ours not in torch.nn.modules.module._global_forward_pre_hooks.values()
    assert arena.used_bytes == 0
    # Or at the engine's next call, before any module runs: it drops the dead storages, and with them the hook.
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    go.offload(model, arena=arena)
    del model
    gc.collect()
    assert ours in torch.nn.modules.module._global_forward_pre_hooks.values()
    assert go.offloaded_bytes() == 0
    assert ours not in torch.nn.modules.module._global_forward_pre_hooks.values()
    # One model dropped of two offloaded: the hook stays for the other.
    kept, dropped = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    go.offload(kept, arena=arena)
    go.offload(dropped, arena=arena)
    del dropped
    gc.collect()
    assert go.offloaded_bytes() == 4 * 4 * 4 + 4 * 4
    assert ours in torch.nn.modules.module._global_forward_pre_hooks.values()
    with pytest.raises(go.OffloadError, match="cannot run Linear"):
        kept(torch.ones(1, 4))
    go.reload(kept)
    assert ours not in torch.nn.modules.module._global_forward_pre_hooks.values()
    assert arena.used_bytes == 0


@needs_guard
def test_a_global_hook_handle_left_by_an_interrupted_removal_is_replaced(arena):
    # An interrupt right after the hook's removal, before its handle is forgotten: the next offload installs
    # the hook again instead of trusting the stale handle (its module would otherwise run unguarded by it).
    ours = _registry._global_forward_guard
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    go.offload(model, arena=arena)
    try:
        _registry._global_hook.remove()  # what the interrupt leaves: a handle whose hook is gone
        assert ours not in torch.nn.modules.module._global_forward_pre_hooks.values()
        other = torch.nn.Sequential(torch.nn.Linear(4, 4))
        go.offload(other, arena=arena)
        assert list(torch.nn.modules.module._global_forward_pre_hooks.values()).count(ours) == 1
        go.reload(other)
    finally:
        go.reload(model)
    assert ours not in torch.nn.modules.module._global_forward_pre_hooks.values()


@needs_guard
@pytest.mark.filterwarnings("ignore:Using `torch.compile\\(module\\)` when there are global hooks:UserWarning")
def test_a_module_compiled_while_another_is_offloaded_traces_the_global_hook_to_nothing(arena):
    # The global hook runs for every module call in the process while a module is offloaded; inside a compiled
    # graph it must vanish (no graph break: fullgraph=True raises on one), and it still stops the offloaded one.
    offloaded = torch.nn.Sequential(torch.nn.Linear(4, 4))
    other = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    go.offload(offloaded, arena=arena)
    try:
        assert torch.nn.modules.module._global_forward_pre_hooks
        compiled = torch.compile(other, backend="eager", fullgraph=True)
        x = torch.randn(3, 4)
        assert torch.equal(compiled(x), other(x))
        with pytest.raises(go.OffloadError, match=r"cannot run Linear '0' of Sequential"):
            offloaded[0](x)
    finally:
        go.reload(offloaded)
        torch._dynamo.reset()


def test_a_module_reloaded_through_its_tensors_loses_its_hooks_at_its_next_call(arena):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    go.offload([model, opt], arena=arena)
    go.reload(dict(model.named_parameters()))  # neither the module nor the optimizer
    model(torch.ones(1, 4)).sum().backward()
    opt.step()
    assert all(not m._forward_pre_hooks and "forward" not in vars(m) for m in model.modules())
    assert not opt._optimizer_step_pre_hooks


# -- DeepSpeed ZeRO 2 and 3 -------------------------------------------------------------------------------------
_DEEPSPEED = """
import test_deepspeed as t
from helpers_dist import batch, lm_loss, run_ranks
from gpu_offload.integrations.deepspeed import offload_states, reload_states

def body(rank, world_size):
    out = {}
    for stage in (2, 3):
        engine = t.make_engine(stage, bf16=False)
        t.train_step(engine, 0, rank)
        ids = batch(1, rank)
        weights = {k: v.detach().clone() for k, v in go.adapters.named_tensors(engine)}
        loss = lm_loss(engine(ids), ids)
        engine.backward(loss)  # gradients waiting for the step
        go.offload(engine)
        case(f"zero{stage} forward", lambda: engine(ids))
        case(f"zero{stage} step", lambda: engine.step())
        go.reload(engine)
        out[f"zero{stage} same"] = all(torch.equal(v, w) for (_, v), w in zip(go.adapters.named_tensors(engine), weights.values()))
        offload_states(engine)  # the drop-in
        case(f"zero{stage} forward after offload_states", lambda: engine(ids))
        reload_states(engine)
        case(f"zero{stage} forward after reload_states", lambda: engine(ids))
    return out

(out,) = run_ranks(body, 1)
report(**out)
"""


def test_an_offloaded_deepspeed_engine_raises_on_forward_and_step():
    pytest.importorskip("deepspeed")
    result = _child(_DEEPSPEED, env={"DS_ACCELERATOR": "cpu"}, timeout=900)
    expected = {}
    for stage in (2, 3):
        expected[f"zero{stage} forward"] = r"^OffloadError: cannot run DeepSpeedEngine .*reload\(\)"
        # The ZeRO optimizer reaches the offloaded fp32 partitions through its inner torch optimizer.
        expected[f"zero{stage} step"] = r"^(OffloadError: cannot step AdamW|RuntimeError: gpu_offload: .* is offloaded).*reload\(\)"
        expected[f"zero{stage} forward after offload_states"] = r"^OffloadError: cannot run DeepSpeedEngine .*reload\(\)"
        expected[f"zero{stage} forward after reload_states"] = r"^no error$"
    _check(result["cases"], expected)
    assert result["zero2 same"] and result["zero3 same"]


# -- FSDP2 --------------------------------------------------------------------------------------------------------
_FSDP2 = """
import torch.distributed as dist
from helpers_dist import batch, build_qwen2, run_ranks

def body(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    model = build_qwen2(seed=0)
    mesh = init_device_mesh("cpu", (1,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    ids = batch(0, rank)
    with torch.no_grad():
        want = model(ids).clone()
        cos, sin = model.model.rotary_emb(ids.shape[1])
    go.offload(model)
    hidden = torch.randn(ids.shape[0], ids.shape[1], model.config["hidden_size"])
    case("root", lambda: model(ids))
    case("unit", lambda: model.model.layers[0](hidden, cos, sin))
    case("embedding", lambda: model.model.embed_tokens(ids))
    go.reload(model)
    with torch.no_grad():
        return bool(torch.equal(model(ids), want))

(same,) = run_ranks(body, 1)
report(same=same)
"""


def test_an_offloaded_fully_shard_model_and_its_units_raise():
    result = _child(_FSDP2)
    _check(result["cases"], {
        "root": r"^OffloadError: cannot run FSDP\w+ \(id .*reload\(\)",
        "unit": r"^OffloadError: cannot run FSDP\w+ 'model\.layers\.0' of FSDP\w+ .*reload\(\)",
        "embedding": r"^OffloadError: cannot run Embedding 'model\.embed_tokens' of FSDP\w+ .*reload\(\)",
    })
    assert result["same"]


@needs_guard
def test_refusal_with_a_message_for_each_storage():
    a, b = torch.zeros(3), torch.ones(2)
    torch_ext.refuse_access([a, b.untyped_storage()._cdata], ["about a", "about b"])
    with pytest.raises(RuntimeError, match="^about a"):
        a.sum()
    with pytest.raises(RuntimeError, match="^about b"):
        b.sum()
    torch_ext.allow_access([a, b])
    with pytest.raises(ValueError, match="1 messages for 2 storages"):
        torch_ext.refuse_access([a, b], ["one"])
    assert float(a.sum() + b.sum()) == 2.0  # nothing was refused by the call that failed


@needs_guard
def test_a_discarded_module_raises_when_touched_instead_of_crashing(arena):
    # Plain torch reads an empty storage under a full-shape tensor through a null pointer (SIGSEGV); run in
    # a child so that a crash fails this test instead of ending the run.
    child = textwrap.dedent("""
        import torch, gpu_offload as go
        m = torch.nn.Linear(512, 512)
        go.offload(m)
        go.discard(m)
        # (A forward may meet torch's own bounds check first: any clean RuntimeError is right there.)
        for touch, says in ((lambda: m.weight.detach().sum(), "gpu_offload.discard()"),
                            (lambda: print(m.bias), "gpu_offload.discard()"), (lambda: m(torch.ones(1, 512)), "")):
            try:
                touch()
            except RuntimeError as e:
                assert says in str(e), e
            else:
                raise SystemExit("read a discarded tensor without an error")
        m.weight.data = torch.ones(512, 512)
        m.bias.data = torch.zeros(512)
        assert float(m(torch.ones(1, 512)).sum()) == 512.0 * 512
        print("ok")
    """)
    done = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), (done.returncode, done.stdout, done.stderr)
