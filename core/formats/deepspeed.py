"""DeepSpeed ZeRO checkpoints (stages 1, 2 and 3), read without importing deepspeed.

Format facts (DeepSpeed's ``utils/zero_to_fp32.py`` and ``runtime/engine.py``; FORMATS.md;
checked on checkpoints written by DeepSpeed 0.19 on the CPU accelerator): a folder with
``latest`` (the tag) and ``<tag>/`` holding
- stage <= 2: ``mp_rank_00_model_states.pt`` (``module``: the module's state dict in the training
  dtype, ``param_shapes``: one ordered name -> shape dict per parameter group, the only source of
  names, shapes and order; ``buffer_names``; ``shared_params``: tied names) and per data-parallel
  rank ``[bf16_]zero_pp_rank_{r}_mp_rank_00_optim_states.pt`` whose ``optimizer_state_dict``
  holds ``single_partition_of_fp32_groups``: this rank's slice of each group's flat fp32 master.
  A group's master is the ranks' slices concatenated, split in ``param_shapes`` order; padding
  only at the group's tail.
- stage 3: ``zero_pp_rank_{r}_mp_rank_00_model_states.pt`` per rank (``module`` entries are
  empty placeholders) and the optimizer files with ``fp32_flat_groups``; each parameter, in
  ``param_shapes`` order, contributes ``ceil(numel / W)`` elements per rank (the last rank
  padded), so the full parameter is the ranks' pieces concatenated and truncated to ``numel``.
Every piece is a range of the flattened parameter (``TensorInfo.flat``).

Beyond that (DeepSpeed 0.19 ``runtime/engine.py``, ``runtime/pipe/module.py``,
``module_inject/layers.py``, ``checkpoint/ds_to_universal.py``, checked on real files):
frozen parameters live outside the flat groups (see :func:`_frozen`); the model states record
``mp_world_size`` and ``checkpoint_parallel_dimensions`` (``pp_degree``, ``tp_degree``); a
``PipelineModule`` run has one ``mp_rank_{stage:02d}`` per stage (names ``<layer>.<param>``,
module weights in ``layer_XX[-model_YY]-model_states.pt``); an AutoTP run one ``mp_rank_{t}``
per TP rank with ``universal_checkpoint_info`` (its affine map, :func:`_autotp`); a universal
checkpoint ``zero/<name>/fp32.pt`` per parameter (:func:`_universal`).
"""

from __future__ import annotations

import math
import re
from pathlib import Path

from ..errors import BadCheckpointError
from ..layout import CheckpointLayout, Piece, Problem, TensorInfo, coverage_problems
from ..phases import phase, progressed
from .common import attach_config, contained, problem_for, same_data_groups, stat_file
from .torchsave import Record, TensorRef, read_torch_archive

OPTIM_RE = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
MODEL3_RE = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt$")
MODEL_RE = re.compile(r"^mp_rank_(\d+)_model_states\.pt$")
#: a PipelineModule layer's weights: ``layer_{idx:02d}[-{rank_repr}]-model_states.pt``, where
#: rank_repr names the non-data, non-pipe topology axes (``model_00``); ``runtime/pipe/module.py``
#: ``ckpt_layer_path``
LAYER_RE = re.compile(r"^layer_(\d+)(?:-model_(\d+))?-model_states\.pt$")
#: DeepSpeed MoE: ``layer_{l}_expert_{e}_mp_rank_{mp:02d}_model_states.pt`` (older:
#: ``expert_{e}_mp_rank_*``) and ``expp_rank_{r}_mp_rank_*_optim_states.pt``
#: (``runtime/engine.py`` ``_get_expert_ckpt_name``, ``_get_optimizer_ckpt_name``)
MOE_RE = re.compile(r"^((layer_\d+_)?expert_\d+_mp_rank_\d+_model_states|"
                    r"expp_rank_\d+_mp_rank_\d+_optim_states)\.pt$")
MODEL2 = "mp_rank_00_model_states.pt"


def _is_ds_file(name: str) -> bool:
    return bool(OPTIM_RE.match(name) or MODEL_RE.match(name) or MODEL3_RE.match(name)
                or MOE_RE.match(name))


def _is_tag_dir(d: Path) -> bool:
    """True for a folder of DeepSpeed rank files, or a ``ds_to_universal`` output (``zero/``
    beside the copied model states)."""
    names = [n.name for n in d.iterdir()]
    return any(_is_ds_file(n) for n in names) and (
        any(OPTIM_RE.match(n) or MOE_RE.match(n) for n in names) or (d / "zero").is_dir()
        or any(MODEL_RE.match(n) for n in names))


def _tag_dir(path: Path) -> Path | None:
    """The folder holding the rank files: ``path`` itself, or ``path/<tag>`` for the tag named
    by ``latest`` (or ``latest_universal``, which ``ds_to_universal`` writes)."""
    try:
        if _is_tag_dir(path):
            return path
        stale = None
        for latest in (path / "latest", path / "latest_universal"):
            if latest.is_file():
                tag = latest.read_text().strip()
                d = contained(path, tag, latest.name, latest)
                if d.is_dir() and _is_tag_dir(d):
                    return d
                if stale is None and not d.exists():
                    stale = (latest, tag)
        if stale is not None and any(_is_tag_dir(c) for c in path.iterdir() if c.is_dir()):
            # a DeepSpeed folder whose `latest` names a step that is not here (deleted,
            # not copied): say so, never "not a checkpoint"
            steps = sorted(c.name + "/" for c in path.iterdir() if c.is_dir() and _is_tag_dir(c))
            raise BadCheckpointError(
                f"names {stale[1]!r}, which is missing; the step folders here: "
                + ", ".join(steps) + " (give one of them as PATH)", str(stale[0]))
    except (OSError, UnicodeDecodeError):
        return None
    return None


def sniff(path: str) -> bool:
    """True for a DeepSpeed checkpoint folder (with ``latest``) or one of its step folders
    (also when ``latest`` names a folder outside it: the reader then refuses, naming it)."""
    try:
        return _tag_dir(Path(path)) is not None
    except BadCheckpointError:
        return True


def _get(d, key, default=None):
    if isinstance(d, dict):
        return d.get(key, default)
    if isinstance(d, Record):
        return d.get(key, default)
    return default


def _has(d, key) -> bool:
    return isinstance(d, dict) and key in d


def _flat_groups(osd, path: str) -> list[TensorRef]:
    for key in ("single_partition_of_fp32_groups", "fp32_flat_groups"):
        groups = _get(osd, key)
        if groups is not None:
            if not all(isinstance(g, TensorRef) for g in groups):
                raise BadCheckpointError(f"{key} holds non-tensors", path)
            return list(groups)
    raise BadCheckpointError("no fp32 master partitions (single_partition_of_fp32_groups or "
                             "fp32_flat_groups) in the optimizer state", path)


def _piece(ref: TensorRef, start: int, n: int, global_off: int, rank: int, path: str) -> Piece:
    """Elements [start, start+n) of a rank's flat partition as a piece at ``global_off`` of the
    flattened parameter."""
    from ..dtypes import ITEMSIZE

    if len(ref.shape) != 1 or start + n > ref.shape[0]:
        raise BadCheckpointError(f"a flat partition of {ref.shape} cannot hold elements "
                                 f"[{start}, {start + n})", path)
    off = ref.byte_offset + start * ITEMSIZE[ref.dtype] * ref.stride[0]
    return Piece(path, off, ref.dtype, (n,), (ref.stride[0],), (global_off,), rank)


def _whole(ref: TensorRef, path: str, rank: int = 0) -> Piece:
    return Piece(path, ref.byte_offset, ref.dtype, ref.shape, ref.stride,
                 (0,) * len(ref.shape), rank)


def _int(v) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _zero_stage(osd, model_states) -> int | None:
    """The ZeRO stage: the optimizer state's ``zero_stage`` (a ``ZeroStageEnum`` record),
    else the saved ``ds_config``'s ``zero_optimization.stage`` (DeepSpeed's ``BF16_Optimizer``,
    used for bf16 at stage 0/1, writes no ``zero_stage``; ``runtime/bf16_optimizer.py``)."""
    zs = _get(osd, "zero_stage")
    zs = zs.args[0] if isinstance(zs, Record) and zs.args else zs
    if _int(zs) is not None:
        return zs
    cfg = _get(model_states, "ds_config")
    zo = _get(cfg, "zero_optimization")
    zs = _get(zo, "stage") if zo is not None else None
    zs = zs.args[0] if isinstance(zs, Record) and zs.args else zs
    return _int(zs)


def read(path: str, weights: str = "master", hf_config: str | None = None) -> CheckpointLayout:
    """Layout of a ZeRO checkpoint: with ``weights="master"`` the fp32 master weights as flat
    pieces of the optimizer partitions, the frozen parameters (``requires_grad=False``) from the
    model states, plus buffers from the module state; with ``"module"`` the module's own weights
    as trained (stages 1 and 2 keep them whole in ``mp_rank_*_model_states.pt`` or a pipeline's
    ``layer_*-model_states.pt``; stage 3 does not, which is a ``BadCheckpointError``).

    Pipeline parallelism (``PipelineModule``: one ``mp_rank_{stage}`` per pipeline stage, as
    the model states' ``checkpoint_parallel_dimensions``/``mp_world_size`` say) merges as the
    union of the stages; AutoTP tensor parallelism (ZeRO 1/2) by the affine map it records. A
    universal checkpoint (``ds_to_universal``'s ``zero/``) gives one full tensor per parameter.
    Refused by name (error problems): other tensor parallelism (``unsupported-tp``), DeepSpeed
    MoE expert files (``unsupported-moe``), frozen parameters excluded at save time
    (``frozen-excluded``), a run without ZeRO (``unsupported-layout``). ``hf_config``: the Hugging Face config folder to use (default: the
    checkpoint's ``huggingface/`` or a ``config.json`` beside it).
    Problems: missing or unreadable rank files, partitions whose sizes do not add up
    (``partition-mismatch``)."""
    root = Path(path)
    d = _tag_dir(root)
    if d is None:
        raise BadCheckpointError("no zero_pp_rank_*_optim_states.pt files", path)
    layout = CheckpointLayout(format="deepspeed", path=str(root), world_size=0)
    names = sorted(n.name for n in d.iterdir())
    optim: dict[tuple[int, int], str] = {}
    model3: dict[tuple[int, int], str] = {}
    model2: dict[int, str] = {}
    layer_files: dict[int, str] = {}
    moe = [n for n in names if MOE_RE.match(n)]
    for n in names:
        if m := OPTIM_RE.match(n):
            optim[int(m[3]), int(m[2])] = str(d / n)
        elif m := MODEL3_RE.match(n):
            model3[int(m[2]), int(m[1])] = str(d / n)
        elif m := MODEL_RE.match(n):
            model2[int(m[1])] = str(d / n)
        elif (m := LAYER_RE.match(n)) and int(m[2] or 0) == 0:
            layer_files[int(m[1])] = str(d / n)
    layer_tp = {int(m[2]) for n in names if (m := LAYER_RE.match(n)) and m[2]}
    universal = not optim and not moe and (d / "zero").is_dir()
    if universal and weights == "module":
        raise BadCheckpointError("a DeepSpeed universal checkpoint (ds_to_universal) keeps no "
                                 "module weights; merge its fp32 weights instead", str(d))
    model_file = model2.get(0) or model3.get((0, 0))
    if model_file is None:
        raise BadCheckpointError(f"no {MODEL2} or zero_pp_rank_0_mp_rank_00_model_states.pt",
                                 str(d))
    layout.files.append(stat_file(model_file))
    try:
        model_states = read_torch_archive(model_file).root
    except BadCheckpointError as e:
        layout.files[-1].status = "unreadable"
        layout.problems.append(problem_for(e, model_file))
        return layout
    _attach(layout, hf_config, root, d)
    if universal:
        return _universal(layout, d, model_states, model_file)
    if moe:
        layout.problems.append(Problem(
            "unsupported-moe", f"DeepSpeed MoE (expert parallelism: {moe[0]} and {len(moe) - 1} "
            "more expert files) is not supported", str(d / moe[0])))
        return layout
    if not optim and not model3 and _get(model_states, "param_shapes") is None:
        layout.problems.append(Problem(
            "unsupported-layout", "a DeepSpeed checkpoint saved without ZeRO (no "
            "zero_pp_rank_*_optim_states.pt beside it) is not supported", model_file))
        return layout
    # model parallelism: mp_world_size = pp x tp (runtime/engine.py _checkpoint_parallel_metadata)
    mpw = max([_int(_get(model_states, "mp_world_size")) or 1]
              + [m + 1 for m, _ in optim] + [m + 1 for m in model2] + [m + 1 for m, _ in model3])
    dims = _get(model_states, "checkpoint_parallel_dimensions")
    tp = _int(_get(dims, "tp_degree")) if dims is not None else None
    pp = _int(_get(dims, "pp_degree")) if dims is not None else None
    if tp is None:  # older DeepSpeed: a pipeline's layer files name the model axis, if any
        tp = (max(layer_tp) + 1 if layer_tp else 1) if layer_files or layer_tp else mpw
        pp = mpw // tp
    pp = pp or 1
    uc = _get(model_states, "universal_checkpoint_info")
    affine = _get(_get(uc, "affine_map"), "params") if uc is not None else None
    if tp > 1 and not (pp == 1 and tp == mpw and isinstance(affine, dict)
                       and _get(_get(uc, "affine_map"), "version") == 1):
        layout.world_size = mpw
        layout.parallel = {"tp": tp, "pp": pp}
        how = ("the checkpoint's AutoTP rules (universal_checkpoint_info) have no affine map "
               "version 1; convert it with DeepSpeed's ds_to_universal and merge that"
               if uc is not None else
               "the checkpoint records no rule to join the tensor-parallel ranks' slices")
        layout.problems.append(Problem(
            "unsupported-tp", f"DeepSpeed tensor parallelism (tp_degree {tp}, mp_world_size "
            f"{mpw}) is not supported: {how}", model_file))
        return layout
    if pp * tp != mpw:  # never guess which model-parallel ranks are stages and which slices
        layout.world_size = mpw
        layout.problems.append(Problem(
            "unsupported-model-parallel", f"model parallelism of unknown kind: the model states "
            f"say pp_degree {pp} x tp_degree {tp}, but mp_world_size {mpw}", model_file))
        return layout
    stage = None
    dp = _int(_get(model_states, "dp_world_size"))
    ranks_found = 1 + max((r for _, r in optim), default=0)
    world = max(dp or 0, ranks_found)
    if dp and dp < ranks_found:
        layout.problems.append(Problem("world-size-mismatch", f"the model states say "
                                       f"dp_world_size {dp}, optimizer files go to rank "
                                       f"{ranks_found - 1}", model_file))
    prefix = "bf16_" if any(Path(f).name.startswith("bf16_") for f in optim.values()) else ""
    stages: list[dict] = []  # per pipeline stage: model states, groups by dp rank, files
    stages_seen: dict[int, str] = {}  # ZeRO stage -> the first optimizer file that says it
    for s in range(mpw):  # pipeline stages, or AutoTP ranks
        progressed(s * world, mpw * world, layout, what="optimizer files")
        st = {"model_file": None, "states": None, "groups": {}, "optim": {}, "model3": {}}
        stages.append(st)
        mf = model2.get(s) or model3.get((s, 0)) or str(d / f"mp_rank_{s:02d}_model_states.pt")
        if s == 0:
            st["model_file"], st["states"] = model_file, model_states
        else:
            sf = stat_file(mf)
            layout.files.append(sf)
            if sf.status == "missing":
                layout.problems.append(Problem(
                    "missing-stage", (f"pipeline stage {s} of {pp}" if pp > 1 else
                                      f"tensor-parallel rank {s} of {tp}")
                    + ": no model states file", mf))
            else:
                try:
                    st["model_file"], st["states"] = mf, read_torch_archive(mf).root
                except BadCheckpointError as e:
                    sf.status = "unreadable"
                    layout.problems.append(problem_for(e, mf))
        for r in range(world):
            fpath = optim.get((s, r), str(d / f"{prefix}zero_pp_rank_{r}_mp_rank_{s:02d}_"
                                               "optim_states.pt"))
            st["optim"][r] = fpath
            sf = stat_file(fpath, r)
            layout.files.append(sf)
            what = f"rank {r} of {world}" + (f", pipeline stage {s}" if pp > 1 else
                                              f", tensor-parallel rank {s}" if tp > 1 else "")
            if sf.status == "missing":
                layout.problems.append(Problem("missing-rank", f"{what}: no optimizer file",
                                               fpath))
                continue
            phase(f"reading optimizer files: {what}")
            progressed(s * world + r, mpw * world, layout, what="optimizer files")
            try:
                osd = _get(read_torch_archive(fpath).root, "optimizer_state_dict")
                st["groups"][r] = _flat_groups(osd, fpath)
                st.setdefault("slices", {})[r] = _get(osd, "param_slice_mappings")
                mine = _zero_stage(osd, None)
                if mine is not None and stages_seen and mine not in stages_seen:
                    other, first = next(iter(stages_seen.items()))
                    layout.problems.append(Problem(
                        "rank-disagreement", f"ZeRO stage {mine} in this optimizer file, "
                        f"{other} in {Path(first).name}: a file of another run?", fpath))
                if mine is not None:
                    stages_seen.setdefault(mine, fpath)
                stage = stage or _zero_stage(osd, model_states)
            except BadCheckpointError as e:
                sf.status = "unreadable"
                layout.problems.append(problem_for(e, fpath))
    for st in stages:  # a rank's optimizer file copied under another rank's name
        read_ok = {r: st["optim"][r] for r in st["groups"]}
        for group in same_data_groups(read_ok):
            for r in group[1:]:
                layout.problems.append(Problem(
                    "duplicate-rank", f"holds the same tensor bytes as rank {group[0]}'s "
                    f"optimizer file ({Path(read_ok[group[0]]).name}): every rank's partition "
                    f"differs; a copy of that file under rank {r}'s name? rank {r}'s partition "
                    "is missing", read_ok[r]))
    if stage is None:
        stage = _zero_stage(None, model_states) or (3 if model3 else 1)
    if stage >= 3:  # every dp rank's model states hold its fragments of the frozen parameters
        for s, st in enumerate(stages):
            for r in range(world):
                mf = model3.get((s, r), str(d / f"zero_pp_rank_{r}_mp_rank_{s:02d}_"
                                                 "model_states.pt"))
                st["model3"][r] = mf
                if s == 0 and r == 0:
                    st["model3"][r] = (mf, model_states)
                    continue
                sf = stat_file(mf, r)
                layout.files.append(sf)
                if sf.status == "missing":
                    layout.problems.append(Problem("missing-rank", f"rank {r} of {world}: no "
                                                   "model states file", mf))
                    continue
                try:
                    st["model3"][r] = (mf, read_torch_archive(mf).root)
                except BadCheckpointError as e:
                    sf.status = "unreadable"
                    layout.problems.append(problem_for(e, mf))
    layout.world_size = world * mpw
    layout.files.extend(stat_file(f) for _, f in sorted(layer_files.items()))
    layout.parallel = ({"dp": world} if stage < 3 else {"fsdp": world}) | (
        {"pp": pp} if pp > 1 else {}) | ({"tp": tp} if tp > 1 else {})
    if tp > 1 and (weights == "module" or stage >= 3):
        layout.problems.append(Problem(
            "unsupported-tp", f"DeepSpeed tensor parallelism (AutoTP, tp_degree {tp}) is "
            "supported for the fp32 master weights of ZeRO stages 1 and 2 only" + (
                f", not stage {stage}" if stage >= 3 else ", not --weights module"), model_file))
        return layout
    if weights == "module":
        return _module_weights(layout, stages, layer_files, stage)
    train = "bf16" if prefix else _module_dtype(model_states, layer_files)
    layout.notes.append(f"ZeRO stage {stage}; data-parallel world size {world}"
                        + (f"; {pp} pipeline stages (PipelineModule)" if pp > 1 else "")
                        + (f"; AutoTP tensor parallelism {tp}" if tp > 1 else "")
                        + f"; training weights {train}, merged from the fp32 master copy")
    if layout.errors:
        return layout
    pipe_module = None  # a pipeline's module weights, from its layer files
    if pp > 1:
        pipe_module, problems = _layer_module(layer_files)
        layout.problems.extend(problems)
    shapes_of = []
    for st in stages:
        param_shapes = _get(st["states"], "param_shapes")
        if param_shapes is None:
            raise BadCheckpointError("no param_shapes in the model states", st["model_file"])
        shapes_of.append([param_shapes] if isinstance(param_shapes, dict) else param_shapes)
    if tp > 1:
        _autotp(layout, world, stages, shapes_of, affine, tp)
        probe = CheckpointLayout(format="deepspeed", path=layout.path, world_size=world)
        if _frozen(probe, stage, world, stages[0], set(layout.tensors), None) or any(
                p.code == "frozen-excluded" for p in probe.problems):
            layout.problems.append(Problem(
                "unsupported-tp", "frozen parameters with DeepSpeed tensor parallelism (AutoTP) "
                "are not supported", model_file))
        _buffers_and_shared(layout, model_states, model_file, None)
        if not layout.errors:
            for t in layout.tensors.values():
                layout.problems.extend(coverage_problems(t))
        return layout
    tied = []
    for st, param_shapes in zip(stages, shapes_of):
        earlier = dict(layout.tensors)
        if stage <= 2:
            _stage2(layout, world, param_shapes, st["groups"], st["optim"], st.get("slices"))
        else:
            _stage3(layout, world, param_shapes, st["groups"], st["optim"])
        # a tied layer (TiedLayerSpec) is in every stage that uses it: keep the first stage's
        tied += [k for k in earlier if layout.tensors[k] is not earlier[k]]
        layout.tensors.update(earlier)
    if tied:
        layout.notes.append(f"{len(tied)} parameter(s) held by several pipeline stages (tied "
                            f"layers), taken from the first: {', '.join(tied[:4])}")
    trained = set(layout.tensors)
    frozen_n = 0
    for st in stages:
        frozen_n += _frozen(layout, stage, world, st, trained, pipe_module)
        _buffers_and_shared(layout, st["states"], st["model_file"], pipe_module)
    if frozen_n:
        layout.notes.append(f"{frozen_n} frozen parameter(s) (requires_grad=False) taken from "
                            "the model states as saved, in the training dtype")
    if not layout.errors:
        for t in layout.tensors.values():
            layout.problems.extend(coverage_problems(t))
    return layout


def _universal(layout, d: Path, model_states, model_file: str) -> CheckpointLayout:
    """A universal checkpoint (``checkpoint/ds_to_universal.py``): ``zero/<name>/fp32.pt`` per
    parameter, a ``torch.save`` of ``{"param": the full fp32 tensor, ...}`` (tensor-parallel
    slices already joined, ``cat_dim`` recorded beside it), next to copies of the model states
    (``param_shapes``, ``frozen_param_shapes``, buffers). Every parameter the model states name
    must have its file."""
    layout.world_size = 1
    layout.notes.append("DeepSpeed universal checkpoint (ds_to_universal): one full fp32 tensor "
                        "per parameter in zero/<name>/fp32.pt")
    want: dict[str, tuple] = {}
    for shapes in _get(model_states, "param_shapes") or ():
        if isinstance(shapes, dict):
            want.update({k: tuple(v) for k, v in shapes.items()})
    frozen = _get(model_states, "frozen_param_shapes")
    if isinstance(frozen, dict):
        want.update({k: tuple(v) for k, v in frozen.items()})
    for sub in sorted((d / "zero").iterdir()):
        f = contained(d, Path("zero", sub.name, "fp32.pt"), f"universal parameter {sub.name}")
        if not sub.is_dir() or (sub.name not in want and not f.is_file()):
            continue
        sf = stat_file(str(f))
        layout.files.append(sf)
        if sf.status == "missing":
            continue
        try:
            ref = _get(read_torch_archive(str(f)).root, "param")
            if not isinstance(ref, TensorRef) or not ref.fits_storage():
                raise BadCheckpointError("no 'param' tensor", str(f))
        except BadCheckpointError as e:
            sf.status = "unreadable"
            layout.problems.append(problem_for(e, str(f)))
            continue
        if sub.name in want and want[sub.name] != tuple(ref.shape):
            layout.problems.append(Problem("shape-mismatch", f"{sub.name}: fp32.pt holds "
                                           f"{ref.shape}, the model states say "
                                           f"{want[sub.name]}", str(f)))
            continue
        layout.tensors[sub.name] = TensorInfo(sub.name, tuple(ref.shape), ref.dtype,
                                              "universal", [_whole(ref, str(f))])
    for name in want:
        if name not in layout.tensors and not any(p.path and f"/{name}/" in p.path
                                                  for p in layout.problems):
            layout.problems.append(Problem("missing-tensor", f"{name}: named by the model "
                                           "states, no zero/<name>/fp32.pt",
                                           str(d / "zero" / name / "fp32.pt")))
    if (_get(model_states, "frozen_param_shapes") is None
            and _has(model_states, "frozen_param_shapes")
            and (_zero_stage(None, model_states) or 0) >= 2):
        layout.problems.append(Problem(
            "frozen-excluded", "frozen parameters were excluded at save time "
            "(save_checkpoint(exclude_frozen_parameters=True)): the model states hold no "
            "frozen_param_shapes, so the frozen ones' names and values are lost", model_file))
    _buffers_and_shared(layout, model_states, model_file, None)
    if not layout.errors:
        for t in layout.tensors.values():
            layout.problems.extend(coverage_problems(t))
    return layout


def _contiguous(shape) -> tuple[int, ...]:
    return tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))


def _unravel(offset: int, shape) -> tuple[int, ...]:
    return tuple((offset // st) % n if n else 0 for st, n in zip(_contiguous(shape), shape))


def _autotp(layout, world, stages, shapes_of, affine, tp) -> None:
    """AutoTP: each TP rank's flat fp32 master (``param_shapes`` hold its slice shapes) placed
    by the affine map AutoTP records in ``universal_checkpoint_info`` (DeepSpeed's
    ``checkpoint/affine.py``, ``module_inject/layers.py``): per parameter (a regex) its
    ``logical_shape`` and per rank ``pieces``, each a box of ``shape`` read at ``dest``
    (offset, strides) in the rank's slice and written at ``source`` in the full tensor;
    ``locations``: the ranks holding the same box (a replicated one is taken from the lowest)."""
    rules = [(re.compile(p), spec) for p, spec in affine.items() if isinstance(p, str)]
    for t, (st, param_shapes) in enumerate(zip(stages, shapes_of)):
        shard = CheckpointLayout(format="deepspeed", path=layout.path, world_size=world)
        _stage2(shard, world, param_shapes, st["groups"], st["optim"])
        layout.problems.extend(shard.problems)
        for name, sh in shard.tensors.items():
            spec = next((sp for rx, sp in rules if rx.fullmatch(name)), None)
            rank = _get(_get(spec, "ranks"), t) if spec is not None else None
            if rank is None or tuple(_get(rank, "shard_shape") or ()) != sh.shape:
                layout.problems.append(Problem(
                    "unsupported-tp", f"{name}: AutoTP's affine map has no entry for "
                    f"tensor-parallel rank {t}'s {sh.shape} slice", st["model_file"]))
                continue
            logical = tuple(spec["logical_shape"])
            ti = layout.tensors.setdefault(name, TensorInfo(name, logical, sh.dtype,
                                                            f"AutoTP, {tp} ranks"))
            for ap in rank["pieces"]:
                if min(ap["locations"]) != t:
                    continue
                (soff, sstr), (doff, dstr) = ap["source"], ap["dest"]
                box = tuple(ap["shape"])
                if (len(logical) > 2 or tuple(sstr) != _contiguous(logical)
                        or tuple(dstr) != _contiguous(sh.shape)
                        or any(p.stride[0] != 1 for p in sh.pieces)):
                    layout.problems.append(Problem(
                        "unsupported-tp", f"{name}: an AutoTP piece with strides {sstr}/{dstr} "
                        "is not supported", st["model_file"]))
                    break
                for fp in sh.pieces:
                    ti.pieces.extend(_boxes(fp, sh.shape, _unravel(doff, sh.shape), box,
                                            _unravel(soff, logical)))


def _boxes(fp: Piece, shard: tuple, dst: tuple, box: tuple, src: tuple) -> list[Piece]:
    """The parts of flat piece ``fp`` (elements [a, b) of a C-contiguous 1-D or 2-D ``shard``)
    inside the ``box`` at ``dst`` of the shard, as pieces at ``src + (position - dst)`` of the
    full tensor: one range (1-D), or up to a partial first row, a block of whole rows and a
    partial last row (2-D)."""
    from ..dtypes import ITEMSIZE

    size = ITEMSIZE[fp.dtype]
    a = fp.global_offsets[0]
    b = a + fp.shape[0]

    def at(flat: int, shape: tuple, stride: tuple, goff: tuple) -> Piece:
        return Piece(fp.file, fp.byte_offset + (flat - a) * size, fp.dtype, shape, stride, goff,
                     fp.rank)

    if len(shard) == 1:
        lo, hi = max(a, dst[0]), min(b, dst[0] + box[0])
        return [at(lo, (hi - lo,), (1,), (src[0] + lo - dst[0],))] if lo < hi else []
    cols = shard[1]
    (dr, dc), (nr, nc) = dst, box
    first, last = max(dr, a // cols), min(dr + nr - 1, (b - 1) // cols)
    out: list[Piece] = []
    full0 = max(first, -(-(a - dc) // cols))
    full1 = min(last, (b - dc - nc) // cols)
    if full0 <= full1:
        out.append(at(full0 * cols + dc, (full1 - full0 + 1, nc), (cols, 1),
                      (src[0] + full0 - dr, src[1])))
    for r in range(first, last + 1):
        if full0 <= r <= full1:
            continue
        lo, hi = max(a, r * cols + dc), min(b, r * cols + dc + nc)
        if lo < hi:
            out.append(at(lo, (1, hi - lo), (cols, 1),
                          (src[0] + r - dr, src[1] + lo - r * cols - dc)))
    return out


def _attach(layout, hf_config, root, d) -> None:
    if hf_config:
        attach_config(layout, hf_config)
        return
    places = [root / "huggingface", root, d]
    if d == root and ((root.parent / "latest").is_file()
                      or (root.parent / "zero_to_fp32.py").is_file()):
        # PATH is a step folder (or --tag): DeepSpeed's save_checkpoint dir holding `latest`
        # is its parent, where the run's config sits beside the step folders
        places += [root.parent / "huggingface", root.parent]
    for c in places:
        if (c / "config.json").is_file():
            attach_config(layout, c)
            break


def _layer_module(layer_files: dict[int, str]) -> tuple[dict[str, tuple[TensorRef, str]],
                                                       list[Problem]]:
    """A pipeline's module weights: each ``layer_XX-model_states.pt`` holds layer XX's state
    dict, whose keys PipelineModule names ``"XX.<key>"`` (``runtime/pipe/module.py``
    ``save_state_dict``; the layers are registered under their index)."""
    out: dict[str, tuple[TensorRef, str]] = {}
    problems: list[Problem] = []
    for idx, f in sorted(layer_files.items()):
        try:
            sd = read_torch_archive(f).root
        except BadCheckpointError as e:
            problems.append(problem_for(e, f))
            continue
        for k, ref in (sd.items() if isinstance(sd, dict) else ()):
            if isinstance(ref, TensorRef) and ref.fits_storage():
                out[f"{idx}.{k}"] = (ref, f)
    return out, problems


def _module_of(st, pipe_module) -> dict[str, tuple[TensorRef, str]]:
    """The stage's module weights as ``name -> (tensor, file)``: the pipeline's layer files
    when given, else the model states' ``module``."""
    if pipe_module is not None:
        return pipe_module
    module = _get(st["states"], "module") or {}
    return {k: (v, st["model_file"]) for k, v in (module.items() if isinstance(module, dict)
                                                  else ()) if isinstance(v, TensorRef)}


def _frozen(layout, stage, world, st, trained, pipe_module) -> int:
    """Add the stage's frozen parameters (those not in ``trained``, the names of every stage's
    flat groups); return how many.

    Facts from DeepSpeed's ``runtime/engine.py`` (``_save_checkpoint``,
    ``_get_zero_frozen_param_attributes``) and ``utils/zero_to_fp32.py``
    (``_zero2_merge_frozen_params``, ``_zero3_merge_frozen_params``): parameters the optimizer
    does not own (``requires_grad=False``) are in no flat group. From stage 2 on the model
    states hold ``frozen_param_shapes`` (name -> shape) and ``frozen_param_fragments``: the
    whole tensor at stage 2, at stage 3 this rank's ``ceil(numel / W)`` elements (joined
    over ranks, cut to numel). Stage 1 (and stage 0/1 ``BF16_Optimizer``) saves neither: the
    module state dict (a pipeline's layer files) holds them. ``exclude_frozen_parameters=True``
    drops them everywhere; from stage 2 on ``frozen_param_shapes`` is then saved as None."""
    states = st["states"]
    if stage >= 2:
        shapes = _get(states, "frozen_param_shapes")
        if shapes is None:
            if _has(states, "frozen_param_shapes"):
                layout.problems.append(Problem(
                    "frozen-excluded", "frozen parameters were excluded at save time "
                    "(save_checkpoint(exclude_frozen_parameters=True)): the model states hold "
                    f"only the {len(trained)} trained parameters and not the frozen ones' names "
                    "or values; the merged model would lack them", st["model_file"]))
            return 0
        n = 0
        for name, shape in (shapes.items() if isinstance(shapes, dict) else ()):
            shape = tuple(shape)
            if name in layout.tensors:
                continue
            n += 1
            numel = math.prod(shape)
            if stage == 2:
                frag = _get(_get(states, "frozen_param_fragments"), name)
                if not isinstance(frag, TensorRef) or tuple(frag.shape) != shape:
                    layout.problems.append(Problem(
                        "missing-frozen", f"{name}: frozen_param_shapes names it {shape}, "
                        "frozen_param_fragments holds " + (f"{frag.shape}" if isinstance(
                            frag, TensorRef) else "no tensor"), st["model_file"]))
                    continue
                layout.tensors[name] = TensorInfo(name, shape, frag.dtype, "frozen",
                                                  [_whole(frag, st["model_file"])])
                continue
            part = -(-numel // world)
            t = TensorInfo(name, shape, "", "frozen, ZeRO-3", flat=True)
            for r in range(world):
                entry = st["model3"].get(r)
                if not isinstance(entry, tuple):
                    continue
                mf, rs = entry
                frag = _get(_get(rs, "frozen_param_fragments"), name)
                take = max(0, min(part, numel - r * part))
                if not isinstance(frag, TensorRef) or frag.shape[0:1] != (part,) or len(
                        frag.shape) != 1:
                    layout.problems.append(Problem(
                        "missing-frozen", f"{name}: rank {r}'s frozen_param_fragments should "
                        f"hold {part} elements, it holds " + (f"{frag.shape}" if isinstance(
                            frag, TensorRef) else "no tensor"), mf))
                    break
                t.dtype = frag.dtype
                if take:
                    t.pieces.append(_piece(frag, 0, take, r * part, r, mf))
            else:
                layout.tensors[name] = t
        return n
    module = _module_of(st, pipe_module)
    buffers = set(_get(states, "buffer_names") or ())
    n = 0
    for name, (ref, f) in module.items():
        if name in trained or name in buffers or name in layout.tensors:
            continue
        if not ref.fits_storage():
            layout.problems.append(Problem("unreadable-file", f"{name}: the module weight lies "
                                           "outside its storage", f))
            continue
        layout.tensors[name] = TensorInfo(name, ref.shape, ref.dtype, "frozen", [_whole(ref, f)])
        n += 1
    return n


def _module_weights(layout, stages, layer_files, stage) -> CheckpointLayout:
    if stage >= 3:
        raise BadCheckpointError("ZeRO stage 3 keeps no module weights (only placeholders); "
                                 "merge the fp32 master copy instead", stages[0]["model_file"])
    if len(stages) > 1 or (layer_files and not _get(stages[0]["states"], "module")):
        module, problems = _layer_module(layer_files)
        layout.problems.extend(problems)
    else:
        module = _module_of(stages[0], None)
    for name, (ref, f) in module.items():
        if ref.fits_storage():
            layout.tensors[name] = TensorInfo(name, ref.shape, ref.dtype, "module",
                                              [_whole(ref, f)])
    for st in stages:  # every trained parameter must have its module weight
        for shapes in _get(st["states"], "param_shapes") or ():
            for name in (shapes if isinstance(shapes, dict) else ()):
                if name not in layout.tensors:
                    layer = name.split(".", 1)[0]
                    where = (f"no layer_{int(layer):02d}-*model_states.pt holds it"
                             if layer_files is not None and layer.isdigit() and len(stages) > 1
                             else "the module weights lack it")
                    layout.problems.append(Problem("missing-tensor", f"{name}: in param_shapes, "
                                                   f"but {where}", st["model_file"]))
    layout.notes.append("module weights as trained (--weights module)")
    return layout


def _module_dtype(model_states, layer_files) -> str:
    """dtype of the module's weights as trained (stage <= 2 keeps them in the model states, a
    pipeline in its layer files)."""
    module = _get(model_states, "module") or {}
    refs = [v for v in (module.values() if isinstance(module, dict) else ())]
    if not refs and layer_files:
        try:
            sd = read_torch_archive(layer_files[min(layer_files)]).root
            refs = list(sd.values()) if isinstance(sd, dict) else []
        except BadCheckpointError:
            refs = []
    for v in refs:
        if isinstance(v, TensorRef):
            return {"F32": "fp32", "BF16": "bf16", "F16": "fp16"}.get(v.dtype, v.dtype)
    return "unknown"


def _stage2(layout, world, param_shapes, groups_by_rank, optim, slices=None) -> None:
    """ZeRO-1/2: each group's parameters flattened in order and cut into one partition per
    rank. ``slices``: each rank's ``param_slice_mappings`` (DeepSpeed >= 0.10: per group, the
    parameter fragments that rank's partition holds, ``fragment_address(numel, start)``), when
    saved; a file whose mappings name other fragments than its rank's place gives (a copy of
    another rank's file under this rank's name) is a ``rank-disagreement``."""
    for g, shapes in enumerate(param_shapes):
        parts = [groups_by_rank[r][g] for r in range(world)]
        sizes = [p.shape[0] for p in parts]
        starts = [sum(sizes[:r]) for r in range(world)]
        held: dict[int, dict[str, tuple[int, int]]] = {r: {} for r in range(world)}
        offset = 0
        for name, shape in shapes.items():
            shape = tuple(shape)
            n = math.prod(shape)
            t = TensorInfo(name, shape, parts[0].dtype, f"ZeRO-2 group {g}", flat=True)
            pos = offset
            while pos < offset + n:  # the range may cross rank boundaries
                r = max(i for i in range(world) if starts[i] <= pos)
                take = min(offset + n, starts[r] + sizes[r]) - pos
                if take <= 0:
                    break
                t.pieces.append(_piece(parts[r], pos - starts[r], take, pos - offset, r,
                                       optim[r]))
                held[r][name] = (pos - starts[r], take)
                pos += take
            layout.tensors[name] = t
            offset += n
        flagged = {p.path for p in layout.errors}
        for r in range(world):
            if optim[r] in flagged:  # already refused (e.g. duplicate-rank): one reason each
                continue
            said = _fragments((slices or {}).get(r), g)
            if said is None or not said.keys() & set(shapes):
                continue  # not saved, or names of another kind: nothing to compare
            wrong = sorted(k for k in said.keys() | held[r].keys()
                           if said.get(k) != held[r].get(k) and k in shapes)
            if wrong:
                k = wrong[0]
                here = (f"elements [{held[r][k][0]}, {sum(held[r][k])}) of {k}"
                        if k in held[r] else f"nothing of {k}")
                there = (f"elements [{said[k][0]}, {sum(said[k])}) of {k}" if k in said
                         else f"nothing of {k}")
                layout.problems.append(Problem(
                    "rank-disagreement", f"group {g}: by its param_slice_mappings this file "
                    f"holds {there}, but as rank {r}'s partition it holds {here} "
                    f"({len(wrong)} parameter(s) differ): a copy of another rank's file, or a "
                    "file of another run?", optim[r]))
        total = sum(sizes)
        if offset > total or total - offset >= 2 * world * 64:
            layout.problems.append(Problem(
                "partition-mismatch", f"group {g}: parameters need {offset} elements, the "
                f"partitions hold {total}", optim[0]))


def _fragments(mappings, g: int) -> dict[str, tuple[int, int]] | None:
    """Group ``g`` of a rank's ``param_slice_mappings`` as name -> (start, numel) in the
    rank's partition; None when not saved or not of the known form."""
    if not isinstance(mappings, (list, tuple)) or g >= len(mappings):
        return None
    group = mappings[g]
    if not hasattr(group, "items"):
        return None
    out = {}
    for name, frag in group.items():
        start, numel = _int(_get(frag, "start")), _int(_get(frag, "numel"))
        if not isinstance(name, str) or start is None or numel is None:
            return None
        out[name] = (start, numel)
    return out


def _stage3(layout, world, param_shapes, groups_by_rank, optim) -> None:
    flat = {r: groups_by_rank[r] for r in range(world)}
    # a rank's groups are consecutive in its flat space, in group order
    offsets = {r: 0 for r in range(world)}
    group_index = {r: 0 for r in range(world)}
    group_start = {r: 0 for r in range(world)}
    for shapes in param_shapes:
        for name, shape in shapes.items():
            shape = tuple(shape)
            n = math.prod(shape)
            part = -(-n // world)
            t = TensorInfo(name, shape, flat[0][0].dtype, "ZeRO-3", flat=True)
            for r in range(world):
                # move to the group that holds this offset
                while (group_index[r] < len(flat[r]) and offsets[r] - group_start[r]
                       >= flat[r][group_index[r]].shape[0]):
                    group_start[r] += flat[r][group_index[r]].shape[0]
                    group_index[r] += 1
                if group_index[r] >= len(flat[r]):
                    raise BadCheckpointError(f"{name}: rank {r}'s partitions end early",
                                             optim[r])
                take = max(0, min(part, n - r * part))
                if take:
                    t.pieces.append(_piece(flat[r][group_index[r]], offsets[r] - group_start[r],
                                           take, r * part, r, optim[r]))
                offsets[r] += part
            layout.tensors[name] = t


def _buffers_and_shared(layout, model_states, model_file, pipe_module) -> None:
    module = _module_of({"states": model_states, "model_file": model_file}, pipe_module)
    for name in _get(model_states, "buffer_names") or ():
        ref, f = module.get(name, (None, None))
        if isinstance(ref, TensorRef) and ref.fits_storage() and name not in layout.tensors:
            layout.tensors[name] = TensorInfo(name, ref.shape, ref.dtype, "buffer",
                                              [_whole(ref, f)])
    shared = _get(model_states, "shared_params") or {}
    pairs = shared.items() if isinstance(shared, dict) else shared
    for pair in pairs:
        try:
            alias, target = pair
        except (TypeError, ValueError):
            continue
        if target in layout.tensors and alias not in layout.tensors:
            src = layout.tensors[target]
            layout.tensors[alias] = TensorInfo(alias, src.shape, src.dtype,
                                               f"shared with {target}", list(src.pieces),
                                               src.flat)
