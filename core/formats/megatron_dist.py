"""Megatron-LM ``torch_dist`` checkpoints (megatron-core ``dist_checkpointing``):
``iter_NNNNNNN/`` with ``metadata.json``, DCP ``.metadata`` + ``__{rank}_{i}.distcp`` and
``common.pt``; ``latest_checkpointed_iteration.txt`` at the top. verl keeps the same folder as
``actor/dist_ckpt`` (or ``actor/model/dist_ckpt``) beside ``actor/huggingface/``.

Format facts (FORMATS.md; checked on folders written by megatron-core 0.16.1):
``metadata.json`` is ``{"sharded_backend": "torch_dist", ...}``; the DCP metadata records every
tensor's global shape (layers stacked, experts on a second axis, SwiGLU ``linear_fc1`` as global
``[gate; up]``, the embedding with its padded rows); ``common.pt`` holds what is not sharded,
``args`` (an ``argparse.Namespace``) among it. The DCP side is read by :mod:`.dcp`.
"""

from __future__ import annotations

import json
from pathlib import Path

from .. import megatron as mg
from ..errors import BadCheckpointError
from ..layout import CheckpointLayout, Problem, coverage_problems
from . import dcp
from .common import corrupt_is_bad, problem_for
from .megatron_legacy import iteration_dir
from .torchsave import read_torch_archive

#: where verl keeps the torch_dist folder inside ``actor/`` or ``critic/``
VERL_DIRS = ("dist_ckpt", "model/dist_ckpt", "model")


def dist_dir(path: Path, strict: bool = False) -> Path | None:
    """The folder holding ``metadata.json`` + ``.metadata``: ``path``, its current iteration,
    or verl's ``dist_ckpt``; None when there is none. With ``strict``, a tracker file naming a
    missing or unreadable iteration raises BadCheckpointError."""
    candidates = [path]
    try:
        it = iteration_dir(path)
    except BadCheckpointError:
        if strict:
            raise
        it = None
    if it is not None:
        candidates.insert(0, it)
    candidates += [path / v for v in VERL_DIRS]
    for c in candidates:
        try:
            if (c / "metadata.json").is_file() and (c / ".metadata").is_file():
                return c
        except OSError:
            continue
    return None


def sniff(path: str) -> bool:
    """True when ``path`` is (or holds, as above) a Megatron ``torch_dist`` checkpoint, or is
    a top folder whose tracker file is broken but whose iterations are torch_dist (so the
    reader names the tracker's problem)."""
    p = Path(path)
    if dist_dir(p) is not None:
        return True
    return (p / "latest_checkpointed_iteration.txt").is_file() and any(
        p.glob("iter_*/metadata.json"))


def _backend(d: Path) -> str:
    try:
        meta = json.loads((d / "metadata.json").read_text())
        return str(meta.get("sharded_backend"))
    except (OSError, ValueError, AttributeError):
        raise BadCheckpointError("unreadable metadata.json", str(d / "metadata.json")) from None


def _args(d: Path, layout: CheckpointLayout) -> dict:
    f = d / "common.pt"
    if not f.exists():
        layout.problems.append(Problem("no-args", "no common.pt: Megatron's args are unknown",
                                       str(f), "warning"))
        return {}
    try:
        root = read_torch_archive(str(f)).root
    except BadCheckpointError as e:  # present but damaged (or unsafe): refuse, as for weights
        layout.problems.append(problem_for(e, str(f)))
        return {}
    return mg.namespace(root.get("args")) if isinstance(root, dict) else {}


@corrupt_is_bad("torch_dist checkpoint")
def read(path: str, hf_config: str | None = None) -> CheckpointLayout:
    """Read a ``torch_dist`` checkpoint's layout from its DCP metadata and ``common.pt``, and
    cut it into Hugging Face tensors. Problems as for a DCP folder, plus
    ``parallel-mismatch`` (warning) when ``args`` disagree with the recorded chunks and
    ``unmapped-tensor`` for tensors with no Hugging Face name. Raises BadCheckpointError for
    an unreadable ``.metadata``/``metadata.json`` or a backend other than ``torch_dist``."""
    p = Path(path)
    d = dist_dir(p, strict=True)
    if d is None:
        raise BadCheckpointError("no metadata.json with .metadata: not a torch_dist folder",
                                 path)
    backend = _backend(d)
    if backend != "torch_dist":
        raise BadCheckpointError(f"sharded backend {backend!r}: only torch_dist is read",
                                 str(d / "metadata.json"))
    layout = dcp.read(str(d))
    layout.format, layout.path = "megatron-dist", str(path)
    layout.notes = [n for n in layout.notes if "skipped" not in n]
    args = _args(d, layout)
    if layout.errors:
        layout.tensors = {}
        return layout
    mt = mg.unstack(layout.tensors)
    layout.tensors = {}
    emb = mt.get("embedding.word_embeddings.weight")
    tp_found = len({pc.global_offsets for pc in emb.pieces}) if emb else 1
    tp = args.get("tensor_model_parallel_size") or tp_found
    if tp != tp_found:
        layout.problems.append(Problem(
            "parallel-mismatch", f"args say TP={tp}, the embedding is stored in {tp_found} "
            "slices", str(d / "common.pt"), "warning"))
    pp = args.get("pipeline_model_parallel_size") or 1
    vpp = args.get("virtual_pipeline_model_parallel_size") or 0
    ep = args.get("expert_model_parallel_size") or 1
    dp = mg.data_parallel(args, tp, pp)
    layout.parallel = {k: v for k, v in (("dp", dp), ("tp", tp), ("pp", pp), ("vpp", vpp),
                                         ("ep", ep)) if v and v > 1}
    layout.mesh_shape, layout.mesh_dim_names = (), None
    if args:  # torch_dist data is global; the model-parallel grid is only in args
        layout.mesh_shape = (pp, tp, ep) if ep > 1 else (pp, tp)
        layout.mesh_dim_names = ("pp", "tp", "ep") if ep > 1 else ("pp", "tp")
    config_dir = Path(hf_config) if hf_config else _config_dir(p, d)
    arch = mg.cut_to_hf(layout, mt, args, config_dir, output_means_untied=True)
    if arch is None:
        return layout
    for t in layout.tensors.values():
        layout.problems.extend(coverage_problems(t))
    stages = _stages(args, arch.layers, pp, vpp)
    owners = []
    for key, label in (("embedding.word_embeddings.weight", "embedding"),
                       ("output_layer.weight", "output layer")):
        ranks = sorted({pc.rank for pc in mt[key].pieces if pc.rank is not None}
                       ) if key in mt else []
        if ranks:
            owners.append(f"{label} written by rank{'s' if len(ranks) > 1 else ''} "
                          + ", ".join(map(str, ranks)))
    layout.details = mg.describe(
        arch, layout.parallel, stages, "; ".join(owners) or "none found",
        "common.pt" if args else "none (sizes from the Hugging Face config and shapes)",
        bool(args.get("moe_grouped_gemm")))
    return layout


def _stages(args: dict, layers: int, pp: int, vpp: int) -> str:
    """The pipeline stages' layers as Megatron assigns them (from ``args``: even split, VPP
    chunks, or the first/last stage sizes of an uneven split)."""
    if not args or pp <= 1:
        return f"stage 0: layers 0-{layers - 1}" if layers else "none"
    first = (args.get("num_layers_in_first_pipeline_stage")
             or args.get("decoder_first_pipeline_num_layers"))
    last = (args.get("num_layers_in_last_pipeline_stage")
            or args.get("decoder_last_pipeline_num_layers"))
    ids: dict[tuple[int, int], list[int]] = {}
    if first or last:
        rest = layers - (first or 0) - (last or 0)
        middle = pp - (first is not None) - (last is not None)
        sizes = [rest // middle if middle else 0] * pp
        if first:
            sizes[0] = first
        if last:
            sizes[-1] = last
        at = 0
        for s, n in enumerate(sizes):
            ids[(s, 0)] = list(range(at, at + n))
            at += n
        return mg.pipeline_text(ids, pp, 0)
    v_n = max(vpp, 1)
    per = layers // (pp * v_n)
    for v in range(v_n):
        for s in range(pp):
            start = v * layers // v_n + s * per
            ids[(s, v)] = list(range(start, start + per))
    return mg.pipeline_text(ids, pp, v_n)


def _config_dir(path: Path, d: Path) -> Path | None:
    for c in (d / "huggingface", path / "huggingface", d.parent / "huggingface",
              d.parent.parent / "huggingface"):
        if (c / "config.json").is_file():
            return c
    return None
