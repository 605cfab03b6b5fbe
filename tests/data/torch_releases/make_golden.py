"""Write the golden checkpoints of one torch release (the one running this script).

Run it with the Python of a side virtual environment that holds that torch release (plus
numpy and safetensors; no transformers needed), from the repository root:

    /work/venvs/torch-2.4/bin/python tests/data/torch_releases/make_golden.py tests/data/torch_releases

It writes ``<out>/<torch version>/<layout>/`` for every layout the release supports, each with
``checkpoint/`` (what the framework wrote, through torch.distributed with gloo on the CPU,
one process per rank), ``reference/`` (``config.json`` of the Hugging Face Llama model whose
parameter names the tiny model uses, and ``model.safetensors``: the unsharded state dict
before sharding) and ``golden.json`` (release, layout, world size, placements seen, and whether
torch's own ``full_tensor()`` of every DTensor equals the reference). A layout the release
cannot write is listed in ``<out>/<version>/skipped.json`` with the error.

The model is a plain ``torch.nn`` module that mimics ``LlamaForCausalLM``'s parameter names
(2 layers, hidden 16, vocab 61), so old releases need no transformers.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import traceback
from pathlib import Path

VOCAB, HIDDEN, INTER, LAYERS, HEADS, KV_HEADS = 61, 16, 24, 2, 4, 2

#: layout name -> (world size, kind, options)
LAYOUTS = {
    "fsdp1_sharded_tensor": (2, "fsdp1", {}),
    "fsdp1_dtensor": (3, "fsdp1", {"mesh": (3,), "names": ("fsdp",)}),
    "fsdp2_1d_named_uneven": (3, "fsdp2", {"mesh": (3,), "names": ("fsdp",)}),
    "fsdp2_1d_unnamed": (2, "fsdp2", {"mesh": (2,), "names": None, "dtype": "float32"}),
    "fsdp2_hsdp_2x2_named": (4, "fsdp2", {"mesh": (2, 2), "names": ("ddp", "fsdp")}),
    "fsdp2_hsdp_2x2_unnamed": (4, "fsdp2", {"mesh": (2, 2), "names": None}),
    "fsdp2_tp_2x2": (4, "fsdp2_tp", {"mesh": (2, 2), "names": ("dp", "tp")}),
    # torch 2.5-2.7 refuse uneven FSDP + TP shards: every TP-sharded dim divides by 4 here
    "fsdp2_tp_2x2_even": (4, "fsdp2_tp", {"mesh": (2, 2), "names": ("dp", "tp"),
                                          "vocab": 64}),
    "dcp_fsdp2_1d": (3, "dcp", {"mesh": (3,), "names": ("fsdp",)}),
}


def _config(dtype: str, vocab: int = VOCAB) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab,
        "hidden_size": HIDDEN, "intermediate_size": INTER, "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
        "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
        "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": dtype,
        "dtype": dtype,
    }


def _build(seed: int, dtype: str, vocab: int = VOCAB):
    import torch
    from torch import nn

    class Norm(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(HIDDEN))

    class Attn(nn.Module):
        def __init__(self):
            super().__init__()
            hd = HIDDEN // HEADS
            self.q_proj = nn.Linear(HIDDEN, HEADS * hd, bias=False)
            self.k_proj = nn.Linear(HIDDEN, KV_HEADS * hd, bias=False)
            self.v_proj = nn.Linear(HIDDEN, KV_HEADS * hd, bias=False)
            self.o_proj = nn.Linear(HEADS * hd, HIDDEN, bias=False)

    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_proj = nn.Linear(HIDDEN, INTER, bias=False)
            self.up_proj = nn.Linear(HIDDEN, INTER, bias=False)
            self.down_proj = nn.Linear(INTER, HIDDEN, bias=False)

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.self_attn, self.mlp = Attn(), MLP()
            self.input_layernorm, self.post_attention_layernorm = Norm(), Norm()

    class Inner(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed_tokens = nn.Embedding(vocab, HIDDEN)
            self.layers = nn.ModuleList(Layer() for _ in range(LAYERS))
            self.norm = Norm()

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = Inner()
            self.lm_head = nn.Linear(HIDDEN, vocab, bias=False)

    torch.manual_seed(seed)
    m = Model()
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn_like(p) * (0.1 if p.dim() == 1 else 0.02) + (p.dim() == 1))
    return m.to(getattr(torch, dtype)), Layer


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _imports():
    import torch.distributed as dist  # noqa: F401
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # torch < 2.6
        from torch.distributed._composable.fsdp import fully_shard
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch < 2.5
        from torch.distributed._tensor import DTensor
    return fully_shard, DTensor


def _tp_plan():
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   SequenceParallel)

    plan = {"model.embed_tokens": RowwiseParallel(), "lm_head": ColwiseParallel(),
            "model.norm": SequenceParallel()}
    for i in range(LAYERS):
        p = f"model.layers.{i}"
        for m in ("q_proj", "k_proj", "v_proj"):
            plan[f"{p}.self_attn.{m}"] = ColwiseParallel()
        plan[f"{p}.self_attn.o_proj"] = RowwiseParallel()
        plan[f"{p}.mlp.gate_proj"] = ColwiseParallel()
        plan[f"{p}.mlp.up_proj"] = ColwiseParallel()
        plan[f"{p}.mlp.down_proj"] = RowwiseParallel()
        plan[f"{p}.input_layernorm"] = SequenceParallel()
        plan[f"{p}.post_attention_layernorm"] = SequenceParallel()
    return plan


def _write_layout(rank: int, world: int, root: Path, name: str, kind: str, opts: dict,
                  seed: int) -> dict:
    import torch
    import torch.distributed as dist
    from safetensors.torch import save_file
    from torch.distributed.device_mesh import init_device_mesh

    fully_shard, DTensor = _imports()
    dtype = opts.get("dtype", "bfloat16")
    vocab = opts.get("vocab", VOCAB)
    model, Layer = _build(seed, dtype, vocab)
    ref = {k: v.detach().clone() for k, v in model.state_dict().items()}
    out = root / name
    ckpt = out / "checkpoint"
    if rank == 0:
        (out / "reference").mkdir(parents=True, exist_ok=True)
        ckpt.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in ref.items()},
                  str(out / "reference" / "model.safetensors"), metadata={"format": "pt"})
        (out / "reference" / "config.json").write_text(
            json.dumps(_config(dtype, vocab), indent=2))
    dist.barrier()
    mesh = None
    if opts.get("mesh"):
        mesh = init_device_mesh("cpu", opts["mesh"], mesh_dim_names=opts.get("names"))
    if kind == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp import StateDictType
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        kw = {"device_mesh": mesh} if mesh is not None else {}
        wrapped = FSDP(model, device_id=torch.device("cpu"),
                       auto_wrap_policy=ModuleWrapPolicy({Layer}), **kw)
        with FSDP.state_dict_type(wrapped, StateDictType.SHARDED_STATE_DICT):
            sd = wrapped.state_dict()
    else:
        if kind == "fsdp2_tp":
            from torch.distributed.tensor.parallel import parallelize_module

            dp, tp = opts["names"]
            parallelize_module(model, mesh[tp], _tp_plan())
            shard_mesh = mesh[dp]
        else:
            shard_mesh = mesh
        for layer in model.model.layers:
            fully_shard(layer, mesh=shard_mesh)
        fully_shard(model, mesh=shard_mesh)
        sd = model.state_dict()
    if kind == "dcp":
        import torch.distributed.checkpoint as dcp

        dcp.save(dict(sd), checkpoint_id=str(ckpt))
    else:
        torch.save(sd, ckpt / f"model_world_size_{world}_rank_{rank}.pt")
        if rank == 0:
            (ckpt / "fsdp_config.json").write_text(json.dumps(
                {"FSDP_version": 1 if kind == "fsdp1" else 2, "world_size": world}))
    placements, full_ok = {}, True
    for k, v in sd.items():
        if isinstance(v, DTensor):
            placements.setdefault(str(tuple(v.placements)), k)
            full = v.full_tensor()
            full_ok &= bool(torch.equal(full, ref[k]))
        else:
            placements.setdefault(type(v).__name__, k)
    return {"torch": torch.__version__, "layout": name, "kind": kind, "world_size": world,
            "mesh": list(opts.get("mesh") or ()), "mesh_dim_names": opts.get("names"),
            "dtype": dtype, "placements": placements,
            "full_tensor_equals_reference": full_ok}


def _rank_main(rank: int, world: int, port: int, root: str, names: list[str]) -> None:
    import warnings

    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    skipped = {}
    try:
        for name in names:
            _, kind, opts = LAYOUTS[name]
            try:
                info = _write_layout(rank, world, Path(root), name, kind, opts,
                                     seed=60 + list(LAYOUTS).index(name))
                err = None
            except Exception as e:  # noqa: BLE001 - a release that lacks the layout
                info, err = None, f"{type(e).__name__}: {e}"
                if rank == 0:
                    traceback.print_exc()
            errs = [None] * world
            dist.all_gather_object(errs, err)
            if any(errs):
                skipped[name] = next(e for e in errs if e)
                if rank == 0:
                    import shutil

                    shutil.rmtree(Path(root) / name, ignore_errors=True)
            elif rank == 0:
                (Path(root) / name / "golden.json").write_text(json.dumps(info, indent=1))
            dist.barrier()
    finally:
        if rank == 0 and skipped:
            f = Path(root) / "skipped.json"
            old = json.loads(f.read_text()) if f.exists() else {}
            f.write_text(json.dumps({**old, **skipped}, indent=1))
        dist.destroy_process_group()


def main(out: str, only: list[str]) -> None:
    import torch
    import torch.multiprocessing as mp

    version = torch.__version__.split("+")[0]
    root = Path(out) / version
    root.mkdir(parents=True, exist_ok=True)
    by_world: dict[int, list[str]] = {}
    for name, (world, _, _) in LAYOUTS.items():
        if not only or name in only:
            by_world.setdefault(world, []).append(name)
    for world, names in sorted(by_world.items()):
        mp.start_processes(_rank_main, args=(world, _port(), str(root), names),
                           nprocs=world, start_method="spawn", join=True)
    print(f"wrote {root}")


README_HEAD = """# Golden checkpoints of real torch releases

Each `<torch version>/<layout>/` holds `checkpoint/` (written by that torch release with
torch.distributed, gloo, CPU, one process per rank), `reference/` (`config.json` and the
unsharded `model.safetensors`) and `golden.json` (what was written: world size, mesh,
placements seen, and whether torch's own `full_tensor()` gave the reference). The normal test
run merges every one of them with today's torch and compares bit for bit
(`tests/test_torch_releases.py`).

Regenerate one release (a side virtual environment holding that torch, numpy and
safetensors; the older releases are CUDA builds of a few GB, so never in CI):

    python3.11 -m venv /work/venvs/torch-2.6
    /work/venvs/torch-2.6/bin/pip install torch==2.6.0 "numpy<2" safetensors
    /work/venvs/torch-2.6/bin/python tests/data/torch_releases/make_golden.py tests/data/torch_releases
    python3 tests/data/torch_releases/make_golden.py --readme tests/data/torch_releases

The model is a plain `torch.nn` module with `LlamaForCausalLM`'s parameter names (2 layers,
hidden 16, 4 heads, 2 KV heads, intermediate 24, vocab 61): rows do not divide by 2 or 3, so
shards are uneven. Layouts:

- `fsdp1_sharded_tensor`: FSDP1 `SHARDED_STATE_DICT` without a device mesh (ShardedTensor), 2 ranks
- `fsdp1_dtensor`: FSDP1 with a 1-D device mesh (DTensor), 3 ranks
- `fsdp2_1d_named_uneven`: FSDP2 `fully_shard` on a named 1-D mesh, 3 ranks
- `fsdp2_1d_unnamed`: FSDP2 on an unnamed 1-D mesh, fp32, 2 ranks
- `fsdp2_hsdp_2x2_named` / `_unnamed`: FSDP2 on a `(ddp, fsdp)` HSDP mesh, 4 ranks
- `fsdp2_tp_2x2`: `parallelize_module` over `tp`, then `fully_shard` over `dp` of a `(dp, tp)` mesh
  (uneven rows); `fsdp2_tp_2x2_even`: the same with vocab 64, rows that divide (torch 2.5-2.7
  refuse uneven FSDP + TP)
- `dcp_fsdp2_1d`: `torch.distributed.checkpoint.save` of an FSDP2 state dict, 3 ranks

"tested" = merged bit for bit by the test; "skipped" = the release refuses to write that
layout (its error is in `<version>/skipped.json`).

"""


def write_readme(out: str) -> None:
    """Rewrite ``<out>/README.md`` with the release x layout table of the folders present."""
    root = Path(out)
    versions = sorted((p for p in root.iterdir() if p.is_dir() and p.name[0].isdigit()),
                      key=lambda p: tuple(int(x) for x in p.name.split(".")))
    rows = ["| layout | " + " | ".join(v.name for v in versions) + " |",
            "|---|" + "---|" * len(versions)]
    for name in LAYOUTS:
        cells = []
        for v in versions:
            skipped = json.loads((v / "skipped.json").read_text()) if (
                v / "skipped.json").exists() else {}
            if (v / name / "golden.json").exists():
                info = json.loads((v / name / "golden.json").read_text())
                cells.append("tested" + ("" if info["full_tensor_equals_reference"] else
                                         " (torch's full_tensor() is wrong here)"))
            elif name in skipped:
                cells.append("skipped")
            else:
                cells.append("not written")
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
    (root / "README.md").write_text(README_HEAD + "\n".join(rows) + "\n")


if __name__ == "__main__":
    if sys.argv[1] == "--readme":
        write_readme(sys.argv[2])
    else:
        main(sys.argv[1], sys.argv[2:])
