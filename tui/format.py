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
