"""Rich rendering of a layout for ``shardscope inspect``."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from core import CheckpointLayout
from tui.format import human_bytes as _human


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
