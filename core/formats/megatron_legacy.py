"""Megatron-LM legacy per-rank checkpoints: ``iter_NNNNNNN/mp_rank_{tp:02d}[_{pp:03d}]
[_{ep:03d}]/model_optim_rng.pt`` (or ``release/``), with ``latest_checkpointed_iteration.txt``
at the top.

Format facts (FORMATS.md; megatron.training's ``get_checkpoint_name``; checked on files written
by megatron-core 0.16.1): each file is a ``torch.save`` of ``{"args": Namespace, "model": state
dict (or "model0".."model{V-1}" under VPP), "checkpoint_version", "iteration", "rng_state",
"optimizer"...}`` written by the first data-parallel replica of each model-parallel rank. The
PP index appears in the folder name only when PP > 1, the EP index only when EP > 1. With EP,
every EP rank's file holds the dense weights too (replicas) plus its local experts.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from .. import megatron as mg
from ..dtypes import ITEMSIZE
from ..errors import BadCheckpointError
from ..layout import CheckpointLayout, Piece, Problem, TensorInfo, coverage_problems
from ..phases import phase, progressed
from .common import contained, corrupt_is_bad, problem_for, same_data_groups, stat_file
from .torchsave import TensorRef, read_torch_archive

RANK_DIR_RE = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?$")
FILE_NAMES = ("model_optim_rng.pt", "model_rng.pt")

#: replicated tensors up to this many bytes are compared across ranks when inspecting
REPLICA_CHECK_BYTES = 1 << 20

#: how a Megatron tensor is split across TP ranks, by the end of its name
ROW = ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias",
       "embedding.word_embeddings.weight", "output_layer.weight")
GATED = ("linear_fc1.weight", "linear_fc1.bias")
COL = ("self_attention.linear_proj.weight", "linear_fc2.weight")


def iteration_dir(path: Path) -> Path | None:
    """The ``iter_*``/``release`` folder of a Megatron checkpoint: ``path`` itself, the one
    ``latest_checkpointed_iteration.txt`` names, or the parent of a ``mp_rank_*`` folder."""
    try:
        tracker = path / "latest_checkpointed_iteration.txt"
        if tracker.is_file():
            text = tracker.read_text().strip()
            d = contained(path, "release" if text == "release" else f"iter_{int(text):07d}",
                          "latest_checkpointed_iteration.txt", tracker)
            if not d.is_dir():
                raise BadCheckpointError(f"names iteration {text}, whose folder {d.name} is "
                                         "missing", str(tracker))
            return d
        if RANK_DIR_RE.match(path.name):
            return path.parent
        if re.match(r"^(iter_\d+|release)$", path.name):
            return path
    except ValueError:
        raise BadCheckpointError("does not hold an iteration number", str(tracker)) from None
    return None


def _rank_dirs(d: Path) -> dict[tuple[int, int | None, int | None], Path]:
    out = {}
    try:
        for name in os.listdir(d):
            if m := RANK_DIR_RE.match(name):
                out[(int(m[1]), None if m[2] is None else int(m[2]),
                     None if m[3] is None else int(m[3]))] = d / name
    except OSError:
        return {}
    return out


def sniff(path: str) -> bool:
    """True when ``path`` is a legacy Megatron checkpoint (or its iteration folder)."""
    try:
        d = iteration_dir(Path(path))
    except BadCheckpointError:
        return (Path(path) / "latest_checkpointed_iteration.txt").is_file() and not any(
            Path(path).glob("iter_*/metadata.json"))
    return d is not None and bool(_rank_dirs(d))


def _model_file(d: Path) -> Path:
    for n in FILE_NAMES:
        if (d / n).exists():
            return d / n
    return d / FILE_NAMES[0]


def _chunks(root) -> list[dict]:
    """The model state dicts of one file: ``[model]`` or ``[model0, model1, ...]``."""
    if not isinstance(root, dict):
        return []
    if "model" in root:
        return [root["model"]]
    out, v = [], 0
    while f"model{v}" in root:
        out.append(root[f"model{v}"])
        v += 1
    return out


def _split_rule(rest: str, swiglu: bool) -> str:
    if rest.endswith(GATED):
        return "gated" if swiglu else "row"
    if rest.endswith(ROW):
        return "row"
    if rest.endswith(COL):
        return "col"
    return "replicated"


@corrupt_is_bad("Megatron checkpoint")
def read(path: str, hf_config: str | None = None) -> CheckpointLayout:
    """Read a legacy Megatron checkpoint's layout (pickles only, no tensor data except the
    small replicated tensors compared across ranks) and cut it into Hugging Face tensors.

    Problems: a rank folder or file missing (``missing-rank``), an unreadable or truncated
    file, sizes in ``args`` that disagree with the folders (``parallel-mismatch``), replicas
    that differ (``replica-mismatch``), shapes that disagree between ranks
    (``shape-mismatch``), tensors with no Hugging Face name (``unmapped-tensor``).
    Raises BadCheckpointError when no rank file can be read at all.
    """
    p = Path(path)
    d = iteration_dir(p)
    if d is None:
        raise BadCheckpointError("no iter_* folder and no latest_checkpointed_iteration.txt",
                                 path)
    dirs = _rank_dirs(d)
    layout = CheckpointLayout(format="megatron-legacy", path=str(path), world_size=0)
    contents: dict[tuple, tuple[str, list[dict]]] = {}
    args: dict = {}
    args_file = ""
    for i, (key, rd) in enumerate(sorted(dirs.items(), key=lambda kv: str(kv[1]))):
        progressed(i, len(dirs), layout)
        f = _model_file(rd)
        sf = stat_file(str(f))
        layout.files.append(sf)
        if sf.status == "missing":
            layout.problems.append(Problem("missing-rank", f"{rd.name} holds no "
                                           f"{FILE_NAMES[0]}", str(f)))
            continue
        phase(f"reading rank files {len(layout.files)}: {rd.name}")
        try:
            root = read_torch_archive(str(f)).root
        except BadCheckpointError as e:
            sf.status = "unreadable"
            layout.problems.append(problem_for(e, str(f)))
            continue
        chunks = _chunks(root)
        if not chunks or not all(isinstance(c, dict) for c in chunks):
            sf.status = "unreadable"
            layout.problems.append(Problem("unreadable-file", "no model state dict (model or "
                                           "model0..) in this file", str(f)))
            continue
        contents[key] = (str(f), chunks)
        these = mg.namespace(root.get("args")) if isinstance(root, dict) else {}
        if not args:
            args, args_file = these, str(f)
        elif (diff := [k for k in ARGS_SAME if these.get(k) != args.get(k)]):
            layout.problems.append(Problem(
                "args-disagree", f"args say {diff[0]}={these.get(diff[0])!r} here, "
                f"{args.get(diff[0])!r} in {Path(args_file).parent.name}", str(f)))
    if not contents:  # the reader's own reason (e.g. the legacy non-zip torch.save format)
        first = next((pr for pr in layout.problems if pr.severity == "error"), None)
        if first is None:
            raise BadCheckpointError("no readable mp_rank_* model file", str(d))
        raise BadCheckpointError(f"no readable mp_rank_* model file: {first.message}",
                                 first.path or str(d))
    grid = _grid(dirs, contents, args, d, layout)
    if grid is None:
        return layout
    tp, pp, ep, vpp, files = grid
    _check_consistency(files, pp, vpp, layout)
    _duplicate_rank_files(files, layout)
    if layout.errors:
        return layout
    dp = mg.data_parallel(args, tp, pp)
    layout.parallel = {k: v for k, v in (("dp", dp), ("tp", tp), ("pp", pp), ("ep", ep))
                       if v > 1}
    if vpp > 1:
        layout.parallel["vpp"] = vpp
    layout.world_size = tp * pp * ep
    layout.mesh_shape = (pp, tp, ep) if ep > 1 else (pp, tp)
    layout.mesh_dim_names = ("pp", "tp", "ep") if ep > 1 else ("pp", "tp")
    for sf in layout.files:
        for (t, s, e), (f, _) in files.items():
            if f == sf.path:
                sf.rank = t + tp * (e + ep * s)
    stage_layers, offsets = _layer_offsets(files, pp, vpp)
    swiglu = bool(args.get("swiglu", True))
    mt, replicas, where = _gather(files, offsets, tp, ep, swiglu, args, layout)
    _check_replicas(replicas, layout)
    if layout.errors:
        return layout
    for t in mt.values():
        layout.problems.extend(coverage_problems(t))
    config_dir = Path(hf_config) if hf_config else _config_dir(p, d)
    arch = mg.cut_to_hf(layout, mt, args, config_dir)
    if arch is None:
        return layout
    stages = mg.pipeline_text(stage_layers, pp, vpp)
    grouped = bool(args.get("moe_grouped_gemm")) or any(
        "grouped GEMM" in t.placement for t in mt.values())
    layout.details = mg.describe(arch, layout.parallel, stages, where,
                                 "in every model_optim_rng.pt" if args else "none", grouped)
    return layout


def _grid(dirs, contents, args, d: Path, layout: CheckpointLayout):
    """(tp, pp, ep, vpp, {(tp, pp, ep): (file, chunks)}) from the folder names and ``args``;
    None (with problems) when they cannot be reconciled."""
    tp_a = args.get("tensor_model_parallel_size")
    pp_a = args.get("pipeline_model_parallel_size")
    ep_a = args.get("expert_model_parallel_size")
    second = {k[1] for k in dirs if k[1] is not None}
    third = {k[2] for k in dirs if k[2] is not None}
    # one extra index is PP when PP > 1, else EP (megatron.training's naming)
    if third:
        kind = ("pp", "ep")
    elif second and (ep_a or 1) > 1 and (pp_a or 1) == 1:
        kind = ("ep", None)
    else:
        kind = ("pp", None) if second else (None, None)
    files = {}
    for (t, a, b), v in contents.items():
        idx = {"tp": t, "pp": 0, "ep": 0}
        if kind[0]:
            idx[kind[0]] = a or 0
        if kind[1]:
            idx[kind[1]] = b or 0
        files[(idx["tp"], idx["pp"], idx["ep"])] = v
    found = {"tp": 1 + max(k[0] for k in dirs), "pp": 1, "ep": 1}
    if kind[0]:
        found[kind[0]] = 1 + max((k[1] or 0) for k in dirs)
    if kind[1]:
        found[kind[1]] = 1 + max((k[2] or 0) for k in dirs)
    sizes = {}
    for name, arg in (("tp", tp_a), ("pp", pp_a), ("ep", ep_a)):
        sizes[name] = arg or found[name]
        if arg and found[name] > arg:
            layout.problems.append(Problem(
                "parallel-mismatch", f"the folders give {name.upper()}={found[name]}, args "
                f"say {arg}", str(d)))
            return None
    tp, pp, ep = sizes["tp"], sizes["pp"], sizes["ep"]
    vpp_a = args.get("virtual_pipeline_model_parallel_size") or 1
    vpp = max(len(c) for _, c in files.values())
    if vpp != vpp_a and args:
        layout.problems.append(Problem("parallel-mismatch", f"the files hold {vpp} model chunks "
                                       f"(VPP), args say {vpp_a}", str(d)))
        return None
    for t in range(tp):
        for s in range(pp):
            for e in range(ep):
                if (t, s, e) in files:
                    continue
                name = f"mp_rank_{t:02d}" + (f"_{s:03d}" if pp > 1 else "") + (
                    f"_{e:03d}" if ep > 1 else "")
                if not any(sf.path.startswith(str(d / name) + os.sep) for sf in layout.files):
                    layout.problems.append(Problem(
                        "missing-rank", f"{name}/ is missing (TP={tp}, PP={pp}, EP={ep})",
                        str(d / name)))
    return tp, pp, ep, vpp, files


#: args fields every rank's file must agree on
ARGS_SAME = ("tensor_model_parallel_size", "pipeline_model_parallel_size",
             "virtual_pipeline_model_parallel_size", "expert_model_parallel_size", "num_layers",
             "hidden_size", "num_attention_heads", "num_query_groups", "swiglu",
             "padded_vocab_size", "num_experts", "untie_embeddings_and_output_weights")


def _duplicate_rank_files(files, layout: CheckpointLayout) -> None:
    """``duplicate-rank`` for a file whose tensor data is byte for byte another rank's of the
    same pipeline stage (every storage record of the same CRC-32 and size in the two zip
    directories, read without the data): TP ranks hold different slices of every split tensor
    and EP ranks different experts, so such a file is a copy under another rank's folder,
    whose own tensors are missing."""
    groups = []
    for s in sorted({s for (_, s, _) in files}, key=str):
        stage = {(t, e): f for (t, s2, e), (f, _) in files.items() if s2 == s}
        groups += [[(k, stage[k]) for k in g] for g in same_data_groups(stage)]
    for group in groups:
        _, f0 = group[0]
        for _, f1 in group[1:]:
            layout.problems.append(Problem(
                "duplicate-rank", f"holds the same tensor bytes as "
                f"{Path(f0).parent.name}/{Path(f0).name}: the tensor- and expert-parallel ranks "
                f"of a stage hold different slices; a copy of that file under "
                f"{Path(f1).parent.name}? Its own rank's tensors are missing", f1))


def _tensor_keys(sd: dict) -> set[str]:
    return {k for k, v in sd.items() if isinstance(v, TensorRef)}


def _check_consistency(files, pp: int, vpp: int, layout: CheckpointLayout) -> None:
    """Errors for files that cannot belong together: a different number of model chunks
    (VPP), a different set of tensors than the other TP/EP ranks of the same stage
    (``key-mismatch``: a tensor on one rank only would be dropped or half-merged), and
    embedding/output layers on the wrong stage (``stage-order``: swapped stage folders)."""
    v_n = max(vpp, 1)
    first_of_stage: dict[int, tuple[str, list[set[str]]]] = {}
    for (t, s, e), (f, chunks) in sorted(files.items(), key=lambda kv: (kv[0][1], kv[0])):
        if len(chunks) != v_n:
            layout.problems.append(Problem("parallel-mismatch", f"{len(chunks)} model chunks "
                                           f"here, {v_n} in the other files (VPP)", f))
            continue
        keys = [_tensor_keys(c) for c in chunks]
        if s not in first_of_stage:
            first_of_stage[s] = (f, keys)
        else:
            ref_f, ref_keys = first_of_stage[s]
            for v, (a, b) in enumerate(zip(keys, ref_keys)):
                if a != b:
                    odd = sorted(a ^ b)[0]
                    where = "here" if odd in a else f"in {Path(ref_f).parent.name}"
                    layout.problems.append(Problem(
                        "key-mismatch", f"{odd} is only {where}: the ranks of a stage must "
                        "hold the same tensors", f))
                    break
        for v, ks in enumerate(keys):
            first, last = (s, v) == (0, 0), (s, v) == (pp - 1, v_n - 1)
            if any(k.startswith("embedding.") for k in ks) and not first:
                layout.problems.append(Problem(
                    "stage-order", f"the embedding is on stage {s}" + (f", chunk {v}" if vpp
                                                                       else "") +
                    ", not the first: are the stage folders swapped?", f))
            if "decoder.final_layernorm.weight" in ks and not last:
                layout.problems.append(Problem(
                    "stage-order", f"the final norm is on stage {s}" + (f", chunk {v}" if vpp
                                                                        else "") +
                    ", not the last: are the stage folders swapped?", f))


def _layer_offsets(files, pp: int, vpp: int):
    """Global number of each chunk's first layer: chunks ordered (vpp chunk, stage), each as
    long as the layers its files hold (so uneven stages work). Returns ({(stage, chunk):
    global layer ids}, {(stage, chunk): offset})."""
    counts: dict[tuple[int, int], int] = {}
    for (t, s, e), (_, chunks) in files.items():
        for v, sd in enumerate(chunks):
            ids = {int(m[1]) for k in sd if (m := mg.LAYER_RE.match(k))}
            counts[(s, v)] = max(counts.get((s, v), 0), max(ids) + 1 if ids else 0)
    offsets, stage_layers, at = {}, {}, 0
    for v in range(max(vpp, 1)):
        for s in range(pp):
            n = counts.get((s, v), 0)
            offsets[(s, v)] = at
            stage_layers[(s, v)] = list(range(at, at + n))
            at += n
    return stage_layers, offsets


def _gather(files, offsets, tp: int, ep: int, swiglu: bool, args: dict, layout):
    """The normalised Megatron tensors (global names, TP merged, fc1 de-interleaved), the
    replicas of each replicated tensor, and a sentence on where embeddings live."""
    etp = args.get("expert_tensor_parallel_size") or tp
    mt: dict[str, TensorInfo] = {}
    replicas: dict[str, list[Piece]] = {}
    local_shapes: dict[str, tuple] = {}
    for (t, s, e), (f, chunks) in sorted(files.items()):
        for v, sd in enumerate(chunks):
            if not isinstance(sd, dict):
                continue
            n_experts = 1 + max([int(x[1]) for k in sd if (m := mg.LAYER_RE.match(k))
                                 and (x := mg.EXPERT_RE.match(m[2]))] or [-1])
            for key, ref in sd.items():
                if not isinstance(ref, TensorRef):
                    continue
                name, expert, grouped = key, False, None
                if m := mg.LAYER_RE.match(key):
                    rest = m[2]
                    if x := mg.EXPERT_RE.match(rest):
                        expert = True
                        rest = f"mlp.experts.local_experts.{e * n_experts + int(x[1])}.{x[2]}"
                    elif rest in GROUPED:
                        grouped = GROUPED[rest]
                    name = f"decoder.layers.{offsets[(s, v)] + int(m[1])}.{rest}"
                if not grouped:
                    rule = _split_rule(name, swiglu)
                    if expert and etp == 1:
                        rule = "replicated"
                    elif expert and etp != tp:
                        layout.problems.append(Problem(
                            "unsupported-layout", f"expert tensor parallel size {etp} differs "
                            f"from TP={tp}", f))
                        return mt, replicas, ""
                if not ref.fits_storage():
                    layout.problems.append(Problem(
                        "unreadable-file", f"{key}: view outside its storage", f))
                    continue
                shape = tuple(ref.shape)
                if local_shapes.setdefault(name, shape) != shape:
                    layout.problems.append(Problem(
                        "shape-mismatch", f"{name}: {list(shape)} here, "
                        f"{list(local_shapes[name])} on another rank", f))
                    continue
                if grouped:
                    try:
                        _add_grouped(mt, name, grouped, ref, sd, f, t, tp, etp, e, ep, swiglu,
                                     args, (s, t, e) if ep > 1 else (s, t),
                                     t + tp * (e + ep * s))
                    except _Mismatch as m:
                        layout.problems.append(m.problem)
                    continue
                # replicas: a replicated tensor on every TP rank (and EP rank), or a dense
                # weight's slice on every EP rank; the first copy is used, all are compared
                primary = (t == 0 or rule != "replicated") and (expert or e == 0)
                if rule == "replicated" or not expert:
                    replicas.setdefault(f"{name}@{0 if rule == 'replicated' else t}", []).append(
                        Piece(f, ref.byte_offset, ref.dtype, shape, tuple(ref.stride),
                              (0,) * len(shape)))
                if not primary:
                    continue
                try:
                    _add(mt, name, rule, ref, f, t, tp, (s, t, e) if ep > 1 else (s, t),
                         t + tp * (e + ep * s))
                except _Mismatch as m:
                    layout.problems.append(m.problem)
    where = []
    for key, label in (("embedding.word_embeddings.weight", "embedding"),
                       ("output_layer.weight", "output layer")):
        stages = sorted({p.coord[0] for p in mt[key].pieces}) if key in mt else []
        if stages:
            where.append(f"{label} on stage {', '.join(map(str, stages))}")
    return mt, replicas, "; ".join(where) or "none found"


def _add(mt, name: str, rule: str, ref: TensorRef, f: str, t: int, tp: int, coord,
         rank: int) -> None:
    """Add TP rank ``t``'s slice of ``name`` as pieces of its global tensor. ``rank``: the
    model-parallel rank of the file (``tp + TP * (ep + EP * pp)``), ``coord`` its (pp, tp[,
    ep]) coordinate."""
    shape, stride = tuple(ref.shape), tuple(ref.stride)
    zeros = (0,) * len(shape)
    if rule == "replicated":
        g = shape
        pieces = [Piece(f, ref.byte_offset, ref.dtype, shape, stride, zeros, rank, coord)]
    elif rule == "col":
        g = (shape[0], shape[1] * tp) + shape[2:]
        pieces = [Piece(f, ref.byte_offset, ref.dtype, shape, stride,
                        (0, t * shape[1]) + zeros[2:], rank, coord)]
    elif rule == "row":
        g = (shape[0] * tp,) + shape[1:]
        pieces = [Piece(f, ref.byte_offset, ref.dtype, shape, stride,
                        (t * shape[0],) + zeros[1:], rank, coord)]
    else:  # gated: this rank's [gate_r; up_r] -> rows of the global [gate; up]
        half = shape[0] // 2
        g = (shape[0] * tp,) + shape[1:]
        step = half * stride[0] * ITEMSIZE[ref.dtype]
        pieces = [Piece(f, ref.byte_offset + k * step, ref.dtype, (half,) + shape[1:], stride,
                        (k * half * tp + t * half,) + zeros[1:], rank, coord) for k in (0, 1)]
    info = mt.get(name)
    if info is not None and info.dtype != ref.dtype:
        raise _Mismatch(Problem("dtype-mismatch", f"{name} is {ref.dtype} here, {info.dtype} "
                                "on another rank", f))
    if info is None:
        placement = {"replicated": "TP Replicate()", "col": "TP Shard(1)", "row": "TP Shard(0)",
                     "gated": "TP Shard(0) of gate and up"}[rule] if tp > 1 else "plain"
        info = mt[name] = TensorInfo(name, g, ref.dtype, placement, source=name)
    info.pieces.extend(pieces)


#: megatron-core's legacy ``GroupedMLP`` (``--moe-grouped-gemm``): the local experts stacked
#: in one tensor per projection, by the module name under a layer
GROUPED = {"mlp.experts.weight1": "linear_fc1", "mlp.experts.weight2": "linear_fc2"}


def _add_grouped(mt, name: str, which: str, ref: TensorRef, sd: dict, f: str, t: int,
                 tp: int, etp: int, e: int, ep: int, swiglu: bool, args: dict, coord,
                 rank: int) -> None:
    """Cut EP rank ``e``'s (TP rank ``t``'s) grouped-GEMM ``weight1``/``weight2`` into the
    per-expert ``mlp.experts.local_experts.{g}.linear_fc1/linear_fc2.weight`` of the global
    form (``[gate; up]`` x hidden, hidden x ffn), as strided pieces of the stored bytes.

    Format facts (megatron-core 0.16.1, ``megatron/core/transformer/moe/experts.py``,
    ``GroupedMLP.__init__`` and ``sharded_state_dict``): ``weight1`` is ``[hidden, local x W]``
    with ``W = 2 x ffn/TP`` (gated) or ``ffn/TP``, and is read as ``view(local, hidden, W)``
    then transposed: local expert j's fc1 is the ``[hidden, W]`` row-major block j, transposed,
    its first ``ffn/TP`` rows the gate (TP shard ``t`` of ``2 x TP``), the rest the up
    projection (shard ``TP + t``). ``weight2`` is ``[local x ffn/TP, hidden]``, read as
    ``view(local, ffn/TP, hidden)`` and transposed: expert j's fc2 is block j transposed, TP
    split along its ffn columns. Global expert = ``e x local + j``.

    Raises ``_Mismatch`` naming grouped GEMM when the layout cannot be cut this way."""
    def refuse(why: str):
        raise _Mismatch(Problem("unsupported-layout", f"Megatron grouped GEMM experts "
                                f"({name.rsplit('.', 1)[1]}): {why}", f))

    layer = name[:-len("mlp.experts.weight1")]
    experts = args.get("num_experts")
    if not experts:
        r = next((v for k, v in sd.items() if k.endswith(".mlp.router.weight")
                  and isinstance(v, TensorRef)), None)
        experts = r.shape[0] if r is not None and len(r.shape) == 2 else None
    if not experts or experts % ep:
        refuse(f"the expert count ({experts}) is unknown or does not divide by EP={ep}")
    if etp != tp:
        refuse(f"expert tensor parallel size {etp} differs from TP={tp}")
    local = experts // ep
    shape, stride = tuple(ref.shape), tuple(ref.stride)
    if len(shape) != 2 or stride != (shape[1], 1):
        refuse(f"{list(shape)} with strides {list(stride)} is not a contiguous matrix")
    size = ITEMSIZE[ref.dtype]
    if which == "linear_fc1":
        hidden, width = shape[0], shape[1] // local if shape[1] % local == 0 else 0
        ffn_tp = width // 2 if swiglu else width
        if not width or (swiglu and width % 2):
            refuse(f"{list(shape)} does not hold {local} experts of [hidden, gate + up]")
    else:
        hidden, ffn_tp = shape[1], shape[0] // local if shape[0] % local == 0 else 0
        if not ffn_tp:
            refuse(f"{list(shape)} does not hold {local} experts of [ffn, hidden]")
    ffn = ffn_tp * tp
    for j in range(local):
        g = e * local + j
        out = f"{layer}mlp.experts.local_experts.{g}.{which}.weight"
        if which == "linear_fc1":
            base = ref.byte_offset + j * hidden * width * size
            glob = ((2 if swiglu else 1) * ffn, hidden)
            parts = [(0, t * ffn_tp)] + ([(ffn_tp, ffn + t * ffn_tp)] if swiglu else [])
            pieces = [Piece(f, base + col * size, ref.dtype, (ffn_tp, hidden), (1, width),
                            (row, 0), rank, coord) for col, row in parts]
            what = "gate and up" if swiglu else "rows"
        else:
            base = ref.byte_offset + j * ffn_tp * hidden * size
            glob = (hidden, ffn)
            pieces = [Piece(f, base, ref.dtype, (hidden, ffn_tp), (1, hidden), (0, t * ffn_tp),
                            rank, coord)]
            what = "columns"
        info = mt.get(out)
        if info is not None and info.dtype != ref.dtype:
            raise _Mismatch(Problem("dtype-mismatch", f"{out} is {ref.dtype} here, "
                                    f"{info.dtype} on another rank", f))
        if info is None:
            placement = (f"EP expert {g} of grouped GEMM {name.rsplit('.', 1)[1]} "
                         "(transposed)" + (f"; TP Shard of {what}" if tp > 1 else ""))
            info = mt[out] = TensorInfo(out, glob, ref.dtype, placement, source=name)
        info.pieces.extend(pieces)


class _Mismatch(Exception):
    def __init__(self, problem: Problem):
        self.problem = problem


def _check_replicas(replicas: dict[str, list[Piece]], layout: CheckpointLayout) -> None:
    """Compare the bytes of small replicated tensors across the ranks that hold them."""
    for key, pieces in replicas.items():
        first = pieces[0]
        if len(pieces) < 2 or first.nbytes > REPLICA_CHECK_BYTES or not first.contiguous:
            continue
        want = _read_bytes(first)
        for p in pieces[1:]:
            if p.shape == first.shape and p.contiguous and want is not None \
                    and _read_bytes(p) != want:
                layout.problems.append(Problem(
                    "replica-mismatch", f"{key.rsplit('@', 1)[0]} differs from its copy in "
                    f"{Path(first.file).parent.name}: replicas must be identical", p.file))


def _read_bytes(p: Piece) -> bytes | None:
    try:
        with open(p.file, "rb") as fh:
            return os.pread(fh.fileno(), p.nbytes, p.byte_offset)
    except OSError:
        return None


def _config_dir(path: Path, d: Path) -> Path | None:
    for c in (d / "huggingface", path / "huggingface", d.parent / "huggingface",
              path.parent / "huggingface"):
        if (c / "config.json").is_file():
            return c
    return None
