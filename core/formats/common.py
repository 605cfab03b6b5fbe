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


def _hub_blobs(root: str) -> str | None:
    """The ``blobs`` folder of a Hugging Face hub cache snapshot ``.../models--org--name/
    snapshots/<revision>``, whose files are symbolic links into ``../../blobs/``
    (huggingface_hub/file_download.py ``_create_symlink``); None for any other folder."""
    parent = os.path.dirname(root)
    repo = os.path.dirname(parent)
    if os.path.basename(parent) == "snapshots" and os.path.basename(repo).startswith(
            ("models--", "datasets--", "spaces--")):
        return os.path.join(repo, "blobs")
    return None


def read_weight_map(root: Path, index: str) -> tuple[dict[str, str], list[str]]:
    """``weight_map`` of a Hugging Face index file (``model.safetensors.index.json`` or
    ``pytorch_model.bin.index.json``, huggingface_hub's format) in ``root``, and the shard files
    it names, sorted; each must lie inside ``root`` (:func:`contained`). Raises
    :class:`BadCheckpointError` when the index is not JSON with a ``weight_map`` of strings."""
    from ..errors import BadCheckpointError

    try:
        weight_map = json.loads((root / index).read_text())["weight_map"]
        if not isinstance(weight_map, dict) or not all(
                isinstance(v, str) for v in weight_map.values()):
            raise TypeError
    except (ValueError, KeyError, TypeError, OSError):
        raise BadCheckpointError("index is not valid JSON with a weight_map",
                                 str(root / index)) from None
    shards = sorted(set(weight_map.values()))
    for name in shards:
        contained(root, name, "a weight_map entry", root / index)
    return weight_map, shards


def contained(root: str | os.PathLike, rel: str | os.PathLike, what: str,
              named_by: str | os.PathLike | None = None) -> Path:
    """``root / rel`` when it stays inside ``root`` once ``..`` and symbolic links are
    resolved; else raise :class:`BadCheckpointError` naming the entry.

    Every path a checkpoint names (a DCP storage entry's ``relative_path``, an index's shard,
    DeepSpeed's ``latest`` tag, Megatron's iteration, a file of ``huggingface/``) goes through
    here: a checkpoint is untrusted input, and an entry such as ``../../../etc/hostname`` or a
    link to it would put another file's bytes into the merged model (and, with ``--hf-upload``,
    on the Hub). ``what`` says what the entry is (e.g. ``storage entry of model.norm.weight``),
    ``named_by`` the file that names it (default ``root / rel``). A snapshot folder of the
    Hugging Face hub cache may also point into its own ``blobs/`` folder. A missing target is
    returned as is (the reader reports it missing)."""
    from ..errors import BadCheckpointError

    rel_s = os.fspath(rel)
    base = os.path.realpath(root)
    target = os.path.realpath(os.path.join(base, rel_s))
    allowed = [base] + [b for b in (_hub_blobs(base),) if b]
    if os.path.isabs(rel_s) or not any(
            target == a or target.startswith(a.rstrip(os.sep) + os.sep) for a in allowed):
        raise BadCheckpointError(f"{what} names {rel_s!r}, which resolves to {target}, outside "
                                 f"the checkpoint folder {base}: refusing to read it",
                                 str(named_by or os.path.join(os.fspath(root), rel_s)),
                                 code="path-outside-checkpoint")
    return Path(root) / rel_s


def config_files(folder: str | os.PathLike) -> list[tuple[str, str]]:
    """Files of a Hugging Face config folder to copy into a merged folder, byte for byte:
    config, generation config, tokenizer files and custom modelling code, never weights.
    Returns (source path, relative name) pairs, sorted. Raises BadCheckpointError for a file
    (a symbolic link) that resolves outside ``folder`` (see :func:`contained`)."""
    from ..errors import BadCheckpointError

    folder = Path(folder)
    out = []
    for p in sorted(folder.rglob("*")):
        if p.name.startswith("."):
            continue
        if p.is_symlink() and not p.exists():
            # e.g. a hub cache snapshot whose blob never finished downloading: copying the
            # rest would give a folder without it, said to be complete
            raise BadCheckpointError(f"a symbolic link to nothing ({os.readlink(p)}): the "
                                     "merged folder would lack this file; an incomplete "
                                     "download?", str(p), code="missing-file")
        if not p.is_file():
            if p.exists() and not p.is_dir():
                raise BadCheckpointError("not a regular file (a pipe, socket or device): "
                                         "refusing to read it", str(p), code="unreadable-file")
            continue
        if p.name.endswith(WEIGHT_SUFFIXES) or p.name in WEIGHT_NAMES:
            continue
        rel = str(p.relative_to(folder))
        contained(folder, rel, "a file of the config folder (symbolic link)")
        out.append((str(p), rel))
    return out


def attach_config(layout: CheckpointLayout, folder: str | os.PathLike | None) -> None:
    """Record ``folder`` as the layout's Hugging Face config folder and its files to copy.
    Raises BadCheckpointError when ``folder`` lies in the checkpoint (``layout.path``) but
    resolves outside it, or holds a file that resolves outside ``folder`` (see
    :func:`contained`)."""
    if folder is None or not Path(folder, "config.json").is_file():
        return
    try:
        rel = Path(os.path.abspath(folder)).relative_to(os.path.abspath(layout.path))
    except ValueError:
        rel = None  # a folder given by the user (--hf-config), not named by the checkpoint
    if rel is not None and str(rel) != ".":
        contained(layout.path, rel, "the config folder (symbolic link)")
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
    shorter than its contents say, ``unsafe-pickle`` for a forbidden global,
    ``unsupported-dtype`` for a tensor of a dtype safetensors cannot hold, else
    ``unreadable-file``."""
    from ..errors import UnsafeCheckpointError

    msg = getattr(err, "message", str(err))
    if isinstance(err, UnsafeCheckpointError):
        code = "unsafe-pickle"
    elif getattr(err, "code", None) == "unsupported-dtype":
        code = "unsupported-dtype"
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


def same_data_groups(files: dict) -> list[list]:
    """Groups (two or more, keys sorted) of the ``key -> torch.save file`` of ``files`` whose
    tensor data is byte for byte the same: every storage record (``<archive>/data/<n>``) of
    equal CRC-32 and size in the zip directories, read without the data. Two ranks' files of
    one save that each hold their own slices never agree on all of them: a group is a file
    copied under another rank's name. Files that cannot be read as zips are left out. The
    records come from :func:`core.integrity.storage_crcs` (the merge's own directory reader,
    which recognises the directories of one run's files from each other)."""
    from ..integrity import storage_crcs
    from .torchsave import DirectoryCache

    directories = DirectoryCache()
    by_records: dict[tuple, list] = {}
    for key, f in files.items():
        # (size, CRC-32) of each record in the order of the records in the file
        records = tuple(v for _, v in sorted(storage_crcs(str(f), directories).items()))
        if records:
            by_records.setdefault(records, []).append(key)
    return [sorted(g) for g in by_records.values() if len(g) > 1]
