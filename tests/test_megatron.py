"""Megatron-LM checkpoints written by real megatron-core on gloo (torch_dist and legacy), for
TP, PP, TP x PP, VPP, uneven stages and EP: every merge is bit-identical with the Hugging Face
reference, and the merged model computes Megatron's own logits. Damaged sets are reported."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import ROOT, copy_checkpoint, run_cli
from shardscope.core import MergeOptions, detect, plan_merge, run_merge
from shardscope.core.sample_megatron import LAYOUTS, PROBE, layout_name
from test_merge_exact import assert_bit_equal, load

pytest.importorskip("megatron.core")

CASES = [(fam, layout_name(*lay), kind) for fam, lays in LAYOUTS.items() for lay in lays
         for kind in ("torch_dist", "legacy")]


def codes(layout):
    return {(p.code, Path(p.path).name if p.path else None) for p in layout.problems}


def merge(src: Path, out: Path, **kw):
    plan = plan_merge(detect(src), MergeOptions(output=str(out), workers=2, **kw))
    run_merge(plan)
    return plan


@pytest.mark.parametrize("family,layout,kind", CASES, ids=["/".join(c) for c in CASES])
def test_merge_is_bit_exact(megatron_root, tmp_path, family, layout, kind):
    src = megatron_root / family / layout / kind
    ref = megatron_root / family / "reference"
    # torch_dist carries huggingface/ (verl's way); the legacy set is merged with --hf-config
    kw = {} if kind == "torch_dist" else {"hf_config": str(ref)}
    merge(src, tmp_path / "out", **kw)
    assert_bit_equal(load(tmp_path / "out"), load(ref))
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg == json.loads((ref / "config.json").read_text())


def logits(folder: Path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    with torch.no_grad():
        return model(torch.tensor(PROBE)).logits


@pytest.mark.parametrize("family,layout", [("llama", "tp2_pp2"), ("qwen2", "tp2_pp2"),
                                           ("qwen3", "tp2_pp2"), ("mixtral", "tp2_pp1_ep2")])
def test_merged_model_computes_megatrons_logits(megatron_root, tmp_path, family, layout):
    merge(megatron_root / family / layout / "legacy", tmp_path / "out",
          hf_config=str(megatron_root / family / "reference"))
    want = torch.load(megatron_root / family / "reference" / "megatron_logits.pt")
    got = logits(tmp_path / "out")
    assert got.shape[-1] == want.shape[-1] == 300
    torch.testing.assert_close(got, want.reshape(got.shape), atol=2e-5, rtol=1e-5)


def test_no_config_derives_one_from_args(megatron_root, tmp_path):
    """Legacy files hold no Hugging Face config: the merge writes one from ``args``, warns
    about each guessed field, and the model loads and computes Megatron's logits."""
    src = megatron_root / "llama" / "tp2_pp2" / "legacy"
    layout = detect(src)
    guessed = [p.message for p in layout.problems if p.code == "config-guessed"]
    assert any("vocab_size=384" in m for m in guessed), guessed
    plan = merge(src, tmp_path / "out")
    assert any("derived from the checkpoint's args" in w for w in plan.warnings)
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["num_key_value_heads"] == 2
    assert cfg["vocab_size"] == 384 and cfg["tie_word_embeddings"] is False
    want = torch.load(megatron_root / "llama" / "reference" / "megatron_logits.pt")
    got = logits(tmp_path / "out")[..., :300]
    torch.testing.assert_close(got, want.reshape(got.shape), atol=2e-5, rtol=1e-5)
    # the padded rows are kept (no true vocabulary known), the first 300 are the reference's
    ref = load(megatron_root / "llama" / "reference")
    out = load(tmp_path / "out")
    assert torch.equal(out["model.embed_tokens.weight"][:300], ref["model.embed_tokens.weight"])


@pytest.mark.parametrize("kind", ["legacy", "torch_dist"])
def test_inspect_shows_the_parallel_layout(megatron_root, kind):
    cfg = str(megatron_root / "llama" / "reference")
    vpp = detect(megatron_root / "llama" / "tp1_pp2_vpp2" / kind, hf_config=cfg)
    assert vpp.parallel == {"pp": 2, "vpp": 2}
    assert vpp.details["layers"] == "4; stage 0: layers 0, 2; stage 1: layers 1, 3"
    assert vpp.details["vocabulary"] == "300 (padded to 384 rows in the checkpoint)"
    assert vpp.details["attention"] == "4 heads, 2 query groups (GQA), head dim 16"
    uneven = detect(megatron_root / "llama" / "tp1_pp2_uneven" / kind, hf_config=cfg)
    assert uneven.details["layers"] == "4; stage 0: layers 0; stage 1: layers 1-3"
    tp = detect(megatron_root / "llama" / "tp2_pp2" / kind)
    assert tp.parallel == {"tp": 2, "pp": 2}
    assert tp.details["TP/PP/VPP/EP"] == "2 / 2 / - / 1"
    q = tp.tensors["model.layers.3.self_attn.q_proj.weight"]
    assert q.source == "decoder.layers.3.self_attention.linear_qkv.weight"
    assert q.shape == (64, 64)
    moe = detect(megatron_root / "mixtral" / "tp1_pp1_ep2" / kind)
    assert moe.parallel == {"dp": 2, "ep": 2}  # args: world_size 2, TP 1, PP 1
    assert "4 experts, top-2, 2 per EP rank" in moe.details["MLP"]
    if kind == "legacy":
        assert tp.details["embeddings"] == "embedding on stage 0; output layer on stage 1"
        assert tp.mesh_text == "pp=2 x tp=2"


def test_inspect_cli_json(megatron_root):
    r = run_cli("inspect", "--json", "--params",
                str(megatron_root / "qwen2" / "tp2_pp2" / "legacy"), cwd=ROOT)
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["format"] == "megatron-legacy"
    assert d["parallel"]["tp"] == 2 and d["parallel"]["pp"] == 2
    assert d["details"]["tied embeddings"] == "yes"
    names = {p["name"]: p for p in d["params"]}
    assert names["model.layers.0.self_attn.k_proj.bias"]["source"] == \
        "decoder.layers.0.self_attention.linear_qkv.bias"


def test_verl_layout(megatron_root, tmp_path):
    """verl keeps the torch_dist folder as ``actor/dist_ckpt`` beside ``actor/huggingface``."""
    src = megatron_root / "qwen2" / "tp2_pp2" / "torch_dist"
    actor = tmp_path / "global_step_10" / "actor"
    shutil.copytree(src / "iter_0000010", actor / "dist_ckpt")
    shutil.copytree(src / "huggingface", actor / "huggingface")
    layout = detect(actor)
    assert layout.format == "megatron-dist" and not layout.errors
    merge(actor, tmp_path / "out")
    assert_bit_equal(load(tmp_path / "out"), load(megatron_root / "qwen2" / "reference"))


def test_merge_never_imports_megatron(megatron_root, tmp_path):
    code = ("import sys; from shardscope.core import detect, plan_merge, run_merge, MergeOptions\n"
            "for src, out in ((sys.argv[1], sys.argv[3]), (sys.argv[2], sys.argv[4])):\n"
            "    run_merge(plan_merge(detect(src), MergeOptions(output=out)))\n"
            "print([m for m in sys.modules if m.startswith('megatron')])")
    base = megatron_root / "llama" / "tp2_pp2"
    r = subprocess.run([sys.executable, "-c", code, str(base / "torch_dist"),
                        str(base / "legacy"), str(tmp_path / "a"), str(tmp_path / "b")],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


# --- damaged sets ---------------------------------------------------------------------------

def merge_cli(src, out, *extra):
    return run_cli("merge", src, "-o", out, *extra, cwd=ROOT)  # in this process


def test_missing_rank_folder(megatron_root, tmp_path):
    ck = copy_checkpoint(megatron_root / "llama" / "tp2_pp2" / "legacy", tmp_path / "ck")
    shutil.rmtree(ck / "iter_0000010" / "mp_rank_01_001")
    assert ("missing-rank", "mp_rank_01_001") in codes(detect(ck))
    r = merge_cli(ck, tmp_path / "out")
    assert r.returncode == 3, r.stderr
    assert "mp_rank_01_001" in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_missing_last_expert_rank(megatron_root, tmp_path):
    ck = copy_checkpoint(megatron_root / "mixtral" / "tp1_pp1_ep2" / "legacy", tmp_path / "ck")
    shutil.rmtree(ck / "iter_0000010" / "mp_rank_00_001")
    assert ("missing-rank", "mp_rank_00_001") in codes(detect(ck))


def test_truncated_legacy_file(megatron_root, tmp_path):
    ck = copy_checkpoint(megatron_root / "llama" / "tp2_pp1" / "legacy", tmp_path / "ck")
    f = ck / "iter_0000010" / "mp_rank_01" / "model_optim_rng.pt"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    layout = detect(ck)
    assert any(p.path == str(f) and p.severity == "error" for p in layout.problems), \
        layout.problems
    r = merge_cli(ck, tmp_path / "out", "--hf-config", str(megatron_root / "llama" /
                                                          "reference"))
    assert r.returncode == 3 and "model_optim_rng.pt" in r.stderr
    assert "Traceback" not in r.stderr


def test_truncated_distcp(megatron_root, tmp_path):
    ck = copy_checkpoint(megatron_root / "llama" / "tp2_pp2" / "torch_dist", tmp_path / "ck")
    f = ck / "iter_0000010" / "__1_0.distcp"
    f.write_bytes(f.read_bytes()[:100])
    assert ("truncated-file", "__1_0.distcp") in codes(detect(ck))


def _rewrite(f: Path, change) -> None:
    """Load a real rank file, change it, and save it back (as a damaged or odd file)."""
    state = torch.load(f, weights_only=False)
    change(state)
    torch.save(state, f)


def test_replicas_that_differ(megatron_root, tmp_path):
    ck = copy_checkpoint(megatron_root / "llama" / "tp2_pp1" / "legacy", tmp_path / "ck")
    f = ck / "iter_0000010" / "mp_rank_01" / "model_optim_rng.pt"
    _rewrite(f, lambda s: s["model"]["decoder.layers.2.pre_mlp_layernorm.weight"].add_(1))
    layout = detect(ck)
    bad = [p for p in layout.problems if p.code == "replica-mismatch"]
    assert len(bad) == 1 and "decoder.layers.2.pre_mlp_layernorm.weight" in bad[0].message
    assert bad[0].path == str(f)


def test_expert_parallel_copies_that_differ(megatron_root, tmp_path):
    """With EP every EP rank's file repeats the dense weights: a copy that differs is found."""
    ck = copy_checkpoint(megatron_root / "mixtral" / "tp1_pp1_ep2" / "legacy", tmp_path / "ck")
    f = ck / "iter_0000010" / "mp_rank_00_001" / "model_optim_rng.pt"
    _rewrite(f, lambda s: s["model"]["decoder.layers.1.self_attention.linear_qkv.weight"]
             [0, 0].add_(1))
    bad = [p for p in detect(ck).problems if p.code == "replica-mismatch"]
    assert [(p.path, "linear_qkv" in p.message) for p in bad] == [(str(f), True)]


def test_args_disagree_with_files(megatron_root, tmp_path):
    ck = copy_checkpoint(megatron_root / "llama" / "tp1_pp2_vpp2" / "legacy", tmp_path / "ck")
    for f in (ck / "iter_0000010").glob("*/model_optim_rng.pt"):
        _rewrite(f, lambda s: setattr(s["args"], "virtual_pipeline_model_parallel_size", None))
    assert ("parallel-mismatch", "iter_0000010") in codes(detect(ck))


def test_unknown_tensor_is_not_dropped(megatron_root, tmp_path):
    ck = copy_checkpoint(megatron_root / "llama" / "tp2_pp1" / "legacy", tmp_path / "ck")
    for f in (ck / "iter_0000010").glob("*/model_optim_rng.pt"):
        _rewrite(f, lambda s: s["model"].__setitem__(
            "embedding.position_embeddings.weight", torch.zeros(64, 64)))
    layout = detect(ck)
    assert "unmapped-tensor" in {p.code for p in layout.errors}
    with pytest.raises(Exception, match="position_embeddings"):
        plan_merge(layout, MergeOptions(output=str(tmp_path / "out")))


def test_config_that_does_not_fit(megatron_root, tmp_path):
    """A config whose heads do not give linear_qkv's rows is refused, not merged wrongly."""
    cfg = copy_checkpoint(megatron_root / "llama" / "reference", tmp_path / "cfg")
    c = json.loads((cfg / "config.json").read_text())
    c["num_key_value_heads"] = 4
    (cfg / "config.json").write_text(json.dumps(c))
    layout = detect(megatron_root / "llama" / "tp2_pp1" / "legacy", hf_config=str(cfg))
    assert "config-mismatch" in {p.code for p in layout.errors}


# --- found by a breaking pass: each kind of damage is refused, never merged wrongly --------

def _error_codes(layout) -> set[str]:
    return {p.code for p in layout.errors}


def test_overlapping_chunk_bytes_in_metadata(megatron_root, tmp_path):
    """A .metadata whose storage entry points into another chunk's bytes is refused."""
    import pickle

    ck = copy_checkpoint(megatron_root / "llama" / "tp2_pp1" / "torch_dist", tmp_path / "ck")
    meta = ck / "iter_0000010" / ".metadata"
    m = pickle.loads(meta.read_bytes())  # torch is imported: DCP's own classes load
    items = sorted(((i, s) for i, s in m.storage_data.items() if s.relative_path ==
                    "__0_0.distcp"), key=lambda kv: kv[1].offset)
    (idx, info), (_, other) = items[-1], items[-2]
    m.storage_data[idx] = type(info)(info.relative_path, other.offset, info.length)
    meta.write_bytes(pickle.dumps(m))
    assert "overlapping-chunks" in _error_codes(detect(ck))


def test_chunk_with_too_few_dims(megatron_root, tmp_path):
    import pickle

    ck = copy_checkpoint(megatron_root / "llama" / "tp2_pp1" / "torch_dist", tmp_path / "ck")
    meta = ck / "iter_0000010" / ".metadata"
    m = pickle.loads(meta.read_bytes())
    tm = m.state_dict_metadata["decoder.layers.mlp.linear_fc2.weight"]
    tm.chunks[0] = type(tm.chunks[0])(tm.chunks[0].offsets[:2], tm.chunks[0].sizes[:2])
    meta.write_bytes(pickle.dumps(m))
    assert "bad-chunk" in _error_codes(detect(ck))


def test_swapped_stage_folders(megatron_root, tmp_path):
    ck = copy_checkpoint(megatron_root / "llama" / "tp1_pp2" / "legacy", tmp_path / "ck")
    it = ck / "iter_0000010"
    (it / "mp_rank_00_000").rename(it / "tmp")
    (it / "mp_rank_00_001").rename(it / "mp_rank_00_000")
    (it / "tmp").rename(it / "mp_rank_00_001")
    assert "stage-order" in _error_codes(detect(ck))


def test_stage_from_another_run(megatron_root, tmp_path):
    """A VPP set whose second stage comes from a run without VPP."""
    ck = copy_checkpoint(megatron_root / "llama" / "tp1_pp2_vpp2" / "legacy", tmp_path / "ck")
    other = megatron_root / "llama" / "tp1_pp2" / "legacy" / "iter_0000010" / "mp_rank_00_001"
    shutil.rmtree(ck / "iter_0000010" / "mp_rank_00_001")
    shutil.copytree(other, ck / "iter_0000010" / "mp_rank_00_001")
    assert _error_codes(detect(ck)) & {"parallel-mismatch", "args-disagree"}


def test_one_rank_in_another_dtype(megatron_root, tmp_path):
    ck = copy_checkpoint(megatron_root / "llama" / "tp2_pp1" / "legacy", tmp_path / "ck")
    f = ck / "iter_0000010" / "mp_rank_01" / "model_optim_rng.pt"
    _rewrite(f, lambda s: s.__setitem__("model", {
        k: v.to(torch.bfloat16) if isinstance(v, torch.Tensor) else v
        for k, v in s["model"].items()}))
    assert "dtype-mismatch" in _error_codes(detect(ck))


def test_tensor_on_one_tp_rank_only(megatron_root, tmp_path):
    ck = copy_checkpoint(megatron_root / "llama" / "tp2_pp1" / "legacy", tmp_path / "ck")
    f = ck / "iter_0000010" / "mp_rank_01" / "model_optim_rng.pt"
    _rewrite(f, lambda s: s["model"].pop("decoder.layers.1.pre_mlp_layernorm.weight"))
    bad = [p for p in detect(ck).errors if p.code == "key-mismatch"]
    assert bad and "decoder.layers.1.pre_mlp_layernorm.weight" in bad[0].message


def test_model_entry_that_is_not_a_state_dict(megatron_root, tmp_path):
    ck = copy_checkpoint(megatron_root / "llama" / "tp2_pp1" / "legacy", tmp_path / "ck")
    f = ck / "iter_0000010" / "mp_rank_01" / "model_optim_rng.pt"
    _rewrite(f, lambda s: s.__setitem__("model", list(s["model"].values())))
    assert ("unreadable-file", "model_optim_rng.pt") in codes(detect(ck))


def _config(megatron_root, tmp_path, family="llama", **change) -> str:
    cfg = copy_checkpoint(megatron_root / family / "reference", tmp_path / "cfg")
    c = json.loads((cfg / "config.json").read_text())
    for k, v in change.items():
        if v is None:
            c.pop(k, None)
        else:
            c[k] = v
    (cfg / "config.json").write_text(json.dumps(c))
    return str(cfg)


@pytest.mark.parametrize("family,change", [
    ("llama", {"intermediate_size": 128}),
    ("llama", {"model_type": "qwen2"}),
    ("llama", {"model_type": "mixtral"}),
    ("llama", {"num_key_value_heads": None}),
    ("llama", {"tie_word_embeddings": True}),
    ("qwen2", {"model_type": "llama"}),
    ("qwen2", {"model_type": "qwen3"}),
    ("mixtral", {"num_local_experts": 8}),
    ("llama", {"num_hidden_layers": 8}),
])
@pytest.mark.parametrize("kind", ["legacy", "torch_dist"])
def test_config_that_contradicts_the_weights(megatron_root, tmp_path, family, change, kind):
    layout_dir = "tp2_pp1_ep2" if family == "mixtral" else "tp2_pp1"
    cfg = _config(megatron_root, tmp_path, family, **change)
    layout = detect(megatron_root / family / layout_dir / kind, hf_config=cfg)
    assert "config-mismatch" in _error_codes(layout), layout.problems


def test_config_with_a_string_count(megatron_root, tmp_path):
    cfg = _config(megatron_root, tmp_path, vocab_size="300")
    assert "bad-config" in _error_codes(detect(megatron_root / "llama" / "tp2_pp1" / "legacy",
                                                hf_config=cfg))


def test_args_that_contradict_the_weights(megatron_root, tmp_path):
    """No config: the one derived from args must fit the tensors, or the merge refuses."""
    ck = copy_checkpoint(megatron_root / "llama" / "tp2_pp1" / "legacy", tmp_path / "ck")
    for f in (ck / "iter_0000010").glob("*/model_optim_rng.pt"):
        _rewrite(f, lambda s: setattr(s["args"], "num_layers", 8))
    assert "config-mismatch" in _error_codes(detect(ck))


def _corrupt_zip_directory(f: Path) -> None:
    """Set an unknown compression method for every entry of the archive's central
    directory (zipfile then raises NotImplementedError on reading data.pkl)."""
    data = bytearray(f.read_bytes())
    at = data.find(b"PK\x01\x02")
    while at >= 0:
        data[at + 10:at + 12] = (99).to_bytes(2, "little")
        at = data.find(b"PK\x01\x02", at + 4)
    f.write_bytes(bytes(data))


@pytest.mark.parametrize("which", ["legacy", "common.pt"])
def test_corrupt_zip_directory_is_one_line(megatron_root, tmp_path, which):
    kind = "legacy" if which == "legacy" else "torch_dist"
    ck = copy_checkpoint(megatron_root / "llama" / "tp2_pp1" / kind, tmp_path / "ck")
    f = (ck / "iter_0000010" / "mp_rank_01" / "model_optim_rng.pt" if which == "legacy"
         else ck / "iter_0000010" / "common.pt")
    _corrupt_zip_directory(f)
    r = merge_cli(ck, tmp_path / "out")
    assert r.returncode == 3, r.stderr
    assert f.name in r.stderr and "Traceback" not in r.stderr and "unexpected" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


class _Boom:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        import os

        return (os.system, (f"touch {self.marker}",))


def test_unsafe_common_pt_is_refused(megatron_root, tmp_path):
    ck = copy_checkpoint(megatron_root / "llama" / "tp2_pp1" / "torch_dist", tmp_path / "ck")
    marker = tmp_path / "ran"
    torch.save({"args": _Boom(marker)}, ck / "iter_0000010" / "common.pt")
    assert not marker.exists()
    layout = detect(ck)
    assert "unsafe-pickle" in _error_codes(layout)
    r = merge_cli(ck, tmp_path / "out")
    assert r.returncode == 3 and not marker.exists()


def test_bad_tracker_file_is_named(megatron_root, tmp_path):
    ck = copy_checkpoint(megatron_root / "llama" / "tp2_pp1" / "torch_dist", tmp_path / "ck")
    (ck / "latest_checkpointed_iteration.txt").write_text("99")
    r = merge_cli(ck, tmp_path / "out")
    assert r.returncode == 3
    assert "latest_checkpointed_iteration.txt" in r.stderr and "iter_0000099" in r.stderr


def test_merge_deep_refuses_flipped_tensor_bytes(megatron_root, tmp_path):
    """A flipped byte inside tensor data passes the metadata checks; `merge --deep` reads
    every byte first and refuses it by the CRC-32 torch.save recorded."""
    from shardscope.core.formats.torchsave import read_torch_archive

    ck = copy_checkpoint(megatron_root / "llama" / "tp2_pp1" / "legacy", tmp_path / "ck")
    f = ck / "iter_0000010" / "mp_rank_01" / "model_optim_rng.pt"
    ref = read_torch_archive(str(f)).root["model"]["decoder.layers.0.mlp.linear_fc2.weight"]
    with open(f, "r+b") as fh:
        fh.seek(ref.byte_offset + 7)
        b = fh.read(1)
        fh.seek(ref.byte_offset + 7)
        fh.write(bytes([b[0] ^ 0x40]))
    cfg = str(megatron_root / "llama" / "reference")
    r = merge_cli(ck, tmp_path / "out", "--deep", "--hf-config", cfg)
    assert r.returncode == 3 and "model_optim_rng.pt" in r.stderr, r.stderr
    assert not (tmp_path / "out").exists()


def test_mistral_names(megatron_root, tmp_path):
    """Mistral shares Llama's tensor names: a Llama-shaped Megatron checkpoint merged with a
    Mistral config loads as MistralForCausalLM and computes Megatron's logits."""
    cfg = _config(megatron_root, tmp_path, model_type="mistral",
                  architectures=["MistralForCausalLM"], sliding_window=None)
    merge(megatron_root / "llama" / "tp2_pp2" / "legacy", tmp_path / "out", hf_config=cfg)
    from transformers import AutoConfig

    assert AutoConfig.from_pretrained(tmp_path / "out").model_type == "mistral"
    want = torch.load(megatron_root / "llama" / "reference" / "megatron_logits.pt")
    got = logits(tmp_path / "out")
    torch.testing.assert_close(got, want.reshape(got.shape), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["legacy", "torch_dist"])
def test_bf16_model_keeps_each_dtype(megatron_root, tmp_path, kind):
    """megatron-core keeps RMSNorm weights in fp32 in a bf16 model: the merge keeps both
    dtypes as stored (the reference has them too); --dtype bf16 casts the norms only."""
    src = megatron_root / "llama-bf16" / "tp2_pp2" / kind
    cfg = str(megatron_root / "llama-bf16" / "reference")
    layout = detect(src, hf_config=cfg)
    assert layout.dtypes == {"BF16": 30, "F32": 9}
    assert layout.tensors["model.layers.0.input_layernorm.weight"].dtype == "F32"
    merge(src, tmp_path / "cast", hf_config=cfg, dtype="bf16")
    out, ref = load(tmp_path / "cast"), load(megatron_root / "llama-bf16" / "reference")
    assert {t.dtype for t in out.values()} == {torch.bfloat16}
    for k, v in ref.items():
        assert torch.equal(out[k], v.to(torch.bfloat16)), k


def test_tp_rank_file_copied_under_another_tp_rank(megatron_root, tmp_path):
    """mp_rank_01_000 (TP rank 1 of stage 0) replaced by a copy of mp_rank_00_000: every TP-split
    tensor of the stage then has byte-identical slices on both TP ranks (same CRC-32 in both
    zip directories), which two TP ranks of one run never hold. It merged into wrong weights
    with no problem reported."""
    ck = copy_checkpoint(megatron_root / "llama" / "tp2_pp2" / "legacy", tmp_path / "ck")
    it = ck / "iter_0000010"
    shutil.copy(it / "mp_rank_00_000" / "model_optim_rng.pt",
                it / "mp_rank_01_000" / "model_optim_rng.pt")
    bad = [(p.code, Path(p.path).parent.name) for p in detect(ck).errors]
    assert bad == [("duplicate-rank", "mp_rank_01_000")], bad
    r = merge_cli(ck, tmp_path / "out", "--hf-config", str(megatron_root / "llama" / "reference"))
    assert r.returncode == 3 and "mp_rank_00_000" in r.stderr and not (tmp_path / "out").exists()


def test_expert_rank_file_copied_under_another_expert_rank(megatron_root, tmp_path):
    """EP ranks repeat the dense weights but hold different experts: a byte copy of EP rank 0's
    file under EP rank 1's folder merged with EP rank 0's experts twice (24 tensors wrong)."""
    ck = copy_checkpoint(megatron_root / "mixtral" / "tp1_pp1_ep2" / "legacy", tmp_path / "ck")
    it = ck / "iter_0000010"
    shutil.copy(it / "mp_rank_00_000" / "model_optim_rng.pt",
                it / "mp_rank_00_001" / "model_optim_rng.pt")
    bad = [(p.code, Path(p.path).parent.name) for p in detect(ck).errors]
    assert bad == [("duplicate-rank", "mp_rank_00_001")], bad
