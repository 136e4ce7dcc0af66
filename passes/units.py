"""Bytes as people write them: ``"512MiB"`` read into a number, a number written as ``"3.5 MiB"``.

One reader and one writer for the whole project (planner messages, reports, the command
line, benchmark tables), so a size means the same everywhere. Torch-free like all of
:mod:`passes`.
"""

from __future__ import annotations

import re

BINARY_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")
SIZE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
              "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"(\d+(?:\.\d+)?)([kmgt]i?b|b)?")


def parse_size(text: str) -> int | None:
    """Bytes of a size such as ``"512MiB"``, ``"1.5 GB"`` or ``"100"`` (case and spaces
    ignored), or ``None`` when ``text`` is not one.

    >>> parse_size("2KiB"), parse_size("1.5kb"), parse_size("lots")
    (2048, 1500, None)
    """
    match = _SIZE.fullmatch(text.strip().lower().replace(" ", ""))
    if match is None:
        return None
    return int(float(match.group(1)) * SIZE_UNITS[match.group(2) or ""])


def unit_of(nbytes: float) -> str:
    """The largest of :data:`BINARY_UNITS` that keeps ``nbytes`` below 1024 of it: the unit
    :func:`format_bytes` writes ``nbytes`` in, and the one a message whose sizes are compared
    with it (a budget against eager's peak) writes them all in.

    >>> unit_of(512), unit_of(32768), unit_of(3.5 * 2**30)
    ('B', 'KiB', 'GiB')
    """
    value = abs(float(nbytes))
    for name in BINARY_UNITS[:-1]:
        if value < 1024:
            return name
        value /= 1024
    return BINARY_UNITS[-1]


def format_bytes(nbytes: float, unit: str | None = None) -> str:
    """``nbytes`` for a person to read, in binary units.

    Without ``unit``: the largest unit that keeps the number below 1024, three significant
    figures (``"512 B"``, ``"32 KiB"``, ``"3.5 MiB"``), for tables and reports. With a
    ``unit`` of :data:`BINARY_UNITS`: two decimals in that unit (``"13.60 MiB"``), for
    messages and columns whose numbers are compared with each other.

    >>> format_bytes(32768), format_bytes(3.5 * 2**20), format_bytes(3.5 * 2**20, "MiB")
    ('32 KiB', '3.5 MiB', '3.50 MiB')
    """
    if unit is not None:
        return f"{nbytes / 1024 ** BINARY_UNITS.index(unit):.2f} {unit}"
    name = unit_of(nbytes)
    value = nbytes / 1024 ** BINARY_UNITS.index(name)
    return f"{value:.0f} {name}" if name == "B" else f"{value:.3g} {name}"
