"""The layout summary: format, world size, device mesh, parallel degrees, counts, dtypes."""

from __future__ import annotations

from rich.markup import escape
from textual.widgets import Static

from shardscope.core import CheckpointLayout
from shardscope.tui.format import human_bytes, human_count


def summary_text(layout: CheckpointLayout, check=None) -> str:
    """Rich markup describing ``layout`` (one fact per line, labels aligned); with ``check``
    (a :class:`core.judge.Verdict`), its one-line result last (green: matches, red: does not,
    yellow: skipped)."""
    d = layout.to_dict()
    par = " ".join(f"{k}={v}" for k, v in d["parallel"].items() if v > 1) or "none"
    rows = [
        ("format", layout.format),
        ("world size", str(layout.world_size)),
        ("device mesh", layout.mesh_text),
        ("parallel", par),
        ("tensors", f"{len(layout.tensors)} ({human_count(layout.parameters)} parameters)"),
        ("size", human_bytes(layout.bytes)),
        ("dtypes", ", ".join(f"{k}x{v}" for k, v in layout.dtypes.items())),
        ("config", _short(layout.config_dir, layout.path) or _no_config(layout)),
    ]
    if layout.lora is not None:
        rows.append(("LoRA", layout.lora.summary()))
    rows += list(layout.details.items())
    if check is not None:
        rows.append(("check", check.summary().removeprefix("architecture check ")))
    width = max(len(label) for label, _ in rows) + 2  # two spaces: never "labelvalue"
    lines = [f"[b]{escape(label)}[/]{' ' * (width - len(label))}{escape(text)}"
             for label, text in rows]
    if check is not None:
        color = "green" if check.ok else "yellow" if check.skipped else "red"
        lines[-1] = f"[{color}]{lines[-1]}[/]"
    return "\n".join(lines)


def _no_config(layout: CheckpointLayout) -> str:
    return "derived from args" if layout.derived_config else "none"


def _short(path: str | None, base: str) -> str | None:
    """``path`` relative to the checkpoint folder when inside it."""
    import os

    if path is None:
        return None
    rel = os.path.relpath(path, base)
    return path if rel.startswith("..") else rel + "/"


class LayoutSummary(Static):
    """Static text view of a layout's summary."""

    def __init__(self, layout: CheckpointLayout, **kw):
        super().__init__(summary_text(layout), **kw)
        self.checkpoint = layout

    def show_check(self, verdict) -> None:
        """Add the architecture check's result (a :class:`core.judge.Verdict`): the whole line
        last in the summary, and its short form in the box's bottom border, which stays in
        sight however narrow or short the terminal (at 80x24 the summary scrolls)."""
        self.update(summary_text(self.checkpoint, verdict))
        color = "green" if verdict.ok else "yellow" if verdict.skipped else "red"
        self.border_subtitle = f"[{color}]{escape(check_short(verdict))}[/]"


def check_short(verdict) -> str:
    """The architecture check's verdict in at most about 30 columns (the summary box's border
    at 80x24): ``check: matches, 27/27``, ``check: 3 missing, 1 extra``, ``check skipped: no
    config``; the summary's last line has the whole of it."""
    if verdict.skipped is not None:
        why = verdict.skipped
        short = ("no config" if why.startswith("no config")
                 else "remote code" if "remote code" in why
                 else "unknown model_type" if "does not know model_type" in why
                 else "see below")
        return f"check skipped: {short}"
    if verdict.ok:
        return f"check: matches, {verdict.matched}/{verdict.expected}"
    kinds = [f"{len(items)} {label}" for label, items in (
        ("missing", verdict.missing), ("extra", verdict.extra), ("shape", verdict.shape),
        ("dtype", verdict.dtype)) if items]
    return "check: " + ", ".join(kinds[:2]) + (", ..." if len(kinds) > 2 else "")
