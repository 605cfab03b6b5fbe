"""LoRA adapters inside sharded checkpoints: detection, each module's rank and alpha, the output
names of each mode, and the facts the PEFT adapter folder needs.

Key facts (peft 0.21 ``tuners/lora/layer.py``, ``tuners/lora/model.py``,
``utils/save_and_load.py``; checked on FSDP2 checkpoints of real peft models): the model's
state dict is under ``base_model.model.``; a target module ``M`` keeps its base weights as
``M.base_layer.{weight,bias}`` and its adapter as ``M.lora_A.<adapter>.weight`` (r x in) and
``M.lora_B.<adapter>.weight`` (out x r); an embedding keeps ``M.lora_embedding_A.<adapter>``
(r x num_embeddings) and ``M.lora_embedding_B.<adapter>`` (dim x r); DoRA adds
``M.lora_magnitude_vector.<adapter>.weight`` (out). Each module has its own rank (its
``lora_A`` shape) and alpha: ``LoraModel._create_and_replace`` takes
``rank_pattern``/``alpha_pattern`` entries through ``peft.utils.other.get_pattern_key`` on the
module path (without ``base_model.model.``), else ``r``/``lora_alpha``. ``scaling = alpha / r``
(rsLoRA: ``alpha / sqrt(r)``). LoRA on parameters (``target_parameters``, ``ParamWrapper``)
nests ``base_layer`` levels (``mlp.experts.base_layer.base_layer.gate_up_proj``). An adapter
folder stores ``base_model.model.M.lora_A.weight`` (no adapter name),
``M.lora_embedding_A``, ``M.lora_magnitude_vector`` and ``adapter_config.json``.
``modules_to_save`` keep ``M.modules_to_save.<adapter>.*`` (trained) beside
``M.original_module.*``.
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

PREFIX = "base_model.model."
LORA_RE = re.compile(r"^(?P<module>.+)\.(?P<kind>lora_A|lora_B)\.(?P<adapter>[^.]+)\.weight$")
EMB_RE = re.compile(r"^(?P<module>.+)\.(?P<kind>lora_embedding_A|lora_embedding_B)"
                    r"\.(?P<adapter>[^.]+)$")
MAG_RE = re.compile(r"^(?P<module>.+)\.lora_magnitude_vector\.(?P<adapter>[^.]+)\.weight$")
LORA_BIAS_RE = re.compile(r"^(?P<module>.+)\.lora_B\.(?P<adapter>[^.]+)\.bias$")
BASE_RE = re.compile(r"^(?P<module>.+)\.base_layer\.(?P<param>[^.]+)$")
SAVE_RE = re.compile(r"^(?P<module>.+)\.modules_to_save\.(?P<adapter>[^.]+)\.(?P<param>.+)$")
ORIG_RE = re.compile(r"^(?P<module>.+)\.original_module\.(?P<param>.+)$")
#: tensor name parts that belong to an adapter, never to the merged model
ADAPTER_PARTS = ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B",
                 "lora_magnitude_vector")
MODES = ("fold", "adapter", "both", "base")
#: input/output embedding names whose base weights peft also saves in an adapter file when
#: they carry LoRA (``peft.utils.constants.EMBEDDING_LAYER_NAMES``, used by
#: ``get_peft_model_state_dict(save_embedding_layers="auto")``)
EMBEDDING_LAYER_NAMES = ("embed_tokens", "lm_head")


def _pattern_key(patterns, module: str) -> str:
    r"""The ``rank_pattern``/``alpha_pattern`` key that applies to ``module`` (a path without
    ``base_model.model.``), or ``module`` itself when none does: the first key ``k`` for which
    ``re.match(rf"(.*\.)?({k})$", module)`` matches, as peft's
    ``peft.utils.other.get_pattern_key`` decides (a test checks this against peft's own
    helper; not imported here so that ``inspect`` stays free of torch)."""
    for key in patterns:
        if re.match(rf"(.*\.)?({key})$", module):
            return key
    return module


@dataclass
class AdapterInfo:
    """One adapter. ``r``: its default rank (``adapter_config.json``'s ``r``, else the run's
    metadata, else the most common ``lora_A`` rank); ``ranks``: each module's rank from its
    ``lora_A`` shape; ``lora_alpha``/``alpha_pattern``/``use_rslora`` give each module's scale
    (:meth:`scale_for`). ``modules`` are module paths without ``base_model.model.``;
    ``embeddings``: the modules with embedding LoRA; ``dora``: the modules with a DoRA
    magnitude vector; ``params``: modules wrapping parameters (``target_parameters``).
    ``alpha_source`` names where alpha came from (a file, ``--lora-alpha``) or is None.
    ``alpha_doubt``: why the recorded alpha may not hold for every module (then alpha is needed
    from the user or the adapter's own config)."""

    name: str
    r: int
    modules: list[str]
    modules_to_save: list[str] = field(default_factory=list)
    lora_alpha: float | None = None
    use_rslora: bool = False
    alpha_source: str | None = None
    task_type: str = "CAUSAL_LM"
    ranks: dict[str, int] = field(default_factory=dict)
    rank_pattern: dict[str, int] = field(default_factory=dict)
    alpha_pattern: dict[str, float] = field(default_factory=dict)
    embeddings: list[str] = field(default_factory=list)
    dora: list[str] = field(default_factory=list)
    params: list[str] = field(default_factory=list)
    alpha_doubt: str | None = None
    #: the adapter's own adapter_config.json (a dict) when one was found
    config: dict | None = None

    @property
    def target_modules(self) -> list[str]:
        return sorted({m.rsplit(".", 1)[-1] for m in self.modules})

    def alpha_for(self, module: str) -> float:
        """``alpha_pattern``'s entry for ``module`` (peft's key matching), else ``lora_alpha``.
        Raises ValueError when alpha is unknown."""
        if self.lora_alpha is None:
            raise ValueError("lora_alpha is unknown")
        if self.alpha_pattern:
            key = _pattern_key(self.alpha_pattern, module)
            if key in self.alpha_pattern:
                return self.alpha_pattern[key]
        return self.lora_alpha

    def pattern_alphas(self) -> dict[str, tuple[float, int]]:
        """The ``alpha_pattern`` entries that decide some module's alpha (peft's matching:
        each module takes the first key that matches it): key -> (alpha, modules), in the
        config's order; the other modules take ``lora_alpha``."""
        used: Counter = Counter()
        if self.alpha_pattern:
            for m in self.modules:
                key = _pattern_key(self.alpha_pattern, m)
                if key in self.alpha_pattern:
                    used[key] += 1
        return {k: (v, used[k]) for k, v in self.alpha_pattern.items() if used[k]}

    def scale_for(self, module: str) -> float:
        """peft's ``scaling`` of ``module``: ``alpha / r`` or, with rsLoRA, ``alpha / sqrt(r)``,
        with the module's own rank and alpha. Raises ValueError without alpha."""
        r = self.ranks.get(module, self.r)
        alpha = self.alpha_for(module)
        return alpha / math.sqrt(r) if self.use_rslora else alpha / r

    @property
    def scale(self) -> float:
        """The default scale (``lora_alpha`` over ``r``). Raises ValueError without alpha."""
        if self.lora_alpha is None:
            raise ValueError("lora_alpha is unknown")
        return self.lora_alpha / (math.sqrt(self.r) if self.use_rslora else self.r)

    def groups(self) -> list[tuple[str, int, float | None, int]]:
        """(short module name, rank, scale or None, module count) per group of modules that
        share a short name, rank and scale, in name order."""
        out: Counter = Counter()
        for m in self.modules:
            try:  # no scale shown where alpha is in doubt (never an invented one)
                s = None if self.alpha_doubt else self.scale_for(m)
            except ValueError:
                s = None
            short = re.sub(r"(\.base_layer)+$", "", m).rsplit(".", 1)[-1]  # nested wrappers
            out[(short, self.ranks.get(m, self.r), s)] += 1
        return [(k[0], k[1], k[2], n) for k, n in sorted(out.items(), key=lambda kv: kv[0][:2])]


@dataclass
class LoraInfo:
    """The adapters found in a checkpoint, the LoRA variants it uses that are not supported
    (named for the user), ``problems`` (``(code, message, severity)``, e.g. a disagreement
    between the adapter's config and the run's metadata) and ``lora_only`` (the checkpoint
    holds adapter tensors only: the base weights are elsewhere)."""

    adapters: dict[str, AdapterInfo]
    unsupported: list[str] = field(default_factory=list)
    problems: list[tuple[str, str, str]] = field(default_factory=list)
    lora_only: bool = False

    def to_dict(self) -> dict:
        return {"adapters": {n: {**{k: v for k, v in asdict(a).items() if k != "config"},
                                 "target_modules": a.target_modules,
                                 "modules": len(a.modules),
                                 "groups": [{"module": g, "r": r, "scale": s, "count": c}
                                            for g, r, s, c in a.groups()]}
                             for n, a in self.adapters.items()},
                "unsupported": self.unsupported, "lora_only": self.lora_only}

    def summary(self) -> str:
        parts = []
        for a in self.adapters.values():
            alpha = "alpha unknown" if a.lora_alpha is None else f"alpha={a.lora_alpha:g}"
            if a.alpha_doubt:  # one alpha recorded, but other ranks: per-module alpha unknown
                alpha = (f"alpha={a.lora_alpha:g} in {a.alpha_source}, each module's alpha "
                         "unknown")
            rs = ", rsLoRA" if a.use_rslora else ""
            dora = ", DoRA" if a.dora else ""
            groups = ", ".join(f"{g} r={r}" + ("" if s is None else f" scale={s:g}")
                               for g, r, s, _ in a.groups())
            parts.append(f"{a.name}: r={a.r}, {alpha}{rs}{dora} on {groups} "
                         f"({len(a.modules)} modules)")
        if self.lora_only:
            parts.append("adapter tensors only (the base weights are not in the checkpoint)")
        if self.unsupported:
            parts.append("unsupported: " + ", ".join(self.unsupported))
        return "; ".join(parts)


def _strip(name: str) -> str:
    return name[len(PREFIX):] if name.startswith(PREFIX) else name


def _read_json(p: Path) -> dict | None:
    try:
        d = json.loads(p.read_text())
    except (OSError, ValueError):
        return None
    return d if isinstance(d, dict) else None


def _alpha(d: dict) -> float | None:
    try:
        alpha = float(d["lora_alpha"])
    except (KeyError, TypeError, ValueError):
        return None
    return alpha if alpha > 0 else None  # a peer once wrote lora_alpha: 0; never trust that


def find_adapter_config(folder: Path, explicit: str | None = None) -> tuple[dict, str] | None:
    """(the adapter's own ``adapter_config.json``, where it was found): ``explicit`` (a file or
    a folder holding it) when given, else ``lora_adapter/adapter_config.json`` beside the
    checkpoint (where verl saves the adapter) or one folder up. None when there is none."""
    cands = []
    if explicit:
        e = Path(explicit)
        cands.append(e / "adapter_config.json" if e.is_dir() else e)
    else:
        cands += [folder / "lora_adapter" / "adapter_config.json",
                  folder / ".." / "lora_adapter" / "adapter_config.json"]
    for p in cands:
        d = _read_json(p)
        if d is not None and d.get("peft_type", "LORA") == "LORA":
            rel = str(p) if explicit else str(p.relative_to(folder))
            return d, rel
    return None


def _train_meta(folder: Path) -> tuple[dict, str] | None:
    """verl's ``lora_train_meta.json`` (``r``, ``lora_alpha``, ``task_type``)."""
    for rel in ("lora_train_meta.json", "../lora_train_meta.json"):
        d = _read_json(folder / rel)
        if d is not None:
            return d, rel
    return None


def _kind_parts(n: str) -> bool:
    return any(f".{k}." in n or n.endswith(f".{k}") for k in ADAPTER_PARTS)


def detect_lora(names_shapes: dict[str, tuple[int, ...]], folder: str,
                adapter_config: str | None = None) -> LoraInfo | None:
    """Find LoRA adapters among tensor names (with their global shapes). ``folder`` is the
    checkpoint folder, searched for the adapter's ``adapter_config.json`` (which wins) and
    verl's ``lora_train_meta.json``; ``adapter_config`` names that config explicitly. None
    when there is no adapter."""
    mods: dict[str, dict[str, dict[str, tuple]]] = {}
    emb: dict[str, set[str]] = {}
    mags: dict[str, set[str]] = {}
    saves: dict[str, set[str]] = {}
    unsupported: set[str] = set()
    names = {_strip(n) for n in names_shapes}
    other = False  # any tensor that is not an adapter tensor
    for name, shape in names_shapes.items():
        n = _strip(name)
        if m := LORA_RE.match(n) or EMB_RE.match(n):
            mods.setdefault(m["adapter"], {}).setdefault(m["module"], {})[m["kind"]] = shape
            if m["kind"].startswith("lora_embedding"):
                emb.setdefault(m["adapter"], set()).add(m["module"])
        elif m := MAG_RE.match(n):
            mags.setdefault(m["adapter"], set()).add(m["module"])
        elif m := LORA_BIAS_RE.match(n):
            unsupported.add(f"LoRA bias (lora_bias=True, {m['module']}.lora_B.bias)")
        elif m := SAVE_RE.match(n):  # the trained copy: adapter state, not base weights
            saves.setdefault(m["adapter"], set()).add(m["module"])
        elif ".token_adapter." in f".{n}":
            unsupported.add("trainable tokens (peft trainable_token_indices)")
        else:
            other = True
    if not mods:
        return None
    folder_p = Path(folder)
    cfg = find_adapter_config(folder_p, adapter_config)
    meta = _train_meta(folder_p)
    problems: list[tuple[str, str, str]] = []
    lora_only = not other
    adapters = {}
    for aname, modules in sorted(mods.items()):
        # the run's metadata describes its one adapter (peft's name for it: "default")
        own = len(mods) == 1 or aname == "default"
        c = cfg[0] if (cfg and own) else None
        mt = meta[0] if (meta and own) else None
        ranks = {}
        for mod, s in modules.items():
            a = s.get("lora_A") or s.get("lora_embedding_A")
            if a:
                ranks[mod] = a[0]
        common = Counter(ranks.values()).most_common(1)
        info = AdapterInfo(aname, common[0][0] if common else 0, sorted(modules),
                           sorted(saves.get(aname, ())), ranks=ranks,
                           embeddings=sorted(emb.get(aname, ())),
                           dora=sorted(set(mags.get(aname, ())) & set(modules)))
        if c is not None:
            info.config = c
            info.r = int(c.get("r") or info.r)
            info.lora_alpha = _alpha(c)
            info.use_rslora = bool(c.get("use_rslora", False))
            info.rank_pattern = dict(c.get("rank_pattern") or {})
            info.alpha_pattern = dict(c.get("alpha_pattern") or {})
            info.task_type = c.get("task_type") or "CAUSAL_LM"
            info.alpha_source = cfg[1] if info.lora_alpha is not None else None
            if c.get("fan_in_fan_out"):
                unsupported.add("fan_in_fan_out (weights stored transposed, e.g. GPT-2 Conv1D)")
            for mod, r in sorted(ranks.items()):
                key = _pattern_key(info.rank_pattern, mod) if info.rank_pattern else mod
                want = info.rank_pattern.get(key, info.r)
                if want != r:
                    problems.append(("lora-rank-mismatch", f"{cfg[1]} gives {mod} r={want}, "
                                     f"its lora_A has rank {r} (the shape is used)", "warning"))
            if mt is not None:
                for k in ("r", "lora_alpha", "use_rslora"):
                    if k in mt and k in c and mt[k] != c[k] and \
                            not (k == "use_rslora" and not mt[k] and not c[k]):
                        problems.append(("lora-meta-mismatch", f"{meta[1]} says {k}={mt[k]}, "
                                         f"{cfg[1]} says {c[k]} (the adapter's own config is "
                                         "used)", "warning"))
        elif mt is not None:
            info.r = int(mt.get("r") or info.r)
            info.lora_alpha = _alpha(mt)
            info.use_rslora = bool(mt.get("use_rslora", False))
            info.task_type = mt.get("task_type") or "CAUSAL_LM"
            info.alpha_source = meta[1] if info.lora_alpha is not None else None
            odd = sorted(m for m, r in ranks.items() if r != info.r)
            if odd and info.lora_alpha is not None:
                info.alpha_doubt = (
                    f"module ranks differ from r={info.r} of {meta[1]} (e.g. {odd[0]} has "
                    f"r={ranks[odd[0]]}: rank_pattern), which records no alpha_pattern")
                problems.append(("lora-alpha-unknown", f"adapter {aname!r}: "
                                 f"{info.alpha_doubt}, so each module's alpha and scale are "
                                 "unknown; folding or exporting it needs the adapter's "
                                 "adapter_config.json (--lora-config FILE), or --lora-alpha A "
                                 "when one alpha holds for every module", "warning"))
        # LoRA on parameters: a wrapper whose base is not a module weight (ParamWrapper)
        targets = (c or {}).get("target_parameters") or []
        for mod in modules:
            if mod in info.embeddings:
                continue
            nested = mod.endswith(".base_layer") or f"{mod}.base_layer.base_layer" in {
                n.rsplit(".", 1)[0] for n in names}
            plain = f"{mod}.base_layer.weight" in names
            bases = [n for n in names if n.startswith(f"{mod}.base_layer.")]
            if nested or (targets and any(mod.endswith(t.rsplit(".", 1)[0]) for t in targets)) \
                    or (bases and not plain):
                info.params.append(mod)
        for mod in info.params:  # a ParamWrapper's lora_A holds r rows per expert
            experts = {shp[0] for n, shp in ((_strip(k), v) for k, v in names_shapes.items())
                       if n.startswith(f"{mod}.base_layer.") and len(shp) == 3
                       and not _kind_parts(n)}
            if len(experts) == 1 and ranks.get(mod, 0) % next(iter(experts)) == 0:
                ranks[mod] //= next(iter(experts))
        if info.params:
            shown = set()
            for mod in info.params:
                outer = re.sub(r"(\.base_layer)+$", "", mod)
                for n in names:
                    if n.startswith(f"{mod}.base_layer.") and not _kind_parts(n):
                        leaf = re.sub(r"\.base_layer(?=\.)", "", n)
                        shown.add(re.sub(r"^.*?\.layers\.\d+\.", "", leaf))
                if not any(n.startswith(f"{mod}.base_layer.") for n in names):
                    shown.add(re.sub(r"^.*?\.layers\.\d+\.", "", outer))
            what = ", ".join(targets) if targets else ", ".join(sorted(shown))
            unsupported.add(f"LoRA on parameters (peft target_parameters: {what})")
        if set(info.dora) & set(info.embeddings):
            unsupported.add("DoRA on embeddings")
        adapters[aname] = info
    if lora_only:
        problems.append(("lora-adapter-only", "the checkpoint holds LoRA adapter tensors only "
                         "(no base weights, as verl's save_lora_only writes): merging needs "
                         "--base-model DIR", "warning"))
    return LoraInfo(adapters, sorted(unsupported), problems, lora_only)


def output_name(name: str, mode: str, adapter: str) -> str | None:
    """The Hugging Face name of checkpoint tensor ``name`` in the merged model for ``mode``,
    or None when the tensor does not belong there (adapter weights, the other copy of a
    ``modules_to_save`` module). Every ``base_layer`` level is removed (peft nests one per
    wrapper, e.g. ``experts.base_layer.base_layer.gate_up_proj``)."""
    n = _strip(name)
    if _kind_parts(n) or LORA_BIAS_RE.match(n) or ".trainable_tokens_" in n:
        return None
    n = n.replace(".token_adapter.base_layer.", ".base_layer.")  # trainable tokens' wrapper
    n = re.sub(r"\.base_layer(?=\.)", "", n)
    folded = mode in ("fold", "both")
    if m := SAVE_RE.match(n):
        return f"{m['module']}.{m['param']}" if folded and m["adapter"] == adapter else None
    if m := ORIG_RE.match(n):
        return None if folded else f"{m['module']}.{m['param']}"
    return n


def saved_module_key(name: str, adapter: str) -> str | None:
    """For the trained copy of a ``modules_to_save`` module of ``adapter``
    (``M.modules_to_save.<adapter>.P``), its name in a PEFT adapter file
    (``base_model.model.M.P``, as peft saves it); else None."""
    m = SAVE_RE.match(_strip(name))
    if m is None or m["adapter"] != adapter:
        return None
    return f"{PREFIX}{m['module']}.{m['param']}"


def adapter_key(module: str, kind: str) -> str:
    """Name of an adapter tensor in a PEFT adapter file (``get_peft_model_state_dict``):
    ``lora_A``/``lora_B`` end in ``.weight``; ``lora_embedding_A/B`` and
    ``lora_magnitude_vector`` do not."""
    if kind in ("lora_A", "lora_B"):
        return f"{PREFIX}{module}.{kind}.weight"
    return f"{PREFIX}{module}.{kind}"


def adapter_config_json(a: AdapterInfo, all_modules: set[str]) -> bytes:
    """``adapter_config.json`` for adapter ``a``, written by peft's own ``LoraConfig``.
    ``target_modules`` are the short names when the adapter covers every module of those
    names in ``all_modules``, else the exact module paths. Each module whose rank (from its
    ``lora_A``) or alpha differs from ``r``/``lora_alpha`` gets an exact
    ``rank_pattern``/``alpha_pattern`` entry, so peft rebuilds every module as trained."""
    import tempfile

    from peft import LoraConfig

    short = a.target_modules
    covered = {m for m in all_modules if m.rsplit(".", 1)[-1] in short}
    targets = short if covered <= set(a.modules) else sorted(a.modules)
    rank_pattern, alpha_pattern = dict(a.rank_pattern), dict(a.alpha_pattern)

    def exact(m: str) -> str:  # a pattern that get_pattern_key matches to this module alone
        return "^" + re.escape(m)

    extra = {}
    for m in a.modules:
        r = a.ranks.get(m, a.r)
        want_r = rank_pattern.get(_pattern_key(rank_pattern, m), a.r) if rank_pattern else a.r
        if r != want_r:
            extra[exact(m)] = r
    rank_pattern = {**extra, **rank_pattern}  # peft takes the first key that matches
    cfg = LoraConfig(r=a.r, lora_alpha=a.lora_alpha, target_modules=targets,
                     use_rslora=a.use_rslora, use_dora=bool(a.dora), task_type=a.task_type,
                     rank_pattern=rank_pattern, alpha_pattern=alpha_pattern,
                     modules_to_save=a.modules_to_save or None)
    with tempfile.TemporaryDirectory() as d:
        cfg.save_pretrained(d)
        return (Path(d) / "adapter_config.json").read_bytes()
