"""The persistent architecture cache (core/archcache.py): a warm plan gives exactly what a cold
one gives, on real checkpoints (a tied model, a VLM whose names are renamed, fused experts cut
per expert, T5's tied aliases, Megatron with a derived config); a changed config or another
transformers version misses; a damaged entry is rebuilt; an unwritable folder is no error; a
warm merge in a fresh process imports no transformers."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT
from shardscope.core import BadCheckpointError, MergeOptions, archcache, detect, judge, plan_merge


def _fresh(monkeypatch, cache: Path | str) -> None:
    """Point the cache at ``cache`` and forget what this process already built."""
    monkeypatch.setenv("SHARDSCOPE_CACHE", str(cache))
    monkeypatch.setattr(judge, "_cache", {})
    monkeypatch.setattr(judge, "_models", {})


def _no_transformers(monkeypatch) -> None:
    """Make any use of transformers by the judge fail the test (a warm plan must not)."""
    def fail(*a, **k):
        raise AssertionError("the warm plan asked transformers")

    monkeypatch.setattr(judge, "candidates", fail)
    monkeypatch.setattr(judge, "build_model", fail)


def _summary(plan) -> tuple:
    """Everything a plan decides, comparable with ``==``."""
    files = [(f.name, [(t.name, t.shape, t.dtype, t.source.name, t.source.placement,
                        repr(t.pieces)) for t in f.tensors]) for f in plan.files]
    return (files, plan.index, plan.warnings, plan.check.to_dict() if plan.check else None,
            plan.config_dtype, sorted(plan.generated))


def _plan(src: Path, out: Path, **kw):
    return plan_merge(detect(str(src), hf_config=kw.get("hf_config")),
                      MergeOptions(output=str(out), **kw))


def _entries(cache: Path) -> list[Path]:
    return sorted(p for p in cache.rglob("*.json") if not p.name.startswith(".tmp"))


def _cold_then_warm(monkeypatch, tmp_path, src, **kw):
    cache = tmp_path / "cache"
    _fresh(monkeypatch, "off")
    reference = _summary(_plan(src, tmp_path / "o0", **kw))  # no persistent cache at all
    _fresh(monkeypatch, cache)
    cold = _summary(_plan(src, tmp_path / "o1", **kw))
    assert _entries(cache), "the cold plan stored nothing"
    _fresh(monkeypatch, cache)
    with monkeypatch.context() as m:
        _no_transformers(m)
        warm = _summary(_plan(src, tmp_path / "o2", **kw))
    assert cold == reference
    assert warm == cold
    return cache, warm


@pytest.mark.parametrize("name", ["w2-qwen2-bf16-tied", "w3-llama-f32"])
def test_warm_plan_equals_cold(fixtures_root, monkeypatch, tmp_path, name):
    _, plan = _cold_then_warm(monkeypatch, tmp_path, fixtures_root / name)
    assert plan[3]["ok"]


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_moe", "t5"])
def test_warm_plan_equals_cold_renamed_cut_and_tied(models_root, monkeypatch, tmp_path,
                                                    family):
    """VLM renames, fused experts cut into per-expert pieces, T5's aliases: all from the
    cache, identical."""
    _, plan = _cold_then_warm(monkeypatch, tmp_path, models_root / family)
    assert plan[3]["ok"]
    tensors = [t for _, ts in plan[0] for t in ts]
    names = {t[0] for t in tensors}
    if family == "qwen2_5_vl":  # the renames, cuts and aliases really came through the cache
        assert any(t[0] != t[3] for t in tensors)
    elif family == "qwen3_moe":
        assert any("cut from" in t[4] for t in tensors)
    else:
        assert "shared.weight" in names and "encoder.embed_tokens.weight" not in names


def test_warm_plan_equals_cold_megatron_derived_config(megatron_root, monkeypatch, tmp_path):
    _, plan = _cold_then_warm(monkeypatch, tmp_path,
                              megatron_root / "llama" / "tp2_pp2" / "legacy")
    assert plan[3]["ok"]


def test_changed_config_value_misses(fixtures_root, monkeypatch, tmp_path):
    """A warm cache of the original config must not vouch for a config whose vocab_size
    differs: the plan refuses as a cold one does."""
    src = fixtures_root / "w2-qwen2-f32"
    cache = tmp_path / "cache"
    _fresh(monkeypatch, cache)
    _plan(src, tmp_path / "o1")
    cfg = tmp_path / "cfg"
    shutil.copytree(src / "huggingface", cfg)
    raw = json.loads((cfg / "config.json").read_text())
    raw["vocab_size"] += 8
    (cfg / "config.json").write_text(json.dumps(raw))
    _fresh(monkeypatch, cache)
    with pytest.raises(BadCheckpointError, match="do not match"):
        _plan(src, tmp_path / "o2", hf_config=str(cfg))


@pytest.mark.parametrize("what", ["transformers", "shardscope code"])
def test_other_transformers_version_misses(fixtures_root, monkeypatch, tmp_path, what):
    src = fixtures_root / "w2-qwen2-f32"
    cache = tmp_path / "cache"
    _fresh(monkeypatch, cache)
    _plan(src, tmp_path / "o1")
    n = len(_entries(cache))
    _fresh(monkeypatch, cache)
    if what == "transformers":
        monkeypatch.setattr(archcache, "_versions", ("0.0.1-other", archcache.versions()[1]))
    else:  # e.g. a fix in how hf_names traces the renames
        monkeypatch.setattr(archcache, "_code_digest", "0" * 64)
    with monkeypatch.context() as m:
        _no_transformers(m)
        with pytest.raises(AssertionError, match="asked transformers"):
            _plan(src, tmp_path / "o2")
    _fresh(monkeypatch, cache)
    _plan(src, tmp_path / "o3")
    assert len(_entries(cache)) == 2 * n  # same answers, stored under the other version


def test_damaged_entries_are_rebuilt(fixtures_root, monkeypatch, tmp_path):
    src = fixtures_root / "w2-qwen2-bf16-tied"
    cache = tmp_path / "cache"
    _fresh(monkeypatch, cache)
    cold = _summary(_plan(src, tmp_path / "o1"))
    entries = _entries(cache)
    for i, p in enumerate(entries):  # truncated, not JSON, another key, a wrong structure
        text = p.read_text()
        p.write_text([text[: len(text) // 2], "\0garbage",
                      json.dumps({"key": "0" * 64, "value": json.loads(text)["value"]}),
                      json.dumps({"key": p.stem, "value": {"tensors": 3}})][i % 4])
    _fresh(monkeypatch, cache)
    assert _summary(_plan(src, tmp_path / "o2")) == cold
    for p in entries:  # rewritten whole
        assert json.loads(p.read_text())["key"] == p.stem
    _fresh(monkeypatch, cache)
    with monkeypatch.context() as m:
        _no_transformers(m)
        assert _summary(_plan(src, tmp_path / "o3")) == cold


def test_unwritable_cache_is_no_error_and_off_writes_nothing(fixtures_root, monkeypatch,
                                                             tmp_path):
    src = fixtures_root / "w2-qwen2-f32"
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    _fresh(monkeypatch, blocker)  # the cache folder cannot be made under a file
    a = _summary(_plan(src, tmp_path / "o1"))
    assert blocker.read_text() == "not a folder"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    _fresh(monkeypatch, "off")
    assert _summary(_plan(src, tmp_path / "o2")) == a
    assert not (tmp_path / "xdg").exists() and not (tmp_path / "home").exists()


def test_cache_location(monkeypatch, tmp_path):
    monkeypatch.setenv("SHARDSCOPE_CACHE", str(tmp_path / "c"))
    assert archcache.cache_dir() == str(tmp_path / "c" / "arch")
    monkeypatch.delenv("SHARDSCOPE_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert archcache.cache_dir() == str(tmp_path / "x" / "shardscope" / "arch")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "h"))
    assert archcache.cache_dir() == str(tmp_path / "h" / ".cache" / "shardscope" / "arch")
    monkeypatch.setenv("SHARDSCOPE_CACHE", "off")
    assert archcache.cache_dir() is None


def test_remote_code_config_is_never_cached(tmp_path):
    cfg = tmp_path / "remote"
    cfg.mkdir()
    (cfg / "config.json").write_text(json.dumps({
        "model_type": "tiny", "architectures": ["TinyForCausalLM"],
        "auto_map": {"AutoModelForCausalLM": "modeling_tiny.TinyForCausalLM"}}))
    assert archcache.config_key(str(cfg), None, True) is None
    assert archcache.config_key(str(cfg), None, False) is None
    (cfg / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    assert archcache.config_key(str(cfg), None, False) != archcache.config_key(str(cfg), None,
                                                                               True)


def test_warm_merge_imports_no_transformers(fixtures_root, monkeypatch, tmp_path):
    """In a fresh process with a warm cache, a keep-dtype merge plans and writes without
    importing transformers or torch, and writes what a cold merge writes."""
    from shardscope.core import run_merge

    src = fixtures_root / "w2-qwen2-bf16-tied"
    _fresh(monkeypatch, tmp_path / "cache")
    run_merge(_plan(src, tmp_path / "o0"))  # cold: fills the cache
    code = ("import sys\nfrom shardscope.tui.cli import main\n"
            "try:\n    main(['merge', sys.argv[1], '-o', sys.argv[2], '-q'])\n"
            "except SystemExit as e:\n    assert not e.code, e.code\n"
            "print([m for m in ('torch', 'transformers') if m in sys.modules])")
    r = subprocess.run([sys.executable, "-c", code, str(src), str(tmp_path / "o1")], cwd=ROOT,
                       capture_output=True, text=True, env=dict(os.environ))
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "[]"
    for name in ("model.safetensors", "config.json"):  # the same output
        assert (tmp_path / "o0" / name).read_bytes() == (tmp_path / "o1" / name).read_bytes()


def test_versions_are_those_importlib_metadata_reads():
    from importlib import metadata

    archcache._versions = None
    assert archcache.versions() == (metadata.version("transformers"), metadata.version("torch"))
    assert archcache._version("no-such-distribution-shardscope") == "?"
