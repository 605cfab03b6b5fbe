"""Write large benchmark checkpoints with real torch.distributed, materialising only each
rank's shard (the model is built on the meta device, sharded by FSDP2, then ``to_empty``).

- ``write_fsdp_and_dcp(out, gb, world)``: verl-layout FSDP2 rank files and a DCP save of the
  same sharded model, gloo on the CPU, ``world`` processes.
- ``write_many_ranks(out, world)``: a small model saved by ``world`` ranks in ONE process, each
  rank in turn under torch's ``fake`` process-group backend (a ``FakeStore``), for the
  64-rank inspect timing.
"""

from __future__ import annotations

import json
import os
from pathlib import Path


def bench_config(gb: float):
    """A Qwen2-family config of about ``gb`` GB of fp32 weights (untied embeddings)."""
    from transformers import AutoConfig

    hidden, inter, vocab, kv = 2048, 5504, 32000, 4 * 128  # 4 KV heads of 128
    per_layer = 2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * inter
    layers = max(1, round((gb * 1e9 / 4 - 2 * vocab * hidden) / per_layer))
    return AutoConfig.for_model("qwen2", vocab_size=vocab, hidden_size=hidden,
                                intermediate_size=inter, num_hidden_layers=layers,
                                num_attention_heads=16, num_key_value_heads=4,
                                tie_word_embeddings=False, max_position_embeddings=256)


def _shard_on_meta(config, mesh):
    import torch
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().normal_(0, 0.02)
    return model


def _rank(rank: int, world: int, port: int, out: str, gb: float) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    torch.manual_seed(rank)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    config = bench_config(gb)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
    model = _shard_on_meta(config, mesh)
    sd = model.state_dict()
    fsdp_dir, dcp_dir = Path(out, "fsdp"), Path(out, "dcp")
    torch.save(sd, fsdp_dir / f"model_world_size_{world}_rank_{rank}.pt")
    dcp.save(sd, checkpoint_id=str(dcp_dir))
    if rank == 0:
        (fsdp_dir / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2,
                                                               "world_size": world}))
        config.architectures = ["Qwen2ForCausalLM"]
        config.save_pretrained(fsdp_dir / "huggingface")
        from shardscope.core.sample import tiny_tokenizer

        tiny_tokenizer(config.vocab_size).save_pretrained(fsdp_dir / "huggingface")
    dist.barrier()
    dist.destroy_process_group()


def write_fsdp_and_dcp(out: str | os.PathLike, gb: float, world: int) -> None:
    import torch.multiprocessing as mp

    from shardscope.core.sample import _free_port

    for d in ("fsdp", "dcp"):
        Path(out, d).mkdir(parents=True, exist_ok=True)
    mp.start_processes(_rank, args=(world, _free_port(), str(out), gb), nprocs=world,
                       start_method="spawn", join=True)


def write_many_ranks(out: str | os.PathLike, world: int) -> None:
    """``world`` rank files of a small Qwen2 model, each written by its own rank under the
    ``fake`` backend, one rank after another in this process.

    Each value is a ``DTensor.from_local`` of that rank's ``Shard(0)`` rows on a 1-D ``fsdp``
    mesh — what FSDP2's ``state_dict`` returns. (``fully_shard`` itself cannot be used here:
    run for many ranks in one process, its parameters pick up a cached device mesh of the
    first rank.)"""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from transformers import AutoConfig, AutoModelForCausalLM

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    config = AutoConfig.for_model("qwen2", vocab_size=4096, hidden_size=256,
                                  intermediate_size=704, num_hidden_layers=24,
                                  num_attention_heads=8, num_key_value_heads=2)
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in
                  AutoModelForCausalLM.from_config(config).state_dict().items()}
    for rank in range(world):
        dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
        sd = {}
        for k, shape in shapes.items():
            chunk = -(-shape[0] // world)
            rows = max(0, min(chunk, shape[0] - rank * chunk))
            local = torch.empty((rows, *shape[1:])).normal_(0, 0.02)
            sd[k] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=shape,
                                       stride=torch.empty(shape, device="meta").stride())
        torch.save(sd, out / f"model_world_size_{world}_rank_{rank}.pt")
        dist.destroy_process_group()
    (out / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2, "world_size": world}))


def _many_config(layers: int, vocab: int = 512):
    from transformers import AutoConfig

    return AutoConfig.for_model("qwen2", vocab_size=vocab, hidden_size=64, intermediate_size=96,
                                num_hidden_layers=layers, num_attention_heads=4,
                                num_key_value_heads=2, tie_word_embeddings=False)


def _fake_rank(rank: int, world: int, out: str, shapes: dict) -> None:
    """One rank under the ``fake`` backend in a fresh (forked) process: its own DeviceMesh, so
    the file records this rank's own mesh coordinate, as a real run's files do."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    torch.manual_seed(rank)
    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
    sd = {}
    for k, shape in shapes.items():
        chunk = -(-shape[0] // world)
        rows = max(0, min(chunk, shape[0] - rank * chunk))
        local = torch.empty((rows, *shape[1:])).normal_(0, 0.02)
        sd[k] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=shape,
                                   stride=torch.empty(shape, device="meta").stride())
    final = Path(out) / f"model_world_size_{world}_rank_{rank}.pt"
    torch.save(sd, final.with_suffix(".tmp"))
    os.replace(final.with_suffix(".tmp"), final)  # whole files only: a run can resume
    dist.destroy_process_group()


def write_many_ranks_procs(out: str | os.PathLike, world: int, layers: int = 80,
                           workers: int = 2, vocab: int = 512) -> None:
    """``world`` rank files of an ``layers``-layer tiny-width Qwen2 model (hidden 64, untied:
    12 tensors a layer + 3 = 963 tensors at 80 layers), each rank written by ITS OWN process
    (forked from this one, ``fake`` process-group backend, ``workers`` at a time), each value a
    ``DTensor`` of that rank's ``Shard(0)`` rows on a 1-D ``fsdp`` mesh, as FSDP2's
    ``state_dict`` returns. The HF config goes to ``huggingface/``. Rank files already
    written (each is renamed into place when complete) are kept: an interrupted run resumes.
    ``vocab``: the vocabulary size (one not divisible by ``world`` leaves the last ranks
    fewer rows of the embeddings)."""
    import multiprocessing as mp

    import torch
    from transformers import AutoModelForCausalLM

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    config = _many_config(layers, vocab)
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in
                  AutoModelForCausalLM.from_config(config).state_dict().items()}
    ctx = mp.get_context("fork")
    todo = [r for r in range(world)
            if not (out / f"model_world_size_{world}_rank_{r}.pt").exists()]  # resume
    with ctx.Pool(workers, maxtasksperchild=1) as pool:
        pool.starmap(_fake_rank, [(r, world, str(out), shapes) for r in todo], chunksize=1)
    config.architectures = ["Qwen2ForCausalLM"]
    config.save_pretrained(out / "huggingface")
    (out / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2, "world_size": world}))
