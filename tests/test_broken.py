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

from conftest import ROOT, copy_checkpoint, run_cli
from shardscope.core import MergeCancelled, MergeOptions, detect, plan_merge, run_merge


def codes(layout):
    return {(p.code, Path(p.path).name if p.path else None) for p in layout.problems}


def merge_cli(src, out):
    return run_cli("merge", src, "-o", out, cwd=ROOT)  # in this process (conftest.run_cli)


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


def _resave(path: Path, edit) -> None:
    """Load a real rank file (DTensors load without a process group), edit its state dict,
    save it back with torch.save."""
    import torch
    import torch.distributed.tensor  # noqa: F401 - lets weights_only load DTensors

    sd = torch.load(path, weights_only=True)
    edit(sd)
    torch.save(sd, path)


def test_ranks_with_different_key_sets(w3):
    f = w3 / "model_world_size_3_rank_1.pt"
    _resave(f, lambda sd: sd.pop("model.norm.weight"))
    assert ("key-mismatch", f.name) in codes(detect(w3))


def test_ranks_that_disagree_on_a_placement(w3):
    f = w3 / "model_world_size_3_rank_2.pt"
    key = "model.layers.0.mlp.up_proj.weight"
    _resave(f, lambda sd: sd.__setitem__(key, sd[key]._local_tensor.clone()))
    assert ("rank-disagreement", f.name) in codes(detect(w3))


def _edit_dcp_metadata(ck: Path, edit) -> None:
    import pickle

    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(str(ck)).read_metadata()
    edit(meta)
    with open(ck / ".metadata", "wb") as f:
        pickle.dump(meta, f)


def test_dcp_chunks_that_overlap_or_leave_a_gap(fixtures_root, tmp_path):
    import dataclasses

    key = "model.layers.1.self_attn.o_proj.weight"
    ck = copy_checkpoint(fixtures_root / "w3-dcp", tmp_path / "a")

    def overlap(meta):
        chunks = meta.state_dict_metadata[key].chunks
        c0 = chunks[0]
        chunks[0] = dataclasses.replace(c0, sizes=type(c0.sizes)([c0.sizes[0] + 1, *c0.sizes[1:]]))

    _edit_dcp_metadata(ck, overlap)
    assert ("coverage-overlap", "__1_0.distcp") in codes(detect(ck))
    ck = copy_checkpoint(fixtures_root / "w3-dcp", tmp_path / "b")
    _edit_dcp_metadata(ck, lambda meta: meta.state_dict_metadata[key].chunks.pop(1))
    layout = detect(ck)
    assert "coverage-gap" in {c for c, _ in codes(layout)}
    r = merge_cli(ck, tmp_path / "out")
    assert r.returncode == 3 and "pieces hold" in r.stderr
    assert not (tmp_path / "out").exists()


def test_config_that_disagrees_with_the_weights(w3):
    cfg_path = w3 / "huggingface" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["vocab_size"] += 5
    cfg["num_hidden_layers"] = 3
    cfg_path.write_text(json.dumps(cfg))
    found = [p for p in detect(w3).problems if p.code == "config-mismatch"]
    assert {Path(p.path).name for p in found} == {"config.json"}
    text = " ".join(p.message for p in found)
    assert "vocab_size 336" in text and "num_hidden_layers 3" in text


def test_duplicate_key_across_output_shards(fixtures_root, tmp_path):
    from safetensors.torch import load_file, save_file

    out = tmp_path / "o"
    run_merge(plan_merge(detect(fixtures_root / "w4-fsdp2"),
                         MergeOptions(str(out), max_shard_size="150KB")))
    shards = sorted(out.glob("model-*.safetensors"))
    first, last = load_file(shards[0]), load_file(shards[-1])
    k = next(iter(first))
    last[k] = first[k]
    save_file(last, shards[-1], metadata={"format": "pt"})
    layout = detect(out)
    assert ("duplicate-key", shards[-1].name) in codes(layout)
    r = subprocess.run([sys.executable, "-m", "shardscope.tui.cli", "verify", str(out)], cwd=ROOT,
                       capture_output=True, text=True)
    assert r.returncode == 1 and "duplicate-key" in r.stdout


def test_deep_finds_flipped_bytes_in_tensor_data(w3):
    from conftest import flip_largest_storage

    f = w3 / "model_world_size_3_rank_1.pt"
    flip_largest_storage(f)
    assert not detect(w3).problems  # metadata only: the data is not read
    r = subprocess.run([sys.executable, "-m", "shardscope.tui.cli", "inspect", str(w3), "--deep",
                        "--json"],
                       cwd=ROOT, capture_output=True, text=True)
    probs = json.loads(r.stdout)["problems"]
    assert [(p["code"], Path(p["path"]).name) for p in probs] == [("checksum-mismatch", f.name)]


def test_deep_counts_nan_and_inf(fixtures_root, tmp_path):
    from shardscope.core.formats.safetensors_file import read_header

    ref = copy_checkpoint(fixtures_root / "w2-qwen2-f32.reference", tmp_path / "ref")
    entries, _ = read_header(str(ref / "model.safetensors"))
    e = next(x for x in entries if x.name == "model.norm.weight")
    with open(ref / "model.safetensors", "r+b") as fh:
        fh.seek(e.byte_offset)
        fh.write(bytes.fromhex("0000c07f") * 3 + bytes.fromhex("0000807f"))  # 3 NaN, 1 +Inf
    r = subprocess.run([sys.executable, "-m", "shardscope.tui.cli", "inspect", str(ref), "--deep",
                        "--json"],
                       cwd=ROOT, capture_output=True, text=True)
    probs = json.loads(r.stdout)["problems"]
    assert [(p["code"], p["message"]) for p in probs] == [
        ("nan-inf", "model.norm.weight: 3 NaN and 1 Inf of 64 values")]


KILL_SCRIPT = """
import sys, time
from shardscope.core.execute import _Writer
real = _Writer.write_tensor
def slow(self, *a):  # the test's gate: make the merge last long enough to be killed
    time.sleep(0.2)
    return real(self, *a)
_Writer.write_tensor = slow
from shardscope.tui.cli import main
sys.exit(main(["merge", sys.argv[1], "-o", sys.argv[2], "--workers", "1", "-q"]))
"""


def test_kill_9_leaves_no_output_and_the_next_run_cleans_up(fixtures_root, tmp_path):
    import signal
    import time

    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-c", KILL_SCRIPT,
                             str(fixtures_root / "w4-fsdp2"), str(out)], cwd=ROOT)
    # planning first (a cold architecture check imports transformers: slow on a busy machine)
    deadline = time.time() + 300
    while time.time() < deadline and not any((tmp_path.glob(".out.shardscope-tmp-*"))):
        time.sleep(0.02)
    time.sleep(0.5)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not out.exists()
    stale = list(tmp_path.glob(".out.shardscope-tmp-*"))
    assert len(stale) == 1
    r = merge_cli(fixtures_root / "w4-fsdp2", out)
    assert r.returncode == 0
    assert f"removed {stale[0]}" in r.stderr
    assert not list(tmp_path.glob(".out.shardscope-tmp-*")) and out.is_dir()


def test_ctrl_c_exits_130_and_removes_the_temporary_folder(fixtures_root, tmp_path):
    import signal
    import time

    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-c", KILL_SCRIPT,
                             str(fixtures_root / "w4-fsdp2"), str(out)], cwd=ROOT,
                            stderr=subprocess.PIPE, text=True,
                            # SIGINT as Python expects it, even under a parent ignoring it
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    # planning first (a cold architecture check imports transformers: slow on a busy machine)
    deadline = time.time() + 300
    while time.time() < deadline and not any((tmp_path.glob(".out.shardscope-tmp-*"))):
        time.sleep(0.02)
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert err.strip() == "shardscope: interrupted; nothing was written"
    assert not out.exists() and not list(tmp_path.glob(".out*"))


@pytest.mark.parametrize("damage,code", [
    (lambda b: b[: len(b) // 2], "truncated-file"),
    (lambda b: b[:8] + b"{not json" + b[17:], "unreadable-file"),
    (lambda b: (10**9).to_bytes(8, "little") + b[8:], "truncated-file"),
])
def test_damaged_safetensors_header(fixtures_root, tmp_path, damage, code):
    ref = copy_checkpoint(fixtures_root / "w2-qwen2-f32.reference", tmp_path / "ref")
    f = ref / "model.safetensors"
    f.write_bytes(damage(f.read_bytes()))
    layout = detect(ref)
    assert (code, "model.safetensors") in codes(layout)
    r = merge_cli(ref, tmp_path / "out")
    assert r.returncode == 3 and "model.safetensors" in r.stderr


def test_one_byte_in_dcp_metadata_never_gives_a_merge(fixtures_root, tmp_path):
    ck = copy_checkpoint(fixtures_root / "w3-dcp", tmp_path / "ck")
    meta = ck / ".metadata"
    meta.write_bytes(meta.read_bytes().replace(b"chunks", b"c9unks", 1))
    r = merge_cli(ck, tmp_path / "out")
    assert r.returncode == 3 and "Traceback" not in r.stderr, r.stderr
    assert not (tmp_path / "out").exists()


def test_absurd_world_size_in_a_file_name_does_not_hang(w3):
    os.rename(w3 / "model_world_size_3_rank_0.pt", w3 / "model_world_size_99999999_rank_0.pt")
    r = subprocess.run([sys.executable, "-m", "shardscope.tui.cli", "inspect", str(w3), "--json"],
                       cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 3
    found = {p["code"] for p in json.loads(r.stdout)["problems"]}
    assert {"mixed-world-size", "missing-rank"} <= found


def test_negative_shape_in_a_safetensors_header(tmp_path):
    import struct

    d = tmp_path / "hf"
    d.mkdir()
    head = json.dumps({"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, -4]}}).encode()
    (d / "model.safetensors").write_bytes(struct.pack("<Q", len(head)) + head)
    assert ("unreadable-file", "model.safetensors") in codes(detect(d))


def test_config_that_is_not_an_object(w3):
    (w3 / "huggingface" / "config.json").write_text("[1, 2]")
    assert ("bad-config", "config.json") in codes(detect(w3))


def test_empty_tensors_in_deep_inspect_and_verify(fixtures_root, tmp_path):
    src = fixtures_root / "w3-buffers"
    assert detect(src).tensors["model.no_elements"].shape == (0, 4)
    r = subprocess.run([sys.executable, "-m", "shardscope.tui.cli", "inspect", str(src), "--deep"],
                       cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0 and "no problems found" in r.stdout, r.stderr
    run_merge(plan_merge(detect(src), MergeOptions(str(tmp_path / "o"), strict=False)))
    r = subprocess.run([sys.executable, "-m", "shardscope.tui.cli", "verify", str(tmp_path / "o"),
                        "--reference", str(fixtures_root / "w3-buffers.reference")],
                       cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0 and "all tensors match" in r.stdout, r.stdout + r.stderr


@pytest.mark.parametrize("name", ["w2-fsdp1", "w3-dcp"])
def test_config_that_ties_a_separately_trained_lm_head_is_refused(fixtures_root, tmp_path, name):
    """A config saying tie_word_embeddings over a checkpoint whose lm_head was trained apart:
    dropping lm_head as a tied copy would lose it silently. Refused naming both tensors; the
    truly tied fixtures still merge (tests/test_merge_exact.py)."""
    ck = copy_checkpoint(fixtures_root / name, tmp_path / "ck")
    ref = fixtures_root / f"{name}.reference"
    cfg_dir = ck / "huggingface" if (ck / "huggingface").is_dir() else tmp_path / "cfg"
    if not cfg_dir.exists():
        import shutil

        shutil.copytree(ref, cfg_dir, ignore=shutil.ignore_patterns("*.safetensors*"))
    cfg = json.loads((cfg_dir / "config.json").read_text())
    assert cfg.get("tie_word_embeddings") is False
    cfg["tie_word_embeddings"] = True
    (cfg_dir / "config.json").write_text(json.dumps(cfg))
    extra = [] if cfg_dir.parent == ck else ["--hf-config", str(cfg_dir)]
    r = subprocess.run([sys.executable, "-m", "shardscope.tui.cli", "merge", str(ck), "-o",
                        str(tmp_path / "o"), *extra], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 3, r.stderr
    assert "lm_head.weight" in r.stderr and "trained apart" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "o").exists()


def test_rank_file_that_is_a_symlink_loop(fixtures_root, tmp_path):
    """A rank file that is a symbolic link to itself is an unreadable file of the checkpoint
    (exit 3, naming it), not an "unexpected error" (pathlib's resolve() raises RuntimeError for
    a loop on Python < 3.13); an output that is such a link is refused as a usage error."""
    ck = copy_checkpoint(fixtures_root / "w2-qwen2-f32", tmp_path / "ck")
    rank1 = ck / "model_world_size_2_rank_1.pt"
    rank1.unlink()
    os.symlink(rank1.name, rank1)
    for args in (("inspect", ck), ("merge", ck, "-o", tmp_path / "out")):
        r = run_cli(*args, cwd=ROOT)
        assert r.returncode == 3, (args, r.stdout, r.stderr)
        assert "unexpected error" not in r.stderr and rank1.name in r.stdout + r.stderr
    assert not (tmp_path / "out").exists()
    loop = tmp_path / "loop"
    os.symlink(loop.name, loop)
    good = fixtures_root / "w2-qwen2-f32"
    for out in (loop, loop / "sub"):
        r = run_cli("merge", good, "-o", out, cwd=ROOT)
        assert r.returncode == 2 and "unexpected error" not in r.stderr, (out, r.stderr)


def _hsdp_rank0_of_another_run(fixtures_root, tmp_path):
    """w4-hsdp (ddp=2 x fsdp=2), all four rank files present, rank 0's values changed as another
    run of the same model would have them (same layout, same pickle, other bytes). Rank 2 holds
    the true copy of rank 0's shards: the contradiction is on disk."""
    import torch

    ck = copy_checkpoint(fixtures_root / "w4-hsdp", tmp_path / "ck")
    f = ck / "model_world_size_4_rank_0.pt"
    state = torch.load(f, weights_only=False)  # a real fixture, written by the tests
    for v in state.values():
        if hasattr(v, "_local_tensor"):
            v._local_tensor.add_(1.0)
    torch.save(state, f)
    return ck


def test_hsdp_rank_file_of_another_run_found_by_deep(fixtures_root, tmp_path):
    """--deep compares every replica copy (it read only the copies the merge takes, so the
    checkpoint above passed `inspect --deep` and `merge --deep`)."""
    ck = _hsdp_rank0_of_another_run(fixtures_root, tmp_path)
    r = run_cli("inspect", "--deep", ck, cwd=ROOT)
    assert r.returncode == 3 and "replica-mismatch" in r.stdout, r.stdout
    assert "model_world_size_4_rank_2.pt" in r.stdout and "rank_0.pt" in r.stdout
    r = run_cli("merge", "--deep", ck, "-o", tmp_path / "out", cwd=ROOT)
    # (the plain read finds these replicas apart already: the test below)
    assert r.returncode == 3 and "its HSDP replica" in r.stderr, r.stderr
    assert "inspect --deep" in r.stderr and not (tmp_path / "out").exists()


def test_hsdp_rank_file_of_another_run_with_every_rank_present(fixtures_root, tmp_path):
    """The plain read compares the replicas' storage records by the CRC-32 of their zip
    directories (the merge took rank 0's bytes and said nothing): one replica-mismatch naming
    both files, and the merge refuses; the sound checkpoint has none."""
    assert not [p for p in detect(fixtures_root / "w4-hsdp").problems
                if p.code == "replica-mismatch"]
    ck = _hsdp_rank0_of_another_run(fixtures_root, tmp_path)
    found = [p for p in detect(ck).problems if p.code == "replica-mismatch"]
    assert len(found) == 1 and found[0].severity == "error", found
    assert Path(found[0].path).name == "model_world_size_4_rank_0.pt"
    assert "model_world_size_4_rank_2.pt" in found[0].message
    r = run_cli("merge", ck, "-o", tmp_path / "out", cwd=ROOT)
    assert r.returncode == 3 and "rank_2.pt, its HSDP replica" in r.stderr, r.stderr
    assert not (tmp_path / "out").exists()


def test_dcp_safetensors_piece_of_another_dtype(fixtures_root, tmp_path):
    """w3-dcp-hf is BF16; rank 1's file says its piece of lm_head.weight is F16 (same size, so
    the offsets still fit). The merge cast that piece to BF16 and wrote a tensor no rank
    trained; it refuses, naming the file and the two dtypes."""
    import struct

    ck = copy_checkpoint(fixtures_root / "w3-dcp-hf", tmp_path / "ck")
    f = ck / "shard-00002-model-00001-of-00001.safetensors"
    b = f.read_bytes()
    n = struct.unpack("<Q", b[:8])[0]
    header = json.loads(b[8:8 + n])
    assert header["lm_head.weight"]["dtype"] == "BF16"
    header["lm_head.weight"]["dtype"] = "F16"
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    f.write_bytes(struct.pack("<Q", len(h)) + h + b[8 + n:])
    assert [(p.code, Path(p.path).name) for p in detect(ck).errors] == [
        ("rank-disagreement", f.name)], detect(ck).problems
    r = merge_cli(ck, tmp_path / "out")
    assert r.returncode == 3 and "F16 here, BF16 in" in r.stderr, r.stderr
    assert not (tmp_path / "out").exists()
