"""Usage errors and messages found by a new user's trial (notes: trial report A3, B1, B2, C2,
C3, C4, D1, D2): each is one line and exit 2, before any work."""

from __future__ import annotations

import json

import pytest

from conftest import run_cli


@pytest.mark.parametrize("extra", [(), ("--check",), ("--json",)])
@pytest.mark.parametrize("kind", ["missing", "empty"])
def test_inspect_hf_config_without_config_json_is_a_usage_error(fixtures_root, tmp_path,
                                                                extra, kind):
    """As merge refuses it: exit 2 and one line naming DIR, not a silent "config none (merge
    with --hf-config DIR)" or a skipped check (exit 0)."""
    cfg = tmp_path / "cfg"
    if kind == "empty":
        cfg.mkdir()
    r = run_cli("inspect", fixtures_root / "w2-dcp", "--hf-config", cfg, *extra)
    assert r.returncode == 2, r.stdout + r.stderr
    if "--json" in extra:
        doc = json.loads(r.stdout)
        assert doc["refused"] is True and doc["exit_code"] == 2
        [p] = doc["problems"]
        assert p["path"] == str(cfg) and p["message"] == "has no config.json"
    else:
        assert r.stdout == ""
        assert r.stderr == f"shardscope: {cfg}: has no config.json\n"
    merge = run_cli("merge", fixtures_root / "w2-dcp", "-o", tmp_path / "out", "--hf-config", cfg)
    assert merge.returncode == 2 and merge.stderr == f"shardscope: {cfg}: has no config.json\n"


TOLERANCES = [("--atol", "-1"), ("--rtol", "-1"), ("--atol", "nan"), ("--rtol", "nan"),
              ("--atol", "inf"), ("--rtol", "-inf")]


@pytest.mark.parametrize("flag,value", TOLERANCES)
@pytest.mark.parametrize("command", ["verify-reference", "verify", "diff"])
def test_bad_tolerance_is_a_usage_error(fixtures_root, flag, value, command):
    """Negative, NaN or infinite --atol/--rtol: one line, exit 2 (not torch's "unexpected
    error" with exit 1, verify's "differs"; not accepted in silence by verify alone)."""
    ref = fixtures_root / "w2-qwen2-f32.reference"
    args = {"verify-reference": ("verify", ref, "--reference", ref),
            "verify": ("verify", ref),
            "diff": ("diff", ref, fixtures_root / "w2-qwen2-f32")}[command]
    r = run_cli(*args, f"{flag}={value}")
    assert (r.returncode, r.stdout, r.stderr) == (
        2, "", f"shardscope: {flag} must be a non-negative number\n")


@pytest.mark.parametrize("command", ["verify", "diff", "inspect", "merge"])
def test_unexpected_error_names_a_flag_the_command_has(fixtures_root, tmp_path, monkeypatch,
                                                       command):
    """The last-resort message asks for -v output only where -v exists (merge)."""
    from shardscope.tui import cli

    def boom(*a, **k):
        raise RuntimeError("boom")

    ref = fixtures_root / "w2-qwen2-f32.reference"
    target = {"verify": "cmd_verify", "diff": "cmd_diff", "inspect": "cmd_inspect",
              "merge": "cmd_merge"}[command]
    monkeypatch.setattr(cli, target, boom)
    args = {"verify": ("verify", ref), "diff": ("diff", ref, ref), "inspect": ("inspect", ref),
            "merge": ("merge", ref, "-o", tmp_path / "out")}[command]
    r = run_cli(*args)
    assert r.returncode == 1
    [line] = r.stderr.splitlines()
    assert line.startswith("shardscope: unexpected error (RuntimeError: boom); please report")
    if command == "merge":
        assert line.endswith("with the output of the same command with -v")
        assert "-v, --verbose" in run_cli("merge", "--help").stdout
    else:
        assert "-v" not in line and line.endswith("with the command line that caused it")
        assert "-v" not in run_cli(command, "--help").stdout.split()


@pytest.mark.parametrize("repo_id", ["bad repo id", "a/b/c", "me/x.git", "a--b/c"])
@pytest.mark.parametrize("command", ["upload", "merge"])
def test_invalid_repo_id_is_a_usage_error_before_any_work(fixtures_root, tmp_path, monkeypatch,
                                                          repo_id, command):
    """Exit 2 and one line, before the merge and before any request (not exit 4, "upload
    failed", with a retry command that repeats the bad id)."""
    import huggingface_hub.constants
    from fake_hub import FakeHub

    out = tmp_path / "out"
    with FakeHub() as hub:
        monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", hub.url)
        monkeypatch.setenv("HF_TOKEN", "hf_test_token")
        if command == "upload":
            r = run_cli("upload", fixtures_root / "w2-qwen2-f32.reference", repo_id)
        else:
            r = run_cli("merge", fixtures_root / "w2-qwen2-f32", "-o", out, "--hf-upload",
                        repo_id, "--private")
    assert r.returncode == 2, r.stderr
    [line] = r.stderr.splitlines()
    assert line.startswith(f"shardscope: {repo_id!r} is not a Hub repository id (")
    assert "retry" not in line and r.stdout == ""
    assert hub.paths == [] and not out.exists()


@pytest.mark.parametrize("n", [33, 99999])
def test_sample_refuses_an_absurd_world_size_before_spawning(tmp_path, monkeypatch, n):
    """Each rank is a process: 99999 once started thousands. The refusal comes before
    write_sample (replaced here by a stand-in that records its calls: nothing is spawned)."""
    from shardscope.core import sample

    calls = []
    monkeypatch.setattr(sample, "write_sample", lambda *a, **k: calls.append((a, k)))
    monkeypatch.setattr(sample, "write_checkpoints", lambda *a, **k: calls.append((a, k)))
    r = run_cli("sample", tmp_path / "x", "--world-size", n)
    assert (r.returncode, r.stdout) == (2, ""), r.stderr
    assert r.stderr.startswith(f"shardscope: --world-size must be at most 32 (got {n}): ")
    assert len(r.stderr.splitlines()) == 1
    assert calls == [] and not (tmp_path / "x").exists()
    r = run_cli("sample", tmp_path / "x", "--world-size", 32)  # the bound itself is accepted
    assert r.returncode == 0, r.stderr
    assert calls == [((str(tmp_path / "x"),), {"world_size": 32, "reference": None})]


def test_sample_bound_is_the_smallest_sharded_dim():
    """32 = rows of the sample model's smallest tensor (k_proj, v_proj), the dim FSDP2 cuts."""
    from shardscope.core.sample import Variant, build_model
    from shardscope.tui.cli import SAMPLE_MAX_WORLD_SIZE

    model = build_model(Variant("ckpt"))
    assert SAMPLE_MAX_WORLD_SIZE == min(t.shape[0] for t in model.state_dict().values()) == 32


def test_sample_megatron_without_megatron_core_says_how_to_install(tmp_path, monkeypatch):
    """Not "No module named 'megatron'": the pip command of the extra, exit 2, nothing made."""
    import sys

    for name in [m for m in sys.modules if m == "megatron" or m.startswith("megatron.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "megatron", None)  # as if it were not installed
    r = run_cli("sample", tmp_path / "mg", "--megatron", "llama")
    assert (r.returncode, r.stdout) == (2, "")
    assert r.stderr == ("shardscope: --megatron needs megatron-core, which is not installed: "
                        "pip install 'shardscope[megatron]'\n")
    assert not (tmp_path / "mg").exists()


@pytest.mark.parametrize("megatron", [False, True])
@pytest.mark.parametrize("where", ["inside", "itself", "reference"])
def test_sample_into_a_file_says_it_is_a_file(tmp_path, monkeypatch, megatron, where):
    """`sample README.md/x` said "[Errno 17] File exists: 'README.md'" after its minute of
    work; now it says README.md is a file, at once (nothing spawned: the writers are
    replaced by stand-ins that record their calls)."""
    from shardscope.core import sample, sample_megatron

    calls = []
    monkeypatch.setattr(sample, "write_sample", lambda *a, **k: calls.append(a))
    monkeypatch.setattr(sample_megatron, "write_megatron", lambda *a, **k: calls.append(a))
    (tmp_path / "README.md").write_text("hi\n")
    if megatron and where == "reference":
        pytest.skip("--megatron writes its reference inside PATH")
    target = {"inside": ("README.md/x",), "itself": ("README.md",),
              "reference": ("new", "--reference", "README.md/sub/ref")}[where]
    r = run_cli("sample", *target, *(("--megatron", "llama") if megatron else ()),
                cwd=tmp_path)
    assert (r.returncode, r.stdout) == (2, ""), r.stderr
    if where == "itself":
        assert r.stderr == "shardscope: README.md: is a file, not a folder; choose a new folder\n"
    else:
        assert r.stderr == (f"shardscope: README.md: is a file, not a folder, so {target[-1]} "
                            "cannot be made inside it\n")
    assert "Errno" not in r.stderr and calls == []


def test_help_names_every_format_and_matches_the_package_description():
    """`shardscope --help` and pyproject.toml's description name what is read (DeepSpeed and
    Megatron were missing); inspect --hf-config is not described as Megatron's alone."""
    import re
    import tomllib

    from conftest import ROOT

    text = " ".join(run_cli("--help").stdout.split())
    described = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["description"]
    for fmt in ("FSDP", "DCP", "DeepSpeed", "Megatron", "Hugging Face"):
        assert fmt in text and fmt in described
    assert described in text
    hf = " ".join(run_cli("inspect", "--help").stdout.split())
    hf = re.search(r"--hf-config DIR (.*?) --deep", hf).group(1)
    assert not hf.startswith("Megatron")
    for fmt in ("DCP", "DeepSpeed", "Megatron", "torchtitan", ".pt"):
        assert fmt in hf
