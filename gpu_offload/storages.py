"""Storages: tensors grouped by the memory they live in, each storage copied once, whole.

A Layout records, for every named tensor, which storage it views and how (offset, shape, stride,
dtype), and for every storage its size, device and place in the host region. Two targets with equal
layouts (e.g. a model and its freshly built twin) can exchange snapshots.
"""

from __future__ import annotations

import copy
import json
from functools import cached_property
from typing import Any, Callable, NamedTuple, Optional, Sequence

import torch

from . import torch_ext
from ._errors import LayoutMismatchError, OffloadError

_ext: Any = torch_ext.ext  # the torch-aware helper, or None (the Python bind)
_SUPPORTED_DEVICE_TYPES = ("cpu", "cuda")
# Storages are placed at 256-byte boundaries (what the copy engines like); small ones at 16 bytes so
# thousands of tiny tensors do not waste the arena (16 bytes: one vector access of a gather kernel).
_LARGE_ALIGNMENT = 256
_SMALL_ALIGNMENT = 16
_SMALL_STORAGE_BYTES = 64 * 1024


def _align(n: int, to: int) -> int:
    return (n + to - 1) // to * to


class TensorSpec(NamedTuple):
    name: str
    storage: int  # index into Layout.storages
    offset: int  # storage_offset, in elements
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype


class StorageSpec(NamedTuple):
    name: str  # the first tensor that views it
    nbytes: int
    device: torch.device
    host_offset: int  # where it sits in the host region


def device_index(device: torch.device) -> int:
    """-1 for the CPU, else the CUDA device's index (the current device where it has none)."""
    if device.type == "cpu":
        return -1
    return device.index if device.index is not None else torch.cuda.current_device()


_devices: dict[int, torch.device] = {}


def index_device(index: int) -> torch.device:
    """device_index()'s inverse."""
    device = _devices.get(index)
    if device is None:
        device = _devices[index] = torch.device("cpu") if index < 0 else torch.device("cuda", index)
    return device


class Layout:
    """How a target's tensors view its storages, and where the storages sit in the host region.

    Held as columns (one list per field; a fresh bind in C++ fills them without a Python object per tensor);
    `tensors` and `storages` give the same as TensorSpec/StorageSpec tuples, made when first read. Never
    changed once made: layouts are cached and shared.
    """

    def __init__(self, tensors: Sequence[TensorSpec] = (), storages: Sequence[StorageSpec] = (), host_bytes: int = 0,
                 shard_info: Optional[str] = None) -> None:
        self.host_bytes = host_bytes  # region size needed for all storages
        # The strategy's shard layout (rank, world size, shard sizes and placements) as canonical JSON, for
        # targets sharded by FSDP1/FSDP2/Megatron; None otherwise. Part of equality: a rank's snapshot only
        # restores into the same rank of the same sharding.
        self.shard_info = shard_info
        self._tensors: Optional[tuple[TensorSpec, ...]] = tuple(tensors)
        self._storages: Optional[tuple[StorageSpec, ...]] = tuple(storages)
        self._tensor_names: Optional[list[str]] = None
        # Made from the specs when first asked for, or (from_columns) by a function of the layout's maker.
        self._make_tensor_columns: Optional[Callable[[], tuple[list[Any], ...]]] = None
        self._tensor_columns: Optional[tuple[list[Any], ...]] = None
        self._storage_columns: Optional[tuple[list[str], list[int], list[int], list[int]]] = None
        self._extent_problem: Optional[int] = None  # the first tensor past its storage; -1: none; None: unknown

    @classmethod
    def from_columns(cls, tensor_names: list[str], tensor_columns: Callable[[], tuple[list[Any], ...]],
                     storage_columns: tuple[list[str], list[int], list[int], list[int]], host_bytes: int,
                     extent_problem: Optional[int] = None, shard_info: Optional[str] = None) -> "Layout":
        """A layout from columns: the tensors' names and a function giving their (storage, offset, shape,
        stride, dtype) lists (called once, when first needed); the storages' (name, nbytes, device index,
        host offset) lists. None of them may be changed afterwards."""
        layout = cls((), (), host_bytes, shard_info)
        layout._tensors = layout._storages = None
        layout._tensor_names, layout._make_tensor_columns = tensor_names, tensor_columns
        layout._storage_columns = storage_columns
        layout._extent_problem = extent_problem
        return layout

    def with_shard_info(self, shard_info: Optional[str]) -> "Layout":
        """The same layout with another shard layout."""
        other = copy.copy(self)
        other.shard_info = shard_info
        return other

    @property
    def tensors(self) -> tuple[TensorSpec, ...]:
        if self._tensors is None:
            self._tensors = tuple(map(TensorSpec, self.tensor_names, *self.tensor_columns()))
        return self._tensors

    @property
    def storages(self) -> tuple[StorageSpec, ...]:
        if self._storages is None:
            names, nbytes, devices, hosts = self.storage_columns
            self._storages = tuple(map(StorageSpec, names, nbytes, map(index_device, devices), hosts))
        return self._storages

    @property
    def num_tensors(self) -> int:
        return len(self.tensor_names)

    @property
    def num_storages(self) -> int:
        return len(self.storage_columns[0])

    @property
    def tensor_names(self) -> list[str]:
        if self._tensor_names is None:
            self._tensor_names = [t.name for t in self.tensors]
        return self._tensor_names

    def tensor_columns(self) -> tuple[list[Any], ...]:
        """(storage index, offset, shape, stride, dtype) of each tensor, one list each."""
        if self._tensor_columns is None:
            if self._make_tensor_columns is not None:
                self._tensor_columns = tuple(self._make_tensor_columns())
            else:
                specs = self.tensors
                self._tensor_columns = ([t.storage for t in specs], [t.offset for t in specs], [t.shape for t in specs],
                                        [t.stride for t in specs], [t.dtype for t in specs])
        return self._tensor_columns

    @property
    def storage_columns(self) -> tuple[list[str], list[int], list[int], list[int]]:
        """(name, nbytes, device index, host offset) of each storage, one list each."""
        if self._storage_columns is None:
            specs = self.storages
            self._storage_columns = ([s.name for s in specs], [s.nbytes for s in specs],
                                     [device_index(s.device) for s in specs], [s.host_offset for s in specs])
        return self._storage_columns

    @cached_property
    def nbytes(self) -> int:
        """Payload: the sum of the storages' sizes."""
        return sum(self.storage_columns[1])

    @cached_property
    def devices(self) -> list[torch.device]:
        indices = self.storage_columns[2]
        if indices and indices.count(indices[0]) == len(indices):  # (one device, the usual case: no set made)
            return [index_device(indices[0])]
        return sorted(map(index_device, set(indices)), key=str)

    @cached_property
    def has_grads(self) -> bool:
        return any(name.endswith(".grad") for name in self.tensor_names)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Layout):
            return NotImplemented
        if other is self:
            return True
        return (self.host_bytes == other.host_bytes and self.shard_info == other.shard_info
                and self.tensor_names == other.tensor_names and self.storage_columns == other.storage_columns
                and self.tensor_columns() == other.tensor_columns())

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return (f"Layout({self.num_tensors} tensors, {self.num_storages} storages, {self.nbytes} bytes, "
                f"host_bytes={self.host_bytes}{', sharded' if self.shard_info is not None else ''})")


class Bound:
    """A layout together with the live storages of the target it was read from (same order)."""

    def __init__(self, layout: Layout, storages: Optional[list[torch.UntypedStorage]], keys: Optional[list[int]],
                 record: Any = None, tensors: Optional[list[torch.Tensor]] = None,
                 first_tensor: Optional[Sequence[int]] = None) -> None:
        self.layout = layout
        # The storages' identities (StorageImpl addresses), stable while they live; None: the record's, read
        # when first asked for (a snapshot of a target nothing is offloaded from never asks).
        self._keys = keys
        # The helper's TargetRecord of the tensors, where the C++ bind read them.
        self.record = record
        if keys is None and record is None:
            raise ValueError("Bound: keys, or a record to read them from")
        self._storages = storages
        self._tensors = tensors  # (plain; with first_tensor, reach the storages when asked for)
        self.first_tensor = first_tensor

    @property
    def keys(self) -> list[int]:
        if self._keys is None:
            self._keys = self.record.keys()
        return self._keys

    @property
    def storages(self) -> list[torch.UntypedStorage]:
        if self._storages is None:
            tensors = self._tensors
            self._storages = [tensors[i].untyped_storage() for i in self.first_tensor]
        return self._storages

    @property
    def keys_read(self) -> Optional[list[int]]:
        """The keys where they were read already, else None (not made just for this)."""
        return self._keys

    @property
    def storages_read(self) -> Optional[list[torch.UntypedStorage]]:
        """The storages where the bind read them already, else None (not made just for this)."""
        return self._storages

    def storage(self, i: int) -> torch.UntypedStorage:
        if self._storages is not None:
            return self._storages[i]
        return self._tensors[self.first_tensor[i]].untyped_storage()


# Tensor types whose own storage holds their data (anything else, e.g. a DTensor, is unwrapped first).
PLAIN_TENSOR_TYPES = frozenset({torch.Tensor, torch.nn.Parameter})


def regrowable(storage: torch.UntypedStorage) -> bool:
    """Whether a storage can be released and allocated again (offload's `resize_(0)`, then reload's): resizable,
    and not a CPU storage in shared memory (`share_memory_()`, a tensor from another process), which torch
    calls resizable but leaves with no allocator to grow it back from."""
    return storage.resizable() and not (storage.device.type == "cpu" and storage.is_shared())


# What an offload or a drop says of a storage that is not regrowable (after "cannot offload <name>: ").
UNREGROWABLE = ("its storage cannot be released and re-allocated (memory borrowed from numpy, DLPack, a file or "
                "shared memory?)")


def unwrap(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor holding a wrapper's data: a DTensor's local shard, a Parameter's data."""
    local = getattr(t, "_local_tensor", None)
    if isinstance(local, torch.Tensor):
        return local
    return t


def check_tensor(name: str, t: object) -> torch.Tensor:
    """Raises OffloadError for anything that has no plain, strided CPU/CUDA storage to copy."""
    # (By the type itself, not isinstance: an object passes that through its __class__, as a mock with a spec does.)
    if not issubclass(type(t), torch.Tensor):
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
    return bind_lists(*split_named(named), nbytes_of)


def split_named(named: Sequence[tuple[str, torch.Tensor]]) -> tuple[list[str], list[torch.Tensor]]:
    """(names, tensors) of (name, tensor) pairs, as two lists."""
    names = getattr(named, "names", None)
    if names is not None:  # adapters.Named: already two lists
        return names, named.tensors  # type: ignore[attr-defined]
    return [n for n, _ in named], [t for _, t in named]


def bind_lists(names: list[str], tensors: list[torch.Tensor], nbytes_of: Optional[dict[int, int]] = None,
               distinct: bool = False) -> Bound:
    """bind() of names and tensors given as two lists (never changed afterwards: the layout keeps them).
    distinct: the names are known to be distinct (a recorded traversal's, see adapters.Named); the C++ bind
    then does not check them again (the Python bind, which builds its set as it goes, does)."""
    if len(names) != len(tensors):
        raise OffloadError(f"{len(names)} names for {len(tensors)} tensors")
    ext = _ext
    if ext is not None and nbytes_of is None and type(names) is list and type(tensors) is list:
        # One C++ pass where every tensor is a plain one under a distinct name (else the loop below, which
        # also words what is wrong). Its tensor columns are made from the record when someone reads them.
        found = ext.bind(names, tensors, _LARGE_ALIGNMENT, _SMALL_ALIGNMENT, _SMALL_STORAGE_BYTES, distinct)
        if found is not None:
            record, first, nbytes, devices, hosts, host_bytes, extent = found
            if first is None:  # tensor i is the first on storage i, for every i: the names are the storages'
                first, storage_names = range(len(names)), names
            else:
                storage_names = list(map(names.__getitem__, first))
            layout = Layout.from_columns(names, record.tensor_columns, (storage_names, nbytes, devices, hosts),
                                         host_bytes, extent)
            return Bound(layout, None, None, record=record, tensors=tensors, first_tensor=first)
    seen_names: set[str] = set()
    index_of: dict[int, int] = {}
    storages: list[torch.UntypedStorage] = []
    keys: list[int] = []
    specs: list[StorageSpec] = []
    specs_of_tensors: list[TensorSpec] = []
    host = 0
    for name, raw in zip(names, tensors):
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
        specs_of_tensors.append(TensorSpec(name, idx, int(t.storage_offset()), tuple(t.shape), tuple(t.stride()),
                                           t.dtype))
    return Bound(Layout(specs_of_tensors, specs, host), storages, keys)


def _extent_bytes(offset: int, shape: tuple[int, ...], stride: tuple[int, ...], itemsize: int) -> int:
    if not all(shape):
        return 0
    return (offset + sum((d - 1) * st for d, st in zip(shape, stride)) + 1) * itemsize


def tensor_extent_bytes(t: TensorSpec) -> int:
    """Bytes of its storage a view reaches (0 for an empty tensor)."""
    return _extent_bytes(t.offset, t.shape, t.stride, t.dtype.itemsize)


def extent_problem(layout: Layout) -> Optional[str]:
    """Why a tensor reaches past its storage (memory released by someone else, e.g. another offload tool's
    resize_(0), which a snapshot would silently miss), or None. (Found once per layout.)"""
    have = layout.storage_columns[1]
    if layout._extent_problem is None:
        storage, offset, shape, stride, dtype = layout.tensor_columns()
        needs = map(_extent_bytes, offset, shape, stride, [d.itemsize for d in dtype])
        layout._extent_problem = next((i for i, need in enumerate(needs) if need > have[storage[i]]), -1)
    if layout._extent_problem < 0:
        return None
    t = layout.tensors[layout._extent_problem]
    return (f"{t.name}: its storage holds {have[t.storage]} bytes but the tensor needs {tensor_extent_bytes(t)}: "
            "its memory was released outside gpu_offload (another offload tool?); bring it back first")


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
