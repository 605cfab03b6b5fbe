"""DeepSpeed checkpoints of the kinds people run, written by DeepSpeed itself (CPU accelerator,
gloo, one process per rank): frozen parameters (``requires_grad=False``) at ZeRO stages 1-3,
with or without ``exclude_frozen_parameters``; ``PipelineModule`` runs (pipeline stages,
``layer_XX-model_states.pt``); a model-parallel topology (``mp_rank_01_*`` files). Each beside
its unsharded reference (``<name>.reference/model.safetensors``). Test-only: needs deepspeed.

Kept apart from :mod:`core.sample` so its fixture cache key does not change.
"""

from __future__ import annotations

import os
from pathlib import Path

from .sample import Variant, _free_port, _hf_files, build_model


def _env(rank: int, world: int, port: int) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      DS_ACCELERATOR="cpu")


def _config(stage: int, dtype: str, grad_accum: str | None = None) -> dict:
    extra = {"data_types": {"grad_accum_dtype": grad_accum}} if grad_accum else {}
    return extra | {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage},
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
        "bf16": {"enabled": dtype == "BF16"},
    }


def write_jobs(root: str | os.PathLike, world_size: int, jobs: list[dict]) -> None:
    """Run ``jobs`` one after the other in the same ``world_size`` gloo processes (one
    DeepSpeed import per process, which is most of a run's time). A job is a dict with
    ``kind``: ``"frozen"``, ``"pipeline"`` or ``"moe"`` (the keywords of :func:`frozen_job`,
    :func:`pipeline_job`, :func:`moe_job`). Blocks until every rank is done; a failing rank raises."""
    import torch.multiprocessing as mp

    Path(root).mkdir(parents=True, exist_ok=True)
    mp.start_processes(_rank_main, args=(world_size, _free_port(), str(root), jobs),
                       nprocs=world_size, start_method="spawn", join=True)


def _rank_main(rank, world, port, root, jobs) -> None:
    _env(rank, world, port)
    import deepspeed
    import torch

    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    for job in jobs:
        job = dict(job)
        kind = job.pop("kind")
        {"frozen": frozen_job, "pipeline": pipeline_job, "moe": moe_job}[kind](rank, Path(root), **job)
        torch.distributed.barrier()


def frozen_job(rank: int, root: Path, name: str, stage: int, dtype: str,
               frozen: tuple[str, ...], exclude: bool = False, seed: int = 60,
               layers: int = 2, grad_accum: str | None = None) -> None:
    """(In a rank process.) A ZeRO ``stage`` run of the tiny qwen2 model whose parameters
    starting with one of ``frozen`` (name prefixes) have ``requires_grad=False``, saved at
    ``root/<name>/`` with ``exclude_frozen_parameters=exclude``; config in ``huggingface/``, the
    full model's ``save_pretrained`` at ``root/<name>.reference/``."""
    import deepspeed

    v = Variant(name=name, seed=seed, dtype=dtype, layers=layers, hidden=48, vocab=283)
    model = build_model(v)
    for n, p in model.named_parameters():
        if n.startswith(tuple(frozen)):
            p.requires_grad_(False)
    out = root / name
    if rank == 0:
        model.save_pretrained(root / f"{name}.reference")
        _hf_files(model, v, out / "huggingface")
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
        config=_config(stage, dtype, grad_accum))
    engine.save_checkpoint(str(out), tag="global_step0", exclude_frozen_parameters=exclude)


def pipeline_job(rank: int, root: Path, name: str, stages: int, tp: int, layers: int,
                 dtype: str = "F32", hidden: int = 24, seed: int = 70) -> None:
    """(In a rank process; ``stages * tp`` ranks.) A ``deepspeed.pipe.PipelineModule`` of
    ``layers`` ``nn.Linear(hidden, hidden)`` on a topology of ``stages`` pipeline stages x
    ``tp`` model-parallel ranks (``tp=0``: DeepSpeed's default pipeline topology, no model
    axis), ZeRO-1, saved at ``root/<name>/``; the layers' state dict (``"<layer>.weight"``, as
    ``nn.Sequential`` and the PipelineModule name them) at
    ``root/<name>.reference/model.safetensors``."""
    import deepspeed
    import torch
    from deepspeed.pipe import PipelineModule
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology
    from safetensors.torch import save_file

    torch.manual_seed(seed)
    mods = [torch.nn.Linear(hidden, hidden) for _ in range(layers)]
    if dtype == "BF16":
        mods = [m.to(torch.bfloat16) for m in mods]
    if rank == 0:
        ref = root / f"{name}.reference"
        ref.mkdir(parents=True, exist_ok=True)
        save_file({f"{i}.{k}": v.contiguous() for i, m in enumerate(mods)
                   for k, v in m.state_dict().items()}, ref / "model.safetensors")
    if tp:
        kw = dict(topology=PipeModelDataParallelTopology(num_pp=stages, num_mp=tp, num_dp=1))
    else:
        kw = dict(num_stages=stages)
    net = PipelineModule(layers=mods, loss_fn=torch.nn.MSELoss(), partition_method="uniform",
                         **kw)
    engine, *_ = deepspeed.initialize(model=net, model_parameters=[p for p in net.parameters()],
                                      config=_config(1, dtype))
    engine.save_checkpoint(str(root / name), tag="global_step0")


def moe_job(rank: int, root: Path, name: str, experts: int = 2, ep: int = 2, hidden: int = 16,
            stage: int = 2, seed: int = 80) -> None:
    """(In a rank process.) A model with one ``deepspeed.moe.layer.MoE`` of ``experts``
    ``nn.Linear(hidden, hidden)`` experts over ``ep`` expert-parallel ranks, ZeRO ``stage``,
    saved at ``root/<name>/`` (expert files ``layer_*_expert_*_mp_rank_00_model_states.pt``)."""
    import deepspeed
    import torch
    from deepspeed.moe.layer import MoE

    torch.manual_seed(seed)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = torch.nn.Linear(hidden, hidden)
            self.moe = MoE(hidden_size=hidden, expert=torch.nn.Linear(hidden, hidden),
                           num_experts=experts, ep_size=ep, k=1)

        def forward(self, x):
            return self.moe(self.inp(x))[0]

    net = Net()
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    groups = split_params_into_different_moe_groups_for_optimizer(
        {"params": list(net.parameters()), "name": "params"})
    engine, *_ = deepspeed.initialize(model=net, model_parameters=groups,
                                      config=_config(stage, "F32"))
    engine.save_checkpoint(str(root / name), tag="global_step0")
