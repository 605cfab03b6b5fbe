"""DeepSpeed ZeRO fixtures of :data:`test_deepspeed.DS` written with one process group per world
size instead of one per checkpoint: importing deepspeed is most of a rank's time, so each rank
process runs :func:`core.sample._deepspeed_rank` (the writer of ``shardscope``'s DeepSpeed
sample, unchanged) once per checkpoint of its world size, on the same gloo group
(``deepspeed.init_distributed`` keeps the group it already has)."""

from __future__ import annotations

import os
from pathlib import Path


def write_deepspeed_groups(root: str | os.PathLike,
                           jobs: dict[str, tuple[int, int, str, bool, int]]) -> None:
    """``root/<name>/`` and ``root/<name>.reference/`` for every ``name -> (world size, ZeRO
    stage, dtype, tied embeddings, seed)`` of ``jobs``: one ``spawn`` of ``world size`` gloo
    processes per world size. Raises when a rank fails (torch.multiprocessing)."""
    import torch.multiprocessing as mp

    from shardscope.core.sample import _free_port

    Path(root).mkdir(parents=True, exist_ok=True)
    for world in sorted({j[0] for j in jobs.values()}):
        mine = [(name, *rest) for name, (w, *rest) in jobs.items() if w == world]
        mp.start_processes(_rank_main, args=(world, _free_port(), str(root), mine),
                           nprocs=world, start_method="spawn", join=True)


def _rank_main(rank: int, world: int, port: int, root: str, jobs: list[tuple]) -> None:
    from shardscope.core.sample import _deepspeed_rank

    for name, stage, dtype, tie, seed in jobs:
        _deepspeed_rank(rank, world, port, root, name, stage, dtype, tie, seed)
