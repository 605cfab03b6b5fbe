"""The numpy casts give torch's bits exactly."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shardscope.core.cast import cast_bytes
from shardscope.core.dtypes import torch_dtype

SPECIAL = [0.0, -0.0, 1.0, -1.0, 1e-45, -1e-45, 1e-40, 3.4e38, -3.4e38, 65504.0, 65520.0,
           70000.0, 6e-8, 1e-8, float("inf"), float("-inf"), float("nan"), -float("nan"),
           1.00390625, 1.01171875, 3.140625, 2 ** -126, 2 ** -133]


def values(src: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.tensor(SPECIAL), torch.randn(20000, generator=g) * 100,
                   torch.randn(2000, generator=g) * 1e-6,
                   torch.randint(-2**31, 2**31 - 1, (5000,), generator=g, dtype=torch.int32)
                   .view(torch.float32)])
    return x.to(torch_dtype(src))


@pytest.mark.parametrize("dst", ["F32", "F16", "BF16"])
@pytest.mark.parametrize("src", ["F32", "F16", "BF16"])
def test_cast_matches_torch(src, dst):
    """Every non-NaN value gets torch's exact bits; NaN stays NaN (torch's own NaN bits
    depend on whether its vectorised loop or scalar tail converted the element)."""
    x = values(src)
    want = x.to(torch_dtype(dst))
    got = torch.from_numpy(cast_bytes(x.view(torch.uint8).numpy().tobytes(), src, dst)
                           .view(np.uint8).copy()).view(torch_dtype(dst))
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan)
    assert torch.equal(got[~nan].view(torch.uint8) if got.element_size() == 1 else
                       got[~nan].contiguous().view(torch.uint8),
                       want[~nan].contiguous().view(torch.uint8))


@pytest.mark.parametrize("dst", ["F32", "F16", "BF16"])
@pytest.mark.parametrize("src", ["F32", "F16", "BF16"])
def test_cast_in_chunks_matches_torch(src, dst, monkeypatch):
    """Chunk boundaries and a short last chunk: the casts work CHUNK elements at a time
    (made small here); ties, NaNs and denormals fall on both sides of every boundary."""
    from shardscope.core import cast

    monkeypatch.setattr(cast, "CHUNK", 999)
    g = torch.Generator().manual_seed(1)
    hi = torch.randint(0, 1 << 16, (4000,), generator=g, dtype=torch.int32)
    ties = ((hi << 16) | 0x8000).view(torch.float32)  # exactly halfway between two BF16s
    ties16 = (torch.randint(-2**20, 2**20, (3000,), generator=g).float() * 2 ** -10)
    x = torch.cat([values("F32"), ties, ties16, torch.full((7,), float("nan"))])
    x = x[torch.randperm(len(x), generator=g)].to(torch_dtype(src))
    want = x.to(torch_dtype(dst))
    got = torch.from_numpy(cast_bytes(x.view(torch.uint8).numpy().tobytes(), src, dst)
                           .view(np.uint8).copy()).view(torch_dtype(dst))
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan)
    assert torch.equal(got[~nan].contiguous().view(torch.uint8),
                       want[~nan].contiguous().view(torch.uint8))
