"""The command line on real checkpoints: inspect output, merge exit codes, verl flags, verify."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import ROOT, copy_checkpoint, run_cli
from shardscope.tui.cli import main


def run(*args: str) -> subprocess.CompletedProcess:
    return run_cli(*args, cwd=ROOT)  # in this process (conftest.run_cli)


def inspect_json(path) -> dict:
    r = run("inspect", str(path), "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.mark.parametrize("name,fmt,world,mesh,names,par", [
    ("w4-hsdp", "fsdp", 4, [2, 2], ["ddp", "fsdp"], {"dp": 2, "fsdp": 2}),
    ("w4-hsdp-other-names", "fsdp", 4, [2, 2], ["replicate", "shard"], {"dp": 2, "fsdp": 2}),
    ("w3-unnamed-bf16-tied", "fsdp", 3, [3], None, {"dp": 1, "fsdp": 3}),
    ("w2-fsdp1", "fsdp", 2, [], None, {"fsdp": 2}),
    ("w1-fsdp1", "fsdp", 1, [], None, {"fsdp": 1}),
    ("w2-dcp", "dcp", 2, [], None, {"fsdp": 2}),
    ("w2-dcp-accelerate", "dcp", 2, [], None, {"fsdp": 2}),
    ("w2-accelerate-rank", "fsdp", 2, [2], ["fsdp"], {"fsdp": 2}),
    ("w3-dcp-hf", "dcp-hf", 3, [], None, {"fsdp": 3}),
])
def test_inspect_json(fixtures_root, name, fmt, world, mesh, names, par):
    d = inspect_json(fixtures_root / name)
    assert d["format"] == fmt and d["world_size"] == world
    assert d["mesh"] == {"shape": mesh, "dim_names": names}
    for k, v in par.items():
        assert d["parallel"][k] == v
    assert set(d["parallel"]) >= {"dp", "fsdp", "tp", "pp", "ep"}
    assert d["problems"] == []
    from safetensors import safe_open

    with safe_open(str(fixtures_root / f"{name}.reference" / "model.safetensors"), "pt") as s:
        ref = {k: s.get_slice(k) for k in s.keys()}
    assert d["parameters"] >= sum(int(__import__("math").prod(v.get_shape())) for v in ref.values())
    assert all(sh["status"] == "ok" and sh["bytes"] > 0 for sh in d["shards"])
    assert len(d["shards"]) == world


def test_inspect_reads_no_tensor_data_and_imports_no_torch(fixtures_root):
    code = ("import sys, io, contextlib; from shardscope.tui.cli import main; "
            "buf = io.StringIO()\n"
            "with contextlib.redirect_stdout(buf): rc = main(['inspect', sys.argv[1], '--json'])\n"
            "assert rc == 0; assert 'torch' not in sys.modules, 'torch imported'; print('ok')")
    r = subprocess.run([sys.executable, "-c", code, str(fixtures_root / "w4-hsdp")], cwd=ROOT,
                       capture_output=True, text=True)
    assert r.stdout.strip() == "ok", r.stderr


def test_inspect_text_and_missing_config_note(fixtures_root):
    r = run("inspect", str(fixtures_root / "w2-no-fsdp-config"))
    assert r.returncode == 0
    assert "world size 2 taken from the file names" in r.stdout
    assert "no problems found" in r.stdout


def test_merge_cli_and_existing_output(fixtures_root, tmp_path):
    out = tmp_path / "merged"
    r = run("merge", str(fixtures_root / "w2-qwen2-f32"), "-o", str(out))
    assert r.returncode == 0, r.stderr
    assert "wrote" in r.stdout and (out / "model.safetensors").is_file()
    r = run("merge", str(fixtures_root / "w2-qwen2-f32"), "-o", str(out))
    assert r.returncode == 2
    assert r.stderr.strip() == f"shardscope: {out}: exists; pass --overwrite to replace it"
    r = run("merge", str(fixtures_root / "w2-qwen2-f32"), "-o", str(out), "--overwrite")
    assert r.returncode == 0, r.stderr
    r = run("verify", str(out), "--reference", str(fixtures_root / "w2-qwen2-f32.reference"))
    assert r.returncode == 0 and "all tensors match" in r.stdout, r.stdout + r.stderr


def test_verify_reports_a_different_reference(fixtures_root, tmp_path):
    out = tmp_path / "merged"
    assert main(["merge", str(fixtures_root / "w2-qwen2-f32"), "-o", str(out), "-q"]) == 0
    r = run("verify", str(out), "--reference", str(fixtures_root / "w4-fsdp2.reference"))
    assert r.returncode == 1
    assert "values" in r.stdout


def test_verl_flags(fixtures_root, tmp_path):
    out = tmp_path / "verl_out"
    r = run("merge", "--backend", "fsdp", "--local_dir", str(fixtures_root / "w3-llama-f32"),
            "--target_dir", str(out), "--tie-word-embedding", "--trust-remote-code")
    assert r.returncode == 0, r.stderr
    assert (out / "config.json").is_file()
    r = run("merge", "--help")
    assert "--local_dir" in r.stdout or "verl" in r.stdout


def test_bad_input_one_line_errors(tmp_path):
    r = run("inspect", str(tmp_path / "nope"))  # a missing path is a usage error (issue 16)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
    (tmp_path / "empty").mkdir()
    r = run("merge", str(tmp_path / "empty"), "-o", str(tmp_path / "o"))
    assert r.returncode == 3 and "not a checkpoint" in r.stderr and "Traceback" not in r.stderr
    r = run("merge", "--dtype", "int3", str(tmp_path), "-o", "x")
    assert r.returncode == 2


def test_dcp_without_config_refuses_unless_not_strict(fixtures_root, tmp_path):
    out = tmp_path / "o"
    r = run("merge", str(fixtures_root / "w2-dcp"), "-o", str(out))
    assert r.returncode == 3 and r.stderr.count("\n") == 1 and not out.exists()
    assert "no config.json" in r.stderr and "--hf-config" in r.stderr
    r = run("merge", str(fixtures_root / "w2-dcp"), "-o", str(out), "--no-strict")
    assert r.returncode == 0
    assert "no Hugging Face config found" in r.stderr
    assert (out / "model.safetensors").is_file() and not (out / "config.json").exists()


def test_sample_command_writes_a_real_fsdp2_checkpoint(tmp_path):
    (tmp_path / "ref").mkdir()  # an empty folder is fine: the reference takes its place
    r = run("sample", str(tmp_path / "ck"), "--reference", str(tmp_path / "ref"))
    assert r.returncode == 0, r.stderr
    # the last line: with deepspeed installed, the spawned ranks' import of it logs a line too
    assert r.stdout.splitlines()[-1] == (
        f"wrote a 2-rank FSDP2 checkpoint of a tiny Qwen2 model to {tmp_path}/ck "
        f"and its unsharded reference to {tmp_path}/ref")
    assert (tmp_path / "ref" / "config.json").is_file()
    d = inspect_json(tmp_path / "ck")
    assert d["format"] == "fsdp" and d["world_size"] == 2 and d["mesh"]["dim_names"] == ["fsdp"]
    r = run("merge", str(tmp_path / "ck"), "-o", str(tmp_path / "m"))
    assert r.returncode == 0
    r = run("verify", str(tmp_path / "m"), "--reference", str(tmp_path / "ref"))
    assert r.returncode == 0, r.stdout


def test_output_that_would_hold_the_source_is_refused(fixtures_root, tmp_path):
    parent = tmp_path / "parent"
    ck = copy_checkpoint(fixtures_root / "w2-qwen2-f32", parent / "ck")
    r = run("merge", str(ck), "-o", str(parent), "--overwrite")
    assert r.returncode == 2 and "contain the checkpoint" in r.stderr
    assert (ck / "model_world_size_2_rank_0.pt").is_file()
    r = run("merge", str(ck), "-o", str(ck / "inside"))
    assert r.returncode == 2 and not (ck / "inside").exists()


def test_overwrite_refuses_a_folder_that_is_not_a_model(fixtures_root, tmp_path):
    user = tmp_path / "userdir"
    user.mkdir()
    (user / "notes.txt").write_text("keep me")
    r = run("merge", str(fixtures_root / "w2-qwen2-f32"), "-o", str(user), "--overwrite")
    assert r.returncode == 2 and "does not look like a model folder" in r.stderr
    assert (user / "notes.txt").read_text() == "keep me"


def test_cast_updates_config_dtype_and_loads_in_it(fixtures_root, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "o"
    assert main(["merge", str(fixtures_root / "w2-qwen2-f32"), "-o", str(out), "--dtype", "bf16",
                 "-q"]) == 0
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.dtype == torch.bfloat16
    ids = AutoTokenizer.from_pretrained(out)("the quick brown fox", return_tensors="pt")
    assert ids["input_ids"].numel() > 0
    model(**ids)
    r = run("verify", str(out), "--reference", str(fixtures_root / "w2-qwen2-f32.reference"),
            "--atol", "0.01", "--rtol", "0.01")
    assert r.returncode == 0, r.stdout


def test_verify_on_a_non_model_folder_is_a_bad_input(tmp_path):
    r = run("verify", str(tmp_path))
    assert r.returncode == 3 and "no model.safetensors" in r.stderr
