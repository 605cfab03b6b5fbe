"""``merge --distributed``: several processes (standing in for nodes), each seeing a different
subset of a real FSDP2 checkpoint's rank files as its local disk, merge it bit-exactly; a rank
no process holds is refused by every process; a process lost mid-merge leaves nothing."""

from __future__ import annotations

import filecmp
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from test_merge_exact import assert_bit_equal, load

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def node_disks(src: Path, root: Path, ranks_by_node: list[list[int]], config_on=(0,)) -> Path:
    """``root/node{i}`` holding copies of ``src``'s rank files ``ranks_by_node[i]`` (copies, not
    symbolic links: a link leading out of the checkpoint is refused), fsdp_config.json on every
    node and huggingface/ on the nodes ``config_on``."""
    from core.formats.fsdp import ACCELERATE_RE, VERL_RE

    files = {int((VERL_RE.match(f.name) or ACCELERATE_RE.match(f.name))[2]): f
             for f in src.iterdir() if VERL_RE.match(f.name) or ACCELERATE_RE.match(f.name)}
    for i, ranks in enumerate(ranks_by_node):
        d = root / f"node{i}"
        d.mkdir(parents=True)
        if (src / "fsdp_config.json").is_file():
            shutil.copy(src / "fsdp_config.json", d)
        for r in ranks:
            shutil.copy(files[r], d)
        if i in config_on and (src / "huggingface").is_dir():
            shutil.copytree(src / "huggingface", d / "huggingface")
    return root


def torchrun(nproc: int, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node",
         str(nproc), "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
         "-m", "tui.cli", *args], cwd=ROOT, capture_output=True, text=True, timeout=600)


def launch(nproc: int, *args: str) -> list[subprocess.Popen]:
    """The processes torchrun would start (same environment variables), started directly so
    each one's exit code and output can be checked."""
    port = str(free_port())
    procs = []
    for r in range(nproc):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(nproc), LOCAL_RANK=str(r),
                   GROUP_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        procs.append(subprocess.Popen([sys.executable, "-m", "tui.cli", *args], cwd=ROOT,
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    return procs


@pytest.mark.parametrize("name,ranks_by_node", [
    # rank 1 on both nodes (taken once); the writer holds ranks 0 and 1
    ("w4-fsdp2", [[0, 1], [1, 2, 3]]),
    # world size 3 on 2 nodes, uneven: the writer holds one rank in the middle only
    ("w3-llama-f32", [[1], [0, 2]]),
    # accelerate's names hold no world size: node 0 alone would take it for 1
    ("w2-accelerate-rank", [[0], [1]]),
])
def test_union_of_node_disks_merges_bit_exactly(fixtures_root, tmp_path, name, ranks_by_node):
    src = fixtures_root / name
    ref = fixtures_root / f"{name}.reference"
    node_disks(src, tmp_path / "ckpt", ranks_by_node)
    out = tmp_path / "out"
    cfg = src / "huggingface" if (src / "huggingface").is_dir() else ref
    extra = () if cfg != ref else ("--hf-config", str(ref))
    r = torchrun(2, "merge", str(tmp_path / "ckpt" / "node{rank}"), "-o", str(out),
                 "--distributed", *extra)  # not -q: the summary lines are checked
    assert r.returncode == 0, r.stdout + r.stderr
    assert "rank 0 (node 0" in r.stdout and "wrote" in r.stdout
    assert "rank 1 (node 0" in r.stdout and "pieces" in r.stdout
    assert_bit_equal(load(out), load(ref))
    for f in cfg.iterdir():
        if f.suffix == ".safetensors":
            continue
        assert filecmp.cmp(f, out / f.name, shallow=False), f.name
    assert not list(tmp_path.glob(".out.shardscope-tmp-*"))


def test_rank_on_no_node_is_refused_by_every_process(fixtures_root, tmp_path):
    node_disks(fixtures_root / "w4-fsdp2", tmp_path / "ckpt", [[0, 1], [3]])
    out = tmp_path / "out"
    procs = launch(2, "merge", str(tmp_path / "ckpt" / "node{rank}"), "-o", str(out),
                   "--distributed")
    for p in procs:
        stdout, stderr = p.communicate(timeout=600)
        assert p.returncode == 3, stdout + stderr
        assert "rank 2 of 4 is on no node" in stderr, stderr
        assert "has ranks 0, 1" in stderr and "has ranks 3" in stderr, stderr
        assert "Traceback" not in stderr
    assert not out.exists() and not list(tmp_path.glob(".out.shardscope-tmp-*"))


def test_other_formats_are_refused_by_name(fixtures_root, tmp_path):
    procs = launch(1, "merge", str(fixtures_root / "w2-dcp"), "-o", str(tmp_path / "out"),
                   "--distributed")
    stdout, stderr = procs[0].communicate(timeout=600)
    assert procs[0].returncode == 3, stdout + stderr
    assert "dcp checkpoint" in stderr and "per-rank FSDP files" in stderr, stderr
    assert not (tmp_path / "out").exists()


def test_without_a_launcher_is_a_usage_error(fixtures_root, tmp_path):
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS")}
    r = subprocess.run([sys.executable, "-m", "tui.cli", "merge", str(fixtures_root / "w4-fsdp2"),
                        "-o", str(tmp_path / "out"), "--distributed"], cwd=ROOT, env=env,
                       capture_output=True, text=True)
    assert r.returncode == 2 and "torchrun" in r.stderr, r.stderr


def test_path_placeholders_come_from_the_launcher():
    from core.distributed import process_info

    env = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "GROUP_RANK": "2"}
    info = process_info("/ckpt/node{node_rank}/r{rank}-l{local_rank}", env)
    assert (info.path, info.rank, info.world_size, info.node_rank) == ("/ckpt/node2/r5-l1", 5,
                                                                       8, 2)
    slurm = {"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "0", "SLURM_NODEID": "3"}
    assert process_info("/d/{node_rank}", slurm).path == "/d/3"
    from core import UsageError

    with pytest.raises(UsageError):
        process_info("/d/{host}", env)


def test_process_lost_mid_merge_leaves_nothing(fixtures_root, tmp_path):
    """Rank 1's files are cut short after it has read their layout (it logs that with -v) and
    before the writer asks for their bytes: rank 1 stops naming the file, the writer loses it
    mid-merge, and neither OUT nor a temporary folder is left."""
    node_disks(fixtures_root / "w4-fsdp2", tmp_path / "ckpt", [[0, 1], [2, 3]])
    out = tmp_path / "out"
    procs = launch(2, "merge", str(tmp_path / "ckpt" / "node{rank}"), "-o", str(out),
                   "--distributed", "-v")
    lines = []
    for line in procs[1].stderr:
        lines.append(line)
        if "read " in line:
            break
    else:
        pytest.fail("".join(lines))
    for f in (tmp_path / "ckpt" / "node1").glob("model_world_size_4_rank_*.pt"):
        os.truncate(f, 4096)
    results = [p.communicate(timeout=600) for p in procs]
    err0, err1 = results[0][1], "".join(lines) + results[1][1]
    assert procs[1].returncode == 3, err1
    assert "node1/model_world_size_4_rank_" in err1 and "truncated" in err1, err1
    assert procs[0].returncode == 1, err0
    assert "lost rank 1" in err0 and "nothing was written" in err0, err0
    assert "Traceback" not in err0 + err1
    assert not out.exists() and not list(tmp_path.glob(".out.shardscope-tmp-*"))


def _parts(root: Path, n: int):
    from core.distributed import ProcessInfo, read_local

    infos = [ProcessInfo(r, n, r, 0, "host", str(root / f"node{r}")) for r in range(n)]
    return [(i, read_local(i)) for i in infos]


def test_union_is_judged_in_process(fixtures_root, tmp_path):
    """The union without a process group: rank files of two world sizes, and a config folder
    the writer lacks, are named."""
    from core.distributed import union_layout

    node_disks(fixtures_root / "w4-fsdp2", tmp_path / "a", [[0, 1], [2, 3]], config_on=(1,))
    u = union_layout(_parts(tmp_path / "a", 2), "a/node{rank}")
    assert [p.code for p in u.layout.errors] == ["no-config"], u.layout.errors
    assert "on rank 1 (node 1, host) only" in u.layout.errors[0].message
    assert u.remote == {1: sorted(str(tmp_path / "a" / "node1" / f"model_world_size_4_rank_{r}.pt")
                                 for r in (2, 3))}
    assert u.held == {0: [0, 1], 1: [2, 3]}

    node_disks(fixtures_root / "w4-fsdp2", tmp_path / "b", [[0, 1, 2, 3]])
    node_disks(fixtures_root / "w3-llama-f32", tmp_path / "c", [[], [0, 1, 2]], config_on=())
    shutil.copytree(tmp_path / "c" / "node1", tmp_path / "b" / "node1")
    u = union_layout(_parts(tmp_path / "b", 2), "b/node{rank}")
    assert "world-size-mismatch" in [p.code for p in u.layout.errors], u.layout.errors
