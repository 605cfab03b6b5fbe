"""Defects a new user found in the command line (trial report): each on a real checkpoint
written by torch.distributed (tests/conftest.py), damaged where the defect needs it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT, copy_checkpoint, flip_largest_storage, run_cli
from shardscope.core import MergeOptions, detect, plan_merge


def cli(*args):
    return run_cli(*args, cwd=ROOT)  # in this process (conftest.run_cli)


def tensors_in(layout, file: str, start: int, size: int) -> set[str]:
    return {name for name, t in layout.tensors.items() for p in t.pieces
            if Path(p.file).name == Path(file).name and start <= p.byte_offset < start + size}


# -- 1. a flipped byte in tensor data: every merge checks the CRC-32 of what it reads ---------

def test_merge_refuses_a_flipped_byte_in_a_rank_file(fixtures_root, tmp_path):
    ck = copy_checkpoint(fixtures_root / "w3-llama-f32", tmp_path / "ck")
    f = ck / "model_world_size_3_rank_1.pt"
    start, size = flip_largest_storage(f)
    names = tensors_in(detect(ck), str(f), start, size)
    assert names
    assert cli("inspect", ck).returncode == 0  # metadata only: the data is not read
    r = cli("merge", ck, "-o", tmp_path / "out")
    assert r.returncode == 3, r.stderr
    line = r.stderr.strip()
    assert "\n" not in line and "Traceback" not in line
    assert f.name in line and "CRC-32" in line and any(n in line for n in names)
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*"))
    # the check is what refuses: without it the same merge writes the corrupt value
    r = cli("merge", ck, "-o", tmp_path / "out2", "--no-crc", "-q")
    assert r.returncode == 0, r.stderr


def test_merge_refuses_a_flipped_byte_in_a_dcp_chunk(fixtures_root, tmp_path):
    ck = copy_checkpoint(fixtures_root / "w3-dcp", tmp_path / "ck")
    layout = detect(ck)
    p = next(p for t in layout.tensors.values() for p in t.pieces
             if p.archive is not None and p.numel > 64)
    start, size = flip_largest_storage(Path(p.file), p.archive[0], p.archive[1])
    r = cli("merge", ck, "-o", tmp_path / "out", "--hf-config",
            fixtures_root / "w3-dcp.reference")
    assert r.returncode == 3, r.stderr
    assert Path(p.file).name in r.stderr and "CRC-32" in r.stderr
    assert not (tmp_path / "out").exists()


def test_cast_checks_the_crc_of_what_it_reads_and_refuses_a_flipped_byte(
        fixtures_root, tmp_path, monkeypatch):
    """A --dtype merge computes the CRC-32 of each record it casts whole inside its own read
    loop (core/execute.py fused_records): on a real FSDP checkpoint every record is checked
    that way, the background checker gets none of them, and a byte flipped in a rank file is
    still refused by the cast itself: one line naming the file, the record's tensor and the
    CRC-32, nothing left at the output. Without --dtype the checker keeps every record."""
    from shardscope.core import execute, integrity, run_merge
    from shardscope.core.errors import BadCheckpointError

    ck = copy_checkpoint(fixtures_root / "w3-llama-f32", tmp_path / "ck")
    plan = plan_merge(detect(ck), MergeOptions(str(tmp_path / "out"), dtype="bf16"))
    records, _ = integrity.plan_records(plan)
    assert records and set(execute.fused_records(plan, records, lambda f: True)) == {
        (r.file, r.start) for r in records}
    keep = plan_merge(detect(ck), MergeOptions(str(tmp_path / "keep")))
    assert execute.fused_records(keep, integrity.plan_records(keep)[0], lambda f: True) == {}

    f = ck / "model_world_size_3_rank_1.pt"
    start, size = flip_largest_storage(f)
    names = tensors_in(detect(ck), str(f), start, size)
    given = []  # records handed to the background checker

    class Checker(integrity.CrcChecker):
        def __init__(self, records, *a, **k):
            given.extend(records)
            super().__init__(records, *a, **k)

    monkeypatch.setattr(integrity, "CrcChecker", Checker)
    with pytest.raises(BadCheckpointError) as e:
        run_merge(plan_merge(detect(ck), MergeOptions(str(tmp_path / "out"), dtype="bf16")))
    assert not given  # so the refusal is the cast's own check
    msg = str(e.value)
    assert f.name in msg and "CRC-32" in msg and any(n in msg for n in names), msg
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*"))
    r = cli("merge", ck, "-o", tmp_path / "out", "--dtype", "fp16", "-q")
    line = r.stderr.strip()
    assert r.returncode == 3 and "\n" not in line and "Traceback" not in line, r.stderr
    assert f.name in line and "CRC-32" in line and any(n in line for n in names)
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*"))


def test_crc_records_cover_every_piece_of_a_merge(fixtures_root, megatron_root, tmp_path):
    """Every output tensor of a torch.save checkpoint lies in a checked record (FSDP, DCP,
    HSDP, Megatron legacy and torch_dist: vocabulary padding cut, q/k/v split); a safetensors
    source has none (named as unchecked)."""
    from shardscope.core.integrity import check_record, plan_records

    mg = megatron_root / "llama"
    for src in (fixtures_root / "w3-llama-f32", fixtures_root / "w3-dcp",
                fixtures_root / "w4-hsdp", mg / "tp2_pp2" / "legacy",
                mg / "tp2_pp2" / "torch_dist"):
        cfg = str(mg / "reference") if src.parent == mg / "tp2_pp2" else None
        plan = plan_merge(detect(src, hf_config=cfg),
                          MergeOptions(str(tmp_path / src.name), strict=False, hf_config=cfg))
        name = str(src)
        records, unchecked = plan_records(plan)
        covered = {t for r in records for t in r.tensors}
        assert covered == {t.name for f in plan.files for t in f.tensors}, name
        assert not unchecked and all(check_record(r) for r in records)
    plan = plan_merge(detect(fixtures_root / "w3-llama-f32.reference"),
                      MergeOptions(str(tmp_path / "ref")))
    records, unchecked = plan_records(plan)
    assert not records and [Path(u).name for u in unchecked] == ["model.safetensors"]


def test_crc_check_of_a_file_finds_the_one_damaged_small_record(fixtures_root, tmp_path):
    """check_file reads a rank file's small records together (spans of up to CHUNK bytes):
    a byte flipped in one record in the middle of a span fails that record and no other, the
    refusal names its tensor; a file cut short fails the first record past the cut."""
    import threading

    from shardscope.core.integrity import CrcChecker, check_file, plan_records

    copy_checkpoint(fixtures_root / "w3-llama-f32", tmp_path / "ck")
    plan = plan_merge(detect(tmp_path / "ck"), MergeOptions(str(tmp_path / "out")))
    records, _ = plan_records(plan)
    by_file: dict[str, list] = {}
    for r in records:
        by_file.setdefault(r.file, []).append(r)
    path, recs = max(by_file.items(), key=lambda kv: len(kv[1]))
    recs.sort(key=lambda r: r.start)
    assert len(recs) > 4 and check_file(recs) is None
    victim = [r for r in recs if r.size][len(recs) // 2]
    data = bytearray(Path(path).read_bytes())
    data[victim.start + victim.size // 2] ^= 0x10
    Path(path).write_bytes(data)
    assert check_file(recs) is victim
    checker = CrcChecker(records, threading.Event(), 2)
    checker.start()
    with pytest.raises(Exception) as e:
        checker.result()
    assert victim.tensors[0] in str(e.value) and "CRC-32" in str(e.value)
    data[victim.start + victim.size // 2] ^= 0x10  # repaired, then cut inside a later record
    last = recs[-1]
    Path(path).write_bytes(bytes(data[:last.start + max(1, last.size // 2)]))
    assert check_file(recs) is (last if last.size > 1 else None)


# -- 2, 8, 9: what PATH is ---------------------------------------------------------------------

def test_a_file_that_is_not_a_checkpoint(fixtures_root, tmp_path):
    copy_checkpoint(fixtures_root / "w3-llama-f32", tmp_path / "ck")
    note = tmp_path / "notafolder.txt"
    note.write_text("hello\n")
    for cmd in (["inspect", note], ["merge", note, "-o", tmp_path / "out"]):
        r = cli(*cmd)
        assert r.returncode == 3
        assert r.stderr.strip() == (f"shardscope: {note}: not a checkpoint file (expected a "
                                    "folder, .pt/.bin/.safetensors)")
    d = json.loads(cli("inspect", "--json", note).stdout)
    assert d["refused"] and d["problems"][0]["code"] == "not-a-checkpoint"


def test_a_rank_file_given_as_path_says_it_reads_the_whole_folder(fixtures_root, tmp_path,
                                                                   monkeypatch):
    ck = fixtures_root / "w3-llama-f32"
    monkeypatch.setenv("SHARDSCOPE_CACHE", "off")  # the check's steps run, not the cache's
    r = cli("merge", ck / "model_world_size_3_rank_0.pt", "-o", tmp_path / "out", "-v")
    assert r.returncode == 0, r.stderr
    assert (f"note: reading the whole checkpoint folder {ck} that this file "
            "(model_world_size_3_rank_0.pt) belongs to") in r.stderr
    # 7: the phases before writing are reported (here through -v)
    for text in ("reading rank files 3/3", "planning the output files",
                 "importing torch and transformers for the architecture check",
                 "architecture check: building"):
        assert text in r.stderr, text
    r = cli("inspect", ck / "fsdp_config.json")
    assert r.returncode == 0 and "reading the whole checkpoint folder" in r.stdout


@pytest.mark.parametrize("damage,message", [
    (lambda b: b"", "empty file (0 bytes)"),
    (lambda b: os.urandom(len(b) // 2).replace(b"PK", b"pk"),
     "not a zip archive (torch.save) file"),
])
def test_empty_and_random_rank_files(fixtures_root, tmp_path, damage, message):
    ck = copy_checkpoint(fixtures_root / "w3-llama-f32", tmp_path / "ck")
    f = ck / "model_world_size_3_rank_2.pt"
    f.write_bytes(damage(f.read_bytes()))
    probs = [(p.code, p.message) for p in detect(ck).problems]
    assert probs == [("unreadable-file", probs[0][1])] and probs[0][1].startswith(message)
    r = cli("merge", ck, "-o", tmp_path / "out")
    assert r.returncode == 3 and message in r.stderr and "seek" not in r.stderr


# -- 3, 5, 10: diff ------------------------------------------------------------------------------

def test_diff_missing_path_is_a_usage_error(fixtures_root, tmp_path):
    r = cli("diff", tmp_path / "nope", fixtures_root / "w3-llama-f32.reference")
    assert r.returncode == 2 and r.stderr.strip().endswith("nope: no such file or folder")


def test_diff_tolerance_across_dtypes_and_top(fixtures_root, tmp_path):
    ref = fixtures_root / "w2-qwen2-f32.reference"
    out = tmp_path / "bf16"
    assert cli("merge", fixtures_root / "w2-qwen2-f32", "-o", out, "--dtype", "bf16",
               "-q").returncode == 0
    n = len(detect(ref).tensors)
    d = json.loads(cli("diff", ref, out, "--json", "--top", "1").stdout)
    assert d["counts"]["dtype"] == n and len(d["largest"]) == 1
    r = cli("diff", ref, out, "--json", "--atol", "0.05", "--rtol", "0.01")
    assert r.returncode == 0, r.stdout[-2000:]
    d = json.loads(r.stdout)
    assert d["counts"]["close"] == n and d["same"]
    assert any("F32 in A, BF16 in B" in w for w in d["warnings"])
    r = cli("diff", ref, out, "--json", "--atol", "1e-9", "--rtol", "0")
    assert r.returncode == 1 and json.loads(r.stdout)["counts"]["dtype"] == n


# -- 4: SIGTERM while planning -----------------------------------------------------------------

SLOW_PLAN = """
import sys, time
from shardscope import core
real = core.plan_merge
def slow(*a, **k):  # the test's gate: a planning step long enough to be signalled
    print("planning", flush=True)
    time.sleep(60)
    return real(*a, **k)
core.plan_merge = slow
from shardscope.tui.cli import main
sys.exit(main(["merge", sys.argv[1], "-o", sys.argv[2]]))
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_sigterm_while_planning_exits_130(fixtures_root, tmp_path, sig):
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-c", SLOW_PLAN, str(fixtures_root / "w3-llama-f32"),
                             str(out)], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "planning"
    t0 = time.time()
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and time.time() - t0 < 30, err
    assert err.strip() == "shardscope: interrupted; nothing was written"
    assert not out.exists()


# -- 6: inspect --check without a config ---------------------------------------------------------

def test_inspect_check_without_config_is_a_stated_skip(fixtures_root):
    r = cli("inspect", fixtures_root / "w3-dcp", "--check", "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["problems"] == [] and d["check"]["skipped"]
    assert any(n.startswith("architecture check skipped: no config.json") for n in d["notes"])
    r = cli("inspect", fixtures_root / "w3-dcp", "--check")
    assert "problem" not in r.stdout.replace("no problems found", "")
    assert "architecture check skipped" in r.stdout
