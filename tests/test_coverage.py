"""``coverage_problems`` (core/layout.py): its fast path for row splits and its memo give the
verdict an element-by-element count gives, and a changed piece list is checked again."""

from __future__ import annotations

import random
from dataclasses import replace

import numpy as np

from shardscope.core import detect
from shardscope.core.layout import Piece, TensorInfo, coverage_problems


def _piece(offs, shape, file="f") -> Piece:
    return Piece(file=file, byte_offset=0, dtype="F32", shape=tuple(shape),
                 stride=(1,) * len(shape), global_offsets=tuple(offs))


def _oracle(shape, pieces) -> str | None:
    """The first kind of problem an element-by-element count finds."""
    for offs, ps in pieces:
        if len(ps) != len(shape) or any(o < 0 or o + s > g for o, s, g in
                                        zip(offs, ps, shape)):
            return "piece-out-of-bounds"
    count = np.zeros(shape, dtype=int)
    for offs, ps in pieces:
        count[tuple(slice(o, o + s) for o, s in zip(offs, ps))] += 1
    if (count > 1).any():
        return "coverage-overlap"
    if (count == 0).any():
        return "coverage-gap"
    return None


def test_agrees_with_an_element_count():
    rng = random.Random(7)
    for _ in range(3000):
        nd = rng.choice([1, 2, 2, 3])
        shape = [rng.randint(1, 5) for _ in range(nd)]
        pieces = []
        rows = rng.random() < 0.6
        for _ in range(rng.randint(1, 5)):
            if rows:  # row splits: the fast path
                o = rng.randint(-1, shape[0])
                pieces.append(([o] + [0] * (nd - 1),
                               [rng.randint(0, shape[0] - max(o, 0) + 1)] + shape[1:]))
            else:
                pieces.append(([rng.randint(-1, g) for g in shape],
                               [rng.randint(0, g + 1) for g in shape]))
        t = TensorInfo("x", tuple(shape), "F32", "p", [_piece(o, s) for o, s in pieces])
        got = coverage_problems(t)
        assert (got[0].code if got else None) == _oracle(shape, pieces), (shape, pieces)


def test_a_changed_piece_list_is_checked_again(fixtures_root):
    layout = detect(fixtures_root / "w4-fsdp2")
    t = next(t for t in layout.tensors.values() if len(t.pieces) > 1 and t.shape[0] > 1)
    assert coverage_problems(t) == [] and coverage_problems(t) == []
    t.pieces.append(t.pieces[0])  # the same rows twice
    assert [p.code for p in coverage_problems(t)] == ["coverage-overlap"]
    t.pieces.pop()
    assert coverage_problems(t) == []
    first = t.pieces[0]
    t.pieces[0] = replace(first, global_offsets=(t.shape[0],) + first.global_offsets[1:])
    assert [p.code for p in coverage_problems(t)] == ["piece-out-of-bounds"]
    t.pieces[0] = first
    t.shape = (t.shape[0] + 1,) + tuple(t.shape[1:])  # a row no piece holds
    assert [p.code for p in coverage_problems(t)] == ["coverage-gap"]
    problems = coverage_problems(t)
    problems[0].severity = "warning"  # a caller's edit does not reach the next caller
    assert coverage_problems(t)[0].severity != "warning"
