"""Damaged real checkpoints: problems are reported with a code and the file, merges refuse
(exit 3) and leave nothing at the output; crafted pickles never run."""

from __future__ import annotations

import io
import json
import os
import pickle
import subprocess
import sys
import threading
import zipfile
from pathlib import Path

import pytest

from conftest import ROOT, copy_checkpoint
from core import MergeCancelled, MergeOptions, detect, plan_merge, run_merge


def codes(layout):
    return {(p.code, Path(p.path).name if p.path else None) for p in layout.problems}


def merge_cli(src, out):
    return subprocess.run([sys.executable, "-m", "tui.cli", "merge", str(src), "-o", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)


@pytest.fixture
def w3(fixtures_root, tmp_path):
    return copy_checkpoint(fixtures_root / "w3-llama-f32", tmp_path / "ck")


def test_missing_rank(w3, tmp_path):
    os.remove(w3 / "model_world_size_3_rank_1.pt")
    assert ("missing-rank", "model_world_size_3_rank_1.pt") in codes(detect(w3))
    r = merge_cli(w3, tmp_path / "out")
    assert r.returncode == 3 and "rank 1 of 3 is missing" in r.stderr
    assert not (tmp_path / "out").exists()


def test_truncated_rank_file(w3, tmp_path):
    f = w3 / "model_world_size_3_rank_2.pt"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    layout = detect(w3)
    assert {c for c, n in codes(layout) if n == f.name} & {"truncated-file", "unreadable-file"}
    assert [s.status for s in layout.files if s.rank == 2] == ["unreadable"]
    r = merge_cli(w3, tmp_path / "out")
    assert r.returncode == 3 and f.name in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "out").exists()


def test_world_size_mismatch_in_fsdp_config(w3):
    (w3 / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2, "world_size": 4}))
    assert ("world-size-mismatch", "fsdp_config.json") in codes(detect(w3))


def test_mixed_world_sizes(w3, fixtures_root):
    import shutil

    shutil.copy(fixtures_root / "w2-qwen2-f32" / "model_world_size_2_rank_0.pt", w3)
    assert ("mixed-world-size", "ck") in codes(detect(w3))


def test_dcp_missing_distcp(fixtures_root, tmp_path):
    ck = copy_checkpoint(fixtures_root / "w3-dcp", tmp_path / "ck")
    os.remove(ck / "__1_0.distcp")
    assert ("missing-file", "__1_0.distcp") in codes(detect(ck))
    r = merge_cli(ck, tmp_path / "out")
    assert r.returncode == 3 and not (tmp_path / "out").exists()


def test_dcp_truncated_distcp(fixtures_root, tmp_path):
    ck = copy_checkpoint(fixtures_root / "w3-dcp", tmp_path / "ck")
    f = ck / "__2_0.distcp"
    f.write_bytes(f.read_bytes()[:1000])
    assert ("truncated-file", "__2_0.distcp") in codes(detect(ck))


def test_crafted_pickle_is_refused_and_never_runs(w3, tmp_path):
    """A rank file whose pickle would run a shell command on an unrestricted load."""
    marker = tmp_path / "pwned"
    f = w3 / "model_world_size_3_rank_0.pt"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    src = zipfile.ZipFile(f)
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:
        for info in src.infolist():
            data = src.read(info)
            if info.filename.endswith("data.pkl"):
                data = pickle.dumps({"model.embed_tokens.weight": Evil()}, protocol=2)
            z.writestr(info, data)
    f.write_bytes(buf.getvalue())
    layout = detect(w3)
    assert ("unsafe-pickle", f.name) in codes(layout)
    msg = [p.message for p in layout.problems if p.code == "unsafe-pickle"][0]
    assert "system" in msg
    r = merge_cli(w3, tmp_path / "out")
    assert r.returncode == 3 and "refusing" in r.stderr
    assert not marker.exists()
    assert not (tmp_path / "out").exists()


def test_cancel_leaves_nothing(fixtures_root, tmp_path):
    out = tmp_path / "out"
    cancel = threading.Event()
    plan = plan_merge(detect(fixtures_root / "w4-fsdp2"), MergeOptions(str(out), workers=1))

    def on_progress(ev):
        if ev.tensors_done >= 3:
            cancel.set()

    with pytest.raises(MergeCancelled):
        run_merge(plan, on_progress=on_progress, cancel=cancel)
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]


def test_source_is_never_modified(fixtures_root, tmp_path):
    import hashlib

    src = fixtures_root / "w2-qwen2-f32"
    before = {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
              for p in src.rglob("*") if p.is_file()}
    run_merge(plan_merge(detect(src), MergeOptions(str(tmp_path / "o"))))
    after = {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
             for p in src.rglob("*") if p.is_file()}
    assert before == after
