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
"""

from __future__ import annotations

import math
import re
from pathlib import Path

from ..errors import BadCheckpointError
from ..layout import CheckpointLayout, Piece, Problem, TensorInfo, coverage_problems
from .common import attach_config, contained, problem_for, stat_file
from .torchsave import Record, TensorRef, read_torch_archive

OPTIM_RE = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
MODEL3_RE = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt$")
MODEL2 = "mp_rank_00_model_states.pt"


def _tag_dir(path: Path) -> Path | None:
    """The folder holding the rank files: ``path`` itself, or ``path/<latest tag>``."""
    try:
        if any(OPTIM_RE.match(n.name) for n in path.iterdir()):
            return path
        latest = path / "latest"
        if latest.is_file():
            tag = latest.read_text().strip()
            d = contained(path, tag, "latest", latest)
            if d.is_dir() and any(OPTIM_RE.match(n.name) for n in d.iterdir()):
                return d
    except OSError:
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


def read(path: str, weights: str = "master") -> CheckpointLayout:
    """Layout of a ZeRO checkpoint: with ``weights="master"`` the fp32 master weights as flat
    pieces of the optimizer partitions, plus buffers from the module state; with ``"module"``
    the module's own weights as trained (stages 1 and 2 keep them whole in
    ``mp_rank_00_model_states.pt``; stage 3 does not, which is a ``BadCheckpointError``).
    Problems: missing or unreadable rank files, partitions whose sizes do not add up
    (``partition-mismatch``)."""
    root = Path(path)
    d = _tag_dir(root)
    if d is None:
        raise BadCheckpointError("no zero_pp_rank_*_optim_states.pt files", path)
    layout = CheckpointLayout(format="deepspeed", path=str(root), world_size=0)
    optim: dict[int, str] = {}
    for f in d.iterdir():
        if m := OPTIM_RE.match(f.name):
            optim[int(m[2])] = str(f)
    world = max(optim) + 1
    layout.world_size = world
    model3 = {int(m[1]): str(d / n) for n in (p.name for p in d.iterdir())
              if (m := MODEL3_RE.match(n))}
    model_file = str(d / MODEL2) if (d / MODEL2).is_file() else model3.get(0)
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
    param_shapes = _get(model_states, "param_shapes")
    if param_shapes is None:
        raise BadCheckpointError("no param_shapes in the model states", model_file)
    if isinstance(param_shapes, dict):
        param_shapes = [param_shapes]
    dp = _get(model_states, "dp_world_size")
    if isinstance(dp, int) and dp > 0 and dp != world:
        if dp < world:
            layout.problems.append(Problem("world-size-mismatch", f"the model states say "
                                           f"dp_world_size {dp}, optimizer files go to rank "
                                           f"{world - 1}", model_file))
        world = layout.world_size = max(world, dp)
    prefix = "bf16_" if any(Path(f).name.startswith("bf16_") for f in optim.values()) else ""
    groups_by_rank: dict[int, list[TensorRef]] = {}
    stage = None
    for r in range(world):
        fpath = optim.get(r, str(d / f"{prefix}zero_pp_rank_{r}_mp_rank_00_optim_states.pt"))
        sf = stat_file(fpath, r)
        layout.files.append(sf)
        if sf.status == "missing":
            layout.problems.append(Problem("missing-rank", f"rank {r} of {world}: no optimizer "
                                           "file", fpath))
            continue
        try:
            osd = _get(read_torch_archive(fpath).root, "optimizer_state_dict")
            groups_by_rank[r] = _flat_groups(osd, fpath)
            zs = _get(osd, "zero_stage")
            zs = zs.args[0] if isinstance(zs, Record) and zs.args else zs
            stage = stage or (int(zs) if isinstance(zs, int) else None)
        except BadCheckpointError as e:
            sf.status = "unreadable"
            layout.problems.append(problem_for(e, fpath))
    if stage is None:
        stage = 3 if model3 else 2
    if weights == "module":
        return _module_weights(layout, model_states, model_file, stage, root, d)
    train = "bf16" if prefix else _module_dtype(model_states)
    layout.notes.append(f"ZeRO stage {stage}; data-parallel world size {world}; "
                        f"{len(param_shapes)} parameter group(s); training weights {train}, "
                        "merged from the fp32 master copy")
    layout.parallel = {"dp": world} if stage < 3 else {"fsdp": world}
    if layout.errors:
        return layout
    if stage <= 2:
        _stage2(layout, param_shapes, groups_by_rank, optim)
    else:
        _stage3(layout, param_shapes, groups_by_rank, optim)
    _buffers_and_shared(layout, model_states, model_file)
    if not layout.errors:
        for t in layout.tensors.values():
            layout.problems.extend(coverage_problems(t))
    for c in (root / "huggingface", root, d):
        if (c / "config.json").is_file():
            attach_config(layout, c)
            break
    return layout


def _module_weights(layout, model_states, model_file, stage, root, d) -> CheckpointLayout:
    if stage >= 3:
        raise BadCheckpointError("ZeRO stage 3 keeps no module weights (only placeholders); "
                                 "merge the fp32 master copy instead", model_file)
    module = _get(model_states, "module") or {}
    for name, ref in (module.items() if isinstance(module, dict) else ()):
        if isinstance(ref, TensorRef) and ref.fits_storage():
            layout.tensors[name] = TensorInfo(name, ref.shape, ref.dtype, "module", [Piece(
                model_file, ref.byte_offset, ref.dtype, ref.shape, ref.stride,
                (0,) * len(ref.shape), 0)])
    layout.notes.append("module weights as trained (--weights module)")
    for c in (root / "huggingface", root, d):
        if (c / "config.json").is_file():
            attach_config(layout, c)
            break
    return layout


def _module_dtype(model_states) -> str:
    """dtype of the module's weights as trained (stage <= 2 keeps them in the model states)."""
    module = _get(model_states, "module") or {}
    for v in (module.values() if isinstance(module, dict) else ()):
        if isinstance(v, TensorRef):
            return {"F32": "fp32", "BF16": "bf16", "F16": "fp16"}.get(v.dtype, v.dtype)
    return "unknown"


def _stage2(layout, param_shapes, groups_by_rank, optim) -> None:
    world = layout.world_size
    for g, shapes in enumerate(param_shapes):
        parts = [groups_by_rank[r][g] for r in range(world)]
        sizes = [p.shape[0] for p in parts]
        starts = [sum(sizes[:r]) for r in range(world)]
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
                pos += take
            layout.tensors[name] = t
            offset += n
        total = sum(sizes)
        if offset > total or total - offset >= 2 * world * 64:
            layout.problems.append(Problem(
                "partition-mismatch", f"group {g}: parameters need {offset} elements, the "
                f"partitions hold {total}", optim[0]))


def _stage3(layout, param_shapes, groups_by_rank, optim) -> None:
    world = layout.world_size
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


def _buffers_and_shared(layout, model_states, model_file) -> None:
    module = _get(model_states, "module") or {}
    for name in _get(model_states, "buffer_names") or ():
        ref = module.get(name) if isinstance(module, dict) else None
        if isinstance(ref, TensorRef) and ref.fits_storage():
            strides = ref.stride
            layout.tensors[name] = TensorInfo(name, ref.shape, ref.dtype, "buffer", [Piece(
                model_file, ref.byte_offset, ref.dtype, ref.shape, strides,
                (0,) * len(ref.shape), 0)])
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
