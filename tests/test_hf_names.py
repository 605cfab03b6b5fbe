"""Merges write the names and tensors ``save_pretrained`` writes (core/hf_names.py): VLMs'
in-memory ``model.language_model.*``/``model.visual.*`` renamed, fused experts cut per expert,
T5's tied aliases written once. Each checkpoint is a real FSDP2 run (core/sample_models.py),
compared bit for bit with ``save_pretrained`` of the same model."""

from __future__ import annotations

import pytest
import torch

from shardscope.core import MergeOptions, detect, plan_merge, run_merge
from shardscope.core.errors import BadCheckpointError
from shardscope.core.sample_models import FAMILIES
from test_merge_exact import assert_bit_equal, load


def _merge(src, out, **kw):
    layout = detect(str(src))
    assert not layout.errors, layout.errors
    plan = plan_merge(layout, MergeOptions(output=str(out), workers=2, **kw))
    run_merge(plan)
    return layout, plan


@pytest.mark.parametrize("family", list(FAMILIES))
def test_merge_equals_save_pretrained(models_root, tmp_path, family):
    src = models_root / family
    layout, plan = _merge(src, tmp_path / "out")
    world = FAMILIES[family][0]
    assert layout.world_size == world
    merged, ref = load(tmp_path / "out"), load(models_root / f"{family}.reference")
    assert_bit_equal(merged, ref)
    # the checkpoint really holds the in-memory form (else this test proves nothing)
    assert set(layout.tensors) != set(ref)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_merged_folder_loads_without_missing_keys(models_root, tmp_path, family):
    import transformers

    _merge(models_root / family, tmp_path / "out")
    cfg = transformers.AutoConfig.from_pretrained(tmp_path / "out")
    cls = getattr(transformers, cfg.architectures[0])
    model, info = cls.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert not info.get("mismatched_keys"), info
    ref = cls.from_pretrained(models_root / f"{family}.reference")
    a, b = model.state_dict(), ref.state_dict()
    assert set(a) == set(b)
    for k in b:
        assert torch.equal(a[k], b[k]), k


def test_processor_files_are_copied(models_root, tmp_path):
    _merge(models_root / "qwen2_5_vl", tmp_path / "out")
    for name in ("preprocessor_config.json", "chat_template.jinja", "tokenizer.json"):
        assert (tmp_path / "out" / name).read_bytes() == \
            (models_root / "qwen2_5_vl" / "huggingface" / name).read_bytes()
    from transformers import AutoTokenizer, Qwen2VLImageProcessor

    assert Qwen2VLImageProcessor.from_pretrained(tmp_path / "out").merge_size == 2
    assert AutoTokenizer.from_pretrained(tmp_path / "out").vocab_size > 256


def test_fused_experts_become_pieces_of_the_stored_slices(models_root, tmp_path):
    """Each per-expert tensor of Qwen3-MoE (5 experts over 3 ranks: experts split unevenly)
    is planned as pieces pointing into the rank files, no tensor read at planning time."""
    layout = detect(str(models_root / "qwen3_moe"))
    plan = plan_merge(layout, MergeOptions(output=str(tmp_path / "out")))
    out = {t.name: t for f in plan.files for t in f.tensors}
    fused = layout.tensors["model.layers.1.mlp.experts.gate_up_proj"]
    E, two_f, h = fused.shape
    for e in range(E):
        for proj, row0 in (("gate_proj", 0), ("up_proj", two_f // 2)):
            t = out[f"model.layers.1.mlp.experts.{e}.{proj}.weight"]
            assert t.shape == (two_f // 2, h)
            assert "cut from model.layers.1.mlp.experts.gate_up_proj" in t.source.placement
            assert all(p.file.endswith(".pt") for p in t.pieces)
            assert sum(p.numel for p in t.pieces) == t.source.numel
            assert {p.file for p in t.pieces} <= {p.file for p in fused.pieces}
    assert "model.layers.1.mlp.experts.gate_up_proj" not in out


def test_tied_t5_aliases_written_once(models_root, tmp_path):
    layout, plan = _merge(models_root / "t5", tmp_path / "out")
    aliases = {"shared.weight", "encoder.embed_tokens.weight", "decoder.embed_tokens.weight",
               "lm_head.weight"}
    assert aliases <= set(layout.tensors)
    assert set(load(tmp_path / "out")) & aliases == {"shared.weight"}


def test_transposed_box_is_a_strided_piece(models_root, tmp_path):
    """The piece model carries a transpose as permuted strides: a box of the fused experts
    with its dims swapped reads back as the reference expert transposed."""
    from shardscope.core.execute import _Sources, assemble
    from shardscope.core.hf_names import Box, cut

    layout = detect(str(models_root / "qwen3_moe"))
    fused = layout.tensors["model.layers.0.mlp.experts.down_proj"]  # [E, H, F]
    ref = load(models_root / "qwen3_moe.reference")
    E, H, F = fused.shape
    src = _Sources()
    try:
        for e in range(E):
            box = Box((0, 0), (F, H), fused.name, (e, 0, 0), (2, 1))
            x = assemble(cut(box, fused), (F, H), fused.dtype, src)
            assert torch.equal(x, ref[f"model.layers.0.mlp.experts.{e}.down_proj.weight"].T)
    finally:
        src.close()


def test_conversion_that_mixes_dims_is_refused():
    """A conversion whose result is no box of its source (a reshape that mixes dims, as
    transformers' Interleave does) raises, naming the op, instead of writing a wrong
    tensor."""
    from shardscope.core.hf_names import Box, UnsupportedOp, _tracker

    tracker = _tracker()
    x = torch.empty(4, 6, device="meta")
    tracker.track(x, [Box((0, 0), (4, 6), "w", (0, 0), (0, 1))])
    with pytest.raises(UnsupportedOp, match="view"):
        with tracker:
            x.reshape(4, 3, 2).transpose(1, 2).reshape(4, 6).contiguous()


def test_cut_of_a_flat_partition(models_root):
    """A fused tensor held as flat ranges (DeepSpeed ZeRO partitions, here the Mixtral shards
    viewed flat) is cut when the block is one run of consecutive elements (an expert, the
    gate half of one); a transposed block is refused naming the tensor."""
    import dataclasses

    from shardscope.core.execute import _Sources, assemble
    from shardscope.core.hf_names import Box, cut
    from shardscope.core.layout import coverage_problems

    layout = detect(str(models_root / "mixtral"))
    fused = layout.tensors["model.layers.0.mlp.experts.gate_up_proj"]  # [E, 2F, H]
    E, F2, H = fused.shape
    pieces = [dataclasses.replace(p, shape=(p.numel,), stride=(1,),
                                  global_offsets=(p.global_offsets[0] * F2 * H,))
              for p in fused.pieces]  # FSDP2 Shard(0) slices are C-contiguous runs
    flat = dataclasses.replace(fused, flat=True, pieces=pieces)
    ref = load(models_root / "mixtral.reference")
    src = _Sources()
    try:
        for e in range(E):
            box = Box((0, 0), (F2 // 2, H), fused.name, (e, 0, 0), (1, 2))
            got = cut(box, flat)
            t = dataclasses.replace(flat, shape=(F2 // 2, H), pieces=got)
            assert not coverage_problems(t)
            x = assemble(got, (F2 // 2, H), fused.dtype, src, flat=True)
            assert torch.equal(x, ref[f"model.layers.0.block_sparse_moe.experts.{e}.w1.weight"])
    finally:
        src.close()
    with pytest.raises(BadCheckpointError, match="experts.gate_up_proj.*flat"):
        cut(Box((0, 0), (H, F2 // 2), fused.name, (1, 0, 0), (2, 1)), flat)


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_5_vl"])
def test_dcp_checkpoint_merges_to_save_pretrained(models_root, tmp_path, family):
    """The same shards saved with torch.distributed.checkpoint: deferred chunks are located,
    then cut, with the config passed as --hf-config."""
    _merge(models_root / f"{family}.dcp", tmp_path / "out",
           hf_config=str(models_root / family / "huggingface"))
    assert_bit_equal(load(tmp_path / "out"), load(models_root / f"{family}.reference"))


def test_deepspeed_zero_fused_experts_merge_to_save_pretrained(models_root, tmp_path):
    """DeepSpeed ZeRO-2 of a transformers-5 Qwen3-MoE: the fused experts are ranges of the
    flat fp32 partitions; each expert's gate/up/down is cut from them as ranges."""
    layout, _ = _merge(models_root / "qwen3_moe.ds-z2", tmp_path / "out")
    assert layout.format == "deepspeed"
    assert any(t.flat for t in layout.tensors.values())
    assert_bit_equal(load(tmp_path / "out"), load(models_root / "qwen3_moe.ds-z2.reference"))


def test_saved_name_colliding_with_a_stored_name_is_refused(models_root, tmp_path):
    """A checkpoint holding a tensor under the in-memory name and another under the name
    save_pretrained would write for it is refused, naming both, never one silently lost."""
    import dataclasses

    layout = detect(str(models_root / "qwen2_5_vl"))
    src = layout.tensors["model.language_model.norm.weight"]
    layout.tensors["model.norm.weight"] = dataclasses.replace(src, name="model.norm.weight")
    with pytest.raises(BadCheckpointError, match="model.norm.weight from "
                       "model.language_model.norm.weight") as e:
        plan_merge(layout, MergeOptions(output=str(tmp_path / "out")))
    assert e.value.path == layout.path
