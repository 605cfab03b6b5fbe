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
from .layout import CheckpointLayout, Piece, Problem, coverage_problems

#: problems of a rank file that leave its pieces unknown
UNREADABLE = ("unreadable-file", "truncated-file", "unsafe-pickle", "unsupported-record")

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
    for, by index) and ``held`` (per global rank, the checkpoint ranks it holds).

    HSDP with ranks on no node (every shard still has a copy on another replica): ``served``
    says which ranks are missing and which rank's file, on which process, serves each;
    ``replicas`` lists every copy of each place held more than once (place key ``(tensor,
    global offsets, shape)`` -> ``[(global rank of the holder, piece with its local path)]``),
    to be compared byte for byte (:func:`replica_digests`, :func:`disagreeing`) before the
    copies stand in for the missing ranks."""

    layout: CheckpointLayout
    remote: dict[int, list[str]] = field(default_factory=dict)
    held: dict[int, list[int]] = field(default_factory=dict)
    served: str | None = None
    replicas: dict[tuple, list[tuple[int, Piece]]] = field(default_factory=dict)

    def owner(self, file: str) -> int:
        """The global rank of the process holding a piece's ``file`` (the writer's files are
        plain paths, the others' ``rank{k}:{path}``)."""
        if not hasattr(self, "_owners"):
            self._owners = {remote_tag(k, f): k for k, fs in self.remote.items() for f in fs}
        return self._owners.get(file, WRITER)


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
    kinds: dict[int, set[str]] = {}  # placement kinds per mesh dim, over every process
    holders: dict[tuple, list[tuple[int, Piece]]] = {}  # every copy of each place
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
        for i, ks in getattr(lay, "kinds_by_dim", {}).items():
            kinds.setdefault(i, set()).update(ks)
        for name, _, pc in getattr(lay, "replica_copies", []):  # copies on this node's ranks
            holders.setdefault((name, pc.global_offsets, pc.shape), []).append((info.rank, pc))
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
                holders.setdefault(key, []).append((info.rank, pc))
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
    unreadable = any(p.code in UNREADABLE for p in out.problems)
    replica_dims = [i for i, n in enumerate(out.mesh_shape) if kinds.get(i) == {"Replicate"}
                    and n > 1]
    if missing and replica_dims and len(missing) < world and not unreadable:
        _serve_from_replicas(res, parts, missing, replica_dims, holders)
    elif not unreadable and not any(p.code == "missing-rank" for p in out.problems):
        for t in out.tensors.values():
            out.problems.extend(coverage_problems(t))
    out.notes.append("rank files read by several processes: " + held_text)
    return res


def _serve_from_replicas(res: Union, parts, missing: list[int], replica_dims: list[int],
                         holders: dict) -> None:
    """HSDP with ranks on no node, as the one-machine reader does (core/formats/fsdp.py,
    ``_serve_from_replicas``) but over every node's files: the mesh dims in ``replica_dims``
    only ever hold ``Replicate``, so a missing rank is no loss while some node holds another
    replica of each of its shards. When every tensor is tiled exactly, ``missing-rank``
    becomes a warning and ``res.served`` names the rank file (and the process) serving each
    missing rank; the copies are compared later, over the process group. Otherwise a
    ``lost-shard`` error names a tensor lacking a piece."""
    from .formats.fsdp import _unravel

    out = res.layout
    world, shape = out.world_size, out.mesh_shape
    shown = ", ".join(map(str, missing[:16])) + (" ..." if len(missing) > 16 else "")
    ranks = f"rank{'s' if len(missing) > 1 else ''} {shown} of {world}"

    def place(rank: int) -> tuple:  # the mesh coordinate without its replica dims
        return tuple(c for i, c in enumerate(_unravel(rank, shape)) if i not in replica_dims)

    gaps = [p for t in out.tensors.values() for p in coverage_problems(t)]
    if gaps:
        present = {place(f.rank) for f in out.files if f.rank is not None}
        names = out.mesh_dim_names or tuple(f"dim {i}" for i in range(len(shape)))
        kept = [i for i in range(len(shape)) if i not in replica_dims]
        lost = sorted({place(r) for r in missing} - present)
        where = "; ".join(
            ", ".join(f"{names[i]} {c}" for i, c in zip(kept, pl)) + " (ranks " + ", ".join(
                str(r) for r in range(world) if place(r) == pl) + ")" for pl in lost[:4])
        out.problems.insert(0, Problem(
            "lost-shard", f"{ranks} {'are' if len(missing) > 1 else 'is'} on no node and no "
            f"node holds any HSDP replica of the shard at {where or 'some place'}: "
            f"{len(gaps)} tensors lack a piece, e.g. {gaps[0].message}", out.path))
        out.problems.extend(gaps)
        return

    labels = {info.rank: info.label for info, _ in parts}
    by_place: dict[tuple, set[tuple[int, int]]] = {}
    for t in out.tensors.values():
        for pc in t.pieces:
            if pc.rank is not None:
                by_place.setdefault(place(pc.rank), set()).add((pc.rank, res.owner(pc.file)))
    served = []
    for r in missing:
        by = sorted(by_place.get(place(r), ()))
        served.append(f"rank {r} by " + (", ".join(f"rank {q}'s file on {labels[k]}"
                                                   for q, k in by) or "the others"))
    for p in out.problems:
        if p.code == "missing-rank":
            p.severity = "warning"
            p.message += " (HSDP: another replica holds its shards)"
    res.replicas = {k: v for k, v in holders.items() if len(v) > 1}
    res.served = (f"HSDP: {ranks} {'are' if len(missing) > 1 else 'is'} on no node; every "
                  f"shard has a copy on another replica ({'; '.join(served[:8])}"
                  f"{' ...' if len(served) > 8 else ''})")
    out.notes.append(res.served)


def _digest(handles: dict, p: Piece) -> str:
    """BLAKE2b of a piece's elements in C order (and its dtype), read through its strides."""
    import hashlib

    from .formats.fsdp import _handle

    h = hashlib.blake2b(p.dtype.encode(), digest_size=16)
    if p.contiguous:
        f, left, pos = _handle(handles, p.file), p.nbytes, p.byte_offset
        while left:
            f.seek(pos)
            block = f.read(min(left, 1 << 24))
            if not block:
                raise BadCheckpointError(f"ends inside a stored tensor (byte {pos})", p.file,
                                         code="truncated-file")
            h.update(block)
            left -= len(block)
            pos += len(block)
    else:  # through its strides, by the merge's strided reader
        from .execute import _piece_bytes, _Sources

        sources = _Sources()
        try:
            h.update(_piece_bytes(p, sources).tobytes())
        finally:
            sources.close()
    return h.hexdigest()


def replica_digests(u: Union, rank: int) -> list[tuple[tuple, str]]:
    """The digests of every replica copy process ``rank`` holds (``(place key, digest)``;
    see :attr:`Union.replicas`); reads those pieces' bytes from the local disk."""
    handles: dict = {}
    try:
        return [(key, _digest(handles, pc)) for key, copies in u.replicas.items()
                for owner, pc in copies if owner == rank]
    finally:
        for f in handles.values():
            f.close()


def disagreeing(digests: list[list[tuple[tuple, str]]]) -> list[str]:
    """Names of the tensors whose replica copies differ, from every process's
    :func:`replica_digests` (in global-rank order)."""
    seen: dict[tuple, set[str]] = {}
    for mine in digests:
        for key, d in mine:
            seen.setdefault(key, set()).add(d)
    return sorted({key[0] for key, ds in seen.items() if len(ds) > 1})


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


@dataclass(frozen=True)
class NodeProgress:
    """Progress of one process of a distributed merge, passed to ``on_progress`` (from the
    writer's worker threads, or a serving process's main thread).

    ``rank``/``node_rank``/``label``: the process. ``writer``: it is the process writing the
    output (its ``done`` counts the bytes of pieces read from its own disk; another process's
    ``done`` counts the bytes it sent). ``done``/``total``: bytes of rank-file pieces so far / in
    all (``total`` from the writer's plan; ``done`` never exceeds it). The writer reports every
    process's line (each remote process's bytes as it receives them); every other process
    reports its own.
    """

    rank: int
    node_rank: int
    label: str
    writer: bool
    done: int
    total: int


def serve(files: list[str], log=None, report=None) -> tuple[int, int]:
    """Run on a process that is not the writer: answer the writer's piece requests from the
    local ``files`` until it says stop. ``log`` gets one line per request (before its bytes
    are sent), ``report(pieces, bytes)`` the counts after each. Returns (pieces sent, bytes
    sent)."""
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
                                    f"({str(e).splitlines()[0][:120]}); it leaves nothing "
                                    "at the output") from None
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
            if log:
                log(f"sending {n} bytes of {files[i]} at byte {offset}")
            try:
                dist.send(torch.frombuffer(data, dtype=torch.uint8), dst=WRITER)
            except RuntimeError as e:
                raise NodeLostError(f"lost the writer (rank {WRITER}) during the merge "
                                    f"({str(e).splitlines()[0][:120]}); it leaves nothing "
                                    "at the output") from None
            pieces += 1
            sent += n
            if report:
                report(pieces, sent)
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


def _gather_or_raise(value, world_size: int, label) -> list:
    """``all_gather_object`` of ``("ok", value)`` or ``("error", (exit code, message, path,
    code))``: every process raises the first error, naming the process it came from."""
    import torch.distributed as dist

    gathered: list = [None] * world_size
    dist.all_gather_object(gathered, value)
    for k, (kind, val) in enumerate(gathered):
        if kind == "error":
            _raise(val, f"on {label(k)}: " if label(k) else "")
    return [val for _, val in gathered]


def _try(fn, *args):
    """``("ok", fn(*args))``, or ``("error", ...)`` for every process to raise alike (a
    process that raised alone would leave the others waiting at the next collective)."""
    try:
        return ("ok", fn(*args))
    except Exception as e:  # noqa: BLE001 - sent to every process, see _error_of
        if isinstance(e, OSError):
            e = BadCheckpointError(f"cannot read: {e.strerror}", e.filename)
        return ("error", _error_of(e))


def merge_distributed(path: str, options, log=None, on_progress=None, cancel=None,
                      hf_config: str | None = None, timeout_s: float | None = None):
    """Merge a checkpoint whose rank files are spread over the nodes of a launch.

    Called by every process of the launch with the same arguments. Returns
    ``(info, result, stats, warnings)``: on the writer ``result`` is the :class:`MergeResult`
    and ``stats`` None; on the others ``result`` is None and ``stats`` (pieces, bytes) they
    sent. ``warnings``: what every process says (ranks on no node served by HSDP replicas).
    ``on_progress`` receives :class:`NodeProgress` (the writer: one per process; the
    others: their own) and, on the writer, the :class:`MergeProgress` of the output.
    Raises on every process the same error when the union is incomplete or bad (exit 3:
    ``missing-rank``, ``lost-shard``, ``replica-mismatch``...), when planning fails, or when
    the writer fails. ``timeout_s``: how long one collective or one piece request may wait
    (gloo's timeout; a process serving pieces waits between the writer's requests while it
    writes its own pieces), default ``SHARDSCOPE_DIST_TIMEOUT`` seconds or 4 hours.
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
        mine = _try(read_local, info)
        if log:
            log(f"{info.label}: read {info.path}")
        gathered: list = [None] * info.world_size
        dist.all_gather_object(gathered, (info, mine))
        for other, (kind, val) in gathered:
            if kind == "error":
                _raise(val, f"on {other.label}: " if other.rank != info.rank else "")
        infos = [other for other, _ in gathered]
        parts = [(other, val) for other, (_, val) in gathered]
        u = union_layout(parts, path)
        layout = finish_layout(u.layout, hf_config)
        if layout.errors:  # every process refuses alike, before anything is written
            raise _refusal(layout, path)
        warnings: list[str] = []
        if u.served is not None:  # HSDP copies stand in for missing ranks: they must agree
            if log:
                log(f"{info.label}: comparing the HSDP replica copies it holds")
            digests = _gather_or_raise(_try(replica_digests, u, info.rank), info.world_size,
                                       lambda k: infos[k].label if k != info.rank else "")
            bad = disagreeing(digests)
            if bad:
                raise BadCheckpointError(
                    f"{bad[0]}: the HSDP replicas on the nodes differ, so the copies that "
                    f"stand in for the ranks on no node cannot be trusted ({len(bad)} tensors "
                    f"differ; {u.served[6:]})", path, code="replica-mismatch")
            n = sum(len(c) for c in u.replicas.values())
            warnings.append(f"{u.served}; the {n} replica copies present agree byte for byte")
        plan, err = None, None
        if info.rank == WRITER:
            try:
                plan = plan_merge(layout, options)
            except ShardscopeError as e:
                err = _error_of(e)
        totals: dict[int, int] = {}
        if plan is not None:
            for f, n in plan.source_bytes.items():
                totals[u.owner(f)] = totals.get(u.owner(f), 0) + n
        box = [(err, totals)]
        dist.broadcast_object_list(box, src=WRITER)
        err, totals = box[0]
        if err is not None:
            _raise(err)
        if info.rank != WRITER:
            total = totals.get(info.rank, 0)

            def report(pieces: int, sent: int, done: bool = False) -> None:
                if on_progress:
                    on_progress(NodeProgress(info.rank, info.node_rank, info.label, False,
                                             total if done else min(sent, total), total))

            report(0, 0)
            stats = serve(u.remote.get(info.rank, []), log, report)
            box = [None]
            dist.broadcast_object_list(box, src=WRITER)
            if box[0] is not None:
                _raise(box[0], f"the writer ({infos[WRITER].label}) stopped: ")
            report(*stats, done=True)
            return info, None, stats, warnings
        result = _write(plan, u, infos, totals, on_progress, cancel, log)
        result.warnings[:0] = warnings
        return info, result, None, warnings
    finally:
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - a lost peer may leave the group broken
            pass


def _refusal(layout: CheckpointLayout, path: str) -> BadCheckpointError:
    first = layout.errors[0]
    more = f" (and {len(layout.errors) - 1} more problems)" if len(layout.errors) > 1 else ""
    return BadCheckpointError(first.message + more, first.path or path, code=first.code)


def _write(plan, u: Union, infos: list[ProcessInfo], totals: dict[int, int], on_progress,
           cancel, log):
    """The writer's part: run the merge with remote sources (reporting each process's line
    from the pieces it provided), then tell the others to stop and how it ended."""
    import torch
    import torch.distributed as dist

    from .execute import MergeProgress, run_merge

    src = RemoteSources(u.remote, {o.rank: o.label for o in infos})
    status = None
    progress = None
    if on_progress:
        lock = threading.Lock()
        read: dict[str, int] = {}
        done = {o.rank: 0 for o in infos}

        def line(k: int) -> NodeProgress:
            o = infos[k]
            return NodeProgress(o.rank, o.node_rank, o.label, o.rank == WRITER,
                                min(done[k], totals.get(k, 0)), totals.get(k, 0))

        for o in infos:
            on_progress(line(o.rank))

        def progress(ev: MergeProgress) -> None:
            if ev.source:
                with lock:  # in order: a line never goes back
                    k = u.owner(ev.source)
                    prev = read.get(ev.source, 0)
                    if ev.source_read > prev:  # worker threads may report out of order
                        done[k] += ev.source_read - prev
                        read[ev.source] = ev.source_read
                    on_progress(line(k))
            on_progress(ev)
    try:
        return run_merge(plan, on_progress=progress, cancel=cancel, log=log, sources=src)
    except BaseException as e:
        status = _error_of(e)
        raise
    finally:
        try:
            for other in infos:
                if other.rank != WRITER:
                    dist.send(torch.tensor([OP_STOP, 0, 0, 0], dtype=torch.int64),
                              dst=other.rank)
            dist.broadcast_object_list([status], src=WRITER)
        except RuntimeError:
            pass  # a process already gone: its launcher reports it
