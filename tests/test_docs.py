"""Every ```python snippet of README.md and docs/*.md runs on the CPU as written.

Each snippet runs in a process of its own, after a preamble that defines what the snippets take as the
user's own (a small model with `.layers`, `state_dict`, `path`, `train_step`, `compute_log_prob`, a rollout
engine, a DeepSpeed config, Megatron chunks, a verl worker base class and a stand-in for verl's `register`
decorator, which is not installed here). Library imports are not in the preamble: a snippet imports what it
uses. The environment is a one-process launcher's (RANK=0, WORLD_SIZE=1, MASTER_ADDR/PORT), so a snippet
that initialises torch.distributed (or DeepSpeed) does so on one gloo rank. A snippet added to the docs is
picked up by the next run; one that uses a name nobody defines fails with NameError: define it in the
snippet or, if it is the user's own, add a stub below.

A comment in a snippet that shows a log line (`# DEBUG:gpu_offload:...`) must match what the snippet
really logs, digits and `...` aside.
"""

from __future__ import annotations

import importlib.util
import os
import re
import socket
import subprocess
import sys
import textwrap
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Iterator

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# DeepSpeed's first engine compiles its shared-memory op (once, into build/torch_extensions): minutes on a
# busy 2-core machine. A snippet killed in the middle of that compile would leave its lock behind.
TIMEOUT = 580

PREAMBLE = '''
import torch as _torch


class _UserModel(_torch.nn.Module):
    """The user's model: an input layer, a list of layers (what FSDP2 shards one by one), a head."""

    def __init__(self) -> None:
        super().__init__()
        _torch.manual_seed(0)
        self.embed = _torch.nn.Linear(8, 8)
        self.layers = _torch.nn.ModuleList(_torch.nn.Linear(8, 8) for _ in range(2))
        self.head = _torch.nn.Linear(8, 8)

    def forward(self, x=None):
        x = self.embed(_torch.ones(2, 8) if x is None else x)
        for layer in self.layers:
            x = _torch.tanh(layer(x))
        return self.head(x)


def build_policy():
    return _UserModel()


model = _UserModel()
state_dict = model.state_dict()
path = "checkpoint"
num_steps = 2
every = 1
batch = _torch.ones(2, 8)
models = [_UserModel(), _UserModel()]  # Megatron model chunks (chunks without DDP: their parameters)
ds_config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 10**9,
             "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
             "zero_optimization": {"stage": 1}}


def train_step(model, *rest):
    if hasattr(model, "backward") and hasattr(model, "step"):  # a DeepSpeed engine
        loss = model(batch).float().pow(2).mean()
        model.backward(loss)
        model.step()
        return
    optimizer = next((a for a in rest if isinstance(a, _torch.optim.Optimizer)), None)
    chunks = model if isinstance(model, (list, tuple)) else [model]
    sum(m(batch).pow(2).mean() for m in chunks).backward()
    if optimizer is not None:
        optimizer.step()
        optimizer.zero_grad()


def compute_log_prob(model, *rest):
    chunks = model if isinstance(model, (list, tuple)) else [model]
    with _torch.no_grad():
        return [_torch.log_softmax(m(batch), -1) for m in chunks]


class _RolloutEngine:
    def generate(self, *args, **kwargs):
        return []


rollout_engine = vllm_engine = _RolloutEngine()


class DetachActorWorker:
    """verl's actor worker, as the user's code base has it."""
'''

# verl is not installed here: its decorator module, as far as the snippets use it.
VERL_STUB = '''
class Dispatch:
    ONE_TO_ALL = "ONE_TO_ALL"


def register(dispatch_mode):
    def mark(fn):
        fn.dispatch_mode = dispatch_mode
        return fn
    return mark
'''


def _snippets() -> list[tuple[str, int, str]]:
    """(file relative to the repository, line of the fence, code) of every ```python block."""
    out = []
    for doc in DOCS:
        lines = doc.read_text().splitlines()
        i = 0
        while i < len(lines):
            fence = re.match(r"(\s*)```python\s*$", lines[i])
            if fence:
                indent, start, body = fence.group(1), i + 1, []
                i += 1
                while i < len(lines) and lines[i].strip() != "```":
                    body.append(lines[i][len(indent):] if lines[i].startswith(indent) else lines[i])
                    i += 1
                out.append((str(doc.relative_to(ROOT)), start, "\n".join(body) + "\n"))
            i += 1
    return out


SNIPPETS = _snippets()
IDS = [f"{name}:{line}" for name, line, _ in SNIPPETS]


# The frameworks a snippet may show that the package does not require (its extras): a snippet importing one
# that is not installed is skipped, saying which, rather than failed (.ci/other_torch.sh runs the suite without them).
OPTIONAL = ("deepspeed", "megatron", "ray", "transformers", "matplotlib")


def _missing(code: str) -> list[str]:
    """The optional frameworks a snippet imports that are not installed."""
    wanted = re.findall(r"^\s*(?:import|from)\s+(" + "|".join(OPTIONAL) + r")\b", code, re.MULTILINE)
    return sorted({name for name in wanted if importlib.util.find_spec(name) is None})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Future]]:
    """Every selected snippet started at once, two at a time (each process spends seconds importing torch);
    each test waits for its own, so a test's time is its snippet's, not all of them. Only the snippets of
    the tests that will run are started (`-k integrity` runs integrity.md's alone)."""
    selected = {IDS[item.callspec.params["snippet"]] for item in request.session.items
                if isinstance(item, pytest.Function) and item.module is sys.modules[__name__]
                and hasattr(item, "callspec") and "snippet" in item.callspec.params}
    stubs = tmp_path_factory.mktemp("stubs")
    package = stubs / "verl" / "single_controller" / "base"
    package.mkdir(parents=True)
    for d in (stubs / "verl", stubs / "verl" / "single_controller", package):
        (d / "__init__.py").write_text("")
    (package / "decorator.py").write_text(VERL_STUB)

    def run(item: tuple[str, tuple[str, int, str]]) -> subprocess.CompletedProcess:
        ident, (_, _, code) = item
        cwd = tmp_path_factory.mktemp("snippet")
        env = {k: v for k, v in os.environ.items() if not k.startswith("GPU_OFFLOAD_")}
        env.update(PYTHONPATH=str(stubs), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(_free_port()), DS_ACCELERATOR="cpu", PYTHONUNBUFFERED="1",
                   # DeepSpeed's ops build where tests/test_deepspeed.py builds them (compiled once, then reused).
                   TORCH_EXTENSIONS_DIR=os.environ.get("TORCH_EXTENSIONS_DIR", str(ROOT / "build" / "torch_extensions")),
                   # Two snippets at once, each with torch's default of one intra-op thread per core, oversubscribe
                   # a 2-core machine, where an OpenMP region waiting for a busy core can run 100x slower (and a
                   # DeepSpeed snippet that takes 30 s alone once ran past the timeout). One thread each.
                   OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        args = [sys.executable, "-c", PREAMBLE + "\n" + code]
        try:
            proc = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT)
        except subprocess.TimeoutExpired as exc:
            out = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else (exc.stderr or "")
            proc = subprocess.CompletedProcess(args, -9, "", out + f"\n(timed out after {TIMEOUT} s)")
        return proc

    pool = ThreadPoolExecutor(max_workers=2)
    try:
        yield {ident: pool.submit(run, item) for ident, item in zip(IDS, zip(IDS, SNIPPETS))
               if ident in selected and not _missing(item[1][2])}
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def test_the_docs_have_snippets() -> None:
    names = {name for name, _, _ in SNIPPETS}
    assert {"README.md", "docs/checkpoint.md", "docs/integrity.md", "docs/troubleshooting.md"} <= names, names


@pytest.mark.parametrize("snippet", range(len(SNIPPETS)), ids=IDS)
def test_snippet_runs_as_written(snippet: int, runs: dict[str, Future]) -> None:
    ident = IDS[snippet]
    code = SNIPPETS[snippet][2]
    if missing := _missing(code):
        pytest.skip(f"{ident} imports {', '.join(missing)}, not installed")
    proc = runs[ident].result()
    assert proc.returncode == 0, f"{ident} failed:\n{textwrap.indent(code, '    ')}\n{proc.stderr[-3000:]}"


def _log_comment_pattern(comment: str) -> re.Pattern[str]:
    """A log line shown in a comment as a pattern: numbers may differ, `...` stands for anything."""
    parts = re.split(r"(\.\.\.|\d+(?:\.\d+)?)", comment)
    regex = "".join(".*" if p == "..." else r"\d+(?:\.\d+)?" if re.fullmatch(r"\d+(?:\.\d+)?", p) else re.escape(p)
                    for p in parts)
    return re.compile(regex + "$")


@pytest.mark.parametrize("snippet", [i for i, (_, _, code) in enumerate(SNIPPETS)
                                     if re.search(r"^# (DEBUG|INFO|WARNING):gpu_offload:", code, re.MULTILINE)],
                         ids=lambda i: IDS[i])
def test_a_log_line_shown_is_what_the_snippet_logs(snippet: int, runs: dict[str, Future]) -> None:
    code = SNIPPETS[snippet][2]
    if missing := _missing(code):
        pytest.skip(f"{IDS[snippet]} imports {', '.join(missing)}, not installed")
    proc = runs[IDS[snippet]].result()
    logged = proc.stderr.splitlines()
    for comment in re.findall(r"^# ((?:DEBUG|INFO|WARNING):gpu_offload:.*)$", code, re.MULTILINE):
        pattern = _log_comment_pattern(comment)
        assert any(pattern.match(line) for line in logged), (comment, logged)
