"""Byte counts as people write them: 8589934592, 1e9, 8GiB, 512 MiB, 2GB, 8g."""

from __future__ import annotations

import decimal
import math
import re

from ._errors import OffloadError

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 10**3, "kib": 1 << 10, "m": 1 << 20, "mb": 10**6, "mib": 1 << 20,
          "g": 1 << 30, "gb": 10**9, "gib": 1 << 30, "t": 1 << 40, "tb": 10**12, "tib": 1 << 40}
MAX_BYTES = (1 << 63) - 1  # what the core's size_t arithmetic and torch's int64 sizes can hold
_PATTERN = re.compile(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*", re.IGNORECASE)
_FRACTION = re.compile(r"\s*([0-9]*\.[0-9]+)\s*")


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
    # Exact decimal arithmetic (1.5GiB, 1.3GB, 8e9 are whole numbers of bytes); a fraction of a byte (0.5,
    # 1.5) is refused, not rounded to 0 or 1.
    try:
        exact = decimal.Decimal(number) * _UNITS[unit]
        whole = exact == exact.to_integral_value()
    except decimal.DecimalException:  # an exponent past what decimal holds: no byte count either
        raise OffloadError(finite_message) from None
    if exact > MAX_BYTES:
        raise OffloadError(finite_message)
    if not whole:
        raise OffloadError(f"{what}={text!r} is not a whole number of bytes ({exact.normalize():f} bytes); give bytes "
                           "as an integer or with a unit (e.g. 8GiB, 1.5GiB)")
    value = int(exact)
    if not math.isfinite(value) or value > MAX_BYTES:
        raise OffloadError(finite_message)
    return int(value)


def parse_bytes_or_fraction(text: str, what: str, total: int) -> int:
    """A positive byte count as parse_bytes reads it, or a fraction of `total` written with a decimal point
    and no unit (0.8, .5, 1.0). Raises OffloadError naming `what` otherwise."""
    match = _FRACTION.fullmatch(text)
    if match:
        fraction = float(match.group(1))
        if not 0 < fraction <= 1:
            raise OffloadError(f"{what}={text!r}: a fraction (a number with a decimal point and no unit) must be "
                               "above 0 and at most 1; give bytes with a unit (8GiB) or as an integer")
        if total <= 0:
            raise OffloadError(f"{what}={text!r} is a fraction of the host's memory, which is unknown here; "
                               "give bytes (e.g. 200GiB)")
        return max(1, int(fraction * total))
    value = parse_bytes(text, what)
    if value <= 0:
        raise OffloadError(f"{what}={text!r}: must be positive (unset it for no limit)")
    return value


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
