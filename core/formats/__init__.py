"""One reader per on-disk format. Each module offers ``sniff(path) -> bool`` and
``read(path) -> CheckpointLayout``; :func:`detect` picks the first that recognises the path."""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import BadCheckpointError
from ..layout import CheckpointLayout


def _readers():
    from . import dcp, dcp_hf, deepspeed, fsdp, hf, megatron_dist, megatron_legacy

    # order matters: a DCP or FSDP folder may also hold a stray model.safetensors, and a
    # Megatron torch_dist folder is a DCP folder with Megatron's names
    return [("megatron-dist", megatron_dist), ("megatron-legacy", megatron_legacy),
            ("dcp", dcp), ("fsdp", fsdp), ("deepspeed", deepspeed), ("dcp-hf", dcp_hf),
            ("hf", hf)]


def detect(path: str | os.PathLike, deepspeed_weights: str = "master",
           hf_config: str | None = None) -> CheckpointLayout:
    """Detect the format of ``path`` from its files alone and read its layout (metadata only).

    ``path`` may be a checkpoint folder or one file inside it. ``deepspeed_weights``: for a
    DeepSpeed checkpoint, ``master`` (the fp32 optimizer copy) or ``module`` (the weights as
    trained, e.g. bf16, where the stage keeps them). Raises
    :class:`BadCheckpointError` when the path does not exist or no reader recognises it;
    problems with a recognised checkpoint are in ``layout.problems`` instead.
    """
    given = p = Path(path)
    if not p.exists():
        raise BadCheckpointError("no such file or folder", str(p))
    if p.is_file():
        p = p.parent
    for _, mod in _readers():
        if mod.sniff(str(p)):
            from ..checks import config_problems

            from ..lora import detect_lora

            if mod.__name__.endswith(".deepspeed"):
                layout = mod.read(str(p), weights=deepspeed_weights)
            elif mod.__name__.endswith((".megatron_dist", ".megatron_legacy")):
                layout = mod.read(str(p), hf_config=hf_config)
            else:
                layout = mod.read(str(p))
            layout.problems.extend(config_problems(layout))
            layout.lora = detect_lora({n: t.shape for n, t in layout.tensors.items()},
                                      layout.path)
            if layout.lora is not None:
                from ..layout import Problem

                layout.problems.extend(Problem(code, msg, layout.path, sev)
                                       for code, msg, sev in layout.lora.problems)
            return layout
    inside = _checkpoints_inside(p)
    if inside:
        raise BadCheckpointError("not a checkpoint itself; these folders inside it are: "
                                 + ", ".join(inside), str(given))
    raise BadCheckpointError(
        "not a checkpoint shardscope knows (looked for .metadata, latest_checkpointed_iteration"
        ".txt, mp_rank_*/, model_world_size_*_rank_*.pt, "
        "pytorch_model_fsdp_*_rank*.bin, shard-*-model-*.safetensors, model.safetensors)",
        str(given))


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
