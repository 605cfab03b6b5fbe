"""Framework-native names (torchtitan, torchtune) -> Hugging Face Llama, bit-exact.

The checkpoints in tests/data/native/ were written by torchtitan 0.3.0 and torchtune 0.6.1
themselves (FSDP2, gloo, 2 and 3 ranks; tests/data/native/make_native.py, run once in a side
venv); each ``reference/`` is the framework's own exporter (torchtitan's
``Llama3StateDictAdapter.to_hf``, torchtune's ``convert_weights.tune_to_hf``) saved with
``save_pretrained``.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import ROOT, run_cli
from shardscope.core import MergeOptions, detect, plan_merge, run_merge
from shardscope.core.layout import Piece, TensorInfo
from shardscope.core.native_names import permute_rows, recognise
from test_merge_exact import assert_bit_equal, load

DATA = Path(ROOT) / "tests" / "data" / "native"
CASES = {  # fixture -> (checkpoint folder, framework named in messages)
    "titan_w2_fp32": ("checkpoint/step-10", "torchtitan"),
    "titan_w3_bf16_tied": ("checkpoint/step-10", "torchtitan"),
    "tune_w2_fp32": ("checkpoint/dist_epoch_0", "torchtune"),
    "meta_w3_bf16": ("checkpoint/step-10", "Meta Llama"),
    "titan_qwen3_w2_fp32": ("checkpoint/step-10", "torchtitan"),
}


def cli(*args: str) -> subprocess.CompletedProcess:
    return run_cli(*args, cwd=ROOT)  # in this process (conftest.run_cli)


@pytest.mark.parametrize("name", sorted(CASES))
def test_native_checkpoint_merges_bit_exact(tmp_path, name):
    ckpt, framework = CASES[name]
    src, cfg = DATA / name / ckpt, DATA / name / "hf_config"
    out = tmp_path / "out"
    r = cli("merge", str(src), "--hf-config", str(cfg), "-o", str(out), "-q")
    assert r.returncode == 0, r.stderr
    assert_bit_equal(load(out), load(DATA / name / "reference"))
    assert json.loads((out / "config.json").read_text()) == json.loads(
        (cfg / "config.json").read_text())


@pytest.mark.parametrize("name", sorted(CASES))
def test_without_hf_config_refused_naming_framework(tmp_path, name):
    ckpt, framework = CASES[name]
    r = cli("merge", str(DATA / name / ckpt), "-o", str(tmp_path / "out"))
    assert r.returncode == 3
    assert framework in r.stderr and "--hf-config" in r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "out").exists()
    d = json.loads(cli("inspect", str(DATA / name / ckpt), "--json").stdout)
    assert [p["code"] for p in d["problems"]] == ["native-names-no-config"]


def test_inspect_shows_native_names_as_sources():
    src = DATA / "titan_w2_fp32" / "checkpoint/step-10"
    r = cli("inspect", str(src), "--hf-config", str(DATA / "titan_w2_fp32" / "hf_config"),
            "--json", "--params")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["problems"] == []
    src_of = {p["name"]: p.get("source") for p in d["params"]}
    assert src_of["model.embed_tokens.weight"] == "tok_embeddings.weight"
    assert src_of["model.layers.2.self_attn.q_proj.weight"] == \
        "layers.2.attention.qkv_linear.wq.weight"
    assert src_of["model.layers.0.mlp.up_proj.weight"] == "layers.0.feed_forward.w3.weight"
    assert "framework names" in d["details"] and "torchtitan" in d["details"]["framework names"]


def test_merged_torchtune_model_gives_torchtunes_logits(tmp_path):
    """The merged folder, loaded by transformers, computes what torchtune's own model computed
    before saving (logits.pt): the q/k permutation matches transformers' rotary layout."""
    from transformers import AutoModelForCausalLM

    name = "tune_w2_fp32"
    layout = detect(DATA / name / CASES[name][0])  # no config yet: plan_merge reads again
    assert [p.code for p in layout.errors] == ["native-names-no-config"]
    run_merge(plan_merge(layout, MergeOptions(output=str(tmp_path / "out"),
                                              hf_config=str(DATA / name / "hf_config"))))
    golden = torch.load(DATA / name / "logits.pt", weights_only=True)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    ref = AutoModelForCausalLM.from_pretrained(DATA / name / "reference").eval()
    with torch.no_grad():
        got = model(golden["tokens"]).logits
        assert torch.equal(got, ref(golden["tokens"]).logits)
    assert torch.allclose(got, golden["logits"], atol=1e-4, rtol=1e-4)


def test_config_of_another_family_refused(tmp_path):
    name = "titan_w2_fp32"
    cfg = tmp_path / "cfg"
    shutil.copytree(DATA / name / "hf_config", cfg)
    c = json.loads((cfg / "config.json").read_text())
    c["model_type"], c["architectures"] = "qwen2", ["Qwen2ForCausalLM"]
    (cfg / "config.json").write_text(json.dumps(c))
    r = cli("merge", str(DATA / name / CASES[name][0]), "--hf-config", str(cfg), "-o",
            str(tmp_path / "out"))
    assert r.returncode == 3 and "torchtitan" in r.stderr and "qwen2" in r.stderr


def _config(tmp_path, name, **changes) -> str:
    cfg = tmp_path / "cfg"
    shutil.copytree(DATA / name / "hf_config", cfg)
    c = json.loads((cfg / "config.json").read_text())
    c.update(changes)
    (cfg / "config.json").write_text(json.dumps(c))
    return str(cfg)


def test_llama_weights_under_a_qwen3_config_refused(tmp_path):
    cfg = _config(tmp_path, "titan_w2_fp32", model_type="qwen3")
    layout = detect(DATA / "titan_w2_fp32" / CASES["titan_w2_fp32"][0], hf_config=cfg)
    assert [p.code for p in layout.errors] == ["config-mismatch"]
    assert "q_norm" in layout.errors[0].message


def test_qwen3_weights_under_a_llama_config_refused(tmp_path):
    name = "titan_qwen3_w2_fp32"
    cfg = _config(tmp_path, name, model_type="llama", architectures=["LlamaForCausalLM"])
    layout = detect(DATA / name / CASES[name][0], hf_config=cfg)
    codes = {p.code for p in layout.errors}
    assert "unmapped-tensor" in codes
    assert any("q_norm" in p.message and "torchtitan" in p.message for p in layout.errors)


def test_heads_that_do_not_fit_the_weights_refused(tmp_path):
    name = "titan_w2_fp32"
    cfg = tmp_path / "cfg"
    shutil.copytree(DATA / name / "hf_config", cfg)
    c = json.loads((cfg / "config.json").read_text())
    c["num_key_value_heads"] = 4  # the weights have 2 key/value heads
    (cfg / "config.json").write_text(json.dumps(c))
    layout = detect(DATA / name / CASES[name][0], hf_config=str(cfg))
    assert any(p.code == "shape-mismatch" and "wk" in p.message for p in layout.errors)


def test_plain_hugging_face_names_are_not_recognised():
    assert recognise(["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
                      "lm_head.weight"]) is None


@pytest.mark.parametrize("cuts,cols", [([0, 32], [0, 6]), ([0, 5, 13, 32], [0, 6]),
                                       ([0, 1, 2, 31, 32], [0, 6]), ([0, 16, 32], [0, 6]),
                                       ([0, 13, 32], [0, 3, 6])])
def test_permuted_pieces_equal_the_exporters_permutation(tmp_path, cuts, cols):
    """Pieces cut anywhere (rows also inside a head; columns too, as a TP Shard(1) box) give
    the rows torchtune's ``tune_to_hf`` permutation gives:
    ``w.view(h, hd // 2, 2, dim).transpose(1, 2).reshape(h * hd, dim)``."""
    from shardscope.core.execute import _Sources, assemble_bytes

    heads, hd, dim = 4, 8, 6
    w = np.arange(heads * hd * dim, dtype=np.float32).reshape(heads * hd, dim)
    f = tmp_path / "w.bin"
    f.write_bytes(w.tobytes())
    t = TensorInfo("w", w.shape, "F32", "test")
    for a, b in zip(cuts, cuts[1:]):
        for c, d in zip(cols, cols[1:]):
            t.pieces.append(Piece(str(f), (a * dim + c) * 4, "F32", (b - a, d - c), (dim, 1),
                                  (a, c)))
    got = assemble_bytes(permute_rows(t, heads, hd, "q").pieces, w.shape, "F32", _Sources())
    want = (torch.from_numpy(w).view(heads, hd // 2, 2, dim).transpose(1, 2)
            .reshape(heads * hd, dim))
    assert np.array_equal(got.view(np.float32), want.numpy())
