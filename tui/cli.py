"""The ``shardscope`` command: ``inspect``, ``merge``, ``verify``, ``diff``, ``upload``,
``sample``; no subcommand opens the Textual app. Errors print one line (``shardscope: <file>:
<problem>``) and exit with 2 (usage), 3 (bad checkpoint) or 130 (interrupted); never a
traceback."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import threading
import time

VERL_NOTE = """\
verl compatibility: `shardscope merge --backend fsdp --local_dir X --target_dir Y` works as
`python -m verl.model_merger merge` does. --hf_model_path is read as --hf-config. These verl
flags are accepted and have no effect, because shardscope never loads the model:
--tie-word-embedding (the config's tie_word_embeddings decides), --is-value-model (the critic's
score head is written like any other tensor, and checked against the config's model classes),
--use_cpu_initialization. --trust-remote-code lets the architecture check build a model class
that only the config folder's code defines.
--hf_upload_path REPO_ID is read as --hf-upload REPO_ID (with --private).
Unlike verl's merger, dtypes are kept as trained unless --dtype asks otherwise."""


#: what shardscope reads, as ``shardscope --help`` and pyproject.toml's description say it
#: (tests/test_fixcli.py keeps the two equal)
SUMMARY = ("Inspect distributed training checkpoints (FSDP/FSDP2, PyTorch DCP, DeepSpeed ZeRO, "
           "Megatron-LM, Hugging Face), merge them into Hugging Face model folders and compare "
           "them")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="shardscope",
        description=f"{SUMMARY}. Without a command, opens the app.")
    p.add_argument("--version", action="store_true", help="print the version and exit")
    sub = p.add_subparsers(dest="command")

    i = sub.add_parser("inspect", help="show the layout of a checkpoint (reads metadata only)")
    i.add_argument("path")
    i.add_argument("--json", action="store_true", help="print one JSON object")
    i.add_argument("--params", action="store_true", help="list every tensor")
    i.add_argument("--map", metavar="TENSOR", action="append",
                   help="draw how TENSOR is cut: a block per stored piece, by rank and device "
                        "mesh coordinate (repeatable)")
    i.add_argument("--tag", help="DeepSpeed: the step folder to read instead of `latest`")
    i.add_argument("--hf-config", metavar="DIR",
                   help="the Hugging Face config folder to read the checkpoint with, in "
                        "place of its huggingface/ or where it has none (DCP, DeepSpeed, "
                        "Megatron, torchtitan, a .pt file): Megatron and torchtitan names are "
                        "mapped with it (without one, Megatron's config is derived from its "
                        "args); with --check, the config to check against")
    i.add_argument("--deep", action="store_true",
                   help="also read every tensor: check the CRC-32 of torch.save data and count "
                        "NaN/Inf per tensor (reads all bytes once)")
    i.add_argument("--check", action="store_true",
                   help="check the tensors against the model class of the config (built by "
                        "transformers on the meta device, as save_pretrained writes it): "
                        "missing, extra, shape, dtype")
    i.add_argument("--trust-remote-code", action="store_true",
                   help="with --check: build a model class that only the config folder's own "
                        "code (auto_map) defines")

    m = sub.add_parser("merge", help="merge a sharded checkpoint into a Hugging Face folder",
                       epilog=VERL_NOTE, formatter_class=argparse.RawDescriptionHelpFormatter)
    m.add_argument("path", nargs="?", help="the checkpoint folder")
    m.add_argument("-o", "--output", help="the folder to write (must not exist)")
    m.add_argument("--dtype", choices=["bf16", "fp16", "fp32"],
                   help="cast F64/F32/F16/BF16 tensors (float8, integer and bool tensors stay "
                        "as stored; default: keep each tensor's dtype)")
    m.add_argument("--max-shard-size", default="5GB",
                   help="largest output file (decimal units, default 5GB)")
    m.add_argument("--deep", action="store_true",
                   help="first read every source byte and check the CRC-32 that torch.save "
                        "records (refuses flipped bytes in tensor data; costs one more read)")
    m.add_argument("--no-crc", dest="crc", action="store_false",
                   help="skip the CRC-32 check of the torch.save storage records the merge "
                        "reads (on by default, overlapping the writing)")
    m.add_argument("--hf-config", metavar="DIR",
                   help="folder whose config/tokenizer files are copied (never its weights)")
    m.add_argument("--overwrite", action="store_true", help="replace an existing output")
    m.add_argument("--workers", type=int, default=min(32, os.cpu_count() or 1),
                   help="threads moving bytes (default: min(32, CPUs))")
    m.add_argument("--tag", help="DeepSpeed: the step folder to merge instead of `latest`")
    m.add_argument("--weights", choices=["master", "module"], default="master",
                   help="DeepSpeed: the fp32 master copy (default) or the module weights as "
                        "trained (ZeRO stages 1 and 2)")
    m.add_argument("--lora", choices=["fold", "adapter", "both", "base"],
                   help="when the checkpoint holds a LoRA adapter: fold it into the weights, "
                        "write the base model plus a PEFT folder (OUT/lora_adapter), both, or "
                        "the base alone")
    m.add_argument("--lora-adapter", metavar="NAME", help="which adapter, when there are several")
    m.add_argument("--lora-alpha", type=float,
                   help="the run's lora_alpha, when the checkpoint does not record it (peft's "
                        "default alpha: modules an adapter config's alpha_pattern names keep "
                        "theirs)")
    m.add_argument("--lora-config", metavar="FILE",
                   help="the adapter's own adapter_config.json (or its folder), when it is not "
                        "at lora_adapter/ beside the checkpoint: each module's rank and alpha "
                        "(rank_pattern, alpha_pattern), rsLoRA")
    m.add_argument("--base-model", metavar="DIR",
                   help="the Hugging Face folder of the base weights, for a checkpoint that "
                        "holds the LoRA adapter only (verl's save_lora_only)")
    m.add_argument("--hf-upload", metavar="REPO_ID",
                   help="after the merge passes verification, upload it to this Hub repository "
                        "(token from HF_TOKEN or `hf auth login`; HF_ENDPOINT for a private hub)")
    m.add_argument("--private", action="store_true", help="create the repository private")
    m.add_argument("--revision", help="upload to this branch (created if needed)")
    m.add_argument("--commit-message", help="the upload's commit message")
    m.add_argument("--no-card", action="store_true",
                   help="do not write a model card (README.md) into the output")
    m.add_argument("--distributed", action="store_true",
                   help="run as one process of a torchrun/srun launch (one per node): each "
                        "reads the rank files on its own disk under PATH (which may hold "
                        "{node_rank}, {rank}, {local_rank}), rank 0 writes OUT and receives "
                        "the pieces it lacks over gloo; per-rank FSDP files only")
    m.add_argument("--no-strict", dest="strict", action="store_false",
                   help="write the weights even when they do not match the model class of the "
                        "config (missing, extra, other shape or dtype kind; as "
                        "load_state_dict(strict=False)); the model card lists what is off")
    m.add_argument("--trust-remote-code", action="store_true",
                   help="let the architecture check build a model class that only the config "
                        "folder's own code (auto_map) defines (runs that code)")
    m.add_argument("-v", "--verbose", action="store_true", help="log each step")
    m.add_argument("-q", "--quiet", action="store_true",
                   help="print errors only (no progress, warnings or summary); the exit code "
                        "says the rest")
    # verl.model_merger's flags
    m.add_argument("--backend", choices=["fsdp", "megatron"], help=argparse.SUPPRESS)
    m.add_argument("--local_dir", help=argparse.SUPPRESS)
    m.add_argument("--target_dir", help=argparse.SUPPRESS)
    m.add_argument("--hf_model_path", help=argparse.SUPPRESS)
    for flag in ("--tie-word-embedding", "--is-value-model", "--use_cpu_initialization"):
        m.add_argument(flag, action="store_true", help=argparse.SUPPRESS)
    m.add_argument("--hf_upload_path", help=argparse.SUPPRESS)

    v = sub.add_parser("verify", help="check a merged folder, optionally against a reference")
    v.add_argument("path", help="a Hugging Face folder (e.g. a merge's output)")
    v.add_argument("--reference", help="another checkpoint (any format) to compare with")
    v.add_argument("--atol", type=float, default=0.0,
                   help="absolute tolerance (default 0: bit-exact)")
    v.add_argument("--rtol", type=float, default=0.0,
                   help="relative tolerance (default 0: bit-exact)")
    v.add_argument("--trust-remote-code", action="store_true",
                   help="let the check of the weights against the config's model build a "
                        "class that only the folder's own code defines (runs that code)")
    v.add_argument("--no-crc", dest="crc", action="store_false",
                   help="with --reference: skip the CRC-32 check of the torch.save storage "
                        "records read (on by default, as merge)")

    d = sub.add_parser("diff", help="compare two checkpoints of any formats, tensor by tensor "
                                    "(exit 0 identical, 1 different)")
    d.add_argument("a", help="a checkpoint (any format shardscope reads)")
    d.add_argument("b", help="another checkpoint (any format) to compare with A")
    d.add_argument("--json", action="store_true", help="print one JSON object")
    d.add_argument("--atol", type=float, default=0.0,
                   help="absolute tolerance (default 0: bit for bit)")
    d.add_argument("--rtol", type=float, default=0.0,
                   help="relative tolerance (default 0: bit for bit)")
    d.add_argument("--top", type=int, default=10, help="largest changes to list (default 10)")
    d.add_argument("--all", action="store_true", help="list every tensor, identical ones too")
    d.add_argument("--hf-config", metavar="DIR",
                   help="Hugging Face config folder for a side that has none of its own or has "
                        "Megatron/torchtitan names")
    d.add_argument("--dtype", choices=["bf16", "fp16", "fp32"],
                   help="cast both sides' F64/F32/F16/BF16 tensors first, as merge --dtype")
    d.add_argument("--weights", choices=["master", "module"], default="master",
                   help="DeepSpeed sides: the fp32 master copy (default) or the module weights")
    d.add_argument("--lora", choices=["fold", "base"],
                   help="a side holding a LoRA adapter: compare it folded, or its base alone")
    d.add_argument("--lora-adapter", metavar="NAME", help="which adapter, when there are several")
    d.add_argument("--lora-alpha", type=float, help="the run's lora_alpha, when not recorded")
    d.add_argument("--lora-config", metavar="FILE", help="the adapter's adapter_config.json")
    d.add_argument("--base-model", metavar="DIR",
                   help="the base weights of a side holding the LoRA adapter only")
    d.add_argument("--no-crc", dest="crc", action="store_false",
                   help="skip the CRC-32 check of the torch.save storage records read (on by "
                        "default, as merge: a corrupt record is refused, not shown as a change)")
    d.add_argument("-q", "--quiet", action="store_true", help="no progress display")

    u = sub.add_parser("upload", help="upload a merged folder to a Hugging Face Hub repository "
                                      "(after verifying it)")
    u.add_argument("path", help="the merged folder")
    u.add_argument("repo_id", help="e.g. my-org/my-model")
    u.add_argument("--private", action="store_true", help="create the repository private")
    u.add_argument("--revision", help="upload to this branch (created if needed)")
    u.add_argument("--commit-message", help="the upload's commit message")

    s = sub.add_parser("sample", help="write a real FSDP2 sample checkpoint of a tiny model "
                                      "(torch.distributed, gloo, CPU)")
    s.add_argument("path", help="the folder to write (a new or empty one): verl's layout, "
                                "model_world_size_W_rank_r.pt + fsdp_config.json + huggingface/")
    s.add_argument("--world-size", type=int, default=2,
                   help="number of ranks (processes) to shard the model over (default 2, "
                        f"at most {SAMPLE_MAX_WORLD_SIZE})")
    s.add_argument("--reference", help="also write the unsharded model here (save_pretrained; "
                                       "a new or empty folder), for verify --reference")
    s.add_argument("--megatron", metavar="FAMILY", choices=["llama", "qwen2", "qwen3", "mixtral"],
                   help="instead, write Megatron-LM checkpoints (torch_dist and legacy, several "
                        "TP/PP/VPP/EP layouts) of a tiny model of this family with megatron-core "
                        "(needs pip install 'shardscope[megatron]')")
    return p


def _quiet_frameworks() -> None:
    """Keep other frameworks' log lines out of our output. DeepSpeed's logger ("DeepSpeed",
    deepspeed/utils/logging.py ``LoggerFactory.create_logger``) writes to stdout, and importing
    deepspeed (which peft, accelerate or transformers may do) warns "Setting accelerator to
    CPU" through it (deepspeed/accelerator/real_accelerator.py), which broke ``--json``."""
    import logging

    logging.getLogger("DeepSpeed").disabled = True


def main(argv: list[str] | None = None) -> int:
    from shardscope.core import MergeCancelled, ShardscopeError

    _quiet_frameworks()

    parser = build_parser()
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) == 1 and not argv[0].startswith("-") and argv[0] not in (
            "inspect", "merge", "verify", "sample", "upload", "diff"):
        if not os.path.exists(argv[0]):  # a typo must not open the app somewhere else
            print(f"shardscope: {argv[0]}: no such file or folder", file=sys.stderr)
            return 2
        from shardscope.tui.app import run_app  # `shardscope PATH` opens the app there

        return run_app(argv[0])
    args = parser.parse_args(argv)
    global _COMMAND
    _COMMAND = args.command
    try:
        _check_args(args)
        if args.version:
            from importlib.metadata import version

            print(version("shardscope"))
            return 0
        if args.command is None:
            from shardscope.tui.app import run_app

            return run_app()
        with _signals_interrupt() as signals:
            args.cancel = signals.cancel
            return {"inspect": cmd_inspect, "merge": cmd_merge, "verify": cmd_verify,
                    "sample": cmd_sample, "upload": cmd_upload,
                    "diff": cmd_diff}[args.command](args)
    except MergeCancelled:  # the command's cancel event, set by a signal (see _signals_interrupt)
        print("shardscope: interrupted; nothing was written", file=sys.stderr)
        return 130
    except ShardscopeError as e:
        if args.command == "inspect" and args.json:
            # `inspect --json` always prints one JSON document, a usage refusal too (a missing
            # path, a --tag or --map that does not exist): scripts parse stdout
            print(json.dumps(_refusal_json(args.path, e), indent=2))
            return e.exit_code
        if args.command == "diff" and args.json:  # the same for diff (also on stderr)
            print(json.dumps(_diff_refusal_json(args, e), indent=2))
        print(f"shardscope: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("shardscope: interrupted; nothing was written", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
    except OSError as e:
        # 1 is verify's "differences found": a file that cannot be written (the output,
        # e.g. read-only) is a usage problem (2), one that cannot be read is the input's (3)
        print(f"shardscope: {e.filename or ''}: {e.strerror or e}", file=sys.stderr)
        return 2 if _concerns_output(args, e.filename) else 3
    except Exception as e:  # noqa: BLE001 - last resort: one line, never a traceback
        # only merge has -v; the other commands' report is the command line and this line
        how = ("the output of the same command with -v" if args.command == "merge"
               else "the command line that caused it")
        print(f"shardscope: unexpected error ({type(e).__name__}: {e}); please report it "
              f"with {how}", file=sys.stderr)
        return 1


class _signals_interrupt:
    """For the whole command (reading, planning, writing): SIGINT (Ctrl-C), SIGTERM and SIGHUP
    set :attr:`cancel` and raise KeyboardInterrupt, so every command exits 130 with
    "interrupted; nothing was written" and a merge removes its temporary folder. The event
    outlives the exception: Python runs a signal handler in whatever code the main thread is
    running, and code that eats the KeyboardInterrupt there (an ``except BaseException``, a
    finaliser, C code that clears errors, while torch and transformers are imported) must not
    let the merge go on; the merge checks the event at each step and before its output is
    renamed into place. A SIGINT ignored by the parent (SIG_IGN: a background job of a
    non-interactive shell) stays ignored, as Python leaves it. The previous handlers come
    back after."""

    def __enter__(self):
        import signal

        self.cancel = threading.Event()

        def stop(signum, frame):
            self.cancel.set()
            raise KeyboardInterrupt

        self.old = {}
        for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            if s == signal.SIGINT and signal.getsignal(s) == signal.SIG_IGN:
                continue
            try:
                self.old[s] = signal.signal(s, stop)
            except ValueError:  # not the main thread (an embedding program): leave them
                pass
        return self

    def __exit__(self, *exc):
        import signal

        for s, h in self.old.items():
            signal.signal(s, h)
        return False


def _stop_if_interrupted(cancel: threading.Event) -> None:
    """Raise KeyboardInterrupt when a signal set ``cancel`` (its own KeyboardInterrupt may
    have been eaten by the code that was running when it came)."""
    if cancel.is_set():
        raise KeyboardInterrupt


#: ``sample --world-size`` bound: the rows of the sample model's smallest sharded tensor
#: (k_proj/v_proj: 2 key-value heads x head dim 64/4, core/sample.tiny_config), which FSDP2
#: cuts by rows; each rank is a spawned process importing torch, so an unbounded N would start
#: N of them
SAMPLE_MAX_WORLD_SIZE = 32


def _check_args(args) -> None:
    """Refuse impossible option values before any work (:class:`UsageError`, exit 2): an
    input path that does not exist, ``--workers`` (or ``sample --world-size``) below 1,
    ``--atol``/``--rtol`` negative or not finite."""
    from shardscope.core import UsageError

    if args.command in ("inspect", "merge", "verify", "upload"):
        path = args.path if args.command != "merge" else (args.path or args.local_dir)
        # under --distributed PATH may hold {rank}; each process checks its own folder
        if path and not getattr(args, "distributed", False) and not os.path.exists(path):
            raise UsageError("no such file or folder", path, code="no-such-path")
    if args.command == "diff":
        for path in (args.a, args.b):
            if not os.path.exists(path):
                raise UsageError("no such file or folder", path)
    if args.command == "verify" and args.reference and not os.path.exists(args.reference):
        raise UsageError("no such file or folder", args.reference)
    if (args.command == "inspect" and args.hf_config
            and not os.path.isfile(os.path.join(args.hf_config, "config.json"))):
        # as merge refuses it (core/plan.py): a folder ignored in silence read as "checked"
        raise UsageError("has no config.json", args.hf_config)
    if args.command in ("verify", "diff"):  # also verify without --reference: never ignored
        for flag, value in (("--atol", args.atol), ("--rtol", args.rtol)):
            if not (math.isfinite(value) and value >= 0):  # NaN, inf, negative
                raise UsageError(f"{flag} must be a non-negative number")
    repo_id = (args.repo_id if args.command == "upload" else
               (args.hf_upload or args.hf_upload_path) if args.command == "merge" else None)
    if repo_id is not None:  # before the merge and before any network use
        from shardscope.core.publish import check_repo_id

        check_repo_id(repo_id)
    if args.command == "merge" and args.workers < 1:
        raise UsageError(f"--workers must be at least 1 (got {args.workers})")
    for flag in ("atol", "rtol"):  # verify, diff: torch.isclose raises for these
        value = getattr(args, flag, None)
        if value is not None and not (math.isfinite(value) and value >= 0):
            raise UsageError(f"--{flag} must be a finite number >= 0 (got {value})")
    if args.command == "sample" and args.world_size < 1:
        raise UsageError(f"--world-size must be at least 1 (got {args.world_size})")
    if args.command == "sample" and args.world_size > SAMPLE_MAX_WORLD_SIZE:
        raise UsageError(f"--world-size must be at most {SAMPLE_MAX_WORLD_SIZE} (got "
                         f"{args.world_size}): each rank is a process, and the tiny model's "
                         f"smallest sharded tensor has {SAMPLE_MAX_WORLD_SIZE} rows")


def _concerns_output(args, filename) -> bool:
    """True when ``filename`` is the merge's output folder, inside it, or its temporary
    sibling (``.OUT.shardscope-tmp-PID``)."""
    out = getattr(args, "output", None) or getattr(args, "target_dir", None)
    if not out or not filename:
        return False
    out, f = os.path.abspath(out), os.path.abspath(os.fsdecode(filename))
    parent, name = os.path.split(out)
    return (f == out or f.startswith(out + os.sep)
            or f.startswith(os.path.join(parent, f".{name}.shardscope-tmp")))


def _with_tag(path: str, tag: str | None) -> str:
    """``PATH/TAG`` for DeepSpeed's --tag (a step folder beside ``latest``)."""
    if not tag:
        return path
    from shardscope.core import UsageError

    p = os.path.join(path, tag)
    if not os.path.isdir(p):
        raise UsageError(f"no step folder {tag!r} here", path)
    return p


def _refusal_json(path: str, err) -> dict:
    """The ``inspect --json`` document of a checkpoint that cannot be read at all: no layout,
    one error problem (``code``: e.g. ``path-outside-checkpoint``, ``wrong-folder``,
    ``unsafe-pickle``, ``bad-checkpoint``) and ``refused: true``."""
    return {"format": None, "path": path, "refused": True, "exit_code": err.exit_code,
            "tensors": 0, "shards": [],
            "problems": [{"code": err.code, "message": err.message, "path": err.path,
                          "severity": "error"}], "notes": []}


def _diff_refusal_json(args, err) -> dict:
    """The ``diff --json`` document of a comparison refused (a usage error, a side that
    cannot be read, a record that fails its CRC-32): the keys of a result with no tensors,
    ``same`` null, ``refused: true``, the exit code and one error problem, as
    :func:`_refusal_json`."""
    return {"a": args.a, "b": args.b, "format_a": None, "format_b": None,
            "atol": args.atol, "rtol": args.rtol, "same": None, "refused": True,
            "exit_code": err.exit_code, "counts": {}, "warnings": [], "largest": [],
            "layers": [], "tensors": [],
            "problems": [{"code": err.code, "message": err.message, "path": err.path,
                          "severity": "error"}]}


def cmd_inspect(args) -> int:
    from shardscope.core import ShardscopeError, detect

    try:
        layout = detect(_with_tag(args.path, args.tag), hf_config=args.hf_config)
    except ShardscopeError as e:
        if not args.json:
            raise
        print(json.dumps(_refusal_json(args.path, e), indent=2))
        return e.exit_code
    for name in args.map or ():
        if name not in layout.tensors:
            from shardscope.core import UsageError

            raise UsageError(f"no tensor named {name!r} (inspect --params lists them)",
                             layout.path)
    deep_done = False
    if args.deep and not any(p.code in ("missing-rank", "missing-file", "unsafe-pickle")
                             for p in layout.errors):
        layout.problems.extend(_deep(layout, show=not args.json))
        deep_done = True
    if deep_done:
        layout.notes.append("deep check: every tensor read; CRC-32 of torch.save data checked "
                            "and NaN/Inf counted (problems below, if any)")
    verdict = None
    if args.check:
        from shardscope.core.judge import check_layout

        verdict = check_layout(layout, args.hf_config, args.trust_remote_code)
        add_verdict(layout, verdict)
    if args.json:
        d = layout.to_dict()
        if not args.params:
            d.pop("params")
        if verdict is not None:
            d["check"] = verdict.to_dict()
        print(json.dumps(d, indent=2))
    else:
        from rich.console import Console

        from shardscope.tui.render import render_layout

        render_layout(layout, stdout_console(), params=args.params)
        for name in args.map or ():
            from shardscope.tui.sharding_map import ShardingMap

            Console().print(ShardingMap(layout.tensors[name], layout, height=12))
    return 3 if layout.errors else 0


#: the width given to Rich when stdout is not a terminal: lines are never wrapped or cut there
#: (a pipe, a file, ``grep``), only a terminal's width folds them
PIPE_WIDTH = 1 << 16


def stdout_console():
    """A Rich console on stdout: the terminal's width on a terminal; else (piped, redirected)
    one so wide that no table cell or line is wrapped or cut at Rich's default 80 columns."""
    from rich.console import Console

    console = Console()
    if console.is_terminal:
        return console
    return Console(width=PIPE_WIDTH)


def add_verdict(layout, verdict) -> None:
    """Record the judge's verdict on ``layout``: a note when it matches or when the check
    could not be made (``architecture check skipped: <why>``: a stated skip, as merge states
    it, not a problem of the files), an ``architecture-mismatch`` error otherwise."""
    from shardscope.core import Problem

    where = layout.config_dir or layout.path
    if verdict.ok or verdict.skipped is not None:
        layout.notes.append(verdict.summary())
    else:
        layout.problems.append(Problem("architecture-mismatch", verdict.summary(), where))


def _deep(layout, show: bool):
    from rich.console import Console
    from rich.progress import Progress

    from shardscope.core.deep import deep_check

    err = Console(stderr=True)
    if not (show and err.is_terminal):
        return deep_check(layout)
    with Progress(console=err, transient=True) as prog:
        task = prog.add_task("reading every tensor", total=None)

        def update(ev):
            prog.update(task, completed=ev.done, total=ev.total)

        return deep_check(layout, on_progress=update)


def cmd_merge(args) -> int:
    from rich.console import Console

    from shardscope.core import MergeOptions, UsageError

    repo_id = args.hf_upload or args.hf_upload_path
    path = args.path or args.local_dir
    output = args.output or args.target_dir
    if not path or not output:
        raise UsageError("usage: shardscope merge PATH -o OUT (or --local_dir X --target_dir Y)")
    err = Console(stderr=True, soft_wrap=True)  # one message, one line, whatever the width
    log = (lambda msg: err.print(f"[dim]{msg}[/]", highlight=False)) if args.verbose else None
    if args.distributed:
        return _merge_distributed(args, path, output, repo_id, err, log)
    # set by Ctrl-C, SIGTERM, SIGHUP (_signals_interrupt); checked between every step
    cancel = getattr(args, "cancel", None) or threading.Event()
    if log:
        log(f"reading the layout of {path}")
    started = time.perf_counter()
    phases = _Phases(err, show=not args.quiet and err.is_terminal, log=log, cancel=cancel)
    from shardscope.core.overlap import finish, likely_cold, plan_first, start_worker

    # a config not checked before: its architecture check imports while the layout is read
    hf_config = args.hf_config or args.hf_model_path
    worker = (start_worker(preload=True)
              if likely_cold(path, hf_config, args.trust_remote_code) else None)
    try:
        layout = _merge_layout(args, path, hf_config, phases, cancel, err)
        opts = MergeOptions(output=output, dtype=args.dtype, max_shard_size=args.max_shard_size,
                            overwrite=args.overwrite, hf_config=hf_config,
                            workers=args.workers, lora=args.lora,
                            lora_adapter=args.lora_adapter, lora_alpha=args.lora_alpha,
                            lora_config=args.lora_config, base_model=args.base_model,
                            model_card=not args.no_card, hf_upload=repo_id,
                            private=args.private, strict=args.strict,
                            trust_remote_code=args.trust_remote_code, crc=args.crc)
        with phases:  # a config not checked before: planned on a guess, checked while writing
            plan, pending = plan_first(layout, opts, worker, on_phase=log, cancel=cancel)
    except BaseException:
        if worker is not None:
            worker.kill()
        raise
    try:
        _stop_if_interrupted(cancel)
        if pending is None:
            _warn(err, plan.warnings, args.quiet)
        elif log:
            log("writing while the architecture check runs (its answers are not cached yet)")
        if log:
            log(f"{layout.format}: {len(layout.tensors)} tensors, {layout.world_size} ranks "
                f"-> {len(plan.files)} output files, {plan.total_bytes} bytes")
        show = not args.quiet and err.is_terminal

        runs = []

        def run(p, pend):
            runs.append(pend)
            if len(runs) > 1 and log:
                log("the architecture check changed the plan: writing it again")
            if show:
                from shardscope.tui.progress import MergeProgressView

                with MergeProgressView(p, err) as view:
                    return _run_cancellable(p, view.update, cancel, log, pend)
            return _run_cancellable(p, None, cancel, log, pend)

        real, result = finish(plan, pending, run, cancel)
    finally:
        if pending is not None:
            pending.close()
    if pending is not None:  # the real plan's warnings, known only now
        _warn(err, real.warnings, args.quiet)
    plan = real
    # the merge is at OUT (run_merge's commit): an interrupt from here on must not say
    # "nothing was written"
    try:
        _stop_if_interrupted(cancel)
        if not args.quiet:
            _merge_summary(result, plan, started, err,
                           pending.waited if runs[-1] is not None else None)
        if repo_id:
            return _verified_upload(result.output, repo_id, args.private, args.revision,
                                    args.commit_message, quiet=args.quiet)
    except KeyboardInterrupt:
        print(f"shardscope: interrupted after the merge was written to {result.output}"
              + ("; nothing was uploaded" if repo_id else ""), file=sys.stderr)
        return 130
    return 0


def _merge_layout(args, path: str, hf_config, phases, cancel, err):
    """The layout ``merge`` reads (its --deep problems added), or the usage error of a LoRA
    option given for a checkpoint without an adapter."""
    from shardscope.core import UsageError, detect

    with phases:
        layout = detect(_with_tag(path, args.tag), deepspeed_weights=args.weights,
                        hf_config=hf_config)
    _stop_if_interrupted(cancel)
    if (layout.notes and layout.notes[0].startswith("reading the whole checkpoint folder")
            and not args.quiet):
        err.print(f"note: {layout.notes[0]}", highlight=False)  # PATH was one of its files
    if layout.lora is None:
        given = [f for f, v in (("--lora-alpha", args.lora_alpha),
                                ("--lora-adapter", args.lora_adapter),
                                ("--lora-config", args.lora_config),
                                ("--base-model", args.base_model)) if v is not None]
        if given:
            raise UsageError(f"{' and '.join(given)} given, but this checkpoint holds no LoRA "
                             "adapter", layout.path)
    if args.deep and not layout.errors:
        layout.problems.extend(_deep(layout, show=not args.quiet))
        _stop_if_interrupted(cancel)
    return layout


def _merge_summary(result, plan, started, err, waited: float | None = None) -> None:
    """The warnings the run added and the one-line summary of a finished merge (not with -q).
    ``waited``: the merge was written while the architecture check ran (core/overlap.py),
    then waited this many seconds for it; None: it was written after the check.
    """
    for w in result.warnings[len(plan.warnings):]:
        err.print(f"[yellow]warning:[/] {w}", highlight=False)
    from shardscope.tui.format import human_bytes

    writing = result.seconds - (waited or 0.0)
    rate = result.tensor_bytes / writing if writing > 0 else 0
    total = time.perf_counter() - started
    check = "" if waited is None else (f" while the architecture check ran, then "
                                       f"{waited:.2f} s waiting for it")
    print(f"wrote {result.output}: {len(result.files)} safetensors file(s), "
          f"{result.tensors} tensors, {human_bytes(result.tensor_bytes)} in {total:.2f} s "
          f"(reading the layout and planning {total - result.seconds:.2f} s, writing "
          f"{writing:.2f} s at {human_bytes(rate)}/s{check})")


class _Phases:
    """While reading the layout and planning: core's phase reports (core/phases.py) shown as
    one transient status line on a terminal, and logged with ``-v``; each report first raises
    KeyboardInterrupt when ``cancel`` is set. Re-entrant: one block per step (the --deep
    progress bar runs between them)."""

    def __init__(self, err, show: bool, log, cancel: threading.Event | None = None):
        self.err, self.show, self.log, self.cancel = err, show, log, cancel

    def __enter__(self):
        from shardscope.core.phases import reporting

        self.status = self.err.status("reading the layout") if self.show else None
        if self.status is not None:
            self.status.__enter__()
        self.ctx = reporting(self.update)
        self.ctx.__enter__()
        return self

    def update(self, text: str) -> None:
        if self.cancel is not None:  # each step: stop there after an eaten KeyboardInterrupt
            _stop_if_interrupted(self.cancel)
        if self.status is not None:
            self.status.update(text)
        if self.log:
            self.log(text)

    def __exit__(self, *exc):
        self.ctx.__exit__(*exc)
        if self.status is not None:
            self.status.__exit__(*exc)
        return False


def _merge_distributed(args, path, output, repo_id, err, log) -> int:
    """``merge --distributed``: this process's part of a merge spread over a launch's nodes
    (core/distributed.py). The writer (rank 0) prints the usual summary, every other process
    one line of what it sent."""
    import signal

    from shardscope.core import MergeOptions, UsageError
    from shardscope.core.distributed import merge_distributed

    for flag, given in (("--deep", args.deep), ("--hf-upload", repo_id), ("--tag", args.tag)):
        if given:
            raise UsageError(f"{flag} is not supported with --distributed yet")
    opts = MergeOptions(output=output, dtype=args.dtype, max_shard_size=args.max_shard_size,
                        overwrite=args.overwrite, hf_config=args.hf_config or args.hf_model_path,
                        workers=max(1, args.workers), lora=args.lora,
                        lora_adapter=args.lora_adapter, lora_alpha=args.lora_alpha,
                        lora_config=args.lora_config, base_model=args.base_model,
                        model_card=not args.no_card, strict=args.strict,
                        trust_remote_code=args.trust_remote_code)
    cancel = threading.Event()

    def stop(signum, frame):
        cancel.set()
        raise KeyboardInterrupt

    old = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGHUP)}
    started = time.perf_counter()
    try:
        if not args.quiet and err.is_terminal:  # one progress line per node
            from shardscope.tui.progress import NodeProgressView

            with NodeProgressView(err) as view:
                info, result, stats, warnings = merge_distributed(
                    path, opts, log=log, cancel=cancel, on_progress=view.update,
                    hf_config=args.hf_config or args.hf_model_path)
        else:
            info, result, stats, warnings = merge_distributed(
                path, opts, log=log, cancel=cancel,
                hf_config=args.hf_config or args.hf_model_path)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    from shardscope.tui.format import human_bytes

    if args.quiet:  # errors only, and the exit code
        return 0
    if result is None:
        for w in warnings:
            err.print(f"[yellow]warning:[/] {w}", highlight=False)
        print(f"{info.label}: sent {stats[0]} pieces ({human_bytes(stats[1])}) of the rank "
              f"files under {info.path} to the writer (rank 0)")
        return 0
    for w in result.warnings:
        err.print(f"[yellow]warning:[/] {w}", highlight=False)
    print(f"{info.label}: wrote {result.output}: {len(result.files)} safetensors file(s), "
          f"{result.tensors} tensors, {human_bytes(result.tensor_bytes)} in "
          f"{time.perf_counter() - started:.2f} s")
    return 0


def _verified_upload(folder, repo_id, private, revision, message, quiet=False) -> int:
    """Upload only a folder that passes verification (exit 3 otherwise, 4 when the upload
    fails); ``quiet``: print nothing but errors."""
    from shardscope.core import BadCheckpointError
    from shardscope.core.publish import upload
    from shardscope.core.verify import verify_folder

    errors = [p for p in verify_folder(folder) if p.severity == "error"]
    if errors:
        raise BadCheckpointError(f"not uploaded: {errors[0].code}: {errors[0].message}",
                                 errors[0].path or folder)
    if not quiet:
        print(f"uploading {folder} to {repo_id} ...", file=sys.stderr)
    url = upload(folder, repo_id, private=private, revision=revision, commit_message=message)
    if not quiet:
        print(f"uploaded to {url}")
    return 0


def cmd_upload(args) -> int:
    if not os.path.isdir(args.path):
        from shardscope.core import UsageError

        raise UsageError("not a folder", args.path)
    return _verified_upload(args.path, args.repo_id, args.private, args.revision,
                            args.commit_message)


def _run_cancellable(plan, on_progress, cancel, log, pending=None):
    """Run the merge; Ctrl-C, SIGTERM and SIGHUP (_signals_interrupt) set the cancel event and
    unwind, so the core removes its temporary folder (kill -9 cannot be caught: the next merge
    cleans up). ``pending``: the plan is speculative (core/overlap.py)."""
    from shardscope.core import run_merge

    try:
        return run_merge(plan, on_progress=on_progress, cancel=cancel, log=log,
                         pending=pending)
    except KeyboardInterrupt:
        cancel.set()
        raise


def _warn(err, warnings, quiet: bool) -> None:
    """A plan's warnings, one line each (none with -q: errors only, and the exit code)."""
    for w in warnings if not quiet else ():
        err.print(f"[yellow]warning:[/] {w}", highlight=False)


def cmd_verify(args) -> int:
    from rich.console import Console
    from rich.table import Table

    from shardscope.core.verify import compare, verify_folder

    from shardscope.core import BadCheckpointError

    console = stdout_console()
    problems = verify_folder(args.path)
    if problems and problems[0].code == "not-hf-folder":
        raise BadCheckpointError(problems[0].message, args.path)
    if not any(p.severity == "error" for p in problems):
        # the weights against the model of the config: "ok" over a folder missing a tensor
        # the model needs would be a lie (from_pretrained initialises it randomly)
        from shardscope.core.verify import architecture_problems

        problems += architecture_problems(args.path, args.trust_remote_code)
    for p in problems:
        color = "red" if p.severity == "error" else "yellow"
        console.print(f"[{color}]{p.severity}: {p.code}[/] {p.path or ''}: {p.message}",
                      highlight=False)
    errors = [p for p in problems if p.severity == "error"]
    warnings = [p for p in problems if p.severity != "error"]
    if args.reference and not errors:  # a folder with errors is not ok, whatever its values
        from shardscope.core.checks import describe_config_differences
        from shardscope.core.verify import config_comparison

        layouts = []
        diffs = compare(args.path, args.reference, args.atol, args.rtol, crc=args.crc,
                        on_layouts=lambda a, b: layouts.extend((a, b)))
        # config.json too: "ok" after --reference reads as "the same model"
        state, where, cfg, as_tensors = config_comparison(*layouts)
        cfg_keys = ", ".join(k for k, _, _ in cfg or ())
        if diffs:
            t = Table("tensor", "difference", "detail", title="differences from the reference")
            for d in diffs:
                t.add_row(d.name, d.kind, d.detail)
            console.print(t)
        else:
            console.print(f"[green]all tensors match[/] {args.reference}"
                          + (f" within atol={args.atol:g} rtol={args.rtol:g}"
                             if args.atol or args.rtol else " bit for bit"), highlight=False)
        if state == "differ":
            console.print(f"[red]config.json differs[/] from {where} in {len(cfg)} key(s), "
                          "this folder's vs the reference's: "
                          + describe_config_differences(cfg), highlight=False)
        elif state == "same":
            console.print(f"config.json matches {where}"
                          + (f" but for {describe_config_differences(as_tensors)}, as the "
                             "tensors' dtypes" if as_tensors else ""), highlight=False)
        else:
            console.print(f"[yellow]config.json not compared[/]: {where}", highlight=False)
        if diffs or state == "differ":
            # the verdict names what differs (never the table's border as the last word)
            kinds = {}
            for d in diffs:
                kinds[d.kind] = kinds.get(d.kind, 0) + 1
            tensors = len(dict.fromkeys(d.name for d in diffs))
            hint = ("; the dtypes differ: compare values with --atol/--rtol"
                    if "dtype" in kinds and not (args.atol or args.rtol) else "")
            what = ([f"{tensors} tensor(s) differ from {args.reference} ("
                     + ", ".join(f"{n} {k}" for k, n in kinds.items()) + ")"] if diffs else [])
            if state == "differ":
                what.append(f"config.json differs from {args.reference}'s ({cfg_keys})"
                            if not diffs else f"config.json differs ({cfg_keys})")
            console.print(
                f"[red]not ok[/] {args.path}: " + " and ".join(what)
                + (f" and {len(errors)} error(s) ("
                   + ", ".join(dict.fromkeys(p.code for p in errors)) + ")" if errors else "")
                + hint, highlight=False)
            return 1
    if errors:
        console.print(f"[red]not ok[/] {args.path}: {len(errors)} error(s) ("
                      + ", ".join(dict.fromkeys(p.code for p in errors)) + ")"
                      + (f" and {len(warnings)} warning(s)" if warnings else "")
                      + (f"; not compared with {args.reference}" if args.reference else ""),
                      highlight=False)
        return 1
    if warnings:  # the verdict names every problem listed above, never a bare "ok"
        console.print(f"[yellow]{len(warnings)} warning(s)[/] {args.path}: "
                      + ", ".join(dict.fromkeys(p.code for p in warnings))
                      + "; the weights are sound"
                      + (f" (within atol={args.atol:g} rtol={args.rtol:g} of {args.reference})"
                         if args.reference and (args.atol or args.rtol) else "")
                      + (", but without config.json from_pretrained cannot load the folder"
                         if any(p.code == "no-config" for p in warnings) else ""),
                      highlight=False)
        return 0
    # under tolerances the verdict says so: "ok" alone reads as bit for bit
    within = (f": within atol={args.atol:g} rtol={args.rtol:g} of {args.reference}"
              if args.reference and (args.atol or args.rtol) else "")
    console.print(f"[green]ok[/] {args.path}{within}", highlight=False)
    return 0


def cmd_diff(args) -> int:
    """``shardscope diff A B``: exit 0 when every tensor is identical (or within
    --atol/--rtol), 1 when they differ, 2/3 for usage/bad checkpoint, 130 on Ctrl-C."""
    from rich.console import Console

    from shardscope.core import MergeCancelled, UsageError
    from shardscope.core.diff import SideOptions, check_readable, diff_checkpoints

    if args.top < 0:  # --atol/--rtol: _check_args
        raise UsageError("--top must not be negative")
    for path in (args.a, args.b):
        check_readable(path)
    side = SideOptions(hf_config=args.hf_config, dtype=args.dtype, weights=args.weights,
                       lora=args.lora,
                       lora_adapter=args.lora_adapter, lora_alpha=args.lora_alpha,
                       lora_config=args.lora_config, base_model=args.base_model)
    err = Console(stderr=True, soft_wrap=True)
    cancel = getattr(args, "cancel", None) or threading.Event()
    try:
        if not args.quiet and err.is_terminal:
            from rich.progress import Progress

            with Progress(console=err, transient=True) as prog:
                task = prog.add_task("comparing", total=None)

                def update(done, total, name):
                    prog.update(task, completed=done, total=total,
                                description=f"comparing {name}")

                result = diff_checkpoints(args.a, args.b, args.atol, args.rtol, side, side,
                                          on_progress=update, cancel=cancel, crc=args.crc)
        else:
            result = diff_checkpoints(args.a, args.b, args.atol, args.rtol, side, side,
                                      cancel=cancel, crc=args.crc)
    except (KeyboardInterrupt, MergeCancelled):
        cancel.set()
        print("shardscope: interrupted", file=sys.stderr)
        return 130
    if args.json:
        print(json.dumps(result.to_dict(top=args.top), indent=2))
    else:
        from shardscope.tui.render import render_diff

        for w in result.warnings:
            err.print(f"[yellow]warning:[/] {w}", highlight=False)
        out = Console()
        if not out.is_terminal:  # piped: full tensor names rather than an 80-column cut
            out = Console(width=max(out.width, 140))
        render_diff(result, out, top=args.top, every=args.all)
    return 0 if result.same else 1


MEGATRON_MISSING = ("--megatron needs megatron-core, which is not installed: "
                    "pip install 'shardscope[megatron]'")


def _importable(name: str) -> bool:
    """Whether module ``name`` can be imported (without importing it, its parent aside)."""
    import importlib.util

    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a parent package missing (or set to None)
        return False


def _check_new_folder(folder: str) -> None:
    """Refuse (UsageError) a folder ``sample`` could not create, before its minute of work:
    ``folder`` itself, or the nearest of its parents that exists, is a file."""
    from shardscope.core import UsageError

    if os.path.exists(folder) and not os.path.isdir(folder):
        raise UsageError("is a file, not a folder; choose a new folder", folder)
    up = os.path.dirname(os.path.normpath(folder))
    while up and not os.path.exists(up):
        up = os.path.dirname(up)
    if up and not os.path.isdir(up):
        raise UsageError(f"is a file, not a folder, so {folder} cannot be made inside it", up)


def cmd_sample(args) -> int:
    from shardscope.core import UsageError
    from shardscope.core.sample import write_sample

    for folder in (args.path, args.reference):
        if folder:
            _check_new_folder(folder)
    if args.megatron:
        from shardscope.core.sample_megatron import write_megatron

        if os.path.exists(args.path):
            raise UsageError("exists; choose a new folder", args.path)
        # find_spec("megatron.core") itself raises "No module named 'megatron'" without it
        if not _importable("megatron") or not _importable("megatron.core"):
            raise UsageError(MEGATRON_MISSING)
        try:
            out = write_megatron(args.path, args.megatron)
        except ImportError as e:
            if (e.name or "").partition(".")[0] == "megatron":
                raise UsageError(MEGATRON_MISSING) from None
            raise UsageError(str(e)) from None
        print(f"wrote Megatron-LM checkpoints of a tiny {args.megatron} model to {out}: "
              + ", ".join(sorted(p.name for p in out.iterdir() if p.name.startswith("tp")))
              + " (each with torch_dist/ and legacy/), and reference/")
        return 0
    # before the minute of writing: write_sample moves the reference *into* an existing folder
    # (and a later verify --reference would compare with the old model there)
    for folder in (args.path, args.reference):
        if folder and os.path.exists(folder) and (not os.path.isdir(folder) or os.listdir(folder)):
            raise UsageError("exists and is not empty; choose a new folder", folder)
    if args.reference and os.path.isdir(args.reference):
        os.rmdir(args.reference)  # empty: the reference is moved into its place
    try:
        write_sample(args.path, world_size=args.world_size, reference=args.reference)
    except FileExistsError as e:
        from shardscope.core import UsageError

        raise UsageError(str(e)) from None
    print(f"wrote a {args.world_size}-rank FSDP2 checkpoint of a tiny Qwen2 model to {args.path}"
          + (f" and its unsharded reference to {args.reference}" if args.reference else ""))
    return 0


#: the subcommand main() ran last (for entry(): how the process may end)
_COMMAND: str | None = None


def entry() -> None:
    """Console-script entry point (and ``python -m shardscope.tui.cli``)."""
    code = main()
    if "--distributed" in sys.argv[1:] and "torch.distributed" in sys.modules:
        # a process that was in a gloo process group ends without running C++ static
        # destructors: after a SIGTERM or a lost peer, gloo's threads could otherwise abort
        # the exit ("terminate called without an active exception", signal 6) and hide the
        # exit code that was decided above (the output is already renamed or removed)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code if isinstance(code, int) else 1)
    if code == 130 or (_COMMAND == "merge" and "torch" in sys.modules
                       and "--hf-upload" not in sys.argv[1:]):
        # interrupted: exit 130 as said. CPython 3.11's `python -m` (Modules/main.c
        # Py_RunMain) kills itself with SIGINT after a clean exit when a KeyboardInterrupt once
        # escaped an exec() of source (Python/pythonrun.c run_eval_code_obj sets the
        # "unhandled Ctrl-C" flag even though it was caught later); dataclasses and
        # namedtuple exec their methods while torch and transformers are imported, so a
        # Ctrl-C there ended the process with -2, not 130.
        # A merge that imported torch (a cast, a LoRA fold, a cold architecture check) is
        # over: its output renamed into place or removed, every file it wrote closed, its
        # lines printed. Tearing the interpreter down would now cost 0.6-1.2 CPU s (torch's
        # modules and C++ static destructors; measured in a process that planned the 4 GB
        # checkpoint of bench/bench.py, against 0.05 s for os._exit): skipped.
        # In both cases the atexit functions still run.
        import atexit

        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # a closed pipe: nothing more can be said there
                pass
        os._exit(code if isinstance(code, int) else 1)
    sys.exit(code)


if __name__ == "__main__":
    entry()
