"""Writes verl-layout FSDP2 checkpoints of tiny models whose in-memory names or tensors differ
from what ``save_pretrained`` writes, with real torch.distributed (gloo, CPU).

Each family is built from a config with transformers 5 (no download) and a fixed seed; its
reference is ``save_pretrained`` of the same model before sharding. The checkpoint is what verl
writes: ``model_world_size_{W}_rank_{r}.pt`` (``torch.save`` of ``model.state_dict()`` after
``fully_shard`` of every decoder/encoder block and of the root), ``fsdp_config.json``, and
``huggingface/`` (config, generation config, tokenizer, and the processor files of a
vision-language model).

Families (:data:`FAMILIES`): Qwen2.5-VL and Llava (in memory ``model.language_model.*``,
``model.visual.*``/``model.vision_tower.*``), Qwen3-MoE and Mixtral (experts fused in memory as
``mlp.experts.gate_up_proj`` ``[E, 2F, H]`` and ``down_proj`` ``[E, H, F]``), T5 (one tensor
tied under four names); :data:`DCP_FAMILIES` also as a DCP folder. Sizes differ on purpose (experts != layers, world sizes 2 and 3).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

#: family -> (world size, dtype, seed)
FAMILIES = {
    "qwen2_5_vl": (2, "F32", 50),
    "qwen2_vl": (2, "F32", 55),
    "llava": (3, "F32", 51),
    "qwen3_moe": (3, "F32", 52),
    "mixtral": (2, "BF16", 53),
    "t5": (2, "F32", 54),
}

#: families also written as a DCP folder ``<family>.dcp/`` (pass ``huggingface/`` as config)
DCP_FAMILIES = ("qwen3_moe", "qwen2_5_vl")

VOCAB = 320


def tiny_config(family: str):
    """A transformers config of a tiny model of ``family`` (imports transformers)."""
    from transformers import AutoConfig

    text = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=128, bos_token_id=1,
                eos_token_id=2, tie_word_embeddings=False)
    if family == "qwen2_5_vl":
        return AutoConfig.for_model(
            "qwen2_5_vl", text_config=dict(text, num_hidden_layers=2, rope_scaling={
                "type": "mrope", "mrope_section": [2, 2, 4]}),
            vision_config=dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2,
                               out_hidden_size=64, patch_size=14, spatial_merge_size=2,
                               temporal_patch_size=2, fullatt_block_indexes=[1]),
            image_token_id=300, video_token_id=301, vision_start_token_id=302,
            tie_word_embeddings=False)
    if family == "qwen2_vl":
        return AutoConfig.for_model(
            "qwen2_vl", text_config=dict(text, num_hidden_layers=2, rope_scaling={
                "type": "mrope", "mrope_section": [2, 2, 4]}),
            vision_config=dict(depth=2, embed_dim=32, hidden_size=64, mlp_ratio=2,
                               num_heads=2, patch_size=14, spatial_merge_size=2,
                               temporal_patch_size=2),
            image_token_id=300, video_token_id=301, vision_start_token_id=302,
            tie_word_embeddings=False)
    if family == "llava":
        return AutoConfig.for_model(
            "llava", text_config=dict(text, model_type="llama", num_hidden_layers=3),
            vision_config=dict(model_type="clip_vision_model", hidden_size=32,
                               intermediate_size=40, num_hidden_layers=2,
                               num_attention_heads=2, image_size=28, patch_size=14,
                               projection_dim=32),
            image_token_id=300, vision_feature_layer=-1)
    if family == "qwen3_moe":
        return AutoConfig.for_model("qwen3_moe", **dict(text, num_hidden_layers=2, head_dim=16,
                                                        num_experts=5, num_experts_per_tok=2,
                                                        moe_intermediate_size=24,
                                                        decoder_sparse_step=1))
    if family == "mixtral":
        return AutoConfig.for_model("mixtral", **dict(text, num_hidden_layers=4,
                                                      num_local_experts=3,
                                                      num_experts_per_tok=2))
    if family == "t5":
        return AutoConfig.for_model("t5", vocab_size=VOCAB, d_model=48, d_kv=12, d_ff=80,
                                    num_layers=2, num_decoder_layers=3, num_heads=4,
                                    decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
                                    tie_word_embeddings=True)
    raise ValueError(f"unknown family {family}")


def build_model(family: str, seed: int, dtype: str = "F32"):
    """The tiny model of ``family``, deterministic for ``seed``, with its 1-D parameters moved
    off their initial values (so a mix-up of norms or biases shows)."""
    import torch
    import transformers

    torch.manual_seed(seed)
    config = tiny_config(family)
    cls = {"qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
           "qwen2_vl": "Qwen2VLForConditionalGeneration",
           "llava": "LlavaForConditionalGeneration", "qwen3_moe": "Qwen3MoeForCausalLM",
           "mixtral": "MixtralForCausalLM", "t5": "T5ForConditionalGeneration"}[family]
    model = getattr(transformers, cls)(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    if dtype == "BF16":
        model = model.to(torch.bfloat16)
    return model


def _blocks(model):
    """The repeated blocks FSDP2 wraps one by one (verl wraps each decoder layer and vision
    block): elements of ModuleLists named ``layers``, ``blocks`` or ``block``."""
    import torch

    return [m for name, ml in model.named_modules() if isinstance(ml, torch.nn.ModuleList)
            and name.rsplit(".", 1)[-1] in ("layers", "blocks", "block") for m in ml]


def _side_files(model, family: str, out: Path) -> None:
    from .sample import tiny_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(out)
    if model.can_generate():
        model.generation_config.save_pretrained(out)
    tiny_tokenizer(VOCAB).save_pretrained(out)
    if family in ("qwen2_5_vl", "qwen2_vl"):
        from transformers import Qwen2VLImageProcessor

        Qwen2VLImageProcessor(patch_size=14, merge_size=2, temporal_patch_size=2
                              ).save_pretrained(out)
        (out / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }}"
                                                 "{% endfor %}")
    elif family == "llava":
        from transformers import CLIPImageProcessor

        CLIPImageProcessor(size={"shortest_edge": 28}, crop_size=28).save_pretrained(out)


def write_models(root: str | os.PathLike, families=None) -> None:
    """Write ``root/<family>/`` (the checkpoint) and ``root/<family>.reference/`` for each of
    ``families`` (default: all), one gloo process group per world size."""
    import torch.multiprocessing as mp

    from .sample import _free_port

    families = list(families or FAMILIES)
    by_world: dict[int, list[str]] = {}
    for f in families:
        by_world.setdefault(FAMILIES[f][0], []).append(f)
    Path(root).mkdir(parents=True, exist_ok=True)
    for world, fams in sorted(by_world.items()):
        mp.start_processes(_rank_main, args=(world, _free_port(), str(root), fams),
                           nprocs=world, start_method="spawn", join=True)


def _rank_main(rank: int, world: int, port: int, root: str, families: list[str]) -> None:
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
        for family in families:
            _write(rank, world, Path(root), family)
            dist.barrier()
    finally:
        dist.destroy_process_group()


def _write(rank: int, world: int, root: Path, family: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    _, dtype, seed = FAMILIES[family]
    model = build_model(family, seed, dtype)
    out = root / family
    if rank == 0:
        model.save_pretrained(root / f"{family}.reference")
        _side_files(model, family, out / "huggingface")
        (out / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2,
                                                          "world_size": world}))
    dist.barrier()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
    for block in _blocks(model):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    sd = model.state_dict()
    torch.save(sd, out / f"model_world_size_{world}_rank_{rank}.pt")
    if family in DCP_FAMILIES:  # the same shards through torch.distributed.checkpoint
        import torch.distributed.checkpoint as dcp

        dcp.save(dict(sd), checkpoint_id=str(root / f"{family}.dcp"))


def write_deepspeed_moe(root: str | os.PathLike, name: str = "qwen3_moe.ds-z2",
                        world: int = 2, stage: int = 2) -> None:
    """A DeepSpeed ZeRO checkpoint (CPU accelerator, gloo) of the tiny Qwen3-MoE at
    ``root/<name>/``: its fused experts are stored as ranges of flat fp32 partitions. The
    model's config is in ``huggingface/``, ``save_pretrained`` of the weights at
    ``root/<name>.reference/``. Needs deepspeed."""
    import torch.multiprocessing as mp

    from .sample import _free_port

    Path(root).mkdir(parents=True, exist_ok=True)
    mp.start_processes(_deepspeed_rank, args=(world, _free_port(), str(root), name, stage),
                       nprocs=world, start_method="spawn", join=True)


def _deepspeed_rank(rank, world, port, root, name, stage) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      DS_ACCELERATOR="cpu")
    import deepspeed
    import torch

    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    model = build_model("qwen3_moe", FAMILIES["qwen3_moe"][2] + 100)
    out = Path(root) / name
    if rank == 0:
        model.save_pretrained(Path(root) / f"{name}.reference")
        _side_files(model, "qwen3_moe", out / "huggingface")
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": stage},
              "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=config)
    engine.save_checkpoint(str(out), tag="global_step0")
    torch.distributed.barrier()
