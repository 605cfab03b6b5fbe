"""Writes real sharded checkpoints of tiny models, with real torch.distributed (gloo, CPU).

Used by ``shardscope sample`` (the README's main job), by the tests (fixtures of every layout
the core reads, each with its unsharded reference) and by ``bench/``. Models are built from a
config with a fixed seed: no download. Each rank runs in its own process (``spawn``).

Layouts written (``Variant.kind``):
- ``fsdp2``: verl's layout (``model_world_size_{W}_rank_{r}.pt`` of DTensor state dicts,
  ``fsdp_config.json``, ``huggingface/``), FSDP2 ``fully_shard`` on a 1-D or 2-D (HSDP) mesh.
- ``fsdp1``: the same files from FSDP1 ``SHARDED_STATE_DICT`` (ShardedTensor values).
- ``dcp``: ``torch.distributed.checkpoint.save`` of the flat model state dict beside a
  ``train_state`` entry (torchtitan style).
- ``dcp-accelerate``: ``pytorch_model_fsdp_0/`` with the model nested under ``model``, as
  accelerate's ``save_fsdp_model`` writes it.
- ``accelerate-rank``: ``pytorch_model_fsdp_0_rank{r}.bin`` per rank (accelerate's per-rank
  variant).
- ``dcp-hf``: DCP's Hugging Face writer (``HuggingFaceStorageWriter(save_distributed=True)``):
  per-rank ``shard-*-model-*.safetensors`` with ``DCP_SHARDING_INFO``, plus ``huggingface/``.
The reference (``save_pretrained`` of the same model before sharding) goes to ``reference/``
beside the checkpoint when asked.
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class Variant:
    """One checkpoint to write. ``dtype``: ``F32`` or ``BF16`` parameters. ``mesh_shape``:
    ``()`` for a 1-D mesh over all ranks, ``(2, W/2)`` for HSDP. ``mesh_names``: dimension
    names, or ``None`` for an unnamed mesh."""

    name: str
    kind: str = "fsdp2"
    family: str = "qwen2"
    dtype: str = "F32"
    tie: bool = False
    mesh_shape: tuple[int, ...] = ()
    mesh_names: tuple[str, ...] | None = ("fsdp",)
    seed: int = 0
    hidden: int = 64
    layers: int = 2
    vocab: int = 331
    write_fsdp_config: bool = True
    #: register persistent buffers (an int64 vector and a 0-d float) that FSDP2 saves as plain
    #: full-size tensors on every rank; such a model is for bit-exact tests, not from_pretrained
    buffers: bool = False
    #: LoRA: "" for none, else "qv" (r=8, alpha=16 on q_proj/v_proj) or "rslora" (r=4,
    #: alpha=8, rsLoRA, on k_proj/o_proj/gate_proj), built with peft, lora_B non-zero
    lora: str = ""


def tiny_config(v: Variant):
    """A transformers config of a tiny model of the variant's family (imports transformers)."""
    from transformers import AutoConfig

    common = dict(vocab_size=v.vocab, hidden_size=v.hidden, intermediate_size=v.hidden * 11 // 4,
                  num_hidden_layers=v.layers, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=128, tie_word_embeddings=v.tie, bos_token_id=1,
                  eos_token_id=2)
    if v.family == "llama":
        return AutoConfig.for_model("llama", **common)
    return AutoConfig.for_model("qwen2", **common)


def tiny_tokenizer(vocab: int):
    """A byte-level BPE tokenizer trained in memory on a few sentences (the ``tokenizers``
    library), so the sample has real tokenizer files that ``AutoTokenizer`` loads (also as
    the family's own class, e.g. ``Qwen2Tokenizer``) without a download; its vocabulary fits
    in the model's ``vocab`` rows."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab < 259:  # 256 byte symbols + 3 special tokens are always in the vocabulary
        raise ValueError(f"a byte-level tokenizer needs at least 259 ids, the model has {vocab}")

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=min(vocab, 300), show_progress=False,
                                  special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    text = ["the quick brown fox jumps over the lazy dog", "shards merge checkpoints",
            "every rank holds a slice of each tensor"]
    tok.train_from_iterator(text * 20, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>")


def build_model(v: Variant):
    """The tiny model, deterministic for the variant's seed, in the variant's dtype."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(v.seed)
    model = AutoModelForCausalLM.from_config(tiny_config(v))
    with torch.no_grad():  # make biases and norms non-trivial so a mix-up shows in values
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    if v.dtype == "BF16":
        model = model.to(torch.bfloat16)
    if v.buffers:
        model.model.register_buffer("step_count", torch.arange(5, dtype=torch.int64) * 7)
        model.model.register_buffer("loss_scale", torch.tensor(0.375))
        model.model.register_buffer("no_elements", torch.zeros(0, 4))
    return model


LORA_PRESETS = {
    "qv": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
    "rslora": dict(r=4, lora_alpha=8, use_rslora=True,
                   target_modules=["k_proj", "o_proj", "gate_proj"]),
    "dora": dict(r=4, lora_alpha=8, use_dora=True, target_modules=["q_proj"]),
    # two adapters ("default" active, "second" beside it) and a modules_to_save copy
    "multi": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                  modules_to_save=["lm_head"]),
}


def add_lora(model, v: Variant):
    """Wrap ``model`` with a peft LoRA adapter of the variant's preset; lora_B is drawn at
    random (peft starts it at zero, which would hide every mistake in a merge)."""
    import torch
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM",
                                                  **LORA_PRESETS[v.lora]))
    if v.lora == "multi":
        peft_model.add_adapter("second", LoraConfig(task_type="CAUSAL_LM", r=2, lora_alpha=4,
                                                    target_modules=["up_proj"]))
        peft_model.set_adapter("default")
    torch.manual_seed(v.seed + 100)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name or "modules_to_save" in name:
                p.copy_(torch.randn_like(p) * 0.05)
    return peft_model


def _write_lora_references(peft_model, root: Path, v: Variant) -> None:
    """The unsharded answers: ``.fold`` (peft's merge_and_unload), ``.base`` (peft's unload,
    which keeps trained ``modules_to_save`` copies), ``.adapter`` (peft's own adapter folder);
    ``.reference`` (written before peft wrapped the model) is the untouched base."""
    import copy

    copy.deepcopy(peft_model).merge_and_unload().save_pretrained(root / f"{v.name}.fold")
    copy.deepcopy(peft_model).unload().save_pretrained(root / f"{v.name}.base")
    peft_model.save_pretrained(root / f"{v.name}.adapter")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_checkpoints(root: str | os.PathLike, world_size: int, variants: list[Variant],
                      reference: bool = True) -> None:
    """Write each variant to ``root/<name>/`` (and its reference to ``root/<name>.reference/``)
    with ``world_size`` gloo processes on the CPU. Blocks until all ranks are done; raises
    ``RuntimeError`` when a rank fails."""
    import torch.multiprocessing as mp

    Path(root).mkdir(parents=True, exist_ok=True)
    port = _free_port()
    mp.start_processes(_rank_main, args=(world_size, port, str(root),
                                         [asdict(v) for v in variants], reference),
                       nprocs=world_size, start_method="spawn", join=True)


def _rank_main(rank: int, world_size: int, port: int, root: str, variants: list[dict],
               reference: bool) -> None:
    import warnings

    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        for vd in variants:
            vd["mesh_shape"] = tuple(vd["mesh_shape"])
            vd["mesh_names"] = tuple(vd["mesh_names"]) if vd["mesh_names"] else None
            _write_variant(rank, world_size, Path(root), Variant(**vd), reference)
            dist.barrier()
    finally:
        dist.destroy_process_group()


def _hf_files(model, v: Variant, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(out)
    model.generation_config.save_pretrained(out)
    tiny_tokenizer(v.vocab).save_pretrained(out)


def _write_variant(rank: int, world: int, root: Path, v: Variant, reference: bool) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    out = root / v.name
    model = build_model(v)
    hf_model = model
    if rank == 0 and reference:
        model.save_pretrained(root / f"{v.name}.reference")
        tiny_tokenizer(v.vocab).save_pretrained(root / f"{v.name}.reference")
    if v.lora:
        model = add_lora(model, v)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        if reference and v.lora:
            _write_lora_references(model, root, v)
        if v.lora:
            cfg = LORA_PRESETS[v.lora]
            (out / "lora_train_meta.json").write_text(json.dumps(
                {"r": cfg["r"], "lora_alpha": cfg["lora_alpha"], "task_type": "CAUSAL_LM",
                 "use_rslora": cfg.get("use_rslora", False)}))
    dist.barrier()
    layers = hf_model.model.layers
    if v.kind == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp import StateDictType
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        wrapped = FSDP(model, device_id=torch.device("cpu"),
                       auto_wrap_policy=ModuleWrapPolicy({type(layers[0])}))
        with FSDP.state_dict_type(wrapped, StateDictType.SHARDED_STATE_DICT):
            sd = wrapped.state_dict()
    else:
        from torch.distributed.fsdp import fully_shard

        shape = v.mesh_shape or (world,)
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=v.mesh_names)
        for layer in layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        sd = model.state_dict()
    if v.kind in ("fsdp1", "fsdp2"):
        torch.save(sd, out / f"model_world_size_{world}_rank_{rank}.pt")
        if rank == 0:
            if v.write_fsdp_config:
                (out / "fsdp_config.json").write_text(json.dumps(
                    {"FSDP_version": 1 if v.kind == "fsdp1" else 2, "world_size": world}))
            _hf_files(hf_model, v, out / "huggingface")
    elif v.kind == "dcp-hf":
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import HuggingFaceStorageWriter

        dcp.save(dict(sd), storage_writer=HuggingFaceStorageWriter(str(out),
                                                                  save_distributed=True))
        if rank == 0:
            _hf_files(hf_model, v, out / "huggingface")
    elif v.kind == "accelerate-rank":
        torch.save(sd, out / f"pytorch_model_fsdp_0_rank{rank}.bin")
    elif v.kind in ("dcp", "dcp-accelerate"):
        import torch.distributed.checkpoint as dcp

        if v.kind == "dcp":
            state = dict(sd)
            state["train_state"] = {"step": 7, "losses": torch.arange(5, dtype=torch.float32)}
            target = out
        else:
            state = {"model": sd}
            target = out / "pytorch_model_fsdp_0"
        dcp.save(state, checkpoint_id=str(target))
    else:
        raise ValueError(f"unknown variant kind {v.kind}")


def write_sample(out: str | os.PathLike, world_size: int = 2, reference: str | None = None) -> Path:
    """The README's sample: a verl-layout FSDP2 checkpoint of a tiny Qwen2 model (fp32,
    ``world_size`` ranks) at ``out``; the unsharded model at ``reference`` when given.
    Raises ``FileExistsError`` when ``out`` exists and is not empty."""
    import shutil
    import tempfile

    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} exists and is not empty")
    with tempfile.TemporaryDirectory(prefix="shardscope-sample-") as tmp:
        v = Variant(name="ckpt", kind="fsdp2")
        write_checkpoints(tmp, world_size, [v], reference=reference is not None)
        out.parent.mkdir(parents=True, exist_ok=True)
        if out.exists():
            out.rmdir()
        shutil.move(os.path.join(tmp, "ckpt"), out)
        if reference is not None:
            shutil.move(os.path.join(tmp, "ckpt.reference"), reference)
    return out


def write_deepspeed(root: str | os.PathLike, world_size: int, name: str, stage: int,
                    dtype: str = "F32", tie: bool = False, seed: int = 40) -> None:
    """A DeepSpeed ZeRO checkpoint written by DeepSpeed itself (CPU accelerator, gloo) at
    ``root/<name>/``, with the model's config and tokenizer in ``huggingface/`` and the
    weights before training at ``root/<name>.reference/``. Needs deepspeed (a test-only
    dependency)."""
    import torch.multiprocessing as mp

    Path(root).mkdir(parents=True, exist_ok=True)
    mp.start_processes(_deepspeed_rank, args=(world_size, _free_port(), str(root), name, stage,
                                              dtype, tie, seed),
                       nprocs=world_size, start_method="spawn", join=True)


def _deepspeed_rank(rank, world, port, root, name, stage, dtype, tie, seed) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      DS_ACCELERATOR="cpu")
    import deepspeed
    import torch

    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    v = Variant(name=name, tie=tie, seed=seed)
    model = build_model(v)
    out = Path(root) / name
    if rank == 0:
        model.save_pretrained(Path(root) / f"{name}.reference")
        _hf_files(model, v, out / "huggingface")
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage},
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
        "bf16": {"enabled": dtype == "BF16"},
    }
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=config)
    engine.save_checkpoint(str(out), tag="global_step0")
    torch.distributed.barrier()
