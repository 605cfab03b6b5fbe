"""``shardscope diff A B`` on real checkpoints: a run against its own reference, a sharded run
against its merged output, two steps of real training, a LoRA fold against its base, damaged
copies (one tensor changed, one dropped, one cast), a Megatron run against its Hugging Face
reference."""

from __future__ import annotations

import json
import subprocess

import pytest

from conftest import ROOT, copy_checkpoint, run_cli
from fixtures_diff import FROZEN


def run(*args: str) -> subprocess.CompletedProcess:
    return run_cli("diff", *args, cwd=ROOT)  # in this process (conftest.run_cli)


def diff_json(*args) -> tuple[int, dict]:
    r = run(*args, "--json")
    assert r.returncode in (0, 1), r.stderr
    return r.returncode, json.loads(r.stdout)


def by_name(d: dict) -> dict[str, dict]:
    return {t["name"]: t for t in d["tensors"]}


def test_a_run_against_its_own_reference_is_identical(fixtures_root):
    code, d = diff_json(fixtures_root / "w2-qwen2-f32", fixtures_root / "w2-qwen2-f32.reference")
    assert code == 0 and d["same"]
    assert d["format_a"] == "fsdp" and d["format_b"] == "hf"
    assert d["counts"]["identical"] == len(d["tensors"]) > 20
    from safetensors import safe_open

    with safe_open(str(fixtures_root / "w2-qwen2-f32.reference" / "model.safetensors"),
                   "pt") as f:
        assert set(by_name(d)) == set(f.keys())
    assert all(lay["rel_change"] == 0.0 for lay in d["layers"])
    r = run(fixtures_root / "w2-qwen2-f32", fixtures_root / "w2-qwen2-f32.reference")
    assert r.returncode == 0 and "identical bit for bit" in r.stdout


def test_a_sharded_run_against_its_merged_output(fixtures_root, tmp_path):
    from shardscope.core import MergeOptions, detect, plan_merge, run_merge

    src = fixtures_root / "w3-llama-f32"
    run_merge(plan_merge(detect(src), MergeOptions(output=str(tmp_path / "m"), workers=1)))
    code, d = diff_json(src, tmp_path / "m")
    assert code == 0 and d["counts"]["identical"] == len(d["tensors"])
    # and against another model: every shared tensor reported, exit 1
    code, d = diff_json(src, fixtures_root / "w2-qwen2-f32.reference")
    assert code == 1 and not d["same"]


def test_two_steps_of_training_change_every_trained_tensor_and_no_frozen_one(training_root):
    code, d = diff_json(training_root / "step1", training_root / "step2")
    assert code == 1
    tensors = by_name(d)
    frozen = {n for n in tensors if n.startswith(FROZEN)}
    assert frozen and len(frozen) < len(tensors)
    for name, t in tensors.items():
        if name in frozen:
            assert t["status"] == "identical", name
        else:
            assert t["status"] == "changed", name
            assert t["max_abs"] > 0 and t["rel_change"] > 0 and t["differing"] > 0
            assert -1.0 <= t["cosine"] <= 1.0
    layers = {lay["layer"]: lay for lay in d["layers"]}
    assert layers["model.layers.0"]["changed"] == 0
    assert layers["model.layers.0"]["rel_change"] == 0.0
    assert layers["model.layers.1"]["rel_change"] > 0
    assert d["largest"] and all(n not in frozen for n in d["largest"])
    r = run(training_root / "step1", training_root / "step2")
    assert r.returncode == 1 and "change by layer" in r.stdout
    assert "model.layers.1" in r.stdout


def test_a_lora_fold_against_its_base(fixtures_root):
    lora = fixtures_root / "w2-lora-qv"
    code, d = diff_json(fixtures_root / "w2-lora-qv.base", lora, "--lora", "fold")
    assert code == 1
    changed = {n for n, t in by_name(d).items() if t["status"] != "identical"}
    assert changed and all(n.endswith(("q_proj.weight", "v_proj.weight")) for n in changed)
    assert all(t["status"] == "changed" for n, t in by_name(d).items() if n in changed)
    # peft's merge_and_unload is the same model, bit for bit
    code, d = diff_json(fixtures_root / "w2-lora-qv.fold", lora, "--lora", "fold")
    assert code == 0 and d["same"]
    # the base alone equals the base
    code, d = diff_json(fixtures_root / "w2-lora-qv.base", lora, "--lora", "base")
    assert code == 0
    # without a choice: a usage error naming LoRA, not a crash
    r = run(fixtures_root / "w2-lora-qv.base", lora)
    assert r.returncode == 2 and "LoRA" in r.stderr and "Traceback" not in r.stderr


def _damaged(fixtures_root, tmp_path, change):
    """A copy of ``w2-qwen2-f32.reference`` whose model.safetensors is re-saved by
    safetensors after ``change(tensors)``."""
    from safetensors.torch import load_file, save_file

    out = copy_checkpoint(fixtures_root / "w2-qwen2-f32.reference", tmp_path / "damaged")
    f = out / "model.safetensors"
    tensors = load_file(str(f))
    change(tensors)
    save_file(tensors, str(f), metadata={"format": "pt"})
    return out


def test_a_damaged_copy_names_the_changed_tensor(fixtures_root, tmp_path):
    name = "model.layers.1.mlp.down_proj.weight"

    def bump(t):
        t[name] = t[name].clone()
        t[name][3, 5] += 0.25

    out = _damaged(fixtures_root, tmp_path, bump)
    ref = fixtures_root / "w2-qwen2-f32.reference"
    code, d = diff_json(ref, out)
    assert code == 1
    bad = [t for t in d["tensors"] if t["status"] != "identical"]
    assert [t["name"] for t in bad] == [name]
    assert bad[0]["differing"] == 1 and bad[0]["max_abs"] == pytest.approx(0.25, rel=1e-5)
    assert d["largest"] == [name]
    r = run(ref, out)
    assert r.returncode == 1 and name in r.stdout and "1 of" in r.stdout
    # within a tolerance it is close, exit 0
    code, d = diff_json(ref, out, "--atol", "0.3")
    assert code == 0 and by_name(d)[name]["status"] == "close"
    # the sharded run against the damaged copy names it too
    code, d = diff_json(fixtures_root / "w2-qwen2-f32", out)
    assert code == 1 and [t["name"] for t in d["tensors"] if t["status"] != "identical"] == [name]


def test_missing_cast_and_reshaped_tensors(fixtures_root, tmp_path):
    gone, cast, shaped = ("model.layers.0.mlp.up_proj.weight", "model.norm.weight",
                          "model.layers.1.self_attn.o_proj.weight")

    def damage(t):
        import torch

        del t[gone]
        t[cast] = t[cast].to(torch.bfloat16)
        t[shaped] = t[shaped].reshape(-1).contiguous()

    out = _damaged(fixtures_root, tmp_path, damage)
    code, d = diff_json(fixtures_root / "w2-qwen2-f32.reference", out)
    t = by_name(d)
    assert code == 1
    assert t[gone]["status"] == "only_a" and t[gone]["shape_b"] is None
    assert t[cast]["status"] == "dtype" and (t[cast]["dtype_a"], t[cast]["dtype_b"]) == (
        "F32", "BF16")
    assert t[cast]["cosine"] > 0.99
    assert t[shaped]["status"] == "shape"
    assert d["counts"]["only_a"] == 1 and d["counts"]["shape"] == 1 and d["counts"]["dtype"] == 1
    r = run(fixtures_root / "w2-qwen2-f32.reference", out)
    assert r.returncode == 1 and "only a" in r.stdout and gone in r.stdout


def test_a_megatron_run_against_its_hugging_face_reference(megatron_root):
    fam = megatron_root / "llama"
    code, d = diff_json(fam / "tp2_pp1" / "torch_dist", fam / "reference")
    assert code == 0 and d["format_a"] == "megatron-dist"
    assert any(n.endswith("self_attn.q_proj.weight") for n in by_name(d))


def test_bad_inputs_exit_3_and_bad_options_exit_2(fixtures_root, tmp_path):
    r = run(tmp_path / "nothing", fixtures_root / "w2-qwen2-f32.reference")
    # a missing path is a usage error, as for inspect/merge/verify
    assert r.returncode == 2 and "no such file" in r.stderr and "Traceback" not in r.stderr
    (tmp_path / "empty").mkdir()
    r = run(tmp_path / "empty", fixtures_root / "w2-qwen2-f32.reference")
    assert r.returncode == 3 and "Traceback" not in r.stderr
    r = run(fixtures_root / "w2-qwen2-f32", fixtures_root / "w2-qwen2-f32.reference",
            "--atol", "-1")
    assert r.returncode == 2


def test_cancel_between_tensors_stops_with_exit_130(fixtures_root):
    import threading

    from shardscope.core import MergeCancelled
    from shardscope.core.diff import diff_checkpoints

    cancel, seen = threading.Event(), []

    def progress(done, total, name):
        seen.append(name)
        cancel.set()  # as Ctrl-C does from the front end

    ref = fixtures_root / "w2-qwen2-f32.reference"
    with pytest.raises(MergeCancelled) as e:
        diff_checkpoints(str(fixtures_root / "w2-qwen2-f32"), str(ref), on_progress=progress,
                         cancel=cancel)
    assert e.value.exit_code == 130 and len(seen) == 1


def test_a_bf16_merge_against_its_fp32_source(fixtures_root, tmp_path):
    from shardscope.core import MergeOptions, detect, plan_merge, run_merge

    src = fixtures_root / "w2-qwen2-f32"
    run_merge(plan_merge(detect(src), MergeOptions(output=str(tmp_path / "m"), dtype="bf16",
                                                   workers=1)))
    code, d = diff_json(src, tmp_path / "m")
    assert code == 1 and d["counts"]["dtype"] == len(d["tensors"])
    assert all(t["dtype_b"] == "BF16" and t["cosine"] > 0.999 for t in d["tensors"])
    code, d = diff_json(src, tmp_path / "m", "--dtype", "bf16")
    assert code == 0 and d["counts"]["identical"] == len(d["tensors"])


# -- the other bullets, each against main's diff (issue 17) --------------------------

from test_deepspeed import ds_root  # noqa: E402,F401 - the DeepSpeed fixture, shared


def test_a_deepspeed_run_and_a_dcp_run_against_their_references(ds_root, fixtures_root):
    """Pairings of other formats: DeepSpeed ZeRO-2 (fp32 master weights from the optimizer
    partitions) and a DCP folder (no config) against save_pretrained folders."""
    code, d = diff_json(ds_root / "ds-z2-w2", ds_root / "ds-z2-w2.reference")
    assert code == 0 and d["format_a"] == "deepspeed" and d["same"]
    assert d["counts"]["identical"] == len(d["tensors"]) > 10
    code, d = diff_json(fixtures_root / "w2-dcp", fixtures_root / "w2-dcp.reference")
    assert code == 0 and d["format_a"] == "dcp"
    assert d["counts"]["identical"] == len(d["tensors"]) > 10
    # DeepSpeed against an FSDP run of another model: exit 1, every name reported once
    code, d = diff_json(ds_root / "ds-z2-w2", fixtures_root / "w2-dcp.reference")
    assert code == 1
    names = [t["name"] for t in d["tensors"]]
    assert len(names) == len(set(names))


def test_rtol_is_relative_to_a(fixtures_root, tmp_path):
    """--rtol as torch.isclose: |B-A| <= atol + rtol*|A| elementwise."""
    name = "model.layers.0.self_attn.k_proj.weight"

    def scale(t):
        t[name] = t[name] * 1.001  # every element moved by 0.1 % of itself

    out = _damaged(fixtures_root, tmp_path, scale)
    ref = fixtures_root / "w2-qwen2-f32.reference"
    code, d = diff_json(ref, out, "--rtol", "1e-2")
    assert code == 0 and by_name(d)[name]["status"] == "close" and d["rtol"] == 0.01
    code, d = diff_json(ref, out, "--rtol", "1e-4")
    t = by_name(d)[name]
    assert code == 1 and t["status"] == "changed"
    assert t["rel_change"] == pytest.approx(1e-3, rel=1e-2)
    assert t["differing"] > 0.9 * t["shape_a"][0] * t["shape_a"][1]  # few zeros


def test_identical_tensors_are_compared_as_stored_bits_without_decoding(fixtures_root,
                                                                         monkeypatch):
    """A sharded run against its reference: no tensor is decoded through torch
    (read_output_tensor is only for tensors whose bits differ); the one changed tensor of a
    damaged copy is the only one decoded."""
    import shardscope.core.read
    from shardscope import core
    from shardscope.core.diff import diff_checkpoints

    decoded = []
    real = core.read.read_output_tensor

    def spy(t, sources):
        decoded.append(t.name)
        return real(t, sources)

    monkeypatch.setattr(core.read, "read_output_tensor", spy)
    r = diff_checkpoints(str(fixtures_root / "w2-qwen2-f32"),
                         str(fixtures_root / "w2-qwen2-f32.reference"))
    assert r.same and decoded == []
    assert all(t.norm_a is not None and t.norm_a > 0 for t in r.tensors)  # per-layer sums


def test_ctrl_c_in_the_command_exits_130(fixtures_root, monkeypatch, capsys):
    """Ctrl-C (KeyboardInterrupt) during the comparison: one line, exit 130, no output."""
    import shardscope.core.diff
    from shardscope import core
    from shardscope.tui.cli import main

    seen = []
    real = core.diff._compare

    def interrupted(name, *args):
        seen.append(name)
        if len(seen) == 3:
            raise KeyboardInterrupt
        return real(name, *args)

    monkeypatch.setattr(core.diff, "_compare", interrupted)
    code = main(["diff", str(fixtures_root / "w2-qwen2-f32"),
                 str(fixtures_root / "w2-qwen2-f32.reference"), "--json"])
    out, err = capsys.readouterr()
    assert code == 130 and "interrupted" in err and out == "" and len(seen) == 3


def test_bin_folders_pt_files_and_float8_sides(formats_root, tmp_path, capsys):
    """Sides of the kinds issue 17 lists beside the sharded ones: a sharded ``.bin`` folder and a
    single ``.pt`` state dict (read by the restricted reader) against save_pretrained's folder;
    a float8 FSDP2 run against its DCP save (extra buffers its model class lacks are reported
    as such: a diff writes nothing, so never '--no-strict, written anyway'); a changed tensor
    in a safetensors copy is named against the ``.bin`` folder."""
    import shutil

    from safetensors.torch import load_file, save_file

    from shardscope.tui.cli import main

    def diff_json(*args):  # in this process: transformers is imported once for all five
        code = main(["diff", *map(str, args), "--json"])
        assert code in (0, 1), capsys.readouterr().err
        return code, json.loads(capsys.readouterr().out)

    ref = formats_root / "bin.reference"
    code, d = diff_json(formats_root / "bin-sharded", ref)
    assert code == 0 and d["format_a"] == "hf-bin" and d["format_b"] == "hf"
    assert d["counts"]["identical"] == len(d["tensors"]) > 20
    code, d = diff_json(formats_root / "pt-single" / "model.pt", formats_root / "bin-single",
                        "--hf-config", formats_root / "bin-single")
    assert code == 0 and d["format_a"] == d["format_b"] == "hf-bin" and d["same"]
    code, d = diff_json(formats_root / "fp8-fsdp2", formats_root / "fp8-dcp",
                        "--hf-config", formats_root / "fp8.reference")
    assert code == 0 and d["same"] and d["format_b"] == "dcp"
    assert any(t["dtype_a"].startswith("F8") for t in d["tensors"]), d["tensors"][:3]
    assert d["warnings"] and not [w for w in d["warnings"] if "written anyway" in w]
    assert any("extra" in w for w in d["warnings"])

    bad = tmp_path / "bad"
    shutil.copytree(ref, bad)
    t = load_file(bad / "model.safetensors")
    name = "model.layers.1.mlp.down_proj.weight"
    t[name] = t[name].clone()
    t[name][0, 0] += 1
    save_file(t, str(bad / "model.safetensors"), metadata={"format": "pt"})
    code, d = diff_json(formats_root / "bin-sharded", bad)
    assert code == 1 and [x["name"] for x in d["tensors"] if x["status"] != "identical"] == [name]


def test_a_nan_that_appears_is_said_never_a_change_of_zero(fixtures_root, tmp_path):
    """A NaN in B (trial A2): not "changed, max |B-A| 0, rel 0, cosine 1"; the NaN counts that
    differ are said in the table, the JSON and the layer chart, and a NaN beside a real change
    (1e6) does not leave that change's size reported as the whole."""
    norm, mlp = "model.norm.weight", "model.layers.1.mlp.down_proj.weight"

    def nan(t):
        t[norm] = t[norm].clone()
        t[norm][3] = float("nan")
        t[mlp] = t[mlp].clone()
        t[mlp][0, 0] = float("nan")
        t[mlp][1, 1] = 1e6

    out = _damaged(fixtures_root, tmp_path, nan)
    ref = fixtures_root / "w2-qwen2-f32.reference"
    code, d = diff_json(ref, out)
    assert code == 1
    t = by_name(d)
    for name in (norm, mlp):
        assert t[name]["status"] == "changed" and t[name]["nan_mismatch"] == 1
        assert (t[name]["nan_a"], t[name]["nan_b"]) == (0, 1)
        assert t[name]["nonfinite"] == "+1 NaN"
        assert t[name]["max_abs"] == t[name]["rel_change"] == t[name]["cosine"] == "nan"
    assert set(d["largest"][:2]) == {mlp, norm}  # first: a NaN has no size, never small
    layers = {lay["layer"]: lay for lay in d["layers"]}
    assert layers["model.layers.1"]["nonfinite"] == 1
    assert layers["model.layers.1"]["rel_change"] == "nan"
    assert layers["model.layers.0"]["rel_change"] == 0.0
    # NaN and A alike (A's NaN gone in B)
    code, d = diff_json(out, ref)
    assert by_name(d)[norm]["nonfinite"] == "-1 NaN"
    r = run(ref, out)
    assert r.returncode == 1, r.stderr
    row = next(line for line in r.stdout.splitlines() if line.split("│")[1:2]
               and line.split("│")[1].strip() == norm)
    cells = [c.strip() for c in row.split("│")[1:-1]]
    assert cells == [norm, "changed", "nan", "nan", "nan", "1/64", "+1 NaN"], cells
    layer1 = next(line for line in r.stdout.splitlines() if "model.layers.1 " in line)
    assert "nan" in layer1 and "NaN/Inf in 1 tensor(s)" in layer1
    assert "2 of them in NaN/Inf" in r.stdout.splitlines()[-1]


def test_an_inf_that_appears_is_said(fixtures_root, tmp_path):
    norm = "model.norm.weight"

    def inf(t):
        t[norm] = t[norm].clone()
        t[norm][0] = float("inf")
        t[norm][1] = float("-inf")

    out = _damaged(fixtures_root, tmp_path, inf)
    code, d = diff_json(fixtures_root / "w2-qwen2-f32.reference", out)
    t = by_name(d)[norm]
    assert code == 1 and t["inf_mismatch"] == 2 and t["nonfinite"] == "+2 Inf"
    assert t["max_abs"] == "nan"
    # an Inf on both sides at the same place is equal: not a change, and no nan statistics
    code, d = diff_json(out, out)
    assert code == 0 and by_name(d)[norm]["status"] == "identical"


def _flip_dcp_chunk(ck):
    """Flip a byte in the middle of the largest DCP chunk's data; its tensor's name."""
    from shardscope.core import detect

    layout = detect(ck)
    name, t = max(layout.tensors.items(), key=lambda kv: kv[1].pieces[0].nbytes)
    located = layout.resolve_piece(t.pieces[0])
    with open(located.file, "r+b") as fh:
        pos = located.byte_offset + located.nbytes // 2
        fh.seek(pos)
        b = fh.read(1)
        fh.seek(pos)
        fh.write(bytes([b[0] ^ 0x5A]))
    return name, located.file


def test_a_corrupt_rank_file_is_refused_by_its_crc_not_shown_as_a_change(fixtures_root,
                                                                         tmp_path):
    """Trial A6: diff and verify --reference check the CRC-32 of torch.save records, as
    merge does: a flipped byte is corruption naming the file and the record (exit 3), not a
    change from training; --no-crc compares the bytes as they are."""
    from conftest import flip_largest_storage

    ck = copy_checkpoint(fixtures_root / "w2-qwen2-f32", tmp_path / "flip")
    f = ck / "model_world_size_2_rank_1.pt"
    flip_largest_storage(f)
    ref = fixtures_root / "w2-qwen2-f32.reference"
    for args in ((ck, ref), (ref, ck)):
        r = run(*args)
        assert r.returncode == 3 and r.stdout == "", (r.stdout, r.stderr)
        assert r.stderr.count("\n") == 1 and str(f) in r.stderr, r.stderr
        assert "storage record" in r.stderr and "fails its CRC-32" in r.stderr
        assert "not compared (--no-crc" in r.stderr
    r = run(ck, ref, "--no-crc")
    assert r.returncode == 1 and "different: 1 of" in r.stdout, r.stdout
    r = run_cli("verify", ref, "--reference", ck)
    assert r.returncode == 3 and str(f) in r.stderr and "fails its CRC-32" in r.stderr, \
        (r.stdout, r.stderr)
    assert "differ" not in r.stdout
    r = run_cli("verify", ref, "--reference", ck, "--no-crc")
    assert r.returncode == 1 and "not ok" in r.stdout
    # a DCP chunk (a torch.save archive inside a .distcp file) too
    dcp = copy_checkpoint(fixtures_root / "w2-dcp", tmp_path / "dcp")
    name, f = _flip_dcp_chunk(dcp)
    r = run(dcp, fixtures_root / "w2-dcp.reference")
    assert r.returncode == 3 and f in r.stderr and name in r.stderr, r.stderr
    r = run_cli("verify", fixtures_root / "w2-dcp.reference", "--reference", dcp)
    assert r.returncode == 3 and f in r.stderr and "fails its CRC-32" in r.stderr, r.stderr
    # an intact pair is not refused
    r = run_cli("verify", fixtures_root / "w2-dcp.reference", "--reference",
                fixtures_root / "w2-dcp")
    assert r.returncode == 0, (r.stdout, r.stderr)


def test_verdicts_under_tolerances_say_within_and_read_as_the_counts(fixtures_root, tmp_path):
    """Trial C10: diff's "27 close" then "identical within atol" and verify's bare "ok" after
    --atol read as bit for bit; the verdicts say "close within atol=... rtol=..." (diff, with
    how many are close and how many identical) and "within atol=... rtol=..." (verify)."""
    from shardscope.core import MergeOptions, detect, plan_merge, run_merge

    src, ref = fixtures_root / "w2-qwen2-f32", fixtures_root / "w2-qwen2-f32.reference"
    m = tmp_path / "m"
    run_merge(plan_merge(detect(src), MergeOptions(output=str(m), dtype="bf16", workers=1)))
    r = run(src, m, "--atol", "1e-2")
    lines = r.stdout.strip().splitlines()
    n = len(detect(ref).tensors)
    assert r.returncode == 0 and lines[2] == f"{n} close (of {n} tensors)", lines
    assert lines[-1] == (f"close within atol=0.01 rtol=0: every one of the {n} tensors "
                         f"({n} close, 0 identical bit for bit)"), lines
    # identical tensors under a tolerance are identical bit for bit, as the counts say
    r = run(src, ref, "--atol", "1e-2")
    assert r.stdout.strip().splitlines()[-1] == (
        f"identical bit for bit: every one of the {n} tensors"), r.stdout
    r = run_cli("verify", m, "--reference", ref, "--atol", "1e-2", "--rtol", "1e-3")
    lines = r.stdout.strip().splitlines()
    assert r.returncode == 0, r.stdout
    assert lines[0] == f"all tensors match {ref} within atol=0.01 rtol=0.001", lines
    assert lines[-1] == f"ok {m}: within atol=0.01 rtol=0.001 of {ref}", lines
    r = run_cli("verify", m, "--reference", m)
    assert r.stdout.strip().splitlines()[-1] == f"ok {m}", r.stdout


def test_a_refused_diff_json_prints_a_refusal_document(fixtures_root, tmp_path):
    """Trial C9: `diff --json` refused printed nothing on stdout; like `inspect --json` it
    prints one JSON document (refused, exit code, the error), for a usage error (a LoRA side
    without --lora, exit 2), a path that does not exist, and a corrupt record (exit 3)."""
    from conftest import flip_largest_storage

    ref = fixtures_root / "w2-qwen2-f32.reference"
    for args, code, kind in [((ref, fixtures_root / "w2-lora-qv"), 2, "usage"),
                             ((ref, tmp_path / "nothing"), 2, "usage")]:
        r = run(*args, "--json")
        assert r.returncode == code, r.stderr
        d = json.loads(r.stdout)
        assert d["refused"] is True and d["exit_code"] == code and d["same"] is None
        assert d["a"] == str(args[0]) and d["b"] == str(args[1]) and d["tensors"] == []
        (p,) = d["problems"]
        assert p["severity"] == "error" and p["message"] in r.stderr, (p, r.stderr)
    ck = copy_checkpoint(fixtures_root / "w2-qwen2-f32", tmp_path / "flip")
    f = ck / "model_world_size_2_rank_1.pt"
    flip_largest_storage(f)
    r = run(ck, ref, "--json")
    d = json.loads(r.stdout)
    assert r.returncode == 3 and d["refused"] and d["exit_code"] == 3
    assert d["problems"][0]["code"] == "checksum-mismatch"
    assert d["problems"][0]["path"] == str(f)
