"""Byte counts as people write them: 8589934592, 1e9, 8GiB, 512 MiB, 2GB, 8g."""

from __future__ import annotations

import math
import re

from ._errors import OffloadError

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 10**3, "kib": 1 << 10, "m": 1 << 20, "mb": 10**6, "mib": 1 << 20,
          "g": 1 << 30, "gb": 10**9, "gib": 1 << 30, "t": 1 << 40, "tb": 10**12, "tib": 1 << 40}
MAX_BYTES = (1 << 63) - 1  # what the core's size_t arithmetic and torch's int64 sizes can hold
_PATTERN = re.compile(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*", re.IGNORECASE)


def parse_bytes(text: str, what: str = "value") -> int:
    """Bytes from a number with an optional unit: KB/MB/GB/TB are powers of 1000, KiB/MiB/GiB/TiB and the
    bare K/M/G/T (as in `ulimit` or docker) powers of 1024. Raises OffloadError naming `what` otherwise."""
    finite_message = f"{what}={text!r} is not a finite number of bytes up to 2**63-1"
    try:
        if not math.isfinite(float(text)):  # inf, nan: a number, but no byte count
            raise OffloadError(finite_message)
    except ValueError:
        pass  # units or garbage: the pattern below decides
    match = _PATTERN.fullmatch(text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise OffloadError(f"{what}={text!r} is not a number of bytes (e.g. 8589934592, 8GiB, 512MiB, 2GB)")
    number = match.group(1)
    # Plain digits stay exact integers; a float form (1e9, 1.5GiB) goes through float.
    value: float = int(number) * _UNITS[unit] if number.isdigit() else float(number) * _UNITS[unit]
    if not math.isfinite(value) or value > MAX_BYTES:
        raise OffloadError(finite_message)
    return int(value)


def format_bytes(n: int) -> str:
    """A byte count for people, in powers of 1024 with three significant digits: 512 B, 1.2 KiB, 256 MiB,
    3.31 GiB (units that parse_bytes reads back)."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            break
        value /= 1024
    if unit == "B":
        return f"{int(n)} B"
    return f"{value:.3g} {unit}" if value < 1000 else f"{value:.0f} {unit}"
