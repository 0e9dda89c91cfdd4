"""Byte counts as people write them: 8589934592, 1e9, 8GiB, 512 MiB, 2GB, 8g."""

from __future__ import annotations

import re

from ._errors import OffloadError

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 10**3, "kib": 1 << 10, "m": 1 << 20, "mb": 10**6, "mib": 1 << 20,
          "g": 1 << 30, "gb": 10**9, "gib": 1 << 30, "t": 1 << 40, "tb": 10**12, "tib": 1 << 40}
_PATTERN = re.compile(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*", re.IGNORECASE)


def parse_bytes(text: str, what: str = "value") -> int:
    """Bytes from a number with an optional unit: KB/MB/GB/TB are powers of 1000, KiB/MiB/GiB/TiB and the
    bare K/M/G/T (as in `ulimit` or docker) powers of 1024. Raises OffloadError naming `what` otherwise."""
    match = _PATTERN.fullmatch(text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise OffloadError(f"{what}={text!r} is not a number of bytes (e.g. 8589934592, 8GiB, 512MiB, 2GB)")
    return int(float(match.group(1)) * _UNITS[unit])
