"""Snapshots on disk: safetensors files written atomically and checked in full when read back.

    gpu_offload.save(snap, "/ckpt/policy.snap")    # temporary file, fsync, rename, fsync of the directory
    snap = gpu_offload.load("/ckpt/policy.snap")   # into the arena, checked, ready for restore()

File format (a plain safetensors file, readable by any safetensors reader):
  * one uint8 tensor per storage, keyed "storage.<index>", holding the storage's bytes;
  * the metadata entry "format" = "gpu_offload.snapshot", "format_version" = "1", "package_version", and
    "layout": JSON with every tensor (name, storage, offset, shape, stride, dtype) and every storage (name,
    nbytes, device, checksum as 16 hex digits). Checksums are those taken from the source when the
    snapshot was made with checksum=True, else computed from the host copy at save time.

A save interrupted at any point (even SIGKILL) leaves the previous file as it was: the new one is written
beside it under a temporary name and only renamed over it once complete and on disk.
"""

from __future__ import annotations

import contextlib
import importlib.util
import itertools
import json
import logging
import os
import re
import time
from typing import Any, Optional, Union

import torch

from . import integrity as _integrity
from ._errors import OffloadError
from ._version import __version__
from .arena import Arena, default_arena
from .snapshot import Snapshot
from .storages import _LARGE_ALIGNMENT, _SMALL_ALIGNMENT, _SMALL_STORAGE_BYTES, Layout, StorageSpec, TensorSpec, _align

logger = logging.getLogger("gpu_offload")

FORMAT = "gpu_offload.snapshot"
FORMAT_VERSION = 1
CHECKSUM_ALGORITHM = "sum64-v1"  # csrc/core/checksum.hpp
_KEY = "storage.{}"
_MAX_HEADER_BYTES = 100_000_000  # what safetensors itself accepts
_temporary_ids = itertools.count()

PathLike = Union[str, "os.PathLike[str]"]


def _need_safetensors() -> None:
    if importlib.util.find_spec("safetensors") is None:
        raise ImportError("saving and loading snapshots needs the safetensors package: "
                          "pip install safetensors")


# -- save ----------------------------------------------------------------------------------------------
def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _layout_json(layout: Layout, checksums: list[int], source: str) -> str:
    return json.dumps({
        "checksum_algorithm": CHECKSUM_ALGORITHM,
        "checksum_source": source,
        "tensors": [{"name": t.name, "storage": t.storage, "offset": t.offset, "shape": list(t.shape),
                     "stride": list(t.stride), "dtype": _dtype_name(t.dtype)} for t in layout.tensors],
        "storages": [{"name": s.name, "nbytes": s.nbytes, "device": str(s.device), "checksum": f"{c:016x}"}
                     for s, c in zip(layout.storages, checksums)],
        "shard_info": layout.shard_info,  # rank / world size / shard sizes of FSDP or Megatron targets
    }, separators=(",", ":"))


def _fsync_path(path: str, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove_stale_temporaries(path: str) -> None:
    """Deletes temporaries of earlier saves to `path` whose process is gone (killed in the middle)."""
    directory, base = os.path.split(os.path.abspath(path))
    pattern = re.compile(re.escape(base) + r"\.tmp-(\d+)-\d+")
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for name in names:
        m = pattern.fullmatch(name)
        if m is None or int(m.group(1)) == os.getpid():
            continue
        try:
            os.kill(int(m.group(1)), 0)
        except ProcessLookupError:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(directory, name))
                logger.debug("removed %s, left by a save that did not finish", name)
        except (PermissionError, OverflowError, OSError):
            pass  # alive under another user, or not a pid: leave it


def save(snap: Snapshot, path: PathLike) -> None:
    """Writes a snapshot (its bytes and its layout) to a safetensors file at `path`, atomically.

    Waits for the snapshot's copy first. A snapshot taken with checksum=True is verified before anything is
    written (a corrupt host copy is never saved); otherwise checksums of the host copy are computed and
    stored, so that `load` can always check the data. The file appears under its name only when complete
    and synced: a crash or SIGKILL in the middle leaves the previous file at `path` intact.

    Raises:
        OffloadError: the snapshot was freed, its host copy is corrupt, or the writer failed.
        OSError: the file cannot be written (permissions, disk full); the previous file is then intact.
    """
    _need_safetensors()
    from safetensors.torch import save_file

    start = time.perf_counter()
    path = os.fspath(path)
    region = snap._live()
    snap.wait()
    layout = snap.layout
    checksums = snap.checksums
    if checksums is not None:
        _integrity.verify_host(layout, region.ptr, checksums)
        source = "source"
    else:
        checksums = _integrity.host_checksums(layout, region.ptr)
        source = "host copy"
    view = region.buffer(owner=snap)
    tensors = {_KEY.format(i): (torch.frombuffer(view, dtype=torch.uint8, count=s.nbytes, offset=s.host_offset)
                                if s.nbytes else torch.empty(0, dtype=torch.uint8))
               for i, s in enumerate(layout.storages)}
    metadata = {"format": FORMAT, "format_version": str(FORMAT_VERSION), "package_version": __version__,
                "layout": _layout_json(layout, checksums, source)}
    _remove_stale_temporaries(path)
    temporary = f"{path}.tmp-{os.getpid()}-{next(_temporary_ids)}"
    try:
        try:
            save_file(tensors, temporary, metadata=metadata)
        except OSError:
            raise
        except Exception as exc:  # the writer's own error type (SafetensorError)
            raise OffloadError(f"cannot write {path}: {exc}") from exc
        _fsync_path(temporary)  # the bytes are on disk before the name points at them
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
    _fsync_path(os.path.dirname(os.path.abspath(path)), directory=True)  # and so is the rename
    logger.debug("saved %d storages, %d bytes to %s in %.3f s", len(layout.storages), layout.nbytes, path,
                 time.perf_counter() - start)


# -- load ----------------------------------------------------------------------------------------------
def _bad(path: str, problem: str) -> OffloadError:
    return OffloadError(f"cannot load {path}: {problem}")


def _read_header(path: str, size: int) -> tuple[dict[str, Any], int]:
    """The safetensors header and where the data starts, after checking the file is as long as it says."""
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise _bad(path, f"the file has {size} bytes, too short for a safetensors header (truncated or empty)")
        n = int.from_bytes(prefix, "little")
        if n > _MAX_HEADER_BYTES:
            raise _bad(path, f"not a safetensors file (its first 8 bytes give a header of {n} bytes)")
        if 8 + n > size:
            raise _bad(path, f"truncated, or not a safetensors file: the header needs {n} bytes, the file has "
                       f"{size - 8} after the length")
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _bad(path, f"corrupt header, or not a safetensors file: its header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise _bad(path, f"corrupt header: a JSON {type(header).__name__}, not an object")
    return header, 8 + n


def _parse_dtype(name: Any) -> torch.dtype:
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def _int(value: Any, what: str, minimum: int = 0) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{what} must be an integer >= {minimum}, got {value!r}")
    return value


def _parse_layout(text: Any) -> tuple[Layout, list[int]]:
    """Layout and checksums from the metadata's JSON; host offsets laid out afresh as bind() does."""
    if not isinstance(text, str):
        raise ValueError("no layout")
    doc = json.loads(text)
    if doc.get("checksum_algorithm") != CHECKSUM_ALGORITHM:
        raise ValueError(f"checksum algorithm {doc.get('checksum_algorithm')!r}, this version knows "
                         f"{CHECKSUM_ALGORITHM!r}")
    storages: list[StorageSpec] = []
    checksums: list[int] = []
    host = 0
    for i, s in enumerate(doc["storages"]):
        nbytes = _int(s["nbytes"], f"storage {i} nbytes")
        device = torch.device(s["device"])
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"storage {i}: device {device} is not supported")
        if not isinstance(s["name"], str):
            raise ValueError(f"storage {i}: name is not a string")
        host = _align(host, _LARGE_ALIGNMENT if nbytes >= _SMALL_STORAGE_BYTES else _SMALL_ALIGNMENT)
        storages.append(StorageSpec(s["name"], nbytes, device, host))
        host += nbytes
        checksum = s["checksum"]
        if not isinstance(checksum, str) or not re.fullmatch(r"[0-9a-f]{16}", checksum):
            raise ValueError(f"storage {i}: checksum {checksum!r} is not 16 hex digits")
        checksums.append(int(checksum, 16))
    tensors: list[TensorSpec] = []
    names: set[str] = set()
    for t in doc["tensors"]:
        name = t["name"]
        if not isinstance(name, str) or name in names:
            raise ValueError(f"tensor name {name!r} is not a string or appears twice")
        names.add(name)
        index = _int(t["storage"], f"{name}: storage")
        if index >= len(storages):
            raise ValueError(f"{name}: storage {index} does not exist ({len(storages)} storages)")
        shape = tuple(_int(d, f"{name}: shape") for d in t["shape"])
        stride = tuple(_int(d, f"{name}: stride") for d in t["stride"])
        if len(shape) != len(stride):
            raise ValueError(f"{name}: shape {shape} and stride {stride} differ in length")
        offset = _int(t["offset"], f"{name}: offset")
        dtype = _parse_dtype(t["dtype"])
        # The view must lie inside its storage, or Snapshot.tensors() would read past it.
        if all(shape):
            extent = (offset + sum((d - 1) * st for d, st in zip(shape, stride)) + 1) * dtype.itemsize
            if extent > storages[index].nbytes:
                raise ValueError(f"{name}: the view needs {extent} bytes, its storage has {storages[index].nbytes}")
        tensors.append(TensorSpec(name, index, offset, shape, stride, dtype))
    shard_info = doc.get("shard_info")
    if shard_info is not None:
        if not isinstance(shard_info, str):
            raise ValueError("shard_info is not a string")
        json.loads(shard_info)  # must parse: restore compares it field by field
    return Layout(tuple(tensors), tuple(storages), host, shard_info), checksums


def _check_entries(path: str, header: dict[str, Any], layout: Layout, size: int, data_start: int) -> None:
    """Every storage present once, as a uint8 vector of its size, the data section exactly filling the file."""
    expected = {_KEY.format(i) for i in range(len(layout.storages))}
    keys = set(header) - {"__metadata__"}
    missing = sorted(expected - keys, key=lambda k: int(k.split(".")[1]))
    extra = sorted(keys - expected)
    if missing or extra:
        raise _bad(path, "tensors do not match the layout: "
                   + "; ".join(p for p in (f"missing {', '.join(missing[:5])}" if missing else "",
                                           f"unexpected {', '.join(map(repr, extra[:5]))}" if extra else "") if p))
    data_end = 0
    for i, spec in enumerate(layout.storages):
        key = _KEY.format(i)
        entry = header[key]
        if not isinstance(entry, dict):
            raise _bad(path, f"{key}: corrupt header entry")
        offsets = entry.get("data_offsets")
        if (entry.get("dtype") != "U8" or entry.get("shape") != [spec.nbytes] or not isinstance(offsets, list)
                or len(offsets) != 2 or not all(isinstance(o, int) for o in offsets)
                or offsets[1] - offsets[0] != spec.nbytes or offsets[0] < 0):
            raise _bad(path, f"{key} ({spec.name}): the file holds {entry.get('dtype')} {entry.get('shape')} at "
                       f"{offsets}, the layout says {spec.nbytes} bytes (U8)")
        data_end = max(data_end, offsets[1])
    if data_start + data_end > size:
        raise _bad(path, f"truncated: the file has {size} bytes, its header describes {data_start + data_end}")
    if data_start + data_end < size:
        raise _bad(path, f"{size - data_start - data_end} unexpected bytes after the data (corrupt or appended to)")


def load(path: PathLike, arena: Optional[Arena] = None) -> Snapshot:
    """Reads a snapshot written by `gpu_offload.save` into the arena, checks it, and returns it ready for
    `restore`.

    Everything is checked before the snapshot is returned: the safetensors header, the format and its
    version, that the tensors are exactly the layout's storages with their sizes, that the file is neither
    truncated nor extended, and every storage's checksum. Its `checksums` are those of the file.

    Raises:
        FileNotFoundError: there is no file at `path`.
        OffloadError: the file is truncated, corrupt, of a newer format, or not a gpu_offload snapshot
            (the message says which), or the arena cannot hold it. The arena is unchanged then.
    """
    _need_safetensors()
    start = time.perf_counter()
    path = os.fspath(path)
    size = os.stat(path).st_size  # FileNotFoundError as is
    header, data_start = _read_header(path, size)
    meta = header.get("__metadata__")
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise _bad(path, f"not a gpu_offload snapshot: its metadata has no \"format\": \"{FORMAT}\" "
                   "(a safetensors file written by something else?)")
    try:
        version = int(meta.get("format_version", ""))
    except ValueError:
        raise _bad(path, f"format_version {meta.get('format_version')!r} is not a number") from None
    if version != FORMAT_VERSION:
        newer = " (written by a newer gpu_offload; upgrade)" if version > FORMAT_VERSION else ""
        raise _bad(path, f"format version {version}, this gpu_offload ({__version__}) reads {FORMAT_VERSION}{newer}")
    try:
        layout, checksums = _parse_layout(meta.get("layout"))
    except (KeyError, TypeError, ValueError, AttributeError, RuntimeError) as exc:
        raise _bad(path, f"corrupt layout in the metadata ({type(exc).__name__}: {exc})") from None
    _check_entries(path, header, layout, size, data_start)

    arena = arena if arena is not None else default_arena()
    region = arena._allocate(layout.host_bytes)
    try:
        _read_into(path, layout, region)
        _integrity.check(layout, checksums, _integrity.host_checksums(layout, region.ptr),
                         f"cannot load {path}: data corrupt")
    except BaseException:
        region.release()
        raise
    logger.debug("loaded %d storages, %d bytes from %s in %.3f s", len(layout.storages), layout.nbytes, path,
                 time.perf_counter() - start)
    return Snapshot(layout, region, [], _integrity.Checksums(list(checksums)))


def _read_into(path: str, layout: Layout, region: Any) -> None:
    """Copies every storage's bytes from the file into the region, through the safetensors reader."""
    from safetensors import safe_open

    view = region.buffer(owner=region)
    try:
        with safe_open(path, framework="pt") as f:
            for i, spec in enumerate(layout.storages):
                if spec.nbytes == 0:
                    continue
                src = f.get_tensor(_KEY.format(i))
                dst = torch.frombuffer(view, dtype=torch.uint8, count=spec.nbytes, offset=spec.host_offset)
                dst.copy_(src)
                del src, dst
    except OSError:
        raise
    except Exception as exc:  # the reader's own error type (SafetensorError)
        raise _bad(path, f"the safetensors reader refused it: {exc}") from exc
