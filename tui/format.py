"""Human units for the app and the command line."""

from __future__ import annotations


def human_bytes(n: float) -> str:
    """``1234567`` -> ``1.2 MB`` (decimal units, as huggingface_hub)."""
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return str(n)


def human_count(n: int) -> str:
    """``135104`` -> ``135.1K`` elements."""
    for unit, div in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:.1f}{unit}"
    return str(n)


def short_path(path: str, base: str | None = None, parts: int = 2) -> str:
    """A file as the user knows it: its last ``parts`` path components below the checkpoint
    folder ``base`` (``mp_rank_01_001/model_optim_rng.pt``, ``model_world_size_2_rank_0.pt``),
    so files with the same name in different rank folders stay apart."""
    import os

    if base:
        rel = os.path.relpath(path, base)
        if not rel.startswith(".."):
            path = rel
    return os.path.join(*path.split(os.sep)[-parts:]) if os.sep in path else path
