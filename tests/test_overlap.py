"""A merge of a config whose architecture check is not cached yet (core/overlap.py): written
on a speculative plan while core/archworker.py imports transformers in a second process, and
committed only when the real plan writes the same tensor files; otherwise written again from
the real plan, or refused with the real plan's own message."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pytest

from conftest import ROOT, copy_checkpoint, run_cli
from test_interrupt import assert_nothing_left, interrupt_at
from test_merge_exact import assert_bit_equal, load
from shardscope.core import MergeOptions, detect, plan_merge
from shardscope.core import execute, overlap

WROTE_AHEAD = "writing while the architecture check runs"
REWRITTEN = "the architecture check changed the plan: writing it again"


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    """An empty architecture cache: the first merge of every config is cold."""
    cache = tmp_path / "archcache"
    monkeypatch.setenv("SHARDSCOPE_CACHE", str(cache))
    return cache


def _left_beside(out):
    return sorted(p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}"))


def test_a_cold_merge_is_written_ahead_and_exact_then_plans_warm(fixtures_root, tmp_path,
                                                                  fresh_cache):
    src = fixtures_root / "w2-qwen2-f32"
    out = tmp_path / "out"
    r = run_cli("merge", src, "-o", out, "-v")
    assert r.returncode == 0, r.stderr
    assert WROTE_AHEAD in r.stderr and REWRITTEN not in r.stderr
    assert "while the architecture check ran, then" in r.stdout
    assert_bit_equal(load(out), load(fixtures_root / "w2-qwen2-f32.reference"))
    assert _left_beside(out) == []
    assert any(fresh_cache.rglob("*.json"))  # the answers were kept
    r = run_cli("merge", src, "-o", tmp_path / "again", "-v")
    assert r.returncode == 0 and WROTE_AHEAD not in r.stderr, r.stderr
    assert sorted(os.listdir(out)) == sorted(os.listdir(tmp_path / "again"))
    for name in os.listdir(out):  # the same folder, byte for byte (card, config, index)
        assert (out / name).read_bytes() == (tmp_path / "again" / name).read_bytes(), name


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_moe"])
def test_a_model_saved_under_other_names_is_written_again_from_the_real_plan(
        models_root, tmp_path, fresh_cache, family):
    """transformers 5 saves a VLM's language model and fused experts under other names than
    the checkpoint's in-memory ones: the guess is wrong, its files are dropped."""
    out = tmp_path / "out"
    r = run_cli("merge", models_root / family, "-o", out, "-v")
    assert r.returncode == 0, r.stderr
    assert WROTE_AHEAD in r.stderr and REWRITTEN in r.stderr
    assert_bit_equal(load(out), load(models_root / f"{family}.reference"))
    assert _left_beside(out) == []


def test_the_real_plans_refusal_refuses_the_merge(fixtures_root, tmp_path, fresh_cache):
    """Weights that do not fit the config's model: the same one-line refusal as a warm merge,
    and nothing written on the guess is left."""
    ck = copy_checkpoint(fixtures_root / "w2-qwen2-f32", tmp_path / "ck")
    cfg_path = ck / "huggingface" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["intermediate_size"] *= 2  # the model's MLP weights have other shapes
    cfg_path.write_text(json.dumps(cfg))
    out = tmp_path / "out"
    cold = run_cli("merge", ck, "-o", out, "-v")
    assert cold.returncode == 3, cold.stderr
    assert WROTE_AHEAD in cold.stderr
    assert "the weights do not match the model Qwen2ForCausalLM" in cold.stderr
    assert_nothing_left(tmp_path, out)
    warm = run_cli("merge", ck, "-o", out)
    assert warm.returncode == 3 and WROTE_AHEAD not in warm.stderr
    assert warm.stderr.strip().splitlines()[-1] == cold.stderr.strip().splitlines()[-1]
    assert_nothing_left(tmp_path, out)


def test_the_worker_fills_the_cache_a_new_process_plans_from(fixtures_root, tmp_path,
                                                             fresh_cache):
    """core/archworker.py on a speculative plan's question: afterwards a new process plans
    the merge with the cache alone (cache_only raises ColdCache otherwise)."""
    src = fixtures_root / "w3-llama-f32"
    probe = ("import sys\nfrom shardscope.core import MergeOptions, detect, plan_merge\n"
             "from shardscope.core.archcache import ColdCache, cache_only\n"
             "try:\n    with cache_only():\n"
             f"        plan_merge(detect({str(src)!r}), MergeOptions(output={str(tmp_path / 'o')!r}))\n"
             "except ColdCache as e:\n    sys.exit(f'cold: {e}')\n")
    before = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True,
                            text=True)
    assert before.returncode != 0 and "cold" in before.stderr
    spec = plan_merge(detect(src), MergeOptions(output=str(tmp_path / "o")), speculative=True)
    worker = subprocess.run([sys.executable, "-m", "shardscope.core.archworker"], cwd=ROOT,
                            input=json.dumps(spec.question) + "\n", text=True,
                            capture_output=True, timeout=300)
    assert worker.returncode == 0 and worker.stdout == "", worker.stderr
    after = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True,
                           text=True)
    assert after.returncode == 0, after.stderr


def test_same_writes_sees_every_difference(fixtures_root, tmp_path):
    layout = detect(fixtures_root / "w2-qwen2-f32")
    a = plan_merge(layout, MergeOptions(output=str(tmp_path / "a")))
    assert overlap.same_writes(a, plan_merge(layout, MergeOptions(output=str(tmp_path / "b"))))
    assert not overlap.same_writes(a, plan_merge(layout, MergeOptions(
        output=str(tmp_path / "c"), dtype="bf16")))
    assert not overlap.same_writes(a, plan_merge(layout, MergeOptions(
        output=str(tmp_path / "d"), max_shard_size="100KB")))
    b = plan_merge(layout, MergeOptions(output=str(tmp_path / "e")))
    t = b.files[0].tensors[-1]
    t.pieces = t.pieces[::-1]  # the same pieces, another order: other bytes at each offset
    assert len(t.pieces) > 1 and not overlap.same_writes(a, b)
    b = plan_merge(layout, MergeOptions(output=str(tmp_path / "f")))
    b.files[0].tensors[0].name += ".x"
    assert not overlap.same_writes(a, b)


def test_a_wrong_guess_stops_the_writing_as_soon_as_the_real_plan_is_known(
        models_root, tmp_path, monkeypatch):
    """A slow write (each piece 0.5 s) of a guess the real plan proves wrong stops early, not
    after every piece; the real plan is then written whole. The cache is off: the real plan is
    made in the thread."""
    monkeypatch.setenv("SHARDSCOPE_CACHE", "off")
    layout = detect(models_root / "qwen2_5_vl")
    opts = MergeOptions(output=str(tmp_path / "out"), workers=1)
    spec, pending = overlap.plan_first(layout, opts)
    assert pending is not None and pending.proc is None
    pieces = sum(len(t.pieces) for f in spec.files for t in f.tensors)
    real_copy = execute._copy_range
    calls = []

    def slow(*a, **k):
        calls.append(len(runs))
        if len(runs) == 1:
            threading.Event().wait(0.5)
        return real_copy(*a, **k)

    monkeypatch.setattr(execute, "_copy_range", slow)
    runs = []

    def run(p, pend):
        runs.append(pend)
        return execute.run_merge(p, cancel=threading.Event(), pending=pend)

    real, result = overlap.finish(spec, pending, run, threading.Event())
    assert len(runs) == 2 and runs[1] is None and real is pending.plan
    ahead = calls.count(1)
    assert 0 < ahead < pieces // 2, (ahead, pieces)
    assert_bit_equal(load(tmp_path / "out"), load(models_root / "qwen2_5_vl.reference"))
    assert result.tensors == real.tensor_count


def test_ctrl_c_while_the_worker_checks_leaves_nothing(fixtures_root, tmp_path, fresh_cache):
    out = tmp_path / "out"
    code, lines = interrupt_at([sys.executable, "-m", "shardscope.tui.cli", "merge",
                                str(fixtures_root / "w4-fsdp2"), "-o", str(out), "-v"],
                               WROTE_AHEAD, dict(os.environ))
    assert any(WROTE_AHEAD in line for line in lines), lines
    assert code == 130, lines
    assert lines[-1] == "shardscope: interrupted; nothing was written", lines
    assert_nothing_left(tmp_path, out)
    mine = f"SHARDSCOPE_CACHE={fresh_cache}".encode()
    workers = [p for p in os.listdir("/proc") if p.isdigit()
               and "shardscope.core.archworker" in _read(p, "cmdline").decode(errors="replace")
               and mine in _read(p, "environ").split(b"\0")]
    assert workers == [], "the worker outlived the merge"


def _read(pid: str, what: str) -> bytes:
    try:
        with open(f"/proc/{pid}/{what}", "rb") as f:
            return f.read().replace(b"\0", b" ") if what == "cmdline" else f.read()
    except OSError:
        return b""


def test_a_failed_worker_leaves_the_check_to_the_merge(fixtures_root, tmp_path, fresh_cache,
                                                       monkeypatch):
    """The worker's answers only save time: a worker that dies makes the merge check in its
    own process (and say so with -v), the output as exact."""
    def broken(preload=False):
        return subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(7)"],
                                stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)

    monkeypatch.setattr(overlap, "start_worker", broken)
    out = tmp_path / "out"
    r = run_cli("merge", fixtures_root / "w2-qwen2-f32", "-o", out, "-v")
    assert r.returncode == 0, r.stderr
    assert WROTE_AHEAD in r.stderr and "worker process failed (exit 7)" in r.stderr
    assert "importing torch and transformers for the architecture check" in r.stderr
    assert_bit_equal(load(out), load(fixtures_root / "w2-qwen2-f32.reference"))
