"""Hugging Face folders of ``torch.save`` files, and single ``.pt``/``.pth``/``.bin`` state dicts.

Format facts (transformers/utils/__init__.py ``WEIGHTS_NAME = "pytorch_model.bin"``,
``WEIGHTS_INDEX_NAME = "pytorch_model.bin.index.json"``; transformers 4's ``save_pretrained``
with ``safe_serialization=False`` and huggingface_hub/serialization/_torch.py
``split_torch_state_dict_into_shards(filename_pattern="pytorch_model{suffix}.bin")``): a folder
holds ``pytorch_model.bin``, or shards ``pytorch_model-0000i-of-0000N.bin`` listed by the index
(``{"metadata": {"total_size": ...}, "weight_map": {name: shard}}``); each file is a
``torch.save`` of a plain state dict (name -> tensor; tied tensors share one storage). The
storage location (``cpu``, ``cuda:0`` ...) is a string in the pickle and changes nothing here.
A single ``.pt``/``.pth`` file is the same kind of state dict, sometimes nested under
``state_dict``/``model``/``module`` (PyTorch Lightning, plain training scripts).

Everything is read by the restricted reader (:mod:`.torchsave`): the tensors' bytes are copied
from their storages, nothing is ever loaded with ``torch.load(weights_only=False)``.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from ..errors import BadCheckpointError
from ..layout import CheckpointLayout, Piece, Problem, TensorInfo
from .common import attach_config, contained, problem_for, read_weight_map, stat_file
from .torchsave import Record, TensorRef, read_torch_archive

WEIGHTS = "pytorch_model.bin"
INDEX = "pytorch_model.bin.index.json"
#: suffixes of a single-file state dict
SINGLE_SUFFIXES = (".pt", ".pth", ".bin")
#: a shard of a sharded save, ``<name>-0000i-of-0000N.<ext>``
SHARD_RE = re.compile(r"^.*-(\d+)-of-(\d+)\.[A-Za-z]+$")
#: keys a training script nests the model's state dict under
NESTED_KEYS = ("state_dict", "model", "module", "model_state_dict")


#: single files that are not model weights (Hugging Face Trainer's and others' side files)
NOT_WEIGHTS = ("optimizer", "scheduler", "rng_state", "training_args", "extra_state", "optim")


def _single_files(p: Path) -> list[Path]:
    try:
        return sorted(c for c in p.iterdir() if c.suffix in (".pt", ".pth")
                      and not c.name.startswith((".", *NOT_WEIGHTS)) and c.is_file())
    except OSError:
        return []


def is_folder(p: Path) -> bool:
    """True when ``p`` holds ``pytorch_model.bin`` or its index: a file inside it is read
    with the whole folder, never alone."""
    return (p / WEIGHTS).is_file() or (p / INDEX).is_file()


def sniff(path: str) -> bool:
    """True when the folder ``path`` holds ``pytorch_model.bin``, its index, or exactly one
    ``.pt``/``.pth`` file (a single-file state dict)."""
    p = Path(path)
    if not p.is_dir():
        return p.is_file() and p.suffix in SINGLE_SUFFIXES
    return (p / WEIGHTS).is_file() or (p / INDEX).is_file() or len(_single_files(p)) == 1


def _state_dict(root, path: str, layout: CheckpointLayout) -> dict:
    if not isinstance(root, dict):
        raise BadCheckpointError("the pickle is not a state dict", path)
    if not any(isinstance(v, TensorRef) for v in root.values()):
        for k in NESTED_KEYS:
            inner = root.get(k)
            if isinstance(inner, dict) and any(isinstance(v, TensorRef) for v in inner.values()):
                layout.notes.append(f"the state dict is nested under {k!r}; other entries "
                                    "skipped")
                return inner
    return root


def read(path: str) -> CheckpointLayout:
    """Layout of a folder of ``pytorch_model*.bin`` files (or of a single ``.pt``/``.pth``/
    ``.bin`` state dict, when ``path`` is that file or the folder's only one); every tensor is
    one piece. Problems: shards named by the index but missing (``missing-file``), unreadable
    files, keys in two shards (``duplicate-key``), index entries whose shard lacks them
    (``index-mismatch``), values that are not plain tensors (``not-full-tensor``: DTensors or
    ShardedTensors of a sharded save). Raises BadCheckpointError for an invalid index, an index
    entry outside the folder, or a folder with none of these files."""
    given = Path(path)
    root = given.parent if given.is_file() else given
    layout = CheckpointLayout(format="hf-bin", path=str(given), world_size=1)
    weight_map = None
    if given.is_file():
        shards = [given.name]
        m = SHARD_RE.match(given.name)
        if m and int(m[2]) > 1:
            raise BadCheckpointError(f"one shard of {int(m[2])}, without an index beside it: "
                                     f"the other shards' tensors would be missing", str(given))
    elif (root / INDEX).is_file():
        weight_map, shards = read_weight_map(root, INDEX)
    elif (root / WEIGHTS).is_file():
        shards = [WEIGHTS]
    elif len(_single_files(root)) == 1:
        shards = [_single_files(root)[0].name]
    else:
        raise BadCheckpointError(f"no {WEIGHTS}, {INDEX} or single .pt/.pth file", str(root))
    seen: dict[str, str] = {}
    skipped = 0
    for name in shards:
        fpath = str(contained(root, name, "a weight file (symbolic link)"))
        sf = stat_file(fpath)
        layout.files.append(sf)
        if sf.status == "missing":
            layout.problems.append(Problem("missing-file", "shard named by the index is missing",
                                           fpath))
            continue
        try:
            arch = read_torch_archive(fpath)
            sd = _state_dict(arch.root, fpath, layout)
        except BadCheckpointError as e:
            sf.status = "unreadable"
            layout.problems.append(problem_for(e, fpath))
            continue
        for key, ref in sd.items():
            key = str(key)
            if isinstance(ref, Record) and ref.name in ("DTensor", "ShardedTensor"):
                layout.problems.append(Problem(
                    "not-full-tensor", f"{key} is a {ref.name} (one rank's shard of a sharded "
                    "save), not a full tensor", fpath))
                continue
            if not isinstance(ref, TensorRef):
                skipped += 1
                continue
            if key in seen:
                layout.problems.append(Problem("duplicate-key", f"{key} is also in {seen[key]}",
                                               fpath))
                continue
            if not ref.fits_storage():
                raise BadCheckpointError(f"{key}: view {ref.shape} at {ref.storage_offset} lies "
                                         "outside its storage", fpath)
            seen[key] = name
            if weight_map is not None and weight_map.get(key) != name:
                layout.problems.append(Problem("index-mismatch", f"{key} is in {name}, the "
                                               f"index says {weight_map.get(key)}", fpath))
            t = TensorInfo(key, ref.shape, ref.dtype, "full")
            t.pieces.append(Piece(fpath, ref.byte_offset, ref.dtype, ref.shape, ref.stride,
                                  (0,) * len(ref.shape), 0))
            layout.tensors[key] = t
    if weight_map is not None:
        for k, v in weight_map.items():
            if k not in seen and (root / v).is_file():
                layout.problems.append(Problem("index-mismatch", f"{k} is not in {v}",
                                               str(root / v)))
    if skipped:
        layout.notes.append(f"{skipped} non-tensor entries skipped")
    locs = {os.path.basename(f.path) for f in layout.files}
    if layout.tensors:
        layout.notes.append(f"torch.save state dict ({', '.join(sorted(locs)[:3])}"
                            f"{' ...' if len(locs) > 3 else ''}) read without torch.load")
    attach_config(layout, root)
    return layout
