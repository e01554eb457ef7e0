"""Short human-readable renderings of durations and byte counts, for log lines and reports."""

from __future__ import annotations

__all__ = ["format_duration", "format_bytes"]


def format_duration(seconds: float, *, clock: bool = False) -> str:
    """``seconds`` for a person to read.

    Two styles, each kept where it has always been printed:

    * default: one unit chosen by size, ``"42.0 s"`` below two minutes,
      ``"12.5 min"`` below two hours, ``"3.25 h"`` above (``adaptive report``);
    * ``clock=True``: ``"H:MM:SS"``, whole seconds, negative values as
      ``"0:00:00"`` (the data loader's epoch ETA).
    """
    if clock:
        whole = int(max(seconds, 0))
        return f"{whole // 3600}:{whole % 3600 // 60:02d}:{whole % 60:02d}"
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.2f} h"


def format_bytes(count: float) -> str:
    """A byte count in B, KiB, MiB or GiB (``"512 B"``, ``"1.5 KiB"``, ``"3.0 GiB"``)."""
    if count < 1024:
        return f"{int(count)} B"
    for unit in ("KiB", "MiB", "GiB"):
        count /= 1024
        if count < 1024 or unit == "GiB":
            break
    return f"{count:.1f} {unit}"
