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

from conftest import ROOT, _cache_root, cached, copy_checkpoint
from core import MergeOptions, detect, plan_merge, run_merge

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

    from core.sample import write_deepspeed

    key = hashlib.sha256(json.dumps(DS, sort_keys=True).encode()).hexdigest()[:8]

    def write(tmp: Path) -> None:
        for i, (name, (world, stage, dtype, tie)) in enumerate(DS.items()):
            write_deepspeed(tmp, world, name, stage, dtype, tie, seed=40 + i)

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
    code = ("import sys; from core import detect; detect(sys.argv[1]); "
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
    r = subprocess.run([sys.executable, "-m", "tui.cli", "merge", str(ck), "-o",
                        str(tmp_path / "out")], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 3 and not (tmp_path / "out").exists()


def test_module_weights_and_tag(ds_root, tmp_path):
    """--weights module: the bf16 weights as trained (stage 2), same as the master rounded."""
    src = ds_root / "ds-z2-w3-bf16"
    r = subprocess.run([sys.executable, "-m", "tui.cli", "merge", str(src), "--tag",
                        "global_step0", "--weights", "module", "-o", str(tmp_path / "o")],
                       cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    got = load_file(tmp_path / "o" / "model.safetensors")
    ref = load_file(ds_root / "ds-z2-w3-bf16.reference" / "model.safetensors")
    assert set(got) == set(ref)
    for k, v in ref.items():
        assert got[k].dtype == torch.bfloat16 and torch.equal(got[k], v.to(torch.bfloat16)), k
    r = subprocess.run([sys.executable, "-m", "tui.cli", "merge", str(ds_root / "ds-z3-w2-bf16"),
                        "--weights", "module", "-o", str(tmp_path / "o3")],
                       cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 3 and "stage 3 keeps no module weights" in r.stderr
