"""``verify --reference`` compares config.json too, and ``merge --hf-config`` says when the
folder given differs from the checkpoint's own ``huggingface/`` config (trial A7), on the real
FSDP2 fixture ``w2-qwen2-f32`` and its ``save_pretrained`` reference."""

from __future__ import annotations

import json
import shutil

from conftest import copy_checkpoint, run_cli


def _edit_config(folder, change) -> None:
    p = folder / "config.json"
    cfg = json.loads(p.read_text())
    change(cfg)
    p.write_text(json.dumps(cfg, indent=2))


def _other_config(cfg):
    cfg["rms_norm_eps"] = 1e-3
    cfg.setdefault("rope_parameters", {})["rope_theta"] = 500000.0


def test_verify_reference_reports_a_differing_config_json(fixtures_root, tmp_path):
    ref = fixtures_root / "w2-qwen2-f32.reference"
    out = copy_checkpoint(ref, tmp_path / "out")
    _edit_config(out, _other_config)
    r = run_cli("verify", out, "--reference", ref)
    lines = r.stdout.strip().splitlines()
    assert r.returncode == 1, r.stdout + r.stderr
    assert lines[0] == f"all tensors match {ref} bit for bit", lines
    assert lines[1].startswith(f"config.json differs from {ref / 'config.json'} in 2 key(s)")
    assert "rms_norm_eps 0.001 vs 1e-06" in lines[1] and "rope_parameters.rope_theta" in lines[1]
    assert lines[-1] == (f"not ok {out}: config.json differs from {ref}'s (rms_norm_eps, "
                         "rope_parameters.rope_theta)"), lines
    # the same config (the training checkpoint's huggingface/ against its save_pretrained
    # reference): said, and ok
    r = run_cli("verify", ref, "--reference", fixtures_root / "w2-qwen2-f32")
    lines = r.stdout.strip().splitlines()
    assert r.returncode == 0 and lines[-1] == f"ok {ref}", lines
    assert f"config.json matches {fixtures_root / 'w2-qwen2-f32' / 'huggingface'}" in lines[-2]
    # bookkeeping keys (transformers_version, _name_or_path) are not the model
    _edit_config(out, lambda cfg: cfg.update(json.loads((ref / "config.json").read_text()),
                                             transformers_version="0.0.1",
                                             _name_or_path="elsewhere"))
    r = run_cli("verify", out, "--reference", ref)
    assert r.returncode == 0 and r.stdout.strip().splitlines()[-1] == f"ok {out}", r.stdout
    # a dtype the tensors are not stored in is a difference; one they are (merge --dtype
    # writes both) is the tensors' difference, judged by them
    key = "dtype" if "dtype" in json.loads((ref / "config.json").read_text()) else "torch_dtype"
    _edit_config(out, lambda cfg: cfg.update({key: "bfloat16"}))
    r = run_cli("verify", out, "--reference", ref)
    assert r.returncode == 1 and r.stdout.strip().splitlines()[-1].endswith(f"({key})")
    bf16 = tmp_path / "bf16"
    r = run_cli("merge", fixtures_root / "w2-qwen2-f32", "-o", bf16, "--dtype", "bf16")
    assert r.returncode == 0, r.stderr
    r = run_cli("verify", bf16, "--reference", ref, "--atol", "1e-2", "--rtol", "1e-2")
    lines = r.stdout.strip().splitlines()
    assert r.returncode == 0 and lines[-2] == (f"config.json matches {ref / 'config.json'} but "
                                               f'for {key} "bfloat16" vs "float32", as the '
                                               "tensors' dtypes"), lines
    _edit_config(out, lambda cfg: cfg.update({key: json.loads(
        (ref / "config.json").read_text())[key]}))
    # a tensor difference and a config difference: both in the verdict
    from safetensors.torch import load_file, save_file

    _edit_config(out, _other_config)
    sd = load_file(str(out / "model.safetensors"))
    sd["model.norm.weight"] = sd["model.norm.weight"] + 1
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    r = run_cli("verify", out, "--reference", ref)
    last = r.stdout.strip().splitlines()[-1]
    assert r.returncode == 1 and last == (
        f"not ok {out}: 1 tensor(s) differ from {ref} (1 values) and config.json differs "
        "(rms_norm_eps, rope_parameters.rope_theta)"), last


def test_merge_hf_config_warns_when_it_differs_from_the_checkpoints_own(fixtures_root,
                                                                         tmp_path):
    src = fixtures_root / "w2-qwen2-f32"
    alt = tmp_path / "alt"
    shutil.copytree(src / "huggingface", alt)
    r = run_cli("merge", src, "-o", tmp_path / "same", "--hf-config", alt)
    assert r.returncode == 0 and "warning" not in r.stderr, r.stderr
    _edit_config(alt, _other_config)
    r = run_cli("merge", src, "-o", tmp_path / "out", "--hf-config", alt)
    assert r.returncode == 0, r.stderr
    warned = [line for line in r.stderr.splitlines() if "--hf-config" in line]
    assert len(warned) == 1, r.stderr
    assert str(src / "huggingface" / "config.json") in warned[0]
    assert "2 key(s)" in warned[0] and "rms_norm_eps 0.001 vs 1e-06" in warned[0]
    assert "rope_parameters.rope_theta 500000.0 vs" in warned[0]
    assert "the output takes --hf-config's" in warned[0]
