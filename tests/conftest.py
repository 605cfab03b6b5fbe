"""Fixtures: real checkpoints written by torch.distributed (gloo, CPU) from tiny models, each
with its unsharded reference (``save_pretrained`` of the same model before sharding).

They are written once and cached under ``.pytest_cache/shardscope-fixtures/<key>`` (the key
hashes the variant list and the torch version), so a second run of the suite starts at once.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from dataclasses import asdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# The project installs as one package: the folders core/ and tui/ are shardscope.core and
# shardscope.tui (pyproject.toml). The tests import *this checkout's* folders under those names
# whatever the virtualenv's editable install points at (several git worktrees share one venv):
# tests/shim/shardscope is a regular package whose __path__ is this checkout's root (see its
# docstring). It goes first on sys.path, for this process and for the multiprocessing spawn
# children (they copy sys.path), and first on PYTHONPATH, for the subprocesses the tests start
# (`python -m shardscope.tui.cli`, `python -c`, torchrun), which inherit os.environ. The root
# itself is not put on sys.path: nothing may import a top-level `core` or `tui`.
SHIM = ROOT / "tests" / "shim"
sys.path.insert(0, str(SHIM))
os.environ["PYTHONPATH"] = os.pathsep.join(
    [str(SHIM)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                   if p and p != str(SHIM)])
# The architecture cache (core/archcache.py) of the tests and of the subprocesses they start
# goes to a folder of this session, removed at exit: tests never touch ~/.cache.
import atexit  # noqa: E402
import tempfile  # noqa: E402

_ARCH_CACHE = tempfile.mkdtemp(prefix="shardscope-archcache-")
os.environ["SHARDSCOPE_CACHE"] = _ARCH_CACHE
atexit.register(shutil.rmtree, _ARCH_CACHE, True)
_pkg = sys.modules.get("shardscope")
if _pkg is not None and list(getattr(_pkg, "__path__", [])) != [str(ROOT)]:
    raise RuntimeError(f"`shardscope` was imported from {list(_pkg.__path__)} before "
                       f"tests/conftest.py could point it at {ROOT}")

from shardscope.core.sample import Variant, write_checkpoints  # noqa: E402

#: world size -> variants written by one process group of that size
VARIANTS: dict[int, list[Variant]] = {
    1: [Variant("w1-fsdp2"), Variant("w1-fsdp1", kind="fsdp1", family="llama")],
    2: [
        Variant("w2-qwen2-f32"),
        Variant("w2-qwen2-bf16-tied", dtype="BF16", tie=True, seed=1),
        Variant("w2-fsdp1", kind="fsdp1"),
        Variant("w2-dcp", kind="dcp", family="llama", seed=2),
        Variant("w2-dcp-accelerate", kind="dcp-accelerate", dtype="BF16", seed=3),
        Variant("w2-accelerate-rank", kind="accelerate-rank", seed=4),
        Variant("w2-no-fsdp-config", write_fsdp_config=False, seed=5),
        Variant("w2-lora-qv", lora="qv", seed=30),
        Variant("w2-lora-dora", lora="dora", seed=31),
        Variant("w2-lora-multi", lora="multi", seed=32),
    ],
    3: [
        Variant("w3-llama-f32", family="llama", seed=6),
        Variant("w3-unnamed-bf16-tied", mesh_names=None, dtype="BF16", tie=True, seed=7),
        Variant("w3-fsdp1-bf16", kind="fsdp1", dtype="BF16", seed=8),
        Variant("w3-dcp", kind="dcp", seed=9),
        Variant("w3-dcp-hf", kind="dcp-hf", family="llama", dtype="BF16", seed=13),
        Variant("w3-buffers", buffers=True, seed=14),
        Variant("w3-lora-rslora-bf16", lora="rslora", dtype="BF16", seed=33),
    ],
    4: [
        Variant("w4-hsdp", mesh_shape=(2, 2), mesh_names=("ddp", "fsdp"), seed=10),
        Variant("w4-hsdp-other-names", mesh_shape=(2, 2), mesh_names=("replicate", "shard"),
                family="llama", dtype="BF16", seed=11),
        Variant("w4-fsdp2", seed=12),
    ],
}
ALL = [v for vs in VARIANTS.values() for v in vs if not v.lora]
LORA = [v for vs in VARIANTS.values() for v in vs if v.lora]
BY_NAME = {v.name: v for v in ALL + LORA}


def _cache_root() -> Path:
    import torch

    key = hashlib.sha256(json.dumps(
        [torch.__version__, {w: [asdict(v) for v in vs] for w, vs in VARIANTS.items()},
         (ROOT / "core" / "sample.py").read_text()], sort_keys=True).encode()).hexdigest()[:16]
    base = Path(os.environ.get("SHARDSCOPE_FIXTURES", ROOT / ".pytest_cache" /
                               "shardscope-fixtures"))
    return base / key


def cached(root: Path, write, lock: str = "lock") -> Path:
    """``root``, written once by ``write(tmp)`` into a temporary folder renamed into place
    when complete; a file lock makes one process write while the others wait. The marker
    file ``complete`` records how long the writer took (wall seconds, lock wait excluded):
    the suite's fixture costs, for tuning it."""
    import fcntl
    import time

    root.parent.mkdir(parents=True, exist_ok=True)
    with open(root.parent / lock, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        if not (root / "complete").exists():
            tmp = root.with_name(root.name + f".tmp{os.getpid()}")
            shutil.rmtree(tmp, ignore_errors=True)
            started = time.monotonic()
            write(tmp)
            (tmp / "complete").write_text(f"ok, written in {time.monotonic() - started:.1f} s\n")
            shutil.rmtree(root, ignore_errors=True)
            os.rename(tmp, root)
    return root


@pytest.fixture(scope="session")
def fixtures_root() -> Path:
    """Folder holding every variant's checkpoint (``<name>/``) and reference
    (``<name>.reference/``), written by real torch.distributed runs."""

    def write(tmp: Path) -> None:
        for world, variants in VARIANTS.items():
            write_checkpoints(tmp, world, variants)

    return cached(_cache_root(), write)


@pytest.fixture(scope="session")
def megatron_root() -> Path:
    """Folder holding ``<family>/`` for every family of :mod:`core.sample_megatron` (each
    with ``reference/`` and its layouts' ``torch_dist/`` and ``legacy/``), written by real
    megatron-core on gloo (:func:`fixtures_megatron.write_megatron_groups`: one process group
    for all of them, the tensors byte-identical to one group per family) and cached like
    :func:`fixtures_root`."""
    from importlib.metadata import version

    import torch

    from shardscope.core.sample_megatron import FAMILIES, LAYOUTS
    from fixtures_megatron import write_megatron_groups

    key = hashlib.sha256(json.dumps(
        [torch.__version__, version("megatron-core"),
         (ROOT / "core" / "sample_megatron.py").read_text(),
         (ROOT / "core" / "sample.py").read_text(),
         (ROOT / "tests" / "fixtures_megatron.py").read_text()]).encode()).hexdigest()[:16]

    def write(tmp: Path) -> None:  # every family is TP x PP x EP <= 4: one process group
        write_megatron_groups(tmp, {name: (f, False, LAYOUTS.get(name, [(2, 2, 0, 1, False)]))
                                    for name, f in FAMILIES.items()})

    return cached(_cache_root().parent / f"megatron-{key}", write)


#: HSDP over three replicas (mesh (3, 2)), for merges across nodes with ranks on no node
HSDP6 = Variant("w6-hsdp-3x2", mesh_shape=(3, 2), mesh_names=("replicate", "shard"),
                family="llama", hidden=32, vocab=277, seed=60)


@pytest.fixture(scope="session")
def many16_root() -> Path:
    """``w16-fsdp2/``: 16 rank files of a 3-layer Qwen2 model (vocabulary 500), each written
    by its own (forked) process under torch's ``fake`` process-group backend, each value a
    DTensor of its rank's ``Shard(0)`` rows (bench/write_ckpt.py, the writer of the
    256-rank benchmark). Ranks 10-15 have a longer archive folder name than ranks 0-9
    (``model_world_size_16_rank_10/``); the last rank holds fewer embedding rows (500 is
    not a multiple of 16): other storage sizes."""
    import torch

    code = (ROOT / "bench" / "write_ckpt.py").read_text()
    key = hashlib.sha256(json.dumps([torch.__version__, code]).encode()).hexdigest()[:16]

    def write(tmp: Path) -> None:
        import importlib.util

        spec = importlib.util.spec_from_file_location("shardscope_bench_writer",
                                                      ROOT / "bench" / "write_ckpt.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod  # its worker processes name their function by module
        spec.loader.exec_module(mod)
        mod.write_many_ranks_procs(tmp / "w16-fsdp2", 16, layers=3, vocab=500)

    return cached(_cache_root().parent / f"many16-{key}", write, lock="lock-many16")


@pytest.fixture(scope="session")
def hsdp6_root() -> Path:
    """Folder holding ``w6-hsdp-3x2/`` (real FSDP2 on a (3, 2) ``(replicate, shard)`` mesh,
    6 gloo ranks: ranks 0, 2, 4 hold shard 0, ranks 1, 3, 5 shard 1) and its reference,
    cached with its own key."""
    import torch

    key = hashlib.sha256(json.dumps(
        [torch.__version__, asdict(HSDP6), (ROOT / "core" / "sample.py").read_text()],
        sort_keys=True).encode()).hexdigest()[:16]
    return cached(_cache_root().parent / f"hsdp6-{key}",
                  lambda tmp: write_checkpoints(tmp, 6, [HSDP6]), lock="lock-hsdp6")


@pytest.fixture(scope="session")
def megatron_moe_root() -> Path:
    """Folder holding ``<set>/`` for every MoE set of :mod:`core.sample_megatron_moe` (layer
    count != expert count; grouped GEMM), each laid out like :func:`megatron_root`'s
    families, written by real megatron-core on gloo and cached with its own key."""
    from importlib.metadata import version

    import torch

    from shardscope.core.sample_megatron_moe import MOE_SETS
    from fixtures_megatron import write_megatron_groups

    key = hashlib.sha256(json.dumps(
        [torch.__version__, version("megatron-core")] + [
            (ROOT / "core" / n).read_text() for n in
            ("sample_megatron_moe.py", "sample_megatron.py", "sample.py")] +
        [(ROOT / "tests" / "fixtures_megatron.py").read_text()]).encode()
    ).hexdigest()[:16]

    def write(tmp: Path) -> None:  # one process group per world size (fixtures_megatron)
        write_megatron_groups(tmp, MOE_SETS)

    return cached(_cache_root().parent / f"megatron-moe-{key}", write, lock="lock-moe")


@pytest.fixture(scope="session")
def models_root() -> Path:
    """Folder holding ``<family>/`` (a verl-layout FSDP2 checkpoint) and
    ``<family>.reference/`` (``save_pretrained``) for every family of
    :mod:`core.sample_models` (VLMs, fused-expert MoEs, T5), written by real torch.distributed
    runs and cached like :func:`fixtures_root`."""
    from importlib.metadata import version

    import torch

    from shardscope.core.sample_models import write_deepspeed_moe, write_models

    key = hashlib.sha256(json.dumps(
        [torch.__version__, version("transformers"),
         (ROOT / "core" / "sample_models.py").read_text(),
         (ROOT / "core" / "sample.py").read_text()]).encode()).hexdigest()[:16]

    def write(tmp: Path) -> None:
        write_models(tmp)
        write_deepspeed_moe(tmp)

    return cached(_cache_root().parent / f"models-{key}", write, "lock-models")


@pytest.fixture(scope="session")
def lora_root() -> Path:
    """Folder holding every spec of :mod:`core.sample_lora` (real peft models sharded by
    FSDP2 on gloo, with peft's merge_and_unload, adapter folder and the untouched base beside
    each), cached like :func:`fixtures_root`."""
    from importlib.metadata import version

    import torch

    from shardscope.core.sample_lora import SPECS, write_lora_checkpoints

    key = hashlib.sha256(json.dumps(
        [torch.__version__, version("peft"), version("transformers"),
         (ROOT / "core" / "sample_lora.py").read_text(),
         (ROOT / "core" / "sample.py").read_text()]).encode()).hexdigest()[:16]

    def write(tmp: Path) -> None:
        for world, specs in SPECS.items():
            write_lora_checkpoints(tmp, world, specs)

    return cached(_cache_root().parent / f"lora-{key}", write, lock="lock-lora")


@pytest.fixture(scope="session")
def training_root(fixtures_root) -> Path:
    """``step1/`` and ``step2/``: two steps of real training of ``w2-qwen2-f32.reference``
    (:mod:`fixtures_diff`), cached with its own key."""
    from importlib.metadata import version

    import torch

    from fixtures_diff import write_training_steps

    key = hashlib.sha256(json.dumps(
        [torch.__version__, version("transformers"), fixtures_root.name,
         (ROOT / "tests" / "fixtures_diff.py").read_text()]).encode()).hexdigest()[:16]

    def write(tmp: Path) -> None:
        write_training_steps(fixtures_root / "w2-qwen2-f32.reference", tmp)

    return cached(_cache_root().parent / f"training-{key}", write, lock="lock-training")


def flip_largest_storage(f: Path, base: int = 0, length: int | None = None) -> tuple[int, int]:
    """Flip one byte in the middle of the largest storage record of the torch.save zip at byte
    ``base`` of ``f`` (``length`` bytes; None: to the end of the file — a DCP .distcp file holds
    one such archive per chunk), as a bad disk or copy does: the record's CRC-32 then fails.
    Returns (absolute byte where that record's data starts, its size)."""
    import os
    import struct
    import zipfile

    from shardscope.core.formats.torchsave import _Window

    with open(f, "r+b") as fh:
        size = os.fstat(fh.fileno()).st_size
        z = zipfile.ZipFile(_Window(fh, base, (size - base) if length is None else length))
        info = max((i for i in z.infolist() if "/data/" in i.filename),
                   key=lambda i: i.file_size)
        fh.seek(base + info.header_offset)
        n, m = struct.unpack("<HH", fh.read(30)[26:30])
        data = base + info.header_offset + 30 + n + m
        pos = data + info.file_size // 2
        fh.seek(pos)
        b = fh.read(1)
        fh.seek(pos)
        fh.write(bytes([b[0] ^ 0x5A]))
    return data, info.file_size


def run_cli(*args, cwd: str | os.PathLike | None = None) -> "subprocess.CompletedProcess":
    """``shardscope ARGS`` run in this process: :func:`shardscope.tui.cli.main` with stdout and
    stderr captured, as a ``CompletedProcess`` (returncode, stdout, stderr; an argparse exit
    is its code). For the tests about what a command prints and returns, not about the
    process: starting ``python -m shardscope.tui.cli`` costs a second or more of imports each
    time (torch and transformers for a check or a verify), this the first time only. The
    tests about the process itself (signals, exit without a traceback, what is imported,
    several ranks) keep starting one. The in-memory models of the architecture check
(core.judge) are dropped first, as a new process has none. Python's default warning filters apply, and a warning
    is printed to the captured stderr as a subprocess would print it; ``cwd`` is entered for
    the call (relative paths)."""
    import contextlib
    import io
    import subprocess
    import warnings

    from shardscope.core import judge
    from shardscope.tui.cli import main

    with judge._lock:  # as in a new process: the architecture check's models are built anew
        judge._cache.clear()
        judge._models.clear()
    argv = [str(a) for a in args]
    out, err = io.StringIO(), io.StringIO()
    old = os.getcwd()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), \
            warnings.catch_warnings():
        warnings.resetwarnings()  # the interpreter's defaults (no -W, not __main__)
        for cat in (DeprecationWarning, PendingDeprecationWarning, ImportWarning,
                    ResourceWarning):
            warnings.simplefilter("ignore", cat)
        try:
            if cwd is not None:
                os.chdir(cwd)
            code = main(argv)
        except SystemExit as e:  # argparse: usage errors, --help
            if isinstance(e.code, str):
                print(e.code, file=sys.stderr)
                code = 1
            else:
                code = e.code or 0
        finally:
            os.chdir(old)
            sys.stdout.flush()
    return subprocess.CompletedProcess(["shardscope", *argv], code, out.getvalue(),
                                       err.getvalue())


def copy_checkpoint(src: Path, dst: Path) -> Path:
    """A private copy of a fixture checkpoint that a test may damage."""
    shutil.copytree(src, dst)
    return dst


async def wait_for(pilot, cond, tries=100):
    """Let the app run until ``cond()`` holds (checked every 50 ms); fail after ``tries``."""
    for _ in range(tries):
        if cond():
            return
        await pilot.pause(0.05)
    raise AssertionError("condition not reached")


async def inspector_ready(pilot, app, checked: bool = False, tries: int = 400):
    """Wait until the inspector is the screen *and* has run its on_mount (its widgets exist)
    *and* shows the full layout (not the preview it shows while the rank files are read);
    with ``checked``, also until the background architecture check has posted its verdict, so
    a snapshot does not depend on how fast torch imports on a loaded machine."""
    from shardscope.tui.screens.inspector import InspectorScreen

    await wait_for(pilot, lambda: isinstance(app.screen, InspectorScreen)
                   and app.screen.is_mounted and app.screen.loading_path is None, tries=tries)
    if checked:
        await wait_for(pilot, lambda: app.screen.verdict is not None, tries=1200)
    return app.screen


@pytest.fixture(scope="session")
def formats_root() -> Path:
    """Folder of :mod:`core.sample_formats`' checkpoints (float8 FSDP2/DCP, FSDP1
    LOCAL_STATE_DICT, ``.bin`` folders and ``.pt`` files, each with its reference), written by
    real torch.distributed/torch.save runs and cached like :func:`fixtures_root`."""
    import torch

    key = hashlib.sha256(json.dumps(
        [torch.__version__, (ROOT / "core" / "sample_formats.py").read_text(),
         (ROOT / "core" / "sample.py").read_text()]).encode()).hexdigest()[:16]

    def write(tmp: Path) -> None:
        from shardscope.core.sample_formats import write_formats

        write_formats(tmp)

    return cached(_cache_root().parent / f"formats-{key}", write, lock="lock-formats")


@pytest.fixture(scope="session")
def heads_root() -> Path:
    """Folder holding ``critic/``, ``reward/`` and ``t5/`` (verl-layout FSDP2 checkpoints on 2
    ranks of models with a score head or T5's tied embeddings) and their ``<kind>.reference/``
    (save_pretrained), written by :mod:`core.sample_heads` and cached like
    :func:`fixtures_root`."""
    from importlib.metadata import version

    import torch

    from shardscope.core.sample_heads import write_heads

    key = hashlib.sha256(json.dumps(
        [torch.__version__, version("transformers"),
         (ROOT / "core" / "sample_heads.py").read_text()]).encode()).hexdigest()[:16]
    return cached(_cache_root().parent / f"heads-{key}", write_heads, lock="lock-heads")
