"""Writes real Megatron-LM checkpoints of tiny GPT models with megatron-core on the CPU (gloo).

Needs the ``megatron`` extra (``pip install 'shardscope[megatron]'``, megatron-core 0.16.1);
the readers never import megatron. Used by the tests and by ``shardscope sample --megatron``.

One call writes, for one model family (:data:`FAMILIES`):

- ``reference/``: the Hugging Face folder of the unsharded model (config, tokenizer,
  ``model.safetensors``), converted from the TP=1/PP=1 Megatron state dict by plain tensor
  slicing written here (independent of the readers' piece arithmetic), plus
  ``megatron_logits.pt``: Megatron's own logits for :data:`PROBE` tokens, so a test can check
  that the merged folder computes the same function;
- for each layout ``tpT_ppP[_vppV][_epE][_uneven]``: ``torch_dist/`` (``dist_checkpointing.save``,
  as ``megatron.training`` lays it out: ``latest_checkpointed_iteration.txt`` and
  ``iter_0000010/`` with ``common.pt`` holding ``args``) and ``legacy/`` (``torch.save`` of each
  rank's ``state_dict_for_save_checkpoint()`` under ``iter_0000010/mp_rank_TT[_PPP][_EEE]/
  model_optim_rng.pt``, with ``model`` or ``model0..`` under VPP and ``args``).

Every layout holds the same weights: each is loaded from the TP=1 ``torch_dist`` checkpoint with
``dist_checkpointing.load``, i.e. resharded by megatron-core itself.

megatron-core's save path calls a few CUDA-only functions; on the CPU they are replaced by
no-ops here (``torch.cuda.synchronize``, ``torch.cuda.current_device``, the CUDA RNG tracker's
``fork``, used around attention dropout, which is off, ``Tensor.cuda`` on a tied embedding under
PP > 1) and the MoE router's undefined Transformer Engine name is set to None.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import asdict, dataclass
from pathlib import Path

#: token ids whose logits the reference records (shape (1, 12))
PROBE = [[1, 5, 17, 3, 42, 8, 299, 23, 164, 7, 211, 2]]

ITERATION = 10


@dataclass(frozen=True)
class Family:
    """A tiny model of one Hugging Face family: Megatron config and HF config in one place.
    ``vocab``: the true vocabulary; the Megatron embedding is padded to ``padded_vocab``."""

    name: str
    hf_type: str
    layers: int = 4
    hidden: int = 64
    heads: int = 4
    groups: int = 2
    ffn: int = 96
    #: at least 259: the tiny byte-level tokenizer's alphabet and special tokens must fit
    vocab: int = 300
    padded_vocab: int = 384
    qkv_bias: bool = False
    tied: bool = False
    qk_norm: bool = False
    experts: int = 0
    topk: int = 2
    #: parameter dtype: "float32" or "bfloat16"
    dtype: str = "float32"


FAMILIES = {
    # GQA, SwiGLU, untied output layer, padded vocabulary
    "llama": Family("llama", "llama"),
    # qkv bias, tied embeddings
    "qwen2": Family("qwen2", "qwen2", qkv_bias=True, tied=True),
    # q/k RMSNorm, head_dim given
    "qwen3": Family("qwen3", "qwen3", qk_norm=True),
    # Mixtral-style experts (router + SwiGLU experts)
    "mixtral": Family("mixtral", "mixtral", experts=4),
    # bf16 parameters: the merge must keep each tensor's dtype
    "llama-bf16": Family("llama-bf16", "llama", dtype="bfloat16"),
}

#: layouts written per family: (tp, pp, vpp, ep, uneven)
LAYOUTS = {
    "llama": [(2, 1, 0, 1, False), (1, 2, 0, 1, False), (2, 2, 0, 1, False),
              (1, 2, 2, 1, False), (1, 2, 0, 1, True)],
    "qwen2": [(2, 1, 0, 1, False), (2, 2, 0, 1, False)],
    "qwen3": [(2, 2, 0, 1, False)],
    "mixtral": [(1, 1, 0, 2, False), (2, 1, 0, 2, False)],
    "llama-bf16": [(2, 2, 0, 1, False)],
}


def layout_name(tp: int, pp: int, vpp: int = 0, ep: int = 1, uneven: bool = False) -> str:
    """``tp2_pp2``, ``tp1_pp2_vpp2``, ``tp1_pp1_ep2``, ``tp1_pp2_uneven``..."""
    name = f"tp{tp}_pp{pp}"
    if vpp:
        name += f"_vpp{vpp}"
    if ep > 1:
        name += f"_ep{ep}"
    if uneven:
        name += "_uneven"
    return name


def hf_config(f: Family):
    """The transformers config of the family's tiny model (imports transformers)."""
    from transformers import AutoConfig

    kw = dict(vocab_size=f.vocab, hidden_size=f.hidden, intermediate_size=f.ffn,
              num_hidden_layers=f.layers, num_attention_heads=f.heads,
              num_key_value_heads=f.groups, max_position_embeddings=64, rms_norm_eps=1e-5,
              rope_theta=10000.0, tie_word_embeddings=f.tied, bos_token_id=1, eos_token_id=2,
              torch_dtype=f.dtype)
    kw["architectures"] = [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                            "qwen3": "Qwen3ForCausalLM",
                            "mixtral": "MixtralForCausalLM"}[f.hf_type]]
    if f.hf_type == "qwen3":
        kw["head_dim"] = f.hidden // f.heads
    if f.experts:
        kw.update(num_local_experts=f.experts, num_experts_per_tok=f.topk)
    if f.hf_type == "llama":
        kw["attention_bias"] = f.qkv_bias
    return AutoConfig.for_model(f.hf_type, **kw)


def megatron_args(f: Family, tp: int, pp: int, vpp: int, ep: int,
                  uneven: bool = False) -> argparse.Namespace:
    """The ``args`` record ``megatron.training`` stores in every checkpoint (the fields the
    readers use, with Megatron-LM's names and value types: a torch dtype, a megatron enum)."""
    import torch
    from megatron.core.transformer.enums import AttnBackend

    return argparse.Namespace(
        num_layers=f.layers, hidden_size=f.hidden, ffn_hidden_size=f.ffn,
        num_attention_heads=f.heads, num_query_groups=f.groups, group_query_attention=True,
        kv_channels=f.hidden // f.heads, swiglu=True, padded_vocab_size=f.padded_vocab,
        make_vocab_size_divisible_by=64, untie_embeddings_and_output_weights=not f.tied,
        add_qkv_bias=f.qkv_bias, add_bias_linear=False, normalization="RMSNorm",
        norm_epsilon=1e-5, qk_layernorm=f.qk_norm, position_embedding_type="rope",
        rotary_base=10000, max_position_embeddings=64, seq_length=64,
        num_experts=f.experts or None, moe_router_topk=f.topk if f.experts else 2,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp or None, expert_model_parallel_size=ep,
        world_size=tp * pp * ep, params_dtype=getattr(torch, f.dtype),
        bf16=f.dtype == "bfloat16", fp16=False,
        iteration=ITERATION, tokenizer_type="HuggingFaceTokenizer",
        attention_backend=AttnBackend.auto,
        num_layers_in_first_pipeline_stage=1 if uneven else None,
        num_layers_in_last_pipeline_stage=f.layers - 1 if uneven else None)


def _rng_state() -> list:
    """The ``rng_state`` entry ``megatron.training`` writes (Python, numpy and torch
    generator states)."""
    import random

    import numpy as np
    import torch

    return [{"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
             "torch_rng_state": torch.get_rng_state(), "rng_tracker_states": {}}]


def write_megatron(root: str | os.PathLike, family: str | Family, layouts=None) -> Path:
    """Write ``root/reference`` and every layout of ``family`` (a name of :data:`FAMILIES`,
    or a :class:`Family` for other sizes; its layouts then default to TP=2 x PP=2) with
    ``max(TP x PP x EP)`` gloo processes. Returns ``root``. Raises ImportError when
    megatron-core is not installed, RuntimeError when a rank fails."""
    import importlib.util

    import torch.multiprocessing as mp

    from .sample import _free_port

    if importlib.util.find_spec("megatron.core") is None:
        raise ImportError("megatron-core is not installed: pip install 'shardscope[megatron]'")
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    f = FAMILIES[family] if isinstance(family, str) else family
    if layouts is None:
        layouts = LAYOUTS.get(f.name, [(2, 2, 0, 1, False)])
    layouts = list(layouts)
    world = max(2, max(tp * pp * ep for tp, pp, _, ep, _ in layouts))
    mp.start_processes(_rank_main, args=(world, _free_port(), str(root), asdict(f), layouts),
                       nprocs=world, start_method="spawn", join=True)
    import shutil

    shutil.rmtree(root / "_full_tp1", ignore_errors=True)  # the scratch TP=1 source
    return root


def _cpu_only() -> None:
    """megatron-core's save path synchronises CUDA and its attention forks the CUDA RNG
    tracker (for dropout, off here); there is no CUDA here."""
    import contextlib

    import torch
    from megatron.core.tensor_parallel import random as mrandom

    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"
    mrandom.CudaRNGStatesTracker.fork = lambda self, name=None: contextlib.nullcontext()
    # a tied embedding under PP > 1 is moved with .cuda() before its all-reduce
    torch.Tensor.cuda = lambda self, *a, **k: self
    # the MoE router tests a Transformer Engine name that is undefined without TE
    from megatron.core.transformer.moe import moe_utils

    moe_utils.te_general_gemm = None


def _rank_main(rank: int, world: int, port: int, root: str, family: dict, layouts) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    import logging

    logging.disable(logging.WARNING)
    import torch
    import torch.distributed as dist

    _cpu_only()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    f = Family(**family)
    root = Path(root)
    full = root / "_full_tp1"
    try:
        _write_reference(rank, f, root, full)
        for tp, pp, vpp, ep, uneven in layouts:
            _write_layout(rank, world, f, root / layout_name(tp, pp, vpp, ep, uneven), full,
                          tp, pp, vpp, ep, uneven)
    finally:
        dist.barrier()
        dist.destroy_process_group()


def _config(f: Family, tp: int, pp: int, vpp: int, ep: int, uneven: bool):
    import torch
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    kw = {}
    if uneven:
        kw.update(num_layers_in_first_pipeline_stage=1,
                  num_layers_in_last_pipeline_stage=f.layers - 1)
    if f.experts:
        kw.update(num_moe_experts=f.experts, moe_router_topk=f.topk, moe_grouped_gemm=False,
                  moe_token_dispatcher_type="allgather", expert_model_parallel_size=ep,
                  moe_aux_loss_coeff=0.0)
    return TransformerConfig(
        num_layers=f.layers, hidden_size=f.hidden, num_attention_heads=f.heads,
        num_query_groups=f.groups, ffn_hidden_size=f.ffn, kv_channels=f.hidden // f.heads,
        gated_linear_unit=True, activation_func=F.silu, normalization="RMSNorm",
        layernorm_epsilon=1e-5, add_bias_linear=False, add_qkv_bias=f.qkv_bias,
        qk_layernorm=f.qk_norm, use_cpu_initialization=True, perform_initialization=True,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp or None, pipeline_dtype=getattr(torch, f.dtype),
        params_dtype=getattr(torch, f.dtype), bf16=f.dtype == "bfloat16",
        bias_dropout_fusion=False, apply_rope_fusion=False,
        masked_softmax_fusion=False, persist_layer_norm=False,
        gradient_accumulation_fusion=False, hidden_dropout=0.0, attention_dropout=0.0, **kw)


def _models(f: Family, tp: int, pp: int, vpp: int, ep: int, uneven: bool, seed: int):
    """Initialise model parallelism and build this rank's model chunks (one, or ``vpp``)."""
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                 virtual_pipeline_model_parallel_size=vpp or None,
                                 expert_model_parallel_size=ep)
    torch.manual_seed(seed)
    cfg = _config(f, tp, pp, vpp, ep, uneven)
    spec = get_gpt_layer_local_spec(num_experts=f.experts or None, moe_grouped_gemm=False,
                                    qk_layernorm=f.qk_norm, normalization="RMSNorm")
    chunks = []
    for v in range(vpp or 1):
        vp = v if vpp else None
        chunks.append(GPTModel(
            cfg, spec, vocab_size=f.padded_vocab, max_sequence_length=64,
            pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp),
            post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp),
            share_embeddings_and_output_weights=f.tied, position_embedding_type="rope",
            rotary_base=10000, vp_stage=vp))
    return chunks


def _sharded(chunks):
    if len(chunks) == 1:
        return {"model": chunks[0].sharded_state_dict()}
    return {f"model{v}": m.sharded_state_dict() for v, m in enumerate(chunks)}


def _write_reference(rank: int, f: Family, root: Path, full: Path) -> None:
    """TP=1: the model as megatron-core initialises it, saved as ``torch_dist`` (the source of
    every layout) and, on rank 0, as the Hugging Face reference with Megatron's logits."""
    import torch
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    (m,) = _models(f, 1, 1, 0, 1, False, seed=1234)
    with torch.no_grad():  # non-trivial norms and biases, so a mix-up shows in values
        for name, p in m.named_parameters():
            if p.dim() == 1:
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(
                    sum(map(ord, name)))) * 0.1)
    if rank == 0:
        full.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save({"model": m.sharded_state_dict()}, str(full))
    if rank == 0:
        sd = {k: v for k, v in m.state_dict_for_save_checkpoint().items()
              if isinstance(v, torch.Tensor)}
        ref = root / "reference"
        _write_hf_reference(f, sd, ref)
        m.eval()
        tokens = torch.tensor(PROBE)
        pos = torch.arange(tokens.shape[1]).unsqueeze(0)
        mask = torch.triu(torch.ones(1, 1, tokens.shape[1], tokens.shape[1], dtype=torch.bool),
                          diagonal=1)
        with torch.no_grad():
            logits = m(tokens, pos, mask)
        torch.save(logits[..., :f.vocab].clone(), ref / "megatron_logits.pt")
    dist.barrier()


def megatron_to_hf(f: Family, sd: dict) -> dict:
    """The Hugging Face state dict of a TP=1/PP=1 Megatron state dict (Megatron-LM's own
    names), by direct slicing: ``linear_qkv`` viewed as (groups, heads/groups + 2, head_dim,
    hidden), ``linear_fc1`` as [gate; up], the vocabulary padding cut."""
    hd = f.hidden // f.heads
    hpg = f.heads // f.groups
    out = {"model.embed_tokens.weight": sd["embedding.word_embeddings.weight"][:f.vocab],
           "model.norm.weight": sd["decoder.final_layernorm.weight"]}
    if not f.tied:
        out["lm_head.weight"] = sd["output_layer.weight"][:f.vocab]
    for i in range(f.layers):
        m, h = f"decoder.layers.{i}.", f"model.layers.{i}."
        out[h + "input_layernorm.weight"] = sd[m + "input_layernorm.weight"]
        for kind in ("weight", "bias") if f.qkv_bias else ("weight",):
            qkv = sd[m + f"self_attention.linear_qkv.{kind}"]
            g = qkv.reshape(f.groups, hpg + 2, hd, *qkv.shape[1:])
            out[h + f"self_attn.q_proj.{kind}"] = g[:, :hpg].reshape(-1, *qkv.shape[1:])
            out[h + f"self_attn.k_proj.{kind}"] = g[:, hpg].reshape(-1, *qkv.shape[1:])
            out[h + f"self_attn.v_proj.{kind}"] = g[:, hpg + 1].reshape(-1, *qkv.shape[1:])
        out[h + "self_attn.o_proj.weight"] = sd[m + "self_attention.linear_proj.weight"]
        if f.qk_norm:
            out[h + "self_attn.q_norm.weight"] = sd[m + "self_attention.q_layernorm.weight"]
            out[h + "self_attn.k_norm.weight"] = sd[m + "self_attention.k_layernorm.weight"]
        out[h + "post_attention_layernorm.weight"] = sd[m + "pre_mlp_layernorm.weight"]
        if f.experts:
            out[h + "block_sparse_moe.gate.weight"] = sd[m + "mlp.router.weight"]
            for e in range(f.experts):
                x = f"{m}mlp.experts.local_experts.{e}."
                hx = f"{h}block_sparse_moe.experts.{e}."
                fc1 = sd[x + "linear_fc1.weight"]
                out[hx + "w1.weight"], out[hx + "w3.weight"] = fc1[:f.ffn], fc1[f.ffn:]
                out[hx + "w2.weight"] = sd[x + "linear_fc2.weight"]
        else:
            fc1 = sd[m + "mlp.linear_fc1.weight"]
            out[h + "mlp.gate_proj.weight"], out[h + "mlp.up_proj.weight"] = (fc1[:f.ffn],
                                                                               fc1[f.ffn:])
            out[h + "mlp.down_proj.weight"] = sd[m + "mlp.linear_fc2.weight"]
    return {k: v.contiguous().clone() for k, v in out.items()}


def _write_hf_reference(f: Family, sd: dict, ref: Path) -> None:
    from safetensors.torch import save_file

    from .sample import tiny_tokenizer

    ref.mkdir(parents=True, exist_ok=True)
    hf_config(f).save_pretrained(ref)
    tiny_tokenizer(f.vocab).save_pretrained(ref)
    save_file(megatron_to_hf(f, sd), str(ref / "model.safetensors"), metadata={"format": "pt"})


def _write_layout(rank: int, world: int, f: Family, out: Path, full: Path, tp: int, pp: int,
                  vpp: int, ep: int, uneven: bool) -> None:
    """One layout from the TP=1 checkpoint, resharded by megatron-core: ``torch_dist`` by
    every rank, ``legacy`` by the first data-parallel replica of each model-parallel rank."""
    import torch
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    chunks = _models(f, tp, pp, vpp, ep, uneven, seed=99)
    loaded = dist_checkpointing.load(_sharded(chunks), str(full))
    if len(chunks) == 1:
        chunks[0].load_state_dict(loaded["model"])
    else:
        for v, m in enumerate(chunks):
            m.load_state_dict(loaded[f"model{v}"])
    args = megatron_args(f, tp, pp, vpp, ep, uneven)
    it = f"iter_{ITERATION:07d}"
    dist_dir, legacy_dir = out / "torch_dist", out / "legacy"
    if rank == 0:
        for d in (dist_dir / it, legacy_dir / it):
            d.mkdir(parents=True, exist_ok=True)
        for d in (dist_dir, legacy_dir):
            (d / "latest_checkpointed_iteration.txt").write_text(str(ITERATION))
        hf_config(f).save_pretrained(dist_dir / "huggingface")
        from .sample import tiny_tokenizer

        tiny_tokenizer(f.vocab).save_pretrained(dist_dir / "huggingface")
    dist.barrier()
    state = {"args": args, "checkpoint_version": 3.0, "iteration": ITERATION, **_sharded(chunks)}
    dist_checkpointing.save(state, str(dist_dir / it))
    # Megatron-LM: with EP every expert-parallel rank writes (dense weights + its experts)
    first = ps.get_expert_data_parallel_rank() == 0 if ep > 1 else ps.get_data_parallel_rank() == 0
    if first:
        name = f"mp_rank_{ps.get_tensor_model_parallel_rank():02d}"
        if pp > 1:
            name += f"_{ps.get_pipeline_model_parallel_rank():03d}"
        if ep > 1:
            name += f"_{ps.get_expert_model_parallel_rank():03d}"
        d = legacy_dir / it / name
        d.mkdir(parents=True, exist_ok=True)
        state = {"args": args, "checkpoint_version": 3.0, "iteration": ITERATION,
                 "rng_state": _rng_state()}
        if len(chunks) == 1:
            state["model"] = chunks[0].state_dict_for_save_checkpoint()
        else:
            for v, m in enumerate(chunks):
                state[f"model{v}"] = m.state_dict_for_save_checkpoint()
        torch.save(state, d / "model_optim_rng.pt")
    dist.barrier()
