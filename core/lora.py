"""LoRA adapters inside sharded checkpoints: detection, the output names of each mode, and the
facts the PEFT adapter folder needs.

Key facts (peft's LoRA layer and ``get_peft_model_state_dict``; checked on FSDP2 checkpoints
of real peft models): the model's state dict is under ``base_model.model.``; a target module
``M`` keeps its base weights as ``M.base_layer.{weight,bias}`` and its adapter as
``M.lora_A.<adapter>.weight`` (r x in) and ``M.lora_B.<adapter>.weight`` (out x r); peft keeps
them in fp32 over a bf16 base. The delta is ``(B @ A) * scale`` with ``scale = alpha / r``
(rsLoRA: ``alpha / sqrt(r)``). An adapter folder stores ``base_model.model.M.lora_A.weight``
(no adapter name) and ``adapter_config.json``. ``modules_to_save`` keep
``M.modules_to_save.<adapter>.*`` (trained) beside ``M.original_module.*``. DoRA adds
``lora_magnitude_vector``; embedding LoRA uses ``lora_embedding_A/B``: not supported yet.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

PREFIX = "base_model.model."
LORA_RE = re.compile(r"^(?P<module>.+)\.(?P<kind>lora_A|lora_B)\.(?P<adapter>[^.]+)\.weight$")
BASE_RE = re.compile(r"^(?P<module>.+)\.base_layer\.(?P<param>[^.]+)$")
SAVE_RE = re.compile(r"^(?P<module>.+)\.modules_to_save\.(?P<adapter>[^.]+)\.(?P<param>.+)$")
ORIG_RE = re.compile(r"^(?P<module>.+)\.original_module\.(?P<param>.+)$")
UNSUPPORTED = {
    "lora_magnitude_vector": "DoRA (lora_magnitude_vector)",
    "lora_embedding_A": "LoRA on embeddings (lora_embedding_A/B)",
    "lora_embedding_B": "LoRA on embeddings (lora_embedding_A/B)",
}
MODES = ("fold", "adapter", "both", "base")


@dataclass
class AdapterInfo:
    """One adapter: its name, rank ``r`` (from the shapes), the module paths it targets
    (without ``base_model.model.``), ``lora_alpha`` and ``use_rslora`` with where they came
    from (``alpha_source``: a file name, ``--lora-alpha``, or None when unknown)."""

    name: str
    r: int
    modules: list[str]
    modules_to_save: list[str] = field(default_factory=list)
    lora_alpha: float | None = None
    use_rslora: bool = False
    alpha_source: str | None = None
    task_type: str = "CAUSAL_LM"

    @property
    def target_modules(self) -> list[str]:
        return sorted({m.rsplit(".", 1)[-1] for m in self.modules})

    @property
    def scale(self) -> float:
        """``alpha / r`` or, with rsLoRA, ``alpha / sqrt(r)``. Raises ValueError without alpha."""
        if self.lora_alpha is None:
            raise ValueError("lora_alpha is unknown")
        return self.lora_alpha / (math.sqrt(self.r) if self.use_rslora else self.r)


@dataclass
class LoraInfo:
    """The adapters found in a checkpoint and the LoRA variants it uses that are not
    supported (named for the user)."""

    adapters: dict[str, AdapterInfo]
    unsupported: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"adapters": {n: {**asdict(a), "target_modules": a.target_modules,
                                 "modules": len(a.modules)} for n, a in self.adapters.items()},
                "unsupported": self.unsupported}

    def summary(self) -> str:
        parts = []
        for a in self.adapters.values():
            alpha = "alpha unknown" if a.lora_alpha is None else f"alpha={a.lora_alpha:g}"
            rs = ", rsLoRA" if a.use_rslora else ""
            parts.append(f"{a.name}: r={a.r}, {alpha}{rs} on {', '.join(a.target_modules)} "
                         f"({len(a.modules)} modules)")
        if self.unsupported:
            parts.append("unsupported: " + ", ".join(self.unsupported))
        return "; ".join(parts)


def _strip(name: str) -> str:
    return name[len(PREFIX):] if name.startswith(PREFIX) else name


def _run_metadata(folder: Path) -> dict:
    """alpha/rsLoRA/task type from verl's ``lora_train_meta.json`` or a saved
    ``lora_adapter/adapter_config.json`` beside the checkpoint."""
    for rel in ("lora_train_meta.json", "lora_adapter/adapter_config.json",
                "../lora_train_meta.json"):
        p = folder / rel
        try:
            d = json.loads(p.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(d, dict) and d.get("lora_alpha") is not None:
            try:
                alpha = float(d["lora_alpha"])
            except (TypeError, ValueError):
                continue
            if alpha > 0:  # a peer once wrote lora_alpha: 0; never trust that
                return {"lora_alpha": alpha, "use_rslora": bool(d.get("use_rslora", False)),
                        "task_type": d.get("task_type") or "CAUSAL_LM", "source": rel}
    return {}


def detect_lora(names_shapes: dict[str, tuple[int, ...]], folder: str) -> LoraInfo | None:
    """Find LoRA adapters among tensor names (with their global shapes). ``folder`` is the
    checkpoint folder, searched for the run's LoRA metadata. None when there is no adapter."""
    mods: dict[str, dict[str, dict[str, tuple]]] = {}
    saves: dict[str, set[str]] = {}
    unsupported: set[str] = set()
    for name, shape in names_shapes.items():
        n = _strip(name)
        for key, label in UNSUPPORTED.items():
            if f".{key}." in n or n.endswith(f".{key}"):
                unsupported.add(label)
        if m := LORA_RE.match(n):
            mods.setdefault(m["adapter"], {}).setdefault(m["module"], {})[m["kind"]] = shape
        elif m := SAVE_RE.match(n):
            saves.setdefault(m["adapter"], set()).add(m["module"])
    if not mods and not unsupported:
        return None
    meta = _run_metadata(Path(folder))
    adapters = {}
    for name, modules in sorted(mods.items()):
        # the run's metadata describes its one adapter (peft's name for it: "default")
        own = meta if (len(mods) == 1 or name == "default") else {}
        ranks = {s["lora_A"][0] for s in modules.values() if "lora_A" in s}
        r = max(ranks) if ranks else 0
        adapters[name] = AdapterInfo(name, r, sorted(modules), sorted(saves.get(name, ())),
                                     own.get("lora_alpha"), own.get("use_rslora", False),
                                     own.get("source"), own.get("task_type", "CAUSAL_LM"))
    return LoraInfo(adapters, sorted(unsupported))


def output_name(name: str, mode: str, adapter: str) -> str | None:
    """The Hugging Face name of checkpoint tensor ``name`` in the merged model for ``mode``,
    or None when the tensor does not belong there (adapter weights, the other copy of a
    ``modules_to_save`` module)."""
    n = _strip(name)
    if LORA_RE.match(n) or any(f".{k}." in n or n.endswith(f".{k}") for k in UNSUPPORTED):
        return None
    if m := BASE_RE.match(n):
        return f"{m['module']}.{m['param']}"
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
    """Name of an adapter weight in a PEFT adapter file."""
    return f"{PREFIX}{module}.{kind}.weight"


def adapter_config_json(a: AdapterInfo, all_modules: set[str]) -> bytes:
    """``adapter_config.json`` for adapter ``a``, written by peft's own ``LoraConfig``.
    ``target_modules`` are the short names when the adapter covers every module of those
    names in ``all_modules``, else the exact module paths."""
    import tempfile

    from peft import LoraConfig

    short = a.target_modules
    covered = {m for m in all_modules if m.rsplit(".", 1)[-1] in short}
    targets = short if covered <= set(a.modules) else sorted(a.modules)
    cfg = LoraConfig(r=a.r, lora_alpha=a.lora_alpha, target_modules=targets,
                     use_rslora=a.use_rslora, task_type=a.task_type,
                     modules_to_save=a.modules_to_save or None)
    with tempfile.TemporaryDirectory() as d:
        cfg.save_pretrained(d)
        return (Path(d) / "adapter_config.json").read_bytes()
