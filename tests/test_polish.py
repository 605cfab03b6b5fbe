"""Defects found by trial users: messages that name the real cause, verdicts that reflect every
problem, output that keeps whole lines when piped and stays quiet with ``-q``. Each test runs
on a real checkpoint (the base fixtures), damaged where the defect needs it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from conftest import ROOT, copy_checkpoint, flip_largest_storage, run_cli
from shardscope.core import detect


def cli(*args):
    return run_cli(*args, cwd=ROOT)  # in this process (conftest.run_cli)


def codes(layout):
    return {(p.code, Path(p.path).name if p.path else None) for p in layout.problems}


# -- 3: swapped DCP files are not "truncated" ---------------------------------------------------

def test_swapped_distcp_files_are_named_not_called_truncated(fixtures_root, tmp_path):
    ck = copy_checkpoint(fixtures_root / "w3-dcp", tmp_path / "ck")
    a, b = ck / "__0_0.distcp", ck / "__1_0.distcp"
    assert a.stat().st_size != b.stat().st_size  # else the sizes could not tell a swap
    a.rename(ck / "tmp")
    b.rename(a)
    (ck / "tmp").rename(b)
    found = codes(detect(ck))
    assert ("file-mismatch", "__0_0.distcp") in found and ("file-mismatch", "__1_0.distcp") \
        in found and not any(c == "truncated-file" for c, _ in found), found
    r = cli("merge", ck, "-o", tmp_path / "out", "--hf-config", fixtures_root / "w3-dcp.reference")
    assert r.returncode == 3 and not (tmp_path / "out").exists()
    assert "does not hold the records .metadata places in it" in r.stderr
    assert "swapped" in r.stderr and "truncated" not in r.stderr, r.stderr


def test_a_short_distcp_file_is_still_truncated(fixtures_root, tmp_path):
    ck = copy_checkpoint(fixtures_root / "w3-dcp", tmp_path / "ck")
    f = ck / "__1_0.distcp"
    f.write_bytes(f.read_bytes()[:-100])  # cut inside its last chunk: the others in place
    assert ("truncated-file", "__1_0.distcp") in codes(detect(ck))


# -- 11: a failed --deep check names the tensor and points to inspect --deep ---------------------

def test_deep_failure_names_the_tensor_and_inspect_deep(fixtures_root, tmp_path):
    ck = copy_checkpoint(fixtures_root / "w3-llama-f32", tmp_path / "ck")
    f = ck / "model_world_size_3_rank_1.pt"
    data, size = flip_largest_storage(f)
    r = cli("merge", ck, "-o", tmp_path / "out", "--deep", "-q")
    assert r.returncode == 3 and r.stderr.count("\n") == 1, r.stderr
    assert "run `shardscope inspect --deep`" in r.stderr
    assert "archive at byte 0" not in r.stderr and "fails its CRC-32" in r.stderr
    r = cli("inspect", ck, "--deep", "--json")
    probs = [p for p in json.loads(r.stdout)["problems"] if p["code"] == "checksum-mismatch"]
    assert len(probs) == 1 and Path(probs[0]["path"]).name == f.name
    # the storage named is the one flipped, and its tensor is the one stored there
    layout = detect(ck)
    owner = [name for name, t in layout.tensors.items() for p in t.pieces
             if p.file == str(f) and data <= p.byte_offset < data + size]
    assert owner and probs[0]["message"].startswith(owner[0]), (owner, probs[0]["message"])
    assert f"data at bytes {data}-{data + size}" in probs[0]["message"]


def test_deep_failure_in_a_dcp_chunk_names_its_tensor(fixtures_root, tmp_path):
    ck = copy_checkpoint(fixtures_root / "w3-dcp", tmp_path / "ck")
    layout = detect(ck)
    name, t = max(layout.tensors.items(), key=lambda kv: kv[1].pieces[0].nbytes)
    p = t.pieces[0]
    start, length, _ = p.archive
    located = layout.resolve_piece(p)
    with open(p.file, "r+b") as fh:  # flip a byte in the middle of that chunk's data
        pos = located.byte_offset + located.nbytes // 2
        fh.seek(pos)
        b = fh.read(1)
        fh.seek(pos)
        fh.write(bytes([b[0] ^ 0x5A]))
    r = cli("inspect", ck, "--deep", "--json")
    probs = [q for q in json.loads(r.stdout)["problems"] if q["code"] == "checksum-mismatch"]
    assert len(probs) == 1 and probs[0]["message"].startswith(name), probs
    where = (f"archive at byte {start}, " if start else "") + "data at bytes "
    assert where in probs[0]["message"], probs[0]["message"]


# -- 6: verify's verdict reflects every problem it lists -----------------------------------------

def test_verify_verdict_is_not_ok_beside_a_problem(fixtures_root, tmp_path):
    out = tmp_path / "out"
    r = cli("merge", fixtures_root / "w2-dcp", "-o", out, "--no-strict", "-q")
    assert r.returncode == 0, r.stderr
    r = cli("verify", out)
    lines = r.stdout.strip().splitlines()
    assert r.returncode == 0 and "no-config" in lines[0] and "warning" in lines[0], r.stdout
    assert "no-config" in lines[-1] and "from_pretrained cannot load" in " ".join(lines[-2:])
    assert not any(line.startswith("ok ") or line == "ok" for line in lines), r.stdout
    r = cli("verify", out, "--reference", fixtures_root / "w2-dcp.reference")
    assert r.returncode == 0 and "all tensors match" in r.stdout and "no-config" in \
        r.stdout.strip().splitlines()[-1] + r.stdout.strip().splitlines()[-2]
    shutil.copy(fixtures_root / "w2-dcp.reference" / "config.json", out / "config.json")
    r = cli("verify", out)
    assert r.returncode == 0 and r.stdout.strip().splitlines() == [f"ok {out}"], r.stdout


# -- 7: piped output keeps whole lines -------------------------------------------------------------

def test_inspect_params_piped_keeps_whole_lines(models_root):
    src = models_root / "qwen2_5_vl"
    r = cli("inspect", src, "--params")
    assert r.returncode == 0, r.stderr
    rows = {line.split("│")[1].strip(): line for line in r.stdout.splitlines()
            if line.startswith("│") and line.count("│") >= 6}
    layout = detect(src)
    longest = max(layout.tensors, key=len)
    assert len(longest) + 40 > 80  # the line would not fit 80 columns
    for name, t in layout.tensors.items():
        assert name in rows, name  # whole, not cut with "…" or folded onto two lines
        assert str(list(t.shape)) in rows[name] and t.placement in rows[name]
    assert str(src / "model_world_size_2_rank_0.pt") in r.stdout


# -- 9: -q prints errors only ---------------------------------------------------------------------

def test_quiet_merge_prints_errors_only(fixtures_root, tmp_path):
    r = cli("merge", fixtures_root / "w2-dcp", "-o", tmp_path / "a", "--no-strict", "-q")
    assert r.returncode == 0 and r.stdout == "" and r.stderr == "", (r.stdout, r.stderr)
    assert (tmp_path / "a" / "model.safetensors").is_file()
    r = cli("merge", fixtures_root / "w2-dcp", "-o", tmp_path / "a", "--no-strict", "-q")
    assert r.returncode == 2 and r.stdout == "" and r.stderr.count("\n") == 1  # it exists
    r = cli("merge", fixtures_root / "w2-dcp", "-o", tmp_path / "b", "--no-strict")
    assert r.returncode == 0 and r.stdout.startswith("wrote ") and "warning:" in r.stderr


# -- 8: the check's verdict fits the 80x24 layout box ---------------------------------------------

def test_short_check_verdict_fits_the_80x24_border():
    """The layout box is 40 columns at 80x24 (its border leaves about 34): the short verdict
    in its bottom border fits for every kind of verdict (the snapshots show it in place)."""
    from shardscope.core.judge import Verdict
    from shardscope.tui.widgets.layout_summary import check_short

    verdicts = [
        Verdict("Qwen2_5_VLForConditionalGeneration", expected=1234, matched=1234),
        Verdict("X", expected=1234, matched=1000, missing=["a"] * 120, extra=["b"] * 999,
                shape=[("c", (1,), (2,))] * 15),
        Verdict(skipped="no config.json (pass --hf-config DIR to check the weights against "
                        "the model)"),
        Verdict(skipped="config.json names TinyRemoteForCausalLM, a class transformers does "
                        "not ship (remote code in auto_map); pass --trust-remote-code"),
        Verdict(skipped="transformers 5.24.0 does not know model_type 'qwen2_private_fork' of "
                        "config.json"),
    ]
    shorts = [check_short(v) for v in verdicts]
    assert shorts == ["check: matches, 1234/1234", "check: 120 missing, 999 extra, ...",
                      "check skipped: no config", "check skipped: remote code",
                      "check skipped: unknown model_type"]
    assert all(len(s) <= 34 for s in shorts)


# -- 12: HSDP replica comparison through strides uses the merge's strided reader -------------------

def test_strided_replica_copies_compared_element_by_element(fixtures_root, tmp_path):
    """A shard of the real HSDP checkpoint and a byte-for-byte replica of its rank file: read
    as transposed (non-contiguous) pieces they agree; a flipped byte in one copy is found."""
    from dataclasses import replace

    from shardscope.core.formats.fsdp import _disagreeing_copies

    ck = copy_checkpoint(fixtures_root / "w4-hsdp", tmp_path / "ck")
    layout = detect(ck)
    name, t = next((n, t) for n, t in layout.tensors.items() if len(t.shape) == 2)
    a = next(p for p in t.pieces if p.rank == 0)
    copy = shutil.copy(a.file, tmp_path / "replica.pt")  # a replica's bytes, as HSDP saves
    c = replace(a, file=str(copy))
    assert a.contiguous and len(a.shape) == 2 and min(a.shape) > 1

    def transposed(p):
        return replace(p, shape=p.shape[::-1], stride=p.stride[::-1])

    pairs = [(name, transposed(a), transposed(c))]
    assert not pairs[0][1].contiguous
    assert _disagreeing_copies(pairs) == []
    with open(c.file, "r+b") as f:  # last element of the copy's first row
        pos = c.byte_offset + (c.shape[1] - 1) * 4
        f.seek(pos)
        b = f.read(1)
        f.seek(pos)
        f.write(bytes([b[0] ^ 0x40]))
    assert _disagreeing_copies(pairs) == [name]


# -- 1 in the app: a DCP folder without a config -------------------------------------------------

@pytest.mark.asyncio
async def test_app_refuses_unchecked_names_in_the_forms_words(fixtures_root, tmp_path):
    """The app's merge of a DCP folder without a config is refused with the reason, in the
    form's words (its config folder field, its not-strict box); ticking the box writes it.
    The layout box's border shows the check's short verdict at 80x24."""
    from test_app import open_form, open_inspector, run_to_end
    from shardscope.tui.app import make_app

    app = make_app(str(fixtures_root / "w2-dcp"))
    async with app.run_test(size=(80, 24)) as pilot:
        screen = await open_inspector(pilot, app)
        from conftest import wait_for

        await wait_for(pilot, lambda: screen.verdict is not None, tries=1200)
        assert "check skipped: no config" in str(screen.query_one("#summary").border_subtitle)
        await open_form(pilot, app, tmp_path / "refused")
        run = await run_to_end(pilot, app, tries=1200)
        result = " ".join(str(run.query_one("#result").render()).split())
        assert "architecture check skipped: no config.json" in result, result
        assert "the config folder field" in result and "not strict" in result
        assert "--no-strict" not in result and "--hf-config" not in result
        await pilot.press("escape")
        await open_inspector(pilot, app)
        form = await open_form(pilot, app, tmp_path / "written")
        form.query_one("#no-strict").value = True
        run = await run_to_end(pilot, app, tries=1200)
        assert "the merge failed" not in str(run.query_one("#status").render())
    assert (tmp_path / "written" / "model.safetensors").is_file()
    assert not (tmp_path / "refused").exists()
    assert "names unchecked" in (tmp_path / "written" / "README.md").read_text()
