"""Turn a :class:`CheckpointLayout` and the user's :class:`MergeOptions` into a
:class:`MergePlan`: the exact output files, the tensors in each, and where each tensor's bytes
come from. Knows Hugging Face naming and options; reads no tensor data."""

from __future__ import annotations

import json

import math
import operator
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from .dtypes import CASTABLE, ITEMSIZE, USER_DTYPES
from .errors import BadCheckpointError, OutputExistsError, UsageError
from .formats.common import config_files, read_config
from . import hf_names, lora as lora_mod
from .layout import CheckpointLayout, Piece, TensorInfo, coverage_problems

ADAPTER_DIR = "lora_adapter"

#: error codes that say the weights are not the whole model (frozen parameters a DeepSpeed run
#: excluded at save time; a config the weights disagree with) rather than that files are broken:
#: the architecture check lists what is off, and ``--no-strict`` (as
#: ``load_state_dict(strict=False)``) writes the weights there are, the model card saying so
STRICT_ONLY = frozenset({"frozen-excluded", "config-mismatch"})

#: problems only ``--deep`` finds (core/deep.py): a refusal points to ``inspect --deep``
DEEP_CODES = frozenset({"checksum-mismatch", "nan-inf", "no-checksum", "replica-mismatch"})

#: names of an output layer that ties to the input embedding (transformers' convention)
TIED_PAIRS = (("lm_head.weight", "model.embed_tokens.weight"),)


@dataclass
class MergeOptions:
    """What the user asked for.

    ``output``: the folder to write. ``dtype``: ``None`` keeps each tensor's dtype, else one of
    ``bf16``/``fp16``/``fp32`` (F64/F32/F16/BF16 tensors only, ``dtypes.CASTABLE``: float8,
    integer and boolean tensors are written as stored). ``max_shard_size``: bytes or a
    string such as ``"5GB"`` (decimal units, as huggingface_hub). ``hf_config``: a folder whose
    config/tokenizer files are copied (never its weights). ``workers``: threads moving bytes.
    """

    output: str
    dtype: str | None = None
    max_shard_size: int | str = "5GB"
    overwrite: bool = False
    hf_config: str | None = None
    workers: int = field(default_factory=lambda: min(32, os.cpu_count() or 1))
    #: LoRA handling when the checkpoint has an adapter: fold, adapter, both or base
    lora: str | None = None
    lora_adapter: str | None = None
    lora_alpha: float | None = None
    #: the adapter's own adapter_config.json (a file, or a folder holding it), when it is not
    #: at lora_adapter/ beside the checkpoint
    lora_config: str | None = None
    #: a Hugging Face folder of the base weights, for checkpoints that hold the adapter only
    #: (verl's save_lora_only)
    base_model: str | None = None
    #: write a model card (README.md) when the config folder brings none
    model_card: bool = True
    #: after a verified merge, upload to this Hub repository (front ends act on it; see
    #: :func:`core.publish.upload`)
    hf_upload: str | None = None
    private: bool = False
    #: refuse a merge whose tensors do not match the model class of the config (missing,
    #: extra, other shape or dtype kind: :mod:`core.judge`); False writes them anyway, as
    #: ``load_state_dict(strict=False)`` loads them, and the model card lists what is off
    strict: bool = True
    #: build a model class that only the config folder's own code (``auto_map``) defines
    trust_remote_code: bool = False
    #: check the CRC-32 of every torch.save storage record the merge reads (core/integrity.py)
    crc: bool = True


@dataclass
class Fold:
    """One adapter folded into one weight, as peft's ``merge_and_unload`` does: ``kind`` is
    ``linear`` (``W + scale * B @ A``), ``embedding`` (``W + (scale * (B @ A).T)``, A is
    ``lora_embedding_A``) or ``dora`` (``m / ||W + dW||_row * (W + dW)``, ``magnitude`` is
    the module's ``lora_magnitude_vector``); the adapter tensors and their located pieces."""

    a: TensorInfo
    a_pieces: list[Piece]
    b: TensorInfo
    b_pieces: list[Piece]
    scale: float
    kind: str = "linear"
    magnitude: TensorInfo | None = None
    m_pieces: list[Piece] = field(default_factory=list)


@dataclass
class OutputTensor:
    """One tensor of the output: name, global shape (elements), output dtype and the source
    pieces (located) that fill it. ``nbytes`` is its size in the output."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    source: TensorInfo
    pieces: list[Piece]
    fold: Fold | None = None

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * ITEMSIZE[self.dtype]


@dataclass
class OutputFile:
    """A safetensors file of the output and its tensors, in write order."""

    name: str
    tensors: list[OutputTensor]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


@dataclass
class MergePlan:
    """Everything ``run_merge`` needs: output files, index (when sharded), files to copy
    (source path, relative name), bytes to read per source file, and warnings for the user."""

    layout: CheckpointLayout
    options: MergeOptions
    files: list[OutputFile]
    index: dict | None
    copy_files: list[tuple[str, str]]
    source_bytes: dict[str, int]
    warnings: list[str] = field(default_factory=list)
    #: torch dtype name to write into config.json when the merge casts (``--dtype``), else None
    config_dtype: str | None = None
    #: files made by the plan itself (relative name -> bytes), e.g. adapter_config.json
    generated: dict[str, bytes] = field(default_factory=dict)
    #: the judge's :class:`core.judge.Verdict` on the output tensors (None: not run)
    check: object = None
    #: a speculative plan's question for the architecture check (:func:`_guessed`), else None
    question: dict | None = None

    @property
    def total_bytes(self) -> int:
        return sum(f.nbytes for f in self.files)

    @property
    def tensor_count(self) -> int:
        return sum(len(f.tensors) for f in self.files)


#: a piece's global offsets (the sort key of a tensor's pieces)
_offsets = operator.attrgetter("global_offsets")


def natural_key(name: str):
    """Sort key that orders ``layers.2`` before ``layers.10``."""
    return [(0, int(p), "") if p.isdigit() else (1, 0, p) for p in re.split(r"(\d+)", name)]


def parse_size(size: int | str) -> int:
    """Bytes in ``5GB``, ``500MB``, ``1GiB`` or an int (decimal units as huggingface_hub)."""
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B?)?\s*", size, re.I)
    if not m:
        raise UsageError(f"cannot read the size {size!r} (e.g. 5GB, 500MB)")
    unit = (m[2] or "B").upper()
    mult = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10,
            "MIB": 2**20, "GIB": 2**30, "TIB": 2**40, "K": 10**3, "M": 10**6, "G": 10**9}
    if unit not in mult:
        raise UsageError(f"unknown unit in {size!r}")
    return int(float(m[1]) * mult[unit])


def tie_word_embeddings(config_dir: str | None, trust_remote_code: bool = False) -> bool | None:
    """``tie_word_embeddings`` of the model config in ``config_dir``; when config.json does not
    set it, the model class's default, as transformers resolves it. None without a config, or
    when the config class is remote code (``auto_map``) not trusted: ``trust_remote_code`` is
    passed to ``AutoConfig.from_pretrained`` as a bool, never None, because None makes
    transformers ask "run the custom code? [y/N]" on the terminal
    (transformers/dynamic_module_utils.py ``resolve_trust_remote_code``), which hangs CI."""
    cfg = read_config(config_dir)
    if cfg is None:
        return None
    tied = _tie_in(cfg)
    if tied is not None:
        return tied
    from .judge import default_tie_word_embeddings

    return default_tie_word_embeddings(config_dir, trust_remote_code)


def _tie_in(cfg: dict | None) -> bool | None:
    """``tie_word_embeddings`` as config fields ``cfg`` set it (or their ``text_config``, a
    vision-language model's), else None; nothing imported."""
    for c in (cfg or {}, (cfg or {}).get("text_config") or {}):
        if isinstance(c, dict) and "tie_word_embeddings" in c:
            return bool(c["tie_word_embeddings"])
    return None


#: files a folder made by a merge holds; --overwrite replaces only folders holding nothing else
MERGED_MARKERS = ("model.safetensors", "model.safetensors.index.json", "config.json")


def recover_set_aside(out: Path, overwrite: bool) -> str | None:
    """An output that an interrupted ``--overwrite`` merge had set aside: renamed to
    ``.OUT.shardscope-tmp-old-PID`` beside ``out`` by a process that is gone (killed with
    SIGKILL between its two renames, or after them but before removing it; core/execute.py
    ``_move_into_place``). With ``out`` missing it is put back at ``out`` (as if that merge had
    not run); with ``out`` present it was superseded by that merge's own output and is removed.
    Returns what was done (one line) or None. Raises :class:`OutputExistsError` when the output
    was put back and ``overwrite`` is off, saying where it came from."""
    import shutil

    from .execute import left_by_dead_merges

    done = None
    for p in left_by_dead_merges(out, "old-"):
        if not out.exists():
            os.rename(p, out)
            if not overwrite:
                raise OutputExistsError(f"exists: put back from {p.name}, where an interrupted "
                                        "--overwrite merge had set it aside; pass --overwrite "
                                        "to replace it", str(out))
            done = (f"put {out} back from {p.name}, where an interrupted --overwrite merge had "
                    "set it aside (replaced now, as --overwrite asks)")
        else:
            shutil.rmtree(p, ignore_errors=True)
            done = f"removed {p}, an output replaced by an interrupted --overwrite merge"
    return done


def check_output(out: Path, overwrite: bool, source: str | None = None) -> None:
    """Refuse an output that would lose data. Raises :class:`UsageError` when ``out`` is a
    file, is or contains the ``source`` checkpoint, or lies inside it, or when ``overwrite``
    would replace a non-empty folder that does not look like a model folder;
    :class:`OutputExistsError` when ``out`` exists and ``overwrite`` is off."""
    if out.is_symlink() and not out.exists():
        raise UsageError("is a symbolic link that leads nowhere (a missing target or a loop)",
                         str(out))
    if out.exists() and not out.is_dir():
        raise UsageError("exists and is not a folder", str(out))
    for parent in out.absolute().parents:  # the folder cannot be made under a file
        if parent.exists():
            if not parent.is_dir():
                raise UsageError(f"cannot make the output folder: {parent} is a file, not a "
                                 "folder", str(out))
            break
    if source is not None:
        src, dst = Path(os.path.realpath(source)), Path(os.path.realpath(out))
        if dst == src or dst in src.parents:
            raise UsageError("the output would contain the checkpoint being merged; choose "
                             "another folder", str(out))
        if src in dst.parents:
            raise UsageError("the output must not be inside the checkpoint", str(out))
    if out.exists() and not overwrite:
        raise OutputExistsError("exists; pass --overwrite to replace it", str(out))
    if out.exists() and any(out.iterdir()) and not any((out / m).exists()
                                                       for m in MERGED_MARKERS):
        raise UsageError("exists and does not look like a model folder; refusing to replace "
                         "it", str(out))


def plan_merge(layout: CheckpointLayout, options: MergeOptions,
               writing: bool = True, speculative: bool = False) -> MergePlan:
    """Plan the merge of ``layout`` into a Hugging Face folder.

    With ``writing`` off (``shardscope diff``: the tensors a merge would write, read in place)
    the output folder is neither checked nor given a model card.

    ``speculative``: a guess made without the model (nothing imported): the checkpoint's own
    names, transformers' usual tied pair dropped when config.json says it is tied, no
    architecture check; its ``question`` says what the check needs to know
    (core/archworker.py). Only core/overlap.py uses it, to write ahead while the check runs,
    and commits what it wrote only when the real plan writes the same tensor files.

    Raises :class:`BadCheckpointError` (listing the problems) when the layout has errors or a
    piece cannot be located; :class:`OutputExistsError` when the output exists and overwrite is
    off; :class:`UsageError` for a bad option.
    """
    from .phases import phase

    phase("planning the output files")
    recovered = None
    if writing:
        recovered = recover_set_aside(Path(options.output), options.overwrite)
        check_output(Path(options.output), options.overwrite, layout.path)
    from .native_names import DETAIL as NATIVE

    native = NATIVE in layout.details or any(p.code == "native-names-no-config"
                                             for p in layout.problems)
    own_config = layout.config_dir  # the checkpoint's own (huggingface/), before --hf-config
    if ((layout.format.startswith("megatron") or native) and options.hf_config
            and os.path.realpath(layout.config_dir or "") != os.path.realpath(options.hf_config)):
        from .formats import detect  # the cut into Hugging Face tensors depends on the config

        layout = detect(layout.path, hf_config=options.hf_config)
    blocking = [p for p in layout.errors if options.strict or p.code not in STRICT_ONLY]
    if blocking:
        first = blocking[0]
        more = f" (and {len(blocking) - 1} more problems)" if len(blocking) > 1 else ""
        hint = ("; pass --no-strict to write the weights there are" if first.code in STRICT_ONLY
                else "")
        deep = any(p.code in DEEP_CODES for p in blocking)  # found by reading the data
        raise BadCheckpointError(f"{first.message}{more}{hint}; run `shardscope inspect"
                                 f"{' --deep' if deep else ''}` for the list",
                                 first.path or layout.path)
    # a diff side (writing=False) writes nothing: its waived problems are reported as they are
    waived = [f"--no-strict, written anyway: {p.message}" if writing else p.message
              for p in layout.errors]
    if not layout.tensors:
        raise BadCheckpointError("the checkpoint holds no model tensors", layout.path)
    target = None
    if options.dtype:
        target = USER_DTYPES.get(options.dtype.lower())
        if target is None:
            raise UsageError(f"unknown dtype {options.dtype!r} (bf16, fp16 or fp32)")
    max_shard = parse_size(options.max_shard_size)
    if max_shard <= 0:
        raise UsageError("--max-shard-size must be positive")
    warnings: list[str] = list(waived) + ([recovered] if recovered else [])
    config_dir = layout.config_dir
    copy = list(layout.extra_files)
    if options.hf_config:
        if not Path(options.hf_config, "config.json").is_file():
            raise UsageError("has no config.json", options.hf_config)
        config_dir = options.hf_config
        copy = config_files(options.hf_config)
        if own_config and os.path.realpath(own_config) != os.path.realpath(options.hf_config):
            from .checks import config_differences, describe_config_differences

            differ = config_differences(options.hf_config, own_config)
            if differ:  # said: the output is not the model the run's own config describes
                warnings.append(
                    f"--hf-config {options.hf_config}: its config.json differs from the "
                    f"checkpoint's own {os.path.join(own_config, 'config.json')} in "
                    f"{len(differ)} key(s), --hf-config's vs the checkpoint's: "
                    f"{describe_config_differences(differ)}; the output takes --hf-config's")
    derived = None
    if config_dir is None and layout.derived_config:
        derived = derived_config_json(layout.derived_config)
        warnings.append("no Hugging Face config found: config.json derived from the "
                        "checkpoint's args (no tokenizer); pass --hf-config DIR for the real "
                        "one")
        warnings.extend(p.message for p in layout.problems if p.code == "config-guessed")
    elif config_dir is None:
        warnings.append("no Hugging Face config found (pass --hf-config DIR): the output holds "
                        "weights only and will not load with from_pretrained")
        if layout.format == "dcp-hf":  # core/formats/dcp_hf.py: no global shape recorded
            warnings.append(f"DCP's per-rank safetensors record no global shapes: without a "
                            f"config, a missing last rank file cannot be detected (the shapes "
                            f"are those of the {len(layout.files)} rank files present)")
    lora, adapter = lora_choice(layout, options)
    recorded = lora.adapters[adapter.name] if adapter is not None else None
    if (options.lora_alpha is not None and recorded is not None
            and recorded.lora_alpha is not None and recorded.lora_alpha != options.lora_alpha):
        # peft's lora_alpha is the default alpha: alpha_pattern's entries still apply (as
        # peft applies them to an adapter_config.json with another lora_alpha)
        kept = recorded.pattern_alphas()
        n = sum(k for _, k in kept.values())
        warnings.append(f"--lora-alpha {options.lora_alpha:g} overrides the lora_alpha "
                        f"{recorded.lora_alpha:g} the checkpoint records "
                        f"({recorded.alpha_source or 'its adapter metadata'})" + (
                            f", not its alpha_pattern: {n} module{'s' if n > 1 else ''} keep "
                            "their own alpha (" + ", ".join(
                                f"{key} {a:g} on {k} module{'s' if k > 1 else ''}"
                                for key, (a, k) in kept.items())
                            + "); another alpha_pattern takes an adapter_config.json given "
                            "by --lora-config FILE" if kept else ""))
    mode = options.lora if lora is not None else None
    sources = dict(layout.tensors)
    base_layout = None
    if lora is not None and lora.lora_only:  # the base weights come from --base-model
        base_layout = _base_model(options.base_model)
        if layout.config_dir is not None:
            _same_model(layout.config_dir, options.base_model)
        sources.update(base_layout.tensors)
        if config_dir is None and not options.hf_config:
            config_dir, copy = options.base_model, config_files(options.base_model)
            warnings = [w for w in warnings if not w.startswith("no Hugging Face config")]
    # output name -> source tensor name
    mapping: dict[str, str] = {}
    for name in sources:
        if base_layout is not None and name in layout.tensors:
            continue  # adapter tensors of an adapter-only checkpoint
        out_name = name if mode is None else lora_mod.output_name(name, mode, adapter.name)
        if out_name is not None:
            mapping[out_name] = name
    resolver = (layout if base_layout is None else base_layout).resolve_piece
    question = None
    if speculative:
        mapping, memory_names, verdict, question = _guessed(
            layout if base_layout is None else base_layout, mapping, config_dir, options)
    else:
        if config_dir is not None:  # tied copies save_pretrained drops must be copies indeed
            from .judge import tied_aliases

            for alias, kept in tied_aliases(config_dir, options.trust_remote_code).items():
                if alias in mapping and kept in mapping:
                    _check_tied(_source(mapping[alias], sources),
                                _source(mapping[kept], sources), alias, kept, resolver,
                                layout.path)
        # in-memory names -> the names and tensors save_pretrained writes (fused experts cut)
        mapping, memory_names = hf_names.saved_mapping(
            layout if base_layout is None else base_layout, mapping, config_dir,
            options.trust_remote_code)
        verdict = _judge(layout, sources, mapping, config_dir, options)
    if speculative:
        pass  # _guessed dropped the usual tied copy; the real plan checks it
    elif verdict.skipped is None:
        for alias, kept in verdict.aliases.items():
            if kept in mapping:
                _check_tied(_source(mapping[alias], sources), _source(mapping[kept], sources),
                            alias, kept, resolver, layout.path)
            del mapping[alias]  # FSDP/DCP keep tied copies; save_pretrained writes one
    else:  # no model class to ask: transformers' usual pair, as the config says
        if options.strict:
            raise BadCheckpointError(unchecked_refusal(verdict.skipped), layout.path)
        tied = (tie_word_embeddings(config_dir, options.trust_remote_code) if config_dir
                else (layout.derived_config or {}).get("tie_word_embeddings"))
        for out_name, emb in TIED_PAIRS:
            if tied and out_name in mapping and emb in mapping:
                _check_tied(_source(mapping[out_name], sources), _source(mapping[emb], sources),
                            out_name, emb, resolver, layout.path)
                del mapping[out_name]
            elif tied is False and out_name not in mapping and emb in mapping:
                raise BadCheckpointError(f"the config says the embeddings are untied, but the "
                                         f"checkpoint has no {out_name}", config_dir)
        if writing:
            warnings.append(f"--no-strict, written anyway: {verdict.summary()}; the tensors "
                            "keep the checkpoint's own (in-memory) names, which nothing "
                            "checked against the names save_pretrained writes")
        elif config_dir or derived is not None:  # e.g. a side of diff: the reason alone
            warnings.append(verdict.summary())
    if verdict.mismatched:
        if options.strict:
            raise BadCheckpointError(
                f"the weights do not match the model {verdict.architecture} of the config: "
                + "; ".join(verdict.problems()) + f" ({verdict.matched}/{verdict.expected} "
                "expected tensors match); pass --no-strict to write them anyway", layout.path)
        warnings.append(f"--no-strict, written anyway: {verdict.summary()}" if writing
                        else verdict.summary())
    elif verdict.note and verdict.named:  # the weights are another head than config.json names
        warnings.append(verdict.summary())
    source_bytes: dict[str, int] = {}

    def located(t: TensorInfo) -> list[Piece]:
        gaps = coverage_problems(t)  # never write a tensor the pieces do not fill exactly
        if gaps:
            raise BadCheckpointError(gaps[0].message, gaps[0].path or layout.path)
        pieces = sorted(t.pieces, key=_offsets)
        lay = layout if base_layout is None or t.name in layout.tensors else base_layout
        if lay.resolve_piece is not None:
            pieces = [lay.resolve_piece(p) for p in pieces]
        for p in pieces:  # p.nbytes, without two property calls per piece (many ranks)
            source_bytes[p.file] = source_bytes.get(p.file, 0) + math.prod(p.shape) * \
                ITEMSIZE[p.dtype]
        return pieces

    lora_src = _lora_sources(layout, adapter) if adapter is not None else {}
    tensors: dict[str, OutputTensor] = {}
    folded: set[str] = set()
    for out_name in sorted(mapping, key=natural_key):
        t = _source(mapping[out_name], sources)
        dtype = target if target and t.dtype in CASTABLE else t.dtype
        ot = OutputTensor(out_name, t.shape, dtype, t, located(t))
        module = memory_names.get(out_name, out_name).rsplit(".", 1)[0]
        if mode in ("fold", "both") and out_name.endswith(".weight") and module in lora_src:
            ot.fold = _fold(module, lora_src[module], t, adapter, located, layout.path)
            folded.add(module)
        tensors[out_name] = ot
    unfolded = sorted(set(lora_src) - folded, key=natural_key)
    if mode in ("fold", "both") and unfolded:  # never leave an update out silently
        where = options.base_model if base_layout is not None else layout.path
        raise BadCheckpointError(f"adapter module {unfolded[0]} has no weight "
                                 f"{unfolded[0]}.weight in the merged model to fold into"
                                 + (f" (and {len(unfolded) - 1} more)" if len(unfolded) > 1
                                    else ""), where)
    files, index = _shard(tensors, max_shard)
    generated: dict[str, bytes] = {}
    if derived is not None:
        generated["config.json"] = derived
    if mode in ("adapter", "both"):
        atensors = []
        for module, parts in sorted(lora_src.items(), key=lambda kv: natural_key(kv[0])):
            for kind, t in parts.items():
                atensors.append(OutputTensor(lora_mod.adapter_key(module, kind), t.shape,
                                             t.dtype, t, located(t)))
        for module in sorted(lora_src, key=natural_key):
            # peft's save_pretrained (save_embedding_layers="auto") keeps the base weights of
            # a LoRA-wrapped input/output embedding in the adapter file as well
            if module.rsplit(".", 1)[-1] in lora_mod.EMBEDDING_LAYER_NAMES:
                for out_name in sorted(n for n in mapping if n.rsplit(".", 1)[0] == module):
                    t = _source(mapping[out_name], sources)
                    key = f"{lora_mod.PREFIX}{module}.base_layer.{out_name.rsplit('.', 1)[1]}"
                    atensors.append(OutputTensor(key, t.shape, t.dtype, t, located(t)))
        for name, t in sorted(layout.tensors.items()):
            key = lora_mod.saved_module_key(name, adapter.name)
            if key is not None:  # the trained copy of a modules_to_save module
                atensors.append(OutputTensor(key, t.shape, t.dtype, t, located(t)))
        files.append(OutputFile(f"{ADAPTER_DIR}/adapter_model.safetensors", atensors))
        modules = {memory_names.get(n, n).rsplit(".", 1)[0] for n in mapping}
        generated[f"{ADAPTER_DIR}/adapter_config.json"] = lora_mod.adapter_config_json(
            adapter, modules)
    if lora is not None and mode == "both":
        warnings.append(f"{ADAPTER_DIR}/ applies to the base model, not to the folded one")
    config_dtype = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}.get(target or "")
    if verdict.ok and verdict.named and config_dir:
        copy = [(src, rel) for src, rel in copy if rel != "config.json"]
        generated["config.json"] = _config_naming(config_dir, verdict.architecture,
                                                  config_dtype)
        warnings.append(f"config.json written with architectures [{verdict.architecture}] "
                        f"(the checkpoint's says {verdict.named})")
    plan = MergePlan(layout, options, files, index, copy, source_bytes, warnings, config_dtype,
                     generated, verdict, question)
    if writing and options.model_card and not any(rel == "README.md" for _, rel in copy):
        from .publish import model_card

        plan.generated["README.md"] = model_card(plan, _version()).encode()
    return plan


def _guessed(layout: CheckpointLayout, mapping: dict, config_dir: str | None,
             options: MergeOptions):
    """(mapping, memory names, verdict, question) of a speculative plan (:func:`plan_merge`):
    the in-memory names kept, ``lm_head.weight`` dropped when config.json itself says the
    embeddings are tied (nothing imported to learn a class default), a skipped verdict, and
    the question for core/archworker.py: the config and :func:`core.hf_names.form_signature`
    of the names."""
    from .judge import Verdict

    tied = _tie_in(read_config(config_dir) if config_dir else layout.derived_config)
    question = {"config_dir": config_dir,
                "config_fields": None if config_dir else layout.derived_config,
                "trust_remote_code": bool(options.trust_remote_code),
                # what hf_names.saved_mapping is asked: the names before any tied copy goes
                "form": hf_names.form_signature(layout, mapping) if config_dir else None}
    mapping = dict(mapping)
    for out_name, emb in TIED_PAIRS:
        if tied and out_name in mapping and emb in mapping:
            del mapping[out_name]
    return mapping, {}, Verdict(skipped="speculative plan: the model was not asked"), question


def _check_tied(alias: TensorInfo, kept: TensorInfo, alias_name: str, kept_name: str,
                resolve, where: str) -> None:
    """Refuse to drop ``alias`` as a tied copy of ``kept`` unless it holds the same values: a
    config that says ``tie_word_embeddings`` over a checkpoint whose output layer was trained
    apart would otherwise lose that layer silently. Pieces at the same bytes (FSDP/DCP saving
    one shared storage) are equal without reading; others are read (``core.read``) and
    compared bit for bit. Raises :class:`BadCheckpointError` naming both tensors."""
    def placed(t):
        ps = [p if resolve is None or p.numel == 0 else resolve(p) for p in t.pieces]
        return sorted(ps, key=lambda p: p.global_offsets)

    why = None
    if alias.shape != kept.shape or alias.dtype != kept.dtype:
        why = (f"it is {list(alias.shape)} {alias.dtype}, {kept_name} is {list(kept.shape)} "
               f"{kept.dtype}")
    else:
        pa, pk = placed(alias), placed(kept)
        key = [(p.file, p.byte_offset, p.shape, p.stride, p.global_offsets) for p in pa]
        if alias.flat != kept.flat or key != [(p.file, p.byte_offset, p.shape, p.stride,
                                               p.global_offsets) for p in pk]:
            from .read import Sources, read_words

            src = Sources()
            try:
                a = read_words(pa, alias.shape, alias.dtype, src, alias.flat)
                k = read_words(pk, kept.shape, kept.dtype, src, kept.flat)
            finally:
                src.close()
            differ = int((a != k).sum())
            if differ:
                why = f"{differ} of its {a.size} elements differ from {kept_name}"
    if why is not None:
        raise BadCheckpointError(
            f"the config ties {alias_name} to {kept_name} (tie_word_embeddings), but the "
            f"checkpoint's {alias_name} was trained apart: {why}; set tie_word_embeddings to "
            "false in config.json (or --hf-config) to keep it", where)


def unchecked_refusal(why: str) -> str:
    """The strict merge's refusal when the architecture check cannot be made (``why``: the
    judge's reason: no config, a ``model_type`` transformers does not know, remote code not
    trusted). Without the model class nothing vouches for the names written: training saves
    ``model.state_dict()``, the names in memory, and transformers 5 saves some models under
    other names (a vision-language model's ``model.language_model.*``, fused experts), which
    only the class's ``save_pretrained`` steps give (:mod:`core.hf_names`)."""
    fix = ("give --hf-config DIR (the model's config folder)" if why.startswith("no config")
           else "pass --trust-remote-code to build it" if "--trust-remote-code" in why
           else "give --hf-config DIR with a config transformers knows")
    return (f"architecture check skipped: {why.split('; pass --')[0].split(' (pass --')[0]}: "
            "the tensor names cannot be checked against those save_pretrained writes (a "
            "vision-language or fused-MoE model keeps other names in memory); " + fix
            + ", or pass --no-strict to write the checkpoint's own names unchecked")


def _source(src: "str | TensorInfo", sources: dict[str, TensorInfo]) -> TensorInfo:
    """The tensor a mapping entry names: a stored tensor by name, or one cut by
    :func:`core.hf_names.saved_mapping`."""
    return src if isinstance(src, TensorInfo) else sources[src]


def _judge(layout: CheckpointLayout, sources: dict[str, TensorInfo], mapping: dict,
           config_dir: str | None, options: MergeOptions):
    """The judge's verdict on the output tensors (``mapping``: output name -> source name or
    cut :class:`TensorInfo`)
    against the config's model class (:func:`core.judge.check`)."""
    from .judge import check

    tensors = {}
    for out, src in mapping.items():  # a source name, or a tensor cut by hf_names
        t = _source(src, sources)
        tensors[out] = (t.shape, t.dtype)
    fields = layout.derived_config if config_dir is None else None
    return check(tensors, config_dir, fields, options.trust_remote_code)


def _config_naming(config_dir: str, architecture: str, dtype: str | None) -> bytes:
    """``config.json`` of ``config_dir`` with ``architectures`` set to the class the weights
    are (verl's critic keeps the actor's ``*ForCausalLM``; from_pretrained would then build
    an lm_head at random), and ``dtype`` set when the merge casts."""
    import json

    cfg = read_config(config_dir)
    cfg["architectures"] = [architecture]
    if dtype:
        for key in ("dtype", "torch_dtype"):
            if key in cfg or key == "dtype":
                cfg[key] = dtype
    return (json.dumps(cfg, indent=2, sort_keys=True) + "\n").encode()


def derived_config_json(fields: dict) -> bytes:
    """``config.json`` bytes for config fields derived from a checkpoint (``model_type`` plus
    the family's field names): :func:`core.judge.config_json_for_fields`."""
    from .judge import config_json_for_fields

    return config_json_for_fields(fields)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("shardscope")
    except PackageNotFoundError:
        return "(source tree)"


def lora_choice(layout: CheckpointLayout, options: MergeOptions):
    """(LoraInfo, chosen AdapterInfo) or (None, None). Raises UsageError (exit 2) when the
    user must choose (mode, adapter name), when alpha is unknown or uncertain but needed, and
    when an adapter-only checkpoint lacks ``--base-model``; BadCheckpointError (exit 3) for a
    LoRA variant shardscope does not support (LoRA on parameters, LoRA bias, ...)."""
    lora = layout.lora
    if lora is None or not hasattr(lora, "adapters"):
        if options.lora not in (None, "base"):
            raise UsageError(f"--lora {options.lora}: this checkpoint holds no LoRA adapter")
        if options.base_model:
            raise UsageError("--base-model is for checkpoints that hold a LoRA adapter only")
        return None, None
    if options.lora_config:
        from .lora import detect_lora, find_adapter_config

        if find_adapter_config(Path(layout.path), options.lora_config) is None:
            raise UsageError("no peft LoRA adapter_config.json there", options.lora_config)
        lora = detect_lora({n: t.shape for n, t in layout.tensors.items()}, layout.path,
                           options.lora_config)
    if options.lora is None:
        raise UsageError(f"the checkpoint holds LoRA ({lora.summary()}): choose --lora fold "
                         "(into the weights), adapter (base + PEFT folder), both, or base "
                         "(drop it)")
    if options.lora not in lora_mod.MODES:
        raise UsageError(f"--lora must be one of {', '.join(lora_mod.MODES)}")
    if lora.unsupported and options.lora != "base":  # a feature, not a misuse: exit 3
        raise BadCheckpointError(f"not supported yet: {', '.join(lora.unsupported)}; --lora "
                                 "base writes the base weights alone", layout.path,
                                 code="unsupported-lora")
    if lora.lora_only and not options.base_model:
        raise UsageError("the checkpoint holds LoRA adapter tensors only (no base weights, as "
                         "verl's save_lora_only writes): the base weights are needed; pass "
                         "--base-model DIR (the Hugging Face folder of the base model)",
                         layout.path)
    if options.base_model and not lora.lora_only:
        raise UsageError("the checkpoint holds its own base weights; --base-model is for "
                         "checkpoints that hold the LoRA adapter only")
    names = sorted(lora.adapters)
    if options.lora_adapter:
        if options.lora_adapter not in lora.adapters:
            raise UsageError(f"no adapter named {options.lora_adapter!r} (found: "
                             f"{', '.join(names)})")
        adapter = lora.adapters[options.lora_adapter]
    elif len(names) == 1:
        adapter = lora.adapters[names[0]]
    else:
        raise UsageError(f"several adapters ({', '.join(names)}): choose one with "
                         "--lora-adapter NAME")
    if options.lora_alpha is not None:
        if options.lora_alpha <= 0:
            raise UsageError("--lora-alpha must be positive")
        import dataclasses

        adapter = dataclasses.replace(adapter, lora_alpha=float(options.lora_alpha),
                                      alpha_source="--lora-alpha", alpha_doubt=None)
    if adapter.lora_alpha is None and options.lora != "base":
        raise UsageError(f"adapter {adapter.name!r}: lora_alpha is not recorded in the "
                         "checkpoint (no lora_train_meta.json or lora_adapter/"
                         "adapter_config.json); pass the adapter's adapter_config.json with "
                         "--lora-config FILE or the run's value with --lora-alpha, "
                         "shardscope never invents one")
    if adapter.alpha_doubt and options.lora != "base":
        raise UsageError(f"adapter {adapter.name!r}: {adapter.alpha_doubt}, so each module's "
                         "alpha is unknown; pass the adapter's adapter_config.json with "
                         "--lora-config FILE, or --lora-alpha A when one alpha holds for every "
                         "module")
    return lora, adapter


#: config.json fields that fix a model's tensors (names, shapes, tying): a base model whose
#: config disagrees with the checkpoint's own on one of them is another model
MODEL_FIELDS = ("model_type", "vocab_size", "hidden_size", "intermediate_size",
                "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                "tie_word_embeddings", "attention_bias", "num_experts", "num_local_experts",
                "moe_intermediate_size", "text_config", "vision_config")


def _same_model(config_dir: str, base: str) -> None:
    """Refuse ``--base-model`` when its config.json describes another model than the
    checkpoint's own config folder (``huggingface/``, saved from the base the adapter was
    trained on): another family, size or tying would otherwise surface as a bare "weights do
    not match the model" refusal, or worse. Fields absent from either side are not compared
    (their defaults belong to the class). Raises :class:`UsageError` naming the differences."""

    def load(d):
        try:
            cfg = json.loads(Path(d, "config.json").read_text())
        except (OSError, ValueError):
            return None
        return cfg if isinstance(cfg, dict) else None

    mine, theirs = load(config_dir), load(base)
    if mine is None or theirs is None:
        return  # a bad or missing config is reported where it is read
    diff = [f"{k} {theirs[k]!r}, not {mine[k]!r}" for k in MODEL_FIELDS
            if k in mine and k in theirs and mine[k] != theirs[k]]
    if diff:
        raise UsageError(
            f"is another model than the one this adapter was trained on: its config.json has "
            + "; ".join(diff[:4]) + (f" (and {len(diff) - 4} more)" if len(diff) > 4 else "")
            + f", against {Path(config_dir, 'config.json')}", base)


def _base_model(path: str):
    """The layout of ``--base-model`` (a Hugging Face folder of the base weights)."""
    from .formats import detect

    if not Path(path).exists():
        raise UsageError("no such folder (--base-model)", path)
    if not Path(path, "config.json").is_file():
        try:
            fmt = detect(path).format
        except (BadCheckpointError, OSError):
            fmt = None
        raise UsageError("is not a Hugging Face model folder (no config.json)" + (
            f": it is a {fmt} checkpoint; merge it first and pass the merged folder"
            if fmt not in (None, "hf", "hf-bin") else ""), path)
    base = detect(path)
    if base.format not in ("hf", "hf-bin"):
        raise UsageError(f"is a {base.format} checkpoint, not a Hugging Face model folder",
                         path)
    if base.lora is not None:
        raise UsageError("holds a LoRA adapter itself; pass the plain base model", path)
    if base.errors:
        raise BadCheckpointError(base.errors[0].message, base.errors[0].path or path)
    return base


def _lora_sources(layout: CheckpointLayout, adapter) -> dict[str, dict[str, TensorInfo]]:
    """module -> its adapter tensors by kind (``lora_A``/``lora_B``, or
    ``lora_embedding_A``/``lora_embedding_B`` for an embedding; plus
    ``lora_magnitude_vector`` under DoRA)."""
    out = {}

    def get(module, suffix):
        return (layout.tensors.get(f"{lora_mod.PREFIX}{module}.{suffix}")
                or layout.tensors.get(f"{module}.{suffix}"))

    for module in adapter.modules:
        kinds = (("lora_embedding_A", "lora_embedding_B") if module in adapter.embeddings
                 else ("lora_A", "lora_B"))
        parts = {}
        for kind in kinds:
            suffix = f"{kind}.{adapter.name}" + ("" if kind.startswith("lora_embedding")
                                                 else ".weight")
            t = get(module, suffix)
            if t is None:
                raise BadCheckpointError(f"{module}: adapter {adapter.name!r} lacks {kind}",
                                         layout.path)
            parts[kind] = t
        if module in adapter.dora:
            parts["lora_magnitude_vector"] = get(
                module, f"lora_magnitude_vector.{adapter.name}.weight")
        out[module] = parts
    return out


def _fold(module: str, parts: dict, w: TensorInfo, adapter, located, where: str) -> Fold:
    """The :class:`Fold` of ``module``'s adapter into its weight ``w``, shapes checked."""
    if "lora_embedding_A" in parts:
        a, b = parts["lora_embedding_A"], parts["lora_embedding_B"]
        got, kind = (a.shape[1], b.shape[0]), "embedding"
        what = "(lora_embedding_B @ lora_embedding_A).T"
    else:
        a, b = parts["lora_A"], parts["lora_B"]
        got, kind = (b.shape[0], a.shape[1]), "linear"
        what = "lora_B @ lora_A"
    if got != tuple(w.shape) or a.shape[0] != b.shape[1]:
        raise BadCheckpointError(f"{module}: {what} is {got} (rank {a.shape[0]} against "
                                 f"{b.shape[1]}), the weight is {tuple(w.shape)}", where)
    f = Fold(a, located(a), b, located(b), adapter.scale_for(module), kind)
    mag = parts.get("lora_magnitude_vector")
    if mag is not None:
        if tuple(mag.shape) != (w.shape[0],):
            raise BadCheckpointError(f"{module}: the DoRA magnitude has shape {mag.shape}, the "
                                     f"weight has {w.shape[0]} rows", where)
        f.kind, f.magnitude, f.m_pieces = "dora", mag, located(mag)
    return f


def _shard(tensors: dict[str, OutputTensor], max_shard: int):
    """Output files via huggingface_hub's split helper (same file names and index as
    ``save_pretrained``)."""
    from huggingface_hub.serialization import split_state_dict_into_shards_factory

    split = split_state_dict_into_shards_factory(
        tensors, get_storage_size=lambda t: t.nbytes,
        filename_pattern="model{suffix}.safetensors", max_shard_size=max_shard)
    files = [OutputFile(fname, [tensors[n] for n in sorted(names, key=natural_key)])
             for fname, names in split.filename_to_tensors.items()]
    index = None
    if split.is_sharded:
        index = {"metadata": {**split.metadata, "total_size": sum(t.nbytes for t in
                                                                  tensors.values())},
                 "weight_map": {n: split.tensor_to_filename[n]
                                for n in sorted(tensors, key=natural_key)}}
    return files, index
