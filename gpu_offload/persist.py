"""Snapshots on disk: safetensors files written atomically and checked in full when read back.

    gpu_offload.save(snap, "/ckpt/policy.snap")    # temporary file, fsync, rename, fsync of the directory
    snap = gpu_offload.load("/ckpt/policy.snap")   # into the arena, checked, ready for restore()

File format (a plain safetensors file, readable by any safetensors reader):
  * one uint8 tensor per storage, keyed "storage.<index>", holding the storage's bytes, in index order with
    no gaps or overlaps;
  * the metadata entry "format" = "gpu_offload.snapshot", "format_version" = "2", "package_version",
    "layout": JSON with every tensor (name, storage, offset, shape, stride, dtype) and every storage (name,
    nbytes, device, checksum as 16 hex digits), and "layout_sha256": the SHA-256 of that JSON text, so
    that a damaged layout (an offset, a shape, a storage index) is refused like damaged data. Checksums
    are those taken from the source when the snapshot was made with checksum=True, else computed from the
    host copy at save time.
  * Version 1 files (gpu_offload before the layout checksum) are still read; their layout is checked for
    consistency but not against a checksum. No single bit flip turns "2" into "1".

A save interrupted at any point (even SIGKILL) leaves the previous file as it was: the new one is written
(by this module, no other temporary file) beside it under a temporary name and only renamed over it once
complete and on disk. The writer holds an flock on its temporary; a later save removes temporaries whose
lock it can take (their writer is gone, in this PID namespace or any other) once they are a minute old.
"""

from __future__ import annotations

import collections
import contextlib
import fcntl
import hashlib
import itertools
import json
import logging
import os
import re
import stat
import time
from typing import Any, Iterable, Optional, Union

import torch

from . import integrity as _integrity
from ._bytes import format_bytes
from ._errors import OffloadError
from ._version import __version__
from .arena import Arena, default_arena
from .snapshot import Snapshot
from .storages import (_LARGE_ALIGNMENT, _SMALL_ALIGNMENT, _SMALL_STORAGE_BYTES, Layout, StorageSpec, TensorSpec,
                       _align, tensor_extent_bytes)

logger = logging.getLogger("gpu_offload")

FORMAT = "gpu_offload.snapshot"
FORMAT_VERSION = 2  # 2: "layout_sha256" added (1 is still read)
_READABLE_VERSIONS = (1, 2)
CHECKSUM_ALGORITHM = "sum64-v1"  # csrc/core/checksum.hpp
_KEY = "storage.{}"
_MAX_HEADER_BYTES = 100_000_000  # what safetensors itself accepts
_STALE_TEMPORARY_SECONDS = 60.0  # an unlocked temporary younger than this may be a writer about to lock it
_IO_CHUNK = 64 << 20  # bytes per write/read call of one storage
_PROGRESS_MIN_BYTES = 256 << 20  # saves and loads from this size on log their progress at INFO
_PROGRESS_INTERVAL_S = 2.0  # at most one progress line per this many seconds
_INT64_MAX = (1 << 63) - 1
_temporary_ids = itertools.count()

PathLike = Union[str, "os.PathLike[str]"]
# The temporary's name: <path>.tmp-<pid>-<counter>-<8 hex digits>; only names of exactly this form are ever removed.
_TEMPORARY = r"\.tmp-[1-9][0-9]*-(?:0|[1-9][0-9]*)-[0-9a-f]{8}"


class _Descriptor:
    """An open file descriptor, owned from the moment it exists: os.open's result lands in the box inside
    C code (map, extend), so no interrupt falls between the open and its owner; closed once, by close()
    or when the owner is dropped (an interrupt anywhere after)."""

    __slots__ = ("_box",)

    def __init__(self, path: str, flags: int, mode: int = 0o777) -> None:
        self._box: list[int] = []
        self._box.extend(map(os.open, (path,), (flags,), (mode,)))

    @property
    def fd(self) -> int:
        return self._box[0]

    def close(self) -> None:
        box = getattr(self, "_box", None)
        if box:
            collections.deque(map(os.close, map(list.pop, [box])), maxlen=0)  # pop and close in one step

    __del__ = close


# -- save ----------------------------------------------------------------------------------------------
def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _layout_json(layout: Layout, checksums: list[int], source: str, include_grads: Optional[bool]) -> str:
    return json.dumps({
        # Whether the snapshot holds gradients (restore writes them too); absent in older files, where
        # it is guessed from the names as before.
        **({} if include_grads is None else {"include_grads": include_grads}),
        "checksum_algorithm": CHECKSUM_ALGORITHM,
        "checksum_source": source,
        "tensors": [{"name": t.name, "storage": t.storage, "offset": t.offset, "shape": list(t.shape),
                     "stride": list(t.stride), "dtype": _dtype_name(t.dtype)} for t in layout.tensors],
        "storages": [{"name": s.name, "nbytes": s.nbytes, "device": str(s.device), "checksum": f"{c:016x}"}
                     for s, c in zip(layout.storages, checksums)],
        "shard_info": layout.shard_info,  # rank / world size / shard sizes of FSDP or Megatron targets
    }, separators=(",", ":"))


def _fsync_path(path: str, directory: bool = False) -> None:
    descriptor = _Descriptor(path, os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if directory else 0))
    try:
        os.fsync(descriptor.fd)
    finally:
        descriptor.close()


def _remove_stale_temporaries(path: str) -> None:
    """Deletes temporaries of earlier saves to `path` whose writer is gone (killed in the middle).

    A writer holds an exclusive flock on its temporary from creation to rename, so a temporary whose lock
    can be taken has no writer, whatever PID namespace it ran in (a PID says nothing across containers).
    The age guard covers the instant between a writer creating its file and locking it.
    """
    directory, base = os.path.split(os.path.abspath(path))
    pattern = re.compile(re.escape(base) + _TEMPORARY)  # only names save() makes: never a user's own file
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for name in names:
        if pattern.fullmatch(name) is None:
            continue
        full = os.path.join(directory, name)
        try:
            descriptor = _Descriptor(full, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            continue
        fd = descriptor.fd
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or time.time() - st.st_mtime < _STALE_TEMPORARY_SECONDS:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # a writer holds it
            with contextlib.suppress(OSError):
                # Still the file we locked (not one that replaced it under the same name since)?
                if os.stat(full, follow_symlinks=False).st_ino == st.st_ino:
                    os.unlink(full)
                    logger.debug("removed %s, left by a save that did not finish", name)
        finally:
            descriptor.close()


def _check_destination(path: str) -> Optional[int]:
    """Refuses to replace anything but a regular file (a device node, FIFO, socket or directory); the
    permission bits of the file it replaces, None when there is none."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    if not stat.S_ISREG(st.st_mode):
        kind = ("a directory" if stat.S_ISDIR(st.st_mode) else "a FIFO" if stat.S_ISFIFO(st.st_mode)
                else "a device" if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode)
                else "a socket" if stat.S_ISSOCK(st.st_mode) else "not a regular file")
        raise OffloadError(f"cannot save to {path}: it is {kind}, not a regular file; "
                           "a snapshot only replaces a regular file (or creates one)")
    return stat.S_IMODE(st.st_mode)


def _header_bytes(layout: Layout, metadata: dict[str, str]) -> bytes:
    """The safetensors header: the length, then the JSON padded with spaces to a multiple of 8."""
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for i, spec in enumerate(layout.storages):
        header[_KEY.format(i)] = {"dtype": "U8", "shape": [spec.nbytes], "data_offsets": [offset, offset + spec.nbytes]}
        offset += spec.nbytes
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-(8 + len(text)) % 8)
    return len(text).to_bytes(8, "little") + text


def _write_all(fd: int, data: memoryview) -> None:
    while len(data):
        n = os.write(fd, data[:_IO_CHUNK])
        data = data[n:]


def save(snap: Snapshot, path: PathLike) -> None:
    """Writes a snapshot (its bytes and its layout) to a safetensors file at `path`, atomically.

    Waits for the snapshot's copy first. A snapshot taken with checksum=True is verified before anything is
    written (a corrupt host copy is never saved); otherwise checksums of the host copy are computed and
    stored, so that `load` can always check the data. The file appears under its name only when complete
    and synced: a crash or SIGKILL in the middle leaves the previous file at `path` intact, and no other
    file behind but the temporary, which a later save removes.

    Raises:
        OffloadError: the snapshot was freed, its host copy is corrupt, or `path` is something other than
            a regular file (a device, a FIFO, a directory), which is never replaced.
        OSError: the file cannot be written (permissions, disk full, no such directory); the previous file
            is then intact and the temporary removed.
        TypeError: `snap` is not a Snapshot (a module or a state dict: snapshot it first).
    """
    _require_snapshot(snap, "save")
    start = time.perf_counter()
    path = os.fspath(path)
    region = snap._use()  # a free() (and trim()) from another thread cannot take the memory while it is written
    try:
        _write(snap, region, path)
    finally:
        region.release()
    logger.debug("saved %d storages, %d bytes to %s in %.3f s", len(snap.layout.storages), snap.layout.nbytes,
                 path, time.perf_counter() - start)


def _require_snapshot(snap: Any, op: str) -> None:
    """A TypeError that says what to pass, for a model, a state dict or anything else given as the snapshot."""
    if not isinstance(snap, Snapshot):
        raise TypeError(f"gpu_offload.{op}() takes a Snapshot, not {type(snap).__qualname__}: "
                        f"gpu_offload.{op}(gpu_offload.snapshot(target), path)")


def _write(snap: Snapshot, region: Any, path: str) -> None:
    """save() once the region has a user of its own: checks, the temporary file, the rename."""
    snap.wait()
    layout = snap.layout
    checksums = snap.checksums
    if checksums is not None:
        _integrity.verify_host(layout, region.ptr, checksums)
        source = "source"
    else:
        checksums = _integrity.host_checksums(layout, region.ptr)
        source = "host copy"
    mode = _check_destination(path)
    text = _layout_json(layout, checksums, source, snap._include_grads)
    metadata = {"format": FORMAT, "format_version": str(FORMAT_VERSION), "package_version": __version__,
                "layout": text, "layout_sha256": hashlib.sha256(text.encode("utf-8")).hexdigest()}
    head = _header_bytes(layout, metadata)
    view = memoryview(region.buffer(owner=snap)).cast("B")
    try:
        _write_atomically(path, head, (view[spec.host_offset:spec.host_offset + spec.nbytes]
                                       for spec in layout.storages), layout.nbytes, mode)
    finally:
        view.release()


class _Progress:
    """Progress of a long save or load (_PROGRESS_MIN_BYTES and more: hundreds of MB take seconds) at INFO:
    a line at the start, one per tenth of the bytes (at most one per _PROGRESS_INTERVAL_S) and one at the
    end. Shorter ones log nothing here (their one DEBUG line comes from save and load)."""

    def __init__(self, verb: str, path: str, total: int) -> None:
        self.verb, self.path, self.total = verb, path, total
        self.done = 0
        self.start = self._last = time.perf_counter()
        self._next = total // 10
        self.on = total >= _PROGRESS_MIN_BYTES and logger.isEnabledFor(logging.INFO)
        if self.on:
            logger.info("%s %s: %s", verb, path, format_bytes(total))

    def advance(self, n: int) -> None:
        self.done += n
        if not self.on or self.done < self._next or self.done >= self.total:
            return
        now = time.perf_counter()
        if now - self._last >= _PROGRESS_INTERVAL_S:
            self._last = now
            self._next = self.done + self.total // 10
            logger.info("%s %s: %d%% (%s of %s, %s/s)", self.verb, self.path, 100 * self.done // self.total,
                        format_bytes(self.done), format_bytes(self.total),
                        format_bytes(int(self.done / max(now - self.start, 1e-9))))

    def finish(self, past: str) -> None:
        if self.on:
            seconds = time.perf_counter() - self.start
            logger.info("%s %s: %s in %.2f s (%s/s)", past, self.path, format_bytes(self.total), seconds,
                        format_bytes(int(self.total / max(seconds, 1e-9))))


def _write_atomically(path: str, head: bytes, pieces: Iterable[memoryview], total: int,
                      mode: Optional[int]) -> None:
    """Writes head and then every piece to a temporary file beside `path`, syncs it, renames it over `path`
    and syncs the directory: `path` is the previous file or the complete new one, never anything else. The
    file gets `mode` (that of the file it replaces) or, new, 0666 less the umask. An OSError names `path`
    (what the caller passed), not the temporary."""
    directory = os.path.dirname(os.path.abspath(path))
    _remove_stale_temporaries(path)
    temporary = f"{path}.tmp-{os.getpid()}-{next(_temporary_ids)}-{os.urandom(4).hex()}"
    progress = _Progress("saving", path, total)
    descriptor: Optional[_Descriptor] = None
    try:
        # Created inside the try that removes it: an interrupt right after the open leaves no temporary.
        # A new file gets 0666 less the umask, as open() would; a replaced one keeps its own mode (set
        # before any byte is written, on a temporary created private).
        try:
            descriptor = _Descriptor(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0),
                                     0o666 if mode is None else 0o600)
        except OSError as exc:
            missing = isinstance(exc, FileNotFoundError) and not os.path.isdir(directory)
            raise _named(exc, path, f"the directory {directory} does not exist" if missing else None) from None
        fd = descriptor.fd
        if mode is not None:
            os.fchmod(fd, mode)
        fcntl.flock(fd, fcntl.LOCK_EX)  # held until the rename: the file is live (see the sweep above)
        _write_all(fd, memoryview(head))
        for piece in pieces:
            _write_all(fd, piece)
            progress.advance(len(piece))
        os.fsync(fd)  # the bytes are on disk before the name points at them
        _check_destination(path)  # again: it may have become something else meanwhile
        os.replace(temporary, path)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        if isinstance(exc, OSError) and not isinstance(exc, OffloadError) and exc.filename != path:
            raise _named(exc, path) from None
        raise
    finally:
        if descriptor is not None:
            descriptor.close()
    _fsync_path(directory, directory=True)  # and so is the rename
    progress.finish("saved")


def _named(exc: OSError, path: str, why: Optional[str] = None) -> OSError:
    """The same kind of OSError (FileNotFoundError, PermissionError, ...) about `path` rather than about the
    temporary file the caller never named."""
    if exc.errno is None:
        return exc
    return type(exc)(exc.errno, f"cannot save to {path}: {why or exc.strerror}", path)


# -- state dicts -------------------------------------------------------------------------------------------
# torch dtype -> safetensors dtype code (those safetensors.torch reads)
_SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.int64: "I64",
    torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
    torch.complex64: "C64",
    **{getattr(torch, name): code for name, code in (
        ("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2"), ("float8_e4m3fnuz", "F8_E4M3FNUZ"),
        ("float8_e5m2fnuz", "F8_E5M2FNUZ"), ("uint16", "U16"), ("uint32", "U32"), ("uint64", "U64"))
       if hasattr(torch, name)},
}


def save_state_dict(snap: Snapshot, path: PathLike, metadata: Optional[dict[str, str]] = None) -> None:
    """Writes a snapshot as a plain safetensors state dict, atomically (as `save` does): each tensor under
    its name with its values, so that other tools load it without gpu_offload:

        model.load_state_dict(safetensors.torch.load_file(path))   # or safetensors.torch.load_model(model, path)
        AutoModelForCausalLM.from_pretrained(directory)            # a Hugging Face model's state dict, saved as
                                                                   # directory/model.safetensors with its config

    Names that alias an earlier tensor (the same storage, offset, shape, strides and dtype: a tied
    `lm_head.weight`) are written once, under the first name, and listed in the metadata as
    `{alias: kept name}`, the way `safetensors.torch.save_model` writes tied weights; load such a file with
    `safetensors.torch.load_model(model, path)`, or `load_state_dict(..., strict=False)`, which then reports
    only the aliases as missing (they are tied to the tensor that was loaded). Other views are written
    with their own values. Gradients (`include_grads=True`) are not written, nor, for a snapshot of an
    `nn.Module` that is still alive, the names its `state_dict()` leaves out (non-persistent buffers such
    as a rotary embedding's `inv_freq`). The metadata also has `"format": "pt"` (what Hugging Face's
    loaders check) and the `metadata` given.

    Use `save`/`load` to bring a snapshot back into gpu_offload (they keep the storages, views, checksums
    and layout); this file is for everything else (`from_pretrained`, vLLM, another framework).

    Raises:
        OffloadError: the snapshot was freed, is of a sharded module (FSDP/Megatron: this rank's flat
            shards are not a state dict), holds DTensor shards (use `dcp.save(snap.state_dict(), ...)`), a
            tensor's dtype has no safetensors code, or `path` is not a regular file.
        OSError: the file cannot be written; `path` is then as it was.
        TypeError: `snap` is not a Snapshot (a module or a state dict: snapshot it first).
    """
    _require_snapshot(snap, "save_state_dict")
    path = os.fspath(path)
    if snap._layout.shard_info is not None:
        raise OffloadError("save_state_dict: this snapshot is of a sharded module (FSDP/Megatron), whose tensors "
                           "are this rank's flat shards, not a state dict; snapshot model.state_dict() (with a "
                           "full state dict) or write a DCP checkpoint with dcp.save(snap.state_dict(), ...)")
    if snap._dtensor_specs:
        raise OffloadError("save_state_dict: this snapshot holds DTensor shards "
                           f"({_names_of(list(snap._dtensor_specs))}); a plain state dict would hold only this "
                           "rank's part: write a DCP checkpoint with dcp.save(snap.state_dict(), checkpoint_id=...)")
    layout = snap.layout
    grads = snap.include_grads
    # A module's snapshot holds its non-persistent buffers too (rotary inv_freq); its state_dict() does not.
    module = snap._source() if snap._source is not None else None
    wanted = set(module.state_dict(keep_vars=True)) if module is not None else None
    keep: list[str] = []
    aliases: dict[str, str] = {}
    first: dict[tuple[Any, ...], str] = {}
    for t in layout.tensors:
        if (grads and t.name.endswith(".grad")) or (wanted is not None and t.name not in wanted):
            continue
        if t.dtype not in _SAFETENSORS_DTYPES:
            raise OffloadError(f"save_state_dict: {t.name} is {t.dtype}, which safetensors cannot store")
        key = (t.storage, t.offset, t.shape, t.stride, t.dtype)
        if key in first:
            aliases[t.name] = first[key]
        else:
            first[key] = t.name
            keep.append(t.name)
    meta = {"format": "pt", **{k: str(v) for k, v in (metadata or {}).items()}}
    for alias, kept in aliases.items():
        meta.setdefault(alias, kept)  # as save_model does: the caller's own metadata is not overwritten
    mode = _check_destination(path)
    region = snap._use()
    try:
        tensors = snap.tensors()
        values = {name: tensors[name].contiguous() for name in keep}  # views of the arena unless strided
        del tensors
        header: dict[str, Any] = {"__metadata__": meta}
        offset = 0
        for name in keep:
            v = values[name]
            n = v.numel() * v.element_size()
            header[name] = {"dtype": _SAFETENSORS_DTYPES[v.dtype], "shape": list(v.shape),
                            "data_offsets": [offset, offset + n]}
            offset += n
        text = json.dumps(header, separators=(",", ":")).encode("utf-8")
        text += b" " * (-(8 + len(text)) % 8)

        def pieces() -> Iterable[memoryview]:
            for name in keep:
                v = values[name]
                if v.numel():
                    yield v.reshape(-1).view(torch.uint8).numpy().data  # a memoryview of the bytes

        start = time.perf_counter()
        _write_atomically(path, len(text).to_bytes(8, "little") + text, pieces(), offset, mode)
    finally:
        region.release()
    logger.debug("save_state_dict: %d tensors (%d aliases in the metadata), %d bytes to %s in %.3f s", len(keep),
                 len(aliases), offset, path, time.perf_counter() - start)


def _names_of(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


# -- load ----------------------------------------------------------------------------------------------
def _bad(path: str, problem: str) -> OffloadError:
    return OffloadError(f"cannot load {path}: {problem}")


def _json(text: Any) -> Any:
    """json.loads, with the failures of hostile input (nesting that exhausts the stack, integers of
    thousands of digits) turned into ValueError like any other bad JSON."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("nested too deeply") from None


def _read_header(f: Any, path: str, size: int) -> tuple[dict[str, Any], int]:
    """The safetensors header and where the data starts, after checking the file is as long as it says."""
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
    if len(raw) < n:
        raise _bad(path, f"truncated while being read: the header needs {n} bytes, {len(raw)} were read")
    try:
        header = _json(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
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
    # Everything here becomes a torch size, stride or offset (int64) or a byte count.
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum or value > _INT64_MAX:
        raise ValueError(f"{what} must be an integer from {minimum} to 2**63-1, got {value!r}")
    return value


def _list(value: Any, what: str) -> list[Any]:
    if not isinstance(value, list):
        raise ValueError(f"{what} is not a list")
    return value


def _parse_layout(text: Any) -> tuple[Layout, list[int], Optional[bool]]:
    """Layout, checksums and include_grads (None where the file does not say) from the metadata's JSON;
    host offsets laid out afresh as bind() does."""
    if not isinstance(text, str):
        raise ValueError("no layout")
    doc = _json(text)
    if not isinstance(doc, dict):
        raise ValueError("not a JSON object")
    if doc.get("checksum_algorithm") != CHECKSUM_ALGORITHM:
        raise ValueError(f"checksum algorithm {doc.get('checksum_algorithm')!r}, this version knows "
                         f"{CHECKSUM_ALGORITHM!r}")
    storages: list[StorageSpec] = []
    checksums: list[int] = []
    host = 0
    for i, s in enumerate(_list(doc["storages"], "storages")):
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
    for t in _list(doc["tensors"], "tensors"):
        name = t["name"]
        if not isinstance(name, str) or name in names:
            raise ValueError(f"tensor name {name!r} is not a string or appears twice")
        names.add(name)
        index = _int(t["storage"], f"{name}: storage")
        if index >= len(storages):
            raise ValueError(f"{name}: storage {index} does not exist ({len(storages)} storages)")
        shape = tuple(_int(d, f"{name}: shape") for d in _list(t["shape"], f"{name}: shape"))
        stride = tuple(_int(d, f"{name}: stride") for d in _list(t["stride"], f"{name}: stride"))
        if len(shape) != len(stride):
            raise ValueError(f"{name}: shape {shape} and stride {stride} differ in length")
        offset = _int(t["offset"], f"{name}: offset")
        dtype = _parse_dtype(t["dtype"])
        numel = 1
        for d in shape:
            numel *= d
        if numel * dtype.itemsize > _INT64_MAX:  # torch's numel and nbytes are int64 (a stride-0 view may be huge)
            raise ValueError(f"{name}: shape {shape} of {dtype} spans {numel * dtype.itemsize} bytes, more than a "
                             "tensor can describe (2**63-1)")
        spec = TensorSpec(name, index, offset, shape, stride, dtype)
        # The view must lie inside its storage, or Snapshot.tensors() would read past it.
        extent = tensor_extent_bytes(spec)
        if extent > storages[index].nbytes:
            raise ValueError(f"{name}: the view needs {extent} bytes, its storage has {storages[index].nbytes}")
        tensors.append(spec)
    shard_info = doc.get("shard_info")
    if shard_info is not None:
        if not isinstance(shard_info, str):
            raise ValueError("shard_info is not a string")
        _json(shard_info)  # must parse: restore compares it field by field
    include_grads = doc.get("include_grads")
    if include_grads is not None and not isinstance(include_grads, bool):
        raise ValueError(f"include_grads {include_grads!r} is not true or false")
    return Layout(tuple(tensors), tuple(storages), host, shard_info), checksums, include_grads


def _check_entries(path: str, header: dict[str, Any], layout: Layout, size: int, data_start: int) -> list[int]:
    """Every storage present once, as a uint8 vector of its size, the storages back to back without gaps or
    overlaps, the data section exactly filling the file. Returns each storage's place in the file.

    Checked before any memory is taken: a small crafted file cannot make load reserve more than it holds.
    """
    expected = {_KEY.format(i) for i in range(len(layout.storages))}
    keys = set(header) - {"__metadata__"}
    missing = sorted(expected - keys, key=lambda k: int(k.split(".")[1]))
    extra = sorted(keys - expected)
    if missing or extra:
        raise _bad(path, "tensors do not match the layout: "
                   + "; ".join(p for p in (f"missing {', '.join(missing[:5])}" if missing else "",
                                           f"unexpected {', '.join(map(repr, extra[:5]))}" if extra else "") if p))
    starts: list[int] = []
    for i, spec in enumerate(layout.storages):
        key = _KEY.format(i)
        entry = header[key]
        if not isinstance(entry, dict):
            raise _bad(path, f"{key}: corrupt header entry")
        offsets = entry.get("data_offsets")
        if (entry.get("dtype") != "U8" or entry.get("shape") != [spec.nbytes] or not isinstance(offsets, list)
                or len(offsets) != 2 or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
                or offsets[1] - offsets[0] != spec.nbytes or offsets[0] < 0):
            raise _bad(path, f"{key} ({spec.name}): the file holds {entry.get('dtype')} {entry.get('shape')} at "
                       f"{offsets}, the layout says {spec.nbytes} bytes (U8)")
        starts.append(offsets[0])
    end = 0
    for i in sorted(range(len(starts)), key=lambda i: (starts[i], layout.storages[i].nbytes)):
        if starts[i] != end:
            what = "overlaps the one before it" if starts[i] < end else f"leaves a gap of {starts[i] - end} bytes"
            raise _bad(path, f"corrupt header: {_KEY.format(i)} at {starts[i]} {what} in the data section "
                       "(each storage must have bytes of its own)")
        end += layout.storages[i].nbytes
    if data_start + end > size:
        raise _bad(path, f"truncated: the file has {size} bytes, its header describes {data_start + end}")
    if data_start + end < size:
        raise _bad(path, f"{size - data_start - end} unexpected bytes after the data (corrupt or appended to)")
    return starts


def _check_format(path: str, meta: Any) -> int:
    """The format and its version; for version 2, that the layout is the one written (its SHA-256)."""
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise _bad(path, f"not a gpu_offload snapshot: its metadata has no \"format\": \"{FORMAT}\" "
                   "(a safetensors file written by something else?)")
    text = meta.get("format_version")
    if text is None:
        raise _bad(path, "corrupt metadata: it has no format_version")
    if not isinstance(text, str) or not re.fullmatch(r"[0-9]{1,9}", text):
        raise _bad(path, f"format_version {text!r} is not a number")
    version = int(text)
    if version not in _READABLE_VERSIONS:
        newer = " (written by a newer gpu_offload; upgrade)" if version > FORMAT_VERSION else ""
        raise _bad(path, f"format version {version}, this gpu_offload ({__version__}) reads "
                   f"{', '.join(map(str, _READABLE_VERSIONS))}{newer}")
    if version >= 2:
        layout, digest = meta.get("layout"), meta.get("layout_sha256")
        if not isinstance(layout, str) or not isinstance(digest, str):
            raise _bad(path, "corrupt metadata: the layout or its checksum (layout_sha256) is missing")
        try:
            encoded = layout.encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate (an escaped \ud800 in the JSON): no text save() writes
            raise _bad(path, "corrupt layout: it is not valid text (a lone surrogate)") from None
        if hashlib.sha256(encoded).hexdigest() != digest:
            raise _bad(path, "corrupt layout: it does not match its checksum (layout_sha256); the offsets, "
                       "shapes or storages it describes cannot be trusted")
    return version


def load(path: PathLike, arena: Optional[Arena] = None) -> Snapshot:
    """Reads a snapshot written by `gpu_offload.save` into the arena, checks it, and returns it ready for
    `restore`.

    Everything is checked before the snapshot is returned: the safetensors header, the format and its
    version, the layout against its checksum, that the tensors are exactly the layout's storages with their
    sizes, back to back, that the file is neither truncated nor extended, and every storage's checksum (the
    header is checked before any arena memory is taken). Header and data are read through one open file, so
    a save replacing the file meanwhile does not mix two versions. Its `checksums` are those of the file.

    Raises:
        FileNotFoundError: there is no file at `path`.
        OffloadError: the file is truncated, corrupt, of a newer format, or not a gpu_offload snapshot
            (the message says which), or the arena cannot hold it. The arena is unchanged then (a slab
            pinned for it is given back).
    """
    start = time.perf_counter()
    path = os.fspath(path)
    # O_NONBLOCK: opening a FIFO must not wait for a writer (regular files ignore the flag).
    descriptor = _Descriptor(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))  # FileNotFoundError
    try:
        return _load(descriptor.fd, path, arena, start)
    finally:
        descriptor.close()


def _load(fd: int, path: str, arena: Optional[Arena], start: float) -> Snapshot:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise _bad(path, "not a regular file (a FIFO, a device or a directory?)")
    with open(fd, "rb", buffering=1 << 20, closefd=False) as f:
        size = st.st_size
        header, data_start = _read_header(f, path, size)
        meta = header.get("__metadata__")
        _check_format(path, meta)
        try:
            layout, checksums, include_grads = _parse_layout(meta.get("layout"))
        except (KeyError, TypeError, ValueError, AttributeError, RuntimeError) as exc:
            raise _bad(path, f"corrupt layout in the metadata ({type(exc).__name__}: {exc})") from None
        starts = _check_entries(path, header, layout, size, data_start)

        arena = arena if arena is not None else default_arena()
        slabs = arena._slabs_made()
        region = arena._allocate(layout.host_bytes, devices=layout.devices)  # where it will be restored
        try:
            progress = _Progress("loading", path, layout.nbytes)
            _read_into(f, path, layout, region, [data_start + s for s in starts], progress)
            _integrity.check(layout, checksums, _integrity.host_checksums(layout, region.ptr),
                             f"cannot load {path}: data corrupt")
            progress.finish("loaded and checked")
        except BaseException:
            region.release()
            with contextlib.suppress(Exception):  # the load's own error is the one to report
                # A slab pinned for this file is not kept for a file that was refused; the arena's other
                # empty slabs (reserve()) are.
                arena._trim_since(slabs)
            raise
    logger.debug("loaded %d storages, %d bytes from %s in %.3f s", len(layout.storages), layout.nbytes, path,
                 time.perf_counter() - start)
    return Snapshot(layout, region, [], _integrity.Checksums(list(checksums)), include_grads=include_grads)


def _read_into(f: Any, path: str, layout: Layout, region: Any, places: list[int],
               progress: _Progress) -> None:
    """Copies every storage's bytes from the open file into the region, in file order."""
    view = memoryview(region.buffer(owner=region)).cast("B")
    try:
        for i in sorted(range(len(places)), key=places.__getitem__):
            spec = layout.storages[i]
            if spec.nbytes == 0:
                continue
            if f.tell() != places[i]:
                f.seek(places[i])
            dst = view[spec.host_offset:spec.host_offset + spec.nbytes]
            while len(dst):
                n = f.readinto(dst[:_IO_CHUNK])
                if not n:
                    raise _bad(path, f"truncated while being read: {_KEY.format(i)} ({spec.name}) ends early")
                dst = dst[n:]
                progress.advance(n)
    finally:
        view.release()
