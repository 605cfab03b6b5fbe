"""The Megatron fixtures (:mod:`core.sample_megatron` families, :mod:`core.sample_megatron_moe`
sets) written with one gloo process group per world size instead of one per family: importing
torch, transformers and megatron-core is most of a rank's time. Each rank runs the writers of
those modules unchanged (``_write_reference``, then ``_write_layout`` per layout) for every
family of its world size in turn; every family seeds its own models (``torch.manual_seed``), so
the files hold the same weights as one process group per family would write (checked: every
``.distcp`` and ``.safetensors`` file byte-identical). Not the same bytes everywhere: a legacy
``model_optim_rng.pt`` records the process's Python RNG state, whose pickle size varies from
run to run anyway, and a ``torch_dist`` ``.metadata`` records the folder it was written to; no
test draws either (``test_snapshots_small`` checks the Megatron file table's rows, not its
sizes). ``megatron_root`` (all families, world 4) and ``megatron_moe_root`` use this writer."""

from __future__ import annotations

import os
import shutil
from dataclasses import asdict
from pathlib import Path


def write_megatron_groups(root: str | os.PathLike, sets: dict[str, tuple]) -> None:
    """``root/<name>/`` for every ``name -> (Family, grouped GEMM, layouts)`` of ``sets``
    (layouts as in :data:`core.sample_megatron.LAYOUTS`), each laid out like
    :func:`core.sample_megatron.write_megatron` writes it, with one ``spawn`` of
    ``max(2, TP x PP x EP)`` processes per world size (sets of one world share it; grouped-GEMM
    sets run after the plain ones, as they patch the model builder in their process).
    Raises when a rank fails (torch.multiprocessing)."""
    import torch.multiprocessing as mp

    from shardscope.core.sample import _free_port

    by_world: dict[int, list] = {}
    for name, (f, grouped, layouts) in sets.items():
        world = max(2, max(tp * pp * ep for tp, pp, _, ep, _ in layouts))
        by_world.setdefault(world, []).append((name, asdict(f), grouped, list(layouts)))
    for world, jobs in sorted(by_world.items()):
        jobs.sort(key=lambda j: j[2])  # plain before grouped
        for name, *_ in jobs:
            (Path(root) / name).mkdir(parents=True, exist_ok=True)
        mp.start_processes(_rank_main, args=(world, _free_port(), str(root), jobs),
                           nprocs=world, start_method="spawn", join=True)
        for name, *_ in jobs:
            shutil.rmtree(Path(root) / name / "_full_tp1", ignore_errors=True)


def _rank_main(rank: int, world: int, port: int, root: str, jobs: list) -> None:
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    import torch
    import torch.distributed as dist

    from shardscope.core import sample_megatron as sm
    from shardscope.core.sample_megatron import Family

    sm._cpu_only()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        for name, family, grouped, layouts in jobs:
            f = Family(**family)
            out = Path(root) / name
            full = out / "_full_tp1"
            sm._write_reference(rank, f, out, full)
            if grouped:
                _use_grouped_gemm(sm)
            for tp, pp, vpp, ep, uneven in layouts:
                sm._write_layout(rank, world, f, out / sm.layout_name(tp, pp, vpp, ep, uneven),
                                 full, tp, pp, vpp, ep, uneven)
            dist.barrier()
    finally:
        dist.barrier()
        dist.destroy_process_group()


def _use_grouped_gemm(sm) -> None:
    """What :func:`core.sample_megatron_moe._grouped_rank_main` does before its layouts: build
    ``GroupedMLP`` experts and record ``moe_grouped_gemm`` in ``args`` (this process only)."""
    from megatron.core.transformer.moe import grouped_gemm_util as gg

    from shardscope.core import sample_megatron_moe as smm

    gg.assert_grouped_gemm_is_available = lambda: None
    if sm._models is smm._grouped_models:
        return
    sm._models = smm._grouped_models
    plain_args = sm.megatron_args

    def grouped_args(*a, **k):
        args = plain_args(*a, **k)
        args.moe_grouped_gemm = True
        return args

    sm.megatron_args = grouped_args
