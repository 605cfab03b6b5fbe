"""A sharding map (Rich renderable, shared by the app and ``inspect --map``): one tensor's shape drawn as a grid of blocks, one per stored piece, coloured
and labelled by the rank that wrote it and its device-mesh coordinate; replicas (the same slice
stored by several ranks) are one block naming every rank. In the spirit of JAX's
``jax.debug.visualize_array_sharding`` and DTensor's ``visualize_sharding``
(torch/distributed/tensor/debug/_visualize_sharding.py), drawn with Rich from the layout alone
(no tensor data is read).

Dim 0 runs down, dim 1 across (a 1-D tensor is one row; dims after the second are not drawn,
and a cut along them is said so). Blocks are proportional to the slices' sizes, each at least
one character; cells no piece covers are drawn as ``·`` (a gap the merge would refuse)."""

from __future__ import annotations

import math

from rich.console import Console, ConsoleOptions, RenderResult
from rich.style import Style
from rich.text import Text

from shardscope.core import CheckpointLayout, TensorInfo

#: background colours, one per block (by the order of their first rank)
PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
           "#7f7f7f", "#bcbd22", "#17becf", "#393b79", "#637939", "#8c6d31", "#843c39",
           "#7b4173", "#3182bd"]

#: more bands than this along a dimension are not drawn (listed instead)
MAX_BANDS = 64


def _allocate(sizes: list[int], total: int) -> list[int]:
    """Character counts for bands of ``sizes`` elements: proportional, each at least 1, summing
    to ``max(total, len(sizes))`` (largest remainders get the spare characters)."""
    n = len(sizes)
    total = max(total, n)
    whole = sum(sizes) or 1
    spare = total - n
    exact = [s * spare / whole for s in sizes]
    counts = [1 + int(e) for e in exact]
    rest = total - sum(counts)
    for i in sorted(range(n), key=lambda i: exact[i] - int(exact[i]), reverse=True)[:rest]:
        counts[i] += 1
    return counts


def _bounds(starts_ends: list[tuple[int, int]], size: int) -> list[int]:
    return sorted({0, size, *(a for a, _ in starts_ends), *(b for _, b in starts_ends)})


class ShardingMap:
    """Rich renderable of ``tensor``'s pieces (``height``: lines of the grid, at most)."""

    def __init__(self, tensor: TensorInfo, layout: CheckpointLayout | None = None,
                 height: int = 8, legend: bool = True):
        self.tensor, self.layout, self.height, self.legend = tensor, layout, height, legend

    # the blocks: (row start, row end, col start, col end) -> the ranks/coords storing it
    def blocks(self) -> dict[tuple[int, int, int, int], list]:
        """The distinct stored slices (element ranges along dims 0 and 1, end exclusive), each
        with the pieces that store it (several: replicas)."""
        shape = tuple(self.tensor.shape)
        out: dict[tuple[int, int, int, int], list] = {}
        for p in sorted(self.tensor.pieces, key=lambda p: (p.global_offsets, p.rank or 0)):
            off = tuple(p.global_offsets) + (0, 0)
            shp = tuple(p.shape) + (1, 1)
            if len(shape) == 0:
                key = (0, 1, 0, 1)
            elif len(shape) == 1 or len(p.global_offsets) == 1:  # 1-D, or a flat partition
                key = (0, 1, off[0], off[0] + shp[0])
            else:
                key = (off[0], off[0] + shp[0], off[1], off[1] + shp[1])
            out.setdefault(key, []).append(p)
        return out

    def flat(self) -> bool:
        """True when the pieces are ranges of the flattened tensor (DeepSpeed ZeRO's flat
        partitions: 1-D offsets into a tensor of more dims), not rectangles."""
        return len(self.tensor.shape) > 1 and any(
            len(p.global_offsets) == 1 for p in self.tensor.pieces)

    def _flat_grid(self, rows_n: int, cols_n: int, width: int) -> RenderResult:
        """The tensor as ``rows x (elements per row)``, each character cell coloured by the
        piece holding the element at its centre; a piece's label starts at its first element."""
        blocks = self.blocks()
        order = self.order(blocks)
        ranges = [(k[2], k[3], i, blocks[k]) for i, k in enumerate(order)]
        lines = max(1, min(self.height, rows_n))
        cols = max(1, min(width, cols_n))

        def owner(flat: int):
            for a, b, i, pieces in ranges:
                if a <= flat < b:
                    return i, pieces
            return None

        starts = {}
        for a, b, i, pieces in ranges:  # the cell of each piece's first element
            starts[(a // cols_n * lines // rows_n, (a % cols_n) * cols // cols_n)] = \
                (i, self._label(pieces))
        for li in range(lines):
            row = min(rows_n - 1, int((li + 0.5) * rows_n / lines))
            text = Text(no_wrap=True, overflow="crop")
            cells = [owner(row * cols_n + min(cols_n - 1, int((j + 0.5) * cols_n / cols)))
                     for j in range(cols)]
            label, at = "", -1
            for j, cell in enumerate(cells):
                if (li, j) in starts and cell is not None:
                    label, at = starts[(li, j)][1], j
                ch = label[j - at] if label and 0 <= j - at < len(label) else " "
                if cell is None:
                    text.append("·", style="dim")
                else:
                    text.append(ch, style=Style(color="white", bold=True,
                                                bgcolor=PALETTE[cell[0] % len(PALETTE)]))
            yield text
        yield Text(f"flat partitions: ranges of the {rows_n * cols_n} elements in row-major "
                   "order", style="dim")

    def order(self, blocks) -> list[tuple[int, int, int, int]]:
        """The blocks in legend order (by first rank, then position); colour i is the i-th."""
        return sorted(blocks, key=lambda k: (min(p.rank or 0 for p in blocks[k]), k))

    def replicated_over(self) -> list[tuple[str, int]]:
        """Mesh dims (name, size) the tensor is replicated over, from a DTensor placement such
        as ``(Replicate(), Shard(0))`` (one placement per mesh dim): every block drawn is also
        held by the ranks that differ only in those coordinates."""
        import re

        lay = self.layout
        if lay is None or not lay.mesh_shape:
            return []
        kinds = re.findall(r"(\w+)\(", self.tensor.placement or "")
        if len(kinds) != len(lay.mesh_shape):
            return []
        names = lay.mesh_dim_names or tuple(f"dim{i}" for i in range(len(kinds)))
        return [(n, size) for n, size, k in zip(names, lay.mesh_shape, kinds)
                if k == "Replicate" and size > 1]

    def _label(self, pieces) -> str:
        ranks = [p.rank for p in pieces if p.rank is not None]
        if not ranks:
            return "file" if len(pieces) == 1 else f"{len(pieces)} copies"
        text = ",".join(f"r{r}" for r in ranks) if len(ranks) <= 4 else \
            f"r{ranks[0]}..r{ranks[-1]} ({len(ranks)})"
        coord = pieces[0].coord
        if len(pieces) == 1 and coord:
            text += " (" + ",".join(str(c) for c in coord) + ")"
        return text

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        t = self.tensor
        shape = tuple(t.shape)
        rows_n = shape[0] if len(shape) >= 2 else 1
        cols_n = shape[1] if len(shape) >= 2 else (shape[0] if shape else 1)
        blocks = self.blocks()
        width = max(8, options.max_width)
        yield Text.assemble((f"{t.name} ", "bold"), f"{list(shape)} {t.dtype} {t.placement}",
                            overflow="fold")
        if not t.pieces:
            yield Text("no stored piece of this tensor was found (see the problems)",
                       style="red")
            return
        if self.flat():
            yield from self._flat_grid(rows_n, cols_n * math.prod(shape[2:]), width)
            if self.legend:
                yield from self._legend(blocks)
            return
        rb = _bounds([(k[0], k[1]) for k in blocks], rows_n)
        cb = _bounds([(k[2], k[3]) for k in blocks], cols_n)
        if len(rb) - 1 > MAX_BANDS or len(cb) - 1 > MAX_BANDS or len(cb) - 1 > width:
            yield Text(f"{len(blocks)} stored slices: too many to draw at this size")
        else:
            yield from self._grid(blocks, rb, cb, width)
        if len(shape) > 2:
            deep = any(any(p.global_offsets[2:]) or tuple(p.shape[2:]) != shape[2:]
                       for p in t.pieces)
            yield Text(f"dims 2+ ({list(shape[2:])}) not drawn"
                       + ("; pieces are cut along them too" if deep else ""), style="dim")
        if self.legend:
            yield from self._legend(blocks)

    def _grid(self, blocks, rb, cb, width) -> RenderResult:
        rsizes = [b - a for a, b in zip(rb, rb[1:])]
        csizes = [b - a for a, b in zip(cb, cb[1:])]
        rlines = _allocate(rsizes, min(self.height, max(len(rsizes), self.height)))
        if len(self.tensor.shape) < 2:
            rlines = [1] * len(rsizes)
        ccols = _allocate(csizes, width)
        # the block covering each band pair (first one wins when slices overlap)
        colour = {key: i for i, key in enumerate(self.order(blocks))}

        def block_at(r0, c0):
            for k in blocks:
                if k[0] <= r0 < k[1] and k[2] <= c0 < k[3]:
                    return k
            return None

        grid = [[block_at(r, c) for c in cb[:-1]] for r in rb[:-1]]
        # where each block's label goes: its top-left band, centred over the block's width
        for bi, (r, nl) in enumerate(zip(rb[:-1], rlines)):
            for line in range(nl):
                text = Text(no_wrap=True, overflow="crop")
                ci = 0
                while ci < len(ccols):
                    k = grid[bi][ci]
                    span = ci
                    while span + 1 < len(ccols) and grid[bi][span + 1] == k:
                        span += 1
                    w = sum(ccols[ci:span + 1])
                    if k is None:
                        text.append("·" * w, style="dim")
                    else:
                        first_band = rb.index(k[0])
                        lines_in_block = sum(rlines[rb.index(k[0]):rb.index(k[1])])
                        line_in_block = sum(rlines[first_band:bi]) + line
                        label = self._label(blocks[k]) if line_in_block == \
                            (lines_in_block - 1) // 2 else ""
                        label = label[:w]
                        bg = PALETTE[colour[k] % len(PALETTE)]
                        text.append(label.center(w), style=Style(color="white", bold=True,
                                                                 bgcolor=bg))
                    ci = span + 1
                yield text

    def _legend(self, blocks) -> RenderResult:
        names = self.layout.mesh_dim_names if self.layout is not None else None
        two_d = len(self.tensor.shape) >= 2
        for i, key in enumerate(self.order(blocks)):
            if i == 8:
                yield Text(f"… {len(blocks) - 8} more blocks", style="dim")
                break
            pieces = blocks[key]
            p = pieces[0]
            where = (f"rows {key[0]}:{key[1]}, cols {key[2]}:{key[3]}" if two_d
                     and not self.flat() else f"elements {key[2]}:{key[3]}")
            who = self._label(pieces)
            if p.coord and names and len(pieces) == 1 and p.rank is not None:
                who = f"r{p.rank} (" + ", ".join(f"{n}={c}" for n, c in zip(names, p.coord)) + ")"
            if len(pieces) > 1:
                who += " (replicas: the same slice stored by each)"
            yield Text.assemble(("■ ", PALETTE[i % len(PALETTE)]), who, f": {where}",
                                no_wrap=True, overflow="ellipsis")
        for name, size in self.replicated_over():
            yield Text(f"replicated over {name} ({size}): each block is also held by the "
                       f"{size - 1} other {name} rank(s); the merge reads one copy", style="dim")
