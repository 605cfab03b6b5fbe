"""Every layout merges bit-exactly into the unsharded reference written by the same run."""

from __future__ import annotations

import filecmp
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from conftest import ALL, BY_NAME
from shardscope.core import BadCheckpointError, MergeOptions, detect, plan_merge, run_merge


def load(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    files = sorted(folder.glob("*.safetensors"))
    for f in files:
        with safe_open(str(f), "pt") as s:
            for k in s.keys():
                assert k not in out, f"{k} duplicated"
                out[k] = s.get_tensor(k)
    return out


def assert_bit_equal(merged: dict, ref: dict) -> None:
    assert set(merged) == set(ref)
    for k in ref:
        a, b = merged[k], ref[k]
        assert a.dtype == b.dtype, k
        assert a.shape == b.shape, k
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), k


def merge(src: Path, out: Path, **kw):
    layout = detect(src)
    assert not layout.errors, layout.errors
    plan = plan_merge(layout, MergeOptions(output=str(out), workers=2, **kw))
    return layout, plan, run_merge(plan)


@pytest.mark.parametrize("name", [v.name for v in ALL])
def test_merge_is_bit_exact(fixtures_root, tmp_path, name):
    src = fixtures_root / name
    ref = fixtures_root / f"{name}.reference"
    hf_config = None if (src / "huggingface").is_dir() else str(ref)
    # persistent buffers Qwen2ForCausalLM does not define: the judge refuses them as extra
    # tensors unless the merge is not strict
    strict = not BY_NAME[name].buffers
    if not strict:
        with pytest.raises(BadCheckpointError, match=r"3 extra \(model.loss_scale, "
                           r"model.no_elements, model.step_count\).*--no-strict"):
            merge(src, tmp_path / "out", hf_config=hf_config)
    layout, plan, result = merge(src, tmp_path / "out", hf_config=hf_config, strict=strict)
    out = tmp_path / "out"
    assert_bit_equal(load(out), load(ref))
    # config and tokenizer copied byte for byte, weights of the config folder never
    cfg_dir = src / "huggingface" if hf_config is None else ref
    for f in cfg_dir.iterdir():
        if f.suffix != ".safetensors":
            assert filecmp.cmp(f, out / f.name, shallow=False), f.name
    assert not list(tmp_path.glob(".out.shardscope-tmp-*"))
    assert result.tensors == len(load(ref))


@pytest.mark.parametrize("name", ["w2-qwen2-bf16-tied", "w3-llama-f32", "w4-hsdp-other-names",
                                  "w3-unnamed-bf16-tied"])
def test_merged_model_gives_reference_logits(fixtures_root, tmp_path, name):
    from transformers import AutoModelForCausalLM

    merge(fixtures_root / name, tmp_path / "out")
    ids = torch.tensor([[1, 5, 9, 42, 7, 300 % BY_NAME[name].vocab, 2]])
    got = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    want = AutoModelForCausalLM.from_pretrained(fixtures_root / f"{name}.reference").eval()
    with torch.no_grad():
        assert torch.equal(got(ids).logits, want(ids).logits)


def test_tied_output_layer_is_dropped_and_untied_kept(fixtures_root, tmp_path):
    tied = detect(fixtures_root / "w2-qwen2-bf16-tied")
    assert "lm_head.weight" in tied.tensors  # FSDP keeps the tied copy...
    merge(fixtures_root / "w2-qwen2-bf16-tied", tmp_path / "a")
    assert "lm_head.weight" not in load(tmp_path / "a")  # ...the HF folder must not
    merge(fixtures_root / "w2-qwen2-f32", tmp_path / "b")
    assert "lm_head.weight" in load(tmp_path / "b")


def test_dtype_cast_touches_floats_only(fixtures_root, tmp_path):
    merge(fixtures_root / "w3-llama-f32", tmp_path / "out", dtype="bf16")
    ref = load(fixtures_root / "w3-llama-f32.reference")
    got = load(tmp_path / "out")
    for k, v in ref.items():
        assert got[k].dtype == torch.bfloat16
        assert torch.equal(got[k], v.to(torch.bfloat16)), k


def test_sharded_output_has_index_and_loads(fixtures_root, tmp_path):
    from transformers import AutoModelForCausalLM

    _, plan, result = merge(fixtures_root / "w4-fsdp2", tmp_path / "out", max_shard_size="150KB")
    out = tmp_path / "out"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(files) > 1 and files == sorted(set(index["weight_map"].values()))
    assert index["metadata"]["total_size"] == plan.total_bytes
    assert_bit_equal(load(out), load(fixtures_root / "w4-fsdp2.reference"))
    AutoModelForCausalLM.from_pretrained(out)


def test_uneven_split_layout(fixtures_root):
    layout = detect(fixtures_root / "w3-llama-f32")
    emb = layout.tensors["model.embed_tokens.weight"]
    assert emb.shape == (331, 64)
    assert [p.shape[0] for p in sorted(emb.pieces, key=lambda p: p.global_offsets)] == \
        [111, 111, 109]


def test_replicated_buffers_are_taken_once(fixtures_root, tmp_path):
    layout = detect(fixtures_root / "w3-buffers")
    for name in ("model.step_count", "model.loss_scale"):
        t = layout.tensors[name]
        assert t.placement == "plain" and len(t.pieces) == 1
    merge(fixtures_root / "w3-buffers", tmp_path / "out", strict=False)  # not Qwen2's buffers
    got = load(tmp_path / "out")
    assert got["model.step_count"].dtype == torch.int64
    assert got["model.step_count"].tolist() == [0, 7, 14, 21, 28]
    assert got["model.loss_scale"].shape == () and got["model.loss_scale"].item() == 0.375


def test_inspect_a_hugging_face_folder(fixtures_root):
    layout = detect(fixtures_root / "w2-qwen2-f32.reference")
    assert layout.format == "hf" and not layout.problems
    assert layout.config_dir is not None
