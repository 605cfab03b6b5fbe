"""``merge --distributed``: one merge run by several processes (one per node, launched by
``torchrun`` or ``srun``) when the rank files of a checkpoint live on node-local disks.

Each process reads the per-rank FSDP files it can see under PATH on its own node (PATH may hold
``{node_rank}``, ``{rank}``, ``{local_rank}``, replaced from the launcher's environment), the
processes exchange their layouts (``all_gather_object`` over gloo), and every process judges
the *union*: a rank that no node holds is refused, naming it, by every process (exit 3). Then
one writer, global rank 0, plans the merge on the union layout and writes the output exactly as
a single-machine merge does (temporary folder, renamed into place when complete); the pieces it
lacks are requested from the process that holds them, piece by piece (``torch.distributed``
``send``/``recv`` of bytes), so memory stays bounded by the tensors in flight; pieces on its own
disk are read (or kernel-copied) directly.

Launcher facts (torch/distributed/run.py and torch/distributed/elastic/agent/server/api.py,
torch 2.13): torchrun sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``GROUP_RANK`` (the node
rank), ``MASTER_ADDR``, ``MASTER_PORT`` for each worker. SLURM's ``srun`` sets
``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``, ``SLURM_NODEID`` (``MASTER_ADDR`` and
``MASTER_PORT`` are the user's to export). torch is imported lazily.
"""

from __future__ import annotations

import os
import socket
import threading
from dataclasses import dataclass, field, replace
from pathlib import Path

from .errors import BadCheckpointError, ShardscopeError, UsageError
from .layout import CheckpointLayout, Problem, coverage_problems

#: the global rank that writes the output
WRITER = 0
#: request opcodes sent by the writer: stop serving / send the bytes of a piece
OP_STOP, OP_READ = 0, 1
#: per-rank file formats that ``--distributed`` merges
SUPPORTED = "per-rank FSDP files (verl's model_world_size_W_rank_r.pt, accelerate's " \
            "pytorch_model_fsdp_N_rankR.bin)"


class NodeLostError(ShardscopeError):
    """A process of the merge stopped (killed, network lost) before the output was complete;
    nothing was left at the output."""

    exit_code = 1
    code = "node-lost"


@dataclass(frozen=True)
class ProcessInfo:
    """Where a process of the merge runs: global rank, node rank, local rank, host name, and
    the checkpoint folder it reads (PATH with its placeholders replaced)."""

    rank: int
    world_size: int
    node_rank: int
    local_rank: int
    host: str
    path: str

    @property
    def label(self) -> str:
        return f"rank {self.rank} (node {self.node_rank}, {self.host})"


def _env_int(env, *names: str) -> int | None:
    for n in names:
        v = env.get(n)
        if v not in (None, ""):
            try:
                return int(v)
            except ValueError:
                raise UsageError(f"environment variable {n}={v!r} is not an integer") from None
    return None


def process_info(path: str, env=None) -> ProcessInfo:
    """This process's place in the launch, from torchrun's (``RANK``, ``WORLD_SIZE``,
    ``LOCAL_RANK``, ``GROUP_RANK``) or SLURM's (``SLURM_PROCID``, ...) environment, and
    ``path`` with ``{node_rank}``, ``{rank}``, ``{local_rank}`` replaced. Raises
    :class:`UsageError` when not launched by either, or ``path`` has another placeholder."""
    env = os.environ if env is None else env
    rank = _env_int(env, "RANK", "SLURM_PROCID")
    world = _env_int(env, "WORLD_SIZE", "SLURM_NTASKS")
    if rank is None or world is None:
        raise UsageError("--distributed: RANK and WORLD_SIZE are not set; launch with torchrun "
                         "(or srun with MASTER_ADDR/MASTER_PORT exported)")
    local = _env_int(env, "LOCAL_RANK", "SLURM_LOCALID")
    node = _env_int(env, "GROUP_RANK", "NODE_RANK", "SLURM_NODEID")
    local = 0 if local is None else local
    node = rank if node is None else node
    try:
        resolved = path.format(node_rank=node, rank=rank, local_rank=local)
    except (KeyError, IndexError, ValueError) as e:
        raise UsageError(f"PATH may hold {{node_rank}}, {{rank}}, {{local_rank}} only ({e})",
                         path) from None
    return ProcessInfo(rank, world, node, local, socket.gethostname(), resolved)


def read_local(info: ProcessInfo) -> CheckpointLayout:
    """The layout of the rank files this process sees (``fsdp.read(present_only=True)``); an
    empty layout (world size 0) when its folder holds none. Raises
    :class:`BadCheckpointError` for a checkpoint of another format (named)."""
    from .formats import _files_inside, detect, fsdp
    from .formats.common import attach_config

    p = Path(info.path)
    if p.is_file():
        p = p.parent
    if fsdp.sniff(str(p)):
        layout = fsdp.read(str(p), present_only=True)
        _files_inside(layout, p)
        return layout
    if p.is_dir() and any(p.iterdir()):
        try:
            other = detect(str(p)).format
        except ShardscopeError:
            other = None
        if other:
            raise BadCheckpointError(f"--distributed merges {SUPPORTED} only; this is a {other} "
                                     "checkpoint (merge it on one machine)", str(p),
                                     code="unsupported-distributed")
    layout = CheckpointLayout(format="fsdp", path=str(p), world_size=0)
    hf = p / "huggingface"
    attach_config(layout, hf if hf.is_dir() else None)
    return layout


@dataclass
class Union:
    """The union of every process's layout: ``layout`` (pieces held by another process have
    ``file`` = ``rank{k}:{path}``), ``remote`` (per global rank k, its files the writer asks
    for, by index) and ``held`` (per global rank, the checkpoint ranks it holds)."""

    layout: CheckpointLayout
    remote: dict[int, list[str]] = field(default_factory=dict)
    held: dict[int, list[int]] = field(default_factory=dict)


def remote_tag(rank: int, path: str) -> str:
    return f"rank{rank}:{path}"


def union_layout(parts: list[tuple[ProcessInfo, CheckpointLayout]], template: str) -> Union:
    """Judge the processes' layouts together (``parts`` in global-rank order, the writer's
    first): same world size and mesh, every checkpoint rank held by some process
    (``missing-rank`` otherwise, naming who holds what), every tensor's pieces tiling it.
    Deterministic, so every process computes the same union."""
    writer_info, writer = parts[0]
    from .formats.fsdp import ACCELERATE_RE

    worlds = sorted({lay.world_size for _, lay in parts if lay.world_size})
    world = worlds[0] if worlds else 0
    if worlds and all(ACCELERATE_RE.match(Path(f.path).name) for _, lay in parts
                      for f in lay.files):
        # accelerate's names hold no world size: each process took its highest rank + 1
        world, worlds = worlds[-1], worlds[-1:]
    out = CheckpointLayout(format="fsdp", path=template, world_size=world)
    out.config_dir, out.extra_files = writer.config_dir, list(writer.extra_files)
    out.notes = list(writer.notes)
    res = Union(out)
    if len(worlds) > 1:
        out.problems.append(Problem("world-size-mismatch", "the processes see rank files of "
                                    "world sizes " + ", ".join(
                                        f"{lay.world_size} ({info.label})" for info, lay in parts
                                        if lay.world_size), template))
    seen: set[tuple] = set()
    keys_by_rank: dict[int, set[str]] = {}
    for info, lay in parts:
        res.held[info.rank] = sorted(f.rank for f in lay.files if f.status == "ok"
                                     and f.rank is not None)
        for pr in lay.problems:
            if pr.code != "missing-rank":
                out.problems.append(replace(pr, message=f"{pr.message} (on {info.label})"))
        if not lay.world_size:
            continue
        if lay.mesh_shape and not out.mesh_shape:
            out.mesh_shape, out.mesh_dim_names = lay.mesh_shape, lay.mesh_dim_names
            out.parallel = dict(lay.parallel)
        elif lay.mesh_shape and (lay.mesh_shape, lay.mesh_dim_names) != (
                out.mesh_shape, out.mesh_dim_names):
            out.problems.append(Problem("mesh-mismatch", f"device mesh {lay.mesh_shape} "
                                        f"{lay.mesh_dim_names} on {info.label}, "
                                        f"{out.mesh_shape} {out.mesh_dim_names} elsewhere",
                                        lay.path))
        if not out.parallel and lay.parallel:
            out.parallel = dict(lay.parallel)
        for r, keys in getattr(lay, "keys_by_rank", {}).items():
            keys_by_rank.setdefault(r, keys)
        for f in lay.files:
            if f.rank is not None and not any(g.rank == f.rank for g in out.files):
                out.files.append(replace(f, path=f.path if info.rank == WRITER
                                         else remote_tag(info.rank, f.path)))
        remote: set[str] = set()
        for name, t in lay.tensors.items():
            u = out.tensors.get(name)
            if u is None:
                u = out.tensors[name] = replace(t, pieces=[])
            elif (u.shape, u.dtype, u.placement) != (t.shape, t.dtype, t.placement):
                out.problems.append(Problem(
                    "rank-disagreement", f"{name}: {t.shape} {t.dtype} {t.placement} on "
                    f"{info.label}, {u.shape} {u.dtype} {u.placement} on another process",
                    lay.path))
                continue
            for pc in t.pieces:
                key = (name, pc.global_offsets, pc.shape)
                if key in seen:  # a copy another process holds too (or an HSDP replica)
                    continue
                seen.add(key)
                if info.rank != WRITER:
                    remote.add(pc.file)
                    pc = replace(pc, file=remote_tag(info.rank, pc.file))
                u.pieces.append(pc)
        if remote:
            res.remote[info.rank] = sorted(remote)
    out.files.sort(key=lambda f: f.rank)
    held_text = "; ".join(f"{info.label} has " + (
        "ranks " + ", ".join(map(str, res.held[info.rank])) if res.held[info.rank] else "none")
        for info, _ in parts)
    if not world:
        out.problems.append(Problem("missing-rank", f"no process sees any rank file ({held_text})",
                                    template))
    missing = [r for r in range(world) if not any(f.rank == r for f in out.files)]
    if missing:
        shown = ", ".join(map(str, missing[:16])) + (" ..." if len(missing) > 16 else "")
        out.problems.append(Problem(
            "missing-rank", f"rank{'s' if len(missing) > 1 else ''} {shown} of {world} "
            f"{'are' if len(missing) > 1 else 'is'} on no node ({held_text})", template))
    all_keys = set().union(*keys_by_rank.values()) if keys_by_rank else set()
    for r, keys in sorted(keys_by_rank.items()):
        if keys != all_keys:
            miss = sorted(all_keys - keys)
            out.problems.append(Problem("key-mismatch", f"rank {r} lacks {len(miss)} keys "
                                        f"(e.g. {miss[0]})", template))
    if writer.config_dir is None and any(lay.config_dir for _, lay in parts[1:]):
        holder = next(info for info, lay in parts[1:] if lay.config_dir)
        out.problems.append(Problem(
            "no-config", f"the config folder (huggingface/) is on {holder.label} only; the "
            f"writer ({writer_info.label}) needs a copy, or pass --hf-config", template))
    if not any(p.code in ("missing-rank", "unreadable-file", "truncated-file", "unsafe-pickle")
               for p in out.problems):
        for t in out.tensors.values():
            out.problems.extend(coverage_problems(t))
    out.notes.append("rank files read by several processes: " + held_text)
    return res


class RemoteSources:
    """Source bytes for the writer: local files are read from disk, files tagged
    ``rank{k}:{path}`` are requested from process ``k`` (one request and one reply at a time,
    so worker threads never interleave messages)."""

    def __init__(self, remote: dict[int, list[str]], labels: dict[int, str]):
        from .execute import _Sources

        self._local = _Sources()
        self.index = {remote_tag(k, f): (k, i) for k, files in remote.items()
                      for i, f in enumerate(files)}
        self.labels = labels
        self.lock = threading.Lock()
        self.fetched = 0

    def fd(self, path: str) -> int:
        return self._local.fd(path)

    def local(self, path: str) -> bool:
        return path not in self.index

    def read(self, path: str, n: int, offset: int):
        where = self.index.get(path)
        if where is None:
            return self._local.read(path, n, offset)
        if n == 0:
            return bytearray()
        import torch
        import torch.distributed as dist

        k, i = where
        with self.lock:
            try:
                dist.send(torch.tensor([OP_READ, i, offset, n], dtype=torch.int64), dst=k)
                buf = torch.empty(n, dtype=torch.uint8)
                dist.recv(buf, src=k)
            except RuntimeError as e:
                raise NodeLostError(f"lost {self.labels.get(k, f'rank {k}')} while fetching "
                                    f"its piece ({str(e).splitlines()[0][:120]}); nothing was "
                                    "written", path) from None
            self.fetched += n
        return buf.numpy()

    def close(self):
        self._local.close()


def serve(files: list[str]) -> tuple[int, int]:
    """Run on a process that is not the writer: answer the writer's piece requests from the
    local ``files`` until it says stop. Returns (pieces sent, bytes sent)."""
    import torch
    import torch.distributed as dist

    from .execute import _pread_exact

    fds: dict[int, int] = {}
    pieces = sent = 0
    try:
        while True:
            req = torch.empty(4, dtype=torch.int64)
            try:
                dist.recv(req, src=WRITER)
            except RuntimeError as e:
                raise NodeLostError(f"lost the writer (rank {WRITER}) during the merge "
                                    f"({str(e).splitlines()[0][:120]})") from None
            op, i, offset, n = req.tolist()
            if op == OP_STOP:
                return pieces, sent
            if not 0 <= i < len(files):
                raise NodeLostError(f"the writer asked for file {i} of {len(files)}")
            if i not in fds:
                try:
                    fds[i] = os.open(files[i], os.O_RDONLY)
                except OSError as e:
                    raise BadCheckpointError(f"cannot open: {e.strerror}", files[i]) from None
            data = _pread_exact(fds[i], n, offset, files[i])
            try:
                dist.send(torch.frombuffer(data, dtype=torch.uint8), dst=WRITER)
            except RuntimeError as e:
                raise NodeLostError(f"lost the writer (rank {WRITER}) during the merge "
                                    f"({str(e).splitlines()[0][:120]})") from None
            pieces += 1
            sent += n
    finally:
        for fd in fds.values():
            os.close(fd)


def _error_of(e: BaseException) -> tuple[int, str, str | None, str]:
    if isinstance(e, ShardscopeError):
        return e.exit_code, e.message, e.path, e.code
    if isinstance(e, KeyboardInterrupt):
        return 130, "interrupted; nothing was written", None, "interrupted"
    return 1, f"unexpected error ({type(e).__name__}: {e})", None, "error"


def _raise(err: tuple[int, str, str | None, str], prefix: str = "") -> None:
    code, message, path, kind = err
    e = ShardscopeError(prefix + message, path, code=kind)
    e.exit_code = code
    raise e


def merge_distributed(path: str, options, log=None, on_progress=None, cancel=None,
                      hf_config: str | None = None, timeout_s: float | None = None):
    """Merge a checkpoint whose rank files are spread over the nodes of a launch.

    Called by every process of the launch with the same arguments. Returns
    ``(info, result, stats)``: on the writer ``result`` is the :class:`MergeResult` and
    ``stats`` None; on the others ``result`` is None and ``stats`` (pieces, bytes) they sent.
    Raises on every process the same error when the union is incomplete or bad (exit 3), when
    planning fails, or when the writer fails. ``timeout_s``: how long one collective or one
    piece request may wait (gloo's timeout; a process serving pieces waits between the
    writer's requests while it writes its own pieces), default ``SHARDSCOPE_DIST_TIMEOUT``
    seconds or 4 hours.
    """
    from datetime import timedelta

    import torch.distributed as dist

    from .formats import finish_layout
    from .plan import plan_merge

    info = process_info(path)
    if not os.environ.get("MASTER_ADDR") or not os.environ.get("MASTER_PORT"):
        raise UsageError("--distributed: MASTER_ADDR and MASTER_PORT are not set (torchrun sets "
                         "them; with srun export them)")
    if timeout_s is None:
        try:
            timeout_s = float(os.environ.get("SHARDSCOPE_DIST_TIMEOUT", 4 * 3600))
        except ValueError:
            raise UsageError("SHARDSCOPE_DIST_TIMEOUT must be a number of seconds") from None
    dist.init_process_group("gloo", init_method="env://", rank=info.rank,
                            world_size=info.world_size, timeout=timedelta(seconds=timeout_s))
    try:
        try:
            mine = ("ok", read_local(info))
        except ShardscopeError as e:
            mine = ("error", _error_of(e))
        if log:
            log(f"{info.label}: read {info.path}")
        gathered: list = [None] * info.world_size
        dist.all_gather_object(gathered, (info, mine))
        for other, (kind, val) in gathered:
            if kind == "error":
                _raise(val, f"on {other.label}: " if other.rank != info.rank else "")
        parts = [(other, val) for other, (_, val) in gathered]
        u = union_layout(parts, path)
        layout = finish_layout(u.layout, hf_config)
        if layout.errors:  # every process refuses alike, before anything is written
            first = layout.errors[0]
            more = (f" (and {len(layout.errors) - 1} more problems)"
                    if len(layout.errors) > 1 else "")
            raise BadCheckpointError(first.message + more, first.path or path,
                                     code=first.code)
        plan, err = None, None
        if info.rank == WRITER:
            try:
                plan = plan_merge(layout, options)
            except ShardscopeError as e:
                err = _error_of(e)
        box = [err]
        dist.broadcast_object_list(box, src=WRITER)
        if box[0] is not None:
            _raise(box[0])
        if info.rank != WRITER:
            stats = serve(u.remote.get(info.rank, []))
            box = [None]
            dist.broadcast_object_list(box, src=WRITER)
            if box[0] is not None:
                _raise(box[0], f"the writer ({gathered[WRITER][0].label}) stopped: ")
            return info, None, stats
        return info, _write(plan, u, gathered, on_progress, cancel, log), None
    finally:
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - a lost peer may leave the group broken
            pass


def _write(plan, u: Union, gathered, on_progress, cancel, log):
    """The writer's part: run the merge with remote sources, then tell the others to stop and
    how it ended."""
    import torch
    import torch.distributed as dist

    from .execute import run_merge

    src = RemoteSources(u.remote, {o.rank: o.label for o, _ in gathered})
    status = None
    try:
        return run_merge(plan, on_progress=on_progress, cancel=cancel, log=log, sources=src)
    except BaseException as e:
        status = _error_of(e)
        raise
    finally:
        try:
            for other, _ in gathered:
                if other.rank != WRITER:
                    dist.send(torch.tensor([OP_STOP, 0, 0, 0], dtype=torch.int64),
                              dst=other.rank)
            dist.broadcast_object_list([status], src=WRITER)
        except RuntimeError:
            pass  # a process already gone: its launcher reports it
