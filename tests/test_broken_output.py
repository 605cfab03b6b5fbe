"""Damaged real checkpoints and hostile outputs, found by breaking shardscope on purpose
(notes: breaker-findings.md): each refusal is one line naming the real cause, the exit code
blames the right side (2: the output, 3: the checkpoint), nothing is left at the output."""

from __future__ import annotations

import resource
from pathlib import Path

import pytest

from shardscope.core import MergeOptions, detect, plan_merge, run_merge
from shardscope.core.errors import BadCheckpointError, OutputWriteError


def _no_leftovers(folder: Path) -> bool:
    return not [p for p in folder.iterdir() if "shardscope-tmp" in p.name]


def test_output_disk_full_is_the_outputs_error(fixtures_root, tmp_path):
    """A full disk (here: a file size limit of 64 kB, EFBIG, as a small disk gives ENOSPC)
    while writing model.safetensors was reported as "shardscope: : No space left on device"
    with exit 3, blaming the checkpoint and naming no file."""
    out = tmp_path / "out"
    plan = plan_merge(detect(fixtures_root / "w2-qwen2-f32"), MergeOptions(str(out)))
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, hard))
    try:
        with pytest.raises(OutputWriteError) as e:
            run_merge(plan)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert e.value.exit_code == 2 and e.value.path == str(out)
    assert "cannot write model.safetensors: File too large" in str(e.value)
    assert not out.exists() and _no_leftovers(tmp_path)


def test_unreadable_config_file_blames_the_source(fixtures_root, tmp_path):
    """A file of huggingface/ that cannot be read is the checkpoint's error (exit 3, naming
    it); the output's own write errors are not (above)."""
    src = tmp_path / "ck"
    import shutil

    shutil.copytree(fixtures_root / "w2-qwen2-f32", src)
    plan = plan_merge(detect(src), MergeOptions(str(tmp_path / "out")))
    victim = next(s for s, rel in plan.copy_files if rel == "tokenizer_config.json")
    Path(victim).unlink()
    Path(victim).mkdir()  # cannot be opened as a file, even by root
    with pytest.raises(BadCheckpointError) as e:
        run_merge(plan)
    assert e.value.path == victim and "cannot copy" in str(e.value)
    assert not (tmp_path / "out").exists() and _no_leftovers(tmp_path)
