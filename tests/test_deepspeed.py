"""DeepSpeed ZeRO checkpoints written by DeepSpeed itself (CPU accelerator, gloo), read without
importing deepspeed, compared bit for bit with the model and with DeepSpeed's zero_to_fp32."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import ROOT, _cache_root, cached, copy_checkpoint, run_cli
from shardscope.core import BadCheckpointError, MergeOptions, detect, plan_merge, run_merge

pytest.importorskip("deepspeed")

#: name -> (world size, stage, dtype, tied embeddings)
DS = {
    "ds-z2-w2": (2, 2, "F32", False),
    "ds-z3-w3-tied": (3, 3, "F32", True),
    "ds-z2-w3-bf16": (3, 2, "BF16", False),
    "ds-z3-w2-bf16": (2, 3, "BF16", False),
    "ds-z1-w2": (2, 1, "F32", True),
}


@pytest.fixture(scope="session")
def ds_root():
    import hashlib
    import json

    from fixtures_deepspeed import write_deepspeed_groups

    key = hashlib.sha256(json.dumps(
        [DS, (ROOT / "tests" / "fixtures_deepspeed.py").read_text()],
        sort_keys=True).encode()).hexdigest()[:8]

    def write(tmp: Path) -> None:  # one process group per world size (fixtures_deepspeed)
        write_deepspeed_groups(tmp, {name: (world, stage, dtype, tie, 40 + i) for i, (
            name, (world, stage, dtype, tie)) in enumerate(DS.items())})

    return cached(_cache_root().with_name(f"{_cache_root().name}-deepspeed-{key}"), write,
                  lock="lock-ds")


def zero_to_fp32(ckpt: Path) -> dict[str, torch.Tensor]:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    return get_fp32_state_dict_from_zero_checkpoint(str(ckpt))


@pytest.mark.parametrize("name", list(DS))
def test_inspect(ds_root, name):
    world, stage, _, _ = DS[name]
    layout = detect(ds_root / name)
    assert layout.format == "deepspeed" and layout.world_size == world
    assert not layout.problems, layout.problems
    assert f"ZeRO stage {stage}" in layout.notes[0]


@pytest.mark.parametrize("name", list(DS))
def test_merge_matches_the_model_and_zero_to_fp32(ds_root, tmp_path, name):
    _, _, dtype, tie = DS[name]
    run_merge(plan_merge(detect(ds_root / name), MergeOptions(str(tmp_path / "o"))))
    got = load_file(tmp_path / "o" / "model.safetensors")
    ref = load_file(ds_root / f"{name}.reference" / "model.safetensors")
    assert set(got) == set(ref)
    for k, v in ref.items():
        # the fp32 master of a bf16 run starts from the bf16-rounded weights
        want = v.to(torch.bfloat16).float() if dtype == "BF16" else v
        assert got[k].dtype == torch.float32 and torch.equal(got[k], want), k
    theirs = zero_to_fp32(ds_root / name)
    for k in got:
        assert torch.equal(got[k], theirs[k].reshape(got[k].shape)), k
    if tie:
        assert "lm_head.weight" not in got


def test_inspect_does_not_import_deepspeed(ds_root):
    code = ("import sys; from shardscope.core import detect; detect(sys.argv[1]); "
            "print('deepspeed' in sys.modules, 'torch' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code, str(ds_root / "ds-z3-w3-tied")], cwd=ROOT,
                       capture_output=True, text=True)
    assert r.stdout.split() == ["False", "False"], r.stderr


def test_missing_optimizer_file(ds_root, tmp_path):
    ck = copy_checkpoint(ds_root / "ds-z2-w3-bf16", tmp_path / "ck")
    victim = next((ck / "global_step0").glob("bf16_zero_pp_rank_2_*optim_states.pt"))
    os.remove(victim)
    layout = detect(ck)
    assert ("missing-rank", victim.name) in {(p.code, Path(p.path).name) for p in layout.problems}
    r = run_cli("merge", str(ck), "-o", str(tmp_path / "out"), cwd=ROOT)
    assert r.returncode == 3 and not (tmp_path / "out").exists()


@pytest.mark.parametrize("name", ["ds-z1-w2", "ds-z2-w2"])
def test_optimizer_file_copied_under_another_rank_refused(ds_root, tmp_path, name):
    """Rank 1's optimizer file replaced by a copy of rank 0's: every flat partition is the same
    size, so only the file's own param_slice_mappings (which parameter fragments it holds)
    tell; merging it anyway writes rank 0's slices in rank 1's place."""
    ck = copy_checkpoint(ds_root / name, tmp_path / "ck")
    d = ck / "global_step0"
    (d / "zero_pp_rank_1_mp_rank_00_optim_states.pt").write_bytes(
        (d / "zero_pp_rank_0_mp_rank_00_optim_states.pt").read_bytes())
    layout = detect(ck)
    assert [(p.code, Path(p.path).name) for p in layout.errors] == [
        ("duplicate-rank", "zero_pp_rank_1_mp_rank_00_optim_states.pt")], layout.problems
    r = run_cli("merge", ck, "-o", tmp_path / "out", cwd=ROOT)
    assert r.returncode == 3 and "rank 0's optimizer file" in r.stderr, r.stderr
    assert not (tmp_path / "out").exists()
    # a file that is not a byte copy but names rank 0's fragments: param_slice_mappings tell
    from shardscope.core.formats import deepspeed

    real = deepspeed.same_data_groups
    try:
        deepspeed.same_data_groups = lambda files: []
        errors = [(p.code, Path(p.path).name, "param_slice_mappings" in p.message)
                  for p in detect(ck).errors]
    finally:
        deepspeed.same_data_groups = real
    assert errors == [("rank-disagreement", "zero_pp_rank_1_mp_rank_00_optim_states.pt", True)]


def test_zero3_optimizer_file_copied_under_another_rank_refused(ds_root, tmp_path):
    """ZeRO-3 optimizer files record nothing about their rank; a byte copy still shows in the
    zip directories (every storage record of the same CRC-32)."""
    ck = copy_checkpoint(ds_root / "ds-z3-w3-tied", tmp_path / "ck")
    d = ck / "global_step0"
    (d / "zero_pp_rank_2_mp_rank_00_optim_states.pt").write_bytes(
        (d / "zero_pp_rank_0_mp_rank_00_optim_states.pt").read_bytes())
    assert [(p.code, Path(p.path).name) for p in detect(ck).errors] == [
        ("duplicate-rank", "zero_pp_rank_2_mp_rank_00_optim_states.pt")]


def test_optimizer_file_of_another_zero_stage_refused(ds_root, tmp_path):
    """A ZeRO-1 run's rank-1 optimizer file among a ZeRO-2 run's files (same model, same
    partition sizes): the files disagree on the stage."""
    ck = copy_checkpoint(ds_root / "ds-z2-w2", tmp_path / "ck")
    f = "global_step0/zero_pp_rank_1_mp_rank_00_optim_states.pt"
    (ck / f).write_bytes((ds_root / "ds-z1-w2" / f).read_bytes())
    codes = [(p.code, Path(p.path).name) for p in detect(ck).errors]
    assert ("rank-disagreement", Path(f).name) in codes


def test_module_weights_and_tag(ds_root, tmp_path):
    """--weights module: the bf16 weights as trained (stage 2), same as the master rounded."""
    src = ds_root / "ds-z2-w3-bf16"
    r = run_cli("merge", str(src), "--tag", "global_step0", "--weights", "module", "-o",
                str(tmp_path / "o"), cwd=ROOT)
    assert r.returncode == 0, r.stderr
    got = load_file(tmp_path / "o" / "model.safetensors")
    ref = load_file(ds_root / "ds-z2-w3-bf16.reference" / "model.safetensors")
    assert set(got) == set(ref)
    for k, v in ref.items():
        assert got[k].dtype == torch.bfloat16 and torch.equal(got[k], v.to(torch.bfloat16)), k
    r = run_cli("merge", str(ds_root / "ds-z3-w2-bf16"), "--weights", "module", "-o",
                str(tmp_path / "o3"), cwd=ROOT)
    assert r.returncode == 3 and "stage 3 keeps no module weights" in r.stderr


# --- frozen parameters, pipelines, tensor parallelism (core/sample_deepspeed.py) -----------

EMB, L0, L1, NORM, HEAD = ("model.embed_tokens.", "model.layers.0.", "model.layers.1.",
                           "model.norm.", "lm_head.")
#: world size -> jobs run by one DeepSpeed process group of that size
DS_JOBS = {
    2: [
        dict(kind="frozen", name="fz-z2-w2", stage=2, dtype="F32", frozen=(EMB, L0, NORM)),
        # bf16 + ZeRO-1 + fp32 gradient accumulation: DeepSpeed's BF16_Optimizer
        dict(kind="frozen", name="fz-z1-w2-bf16", stage=1, dtype="BF16", grad_accum="fp32",
             frozen=(L1 + "self_attn.", HEAD)),
        dict(kind="frozen", name="fz-z3-w2-bf16", stage=3, dtype="BF16", layers=3,
             frozen=(L1 + "mlp.", NORM)),
        dict(kind="frozen", name="fz-z2-w2-excl", stage=2, dtype="F32", frozen=(EMB, L0),
             exclude=True),
        dict(kind="pipeline", name="pp2-w2", stages=2, tp=0, layers=4),
        dict(kind="pipeline", name="mp2-w2", stages=1, tp=2, layers=3),
    ],
    3: [
        dict(kind="frozen", name="fz-z3-w3", stage=3, dtype="F32", layers=3, frozen=(EMB, L1)),
        dict(kind="frozen", name="fz-z2-w3-bf16", stage=2, dtype="BF16",
             frozen=(HEAD, NORM, L0)),
        dict(kind="frozen", name="fz-z1-w3", stage=1, dtype="F32", frozen=(EMB, L0)),
        dict(kind="frozen", name="fz-z3-w3-excl", stage=3, dtype="F32", frozen=(HEAD,),
             exclude=True),
        dict(kind="pipeline", name="pp3-w3-bf16", stages=3, tp=0, layers=5, dtype="BF16"),
    ],
}
JOBS = {j["name"]: j for jobs in DS_JOBS.values() for j in jobs}
FROZEN = [n for n, j in JOBS.items() if j["kind"] == "frozen" and not j.get("exclude")]


@pytest.fixture(scope="session")
def ds_more():
    import hashlib
    import json

    from shardscope.core.sample_deepspeed import write_jobs

    key = hashlib.sha256(json.dumps(
        [DS_JOBS, (ROOT / "core" / "sample_deepspeed.py").read_text()],
        sort_keys=True).encode()).hexdigest()[:8]

    def write(tmp: Path) -> None:
        for world, jobs in DS_JOBS.items():
            write_jobs(tmp, world, jobs)

    return cached(_cache_root().with_name(f"{_cache_root().name}-deepspeed-more-{key}"), write,
                  lock="lock-ds-more")


def _merge(src: Path, out: Path, *args: str) -> subprocess.CompletedProcess:
    return run_cli("merge", src, "-o", out, *args, cwd=ROOT)  # in this process


@pytest.mark.parametrize("name", FROZEN)
def test_frozen_parameters_merge_bit_exact(ds_more, tmp_path, name):
    """Frozen weights come out as saved (training dtype), trained ones from the fp32 master;
    every tensor of the reference, bit for bit, and the same as DeepSpeed's zero_to_fp32."""
    job = JOBS[name]
    layout = detect(ds_more / name)
    assert not layout.problems, layout.problems
    assert f"ZeRO stage {job['stage']}" in layout.notes[0]
    ref = load_file(ds_more / f"{name}.reference" / "model.safetensors")
    frozen = {k for k in ref if k.startswith(job["frozen"])}
    assert frozen and f"{len(frozen)} frozen parameter(s)" in " ".join(layout.notes)
    run_merge(plan_merge(layout, MergeOptions(str(tmp_path / "o"))))
    got = load_file(tmp_path / "o" / "model.safetensors")
    assert set(got) == set(ref)
    for k, v in ref.items():
        if k in frozen:
            assert got[k].dtype == v.dtype and torch.equal(got[k], v), k
        else:
            assert got[k].dtype == torch.float32 and torch.equal(got[k], v.float()), k
    if job.get("grad_accum"):  # zero_to_fp32 refuses BF16_Optimizer files (no zero_stage)
        with pytest.raises(ValueError, match="is not a zero checkpoint"):
            zero_to_fp32(ds_more / name)
        return
    theirs = zero_to_fp32(ds_more / name)
    if job["stage"] >= 2:  # zero_to_fp32 reads frozen_param_fragments from stage 2 on
        assert set(theirs) == set(got)
    for k in set(theirs) & set(got):
        assert torch.equal(got[k], theirs[k].reshape(got[k].shape)), k


def test_bf16_zero1_is_stage_1(ds_more):
    """DeepSpeed's BF16_Optimizer (bf16, ZeRO-1) writes no zero_stage: the stage comes from the
    saved ds_config, not a guess of 2."""
    from shardscope.core.formats.torchsave import read_torch_archive

    d = ds_more / "fz-z1-w2-bf16" / "global_step0"
    osd = read_torch_archive(next(d.glob("bf16_zero_pp_rank_0_*"))).root["optimizer_state_dict"]
    assert "zero_stage" not in osd  # the fixture really went through BF16_Optimizer
    assert detect(d.parent).notes[0].startswith("ZeRO stage 1;")


@pytest.mark.parametrize("name", ["fz-z2-w2-excl", "fz-z3-w3-excl"])
def test_excluded_frozen_parameters_refused(ds_more, tmp_path, name):
    layout = detect(ds_more / name)
    # the config's layer count / untied lm_head disagree too: frozen-excluded says why
    assert layout.errors[0].code == "frozen-excluded"
    r = _merge(ds_more / name, tmp_path / "o")
    assert r.returncode == 3 and not (tmp_path / "o").exists()
    assert "exclude_frozen_parameters" in r.stderr and "Traceback" not in r.stderr
    assert "--no-strict" in r.stderr
    # an expert opts in: the trained weights are written, the card names what is missing
    r = _merge(ds_more / name, tmp_path / "o", "--no-strict")
    assert r.returncode == 0, r.stderr
    got = load_file(tmp_path / "o" / "model.safetensors")
    ref = load_file(ds_more / f"{name}.reference" / "model.safetensors")
    assert got and set(got) < set(ref)
    for k, v in got.items():
        assert torch.equal(v, ref[k].to(v.dtype)), k
    card = (tmp_path / "o" / "README.md").read_text()
    assert "Written with --no-strict" in card
    assert all(f"`{k}`" in card for k in set(ref) - set(got))


@pytest.mark.parametrize("name", ["pp2-w2", "pp3-w3-bf16"])
def test_pipeline_stages_merge_bit_exact(ds_more, tmp_path, name):
    """PipelineModule: one mp_rank per stage, names '<layer>.<param>' from each stage's
    param_shapes; the union of the stages equals the model, master and module weights."""
    job = JOBS[name]
    layout = detect(ds_more / name)
    assert not layout.problems, layout.problems
    assert layout.parallel.get("pp") == job["stages"]
    ref = load_file(ds_more / f"{name}.reference" / "model.safetensors")
    # no Hugging Face model defines PipelineModule's names: not strict (nothing can check them)
    with pytest.raises(BadCheckpointError, match="architecture check skipped: no config"):
        plan_merge(layout, MergeOptions(str(tmp_path / "o")))
    run_merge(plan_merge(layout, MergeOptions(str(tmp_path / "o"), strict=False)))
    got = load_file(tmp_path / "o" / "model.safetensors")
    assert set(got) == set(ref) and len(ref) == 2 * job["layers"]
    for k, v in ref.items():
        assert got[k].dtype == torch.float32 and torch.equal(got[k], v.float()), k
    r = _merge(ds_more / name, tmp_path / "m", "--weights", "module", "--no-strict")
    assert r.returncode == 0, r.stderr
    mod = load_file(tmp_path / "m" / "model.safetensors")
    assert set(mod) == set(ref)
    for k, v in ref.items():
        assert mod[k].dtype == v.dtype and torch.equal(mod[k], v), k


@pytest.mark.parametrize("victim", ["mp_rank_01_model_states.pt",
                                    "zero_pp_rank_0_mp_rank_01_optim_states.pt"])
def test_missing_pipeline_stage_refused(ds_more, tmp_path, victim):
    ck = copy_checkpoint(ds_more / "pp2-w2", tmp_path / "ck")
    os.remove(ck / "global_step0" / victim)
    layout = detect(ck)
    assert victim in {Path(p.path).name for p in layout.errors}
    r = _merge(ck, tmp_path / "o")
    assert r.returncode == 3 and victim in r.stderr and not (tmp_path / "o").exists()


def test_tensor_parallel_refused_by_name(ds_more, tmp_path):
    """Two model-parallel ranks (tp_degree 2): refused naming tensor parallelism, never one
    rank's tensors written as the model."""
    layout = detect(ds_more / "mp2-w2")
    assert [p.code for p in layout.errors] == ["unsupported-tp"]
    assert layout.parallel["tp"] == 2
    r = _merge(ds_more / "mp2-w2", tmp_path / "o")
    assert r.returncode == 3 and "tensor parallelism" in r.stderr
    assert not (tmp_path / "o").exists()


def test_inspect_honours_hf_config(ds_more, tmp_path):
    import json

    ck = copy_checkpoint(ds_more / "fz-z2-w2", tmp_path / "ck")
    cfg = tmp_path / "cfg"
    os.rename(ck / "huggingface", cfg)
    assert detect(ck).config_dir is None
    r = run_cli("inspect", str(ck), "--hf-config", str(cfg), "--json", cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["config_dir"] == str(cfg)


@pytest.fixture(scope="session")
def ds_moe():
    import hashlib

    from shardscope.core.sample_deepspeed import write_jobs

    key = hashlib.sha256((ROOT / "core" / "sample_deepspeed.py").read_bytes()).hexdigest()[:8]
    return cached(_cache_root().with_name(f"{_cache_root().name}-deepspeed-moe-{key}"),
                  lambda tmp: write_jobs(tmp, 2, [dict(kind="moe", name="moe-ep2")]),
                  lock="lock-ds-moe")


def test_moe_refused_by_name(ds_moe, tmp_path):
    """DeepSpeed MoE (2 experts over 2 expert-parallel ranks, layer_0_expert_*_ files):
    refused naming DeepSpeed MoE, not as a partition mismatch."""
    layout = detect(ds_moe / "moe-ep2")
    assert [p.code for p in layout.errors] == ["unsupported-moe"]
    r = _merge(ds_moe / "moe-ep2", tmp_path / "o")
    assert r.returncode == 3 and "DeepSpeed MoE" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "o").exists()


@pytest.fixture(scope="session")
def ds_universal(ds_more):
    """``fz-z2-w2`` (frozen embedding, layer 0 and norm) converted by DeepSpeed's own
    ``ds_to_universal`` (``--inject_missing_state``: a Hugging Face model records no
    universal_checkpoint_info), at ``<root>/universal``."""

    def write(tmp: Path) -> None:
        src = copy_checkpoint(ds_more / "fz-z2-w2", tmp / "src")
        r = subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal",
                            "--input_folder", str(src / "global_step0"), "--output_folder",
                            str(tmp / "universal"), "--inject_missing_state",
                            "--num_extract_workers", "1", "--num_merge_workers", "1"],
                           capture_output=True, text=True)
        assert r.returncode == 0, r.stderr[-2000:]

    return cached(ds_more.with_name(ds_more.name + "-universal"), write, lock="lock-ds-uni")


def test_universal_checkpoint_merges_bit_exact(ds_universal, ds_more, tmp_path):
    layout = detect(ds_universal / "universal")
    assert not layout.problems, layout.problems
    # ds_to_universal writes no config: the run's own, so the names are checked
    plan = plan_merge(layout, MergeOptions(str(tmp_path / "o"),
                                           hf_config=str(ds_more / "fz-z2-w2" / "huggingface")))
    assert plan.check.ok, plan.check.summary()
    run_merge(plan)
    got = load_file(tmp_path / "o" / "model.safetensors")
    ref = load_file(ds_more / "fz-z2-w2.reference" / "model.safetensors")
    assert set(got) == set(ref)
    for k, v in ref.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k


def test_universal_checkpoint_missing_parameter_refused(ds_universal, tmp_path):
    ck = copy_checkpoint(ds_universal / "universal", tmp_path / "u")
    victim = ck / "zero" / "model.norm.weight" / "fp32.pt"
    os.remove(victim)
    layout = detect(ck)
    assert ("missing-tensor", str(victim)) in {(p.code, p.path) for p in layout.errors}
    r = _merge(ck, tmp_path / "o")
    assert r.returncode == 3 and "model.norm.weight" in r.stderr


@pytest.fixture(scope="session")
def ds_autotp():
    import hashlib

    from shardscope.core.sample_deepspeed_tp import write_autotp

    key = hashlib.sha256((ROOT / "core" / "sample_deepspeed_tp.py").read_bytes()).hexdigest()[:8]
    return cached(_cache_root().with_name(f"{_cache_root().name}-deepspeed-autotp-{key}"),
                  lambda tmp: (write_autotp(tmp, "autotp2"),
                               write_autotp(tmp, "autotp2-dp2", dp=2, seed=91)),
                  lock="lock-ds-autotp")


@pytest.mark.parametrize("name,dp", [("autotp2", 1), ("autotp2-dp2", 2)])
def test_autotp_merges_bit_exact(ds_autotp, tmp_path, name, dp):
    """AutoTP (tp 2, ZeRO-1, 1 or 2 data-parallel ranks): each TP rank's flat master slices
    placed by the affine map the checkpoint records (rows, columns, the uneven vocabulary
    split 142/141, replicated norms taken once; with dp 2 slices cut mid-row by the ZeRO
    partitions), equal to the model."""
    layout = detect(ds_autotp / name)
    assert not layout.problems, layout.problems
    assert layout.parallel.get("tp") == 2 and layout.parallel.get("dp") == dp
    run_merge(plan_merge(layout, MergeOptions(str(tmp_path / "o"))))
    got = load_file(tmp_path / "o" / "model.safetensors")
    ref = load_file(ds_autotp / f"{name}.reference" / "model.safetensors")
    assert set(got) == set(ref)
    for k, v in ref.items():
        assert got[k].dtype == torch.float32 and torch.equal(got[k], v), k


def test_autotp_missing_rank_refused(ds_autotp, tmp_path):
    ck = copy_checkpoint(ds_autotp / "autotp2", tmp_path / "ck")
    victim = ck / "global_step0" / "zero_pp_rank_0_mp_rank_01_optim_states.pt"
    os.remove(victim)
    assert victim.name in {Path(p.path).name for p in detect(ck).errors}
    r = _merge(ck, tmp_path / "o")
    assert r.returncode == 3 and victim.name in r.stderr and not (tmp_path / "o").exists()


@pytest.mark.parametrize("shard,dst,box", [((7, 5), (0, 2), (7, 3)), ((6, 4), (1, 0), (4, 4)),
                                           ((9,), (3,), (5,)), ((5, 6), (2, 1), (2, 4))])
def test_autotp_boxes_cover_a_box_split_across_data_parallel_ranks(shard, dst, box):
    """The geometry behind AutoTP x ZeRO: a rank's slice is flat fp32 cut at arbitrary
    element boundaries by the data-parallel partitions; the cuts of every split must place
    exactly the box's elements where the affine map says."""
    from shardscope.core.formats.deepspeed import _boxes
    from shardscope.core.layout import Piece

    n = 1
    for s in shard:
        n *= s
    flat = torch.arange(n, dtype=torch.float32)
    src = (3,) * len(shard)
    full_shape = tuple(s + 3 + b for s, b in zip(shard, box))
    want = torch.full(full_shape, -1.0)
    region = flat.reshape(shard)[tuple(slice(d, d + b) for d, b in zip(dst, box))]
    want[tuple(slice(o, o + b) for o, b in zip(src, box))] = region
    for cuts in ([n // 3, n // 2], [1, n - 1], [shard[-1] + 1], []):
        got = torch.full(full_shape, -1.0)
        bounds = [0, *cuts, n]
        for a, b in zip(bounds, bounds[1:]):
            fp = Piece("f", a * 4, "F32", (b - a,), (1,), (a,), 0)
            for p in _boxes(fp, shard, dst, box, src):
                start = p.byte_offset // 4
                view = flat.as_strided(p.shape, p.stride, start)
                got[tuple(slice(o, o + s) for o, s in zip(p.global_offsets, p.shape))] = view
        assert torch.equal(got, want), cuts
