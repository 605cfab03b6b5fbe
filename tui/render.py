"""Rich rendering of a layout for ``shardscope inspect``."""

from __future__ import annotations

import math

from rich.console import Console
from rich.table import Table
from rich.text import Text

from shardscope.core import CheckpointLayout
from shardscope.tui.format import human_bytes as _human


def config_text(layout: CheckpointLayout) -> str:
    """Where the merge's config.json comes from."""
    if layout.config_dir:
        return layout.config_dir
    if layout.derived_config:
        return "none found: derived from the checkpoint's args (or pass --hf-config DIR)"
    return "none (merge with --hf-config DIR)"


def render_layout(layout: CheckpointLayout, console: Console, params: bool = False) -> None:
    """Print the summary, shard files, problems and notes (and every tensor with ``params``)."""
    d = layout.to_dict()
    mesh = layout.mesh_text
    if layout.mesh_shape and layout.mesh_dim_names is None:
        mesh += " (unnamed)"
    par = ", ".join(f"{k}={v}" for k, v in d["parallel"].items() if v > 1) or "none"
    s = Table.grid(padding=(0, 2))
    s.add_column(style="bold")
    s.add_column()
    s.add_row("format", layout.format)
    s.add_row("path", layout.path)
    s.add_row("world size", str(layout.world_size))
    s.add_row("device mesh", mesh)
    s.add_row("parallelism", par)
    s.add_row("tensors", str(len(layout.tensors)))
    s.add_row("parameters", f"{layout.parameters:,}")
    s.add_row("bytes", f"{_human(layout.bytes)} ({layout.bytes:,})")
    s.add_row("dtypes", ", ".join(f"{k} x{v}" for k, v in layout.dtypes.items()))
    s.add_row("config", config_text(layout))
    if layout.lora is not None:
        s.add_row("LoRA", layout.lora.summary())
    for label, text in layout.details.items():
        s.add_row(label, text)
    console.print(s)
    t = Table("rank", "file", "size", "status", title="shard files", title_justify="left")
    for f in layout.files:
        style = "" if f.status == "ok" else "red"
        t.add_row("" if f.rank is None else str(f.rank), f.path, _human(f.bytes), f.status,
                  style=style)
    console.print(t)
    if params:
        sources = any(t.source for t in layout.tensors.values())
        pt = Table("tensor", *(("from",) if sources else ()), "shape", "dtype", "placement",
                   "pieces", title="parameters", title_justify="left")
        for ten in layout.tensors.values():
            pt.add_row(ten.name, *((ten.source or "",) if sources else ()),
                       str(list(ten.shape)), ten.dtype, ten.placement, str(len(ten.pieces)))
        console.print(pt)
    for n in layout.notes:
        console.print(f"[dim]note:[/] {n}", highlight=False)
    if layout.problems:
        console.print(f"[bold red]{len(layout.problems)} problem(s)[/]")
        for p in layout.problems:
            color = "red" if p.severity == "error" else "yellow"
            console.print(f"  [{color}]{p.code}[/] {p.path or ''}: {p.message}", highlight=False)
    else:
        console.print("[green]no problems found[/]")


def _g(x) -> str:
    """A statistic for a table cell (``-`` when not computed)."""
    if x is None:
        return "-"
    return f"{x:.4g}"


def render_diff(result, console: Console, top: int = 10, every: bool = False) -> None:
    """Print a :class:`core.diff.DiffResult`: the two sides, counts per status, the tensors
    that differ in kind (shape, dtype, one side only), the largest changes, changes by layer
    (with a bar of relative change), and a one-line verdict."""
    console.print(f"A: {result.a} ({result.format_a})\nB: {result.b} ({result.format_b})",
                  highlight=False)
    counts = result.counts()
    total = len(result.tensors)
    console.print(", ".join(f"{n} {s.replace('_', ' ')}" for s, n in counts.items() if n)
                  + f" (of {total} tensors)", highlight=False)
    odd = [t for t in result.tensors if t.status in ("shape", "dtype", "only_a", "only_b")]
    if odd:
        tab = Table(title="tensors that differ in kind")
        tab.add_column("tensor", no_wrap=True, min_width=max(len(t.name) for t in odd))
        for c in ("difference", "A", "B"):
            tab.add_column(c)
        for t in odd:
            a = f"{t.dtype_a} {list(t.shape_a)}" if t.shape_a is not None else "-"
            b = f"{t.dtype_b} {list(t.shape_b)}" if t.shape_b is not None else "-"
            tab.add_row(t.name, t.status.replace("_", " "), a, b)
        console.print(tab)
    rows = result.tensors if every else result.largest(top)
    if rows:
        tab = Table(title="every tensor" if every else "largest changes")
        tab.add_column("tensor", no_wrap=True, min_width=max(len(t.name) for t in rows))
        # a NaN/Inf column when one appeared or went (the sizes are nan then, not 0)
        nonfinite = any(t.nonfinite for t in rows)
        for c in ("status", "max |B-A|", "||B-A||/||A||", "cosine", "differ") + (
                ("NaN/Inf",) if nonfinite else ()):
            tab.add_column(c, no_wrap=True, justify="left" if c == "status" else "right")
        for t in rows:
            n = 1
            for s in (t.shape_a or ()):
                n *= s
            tab.add_row(t.name, t.status, _g(t.max_abs), _g(t.rel_change), _g(t.cosine),
                        "-" if t.differing is None else f"{t.differing}/{n}",
                        *((Text(t.nonfinite or "-", style="red" if t.nonfinite else ""),)
                          if nonfinite else ()))
        console.print(tab)
    layers = result.by_layer()
    if not result.same and len(layers) > 1:
        peak = max((lc.rel_change for lc in layers if lc.rel_change is not None
                    and lc.rel_change == lc.rel_change and lc.rel_change != float("inf")),
                   default=0.0)
        tab = Table("layer", "tensors", "changed", "||B-A||/||A||", "", title="change by layer")
        for lc in layers:
            r = lc.rel_change
            if lc.nonfinite:  # NaN/Inf appeared or went: said, never a 0 or no bar
                tab.add_row(lc.layer, str(lc.tensors), str(lc.changed), _g(r),
                            Text(f"NaN/Inf in {lc.nonfinite} tensor(s)", style="red"))
                continue
            bar = ("#" * max(1, round(20 * r / peak)) if r and peak and math.isfinite(r)
                   else "")
            tab.add_row(lc.layer, str(lc.tensors), str(lc.changed), _g(r), bar)
        console.print(tab)
    if result.same:
        word, rest = result.same_text().split(" ", 1)
        console.print(f"[green]{word}[/] {rest}", highlight=False)
    else:
        gained = [t for t in result.tensors if t.nonfinite]
        console.print(f"[red]different[/]: {total - counts['identical'] - counts['close']} of "
                      f"{total} tensors differ"
                      + (f", {len(gained)} of them in NaN/Inf" if gained else ""),
                      highlight=False)
