"""Upload to a stand-in Hub on loopback (HF_ENDPOINT): what huggingface_hub sends is recorded;
no test reaches a network. The model card."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT
from shardscope.core import publish
from shardscope.core.publish import UploadError, upload, upload_files
from fake_hub import FakeHub

SECRET = "hf_test_token_never_printed_123"


def cli(hub, *args):
    env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_TOKEN": SECRET,
           "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HOME": str(Path(ROOT, ".pytest_cache", "hf"))}
    r = subprocess.run([sys.executable, "-m", "shardscope.tui.cli", *args], cwd=ROOT,
                       capture_output=True,
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


def merged(fixtures_root, out, name="w4-fsdp2", *args) -> Path:
    """``shardscope merge`` of fixture ``name`` into ``out`` (several shards for w4-fsdp2)."""
    with FakeHub() as hub:
        r = cli(hub, "merge", str(fixtures_root / name), "-o", str(out), *args)
    assert r.returncode == 0, r.stderr
    return out


def in_process(monkeypatch, hub, xet=True) -> None:
    """Point this process's huggingface_hub at ``hub`` (``xet=False``: plain LFS transfers,
    which the stand-in serves)."""
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", hub.url)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_DISABLE_XET", not xet)
    monkeypatch.setenv("HF_TOKEN", SECRET)


def test_progress_counts_the_bytes_that_reach_the_hub(fixtures_root, tmp_path, monkeypatch):
    out = merged(fixtures_root, tmp_path / "out", "w4-fsdp2", "--max-shard-size", "150KB")
    sizes = {rel: p.stat().st_size for rel, p in upload_files(str(out))}
    shards = [rel for rel in sizes if rel.endswith(".safetensors")]
    total = sum(sizes.values())
    assert len(shards) > 2
    calls: list[tuple[int, int]] = []
    with FakeHub(lfs=True, fail_commits=10) as hub:
        in_process(monkeypatch, hub, xet=False)
        with pytest.raises(UploadError, match="retry with"):
            upload(str(out), "me/steps", progress=lambda *a: calls.append(a))
        assert sorted(hub.puts) == sorted(hub.lfs) and len(hub.puts) == len(shards)
        assert hub.commits == [] and calls[-1] == (sum(sizes[s] for s in shards), total)
        hub.fail_commits = 0
        calls.clear()
        url = upload(str(out), "me/steps", progress=lambda *a: calls.append(a))
    assert url.startswith(hub.url)
    assert len(hub.puts) == len(shards)  # the re-run resumed: no shard was sent again
    assert hub.commits[-1]["files"] == folder_files(out)
    # one step per shard (its size, when it is on the Hub), the small files with the commit
    assert calls[0] == (0, total) and calls[-1] == (total, total)
    assert {t for _, t in calls} == {total}
    steps = [b - a for (a, _), (b, _) in zip(calls, calls[1:])]
    assert steps == [sizes[s] for s in shards] + [total - sum(sizes[s] for s in shards)]


def test_large_folder_upload_resumes_and_leaves_the_folder_sound(fixtures_root, tmp_path,
                                                                 monkeypatch):
    """Above LARGE (made tiny here) the resumable upload is used: ``upload_large_folder``
    before huggingface_hub 1.20, which keeps its state in ``.cache/huggingface/`` inside the
    folder; from 1.20 ``upload_folder`` (resumable itself). Either way that cache must not be
    uploaded, nor confuse verification, and the folder must not change."""
    import huggingface_hub

    out = merged(fixtures_root, tmp_path / "out")
    cache = out / ".cache" / "huggingface" / "upload"  # as an interrupted upload leaves it
    cache.mkdir(parents=True)
    (cache / "model.safetensors.index.json.metadata").write_text("1700000000.0\n0\n")
    files = {rel: p.read_bytes() for rel, p in upload_files(str(out))}
    assert len(files) == len(folder_files(out)) - 1  # all but the cache
    monkeypatch.setattr(publish, "LARGE", 1)
    large = not publish._has_resumable_upload_folder()
    used = []
    for name in ("upload_folder", "upload_large_folder"):
        real = getattr(huggingface_hub.HfApi, name, None)
        if real is not None:
            def spy(self, *a, _real=real, _name=name, **kw):
                used.append(_name)
                return _real(self, *a, **kw)
            monkeypatch.setattr(huggingface_hub.HfApi, name, spy)
    with FakeHub(fail_commits=10) as hub:
        in_process(monkeypatch, hub)
        if large:  # upload_large_folder retries failed commits itself, until the hub is back
            upload(str(out), "me/large")
        else:
            with pytest.raises(UploadError, match="retry with"):
                upload(str(out), "me/large")
            hub.fail_commits = 0
        upload(str(out), "me/large")  # the re-run resumes
        assert cli(hub, "verify", str(out)).returncode == 0
    assert used == ["upload_large_folder" if large else "upload_folder"] * 2
    sent = {f: b for c in hub.commits for f, b in c["files"].items()}
    assert sent == files  # byte for byte, and nothing from .cache/
    assert {rel: p.read_bytes() for rel, p in upload_files(str(out))} == files  # unchanged


def test_retry_hint_repeats_every_option_shell_quoted(fixtures_root, tmp_path, monkeypatch):
    """A failed upload's retry command repeats --private, --revision and --commit-message (a
    retry that dropped --private would create the repository public) and quotes the folder
    and values: run as printed, it lands where the first attempt was meant to."""
    import re
    import shlex

    from conftest import run_cli

    out = tmp_path / "out dir"
    want = ["shardscope", "upload", str(out), "me/x", "--private", "--revision", "dev",
            "--commit-message", "hi there"]
    with FakeHub(fail_commits=10) as hub:
        in_process(monkeypatch, hub)
        r = run_cli("merge", fixtures_root / "w2-qwen2-f32", "-o", out, "--hf-upload", "me/x",
                    "--private", "--revision", "dev", "--commit-message", "hi there")
        assert r.returncode == 4, r.stderr
        [retry] = re.findall(r"retry with `([^`]*)`", r.stderr)
        assert shlex.split(retry) == want
        hub.fail_commits = 0
        r = run_cli(*shlex.split(retry)[1:])
        assert r.returncode == 0, r.stderr
    assert all(repo.get("visibility") == "private" or repo.get("private") is True
               for repo in hub.repos)
    assert hub.commits[-1]["revision"] == "dev"
    assert hub.commits[-1]["header"]["summary"] == "hi there"
