"""Benchmark: shardscope's merge against the copy floor and the peers, in one run.

    python bench/bench.py [--gb 4] [--world-size 8] [--reps 3] [--cache bench/cache]

Writes (once, cached) a real FSDP2 checkpoint of about ``--gb`` GB of fp32 weights and a DCP
save of the same model (torch.distributed, gloo, CPU; each rank materialises only its shard),
then times each job ``--reps`` times and prints one table: median wall time, its ratio to the
copy floor, peak RSS of the job's process tree, and that peak over the model size. Also times
``shardscope inspect --json`` and ``merge`` on FSDP2 checkpoints of an 80-layer model saved by
``--many`` ranks (256 and 1024 by default; each rank written by its own process under torch's
``fake`` backend), against ``torch.load`` of every rank file, and the app's start: to its first
useful screen (the inspector, maybe still reading rank files) and to the full layout, wall and
CPU seconds (``--only app``: just those, on the many-rank checkpoints). Merges plan with a warm
architecture cache (core/archcache.py, filled by this run before timing) except the rows
marked cold (``SHARDSCOPE_CACHE=off``: the check made in a thread of the merge) and those
marked "first of its config" (an empty cache each time: the check made by a second process
while the merge writes, core/overlap.py). ``--no-peers`` leaves out the DCP, verl and Megatron
peers (long). Ratios within one run are what to compare: these machines are shared and noisy.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
# this checkout's core/ and tui/ as shardscope.core/.tui, here and in the jobs this script
# starts (`python -m shardscope.tui.cli`, `python -c`), whatever install the venv holds: see
# tests/shim/shardscope/__init__.py. ROOT too, for `bench.write_ckpt`.
SHIM = ROOT / "tests" / "shim"
sys.path[:0] = [str(SHIM), str(ROOT)]
os.environ["PYTHONPATH"] = os.pathsep.join(
    [str(SHIM)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])

# Runs a command and prints the peak RSS (KiB) over its whole process tree, sampled from /proc
# every 20 ms, plus getrusage's max of any single descendant (which also catches short peaks).
MEASURE = r"""
import os, resource, subprocess, sys, time, json
def tree(pid):
    out, stack = [], [pid]
    while stack:
        p = stack.pop(); out.append(p)
        try:
            for t in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{t}/children") as f:
                    stack += [int(c) for c in f.read().split()]
        except OSError:
            pass
    return out
def rss(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0
t0 = time.perf_counter()
p = subprocess.Popen(sys.argv[1:], stdout=subprocess.DEVNULL)
peak = 0
while p.poll() is None:
    peak = max(peak, sum(rss(q) for q in tree(p.pid)))
    time.sleep(0.02)
wall = time.perf_counter() - t0
peak = max(peak, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
print(json.dumps({"wall": wall, "rss_kib": peak, "rc": p.returncode}))
"""

COPY_FLOOR = r"""
import os, sys
src, dst = sys.argv[1], sys.argv[2]
os.makedirs(dst)
buf = bytearray(16 << 20)
names = sorted(os.path.join(d, n) for d, _, ns in os.walk(src) for n in ns
               if n.endswith((".pt", ".distcp")))
with open(os.path.join(dst, "out.bin"), "wb") as out:
    for name in names:
        with open(name, "rb", buffering=0) as f:
            while n := f.readinto(buf):
                out.write(memoryview(buf)[:n])
"""

# What a converter written with torch starts with for FSDP rank files: torch.load of each.
FSDP_LOAD_PEER = r"""
import glob, os, sys, torch
for f in sorted(glob.glob(os.path.join(sys.argv[1], "model_world_size_*_rank_*.pt"))):
    torch.load(f, weights_only=False, map_location="cpu")
"""

# Reading the layout and planning, without writing: the merge's fixed cost.
PLAN_ONLY = r"""
import sys
from shardscope.core import MergeOptions, detect, plan_merge
plan_merge(detect(sys.argv[1]), MergeOptions(output=sys.argv[1] + ".plan-only"))
"""

# What Megatron's converters (and most ad-hoc scripts) start with: torch.load of every rank
# file, whole. Only the load is timed: a lower bound of such a peer's cost.
MEGATRON_LOAD_PEER = r"""
import glob, os, sys, torch
for f in sorted(glob.glob(os.path.join(sys.argv[1], "*", "mp_rank_*", "model_optim_rng.pt"))):
    torch.load(f, weights_only=False, map_location="cpu")
"""

DCP_PEER = r"""
import sys, torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from safetensors.torch import save_file
dcp_to_torch_save(sys.argv[1], sys.argv[2] + ".pt")
sd = torch.load(sys.argv[2] + ".pt", weights_only=True)
import os; os.makedirs(sys.argv[2])
save_file({k: v.contiguous() for k, v in sd.items()}, os.path.join(sys.argv[2], "model.safetensors"))
os.remove(sys.argv[2] + ".pt")
"""

# The app's start: to its first useful screen (the inspector pushed and mounted, maybe still
# loading: the preview of the first rank file) and until it shows the full layout (every rank
# file read, the screen recomposed). Prints wall and CPU seconds (this process, all threads)
# of both as JSON; the CPU time is what to compare on a loaded machine.
APP_START = r"""
import asyncio, json, resource, sys, time
t0 = time.perf_counter()
def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime
from shardscope.tui.app import make_app
from shardscope.tui.screens.inspector import InspectorScreen
out = {}
async def main():
    app = make_app(sys.argv[1])
    async with app.run_test(size=(110, 34)) as pilot:
        while not (isinstance(app.screen, InspectorScreen) and app.screen.is_mounted):
            await pilot.pause(0.01)
        # painted: the screen sets the reader's event after its first refresh
        while getattr(app.screen, "shown", None) is not None and not app.screen.shown.is_set():
            await pilot.pause(0.01)
        out.update(first=time.perf_counter() - t0, first_cpu=cpu(),
                   loading=getattr(app.screen, "loading_path", None) is not None)
        while getattr(app.screen, "loading_path", None) is not None or not app.screen.is_mounted:
            await pilot.pause(0.01)
        await pilot.pause(0)
        out.update(full=time.perf_counter() - t0, full_cpu=cpu())
asyncio.run(main())
print(json.dumps(out))
"""


def measure_app(path: Path, reps: int) -> dict:
    """Median (per field) of ``reps`` runs of :data:`APP_START` on ``path``."""
    runs = []
    for _ in range(reps):
        r = subprocess.run([sys.executable, "-c", APP_START, str(path)], capture_output=True,
                           text=True)
        if r.returncode != 0:
            raise SystemExit(f"APP_START failed on {path}: {r.stderr.strip()[-500:]}")
        runs.append(json.loads(r.stdout.strip().splitlines()[-1]))
    return {k: statistics.median(float(x[k]) for x in runs) for k in runs[0]}


def app_rows(paths: dict[int, Path], reps: int) -> None:
    """Print the app's start on each checkpoint (rank count -> folder)."""
    print("\n| app start | first screen wall s | CPU s | fully loaded wall s | CPU s |")
    print("|---|---:|---:|---:|---:|")
    for w, p in paths.items():
        print(f"running: app start, {w} ranks", file=sys.stderr)
        r = measure_app(p, reps)
        print(f"| {w} ranks ({p.name}){'' if r['loading'] else ', loaded at once'} | "
              f"{r['first']:.2f} | {r['first_cpu']:.2f} | {r['full']:.2f} | "
              f"{r['full_cpu']:.2f} |", flush=True)


def measure(cmd: list[str], out: Path | None, reps: int) -> dict:
    walls, peaks, rc = [], [], 0
    for _ in range(reps):
        if out is not None:
            shutil.rmtree(out, ignore_errors=True)
            Path(str(out) + ".pt").unlink(missing_ok=True)
        r = subprocess.run([sys.executable, "-c", MEASURE, *cmd], capture_output=True,
                           text=True, cwd=ROOT)
        d = json.loads(r.stdout.strip().splitlines()[-1])
        walls.append(d["wall"])
        peaks.append(d["rss_kib"] * 1024)
        rc = rc or d["rc"]
    if out is not None:
        shutil.rmtree(out, ignore_errors=True)
    return {"wall": statistics.median(walls), "rss": max(peaks), "rc": rc}


def detect_names(path: Path) -> list[str]:
    from shardscope.core import detect

    return list(detect(path).tensors)


def model_bytes(fsdp_dir: Path) -> int:
    from shardscope.core import detect

    return detect(fsdp_dir).bytes


def _split_cpu(path: Path, cache: str, out: Path) -> tuple[float, float, float]:
    """CPU seconds of reading the layout, planning the merge and running it, in a fresh
    process whose architecture cache (core/archcache.py, ``SHARDSCOPE_CACHE``) is ``cache``:
    ``off`` for a cold plan (imports transformers, builds the model on the meta device), a
    folder already filled by a plan of the same checkpoint for a warm one (CPU time: the wall
    time of a loaded machine says little about a step)."""
    code = ("import sys, time\n"
            "from shardscope.core import MergeOptions, detect, plan_merge, run_merge\n"
            "t = time.process_time(); layout = detect(sys.argv[1])\n"
            "t1 = time.process_time()\n"
            "plan = plan_merge(layout, MergeOptions(output=sys.argv[2]))\n"
            "t2 = time.process_time(); run_merge(plan)\n"
            "print(t1 - t, t2 - t1, time.process_time() - t2)")
    shutil.rmtree(out, ignore_errors=True)
    r = subprocess.run([sys.executable, "-c", code, str(path), str(out)], capture_output=True,
                       text=True, cwd=ROOT, env=dict(os.environ, SHARDSCOPE_CACHE=cache))
    shutil.rmtree(out, ignore_errors=True)
    a, b, c = r.stdout.split()[-3:]
    return float(a), float(b), float(c)


def _warm(cache: Path, path: Path) -> None:
    """Fill the architecture cache ``cache`` with what a plan of ``path`` asks."""
    subprocess.run([sys.executable, "-c", PLAN_ONLY, str(path)], cwd=ROOT, check=True,
                   env=dict(os.environ, SHARDSCOPE_CACHE=str(cache)))


def _megatron_checkpoint(cache: Path) -> Path:
    """A Llama-shaped model of about 1.9 GB fp32 (8 layers, hidden 2048, GQA 16/4, SwiGLU
    5504, vocabulary 32000) written by megatron-core as TP=2 x PP=2, cached."""
    from shardscope.core.sample_megatron import Family, write_megatron

    out = cache / "megatron-llama-1.9gb"
    if not (out / "complete").exists():
        shutil.rmtree(out, ignore_errors=True)
        print(f"writing the Megatron checkpoint to {out} ...", file=sys.stderr)
        write_megatron(out, Family("bench", "llama", layers=8, hidden=2048, heads=16, groups=4,
                                   ffn=5504, vocab=32000, padded_vocab=32000))
        (out / "complete").write_text("ok")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gb", type=float, default=4.0)
    ap.add_argument("--world-size", type=int, default=8)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--cache", default=str(HERE / "cache"))
    ap.add_argument("--work", default=None, help="where outputs go (default: beside the cache)")
    ap.add_argument("--verl-python", default=os.environ.get("VERL_PYTHON", sys.executable),
                    help="a Python that can import verl (its pins may clash with ours, so it "
                         "can live in its own virtual environment)")
    ap.add_argument("--many", default="256,1024",
                    help="rank counts of the 80-layer many-rank checkpoints ('' for none)")
    ap.add_argument("--no-peers", action="store_true",
                    help="leave out the DCP, verl and peer jobs (the cast and many-rank rows "
                         "stay)")
    ap.add_argument("--no-load-peer", action="store_true",
                    help="leave out torch.load of every many-rank file (minutes at 1024 ranks)")
    ap.add_argument("--only", choices=["app"], default=None,
                    help="app: only the app's start (first screen, fully loaded) on the "
                         "80-layer checkpoints of --many ranks (written if missing)")
    ap.add_argument("--megatron", action="store_true",
                    help="also write (once) a ~1.9 GB Llama-shaped Megatron-LM checkpoint with "
                         "megatron-core (TP=2 x PP=2, torch_dist and legacy) and time its merge")
    args = ap.parse_args()
    from bench.write_ckpt import write_fsdp_and_dcp, write_many_ranks_procs

    if args.only == "app":
        paths = {}
        for w in [int(x) for x in args.many.split(",") if x.strip()]:
            paths[w] = Path(args.cache) / f"fsdp2-{w}-ranks-80l"
            if not (paths[w] / "fsdp_config.json").exists():
                print(f"writing the {w}-rank checkpoint ...", file=sys.stderr)
                write_many_ranks_procs(paths[w], w)
        print(f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; median of "
              f"{args.reps}")
        app_rows(paths, args.reps)
        return
    cache = Path(args.cache) / f"fsdp2-{args.gb:g}gb-w{args.world_size}"
    if not (cache / "complete").exists():
        shutil.rmtree(cache, ignore_errors=True)
        print(f"writing the checkpoint to {cache} ...", file=sys.stderr)
        write_fsdp_and_dcp(cache, args.gb, args.world_size)
        (cache / "complete").write_text("ok")
    many = {}
    for w in [int(x) for x in args.many.split(",") if x.strip()]:
        many[w] = Path(args.cache) / f"fsdp2-{w}-ranks-80l"
        if not (many[w] / "fsdp_config.json").exists():
            print(f"writing the {w}-rank checkpoint ...", file=sys.stderr)
            shutil.rmtree(many[w], ignore_errors=True)
            write_many_ranks_procs(many[w], w)
    work = Path(args.work or Path(args.cache) / "work")
    work.mkdir(parents=True, exist_ok=True)
    # The architecture cache (core/archcache.py) of every job: a folder of this run, filled
    # before the first timed job, so every merge row plans warm (no transformers import) but
    # the many-rank rows marked cold (SHARDSCOPE_CACHE=off: transformers imported, the model
    # built on the meta device)
    arch = work / "archcache"
    shutil.rmtree(arch, ignore_errors=True)
    os.environ["SHARDSCOPE_CACHE"] = str(arch)
    fsdp, dcp = cache / "fsdp", cache / "dcp"
    size = model_bytes(fsdp)
    shard_bytes = sum(p.stat().st_size for p in fsdp.glob("*.pt"))
    exe = [sys.executable, "-m", "shardscope.tui.cli"]
    _warm(arch, fsdp)
    out = work / "out"
    # a merge of a config never checked before: its own empty architecture cache each time,
    # so the check runs (core/overlap.py: a second process, while the merge writes)
    fresh = work / "archcache-first"

    def first(cmd: list[str]) -> list[str]:
        return ["sh", "-c", 'rm -rf "$0" && SHARDSCOPE_CACHE="$0" exec "$@"', str(fresh)] + cmd

    jobs: list[tuple[str, list[str], Path | None, int | None]] = [
        ("copy floor (read shards, write same bytes)",
         [sys.executable, "-c", COPY_FLOOR, str(fsdp), str(out)], out, None),
        ("shardscope merge fsdp, keep dtype, 5GB shards",
         exe + ["merge", str(fsdp), "-o", str(out), "-q"], out, 5 * 10**9),
        ("shardscope merge fsdp, keep dtype, 5GB shards, first of its config",
         first(exe + ["merge", str(fsdp), "-o", str(out), "-q"]), out, 5 * 10**9),
        ("shardscope merge fsdp, keep dtype, 5GB shards, --no-crc",
         exe + ["merge", str(fsdp), "-o", str(out), "-q", "--no-crc"], out, 5 * 10**9),
        ("shardscope merge fsdp, keep dtype, 1GB shards",
         exe + ["merge", str(fsdp), "-o", str(out), "-q", "--max-shard-size", "1GB"], out,
         10**9),
        ("shardscope merge fsdp, --dtype bf16, 5GB shards",
         exe + ["merge", str(fsdp), "-o", str(out), "-q", "--dtype", "bf16"], out,
         5 * 10**9),
        ("shardscope merge fsdp, --dtype fp16, 5GB shards",
         exe + ["merge", str(fsdp), "-o", str(out), "-q", "--dtype", "fp16"], out,
         5 * 10**9),
    ]
    if not args.no_peers:
        jobs += [
            ("shardscope merge dcp, keep dtype, 5GB shards",
             exe + ["merge", str(dcp), "-o", str(out), "-q"], out, 5 * 10**9),
            ("peer: dcp_to_torch_save + safetensors save",
             [sys.executable, "-c", DCP_PEER, str(dcp), str(out)], out, None)]
    has_verl = not args.no_peers and subprocess.run(
        [args.verl_python, "-c", "import verl.model_merger"], capture_output=True).returncode == 0
    if has_verl:
        jobs.append(("peer: verl.model_merger (writes bf16)",
                     [args.verl_python, "-m", "verl.model_merger", "merge", "--backend", "fsdp",
                      "--local_dir", str(fsdp), "--target_dir", str(out)], out, None))
    elif not args.no_peers:
        print("verl is not importable (see --verl-python): its merger is not measured",
              file=sys.stderr)
    for w, src in many.items():  # each group's ratios are to its own floor
        jobs += [
            (f"copy floor, {w} rank files (80 layers)",
             [sys.executable, "-c", COPY_FLOOR, str(src), str(out)], out, None),
        ]
        if not args.no_load_peer:
            jobs.append((f"peer floor: torch.load of every rank file ({w} ranks)",
                         [sys.executable, "-c", FSDP_LOAD_PEER, str(src)], None, None))
        jobs += [
            (f"shardscope inspect --json, {w} ranks", exe + ["inspect", str(src), "--json"],
             None, None),
            (f"shardscope read layout + plan only, {w} ranks, cold (no architecture cache)",
             ["env", "SHARDSCOPE_CACHE=off", sys.executable, "-c", PLAN_ONLY, str(src)], None,
             None),
            (f"shardscope read layout + plan only, {w} ranks, warm architecture cache",
             ["env", f"SHARDSCOPE_CACHE={arch}", sys.executable, "-c", PLAN_ONLY, str(src)],
             None, None),
            (f"shardscope merge, {w} ranks, cold (no architecture cache)",
             ["env", "SHARDSCOPE_CACHE=off"] + exe + ["merge", str(src), "-o", str(out), "-q"],
             out, 5 * 10**9),
            (f"shardscope merge, {w} ranks, warm architecture cache",
             ["env", f"SHARDSCOPE_CACHE={arch}"] + exe + ["merge", str(src), "-o", str(out),
                                                          "-q"], out, 5 * 10**9),
            (f"shardscope merge, {w} ranks, first of its config",
             first(exe + ["merge", str(src), "-o", str(out), "-q"]), out, 5 * 10**9)]
        _warm(arch, src)
    if args.megatron:  # after the FSDP group: each group's ratios are to its own floor
        mg = _megatron_checkpoint(Path(args.cache))
        for kind in ("legacy", "torch_dist"):
            src = mg / "tp2_pp2" / kind
            jobs.append((f"copy floor, megatron {kind} files",
                         [sys.executable, "-c", COPY_FLOOR, str(src), str(out)], out, None))
            jobs.append((f"shardscope merge megatron {kind} (TP2 x PP2), keep dtype",
                         exe + ["merge", str(src), "-o", str(out), "-q", "--hf-config",
                                str(mg / "reference")], out, 5 * 10**9))
            if kind == "legacy":
                jobs.append(("peer floor: torch.load of every mp_rank file (converters' first "
                             "step)", [sys.executable, "-c", MEGATRON_LOAD_PEER, str(src)],
                             None, None))
    rows = []
    floor = None
    mg_size = model_bytes(mg / "tp2_pp2" / "legacy") if args.megatron else size
    many_bytes = {w: model_bytes(src) for w, src in many.items()}
    for name, cmd, o, shard in jobs:
        print(f"running: {name}", file=sys.stderr)
        r = measure(cmd, o, args.reps)
        if name.startswith("copy floor"):  # each group's ratios are to its own floor
            floor = r["wall"]
        megatron = "megatron" in name or "mp_rank" in name
        w = next((w for w in many if f"{w} rank" in name), None)
        rows.append((name, r, shard, floor, mg_size if megatron else many_bytes[w] if w
                     else size))
    split = {w: {k: _split_cpu(src, c, work / "split-out") for k, c in
                 (("cold", "off"), ("warm", str(arch)))} for w, src in many.items()}
    cpu = platform.processor() or platform.machine()
    print(f"\nmodel: {size / 1e9:.2f} GB of tensors, {shard_bytes / 1e9:.2f} GB in "
          f"{args.world_size} rank files" + (f"; Megatron model {mg_size / 1e9:.2f} GB"
                                             if args.megatron else "") +
          f"; {os.cpu_count()} CPUs ({cpu}), "
          f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB RAM; "
          f"median of {args.reps}\n")
    print("| job | wall s | x floor | peak RSS GB | RSS / model | RSS - shard (MiB) | rc |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, r, shard, floor, msize in rows:
        over = f"{(r['rss'] - min(shard, msize)) / 2**20:.0f}" if shard else ""
        print(f"| {name} | {r['wall']:.2f} | {r['wall'] / floor:.2f} | {r['rss'] / 1e9:.2f} | "
              f"{r['rss'] / msize:.2f} | {over} | {r['rc']} |")
    verl = next((r for n, r, *_ in rows if n.startswith("peer: verl")), None)
    if verl is not None:
        ours = next(r for n, r, *_ in rows if "--dtype bf16" in n)
        print(f"\nshardscope --dtype bf16 against verl's merger (same output dtype): "
              f"{ours['wall'] / verl['wall']:.2f} x its wall time, "
              f"{ours['rss'] / verl['rss']:.2f} x its peak RSS")
    load = next((r for n, r, *_ in rows if n.startswith("peer floor: torch.load of every mp_rank")),
                None)
    if load is not None:
        ours = next(r for n, r, *_ in rows if n.startswith("shardscope merge megatron legacy"))
        print(f"\nshardscope's whole Megatron legacy merge against only torch.load-ing the same "
              f"files: {ours['wall'] / load['wall']:.2f} x its wall time, "
              f"{ours['rss'] / load['rss']:.2f} x its peak RSS")
    keep = next(r for n, r, *_ in rows if n.startswith("shardscope merge fsdp, keep dtype, 5GB"))
    no_crc = next(r for n, r, *_ in rows if n.endswith("--no-crc"))
    print(f"\nthe default CRC-32 check of every storage record: the keep-dtype merge takes "
          f"{keep['wall'] / no_crc['wall']:.2f} x its time without the check (--no-crc)")
    for n, r, *_ in rows:
        if "--dtype" in n:
            print(f"\n{n}: {r['wall'] / keep['wall']:.2f} x the keep-dtype merge")
    get = {n: r for n, r, *_ in rows}
    pairs = [("fsdp, keep dtype, 5GB shards", "shardscope merge fsdp, keep dtype, 5GB shards")]
    pairs += [(f"{w} ranks", f"shardscope merge, {w} ranks, warm architecture cache")
              for w in many]
    for what, warm in pairs:
        one = get[warm.replace("warm architecture cache", "first of its config")
                  if "ranks" in what else warm + ", first of its config"]
        extra = one["wall"] - get[warm]["wall"]
        print(f"\nfirst merge of its config ({what}, the check not cached): "
              f"{one['wall']:.2f} s against {get[warm]['wall']:.2f} s warm: the architecture "
              f"check adds {extra:.2f} s = {100 * max(extra, 0) / one['wall']:.0f}% of it")
    for w in many:
        ins = get[f"shardscope inspect --json, {w} ranks"]
        load = get.get(f"peer floor: torch.load of every rank file ({w} ranks)")
        print(f"\n{w} ranks x {len(detect_names(many[w]))} tensors: inspect --json "
              f"{ins['wall']:.2f} s" + (f" = {ins['wall'] / load['wall']:.2f} x torch.load of "
                                        "every file" if load else ""))
        for k in ("cold", "warm"):
            sfx = ("cold (no architecture cache)" if k == "cold" else "warm architecture cache")
            plan = get[f"shardscope read layout + plan only, {w} ranks, {sfx}"]
            merge = get[f"shardscope merge, {w} ranks, {sfx}"]
            lay, pl, run = split[w][k]
            print(f"- {k}: layout + plan {plan['wall']:.2f} s of the merge's "
                  f"{merge['wall']:.2f} s (wall); in process, CPU: reading the layout "
                  f"{lay:.2f} s, planning {pl:.2f} s, writing {run:.2f} s: planning is "
                  f"{100 * pl / (lay + pl + run):.0f}% of the merge's CPU")
    app_rows({args.world_size: fsdp, **many}, args.reps)


if __name__ == "__main__":
    main()
