"""The merge options form: a modal that returns a :class:`core.MergeOptions` or None."""

from __future__ import annotations

import os
from pathlib import Path

from rich.markup import escape

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Button, Checkbox, Input, Label, Select, Static

from shardscope.core import CheckpointLayout, MergeOptions, ShardscopeError, UsageError
from shardscope.core.plan import check_output, parse_size

DTYPES = [("keep (as trained)", "keep"), ("bf16", "bf16"), ("fp16", "fp16"), ("fp32", "fp32")]


OVERWRITE = "overwrite an existing output"
#: the form's --no-strict (core.plan.MergeOptions.strict)
NOSTRICT = "write even if the weights do not match the model (not strict)"

#: the core's messages name command-line flags; the form names its own fields instead
FORM_WORDS = [
    ("pass --overwrite to replace it", f"tick “{OVERWRITE}” to replace it"),
    ("pass --no-strict", f"tick “{NOSTRICT}”"),
    ("--lora-adapter NAME", "the adapter field"),
    ("--lora-adapter", "adapter"),
    ("--lora-alpha", "lora_alpha"),
    ("--lora-config", "the adapter_config.json field"),
    ("--base-model", "the base model folder field"),
    ("--lora base", "“base alone”"),
    ("--hf-config DIR", "the config folder field"),
    ("--hf-config", "the config folder field"),
    ("--max-shard-size", "max shard size"),
    ("--dtype", "output dtype"),
]


def form_words(message: str) -> str:
    """``message`` with the command line's flags replaced by the form's field names."""
    for flag, field in FORM_WORDS:
        message = message.replace(flag, field)
    return message


def refusal_text(layout: CheckpointLayout, most: int = 6) -> str:
    """Markup listing the errors that make ``layout`` unmergeable (at most ``most``)."""
    errs = layout.errors
    lines = [f"[red b]cannot merge: {len(errs)} error(s) found by the inspection[/]"]
    for p in errs[:most]:
        where = os.path.basename(p.path) + ": " if p.path else ""
        lines.append(f"[red]{escape(p.code)}[/] {escape(where + p.message)}")
    if len(errs) > most:
        lines.append(f"[dim]… and {len(errs) - most} more (shardscope inspect lists them)[/]")
    return "\n".join(lines)


class MergeOptionsScreen(ModalScreen[MergeOptions | None]):
    """Output folder, dtype, max shard size, overwrite; invalid values are refused here."""

    BINDINGS = [Binding("escape", "cancel", "Cancel", id="cancel-options")]

    def __init__(self, layout: CheckpointLayout):
        super().__init__()
        self.ckpt = layout

    def compose(self) -> ComposeResult:
        default_out = str(Path(self.ckpt.path).resolve().parent / "merged_hf")
        with Vertical(id="options"):
            yield Label("[b]Merge into a Hugging Face folder[/]")
            if self.ckpt.errors:
                yield Static(refusal_text(self.ckpt), id="refusal")
            # the fields scroll; the error line and the buttons stay in sight (80x24 too)
            with VerticalScroll(id="fields"):
                yield Label("output folder")
                yield Input(default_out, id="output")
                yield Label("output dtype")
                yield Select(DTYPES, value="keep", allow_blank=False, id="dtype")
                yield Label("max shard size (decimal units, e.g. 5GB, 500MB)")
                yield Input("5GB", id="shard-size")
                if self.ckpt.config_dir is None:
                    yield Label("config folder (this checkpoint has none)")
                    yield Input("", placeholder="folder with config.json and tokenizer",
                                id="hf-config")
                if self.ckpt.lora is not None:
                    lora = self.ckpt.lora
                    yield Static(f"[b]LoRA[/] {escape(lora.summary())}", id="lora-heading")
                    yield Select([("fold into the weights", "fold"),
                                  ("base + PEFT adapter folder", "adapter"),
                                  ("folded model + adapter folder", "both"),
                                  ("base alone (drop the adapter)", "base")],
                                 value="fold", allow_blank=False, id="lora-mode")
                    names = sorted(lora.adapters)
                    with Horizontal(id="lora-row"):
                        with Vertical():
                            yield Label("adapter")
                            yield Input(names[0] if len(names) == 1 else "",
                                        placeholder=", ".join(names), id="lora-adapter")
                        with Vertical():
                            yield Label("lora_alpha (the run's value)")
                            first = lora.adapters[names[0]] if names else None
                            # not prefilled where the recorded alpha is in doubt (other module
                            # ranks): a value there is then the user's, never assumed
                            alpha = (first.lora_alpha if first is not None
                                     and not first.alpha_doubt else None)
                            yield Input("" if alpha is None else f"{alpha:g}",
                                        placeholder="e.g. 16", id="lora-alpha")
                    with Horizontal(id="lora-files-row"):
                        with Vertical():
                            yield Label("adapter_config.json (if not in lora_adapter/)")
                            yield Input("", placeholder="path to adapter_config.json",
                                        id="lora-config")
                        if lora.lora_only:
                            with Vertical():
                                yield Label("base model folder (adapter-only checkpoint)")
                                yield Input("", placeholder="folder with the base weights",
                                            id="base-model")
                yield Label("Hub repo to upload to after verification (optional)")
                with Horizontal(id="upload-row"):
                    yield Input("", placeholder="my-org/my-model", id="hf-upload")
                    yield Checkbox("private", id="private")
                yield Checkbox(OVERWRITE, id="overwrite")
                yield Checkbox(NOSTRICT, id="no-strict")
            yield Static("", id="error")
            with Horizontal(id="buttons"):
                yield Button("Merge", variant="primary", id="ok")
                yield Button("Cancel", id="cancel")

    def on_mount(self) -> None:
        if self.ckpt.errors:
            self.query_one("#ok", Button).disabled = True
        for box in self.query(Input):
            box.cursor_blink = False  # no repainting animation (SSH, stable pictures)
        # typing right after `m` goes to the output folder (its default selected: typing
        # replaces it); otherwise the scrolling #fields container would take the focus
        self.query_one("#output", Input).focus()

    def options(self) -> MergeOptions:
        """The form as options. Raises UsageError (shown in the form) for a bad value, or
        when the checkpoint's inspection found errors."""
        if self.ckpt.errors:
            raise UsageError(f"this checkpoint has {len(self.ckpt.errors)} error(s) (listed "
                             "above): it cannot be merged")
        out = self.query_one("#output", Input).value.strip()
        if not out:
            raise UsageError("give an output folder")
        size = self.query_one("#shard-size", Input).value.strip()
        if parse_size(size) <= 0:
            raise UsageError("the shard size must be positive")
        overwrite = self.query_one("#overwrite", Checkbox).value
        check_output(Path(out), overwrite, self.ckpt.path)
        hf_config = None
        if self.query("#hf-config"):
            hf_config = self.query_one("#hf-config", Input).value.strip() or None
            if hf_config and not Path(hf_config, "config.json").is_file():
                raise UsageError("has no config.json", hf_config)
        dtype = self.query_one("#dtype", Select).value
        opts = MergeOptions(output=out, dtype=None if dtype == "keep" else str(dtype),
                            max_shard_size=size, overwrite=overwrite, hf_config=hf_config,
                            strict=not self.query_one("#no-strict", Checkbox).value)
        repo = self.query_one("#hf-upload", Input).value.strip()
        if repo:
            if repo.count("/") > 1 or repo.startswith("/") or " " in repo:
                raise UsageError(f"{repo!r} is not a repository id (owner/name)")
            opts.hf_upload = repo
            opts.private = self.query_one("#private", Checkbox).value
        if self.query("#lora-mode"):
            opts.lora = str(self.query_one("#lora-mode", Select).value)
            opts.lora_adapter = self.query_one("#lora-adapter", Input).value.strip() or None
            alpha = self.query_one("#lora-alpha", Input).value.strip()
            if alpha:
                try:
                    opts.lora_alpha = float(alpha)
                except ValueError:
                    raise UsageError(f"lora_alpha {alpha!r} is not a number") from None
                recorded = {a.lora_alpha for a in self.ckpt.lora.adapters.values()
                            if not a.alpha_doubt}
                if opts.lora_alpha in recorded:
                    opts.lora_alpha = None  # the recorded value, not the user's override
            opts.lora_config = self.query_one("#lora-config", Input).value.strip() or None
            if self.query("#base-model"):
                opts.base_model = self.query_one("#base-model", Input).value.strip() or None
        # the same checks the merge makes, so a bad choice is refused here and not later
        from shardscope.core.plan import lora_choice

        lora_choice(self.ckpt, opts)
        return opts

    @on(Button.Pressed, "#ok")
    @on(Input.Submitted)
    def _submit(self) -> None:
        try:
            opts = self.options()
        except ShardscopeError as e:  # a usage error, or a LoRA variant not supported (3)
            self.query_one("#error", Static).update(f"[red]{escape(form_words(str(e)))}[/]")
            return
        self.dismiss(opts)

    @on(Button.Pressed, "#cancel")
    def action_cancel(self) -> None:
        self.dismiss(None)
