"""What a new user tripped over (trial3, /work/notes/trial3-findings.md): each on a real
checkpoint written by torch.distributed (tests/conftest.py)."""

from __future__ import annotations

import json
import threading

import pytest

from app_helpers import open_merge_form
from conftest import ROOT, run_cli, wait_for
from shardscope.core.phases import phase, reporting
from test_merge_exact import assert_bit_equal, load


def cli(*args):
    return run_cli(*args, cwd=ROOT)  # in this process (conftest.run_cli)


# -- 1. verify against a reference ends with a verdict naming the differences ----------------
def test_verify_with_differences_ends_with_a_verdict(fixtures_root, tmp_path, monkeypatch):
    src, ref = fixtures_root / "w2-qwen2-f32", fixtures_root / "w2-qwen2-f32.reference"
    monkeypatch.setenv("SHARDSCOPE_CACHE", "off")  # the check's steps run, not the cache's
    out = tmp_path / "bf16"
    r = cli("merge", src, "-o", out, "--dtype", "bf16", "-v")
    assert r.returncode == 0, r.stderr
    # 5: a phase announced twice in a row (the judge's two steps) is logged once
    assert r.stderr.count("importing torch and transformers for the architecture check") == 1
    n = json.loads(cli("inspect", ref, "--json").stdout)["tensors"]
    r = cli("verify", out, "--reference", ref)
    assert r.returncode == 1
    last = r.stdout.strip().splitlines()[-1]
    assert last == (f"not ok {out}: {n} tensor(s) differ from {ref} ({n} dtype, {n} values); "
                    "the dtypes differ: compare values with --atol/--rtol"), last
    r = cli("verify", out, "--reference", ref, "--atol", "1e-2", "--rtol", "1e-2")
    assert r.returncode == 0 and r.stdout.strip().splitlines()[-1] == (
        f"ok {out}: within atol=0.01 rtol=0.01 of {ref}"), r.stdout
    # another model's weights: values differ, same dtypes, no hint about tolerances
    r = cli("verify", out, "--reference", fixtures_root / "w2-qwen2-bf16-tied.reference")
    last = r.stdout.strip().splitlines()[-1]
    assert r.returncode == 1 and last.startswith(f"not ok {out}: ") and "values" in last
    assert "--atol" not in last


# -- 2. inspect --json prints one JSON document even for a usage refusal ---------------------
def test_inspect_json_refusals_are_json(fixtures_root, tmp_path):
    missing = tmp_path / "nope"
    r = cli("inspect", missing, "--json")
    assert r.returncode == 2 and r.stderr == ""
    d = json.loads(r.stdout)
    assert d["refused"] is True and d["exit_code"] == 2 and d["path"] == str(missing)
    assert [(p["code"], p["message"]) for p in d["problems"]] == [
        ("no-such-path", "no such file or folder")]
    r = cli("inspect", fixtures_root / "w2-qwen2-f32", "--json", "--map", "no.such.tensor")
    d = json.loads(r.stdout)
    assert r.returncode == 2 and d["refused"] and d["problems"][0]["code"] == "usage"
    assert "no tensor named 'no.such.tensor'" in d["problems"][0]["message"]
    # without --json: the one line on stderr, as before
    r = cli("inspect", missing)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr == f"shardscope: {missing}: no such file or folder\n"


def test_phase_reports_each_step_once():
    seen: list[str] = []
    with reporting(seen.append):
        for text in ("a", "a", "b", "a"):
            phase(text)
        with reporting(None):
            phase("c")
        phase("a")  # the inner block does not count as a step of this one
    assert seen == ["a", "b", "a"]


# -- 3/4. the app's merge run shows its planning steps and the whole time ---------------------
@pytest.mark.asyncio
async def test_app_merge_shows_planning_steps_and_total_time(fixtures_root, tmp_path,
                                                             monkeypatch):
    from shardscope.tui.app import make_app
    from shardscope.tui.screens.merge_run import MergeRunScreen

    held, gate = threading.Event(), threading.Event()
    real = MergeRunScreen.on_phase

    def gated(self, text):  # hold the worker in plan_merge's first step (always reported;
        real(self, text)    # the architecture check's may be served by the inspector's cache)
        if text == "planning the output files":
            held.set()
            gate.wait(20)

    monkeypatch.setattr(MergeRunScreen, "on_phase", gated)
    out = tmp_path / "out"
    app = make_app(str(fixtures_root / "w2-qwen2-f32"))
    async with app.run_test(size=(120, 40)) as pilot:
        form = await open_merge_form(pilot, app)
        form.query_one("#output").value = str(out)
        await pilot.click("#ok")
        await wait_for(pilot, lambda: isinstance(app.screen, MergeRunScreen))
        run = app.screen
        await wait_for(pilot, held.is_set, tries=1200)
        status = lambda: str(run.query_one("#status").render())  # noqa: E731
        await wait_for(pilot, lambda: status() == "planning the output files…")
        await pilot.pause(0.3)  # the planning time shown below includes this wait
        gate.set()
        await wait_for(pilot, lambda: run.finished, tries=400)
        result = str(run.query_one("#result").render())
    import re

    m = re.match(r"done in ([\d.]+) s \(planning ([\d.]+) s, writing ([\d.]+) s\): 27 tensors",
                 result)
    assert m, result
    total, planning, writing = map(float, m.groups())
    assert planning >= 0.3 and abs(total - planning - writing) < 0.02
    assert_bit_equal(load(out), load(fixtures_root / "w2-qwen2-f32.reference"))


# -- sample: an existing --reference folder is refused before any writing ----------------------
def test_sample_refuses_a_reference_folder_that_exists(tmp_path):
    ref = tmp_path / "ref"
    ref.mkdir()
    (ref / "model.safetensors").write_bytes(b"an older reference")
    r = cli("sample", tmp_path / "ck", "--reference", ref)
    assert r.returncode == 2
    assert r.stderr == f"shardscope: {ref}: exists and is not empty; choose a new folder\n"
    assert not (tmp_path / "ck").exists() and sorted(p.name for p in ref.iterdir()) == [
        "model.safetensors"]
    r = cli("sample", "--help")
    assert "number of ranks" in r.stdout and "the folder to write" in r.stdout


# -- 9. verl's huggingface/ config folder points at its checkpoint ----------------------------
def test_config_folder_points_at_its_checkpoint(fixtures_root):
    ck = fixtures_root / "w2-qwen2-f32"
    for given in (ck / "huggingface", ck / "huggingface" / "config.json"):
        r = cli("inspect", given)
        assert r.returncode == 3
        assert r.stderr == (f"shardscope: {given}: the config folder of the checkpoint {ck} "
                            "(config and tokenizer, no weights); give that folder\n")
        d = json.loads(cli("inspect", given, "--json").stdout)
        assert d["refused"] and d["problems"][0]["code"] == "wrong-folder"
