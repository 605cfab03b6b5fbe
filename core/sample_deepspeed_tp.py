"""A DeepSpeed AutoTP checkpoint written by DeepSpeed itself (CPU accelerator, gloo): the tiny
qwen2 model trained with ``"tensor_parallel": {"autotp_size": T}`` and ZeRO-1, so
``mp_rank_0T_*`` files hold each TP rank's slices and the model states record AutoTP's
``universal_checkpoint_info`` (``deepspeed/module_inject/layers.py``). Test-only: needs
deepspeed. Apart from :mod:`core.sample_deepspeed` so that module's fixture key holds."""

from __future__ import annotations

import os
from pathlib import Path

from .sample import Variant, _free_port, _hf_files, build_model
from .sample_deepspeed import _env


def write_autotp(root: str | os.PathLike, name: str, tp: int = 2, dp: int = 1,
                 dtype: str = "F32", seed: int = 90) -> None:
    """``root/<name>/`` (``tp x dp`` processes: ``tp`` tensor-parallel ranks, ``dp``
    data-parallel ranks) and its unsharded ``save_pretrained`` reference at
    ``root/<name>.reference/``."""
    import torch.multiprocessing as mp

    Path(root).mkdir(parents=True, exist_ok=True)
    mp.start_processes(_rank, args=(tp * dp, _free_port(), str(root), name, tp, dtype, seed),
                       nprocs=tp * dp, start_method="spawn", join=True)


def _rank(rank, world, port, root, name, tp, dtype, seed) -> None:
    _env(rank, world, port)
    import deepspeed
    import torch

    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    v = Variant(name=name, seed=seed, hidden=48, vocab=283, dtype=dtype)
    model = build_model(v)
    out = Path(root) / name
    if rank == 0:
        model.save_pretrained(Path(root) / f"{name}.reference")
        _hf_files(model, v, out / "huggingface")
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": 1}, "tensor_parallel": {"autotp_size": tp},
              "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
              "bf16": {"enabled": dtype == "BF16"}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=config)
    engine.save_checkpoint(str(out), tag="global_step0")
    torch.distributed.barrier()
