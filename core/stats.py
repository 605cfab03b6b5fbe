"""Statistics of one tensor of a (sharded) checkpoint, read from its pieces."""

from __future__ import annotations

from dataclasses import dataclass, field

HIST_BINS = 16


@dataclass
class TensorStats:
    """Summary of a tensor's values: ``min``/``max``/``mean``/``std`` over finite values
    (None when there are none), counts of ``nan``/``inf`` elements, ``zeros`` share in [0, 1],
    and ``histogram``: counts of finite values in ``HIST_BINS`` equal bins over [min, max]."""

    name: str
    numel: int
    min: float | None
    max: float | None
    mean: float | None
    std: float | None
    nan: int
    inf: int
    zeros: float
    histogram: list[int] = field(default_factory=list)


def tensor_stats(layout, name: str) -> TensorStats:
    """Read tensor ``name`` of ``layout`` (one tensor in memory, in float64 for the sums) and
    summarise it. Raises KeyError for an unknown name, BadCheckpointError for unreadable data."""
    import torch

    from .verify import read_tensor

    x = read_tensor(layout, name).reshape(-1)
    if x.dtype == torch.bool:
        x = x.to(torch.uint8)
    x = x.double()
    n = x.numel()
    nan = int(torch.isnan(x).sum())
    inf = int(torch.isinf(x).sum())
    finite = x[torch.isfinite(x)]
    zeros = float((x == 0).sum()) / n if n else 0.0
    if finite.numel() == 0:
        return TensorStats(name, n, None, None, None, None, nan, inf, zeros, [])
    lo, hi = float(finite.min()), float(finite.max())
    hist = torch.histc(finite, bins=HIST_BINS, min=lo, max=hi if hi > lo else lo + 1)
    std = float(finite.std()) if finite.numel() > 1 else 0.0
    return TensorStats(name, n, lo, hi, float(finite.mean()), std, nan, inf, zeros,
                       [int(c) for c in hist.tolist()])
