"""``merge --distributed``: several processes (standing in for nodes), each seeing a different
subset of a real FSDP2 checkpoint's rank files as its local disk, merge it bit-exactly; a rank
no process holds is refused by every process; a process lost mid-merge leaves nothing."""

from __future__ import annotations

import filecmp
import os
import re
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
    from shardscope.core.formats.fsdp import ACCELERATE_RE, VERL_RE

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
         "-m", "shardscope.tui.cli", *args], cwd=ROOT, capture_output=True, text=True, timeout=600)


def launch(nproc: int, *args: str, stderr: dict | None = None) -> list[subprocess.Popen]:
    """The processes torchrun would start (same environment variables), started directly so
    each one's exit code and output can be checked (``stderr``: a file descriptor per global
    rank instead of a pipe of its own)."""
    port = str(free_port())
    procs = []
    for r in range(nproc):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(nproc), LOCAL_RANK=str(r),
                   GROUP_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        procs.append(subprocess.Popen([sys.executable, "-m", "shardscope.tui.cli", *args], cwd=ROOT,
                                      env=env, stdout=subprocess.PIPE,
                                      stderr=(stderr or {}).get(r, subprocess.PIPE), text=True))
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
    r = subprocess.run([sys.executable, "-m", "shardscope.tui.cli", "merge",
                        str(fixtures_root / "w4-fsdp2"),
                        "-o", str(tmp_path / "out"), "--distributed"], cwd=ROOT, env=env,
                       capture_output=True, text=True)
    assert r.returncode == 2 and "torchrun" in r.stderr, r.stderr


def test_path_placeholders_come_from_the_launcher():
    from shardscope.core.distributed import process_info

    env = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "GROUP_RANK": "2"}
    info = process_info("/ckpt/node{node_rank}/r{rank}-l{local_rank}", env)
    assert (info.path, info.rank, info.world_size, info.node_rank) == ("/ckpt/node2/r5-l1", 5,
                                                                       8, 2)
    slurm = {"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "0", "SLURM_NODEID": "3"}
    assert process_info("/d/{node_rank}", slurm).path == "/d/3"
    from shardscope.core import UsageError

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
    from shardscope.core.distributed import ProcessInfo, read_local

    infos = [ProcessInfo(r, n, r, 0, "host", str(root / f"node{r}")) for r in range(n)]
    return [(i, read_local(i)) for i in infos]


def test_union_is_judged_in_process(fixtures_root, tmp_path):
    """The union without a process group: rank files of two world sizes, and a config folder
    the writer lacks, are named."""
    from shardscope.core.distributed import union_layout

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


# --- HSDP: a rank file on no node is no loss while another replica holds its shards ---------
# w4-hsdp and w4-hsdp-other-names are real FSDP2 checkpoints on a (2, 2) mesh (replicate,
# shard): ranks r and r + 2 hold the same shard, as two nodes' local disks would in a 2-node
# HSDP run.


def torchrun_nodes(nnodes: int, *args: str, env=None) -> list[tuple[int, str, str]]:
    """One torchrun agent per "node" (``--nnodes N --node-rank i``, one process each, static
    rendezvous at 127.0.0.1), as on a cluster; (exit code, stdout, stderr) of each node."""
    port = str(free_port())
    agents = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nnodes), "--node-rank",
         str(i), "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", port,
         "-m", "shardscope.tui.cli", *args], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, env=env) for i in range(nnodes)]
    outs = [a.communicate(timeout=600) for a in agents]
    return [(a.returncode, *o) for a, o in zip(agents, outs)]


def test_hsdp_rank_on_no_node_is_served_by_a_replica_on_another(fixtures_root, tmp_path):
    """Two torchrun nodes; rank 1's file is on neither, rank 3's copy (on node 1) serves it;
    the copies present are compared across nodes, and each node shows its progress line (the
    writer's node every node's line)."""
    node_disks(fixtures_root / "w4-hsdp", tmp_path / "ckpt", [[0], [2, 3]])
    out = tmp_path / "out"
    nodes = torchrun_nodes(2, "merge", str(tmp_path / "ckpt" / "node{node_rank}"), "-o",
                           str(out), "--distributed",
                           env=dict(os.environ, TTY_COMPATIBLE="1", COLUMNS="160"))  # as a tty
    err = [re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", e) for _, _, e in nodes]  # no escapes
    for (code, stdout, _), e in zip(nodes, err):
        assert code == 0, stdout + e
        assert ("HSDP: rank 1 of 4 is on no node; every shard has a copy on another replica "
                "(rank 1 by rank 3's file on rank 1 (node 1") in e, e
        assert "replica copies present agree byte for byte" in e, e
        assert "Traceback" not in e
    assert_bit_equal(load(out), load(fixtures_root / "w4-hsdp.reference"))
    assert "node 0 rank 0: read on its disk (writer)" in err[0], err[0]
    assert "node 1 rank 1: sent to the writer" in err[0], err[0]
    assert "write 27/27 tensors" in err[0], err[0]
    assert "node 1 rank 1: sent to the writer" in err[1], err[1]
    assert "node 0 rank 0" not in err[1] and "tensors" not in err[1], err[1]  # its own only
    assert "rank 0 (node 0" in nodes[0][1] and "wrote" in nodes[0][1]
    assert "rank 1 (node 1" in nodes[1][1] and "sent 27 pieces" in nodes[1][1]


def test_hsdp_four_nodes_one_without_files(fixtures_root, tmp_path):
    """Four processes, one rank file each but rank 2's on none (and node 2's disk empty): the
    writer reads rank 1 itself and receives ranks 0 (standing in for rank 2) and 3."""
    node_disks(fixtures_root / "w4-hsdp-other-names", tmp_path / "ckpt", [[1], [0], [], [3]])
    out = tmp_path / "out"
    procs = launch(4, "merge", str(tmp_path / "ckpt" / "node{rank}"), "-o", str(out),
                   "--distributed")
    res = [p.communicate(timeout=600) for p in procs]
    for p, (stdout, stderr) in zip(procs, res):
        assert p.returncode == 0, stdout + stderr
        assert "rank 2 by rank 0's file on rank 1 (node 0" in stderr, stderr
    assert "sent 0 pieces" in res[2][0] and "wrote" in res[0][0], res
    assert_bit_equal(load(out), load(fixtures_root / "w4-hsdp-other-names.reference"))


def test_hsdp_three_replicas_on_two_nodes(hsdp6_root, tmp_path):
    """A (3, 2) HSDP mesh, three ranks on no node: node 0 holds rank 0 (shard 0) and rank 3
    (shard 1), node 1 rank 5 (shard 1 again); ranks 2 and 4 are served by rank 0's file,
    rank 1 by rank 3's, and the copies of shard 1 on the two nodes are compared."""
    name = "w6-hsdp-3x2"
    node_disks(hsdp6_root / name, tmp_path / "ckpt", [[0, 3], [5]])
    out = tmp_path / "out"
    procs = launch(2, "merge", str(tmp_path / "ckpt" / "node{rank}"), "-o", str(out),
                   "--distributed")
    for p in procs:
        stdout, stderr = p.communicate(timeout=600)
        assert p.returncode == 0, stdout + stderr
        assert ("HSDP: ranks 1, 2, 4 of 6 are on no node; every shard has a copy on another "
                "replica (rank 1 by rank 3's file on rank 0 (node 0, ") in stderr, stderr
        assert "rank 2 by rank 0's file on rank 0 (node 0" in stderr, stderr
        assert "rank 4 by rank 0's file on rank 0 (node 0" in stderr, stderr
    assert_bit_equal(load(out), load(hsdp6_root / f"{name}.reference"))


def test_hsdp_shard_on_no_node_is_refused_naming_it(fixtures_root, tmp_path):
    """Ranks 1 and 3 hold both copies of shard 1: with neither on any node, every process
    refuses, naming the shard and a tensor that lacks it."""
    node_disks(fixtures_root / "w4-hsdp", tmp_path / "ckpt", [[0], [2]])
    out = tmp_path / "out"
    procs = launch(2, "merge", str(tmp_path / "ckpt" / "node{rank}"), "-o", str(out),
                   "--distributed")
    for p in procs:
        stdout, stderr = p.communicate(timeout=600)
        assert p.returncode == 3, stdout + stderr
        assert ("ranks 1, 3 of 4 are on no node and no node holds any HSDP replica of the "
                "shard at fsdp 1 (ranks 1, 3)") in stderr, stderr
        assert "model.embed_tokens.weight: pieces hold" in stderr, stderr
        assert "Traceback" not in stderr
    assert not out.exists() and not list(tmp_path.glob(".out.shardscope-tmp-*"))


def test_hsdp_copies_are_compared_across_nodes(fixtures_root, tmp_path):
    """The union (without a process group): the copies of node 0's rank 0 and node 1's rank 2
    are listed for comparison; once rank 2's bytes of one tensor differ, that tensor is named."""
    from shardscope.core.distributed import disagreeing, replica_digests, union_layout

    node_disks(fixtures_root / "w4-hsdp", tmp_path / "a", [[0], [2, 3]])
    parts = _parts(tmp_path / "a", 2)
    u = union_layout(parts, "a/node{rank}")
    assert not u.layout.errors, u.layout.errors
    assert [p.severity for p in u.layout.problems if p.code == "missing-rank"] == ["warning"]
    assert "rank 1 by rank 3's file on rank 1 (node 1, host)" in u.served
    digests = [replica_digests(u, k) for k in (0, 1)]
    assert len(digests[0]) == len(digests[1]) == len(u.replicas) > 0
    assert disagreeing(digests) == []
    # damage node 1's copy of one place that node 0 holds too
    key, held = sorted(u.replicas.items())[0]
    piece = next(pc for k, pc in held if k == 1)
    _flip(piece.file, piece.byte_offset)
    assert disagreeing([replica_digests(u, k) for k in (0, 1)]) == [key[0]]


def _flip(path: str, offset: int) -> None:
    """Flip one bit of a stored tensor's byte (the pickle stays sound, only the tensor's bytes
    change, as a disk or copy fault would)."""
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x40]))


@pytest.fixture
def one_process(monkeypatch):
    """The environment of a launch of one process (the process group is made by the merge)."""
    for k, v in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", GROUP_RANK="0",
                     MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port())).items():
        monkeypatch.setenv(k, v)


def test_hsdp_copies_on_one_node_are_compared_and_progress_is_reported(fixtures_root, tmp_path,
                                                                         one_process):
    """One process holding ranks 0, 2, 3 (rank 1 on no node): its own replica copies (ranks
    0 and 2) are compared; the merge reports its node's line up to the planned total and is
    bit-exact; once rank 2's copy of a tensor differs, the merge is refused naming it."""
    from shardscope.core import MergeOptions
    from shardscope.core.distributed import NodeProgress, merge_distributed
    from shardscope.core.execute import MergeProgress

    node_disks(fixtures_root / "w4-hsdp", tmp_path / "ckpt", [[0, 2, 3]])
    events = []
    info, result, stats, warnings = merge_distributed(
        str(tmp_path / "ckpt" / "node{rank}"), MergeOptions(output=str(tmp_path / "out")),
        on_progress=events.append)
    assert stats is None and "rank 1 by rank 3's file on rank 0 (node 0" in warnings[0]
    assert warnings[0] in result.warnings
    assert_bit_equal(load(tmp_path / "out"), load(fixtures_root / "w4-hsdp.reference"))
    lines = [e for e in events if isinstance(e, NodeProgress)]
    assert lines[0].done == 0 and lines[0].writer and lines[0].total > 0
    assert [e.done for e in lines] == sorted(e.done for e in lines)
    assert lines[-1].done == lines[-1].total
    last = [e for e in events if isinstance(e, MergeProgress)][-1]
    assert last.bytes_written == last.bytes_total == result.tensor_bytes

    from shardscope.core.formats import fsdp

    lay = fsdp.read(str(tmp_path / "ckpt" / "node0"), present_only=True)
    name, kept, copy = next(c for c in lay.replica_copies if c[2].rank == 2)
    assert kept.rank == 0
    _flip(copy.file, copy.byte_offset + copy.nbytes - 1)
    from shardscope.core import ShardscopeError

    with pytest.raises(ShardscopeError) as e:
        merge_distributed(str(tmp_path / "ckpt" / "node{rank}"),
                          MergeOptions(output=str(tmp_path / "out2")))
    assert e.value.code == "replica-mismatch" and e.value.exit_code == 3
    assert e.value.message.startswith(f"{name}: the HSDP replicas on the nodes differ")
    assert not (tmp_path / "out2").exists()


def _hold_at_next_line(fd_read: int, fd_write: int, marker: bytes) -> bytes:
    """Read a process's stderr (a pipe) until ``marker`` has been written, then fill the pipe,
    so that the process blocks on its next line of output: with ``-v`` a serving process
    writes one line per piece request, before it sends the bytes."""
    seen = b""
    while marker not in seen:
        chunk = os.read(fd_read, 4096)
        assert chunk, seen.decode(errors="replace")
        seen += chunk
    # a non-blocking writer of its own (the process's end stays blocking)
    filler = os.open(f"/proc/self/fd/{fd_write}", os.O_WRONLY | os.O_NONBLOCK)
    try:
        while True:
            os.write(filler, b"." * 512)
    except BlockingIOError:
        pass
    finally:
        os.close(filler)
    return seen


@pytest.mark.parametrize("killed,sig", [(1, "SIGKILL"), (0, "SIGKILL"), (0, "SIGTERM")])
def test_process_killed_mid_merge_leaves_nothing_at_out(fixtures_root, tmp_path, killed, sig):
    """A signal to one process while the writer waits for a piece from the other node (rank
    1 is held, blocked on its output, after the writer's first request, with the temporary
    folder written to). kill -9 of rank 1: the writer stops naming it (exit 1) and removes
    its temporary folder. kill -9 of the writer: rank 1 stops naming the lost writer (exit 1)
    and only the writer's hidden temporary folder is left (removed by the next merge to OUT).
    SIGTERM to the writer (as torchrun sends when a worker fails): it finishes the piece,
    removes its temporary folder and both exit 130, as a merge on one machine. OUT itself
    never appears."""
    import signal
    import threading
    import time

    from shardscope.core.execute import stale_temp_dirs

    node_disks(fixtures_root / "w4-fsdp2", tmp_path / "ckpt", [[0, 1], [2, 3]])
    out = tmp_path / "out"
    r, w = os.pipe()
    try:
        procs = launch(2, "merge", str(tmp_path / "ckpt" / "node{rank}"), "-o", str(out),
                       "--distributed", "-v", stderr={1: w})
        seen = _hold_at_next_line(r, w, b": read ")
        deadline = time.monotonic() + 300
        while not list(tmp_path.glob(".out.shardscope-tmp-*")):
            assert time.monotonic() < deadline and procs[0].poll() is None, seen
            time.sleep(0.2)
        time.sleep(1)  # the writer waits for rank 1's piece
        assert procs[0].poll() is None and procs[1].poll() is None
        procs[killed].send_signal(getattr(signal, sig))
        if sig == "SIGKILL":
            procs[killed].wait(timeout=60)
    finally:
        os.close(w)
    rest: list[bytes] = []
    drain = threading.Thread(target=lambda: rest.append(os.fdopen(r, "rb").read()))
    drain.start()  # rank 1's stderr, read while it runs on
    outs = {k: procs[k].communicate(timeout=600) for k in (0, 1)
            if sig == "SIGTERM" or k != killed}
    drain.join(timeout=600)
    if 1 in outs:
        outs[1] = (outs[1][0], (seen + b"".join(rest)).decode(errors="replace"))
    for k, (stdout, stderr) in outs.items():
        assert "Traceback" not in stderr, stderr
    assert not out.exists()
    if sig == "SIGTERM":
        assert procs[0].returncode == 130, outs[0]
        assert "interrupted; nothing was written" in outs[0][1], outs[0][1]
        assert procs[1].returncode == 130, outs[1]
        assert "the writer (rank 0 (node 0" in outs[1][1], outs[1][1]
        assert not list(tmp_path.glob(".out.shardscope-tmp-*"))
        return
    stdout, stderr = outs[1 - killed]
    assert procs[1 - killed].returncode == 1, stdout + stderr
    if killed == 1:
        assert "lost rank 1 (node 0" in stderr and "nothing was written" in stderr, stderr
        assert not list(tmp_path.glob(".out.shardscope-tmp-*"))
    else:
        assert "lost the writer (rank 0)" in stderr and "nothing at the output" in stderr, stderr
        left = list(tmp_path.glob(".out.shardscope-tmp-*"))
        assert left and stale_temp_dirs(out) == left  # the next merge to OUT removes it
