"""Regenerate the framework-native fixtures of tests/data/native/ with the REAL frameworks.

Runs in a side venv (never the project's): torch 2.13.0 (CPU), torchtitan 0.3.0, torchtune
0.6.1 (+ torchao 0.11.0, its import needs), transformers 5.24.0. See README.md beside this file.

    /work/venvs/native/bin/python tests/data/native/make_native.py tests/data/native

Each fixture: a checkpoint written by the framework under FSDP2 (gloo, CPU, W ranks), its
``hf_config/config.json`` and ``reference/`` — the framework's OWN exporter applied to the full
state dict (torchtitan: ``Llama3StateDictAdapter.to_hf``; torchtune:
``convert_weights.tune_to_hf``), loaded into transformers' ``LlamaForCausalLM`` (strict) and
written with ``save_pretrained``. The torchtune fixture also keeps the native model's logits on
fixed tokens (``logits.pt``), computed by torchtune's own forward.
"""

from __future__ import annotations

import os
import shutil
import sys
import types
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _stub_gpu_kernels():
    # torchtitan 0.3.0 imports its expert-parallel Triton kernels at package import; they are
    # GPU-only and unused here (no triton wheel on this CPU machine), so that one module is
    # replaced by an empty one. The model, its FSDP2 sharding and the adapter are torchtitan's.
    name = "torchtitan.distributed.minimal_async_ep.kernels"
    k = types.ModuleType(name)
    k.__getattr__ = lambda n: None
    sys.modules[name] = k


TITAN = {
    # name: (world size, layers, dim, heads, kv heads, ffn, vocab, tied, dtype)
    "titan_w2_fp32": (2, 3, 32, 4, 2, 80, 260, False, torch.float32),
    "titan_w3_bf16_tied": (3, 2, 48, 6, 2, 64, 250, True, torch.bfloat16),
}
TUNE = {
    # name: (world size, layers, dim, heads, kv heads, ffn, vocab)
    "tune_w2_fp32": (2, 2, 32, 2, 1, 72, 264),
}
QWEN3 = {
    # name: (world size, layers, dim, heads, kv heads, head dim, ffn, vocab), tied, fp32
    "titan_qwen3_w2_fp32": (2, 2, 32, 4, 2, 16, 48, 240),
}
#: torchtune's model, its keys renamed to Meta's Llama names by torchtune's own tune_to_meta
#: (the names of Meta's consolidated checkpoints and of torchtitan's Llama before 0.3)
META = {
    # name: (world size, layers, dim, heads, kv heads, ffn, vocab)
    "meta_w3_bf16": (3, 3, 40, 5, 1, 56, 230),
}
STEP = 10


def hf_config(layers, dim, heads, kv, ffn, vocab, tied, eps, theta, dtype):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=vocab, hidden_size=dim, intermediate_size=ffn,
                       num_hidden_layers=layers, num_attention_heads=heads,
                       num_key_value_heads=kv, rms_norm_eps=eps, rope_theta=theta,
                       max_position_embeddings=64, tie_word_embeddings=tied,
                       torch_dtype=str(dtype).replace("torch.", ""),
                       architectures=["LlamaForCausalLM"])


def write_reference(hf_sd: dict, cfg, out: Path, dtype):
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM(cfg).to(dtype)
    missing, unexpected = model.load_state_dict(hf_sd, strict=False)
    allowed = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
    assert set(missing) <= allowed and not unexpected, (missing, unexpected)
    if cfg.tie_word_embeddings:
        model.tie_weights()
    model.save_pretrained(out)
    cfg.save_pretrained(out.parent / "hf_config")


def _init_pg(rank, world, port):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))


def titan_worker(rank, world, port, name, out):
    _stub_gpu_kernels()
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                         get_model_state_dict)
    from torch.distributed.fsdp import fully_shard
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.llama3 import (_EMBEDDING_INIT, _NORM_INIT, Llama3Model,
                                          _build_llama3_layers, _output_linear_init)
    from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter

    world, layers, dim, heads, kv, ffn, vocab, tied, dtype = TITAN[name]
    mesh = _init_pg(rank, world, port)
    torch.manual_seed(0)
    cfg = Llama3Model.Config(
        dim=dim, vocab_size=vocab, enable_weight_tying=tied,
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim,
                                        param_init=_EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab,
                              param_init=_output_linear_init(dim)),
        layers=_build_llama3_layers(
            fuse_qkv=True, n_layers=layers, dim=dim, n_heads=heads, n_kv_heads=kv,
            hidden_dim=ffn, rope=ComplexRoPE.Config(dim=dim // heads, max_seq_len=64,
                                                    theta=500000),
            attn_backend="flex"))
    model = cfg.build()
    model.init_states()
    with torch.no_grad():  # the norms start at ones: make them distinct values
        for n, p in model.named_parameters():
            if "norm" in n:
                p.add_(torch.randn_like(p) * 0.1)
    model.to(dtype)
    for layer in model.layers.values():
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    from torchtitan.components.checkpointer.base import ModelWrapper

    # torchtitan's CheckpointManager saves ModelWrapper's flat model keys at the top level
    # beside train_state (torchtitan/components/checkpointer/{base,dcp}.py,
    # _flattened_model_states_sd)
    sd = ModelWrapper(model).state_dict()
    state = dict(sd)
    state["train_state"] = {"step": STEP}
    dcp.save(state, checkpoint_id=str(out / "checkpoint" / f"step-{STEP}"))
    full = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in sd.items()}
    if rank == 0:
        hf_sd = Llama3StateDictAdapter(cfg, None).to_hf(full)
        conf = hf_config(layers, dim, heads, kv, ffn, vocab, tied, 1e-5, 500000, dtype)
        write_reference(hf_sd, conf, out / "reference", dtype)
    dist.barrier()
    dist.destroy_process_group()


def tune_worker(rank, world, port, name, out):
    from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                         get_model_state_dict)
    from torch.distributed.fsdp import fully_shard
    from torchtune.models.convert_weights import tune_to_hf
    from torchtune.models.llama3 import llama3
    from torchtune.training.checkpointing import DistributedCheckpointer

    world, layers, dim, heads, kv, ffn, vocab = TUNE[name]
    mesh = _init_pg(rank, world, port)
    torch.manual_seed(1)
    model = llama3(vocab_size=vocab, num_layers=layers, num_heads=heads, num_kv_heads=kv,
                   embed_dim=dim, max_seq_len=64, intermediate_dim=ffn)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * (0.1 if "scale" in n else 0.2)
                    + (1.0 if "scale" in n else 0.0))
    tokens = torch.arange(12).reshape(1, 12) * 7 % vocab
    if rank == 0:
        with torch.no_grad():
            logits = model(tokens)
        torch.save({"tokens": tokens, "logits": logits}, out / "logits.pt")
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    sd = get_model_state_dict(model)
    ckpt = DistributedCheckpointer(checkpoint_dir=str(out), output_dir=str(out / "checkpoint"))
    ckpt.save_checkpoint({"model": sd}, epoch=0)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                cpu_offload=True))
    if rank == 0:
        hf_sd = tune_to_hf(full, num_heads=heads, num_kv_heads=kv, dim=dim)
        conf = hf_config(layers, dim, heads, kv, ffn, vocab, False, 1e-5, 500000,
                         torch.float32)
        write_reference(hf_sd, conf, out / "reference", torch.float32)
    dist.barrier()
    dist.destroy_process_group()


def meta_worker(rank, world, port, name, out):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.fsdp import fully_shard
    from torchtune.models.convert_weights import tune_to_hf, tune_to_meta
    from torchtune.models.llama3 import llama3

    world, layers, dim, heads, kv, ffn, vocab = META[name]
    mesh = _init_pg(rank, world, port)
    torch.manual_seed(2)
    model = llama3(vocab_size=vocab, num_layers=layers, num_heads=heads, num_kv_heads=kv,
                   embed_dim=dim, max_seq_len=64, intermediate_dim=ffn)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * 0.2 + (1.0 if "scale" in n else 0.0))
    model.to(torch.bfloat16)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    sd = get_model_state_dict(model)
    state = dict(tune_to_meta(sd))  # flat model keys beside train_state, as torchtitan
    state["train_state"] = {"step": STEP}
    dcp.save(state, checkpoint_id=str(out / "checkpoint" / f"step-{STEP}"))
    full = {k: v.full_tensor() for k, v in sd.items()}
    if rank == 0:
        hf_sd = tune_to_hf(full, num_heads=heads, num_kv_heads=kv, dim=dim)
        conf = hf_config(layers, dim, heads, kv, ffn, vocab, False, 1e-5, 500000,
                         torch.bfloat16)
        write_reference(hf_sd, conf, out / "reference", torch.bfloat16)
    dist.barrier()
    dist.destroy_process_group()


def qwen3_worker(rank, world, port, name, out):
    _stub_gpu_kernels()
    from torch.distributed.fsdp import fully_shard
    from torchtitan.components.checkpointer.base import ModelWrapper
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear
    from torchtitan.models.qwen3 import (_EMBEDDING_SKIP_INIT, _EPS, _LINEAR_INIT, Qwen3Model,
                                         _build_qwen3_layers, _qwen3_norm)
    from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter
    from transformers import Qwen3Config
    import torch.distributed.checkpoint as dcp

    world, layers, dim, heads, kv, hd, ffn, vocab = QWEN3[name]
    mesh = _init_pg(rank, world, port)
    torch.manual_seed(3)
    cfg = Qwen3Model.Config(
        vocab_size=vocab, dim=dim, norm=_qwen3_norm(dim), enable_weight_tying=True,
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim,
                                        param_init=_EMBEDDING_SKIP_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=_LINEAR_INIT),
        layers=_build_qwen3_layers(
            fuse_qkv=True, n_layers=layers, dim=dim, n_heads=heads, n_kv_heads=kv,
            head_dim=hd, hidden_dim=ffn, attn_backend="flex",
            rope=CosSinRoPE.Config(dim=hd, max_seq_len=64, theta=1000000.0)))
    model = cfg.build()
    model.init_states()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.add_(torch.randn_like(p) * 0.1)
    for layer in model.layers.values():
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    sd = ModelWrapper(model).state_dict()
    state = dict(sd)
    state["train_state"] = {"step": STEP}
    dcp.save(state, checkpoint_id=str(out / "checkpoint" / f"step-{STEP}"))
    full = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in sd.items()}
    if rank == 0:
        hf_sd = Qwen3StateDictAdapter(cfg, None).to_hf(full)
        conf = Qwen3Config(vocab_size=vocab, hidden_size=dim, intermediate_size=ffn,
                           num_hidden_layers=layers, num_attention_heads=heads,
                           num_key_value_heads=kv, head_dim=hd, rms_norm_eps=_EPS,
                           rope_theta=1000000.0, max_position_embeddings=64,
                           tie_word_embeddings=True, torch_dtype="float32",
                           architectures=["Qwen3ForCausalLM"])
        from transformers import Qwen3ForCausalLM

        m = Qwen3ForCausalLM(conf)
        missing, unexpected = m.load_state_dict(hf_sd, strict=False)
        assert set(missing) <= {"lm_head.weight"} and not unexpected, (missing, unexpected)
        m.tie_weights()
        m.save_pretrained(out / "reference")
        conf.save_pretrained(out / "hf_config")
    dist.barrier()
    dist.destroy_process_group()


def main(root: str, only: list[str]):
    root = Path(root)
    port = 29611
    jobs = [(n, titan_worker, TITAN[n][0]) for n in TITAN]
    jobs += [(n, tune_worker, TUNE[n][0]) for n in TUNE]
    jobs += [(n, meta_worker, META[n][0]) for n in META]
    jobs += [(n, qwen3_worker, QWEN3[n][0]) for n in QWEN3]
    for name, worker, world in jobs:
        if only and name not in only:
            continue
        out = root / name
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        mp.spawn(worker, (world, port, name, out), nprocs=world)
        port += 1


if __name__ == "__main__":
    # make_native.py [ROOT [FIXTURE ...]]: every fixture, or only those named
    main(sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.abspath(__file__)),
         sys.argv[2:])
