"""Damaged real checkpoints and hostile outputs, found by breaking shardscope on purpose
(notes: breaker-findings.md): each refusal is one line naming the real cause, the exit code
blames the right side (2: the output, 3: the checkpoint), nothing is left at the output."""

from __future__ import annotations

import resource
from pathlib import Path

import pytest

from shardscope.core import MergeOptions, detect, plan_merge, run_merge
from shardscope.core.errors import BadCheckpointError, OutputWriteError
from test_deepspeed import ds_root  # noqa: F401 - the fixture


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


def test_two_checkpoints_in_one_folder(fixtures_root, tmp_path):
    """Rank files and a model.safetensors (or a DCP save) in one folder: `inspect` said "no
    problems found" about one of them, never mentioning the other, and naming the other's
    file as PATH still read the first one ("reading the whole checkpoint folder")."""
    import shutil

    src = shutil.copytree(fixtures_root / "w2-qwen2-f32", tmp_path / "ck")
    shutil.copy(fixtures_root / "w2-qwen2-f32.reference" / "model.safetensors", src)
    layout = detect(src)
    assert layout.format.startswith("fsdp")
    [p] = [p for p in layout.problems if p.code == "several-checkpoints"]
    assert p.severity == "warning" and Path(p.path).name == "model.safetensors"
    other = detect(src / "model.safetensors")  # the file named is the checkpoint read
    assert other.format == "hf" and [f.path for f in other.files] == [
        str(src / "model.safetensors")]
    assert {Path(p.path).name for p in other.problems if p.code == "several-checkpoints"} == {
        "model_world_size_2_rank_0.pt"}
    # one rank file is also a single .pt state dict: the same file, not a second checkpoint
    assert not [p for p in detect(fixtures_root / "w1-fsdp2").problems
                if p.code == "several-checkpoints"]
    dcp = shutil.copytree(fixtures_root / "w2-dcp", tmp_path / "dcp")
    for f in (fixtures_root / "w2-qwen2-f32").glob("model_world_size_*"):
        shutil.copy(f, dcp)
    assert {(p.code, Path(p.path).name) for p in detect(dcp).problems} >= {
        ("several-checkpoints", "model_world_size_2_rank_0.pt")}
    assert detect(dcp / "model_world_size_2_rank_1.pt").format.startswith("fsdp")


def test_verify_is_not_ok_over_a_folder_missing_a_tensor(fixtures_root, tmp_path, capsys):
    """A merged folder that lost a tensor the model needs (a tool rewrote model.safetensors
    without it) was `ok` (exit 0) under `verify` without --reference: from_pretrained would
    initialise that tensor randomly. Also one of another shape; an extra tensor only warns."""
    import shutil

    from safetensors.torch import load_file, save_file

    from shardscope.tui.cli import main

    ref = fixtures_root / "w2-qwen2-f32.reference"
    assert main(["verify", str(ref)]) == 0
    assert capsys.readouterr().out.strip().splitlines() == [f"ok {ref}"]
    for name, edit, rc, code in [
            ("missing", lambda sd: sd.pop("model.norm.weight"), 1, "architecture-mismatch"),
            ("shape", lambda sd: sd.update({"model.norm.weight": sd["model.norm.weight"][:3]}),
             1, "architecture-mismatch"),
            ("extra", lambda sd: sd.update({"model.extra.weight": sd["model.norm.weight"]}),
             0, "architecture-extra")]:
        out = shutil.copytree(ref, tmp_path / name)
        sd = load_file(out / "model.safetensors")
        edit(sd)
        save_file({k: v.clone() for k, v in sd.items()}, out / "model.safetensors",
                  metadata={"format": "pt"})
        assert main(["verify", str(out)]) == rc, name
        lines = capsys.readouterr().out.strip().splitlines()
        assert code in lines[0] and "model." in lines[0], lines
        assert not any(line.startswith("ok ") for line in lines), lines


def test_truncated_shard_of_a_sharded_folder_is_one_problem(fixtures_root, tmp_path):
    """A shard of a sharded Hugging Face folder cut by one byte: besides `truncated-file`,
    `inspect` listed an `index-mismatch` ("X is not in <shard>") for every tensor of that
    shard, blaming the index for the truncation; and an index entry's missing shard name read
    "the index says None"."""
    import json
    import shutil

    out = tmp_path / "hf"
    run_merge(plan_merge(detect(fixtures_root / "w2-qwen2-f32"),
                         MergeOptions(str(out), max_shard_size=200_000)))
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 2
    cut = shutil.copytree(out, tmp_path / "cut")
    f = cut / shards[1]
    f.write_bytes(f.read_bytes()[:-1])
    probs = detect(cut).problems
    assert [(p.code, Path(p.path).name) for p in probs] == [("truncated-file", shards[1])], probs
    first = sorted(index["weight_map"])[0]
    del index["weight_map"][first]
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    [p] = detect(out).problems
    assert p.code == "index-mismatch" and p.message.endswith("the index does not name it")


def test_base_model_that_does_not_exist_or_is_a_sharded_checkpoint(fixtures_root, tmp_path):
    """--base-model naming a missing folder said "is not a Hugging Face model folder (no
    config.json)"; naming a sharded checkpoint said the same, not what it is."""
    from shardscope.core.errors import UsageError
    from shardscope.core.plan import _base_model

    with pytest.raises(UsageError, match="no such folder"):
        _base_model(str(tmp_path / "nope"))
    with pytest.raises(UsageError, match="it is a fsdp.* checkpoint; merge it first"):
        _base_model(str(fixtures_root / "w2-qwen2-f32"))


def test_a_rank_file_copied_under_another_ranks_name(fixtures_root, tmp_path):
    """rank 0's file copied as rank 1's (a restore or transfer gone wrong): the merge refused
    with "model.embed_tokens.weight: pieces hold 10624 of 21184 elements", naming rank 0's
    file, 27 coverage gaps and no word of the copy. Now one `duplicate-rank` error names the
    copy and whose shards it holds; an HSDP set (replicas at other coordinates) is sound."""
    import shutil

    src = shutil.copytree(fixtures_root / "w3-llama-f32", tmp_path / "ck")
    shutil.copy(src / "model_world_size_3_rank_0.pt", src / "model_world_size_3_rank_2.pt")
    layout = detect(src)
    assert [(p.code, Path(p.path).name) for p in layout.errors] == [
        ("duplicate-rank", "model_world_size_3_rank_2.pt")], layout.errors
    assert "rank 0's file (model_world_size_3_rank_0.pt)" in layout.errors[0].message
    with pytest.raises(BadCheckpointError, match="duplicate|same shards as rank 0"):
        plan_merge(layout, MergeOptions(str(tmp_path / "out")))
    for name in ("w4-hsdp", "w4-hsdp-other-names", "w2-fsdp1", "w3-buffers"):
        assert not detect(fixtures_root / name).errors, name


def test_deepspeed_latest_naming_a_missing_step(ds_root, tmp_path):
    """A DeepSpeed folder whose `latest` names a step folder that is not there (deleted or not
    copied) was "not a checkpoint itself; these folders inside it are: global_step0/": now
    `latest` is named with the tag it holds; the step folder itself still reads."""
    import shutil

    src = shutil.copytree(ds_root / "ds-z2-w2", tmp_path / "ds")
    (src / "latest").write_text("global_step99")
    with pytest.raises(BadCheckpointError) as e:
        detect(src)
    assert e.value.path == str(src / "latest")
    assert "'global_step99', which is missing" in e.value.message
    assert "global_step0/" in e.value.message
    assert not detect(src / "global_step0").errors


def test_verify_of_a_shard_the_index_leaves_out_is_one_report_exit_1(fixtures_root, tmp_path):
    """Trial report C1: a merged folder (1 kB shards, one tensor each) whose index lost the
    entry of lm_head.weight: `verify OUT` blamed config.json ("the embeddings are untied, but
    there is no lm_head.weight", exit 1) and `verify OUT --reference REF` printed that error
    twice and exited 3. The cause is the index, which leaves out a shard that holds the
    tensor: `index-mismatch` naming the shard, exit 1, one report, with or without
    --reference."""
    import json

    from conftest import run_cli

    out = tmp_path / "m3"
    run_merge(plan_merge(detect(fixtures_root / "w2-qwen2-f32"),
                         MergeOptions(str(out), max_shard_size="1kB")))
    index_file = out / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    shard = index["weight_map"].pop("lm_head.weight")
    assert shard not in index["weight_map"].values()  # the tensor is alone in its shard
    index_file.write_text(json.dumps(index))
    ref = fixtures_root / "w2-qwen2-f32.reference"
    error = (f"error: index-mismatch {out / shard}: holds 1 tensor (lm_head.weight), but "
             "model.safetensors.index.json does not name this shard: from_pretrained does not "
             "load it")
    r = run_cli("verify", out)
    assert (r.returncode, r.stdout.splitlines(), r.stderr) == (
        1, [error, f"not ok {out}: 1 error(s) (index-mismatch)"], ""), r
    r = run_cli("verify", out, "--reference", ref)
    assert (r.returncode, r.stdout.splitlines(), r.stderr) == (
        1, [error, f"not ok {out}: 1 error(s) (index-mismatch); not compared with {ref}"],
        ""), r
    assert [p.code for p in detect(out).problems] == ["index-mismatch"]
