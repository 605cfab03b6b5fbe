"""Helpers shared by the format readers: Hugging Face side files, file stats, key clean-up."""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

from ..layout import CheckpointLayout, Problem, SourceFile

#: weight files never copied from a config folder (only config, tokenizer and code are)
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".distcp", ".gguf")
WEIGHT_NAMES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")

#: wrapper prefixes that FSDP1, torch.compile and activation checkpointing add to state-dict keys
WRAPPER_PREFIXES = ("_fsdp_wrapped_module.", "_orig_mod.", "_checkpoint_wrapped_module.")


def clean_key(key: str) -> str:
    """Drop wrapper module names from a state-dict key (they are not in the model's names)."""
    for p in WRAPPER_PREFIXES:
        key = key.replace(p, "")
    return key


def config_files(folder: str | os.PathLike) -> list[tuple[str, str]]:
    """Files of a Hugging Face config folder to copy into a merged folder, byte for byte:
    config, generation config, tokenizer files and custom modelling code, never weights.
    Returns (source path, relative name) pairs, sorted."""
    folder = Path(folder)
    out = []
    for p in sorted(folder.rglob("*")):
        if not p.is_file() or p.name.startswith("."):
            continue
        if p.name.endswith(WEIGHT_SUFFIXES) or p.name in WEIGHT_NAMES:
            continue
        out.append((str(p), str(p.relative_to(folder))))
    return out


def attach_config(layout: CheckpointLayout, folder: str | os.PathLike | None) -> None:
    """Record ``folder`` as the layout's Hugging Face config folder and its files to copy."""
    if folder is None or not Path(folder, "config.json").is_file():
        return
    layout.config_dir = str(folder)
    layout.extra_files = config_files(folder)


def read_config(folder: str | os.PathLike | None) -> dict | None:
    """The parsed ``config.json`` of ``folder``, or None when there is none or it is invalid."""
    if folder is None:
        return None
    try:
        cfg = json.loads(Path(folder, "config.json").read_text())
    except (OSError, ValueError):
        return None
    return cfg if isinstance(cfg, dict) else None


def stat_file(path: str, rank: int | None = None) -> SourceFile:
    """A :class:`SourceFile` with the file's size, or status ``missing``."""
    try:
        return SourceFile(path, os.stat(path).st_size, "ok", rank)
    except OSError:
        return SourceFile(path, 0, "missing", rank)


def problem_for(err, path: str) -> Problem:
    """A :class:`Problem` for a reader error on ``path``: ``truncated-file`` when the file is
    shorter than its contents say, ``unsafe-pickle`` for a forbidden global, else
    ``unreadable-file``."""
    from ..errors import UnsafeCheckpointError

    msg = getattr(err, "message", str(err))
    if isinstance(err, UnsafeCheckpointError):
        code = "unsafe-pickle"
    elif "truncated" in msg:
        code = "truncated-file"
    else:
        code = "unreadable-file"
    return Problem(code, msg, path)


def corrupt_is_bad(what: str, where=None):
    """Decorator for a reader's ``read(path, ...)``: damaged records can hold anything, so any
    exception other than :class:`BadCheckpointError` becomes one, ``corrupt <what> (<error>)``,
    naming ``where(path)`` (default: ``path``)."""
    from ..errors import BadCheckpointError

    def wrap(read):
        @functools.wraps(read)
        def guarded(path, *args, **kwargs):
            try:
                return read(path, *args, **kwargs)
            except BadCheckpointError:
                raise
            except Exception as e:  # noqa: BLE001 - see the docstring
                raise BadCheckpointError(f"corrupt {what} ({type(e).__name__}: {e})",
                                         str(where(path) if where else path)) from None
        return guarded
    return wrap
