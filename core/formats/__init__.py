"""One reader per on-disk format. Each module offers ``sniff(path) -> bool`` and
``read(path) -> CheckpointLayout``; :func:`detect` picks the first that recognises the path."""

from __future__ import annotations

import os
import re
from pathlib import Path

from ..errors import BadCheckpointError
from ..layout import CheckpointLayout
from ..phases import check_cancelled
from .common import contained


def _readers():
    from . import dcp, dcp_hf, deepspeed, fsdp, hf, hf_bin, megatron_dist, megatron_legacy

    # order matters: a DCP or FSDP folder may also hold a stray model.safetensors, and a
    # Megatron torch_dist folder is a DCP folder with Megatron's names; .bin/.pt folders last
    return [("megatron-dist", megatron_dist), ("megatron-legacy", megatron_legacy),
            ("dcp", dcp), ("fsdp", fsdp), ("deepspeed", deepspeed), ("dcp-hf", dcp_hf),
            ("hf", hf), ("hf-bin", hf_bin)]


def detect(path: str | os.PathLike, deepspeed_weights: str = "master",
           hf_config: str | None = None) -> CheckpointLayout:
    """Detect the format of ``path`` from its files alone and read its layout (metadata only).

    ``path`` may be a checkpoint folder or one file inside it. ``deepspeed_weights``: for a
    DeepSpeed checkpoint, ``master`` (the fp32 optimizer copy) or ``module`` (the weights as
    trained, e.g. bf16, where the stage keeps them). Raises
    :class:`BadCheckpointError` when the path does not exist or no reader recognises it;
    problems with a recognised checkpoint are in ``layout.problems`` instead. Inside a
    :func:`core.phases.watching` block the many-file readers report their progress (and a
    preview) and raise :class:`ReadCancelled` between files once it is cancelled.
    """
    given = p = Path(path)
    if not p.exists():
        raise BadCheckpointError("no such file or folder", str(p))
    if p.is_file():
        p = p.parent
    _wrong_folder(p)

    def read(mod) -> CheckpointLayout:
        if mod.__name__.endswith(".deepspeed"):
            return mod.read(str(p), weights=deepspeed_weights, hf_config=hf_config)
        if mod.__name__.endswith((".megatron_dist", ".megatron_legacy")):
            return mod.read(str(p), hf_config=hf_config)
        if mod.__name__.endswith(".hf_bin") and given.is_file() and not mod.is_folder(p):
            return mod.read(str(given))  # the single state-dict file asked for
        return mod.read(str(p))

    found = [(name, mod) for name, mod in _readers()
             if mod.sniff(str(p)) or (mod.__name__.endswith(".hf_bin") and mod.sniff(str(given)))]
    if found:
        name, mod = found[0]
        layout = read(mod)
        check_cancelled()  # a front end's watch (core/phases.py) stopped the read
        others = found[1:]
        if given.is_file() and _real(given) not in _weight_files(layout):
            # a folder holding two checkpoints, and the user named a file of the second one:
            # read that one, never the first reader's checkpoint in its place
            for i, (oname, omod) in enumerate(others):
                try:
                    olayout = read(omod)
                except (BadCheckpointError, OSError):
                    continue
                if _real(given) in _weight_files(olayout):
                    others = [(name, mod)] + others[:i] + others[i + 1:]
                    name, mod, layout = oname, omod, olayout
                    break
        if mod.__name__.endswith(".dcp") and not layout.tensors:
            _optimizer_folder(p)
        _files_inside(layout, p)
        if given.is_file() and _real(layout.path) != _real(given):
            layout.notes.insert(0, f"reading the whole checkpoint folder {layout.path} "
                                   f"that this file ({given.name}) belongs to")
        _other_checkpoints(layout, others, read)
        return finish_layout(layout, hf_config)
    _config_folder(p, given)
    if given.is_file():
        raise BadCheckpointError("not a checkpoint file (expected a folder, .pt/.bin/"
                                 ".safetensors)", str(given), code="not-a-checkpoint")
    inside = _checkpoints_inside(p)
    if inside:
        raise BadCheckpointError("not a checkpoint itself; these folders inside it are: "
                                 + ", ".join(inside), str(given), code="wrong-folder")
    raise BadCheckpointError(
        "not a checkpoint shardscope knows (looked for .metadata, latest_checkpointed_iteration"
        ".txt, mp_rank_*/, model_world_size_*_rank_*.pt, "
        "pytorch_model_fsdp_*_rank*.bin, shard-*-model-*.safetensors, model.safetensors, "
        "pytorch_model.bin, a single .pt/.pth)",
        str(given), code="not-a-checkpoint")


def _real(path: str | os.PathLike) -> Path:
    """``path`` with its symbolic links resolved, as :func:`os.path.realpath` does: unlike
    ``Path.resolve()`` on Python < 3.13 it never raises for a link that loops (such a file
    is reported by its reader as unreadable instead of stopping the whole read)."""
    return Path(os.path.realpath(path))


def _weight_files(layout: CheckpointLayout) -> set[Path]:
    """The resolved files a layout reads: its shard files and the files its pieces lie in."""
    files = {f.path for f in layout.files}
    for t in layout.tensors.values():
        files.update(pc.file for pc in t.pieces)
    return {_real(f) for f in files if f}


def _other_checkpoints(layout: CheckpointLayout, others, read) -> None:
    """Another checkpoint in the same folder (rank files beside a ``model.safetensors``, a DCP
    save beside FSDP rank files, HF Trainer's ``model.safetensors`` beside DeepSpeed's
    ``global_stepN/``): the readers ``others`` also recognised the folder; each that reads
    files disjoint from ``layout``'s (not the same files under another reading, as Megatron's
    torch_dist is DCP, or one rank file is a single .pt) and tensors of the same names (not a
    stray tensor file: saved logits, an RNG state) adds a ``several-checkpoints``
    warning naming what was read and what was not, and how to read the other one."""
    from ..layout import Problem

    mine = _weight_files(layout)
    for name, mod in others:
        try:
            other = read(mod)
        except (BadCheckpointError, OSError):
            continue  # not a readable checkpoint: nothing to mix up
        theirs = _weight_files(other)
        if not theirs or theirs & mine or not set(other.tensors) & set(layout.tensors):
            continue  # the same files, or tensors of no common name (logits, rng state)
        first = sorted(theirs)[0]
        layout.problems.append(Problem(
            "several-checkpoints",
            f"this folder holds two checkpoints: read the {layout.format} one "
            f"({len(mine)} file(s)); the {other.format} one ({len(theirs)} file(s), e.g. "
            f"{first.name}) was not read: to read it, give one of its files as PATH",
            str(first), "warning"))


def finish_layout(layout: CheckpointLayout, hf_config: str | None = None) -> CheckpointLayout:
    """The steps :func:`detect` takes after a reader: torchtitan/torchtune names mapped to
    Hugging Face's, config problems, LoRA adapters found. Also run on the union of several
    nodes' layouts by core/distributed.py. Returns ``layout``, changed in place."""
    from ..checks import config_problems
    from ..lora import detect_lora
    from ..native_names import convert as convert_native_names

    convert_native_names(layout, hf_config)  # torchtitan/torchtune names -> HF
    layout.problems.extend(config_problems(layout))
    layout.lora = detect_lora({n: t.shape for n, t in layout.tensors.items()}, layout.path)
    if layout.lora is not None:
        from ..layout import Problem

        layout.problems.extend(Problem(code, msg, layout.path, sev)
                               for code, msg, sev in layout.lora.problems)
    return layout


def _files_inside(layout: CheckpointLayout, root: Path) -> None:
    """Every file the layout reads (rank files, shards, the files its pieces point into) must
    resolve inside the checkpoint folder ``root``: a symbolic link elsewhere is refused
    (``path-outside-checkpoint``), see :func:`.common.contained`. A Megatron rank folder
    (``mp_rank_*``) opened directly belongs to its iteration folder."""
    from .megatron_legacy import RANK_DIR_RE

    if RANK_DIR_RE.match(root.name):
        root = root.parent
    files = {f.path for f in layout.files}
    for t in layout.tensors.values():
        files.update(pc.file for pc in t.pieces)
    for f in sorted(files):
        try:
            rel = os.path.relpath(f, root)
        except ValueError:
            rel = f
        contained(root, rel, "a file of the checkpoint (symbolic link)", f)


VERL_STEP_RE = re.compile(r"^global_step_(\d+)$")


def _wrong_folder(p: Path) -> None:
    """Raise a pointer (``wrong-folder``) for a folder that holds checkpoints but is none:
    verl's run folder, whose ``latest_checkpointed_iteration.txt`` (written by verl's trainer,
    verl/trainer/ppo/ray_trainer.py ``_save_checkpoint``) names the step of its
    ``global_step_N/`` folder (``actor/``, ``critic/`` inside), unlike Megatron's tracker,
    which names an ``iter_NNNNNNN/`` folder."""
    tracker = p / "latest_checkpointed_iteration.txt"
    try:
        if not tracker.is_file() or any(p.glob("iter_*")) or (p / "release").is_dir():
            return
        steps = sorted(c.name for c in p.iterdir() if VERL_STEP_RE.match(c.name) and c.is_dir())
        text = tracker.read_text().strip()
    except OSError:
        return
    if not steps:
        return
    step = p / f"global_step_{text}" if text.isdigit() else None
    if step is None or not step.is_dir():
        raise BadCheckpointError(
            f"verl's run folder; its latest_checkpointed_iteration.txt says {text[:40]!r}, but "
            f"there is no global_step_{text[:40]}/ (steps here: {', '.join(steps[:4])}); open "
            "one of them", str(p), code="wrong-folder")
    contained(p, step.name, "latest_checkpointed_iteration.txt", tracker)
    inside = [c for c in ("actor", "critic") if (step / c).is_dir()] or _checkpoints_inside(step)
    where = ", ".join(f"{step.name}/{c.rstrip('/')}" for c in inside) or step.name
    raise BadCheckpointError(
        f"verl's run folder, not a checkpoint: latest_checkpointed_iteration.txt names step "
        f"{text}; the checkpoint is {where}", str(p), code="wrong-folder")


def _config_folder(p: Path, given: Path) -> None:
    """Raise a pointer (``wrong-folder``) for the ``huggingface/`` config folder of a checkpoint
    (verl saves config and tokenizer there, beside the rank files), or a file in it: the
    checkpoint is its parent folder."""
    if p.name != "huggingface" or not (p / "config.json").is_file():
        return
    parent = p.parent
    if any(mod.sniff(str(parent)) for _, mod in _readers()):
        raise BadCheckpointError(
            f"the config folder of the checkpoint {parent} (config and tokenizer, no weights); "
            "give that folder", str(given), code="wrong-folder")


def _optimizer_folder(p: Path) -> None:
    """Raise a pointer (``optimizer-state``) for a DCP folder that holds no model tensor
    because it is optimizer state, as accelerate writes it (accelerate/utils/fsdp_utils.py
    ``save_fsdp_optimizer``: ``optimizer_{i}/`` holding ``{"optimizer": ...}``, beside the
    model's ``pytorch_model_fsdp_{i}/``)."""
    from . import dcp

    d = dcp.find_dcp_dir(str(p))
    if d is None:
        return
    try:
        m = dcp.load_metadata(d / ".metadata")
    except BadCheckpointError:
        return
    planner = m.get("planner_data") or {}
    tops = {str((planner.get(k) or (k,))[0]).split(".", 1)[0]
            for k in (m.get("state_dict_metadata") or {})}
    if not tops or not tops <= {"optimizer", "optim", "optimizer_state", "osd"} | set(
            dcp.NON_MODEL_KEYS):
        return
    siblings = []
    try:
        for c in sorted(d.parent.iterdir()):
            if c != d and c.is_dir() and any(mod.sniff(str(c)) for _, mod in _readers()):
                siblings.append(c.name + "/")
    except OSError:
        pass
    hint = (f"; the model is beside it: {', '.join('../' + s for s in siblings[:4])}"
            if siblings else "; the model weights are saved in another folder")
    raise BadCheckpointError(f"optimizer state (every entry is under "
                             f"{', '.join(repr(t) for t in sorted(tops))}, as in accelerate's "
                             f"optimizer_0/), not model weights{hint}", str(d),
                             code="optimizer-state")


def _checkpoints_inside(p: Path, depth: int = 2, limit: int = 8) -> list[str]:
    """Relative names of checkpoint folders up to ``depth`` levels below ``p`` (a hint for a
    user who opened their parent), at most ``limit``."""
    found: list[str] = []
    level = [p]
    for _ in range(depth):
        nxt = []
        for d in level:
            try:
                subs = sorted(c for c in d.iterdir() if c.is_dir() and not c.name.startswith("."))
            except OSError:
                continue
            for c in subs:
                if any(mod.sniff(str(c)) for _, mod in _readers()):
                    found.append(str(c.relative_to(p)) + "/")
                else:
                    nxt.append(c)
                if len(found) >= limit:
                    return found
        level = nxt
    return found
