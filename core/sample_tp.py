"""Writes real FSDP2 + tensor-parallel checkpoints of tiny models (gloo, CPU), verl's per-rank
layout, each with its unsharded reference: ``parallelize_module`` over the ``tp`` dimension of a
``(dp, tp)`` device mesh, then ``fully_shard`` over ``dp`` (torchtitan's and accelerate's
TP + FSDP recipe). Parameters sharded on the same tensor dimension by both mesh dimensions
carry ``_StridedShard(dim, split_factor=tp)`` on ``dp`` (torch/distributed/tensor/
placement_types.py, ``_StridedShard``; torch/distributed/fsdp/_fully_shard/_fsdp_param.py).

Also writes HSDP checkpoints (``(replicate, shard)`` meshes) used to test a lost replica.
Kept apart from :mod:`core.sample` so that its fixture cache key stays unchanged.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class TPVariant:
    """One FSDP2 + TP checkpoint: ``mesh_shape`` is ``(dp, tp)``; ``sequence_parallel`` uses
    ``SequenceParallel`` on the norms (their weights stay replicated on ``tp``)."""

    name: str
    mesh_shape: tuple[int, int] = (2, 2)
    mesh_names: tuple[str, str] = ("dp", "tp")
    family: str = "llama"
    dtype: str = "F32"
    tie: bool = False
    seed: int = 50
    hidden: int = 48
    layers: int = 2
    vocab: int = 263
    sequence_parallel: bool = True


def _tp_plan(model, sequence_parallel: bool):
    """The TP plan of a Llama/Qwen2 model (torchtitan's): column-wise q/k/v/gate/up (weight
    ``Shard(0)``), row-wise o/down (``Shard(1)``), embedding row-wise (``Shard(0)`` of the
    vocabulary), lm_head column-wise, norms sequence-parallel (replicated weights)."""
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   SequenceParallel)

    plan = {"model.embed_tokens": RowwiseParallel(), "lm_head": ColwiseParallel()}
    if sequence_parallel:
        plan["model.norm"] = SequenceParallel()
    for i in range(len(model.model.layers)):
        p = f"model.layers.{i}"
        for m in ("q_proj", "k_proj", "v_proj"):
            plan[f"{p}.self_attn.{m}"] = ColwiseParallel()
        plan[f"{p}.self_attn.o_proj"] = RowwiseParallel()
        for m in ("gate_proj", "up_proj"):
            plan[f"{p}.mlp.{m}"] = ColwiseParallel()
        plan[f"{p}.mlp.down_proj"] = RowwiseParallel()
        if sequence_parallel:
            plan[f"{p}.input_layernorm"] = SequenceParallel()
            plan[f"{p}.post_attention_layernorm"] = SequenceParallel()
    return plan


def write_tp_checkpoints(root: str | os.PathLike, variants: list[TPVariant]) -> None:
    """Write each variant to ``root/<name>/`` (verl layout: ``model_world_size_{W}_rank_{r}.pt``,
    ``fsdp_config.json``, ``huggingface/``) and ``root/<name>.reference/`` (``save_pretrained``
    before sharding), plus ``root/<name>.full/full.safetensors``: every DTensor's
    ``full_tensor()`` as torch itself gathers it. All variants must share one world size."""
    import torch.multiprocessing as mp

    from .sample import _free_port

    worlds = {v.mesh_shape[0] * v.mesh_shape[1] for v in variants}
    if len(worlds) != 1:
        raise ValueError(f"variants of several world sizes {sorted(worlds)}")
    Path(root).mkdir(parents=True, exist_ok=True)
    world = worlds.pop()
    mp.start_processes(_rank_main, args=(world, _free_port(), str(root),
                                         [asdict(v) for v in variants]),
                       nprocs=world, start_method="spawn", join=True)


def _rank_main(rank: int, world: int, port: int, root: str, variants: list[dict]) -> None:
    import warnings

    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        for vd in variants:
            vd["mesh_shape"] = tuple(vd["mesh_shape"])
            vd["mesh_names"] = tuple(vd["mesh_names"])
            _write(rank, world, Path(root), TPVariant(**vd))
            dist.barrier()
    finally:
        dist.destroy_process_group()


def _write(rank: int, world: int, root: Path, v: TPVariant) -> None:
    import torch
    import torch.distributed as dist
    from safetensors.torch import save_file
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import parallelize_module

    from .sample import Variant, _hf_files, build_model

    base = Variant(name=v.name, family=v.family, dtype=v.dtype, tie=v.tie, seed=v.seed,
                   hidden=v.hidden, layers=v.layers, vocab=v.vocab)
    model = build_model(base)
    out = root / v.name
    if rank == 0:
        model.save_pretrained(root / f"{v.name}.reference")
        out.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    mesh = init_device_mesh("cpu", v.mesh_shape, mesh_dim_names=v.mesh_names)
    dp, tp = v.mesh_names
    parallelize_module(model, mesh[tp], _tp_plan(model, v.sequence_parallel))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh[dp])
    fully_shard(model, mesh=mesh[dp])
    sd = model.state_dict()
    torch.save(sd, out / f"model_world_size_{world}_rank_{rank}.pt")
    full = {k: (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()
            for k, t in sd.items()}
    if rank == 0:
        (out / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2,
                                                          "world_size": world}))
        _hf_files(model, base, out / "huggingface")
        (root / f"{v.name}.full").mkdir(exist_ok=True)
        save_file({k: t.contiguous() for k, t in full.items()},
                  str(root / f"{v.name}.full" / "full.safetensors"))
