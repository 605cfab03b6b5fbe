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
