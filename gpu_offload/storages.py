"""Storages: tensors grouped by the memory they live in, each storage copied once, whole.

A Layout records, for every named tensor, which storage it views and how (offset, shape, stride,
dtype), and for every storage its size, device and place in the host region. Two targets with equal
layouts (e.g. a model and its freshly built twin) can exchange snapshots.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from typing import Optional, Sequence

import torch

from . import torch_ext
from ._errors import LayoutMismatchError, OffloadError

_SUPPORTED_DEVICE_TYPES = ("cpu", "cuda")
# Storages are placed at 256-byte boundaries (what the copy engines like); small ones at 16 bytes so
# thousands of tiny tensors do not waste the arena (16 bytes: one vector access of a gather kernel).
_LARGE_ALIGNMENT = 256
_SMALL_ALIGNMENT = 16
_SMALL_STORAGE_BYTES = 64 * 1024


def _align(n: int, to: int) -> int:
    return (n + to - 1) // to * to


@dataclass(frozen=True)
class TensorSpec:
    name: str
    storage: int  # index into Layout.storages
    offset: int  # storage_offset, in elements
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class StorageSpec:
    name: str  # the first tensor that views it
    nbytes: int
    device: torch.device
    host_offset: int  # where it sits in the host region


@dataclass(frozen=True)
class Layout:
    tensors: tuple[TensorSpec, ...]
    storages: tuple[StorageSpec, ...]
    host_bytes: int  # region size needed for all storages
    # The strategy's shard layout (rank, world size, shard sizes and placements) as canonical JSON, for
    # targets sharded by FSDP1/FSDP2/Megatron; None otherwise. Part of equality: a rank's snapshot only
    # restores into the same rank of the same sharding.
    shard_info: Optional[str] = None

    # Computed once per layout: layouts are cached and read on every call.
    @cached_property
    def nbytes(self) -> int:
        """Payload: the sum of the storages' sizes."""
        return sum(s.nbytes for s in self.storages)

    @cached_property
    def devices(self) -> list[torch.device]:
        return sorted({s.device for s in self.storages}, key=str)

    @cached_property
    def has_grads(self) -> bool:
        return any(t.name.endswith(".grad") for t in self.tensors)


@dataclass
class Bound:
    """A layout together with the live storages of the target it was read from (same order)."""

    layout: Layout
    storages: list[torch.UntypedStorage]
    keys: list[int]  # the storages' identities (StorageImpl addresses), stable while they live


# Tensor types whose own storage holds their data (anything else, e.g. a DTensor, is unwrapped first).
PLAIN_TENSOR_TYPES = frozenset({torch.Tensor, torch.nn.Parameter})


def unwrap(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor holding a wrapper's data: a DTensor's local shard, a Parameter's data."""
    local = getattr(t, "_local_tensor", None)
    if isinstance(local, torch.Tensor):
        return local
    return t


def check_tensor(name: str, t: object) -> torch.Tensor:
    """Raises OffloadError for anything that has no plain, strided CPU/CUDA storage to copy."""
    if not isinstance(t, torch.Tensor):
        raise OffloadError(f"{name}: expected a tensor, got {type(t).__qualname__}")
    t = unwrap(t)
    if t.is_meta or t.device.type == "meta":
        raise OffloadError(f"{name}: meta tensors have no data to copy")
    if t.layout != torch.strided:
        raise OffloadError(f"{name}: {t.layout} tensors are not supported (only strided); densify it first")
    if t.is_nested:  # strided-layout nested tensors have no sizes or strides of their own
        raise OffloadError(f"{name}: nested tensors are not supported; unbind it into its components first")
    if t.device.type not in _SUPPORTED_DEVICE_TYPES:
        raise OffloadError(f"{name}: device {t.device} is not supported (cpu or cuda)")
    if t.is_quantized:
        raise OffloadError(f"{name}: quantized tensors are not supported")
    # The storage of a conjugate (or negative) view holds the values before the conjugation: a copy of the
    # storage would come back as conj(value) through tensors(), files and checkpoints, and a snapshot of
    # the plain tensor would restore into the view as if the bit were not there.
    if t.is_conj():
        raise OffloadError(f"{name}: a conjugate view (is_conj()) is not supported: its storage holds the "
                           "unconjugated values; pass the tensor it views, or t.resolve_conj() (a copy)")
    if t.is_neg():
        raise OffloadError(f"{name}: a negative view (is_neg()) is not supported (e.g. the .imag of a conjugate "
                           "view): its storage holds the values before negation; pass the tensor it views, "
                           "or t.resolve_neg() (a copy)")
    if type(t) not in PLAIN_TENSOR_TYPES and not isinstance(t, torch.nn.Parameter):
        # Other tensor subclasses (fake, functional, ...) may have no real storage behind them.
        try:
            t.untyped_storage().data_ptr()
        except Exception as exc:
            if not (torch_ext.access_guard_available() and torch_ext.access_refused(t)):  # not an offloaded one
                raise OffloadError(f"{name}: {type(t).__qualname__} has no storage to copy ({exc})") from None
    return t


def bind(named: Sequence[tuple[str, torch.Tensor]], nbytes_of: Optional[dict[int, int]] = None) -> Bound:
    """Groups named tensors by storage and lays the storages out in a host region.

    nbytes_of overrides a storage's size by its key (offloaded storages have 0 bytes on the device).
    """
    seen_names: set[str] = set()
    index_of: dict[int, int] = {}
    storages: list[torch.UntypedStorage] = []
    keys: list[int] = []
    specs: list[StorageSpec] = []
    tensors: list[TensorSpec] = []
    host = 0
    for name, raw in named:
        if name in seen_names:
            raise OffloadError(f"duplicate tensor name {name!r} in target")
        seen_names.add(name)
        t = check_tensor(name, raw)
        storage = t.untyped_storage()
        key = storage._cdata
        idx = index_of.get(key)
        if idx is None:
            idx = len(storages)
            index_of[key] = idx
            nbytes = storage.nbytes()
            if nbytes_of is not None:
                nbytes = nbytes_of.get(key, nbytes)
            host = _align(host, _LARGE_ALIGNMENT if nbytes >= _SMALL_STORAGE_BYTES else _SMALL_ALIGNMENT)
            specs.append(StorageSpec(name, nbytes, t.device, host))
            host += nbytes
            storages.append(storage)
            keys.append(key)
        tensors.append(TensorSpec(name, idx, int(t.storage_offset()), tuple(t.shape), tuple(t.stride()), t.dtype))
    return Bound(Layout(tuple(tensors), tuple(specs), host), storages, keys)


def tensor_extent_bytes(t: TensorSpec) -> int:
    """Bytes of its storage a view reaches (0 for an empty tensor)."""
    if not all(t.shape):
        return 0
    return (t.offset + sum((d - 1) * st for d, st in zip(t.shape, t.stride)) + 1) * t.dtype.itemsize


def extent_problem(layout: Layout) -> Optional[str]:
    """Why a tensor reaches past its storage (memory released by someone else, e.g. another offload tool's
    resize_(0), which a snapshot would silently miss), or None."""
    for t in layout.tensors:
        need = tensor_extent_bytes(t)
        have = layout.storages[t.storage].nbytes
        if need > have:
            return (f"{t.name}: its storage holds {have} bytes but the tensor needs {need}: its memory was "
                    "released outside gpu_offload (another offload tool?); bring it back first")
    return None


def _first_difference(a: object, b: object, path: str = "") -> str:
    if isinstance(a, dict) and isinstance(b, dict):
        for key in list(a) + [k for k in b if k not in a]:
            if a.get(key) != b.get(key):
                return _first_difference(a.get(key), b.get(key), f"{path}.{key}" if path else str(key))
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            if x != y:
                return _first_difference(x, y, f"{path}[{i}]")
    return f"{path or 'shard layout'}: {b} in target, {a} in snapshot"


def shard_difference(snapshot: Optional[str], target: Optional[str]) -> Optional[str]:
    """The first difference between two shard layouts, or None when they agree."""
    if snapshot == target:
        return None
    if snapshot is None or target is None:
        which = "snapshot" if target is None else "target"
        return f"only the {which} is sharded (FSDP/Megatron): the two come from different strategies"
    return _first_difference(json.loads(snapshot), json.loads(target))


def _names(names: Sequence[str], shown: int = 3) -> str:
    """The first few names, then how many more."""
    more = len(names) - shown
    return ", ".join(names[:shown]) + (f" (+{more} more)" if more > 0 else "")


def _both(names: Sequence[str]) -> str:
    """Names that belong together: "a and b", "a, b and c", "a, b, c and 4 more"."""
    if len(names) <= 3:
        return " and ".join(filter(None, [", ".join(names[:-1]), names[-1]]))
    return f"{', '.join(names[:3])} and {len(names) - 3} more"


def _compile_hint(snapshot_names: Sequence[str], target_names: Sequence[str]) -> Optional[str]:
    """What to do when the names differ only by torch.compile's `_orig_mod.` (an OptimizedModule's
    parameters are its original module's, under that prefix)."""
    def plain(names: Sequence[str]) -> set[str]:
        return {n.replace("_orig_mod.", "") for n in names}

    if plain(snapshot_names) != plain(target_names):
        return None
    if any("_orig_mod." in n for n in snapshot_names):
        return ("the snapshot is of a torch.compile'd module (its names have `_orig_mod.`) and the target is not: "
                "restore into the compiled module, or snapshot the original one (`compiled._orig_mod`)")
    return ("the target is a torch.compile'd module (its names have `_orig_mod.`) and the snapshot is of the original "
            "module: restore into the original one (`compiled._orig_mod`), or snapshot the compiled one")


def _contiguous(t: TensorSpec) -> bool:
    """Whether the strides are those of a contiguous tensor of that shape."""
    expected, step = [], 1
    for d in reversed(t.shape):
        expected.append(step)
        step *= max(d, 1)
    return tuple(reversed(expected)) == t.stride


def _field_lines(diffs: dict[str, list[tuple[str, object, object]]]) -> list[str]:
    """One line per kind of difference: (name, in target, in snapshot) grouped by field, and for dtype and
    device also by the two values (a model built in another dtype differs in every tensor the same way)."""
    lines = []
    for field, items in diffs.items():
        if field in ("dtype", "device"):
            by_values: dict[tuple[str, str], list[str]] = {}
            for name, b, a in items:
                by_values.setdefault((str(b), str(a)), []).append(name)
            for (b, a), names in by_values.items():
                lines.append(f"{names[0]}: {field} {b} in target, {a} in snapshot" if len(names) == 1 else
                             f"{field} {b} in target, {a} in snapshot for {len(names)} tensors: {_names(names)}")
            continue
        name, b, a = items[0]
        what = "storage of" if field == "storage" else field
        unit = " bytes" if field == "storage" else ""
        first = f"{name}: {what} {b}{unit} in target, {a}{unit} in snapshot"
        more = len(items) - 1
        lines.append(first if not more else f"{first}; {more} more tensor{'s differ' if more > 1 else ' differs'} in "
                     f"{field}: {_names([n for n, _, _ in items[1:]])}")
    return lines


def match(snapshot: Layout, target: Layout, max_report: int = 5) -> Optional[list[int]]:
    """Maps each target storage to the snapshot storage it must receive (None: the same layout, storage i
    to storage i).

    Raises LayoutMismatchError when names, shapes, strides, offsets, dtypes, devices, storage sharing or
    storage sizes differ: one short line per kind of difference, naming the tensors (the first few of each
    kind) and, where the remedy is known (tied weights, torch.compile's `_orig_mod.` names), what to do.
    """
    if snapshot is target or snapshot == target:  # identity: the common case of a cached plan
        return None
    problems: list[str] = []
    shard = shard_difference(snapshot.shard_info, target.shard_info)
    if shard is not None:
        problems.append(f"shard layout differs (another rank, world size or sharding): {shard}")
    snap_by_name = {t.name: t for t in snapshot.tensors}
    target_by_name = {t.name: t for t in target.tensors}
    missing = [n for n in snap_by_name if n not in target_by_name]
    extra = [n for n in target_by_name if n not in snap_by_name]
    if missing:
        problems.append(f"missing from target: {', '.join(missing[:max_report])}"
                        + (f" (+{len(missing) - max_report} more)" if len(missing) > max_report else ""))
    if extra:
        problems.append(f"not in snapshot: {', '.join(extra[:max_report])}"
                        + (f" (+{len(extra) - max_report} more)" if len(extra) > max_report else ""))
    if missing and extra:
        hint = _compile_hint(list(snap_by_name), list(target_by_name))
        if hint is not None:
            problems.append(hint)
    diffs: dict[str, list[tuple[str, object, object]]] = {}
    # Which snapshot storages each target storage receives, and the other way round, with the names.
    into: dict[int, dict[int, list[str]]] = {}
    out_of: dict[int, dict[int, list[str]]] = {}
    for name, tt in target_by_name.items():
        st = snap_by_name.get(name)
        if st is None:
            continue
        sized = False  # a difference that changes the storage's size by itself
        for field in ("shape", "stride", "offset", "dtype"):
            a, b = getattr(st, field), getattr(tt, field)
            if a != b and not (field == "stride" and _contiguous(st) and _contiguous(tt)):  # the shape says it all
                diffs.setdefault(field, []).append((name, b, a))
                sized = sized or field in ("shape", "dtype")
        ss, ts = snapshot.storages[st.storage], target.storages[tt.storage]
        if ss.device != ts.device:
            diffs.setdefault("device", []).append((name, ts.device, ss.device))
        elif ss.nbytes != ts.nbytes and not sized:  # a storage size that no difference above explains
            diffs.setdefault("storage", []).append((name, ts.nbytes, ss.nbytes))
        into.setdefault(tt.storage, {}).setdefault(st.storage, []).append(name)
        out_of.setdefault(st.storage, {}).setdefault(tt.storage, []).append(name)
    problems += _field_lines(diffs)
    for groups in into.values():
        if len(groups) > 1:
            names = [ns[0] for ns in groups.values()]
            problems.append(f"{_both(names)} share one storage in the target but are separate in the snapshot: untie "
                            "them in the target as the snapshot's model is built, or snapshot a target built like it")
    for groups in out_of.values():
        if len(groups) > 1:
            names = [ns[0] for ns in groups.values()]
            problems.append(f"{_both(names)} share one storage in the snapshot (tied weights, or views of one "
                            f"tensor) but are separate in the target: tie them in the target as in the snapshot "
                            f"(e.g. target.{names[-1]} = target.{names[0]} for tied weights), or snapshot a target "
                            "built like it")
    if problems:
        shown = problems[:max_report] + ([f"(+{len(problems) - max_report} more differences)"]
                                         if len(problems) > max_report else [])
        raise LayoutMismatchError("target layout differs from the snapshot:\n  " + "\n  ".join(shown))
    return [next(iter(into[i])) for i in range(len(target.storages))]
