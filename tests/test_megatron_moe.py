"""Megatron-LM MoE checkpoints whose layer count differs from their expert count (2 layers and 4
experts, 3 layers and 2 experts; EP 1, 2, 4, TP2 x EP2, PP2 x EP2), with and without grouped GEMM
(megatron-core's ``GroupedMLP``: experts stacked as ``weight1``/``weight2``), written by real
megatron-core on gloo: every merge is bit-identical with the Hugging Face reference, in both
the ``torch_dist`` and the legacy format, and the merged model computes Megatron's logits."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import ROOT, copy_checkpoint
from shardscope.core import MergeOptions, detect, plan_merge, run_merge
from shardscope.core.errors import BadCheckpointError
from shardscope.core.sample_megatron import PROBE, layout_name
from shardscope.core.sample_megatron_moe import MOE_SETS
from test_merge_exact import assert_bit_equal, load

pytest.importorskip("megatron.core")

CASES = [(name, layout_name(*lay), kind) for name, (_, _, lays) in MOE_SETS.items()
         for lay in lays for kind in ("torch_dist", "legacy")]


def merge(src: Path, out: Path, **kw):
    plan = plan_merge(detect(src), MergeOptions(output=str(out), workers=2, **kw))
    run_merge(plan)
    return plan


@pytest.mark.parametrize("name,layout,kind", CASES, ids=["/".join(c) for c in CASES])
def test_moe_merge_is_bit_exact(megatron_moe_root, tmp_path, name, layout, kind):
    src = megatron_moe_root / name / layout / kind
    ref = megatron_moe_root / name / "reference"
    layout_ = detect(src, hf_config=str(ref))
    assert not layout_.errors, layout_.errors
    kw = {} if kind == "torch_dist" else {"hf_config": str(ref)}
    merge(src, tmp_path / "out", **kw)
    got, want = load(tmp_path / "out"), load(ref)
    assert_bit_equal(got, want)
    f = MOE_SETS[name][0]
    assert sum(".block_sparse_moe.experts." in k for k in got) == f.layers * f.experts * 3
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg == json.loads((ref / "config.json").read_text())


def logits(folder: Path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    with torch.no_grad():
        return model(torch.tensor(PROBE)).logits


@pytest.mark.parametrize("name,layout", [("moe-l2e4", "tp1_pp1_ep4"),
                                         ("gg-l3e2", "tp1_pp1_ep2")])
def test_merged_moe_computes_megatrons_logits(megatron_moe_root, tmp_path, name, layout):
    """The logits Megatron computed (SequentialMLP, TP=1) from the merged legacy files."""
    ref = megatron_moe_root / name / "reference"
    merge(megatron_moe_root / name / layout / "legacy", tmp_path / "out", hf_config=str(ref))
    want = torch.load(ref / "megatron_logits.pt")
    got = logits(tmp_path / "out")
    torch.testing.assert_close(got, want.reshape(got.shape), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["legacy", "torch_dist"])
def test_inspect_counts_experts_not_layers(megatron_moe_root, kind):
    lay = detect(megatron_moe_root / "moe-l2e4" / "tp1_pp1_ep4" / kind)
    assert not lay.errors, lay.errors
    assert lay.parallel["ep"] == 4
    assert "4 experts, top-2, 1 per EP rank" in lay.details["MLP"]
    assert lay.details["layers"].startswith("2;")
    three = detect(megatron_moe_root / "moe-l3e2" / "tp1_pp1_ep2" / kind)
    assert not three.errors and "2 experts, top-2, 1 per EP rank" in three.details["MLP"]
    assert three.details["layers"].startswith("3;")


def test_grouped_gemm_experts_are_strided_pieces(megatron_moe_root):
    """Legacy grouped GEMM: an expert's gate/up/down are transposed blocks of weight1/weight2,
    read as strided pieces of the file (not contiguous), one per TP rank."""
    lay = detect(megatron_moe_root / "gg-l2e4-bf16" / "tp2_pp1_ep2" / "legacy")
    assert not lay.errors, lay.errors
    assert lay.parallel == {"dp": 2, "tp": 2, "ep": 2}
    assert lay.details["MLP"].endswith("2 per EP rank, grouped GEMM")
    w1 = lay.tensors["model.layers.1.block_sparse_moe.experts.3.w1.weight"]
    assert w1.source == "decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight"
    assert w1.shape == (96, 64) and "grouped GEMM weight1" in w1.placement
    assert len(w1.pieces) == 2 and not any(p.contiguous for p in w1.pieces)
    assert {Path(p.file).parent.name for p in w1.pieces} == {"mp_rank_00_001",
                                                             "mp_rank_01_001"}
    w2 = lay.tensors["model.layers.0.block_sparse_moe.experts.0.w2.weight"]
    assert w2.shape == (64, 96) and not any(p.contiguous for p in w2.pieces)
    assert {Path(p.file).parent.name for p in w2.pieces} == {"mp_rank_00_000",
                                                             "mp_rank_01_000"}


def test_grouped_gemm_cast_to_fp32(megatron_moe_root, tmp_path):
    """``--dtype fp32`` on bf16 grouped-GEMM experts: the strided pieces are cast exactly."""
    ref = megatron_moe_root / "gg-l2e4-bf16" / "reference"
    merge(megatron_moe_root / "gg-l2e4-bf16" / "tp2_pp1_ep2" / "legacy", tmp_path / "out",
          hf_config=str(ref), dtype="fp32")
    got, want = load(tmp_path / "out"), load(ref)
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert got[k].dtype == torch.float32 and torch.equal(got[k], v.float()), k


def _rewrite(f: Path, change) -> None:
    """Load a real rank file, change it, and save it back."""
    state = torch.load(f, weights_only=False)
    change(state)
    torch.save(state, f)


def test_grouped_gemm_with_experts_that_do_not_divide_is_refused_by_name(megatron_moe_root,
                                                                          tmp_path):
    ck = copy_checkpoint(megatron_moe_root / "gg-l3e2" / "tp1_pp1_ep2" / "legacy",
                         tmp_path / "ck")
    for f in (ck / "iter_0000010").glob("*/model_optim_rng.pt"):
        _rewrite(f, lambda s: setattr(s["args"], "num_experts", 3))
    errs = [p for p in detect(ck).errors if p.code == "unsupported-layout"]
    assert errs and "Megatron grouped GEMM experts (weight1)" in errs[0].message
    assert "does not divide by EP=2" in errs[0].message


def test_grouped_gemm_weight2_narrower_than_weight1_is_refused(megatron_moe_root, tmp_path):
    """weight1 and weight2 must describe the same expert width: a narrower weight2 (each
    expert's fc2 with fewer columns) is a config-mismatch, not a merge that cannot load."""
    ck = copy_checkpoint(megatron_moe_root / "gg-l3e2" / "tp1_pp1_ep2" / "legacy",
                         tmp_path / "ck")
    for f in (ck / "iter_0000010").glob("*/model_optim_rng.pt"):
        _rewrite(f, lambda s: [s["model"].__setitem__(k, s["model"][k][:-2].clone())
                               for k in list(s["model"]) if k.endswith("experts.weight2")])
    lay = detect(ck, hf_config=str(megatron_moe_root / "gg-l3e2" / "reference"))
    assert any(p.code == "config-mismatch" and "linear_fc2 holds 38 columns" in p.message
               for p in lay.errors), lay.errors


def test_grouped_gemm_expert_copy_that_differs_is_not_a_replica(megatron_moe_root, tmp_path):
    """EP ranks hold different experts in weight1: no replica check between them, but a
    changed byte still shows in the merge (compared with the reference)."""
    ck = copy_checkpoint(megatron_moe_root / "gg-l3e2" / "tp1_pp1_ep2" / "legacy",
                         tmp_path / "ck")
    assert not detect(ck).errors
    f = ck / "iter_0000010" / "mp_rank_00_001" / "model_optim_rng.pt"
    _rewrite(f, lambda s: s["model"]["decoder.layers.2.mlp.experts.weight2"][1, 0].add_(1))
    ref = megatron_moe_root / "gg-l3e2" / "reference"
    merge(ck, tmp_path / "out", hf_config=str(ref))
    got, want = load(tmp_path / "out"), load(ref)
    # expert 1 (EP rank 1, its only local expert), down projection: column 1, row 0
    name = "model.layers.2.block_sparse_moe.experts.1.w2.weight"
    diff = (got[name] != want[name]).nonzero().tolist()
    assert diff == [[0, 1]]


def test_data_parallel_size_from_args(megatron_root, tmp_path):
    """Legacy files are written by DP rank 0 only: DP comes from args (data_parallel_size,
    else world_size / (TP x PP))."""
    ck = copy_checkpoint(megatron_root / "llama" / "tp2_pp1" / "legacy", tmp_path / "ck")
    assert "dp" not in detect(ck).parallel
    for f in (ck / "iter_0000010").glob("*/model_optim_rng.pt"):
        _rewrite(f, lambda s: setattr(s["args"], "world_size", 4))
    assert detect(ck).parallel == {"dp": 2, "tp": 2}
    for f in (ck / "iter_0000010").glob("*/model_optim_rng.pt"):
        _rewrite(f, lambda s: setattr(s["args"], "data_parallel_size", 3))
    assert detect(ck).parallel == {"dp": 3, "tp": 2}


def _resave_non_zip(ck: Path) -> list[Path]:
    files = sorted((ck / "iter_0000010").glob("*/model_optim_rng.pt"))
    for f in files:
        state = torch.load(f, weights_only=False)
        torch.save(state, f, _use_new_zipfile_serialization=False)
        assert f.read_bytes()[:1] == b"\x80"  # a bare pickle, no zip
    return files


def test_legacy_non_zip_torch_save_merges(megatron_moe_root, tmp_path):
    """Rank files saved with ``_use_new_zipfile_serialization=False`` (torch's legacy format:
    pickles, then each storage's bytes) are read in place and merge bit-exact."""
    ck = copy_checkpoint(megatron_moe_root / "gg-l3e2" / "tp1_pp1_ep2" / "legacy",
                         tmp_path / "ck")
    _resave_non_zip(ck)
    ref = megatron_moe_root / "gg-l3e2" / "reference"
    lay = detect(ck, hf_config=str(ref))
    assert not lay.errors, lay.errors
    merge(ck, tmp_path / "out", hf_config=str(ref))
    assert_bit_equal(load(tmp_path / "out"), load(ref))
    from shardscope.core.deep import deep_check

    deep = deep_check(lay)  # no CRC-32 in this format: said, not "not a zip archive"
    assert {(p.code, p.severity) for p in deep} == {("no-checksum", "warning")}, deep


def test_unreadable_rank_files_give_the_readers_reason(megatron_moe_root, tmp_path):
    """When no rank file can be read, the refusal carries the reader's own reason and names
    the file, in one line, exit 3 (not a bare 'no readable model file')."""
    ck = copy_checkpoint(megatron_moe_root / "moe-l3e2" / "tp1_pp1_ep2" / "legacy",
                         tmp_path / "ck")
    files = _resave_non_zip(ck)
    for f in files:
        f.write_bytes(f.read_bytes()[: f.stat().st_size - 1000])
    with pytest.raises(BadCheckpointError, match="truncated") as e:
        detect(ck)
    assert e.value.path == str(files[0])
    r = subprocess.run([sys.executable, "-m", "shardscope.tui.cli", "merge", str(ck), "-o",
                        str(tmp_path / "out")], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 3, r.stderr
    assert "truncated" in r.stderr and "model_optim_rng.pt" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
