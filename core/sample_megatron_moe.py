"""Writes real Megatron-LM MoE checkpoints whose layer count differs from their expert count,
with and without grouped GEMM, with megatron-core 0.16.1 on the CPU (gloo).

Built on :mod:`core.sample_megatron` (same folder layout: ``reference/`` with Megatron's logits,
and per layout ``torch_dist/`` and ``legacy/``); kept apart so that its fixtures have their own
cache key.

Grouped GEMM (``--moe-grouped-gemm``, megatron-core's legacy ``GroupedMLP`` of
``megatron/core/transformer/moe/experts.py``): each EP rank keeps its local experts stacked as
``weight1`` (``[hidden, local experts x 2 x ffn / TP]``) and ``weight2`` (``[local experts x ffn
/ TP, hidden]``). ``GroupedMLP`` needs the ``grouped_gemm`` package only for its forward
(``gg.ops.gmm``); its constructor asserts the package is present, which is switched off here
(the weights are created, loaded and saved by megatron-core's own code, never run). The grouped
layouts are loaded with ``dist_checkpointing.load`` from the same TP=1 ``SequentialMLP``
checkpoint as the reference: megatron-core's own conversion (``GroupedMLP.sharded_state_dict``)
places every expert's fc1/fc2 into ``weight1``/``weight2``.
"""

from __future__ import annotations

import os
from dataclasses import asdict
from pathlib import Path

from .sample_megatron import Family

#: MoE families whose layer count differs from the expert count: (family, grouped GEMM,
#: layouts (tp, pp, vpp, ep, uneven))
MOE_SETS: dict[str, tuple[Family, bool, list[tuple]]] = {
    # 2 layers, 4 experts: EP 1, 2 and 4, TP2 x EP2, PP2 x EP2
    "moe-l2e4": (Family("moe-l2e4", "mixtral", layers=2, experts=4, hidden=64, ffn=80),
                 False, [(1, 1, 0, 1, False), (1, 1, 0, 2, False), (1, 1, 0, 4, False),
                         (2, 1, 0, 2, False), (1, 2, 0, 2, False)]),
    # 3 layers, 2 experts: EP 2, TP2 (experts split by TP)
    "moe-l3e2": (Family("moe-l3e2", "mixtral", layers=3, experts=2, hidden=48, heads=4,
                        groups=2, ffn=72),
                 False, [(1, 1, 0, 2, False), (2, 1, 0, 1, False)]),
    # grouped GEMM, bf16 (as trained with --moe-grouped-gemm): 2 layers, 4 experts
    "gg-l2e4-bf16": (Family("gg-l2e4-bf16", "mixtral", layers=2, experts=4, hidden=64, ffn=96,
                            dtype="bfloat16"),
                     True, [(1, 1, 0, 2, False), (1, 1, 0, 4, False), (2, 1, 0, 2, False),
                            (1, 2, 0, 2, False)]),
    # grouped GEMM, fp32: 3 layers, 2 experts, EP 1 and 2
    "gg-l3e2": (Family("gg-l3e2", "mixtral", layers=3, experts=2, hidden=48, ffn=40),
                True, [(1, 1, 0, 1, False), (1, 1, 0, 2, False)]),
}


def write_moe(root: str | os.PathLike, name: str) -> Path:
    """Write ``root`` (``reference/`` and each layout's ``torch_dist/`` and ``legacy/``) for
    the set ``name`` of :data:`MOE_SETS` with ``max(2, TP x PP x EP)`` gloo processes.
    Raises ImportError without megatron-core, RuntimeError when a rank fails."""
    import importlib.util

    import torch.multiprocessing as mp

    from .sample import _free_port
    from .sample_megatron import write_megatron

    f, grouped, layouts = MOE_SETS[name]
    if not grouped:
        return write_megatron(root, f, layouts)
    if importlib.util.find_spec("megatron.core") is None:
        raise ImportError("megatron-core is not installed: pip install 'shardscope[megatron]'")
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    world = max(2, max(tp * pp * ep for tp, pp, _, ep, _ in layouts))
    mp.start_processes(_grouped_rank_main,
                       args=(world, _free_port(), str(root), asdict(f), layouts),
                       nprocs=world, start_method="spawn", join=True)
    import shutil

    shutil.rmtree(root / "_full_tp1", ignore_errors=True)
    return root


def _grouped_models(f: Family, tp: int, pp: int, vpp: int, ep: int, uneven: bool, seed: int):
    """This rank's model chunks as :func:`core.sample_megatron._models` builds them, but with
    ``moe_grouped_gemm=True`` (the local spec then gives megatron-core's ``GroupedMLP``)."""
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from . import sample_megatron as sm

    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                 virtual_pipeline_model_parallel_size=vpp or None,
                                 expert_model_parallel_size=ep)
    torch.manual_seed(seed)
    cfg = sm._config(f, tp, pp, vpp, ep, uneven)
    cfg.moe_grouped_gemm = True
    spec = get_gpt_layer_local_spec(num_experts=f.experts, moe_grouped_gemm=True,
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
    from megatron.core.transformer.moe.experts import GroupedMLP

    assert any(isinstance(m, GroupedMLP) for m in chunks[0].modules()), "no GroupedMLP built"
    return chunks


def _grouped_rank_main(rank: int, world: int, port: int, root: str, family: dict,
                       layouts) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    import logging

    logging.disable(logging.WARNING)
    import torch
    import torch.distributed as dist
    from megatron.core.transformer.moe import grouped_gemm_util as gg

    from . import sample_megatron as sm

    sm._cpu_only()
    gg.assert_grouped_gemm_is_available = lambda: None  # only gmm (the forward) needs it
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    f = Family(**family)
    root = Path(root)
    full = root / "_full_tp1"
    try:
        # the reference (and Megatron's logits) from SequentialMLP experts, TP=1
        sm._write_reference(rank, f, root, full)
        # the layouts with GroupedMLP, loaded from that checkpoint by megatron-core
        sm._models = _grouped_models  # this spawned process only
        plain_args = sm.megatron_args

        def grouped_args(*a, **k):  # megatron.training records the flag in args
            args = plain_args(*a, **k)
            args.moe_grouped_gemm = True
            return args

        sm.megatron_args = grouped_args
        for tp, pp, vpp, ep, uneven in layouts:
            sm._write_layout(rank, world, f, root / sm.layout_name(tp, pp, vpp, ep, uneven),
                             full, tp, pp, vpp, ep, uneven)
    finally:
        dist.barrier()
        dist.destroy_process_group()
