"""Upload to a stand-in Hub on loopback (HF_ENDPOINT): what huggingface_hub sends is recorded;
no test reaches a network. The model card."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import ROOT
from fake_hub import FakeHub

SECRET = "hf_test_token_never_printed_123"


def cli(hub, *args):
    env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_TOKEN": SECRET,
           "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HOME": str(Path(ROOT, ".pytest_cache", "hf"))}
    r = subprocess.run([sys.executable, "-m", "tui.cli", *args], cwd=ROOT, capture_output=True,
                       text=True, env=env, timeout=300)
    assert SECRET not in r.stdout + r.stderr
    return r


def folder_files(out: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for p in out.rglob("*") if p.is_file()}


def test_merge_and_upload(fixtures_root, tmp_path):
    out = tmp_path / "out"
    with FakeHub() as hub:
        r = cli(hub, "merge", str(fixtures_root / "w2-qwen2-f32"), "-o", str(out),
                "--hf-upload", "my-org/tiny", "--private", "--revision", "v1",
                "--commit-message", "first merge")
    assert r.returncode == 0, r.stderr
    assert "uploaded to" in r.stdout
    [repo] = hub.repos
    assert (repo["name"], repo["organization"]) == ("tiny", "my-org")
    assert repo.get("visibility") == "private" or repo.get("private") is True
    assert hub.branches == ["my-org/tiny@v1"]
    [commit] = hub.commits
    assert commit["repo"] == "my-org/tiny" and commit["revision"] == "v1"
    assert commit["header"]["summary"] == "first merge"
    assert commit["files"] == folder_files(out)  # every file, byte for byte
    assert "README.md" in commit["files"] and b"Qwen2ForCausalLM" in commit["files"]["README.md"]
    assert set(hub.auth) == {f"Bearer {SECRET}"}


def test_upload_refuses_a_folder_that_fails_verification(fixtures_root, tmp_path):
    out = tmp_path / "out"
    with FakeHub() as hub:
        assert cli(hub, "merge", str(fixtures_root / "w4-fsdp2"), "-o", str(out),
                   "--max-shard-size", "150KB").returncode == 0
        victim = sorted(out.glob("model-*.safetensors"))[1]
        victim.unlink()
        r = cli(hub, "upload", str(out), "me/broken")
    assert r.returncode == 3 and "not uploaded" in r.stderr and victim.name in r.stderr
    assert hub.commits == [] and hub.repos == []


def test_failed_upload_keeps_the_folder_and_says_how_to_retry(fixtures_root, tmp_path):
    out = tmp_path / "out"
    with FakeHub(fail_commits=10) as hub:
        r = cli(hub, "merge", str(fixtures_root / "w2-qwen2-f32"), "-o", str(out),
                "--hf_upload_path", "me/tiny")
        assert r.returncode == 4, r.stderr
        assert f"retry with `shardscope upload {out} me/tiny`" in r.stderr
        assert (out / "model.safetensors").is_file()
        hub.fail_commits = 0
        r = cli(hub, "upload", str(out), "me/tiny")
    assert r.returncode == 0, r.stderr
    assert hub.commits[-1]["files"] == folder_files(out)


def test_model_card_and_no_card(fixtures_root, tmp_path):
    with FakeHub() as hub:
        assert cli(hub, "merge", str(fixtures_root / "w2-lora-qv"), "-o", str(tmp_path / "a"),
                   "--lora", "fold").returncode == 0
        assert cli(hub, "merge", str(fixtures_root / "w2-qwen2-f32"), "-o",
                   str(tmp_path / "b"), "--no-card").returncode == 0
    card = (tmp_path / "a" / "README.md").read_text()
    assert "| source format | fsdp |" in card and "fold (default: r=8, alpha=16" in card
    assert not (tmp_path / "b" / "README.md").exists()
