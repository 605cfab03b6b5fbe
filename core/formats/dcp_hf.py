"""DCP's Hugging Face writer: per-rank ``shard-{r+1:05d}-model-{i:05d}-of-{n:05d}.safetensors``.

Format facts (torch/distributed/checkpoint/_hf_utils.py and hf_storage.py; FORMATS.md): each
file holds one rank's local pieces under the global tensor names; the piece offsets are only
in the header's ``__metadata__["DCP_SHARDING_INFO"]`` (JSON: name -> {"saved_offsets": [...],
...}); no global shape is recorded, so it is inferred as max(offset + size) per dimension.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from ..errors import BadCheckpointError
from ..layout import CheckpointLayout, Piece, Problem, TensorInfo, coverage_problems
from .common import attach_config, problem_for, stat_file
from .hf import _strides
from .safetensors_file import read_header

SHARD_RE = re.compile(r"^shard-(\d+)-model-(\d+)-of-(\d+)\.safetensors$")


def _files(p: Path) -> dict[str, tuple[int, Path]]:
    out = {}
    for d in (p, p / "sharded"):
        if d.is_dir():
            for f in d.iterdir():
                if m := SHARD_RE.match(f.name):
                    out[f.name] = (int(m[1]) - 1, f)  # file numbers count ranks from 1
    return out


def sniff(path: str) -> bool:
    """True when ``path`` (or its ``sharded/`` folder) holds DCP per-rank safetensors files."""
    return bool(_files(Path(path)))


def read(path: str) -> CheckpointLayout:
    """Layout from the headers of the per-rank files (offsets from ``DCP_SHARDING_INFO``)."""
    root = Path(path)
    files = _files(root)
    layout = CheckpointLayout(format="dcp-hf", path=str(root), world_size=0)
    extents: dict[str, list[int]] = {}
    for name in sorted(files):
        rank, fpath = files[name]
        sf = stat_file(str(fpath), rank)
        layout.files.append(sf)
        try:
            entries, meta = read_header(str(fpath))
            info = json.loads(meta.get("DCP_SHARDING_INFO", "{}"))
        except BadCheckpointError as e:
            sf.status = "unreadable"
            layout.problems.append(problem_for(e, str(fpath)))
            continue
        except ValueError:
            sf.status = "unreadable"
            layout.problems.append(Problem("unreadable-file", "DCP_SHARDING_INFO is not JSON",
                                           str(fpath)))
            continue
        for e in entries:
            offs = tuple((info.get(e.name) or {}).get("saved_offsets") or (0,) * len(e.shape))
            t = layout.tensors.get(e.name)
            if t is None:
                t = layout.tensors[e.name] = TensorInfo(e.name, (), e.dtype, "DCP (safetensors)")
            elif e.dtype != t.dtype:
                # one tensor's pieces are of one dtype: another would be cast in silently
                first = next((Path(pc.file).name for pc in t.pieces), "an earlier rank file")
                layout.problems.append(Problem(
                    "rank-disagreement", f"{e.name}: {e.dtype} here, {t.dtype} in {first}",
                    str(fpath)))
            ext = extents.setdefault(e.name, [0] * len(e.shape))
            for i, (o, s) in enumerate(zip(offs, e.shape)):
                ext[i] = max(ext[i], o + s)
            if e.nbytes:
                t.pieces.append(Piece(str(fpath), e.byte_offset, e.dtype, e.shape,
                                      _strides(e.shape), offs, rank))
    for name, t in layout.tensors.items():
        t.shape = tuple(extents[name])
    ranks = {f.rank for f in layout.files}
    layout.world_size = max(ranks) + 1 if ranks else 0
    for r in sorted(set(range(layout.world_size)) - ranks):
        layout.problems.append(Problem("missing-rank", f"no shard-{r + 1:05d}-model-*.safetensors "
                                       f"for rank {r}", str(root)))
    layout.notes.append("DCP's safetensors files record no global shapes: they are inferred "
                        "from the pieces, so a missing last rank shows only against a config")
    layout.parallel = {"fsdp": layout.world_size} if layout.world_size > 1 else {}
    if not layout.errors:
        for t in layout.tensors.values():
            layout.problems.extend(coverage_problems(t))
    for c in (root / "huggingface", root):
        if (c / "config.json").is_file():
            attach_config(layout, c)
            break
    return layout
