"""Real FSDP2 checkpoints of models whose head is not a plain language-model head, written by
torch.distributed (gloo, CPU) in verl's layout, each with its ``save_pretrained`` reference:

- ``critic``: verl's critic, a ``Qwen2ForTokenClassification`` with one label (a ``score``
  head with bias, no ``lm_head``). verl builds it with ``AutoModelForTokenClassification``
  from the actor's config and saves ``model.config`` into ``huggingface/``, so config.json
  keeps the actor's ``architectures`` (``Qwen2ForCausalLM``) with ``num_labels`` 1
  (verl/utils/checkpoint/fsdp_checkpoint_manager.py, verl/utils/model.py
  ``load_valuehead_model``).
- ``reward``: a reward model, ``LlamaForSequenceClassification`` with one label (``score``
  without bias), its config naming that class (as a reward model's own folder does).
- ``t5``: ``T5ForConditionalGeneration`` with tied embeddings: FSDP2's state dict holds the
  one tensor under four names (``shared``, ``encoder.embed_tokens``,
  ``decoder.embed_tokens``, ``lm_head``); ``save_pretrained`` writes ``shared`` alone.

Models are built from tiny configs with fixed seeds (no download). Each rank is a process
(``spawn``); see :mod:`core.sample` for the general writer.
"""

from __future__ import annotations

import os
from pathlib import Path

HEADS = ("critic", "reward", "t5")


def build_head_model(kind: str):
    """The tiny model of ``kind`` (one of :data:`HEADS`) and the config to write into
    ``huggingface/`` (as the training framework saves it)."""
    import copy

    import torch
    from transformers import (AutoConfig, AutoModelForSequenceClassification,
                              AutoModelForTokenClassification, T5Config,
                              T5ForConditionalGeneration)

    torch.manual_seed({"critic": 50, "reward": 51, "t5": 52}[kind])
    if kind == "t5":
        cfg = T5Config(vocab_size=277, d_model=32, d_kv=8, d_ff=72, num_layers=2,
                       num_decoder_layers=3, num_heads=4, decoder_start_token_id=0,
                       pad_token_id=0, eos_token_id=1)
        model = T5ForConditionalGeneration(cfg)
        saved_cfg = copy.deepcopy(model.config)
    else:
        family = "qwen2" if kind == "critic" else "llama"
        cfg = AutoConfig.for_model(family, vocab_size=293, hidden_size=48,
                                   intermediate_size=112, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=128, tie_word_embeddings=False,
                                   num_labels=1, pad_token_id=0, bos_token_id=1,
                                   eos_token_id=2)
        if kind == "critic":
            cfg.architectures = ["Qwen2ForCausalLM"]  # the actor's, as verl keeps it
            model = AutoModelForTokenClassification.from_config(cfg)
        else:
            model = AutoModelForSequenceClassification.from_config(cfg)
        saved_cfg = copy.deepcopy(model.config)
        if kind == "reward":
            saved_cfg.architectures = [type(model).__name__]
    with torch.no_grad():  # non-trivial biases and norms, so a mix-up shows in values
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    return model, saved_cfg


def write_heads(root: str | os.PathLike, world_size: int = 2) -> None:
    """Write ``root/<kind>/`` (verl layout: ``model_world_size_W_rank_r.pt``,
    ``fsdp_config.json``, ``huggingface/``) and ``root/<kind>.reference/`` for every kind of
    :data:`HEADS`, with ``world_size`` gloo processes. Raises RuntimeError when a rank fails."""
    import torch.multiprocessing as mp

    from .sample import _free_port

    Path(root).mkdir(parents=True, exist_ok=True)
    mp.start_processes(_rank_main, args=(world_size, _free_port(), str(root)),
                       nprocs=world_size, start_method="spawn", join=True)


def _rank_main(rank: int, world: int, port: int, root: str) -> None:
    import json
    import warnings

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    warnings.filterwarnings("ignore")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
        for kind in HEADS:
            model, saved_cfg = build_head_model(kind)
            out = Path(root) / kind
            if rank == 0:
                hf = out / "huggingface"
                hf.mkdir(parents=True, exist_ok=True)
                saved_cfg.save_pretrained(hf)
                model.save_pretrained(Path(root) / f"{kind}.reference")
                (out / "fsdp_config.json").write_text(json.dumps(
                    {"FSDP_version": 2, "world_size": world}))
            dist.barrier()
            blocks = (list(model.encoder.block) + list(model.decoder.block) if kind == "t5"
                      else list(model.model.layers))
            for block in blocks:
                fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh)
            torch.save(model.state_dict(), out / f"model_world_size_{world}_rank_{rank}.pt")
            dist.barrier()
    finally:
        dist.destroy_process_group()
