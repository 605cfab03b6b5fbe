"""LoRA in sharded checkpoints of real peft models (FSDP2, gloo): every mode against peft on
the unsharded model."""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch
from safetensors.torch import load_file

from conftest import ROOT, copy_checkpoint, run_cli
from shardscope.core import MergeOptions, UsageError, detect, plan_merge, run_merge


def merge(src, out, **kw):
    return run_merge(plan_merge(detect(src), MergeOptions(output=str(out), **kw)))


def exact(a: dict, b: dict) -> None:
    assert set(a) == set(b)
    for k in b:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("name,r,alpha,rs,targets", [
    ("w2-lora-qv", 8, 16, False, ["q_proj", "v_proj"]),
    ("w3-lora-rslora-bf16", 4, 8, True, ["gate_proj", "k_proj", "o_proj"]),
])
def test_detect(fixtures_root, name, r, alpha, rs, targets):
    lora = detect(fixtures_root / name).lora
    a = lora.adapters["default"]
    assert (a.r, a.lora_alpha, a.use_rslora, a.target_modules) == (r, alpha, rs, targets)
    assert a.alpha_source == "lora_train_meta.json"
    assert len(a.modules) == 2 * len(targets)


@pytest.mark.parametrize("name", ["w2-lora-qv", "w3-lora-rslora-bf16", "w2-lora-multi"])
def test_fold_matches_peft_merge_and_unload(fixtures_root, tmp_path, name):
    merge(fixtures_root / name, tmp_path / "o", lora="fold", lora_adapter="default")
    exact(load_file(tmp_path / "o" / "model.safetensors"),
          load_file(fixtures_root / f"{name}.fold" / "model.safetensors"))


@pytest.mark.parametrize("name", ["w2-lora-qv", "w3-lora-rslora-bf16", "w2-lora-multi",
                                  "w2-lora-dora"])
def test_base_drops_the_adapter(fixtures_root, tmp_path, name):
    """The base alone: the model as it was before peft wrapped it (modules_to_save come from
    their original_module copy; peft's unload() would keep the trained copy instead)."""
    merge(fixtures_root / name, tmp_path / "o", lora="base", lora_adapter="default")
    exact(load_file(tmp_path / "o" / "model.safetensors"),
          load_file(fixtures_root / f"{name}.reference" / "model.safetensors"))


@pytest.mark.parametrize("name", ["w2-lora-qv", "w3-lora-rslora-bf16", "w2-lora-multi"])
def test_adapter_loads_in_peft_and_gives_the_trained_outputs(fixtures_root, tmp_path, name):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out = tmp_path / "o"
    merge(fixtures_root / name, out, lora="adapter", lora_adapter="default")
    ref = fixtures_root / f"{name}.adapter"
    exact(load_file(out / "lora_adapter" / "adapter_model.safetensors"),
          load_file(ref / "adapter_model.safetensors"))
    exact(load_file(out / "model.safetensors"),
          load_file(fixtures_root / f"{name}.reference" / "model.safetensors"))
    got_cfg = json.loads((out / "lora_adapter" / "adapter_config.json").read_text())
    want_cfg = json.loads((ref / "adapter_config.json").read_text())
    for k in ("r", "lora_alpha", "use_rslora", "task_type", "peft_type", "modules_to_save"):
        assert got_cfg[k] == want_cfg[k], k
    assert sorted(got_cfg["target_modules"]) == sorted(want_cfg["target_modules"])
    ids = torch.tensor([[1, 5, 9, 42, 7, 3]])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(out),
                                        out / "lora_adapter").eval()
    assert not [w for w in caught if "missing" in str(w.message).lower()
                or "unexpected" in str(w.message).lower()]
    want = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(fixtures_root / f"{name}.reference"), ref).eval()
    with torch.no_grad():
        assert torch.equal(got(ids).logits, want(ids).logits)


def test_both_writes_the_folded_model_and_the_adapter(fixtures_root, tmp_path):
    out = tmp_path / "o"
    merge(fixtures_root / "w2-lora-qv", out, lora="both")
    exact(load_file(out / "model.safetensors"),
          load_file(fixtures_root / "w2-lora-qv.fold" / "model.safetensors"))
    exact(load_file(out / "lora_adapter" / "adapter_model.safetensors"),
          load_file(fixtures_root / "w2-lora-qv.adapter" / "adapter_model.safetensors"))
    index = out / "model.safetensors.index.json"
    assert not index.exists()  # the adapter file is not a model shard


def cli(*args):
    return run_cli(*args, cwd=ROOT)  # in this process (conftest.run_cli)


def test_choice_is_required_and_alpha_never_invented(fixtures_root, tmp_path):
    r = cli("merge", str(fixtures_root / "w2-lora-qv"), "-o", str(tmp_path / "a"))
    assert r.returncode == 2 and "choose --lora fold" in r.stderr and "r=8" in r.stderr
    ck = copy_checkpoint(fixtures_root / "w2-lora-qv", tmp_path / "ck")
    os.remove(ck / "lora_train_meta.json")
    assert detect(ck).lora.adapters["default"].lora_alpha is None
    r = cli("merge", str(ck), "-o", str(tmp_path / "b"), "--lora", "adapter")
    assert r.returncode == 2 and "--lora-alpha" in r.stderr
    assert not (tmp_path / "b").exists()
    r = cli("merge", str(ck), "-o", str(tmp_path / "c"), "--lora", "fold", "--lora-alpha", "16")
    assert r.returncode == 0, r.stderr
    exact(load_file(tmp_path / "c" / "model.safetensors"),
          load_file(fixtures_root / "w2-lora-qv.fold" / "model.safetensors"))
    assert "overrides" not in r.stderr  # nothing recorded: nothing overridden
    r = cli("merge", str(ck), "-o", str(tmp_path / "d"), "--lora", "base")
    assert r.returncode == 0, r.stderr
    # a recorded alpha replaced by --lora-alpha is said, never silent
    r = cli("merge", str(fixtures_root / "w2-lora-qv"), "-o", str(tmp_path / "e"), "--lora",
            "fold", "--lora-alpha", "32")
    assert r.returncode == 0 and "--lora-alpha 32 overrides the lora_alpha 16" in r.stderr


def test_dora_folds_like_peft(fixtures_root, tmp_path):
    """DoRA (lora_magnitude_vector) folds as peft's merge_and_unload: bit for bit."""
    lora = detect(fixtures_root / "w2-lora-dora").lora
    assert lora.unsupported == [] and lora.adapters["default"].dora == [
        "model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.q_proj"]
    merge(fixtures_root / "w2-lora-dora", tmp_path / "o", lora="fold")
    exact(load_file(tmp_path / "o" / "model.safetensors"),
          load_file(fixtures_root / "w2-lora-dora.fold" / "model.safetensors"))


def test_several_adapters_and_modules_to_save(fixtures_root, tmp_path):
    layout = detect(fixtures_root / "w2-lora-multi")
    assert sorted(layout.lora.adapters) == ["default", "second"]
    assert layout.lora.adapters["default"].modules_to_save == ["lm_head"]
    assert layout.lora.adapters["second"].lora_alpha is None  # the run's meta is default's
    with pytest.raises(UsageError, match="several adapters"):
        plan_merge(layout, MergeOptions(str(tmp_path / "o"), lora="fold"))
    with pytest.raises(UsageError, match="lora_alpha is not recorded"):
        plan_merge(layout, MergeOptions(str(tmp_path / "o"), lora="fold",
                                        lora_adapter="second"))
