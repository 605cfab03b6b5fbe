"""Writes real FSDP2 checkpoints of tiny models trained with the peft LoRA options of issue 19
(per-module rank and alpha, rsLoRA, DoRA, embedding LoRA, LoRA on fused MoE expert parameters,
adapter-only saves), each beside peft's own answers. Used by the tests only.

Each spec is written by ``world_size`` gloo processes on the CPU (``torch.multiprocessing``,
``spawn``), in verl's layout (``model_world_size_{W}_rank_{r}.pt``, ``fsdp_config.json``,
``huggingface/``, ``lora_train_meta.json``; with ``adapter_config`` also
``lora_adapter/adapter_config.json`` as verl saves it), or with ``kind="dcp"`` as one
``torch.distributed.checkpoint`` save (``.metadata``, ``*.distcp``) beside the same LoRA
files. Beside ``root/<name>/``:

- ``<name>.reference/``: ``save_pretrained`` of the base model before peft wrapped it;
- ``<name>.fold/``: peft's ``merge_and_unload()`` then ``save_pretrained``;
- ``<name>.adapter/``: peft's own adapter folder (``PeftModel.save_pretrained``);
- ``<name>.memory/model.safetensors`` (MoE only): the base model's in-memory state dict
  (fused expert names, as transformers 5 holds them).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from .sample import Variant, _free_port, _hf_files, build_model

#: name -> spec; ``lora``: LoraConfig keyword arguments; ``lora_only``: the rank files hold the
#: adapter tensors only (verl's save_lora_only); ``adapter_config``: write lora_adapter/
#: adapter_config.json beside the rank files; ``moe``: a Qwen3-MoE model (fused experts)
SPECS: dict[int, list[dict]] = {
    2: [
        dict(name="w2-lora-patterns", seed=50, layers=3, hidden=48, adapter_config=True,
             lora=dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj",
                                                           "o_proj", "up_proj"],
                       rank_pattern={"k_proj": 2, "layers.1.self_attn.o_proj": 12},
                       alpha_pattern={"v_proj": 24, "up_proj": 5})),
        dict(name="w2-lora-embed", seed=51, family="llama", layers=2, hidden=32,
             lora=dict(r=6, lora_alpha=12, target_modules=["embed_tokens", "q_proj"])),
        dict(name="w2-lora-only", seed=52, family="llama", layers=3, hidden=40, lora_only=True,
             lora=dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])),
        dict(name="w2-lora-dcp-patterns", seed=57, layers=2, hidden=32, kind="dcp",
             adapter_config=True,
             lora=dict(r=6, lora_alpha=9, target_modules=["q_proj", "o_proj", "down_proj"],
                       rank_pattern={"down_proj": 3}, alpha_pattern={"o_proj": 4})),
        dict(name="w2-lora-moe-params", seed=53, moe=True,
             lora=dict(r=4, lora_alpha=8, target_modules=["q_proj"],
                       target_parameters=["mlp.experts.gate_up_proj",
                                          "mlp.experts.down_proj"])),
    ],
    3: [
        dict(name="w3-lora-rslora-patterns-bf16", seed=54, dtype="BF16", layers=2, hidden=48,
             adapter_config=True,
             lora=dict(r=8, lora_alpha=16, use_rslora=True,
                       target_modules=["q_proj", "k_proj", "gate_proj", "down_proj"],
                       rank_pattern={"gate_proj": 4}, alpha_pattern={"q_proj": 32})),
        dict(name="w3-lora-dora-bf16", seed=55, dtype="BF16", layers=2, hidden=48,
             lora=dict(r=4, lora_alpha=8, use_dora=True, target_modules=["q_proj", "v_proj"])),
        dict(name="w3-lora-tokens", seed=58, layers=2, hidden=32,
             lora=dict(r=4, lora_alpha=8, target_modules=["q_proj"],
                       trainable_token_indices=[3, 5, 7])),
        dict(name="w3-lora-embed-bf16-tied", seed=56, dtype="BF16", tie=True, layers=3,
             hidden=32, lora=dict(r=5, lora_alpha=10, target_modules=["embed_tokens",
                                                                       "v_proj"])),
    ],
}


def _variant(spec: dict) -> Variant:
    return Variant(spec["name"], family=spec.get("family", "qwen2"),
                   dtype=spec.get("dtype", "F32"), tie=spec.get("tie", False),
                   seed=spec["seed"], hidden=spec.get("hidden", 64),
                   layers=spec.get("layers", 2), vocab=spec.get("vocab", 301))


def _build(spec: dict):
    """The tiny base model of ``spec`` (a Qwen3-MoE with 3 experts when ``moe``)."""
    import torch

    v = _variant(spec)
    if not spec.get("moe"):
        return build_model(v), v
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(v.seed)
    cfg = AutoConfig.for_model(
        "qwen3_moe", vocab_size=v.vocab, hidden_size=48, intermediate_size=96,
        moe_intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=12, num_experts=3, num_experts_per_tok=2,
        max_position_embeddings=64, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    return AutoModelForCausalLM.from_config(cfg), v


def _add_lora(model, spec: dict):
    """peft's LoRA of the spec, with every adapter tensor drawn at random (peft starts lora_B
    and lora_embedding_A at zero and DoRA's magnitude at the weight norm, which would hide a
    wrong fold)."""
    import torch
    from peft import LoraConfig, get_peft_model

    pm = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", **spec["lora"]))
    torch.manual_seed(spec["seed"] + 100)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_B" in name or "lora_embedding" in name or "trainable_tokens" in name:
                p.copy_(torch.randn_like(p) * 0.05)
            elif "lora_magnitude_vector" in name:
                p.mul_(1 + torch.randn_like(p) * 0.1)
    return pm


def write_lora_checkpoints(root: str | os.PathLike, world_size: int, specs: list[dict]) -> None:
    """Write each spec to ``root/<name>/`` (and its answers beside it) with ``world_size``
    gloo processes. Raises ``RuntimeError`` when a rank fails."""
    import torch.multiprocessing as mp

    Path(root).mkdir(parents=True, exist_ok=True)
    mp.start_processes(_rank_main, args=(world_size, _free_port(), str(root), specs),
                       nprocs=world_size, start_method="spawn", join=True)


def _rank_main(rank: int, world: int, port: int, root: str, specs: list[dict]) -> None:
    import warnings

    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        for spec in specs:
            _write(rank, world, Path(root), spec)
            dist.barrier()
    finally:
        dist.destroy_process_group()


def _write(rank: int, world: int, root: Path, spec: dict) -> None:
    import copy

    import torch
    from safetensors.torch import save_file
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    name = spec["name"]
    out = root / name
    model, v = _build(spec)
    hf_model = model
    if rank == 0:
        model.save_pretrained(root / f"{name}.reference")
        if spec.get("moe"):
            (root / f"{name}.memory").mkdir(parents=True, exist_ok=True)
            save_file({k: t.contiguous() for k, t in model.state_dict().items()},
                      root / f"{name}.memory" / "model.safetensors")
    pm = _add_lora(model, spec)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        copy.deepcopy(pm).merge_and_unload().save_pretrained(root / f"{name}.fold")
        pm.save_pretrained(root / f"{name}.adapter")
        cfg = spec["lora"]
        (out / "lora_train_meta.json").write_text(json.dumps(
            {"r": cfg["r"], "lora_alpha": cfg["lora_alpha"], "task_type": "CAUSAL_LM"}))
        if spec.get("adapter_config"):
            (out / "lora_adapter").mkdir()
            (out / "lora_adapter" / "adapter_config.json").write_bytes(
                (root / f"{name}.adapter" / "adapter_config.json").read_bytes())
    torch.distributed.barrier()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
    for layer in hf_model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(pm, mesh=mesh)
    sd = pm.state_dict()
    if spec.get("lora_only"):  # verl's save_lora_only: the adapter tensors alone
        sd = {k: t for k, t in sd.items() if "lora_" in k}
    if spec.get("kind") == "dcp":  # torch.distributed.checkpoint of the model state dict
        import torch.distributed.checkpoint as dcp

        dcp.save(dict(sd), checkpoint_id=str(out))
        return
    torch.save(sd, out / f"model_world_size_{world}_rank_{rank}.pt")
    if rank == 0:
        (out / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2,
                                                          "world_size": world}))
        if spec.get("moe"):
            (out / "huggingface").mkdir(parents=True, exist_ok=True)
            hf_model.config.save_pretrained(out / "huggingface")
        else:
            _hf_files(hf_model, v, out / "huggingface")

