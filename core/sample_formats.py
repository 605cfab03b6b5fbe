"""Writes the real checkpoints of the dtype, ``.bin`` and wrong-folder tests (tests/test_formats.py).

Everything is written by the real libraries: torch.distributed (gloo, CPU, ``spawn``) for the
FSDP2, FSDP1 and DCP folders; ``torch.save`` of a Hugging Face model's ``state_dict()`` in
transformers' ``.bin`` layout (transformers 5 no longer writes ``.bin`` files: its
``save_pretrained`` lost ``safe_serialization=False``), sharded by huggingface_hub's
``split_torch_state_dict_into_shards`` with the ``pytorch_model{suffix}.bin`` pattern that
transformers 4 used; the reference is always ``save_pretrained`` of the same model.

Folders written under ``root``:
- ``fp8.reference/``: ``save_pretrained`` of a tiny Llama (3 layers, hidden 48, vocab 293) with
  float8 tensors: a ``float8_e4m3fn`` parameter (layer 2 ``mlp.down_proj.weight``, sharded by
  FSDP2 like any other), buffers of ``float8_e4m3fn``, ``float8_e5m2``, ``float8_e4m3fnuz``,
  ``uint16`` and ``uint32`` (all pickled by torch through ``_rebuild_tensor_v3``).
- ``fp8-fsdp2/``: verl's layout of its FSDP2 state dict, 2 ranks.
- ``fp8-dcp/``: ``torch.distributed.checkpoint.save`` of the same (with a ``train_state``).
- ``fp8-dcp-per-item/``: the same with ``FileSystemWriter(single_file_per_rank=False)``: one
  ``.distcp`` file per item.
- ``accelerate/``: the folders accelerate's ``save_fsdp_model``/``save_fsdp_optimizer``
  (accelerate/utils/fsdp_utils.py, sharded state dict, DCP) write for this model:
  ``pytorch_model_fsdp_0/`` (``{"model": ...}``) and ``optimizer_0/`` (``{"optimizer": ...}``:
  AdamW state after one step, from ``get_optimizer_state_dict``), each with torch's
  ``FileSystemWriter`` as accelerate calls it (the model folder holds the weights after that
  step: it is not compared with the reference).
- ``fsdp1-local/``: FSDP1 ``LOCAL_STATE_DICT`` rank files (flat parameters), verl's names.
- ``bin.reference/``, ``bin-single/`` (``pytorch_model.bin``), ``bin-sharded/`` (shards +
  ``pytorch_model.bin.index.json``), ``pt-single/model.pt`` (no config), ``bin-cuda/``
  (``pytorch_model.bin`` whose storages are tagged ``cuda:0``, see :func:`_cuda_tagged_save`):
  a tiny Qwen2 with tied embeddings (2 layers, hidden 40, vocab 277).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from .sample import Variant, _free_port, build_model, tiny_tokenizer

FP8 = Variant("fp8", family="llama", hidden=48, layers=3, vocab=293, seed=41)
BIN = Variant("bin", family="qwen2", hidden=40, layers=2, vocab=277, tie=True, seed=42)


def fp8_model():
    """The float8 model (see the module docstring), deterministic."""
    import torch

    model = build_model(FP8)
    g = torch.Generator().manual_seed(43)
    layers = model.model.layers
    down = layers[2].mlp.down_proj
    down.weight = torch.nn.Parameter(down.weight.detach().to(torch.float8_e4m3fn),
                                     requires_grad=False)
    layers[0].mlp.register_buffer("amax_fp8", torch.randn(8, generator=g).to(
        torch.float8_e4m3fn))
    layers[1].self_attn.register_buffer("scale_e5m2", torch.randn(6, generator=g).to(
        torch.float8_e5m2))
    layers[1].mlp.register_buffer("scale_fnuz", torch.randn(5, generator=g).to(
        torch.float8_e4m3fnuz))
    model.model.register_buffer("ids_u16", (torch.arange(7) * 9000).to(torch.uint16))
    model.model.register_buffer("ids_u32", (torch.arange(3) * 70000).to(torch.uint32))
    return model


def write_formats(root: str | os.PathLike) -> None:
    """Write every folder of the module docstring under ``root`` (2 gloo processes)."""
    import torch.multiprocessing as mp

    Path(root).mkdir(parents=True, exist_ok=True)
    mp.start_processes(_rank_main, args=(2, _free_port(), str(root)), nprocs=2,
                       start_method="spawn", join=True)
    _write_bin(Path(root))


def _rank_main(rank: int, world: int, port: int, root: str) -> None:
    import warnings

    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        _write_fp8(rank, world, Path(root))
        dist.barrier()
        _write_fsdp1_local(rank, world, Path(root))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _hf_side(model, out: Path, vocab: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(out)
    tiny_tokenizer(vocab).save_pretrained(out)


def _write_fp8(rank: int, world: int, root: Path) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = fp8_model()
    if rank == 0:
        model.save_pretrained(root / "fp8.reference")
        (root / "fp8-fsdp2").mkdir(parents=True, exist_ok=True)
    dist.barrier()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    sd = model.state_dict()
    out = root / "fp8-fsdp2"
    torch.save(sd, out / f"model_world_size_{world}_rank_{rank}.pt")
    if rank == 0:
        (out / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2,
                                                          "world_size": world}))
        _hf_side(model, out / "huggingface", FP8.vocab)
    state = dict(sd)
    state["train_state"] = {"step": 10}
    dcp.save(state, checkpoint_id=str(root / "fp8-dcp"))
    # one file per item, with non-model items (their files are named by .metadata too)
    state["optimizer"] = {"step": torch.tensor(10.0), "exp_avg": torch.ones(3, 4)}
    dcp.save(state, storage_writer=FileSystemWriter(str(root / "fp8-dcp-per-item"),
                                                    single_file_per_rank=False))
    _write_accelerate(model, sd, root / "accelerate")


def _write_accelerate(model, sd, out: Path) -> None:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-3)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    dcp.save({"model": sd}, storage_writer=dcp.FileSystemWriter(str(out / "pytorch_model_fsdp_0")),
             planner=DefaultSavePlanner())
    dcp.save({"optimizer": get_optimizer_state_dict(model, opt)},
             storage_writer=dcp.FileSystemWriter(str(out / "optimizer_0")),
             planner=DefaultSavePlanner())


def _write_fsdp1_local(rank: int, world: int, root: Path) -> None:
    import torch
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import StateDictType
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    v = Variant("fsdp1-local", family="qwen2", hidden=32, layers=2, vocab=263, seed=44)
    model = build_model(v)
    wrapped = FSDP(model, device_id=torch.device("cpu"),
                   auto_wrap_policy=ModuleWrapPolicy({type(model.model.layers[0])}))
    with FSDP.state_dict_type(wrapped, StateDictType.LOCAL_STATE_DICT):
        sd = wrapped.state_dict()
    out = root / "fsdp1-local"
    out.mkdir(parents=True, exist_ok=True)
    torch.save(sd, out / f"model_world_size_{world}_rank_{rank}.pt")
    if rank == 0:
        (out / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 1,
                                                          "world_size": world}))
        _hf_side(model, out / "huggingface", v.vocab)


def _cuda_tagged_save(obj, path: Path) -> None:
    """``torch.save`` with every storage's location recorded as ``cuda:0``, as a save from a
    GPU records it, using torch's own hook for that (``torch.serialization.register_package``:
    a tagger of higher priority than the CPU one names the location). Only the location string
    differs from a CPU save; this machine has no GPU."""
    import torch
    import torch.serialization as ser

    entry = (1, lambda storage: "cuda:0", lambda storage, location: None)
    ser.register_package(*entry)
    try:
        torch.save(obj, path)
    finally:  # the registry is a sorted list of (priority, tagger, deserializer)
        ser._package_registry[:] = [e for e in ser._package_registry if e[1] is not entry[1]]


def _write_bin(root: Path) -> None:
    import torch
    from huggingface_hub import split_torch_state_dict_into_shards

    model = build_model(BIN)
    model.save_pretrained(root / "bin.reference")
    sd = model.state_dict()
    single = root / "bin-single"
    _hf_side(model, single, BIN.vocab)
    torch.save(sd, single / "pytorch_model.bin")
    sharded = root / "bin-sharded"
    _hf_side(model, sharded, BIN.vocab)
    split = split_torch_state_dict_into_shards(sd, filename_pattern="pytorch_model{suffix}.bin",
                                               max_shard_size="60KB")
    assert split.is_sharded, "the fixture must have several shards"
    for fname, names in split.filename_to_tensors.items():
        torch.save({n: sd[n] for n in names}, sharded / fname)
    (sharded / "pytorch_model.bin.index.json").write_text(json.dumps(
        {"metadata": split.metadata, "weight_map": split.tensor_to_filename}, indent=2))
    pt = root / "pt-single"
    pt.mkdir(parents=True, exist_ok=True)
    torch.save(sd, pt / "model.pt")
    cuda = root / "bin-cuda"
    _hf_side(model, cuda, BIN.vocab)
    _cuda_tagged_save(sd, cuda / "pytorch_model.bin")
