"""The judge: a merge's output tensors checked against the model they claim to be.

The expected tensors come from transformers itself: the model class is built from the config
on the meta device (no weights, no download), and its state dict is put in the form
``save_pretrained`` writes, with transformers' own functions in the order
``PreTrainedModel.save_pretrained`` applies them (transformers/modeling_utils.py, 5.x):

1. ``model.state_dict()`` — parameters and persistent buffers (non-persistent buffers are
   not in it, so they are not expected);
2. the keys of ``_keys_to_ignore_on_save`` removed;
3. ``remove_tied_weights_from_state_dict(state_dict, model)`` drops the aliases of tied
   parameters (on the meta device it recognises them by parameter identity), keeping the name
   ``_tied_weights_keys`` says a reload expects (``lm_head.weight`` goes, T5's
   ``encoder.embed_tokens``/``decoder.embed_tokens``/``lm_head`` go, ``shared`` stays);
4. ``revert_weight_conversion(model, state_dict)`` (transformers/core_model_loading.py) turns
   the in-memory names and layouts back into the on-disk ones (e.g. a vision-language model's
   ``model.language_model.*``, or fused experts ``mlp.experts.gate_up_proj`` written per
   expert).

The class is the config's ``architectures[0]`` when transformers ships it, else the auto class
for ``model_type`` (causal LM, image-text-to-text, seq2seq, token and sequence classification,
in that order). A class from ``auto_map`` (remote code) is loaded only with
``trust_remote_code``; otherwise the check is skipped and says why. When the weights do not fit
the named class but fit exactly another head of the same ``model_type`` (verl's critic keeps
the actor's ``*ForCausalLM`` in config.json but holds a ``score`` head), that class is the
verdict, with a note.

Public: :func:`check` (names/shapes/dtypes against a config), :func:`check_layout` (a
checkpoint as ``inspect --check`` sees it), :class:`Verdict`, :func:`meta_model` (the model
class chosen by these rules for a checkpoint's in-memory names, built once on the meta device
and shared with :mod:`core.hf_names`, which traces save_pretrained's renames on it). torch and
transformers are imported inside functions only.

The classes tried and each class's :class:`Expected` are also kept on disk
(:mod:`core.archcache`, keyed by the config's JSON, the installed transformers and torch
versions and this code), so a later process judges the same config without importing
transformers.
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass, field
from typing import Any, Mapping

from . import archcache
from .dtypes import FLOATING
from .gcpause import paused_gc

#: transformers' auto-class tables tried for a ``model_type``, in order (names in
#: transformers/models/auto/modeling_auto.py; a table missing from a release is skipped)
HEAD_TABLES = (
    "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES",
    "MODEL_FOR_VISION_2_SEQ_MAPPING_NAMES",
    "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
    "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES",
    "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES",
)
#: how many names a one-line message lists before "..."
SHOW = 3


def dtype_kind(dtype: str) -> str:
    """``float``, ``int``, ``bool`` or ``complex`` for a safetensors dtype name (``F32``,
    ``I64``, ``BOOL``, ``C64`` ...)."""
    if dtype in FLOATING:
        return "float"
    if dtype == "BOOL":
        return "bool"
    if dtype.startswith("C"):
        return "complex"
    return "int"


@dataclass(frozen=True)
class Expected:
    """The tensors ``save_pretrained`` writes for one model class and config.

    ``tensors``: saved name -> (shape, dtype kind). ``aliases``: name of a tied copy that
    ``save_pretrained`` drops -> the name it keeps (both in-memory and saved spellings)."""

    architecture: str
    tensors: dict[str, tuple[tuple[int, ...], str]]
    aliases: dict[str, str]


@dataclass
class Verdict:
    """The judge's report on one set of tensors.

    ``architecture``: the class checked against (None when skipped). ``expected``: tensors it
    saves; ``matched``: those present with the right shape and dtype kind. ``missing``/
    ``extra``: names; ``shape``: (name, shape found, shape expected); ``dtype``: (name, dtype
    found, kind expected). ``skipped``: why no check was made (then nothing else is set).
    ``note``: e.g. that config.json names another class (then ``named``). ``aliases``: tied
    copies present in
    the tensors that ``save_pretrained`` would drop (alias -> kept name)."""

    architecture: str | None = None
    expected: int = 0
    matched: int = 0
    missing: list[str] = field(default_factory=list)
    extra: list[str] = field(default_factory=list)
    shape: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = field(default_factory=list)
    dtype: list[tuple[str, str, str]] = field(default_factory=list)
    skipped: str | None = None
    note: str | None = None
    aliases: dict[str, str] = field(default_factory=dict)
    #: the class config.json names, when the weights are those of another (``architecture``)
    named: str | None = None

    @property
    def ok(self) -> bool:
        """True when checked and everything matched."""
        return self.skipped is None and not (self.missing or self.extra or self.shape
                                             or self.dtype)

    @property
    def mismatched(self) -> bool:
        """True when checked and something is off (a merge refuses unless not strict)."""
        return self.skipped is None and not self.ok

    def problems(self) -> list[str]:
        """One short phrase per kind of mismatch, with counts and the first names."""
        out = []
        for label, items in (("missing", self.missing), ("extra", self.extra)):
            if items:
                out.append(f"{len(items)} {label} ({_names(items)})")
        if self.shape:
            out.append(f"{len(self.shape)} of another shape (" + ", ".join(
                f"{n} {list(a)} not {list(b)}" for n, a, b in self.shape[:SHOW])
                + (", ..." if len(self.shape) > SHOW else "") + ")")
        if self.dtype:
            out.append(f"{len(self.dtype)} of another dtype kind (" + ", ".join(
                f"{n} {a} not {k}" for n, a, k in self.dtype[:SHOW])
                + (", ..." if len(self.dtype) > SHOW else "") + ")")
        return out

    def summary(self) -> str:
        """One line: ``matches Qwen2ForCausalLM: 291/291 tensors``, what is off, or why the
        check was skipped."""
        if self.skipped is not None:
            return f"architecture check skipped: {self.skipped}"
        note = f" ({self.note})" if self.note else ""
        if self.ok:
            return f"matches {self.architecture}: {self.matched}/{self.expected} tensors{note}"
        return (f"does not match {self.architecture}: {self.matched}/{self.expected} tensors "
                f"match; " + "; ".join(self.problems()) + note)

    def to_dict(self) -> dict[str, Any]:
        """The ``check`` object of ``inspect --json --check``."""
        return {"ok": self.ok, "summary": self.summary(), "architecture": self.architecture,
                "expected": self.expected, "matched": self.matched,
                "missing": list(self.missing), "extra": list(self.extra),
                "shape": [{"name": n, "found": list(a), "expected": list(b)}
                          for n, a, b in self.shape],
                "dtype": [{"name": n, "found": a, "expected": k} for n, a, k in self.dtype],
                "skipped": self.skipped, "note": self.note, "config_names": self.named}


def _names(items: list[str]) -> str:
    return ", ".join(items[:SHOW]) + (", ..." if len(items) > SHOW else "")


class Skip(Exception):
    """The check cannot be made; the message says why."""


# -- building the expected tensors -------------------------------------------------------------

_cache: dict[tuple, Any] = {}  # (config key, class name or "") -> Expected/candidates or Skip
_models: dict[tuple, Any] = {}  # (config key, class name) -> meta model or Skip
_lock = threading.Lock()
#: held while a class is imported and built: transformers' lazy module (``getattr(transformers,
#: "Qwen2ForCausalLM")``) raised AttributeError in one thread while another thread was importing
#: the same model module (the app's background check and a compare view's diff); one build at a
#: time, and the second caller then finds the first one's result in the cache
_build_lock = threading.RLock()


def _config_key(config_dir: str | None, config_fields: dict | None, trust: bool) -> tuple:
    if config_dir is not None:
        p = os.path.join(config_dir, "config.json")
        st = os.stat(p)
        return ("dir", os.path.realpath(config_dir), st.st_mtime_ns, st.st_size, trust)
    return ("fields", json.dumps(config_fields, sort_keys=True, default=str), trust)


def _read_json(config_dir: str) -> dict:
    try:
        with open(os.path.join(config_dir, "config.json"), encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:
        raise Skip(f"config.json cannot be read ({e})") from None
    if not isinstance(cfg, dict):
        raise Skip("config.json is not a JSON object")
    return cfg


def _load_config(config_dir: str | None, config_fields: dict | None, trust: bool):
    """(transformers config, raw dict). Raises Skip."""
    from .phases import phase

    phase("importing torch and transformers for the architecture check")
    from transformers import AutoConfig

    if config_dir is None:
        kw = dict(config_fields or {})
        try:
            return AutoConfig.for_model(kw.pop("model_type"), **kw), dict(config_fields)
        except Exception as e:  # noqa: BLE001 - unknown model_type, bad field: say why
            raise Skip("transformers cannot build a config from the checkpoint's fields "
                       f"({type(e).__name__}: {e})") from None
    raw = _read_json(config_dir)
    remote = _remote_class_name(raw)
    if remote and not trust:
        raise Skip(f"config.json names {remote}, a class transformers does not ship (remote "
                   "code in auto_map); pass --trust-remote-code to check against it")
    model_type = raw.get("model_type")
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    if model_type not in CONFIG_MAPPING_NAMES and not (trust and raw.get("auto_map")):
        import transformers

        raise Skip(f"transformers {transformers.__version__} does not know model_type "
                   f"{model_type!r} of config.json" if model_type else
                   "config.json has no model_type")
    try:  # trust is a bool: None would make transformers prompt "[y/N]" on the terminal
        return AutoConfig.from_pretrained(config_dir, trust_remote_code=bool(trust)), raw
    except Exception as e:  # noqa: BLE001 - unknown model_type, bad field: say why, skip
        text = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise Skip(f"transformers cannot read config.json ({text})") from None


def _remote_class_name(raw: dict) -> str | None:
    """The architecture's class name when it comes from ``auto_map`` code, else None."""
    if not raw.get("auto_map"):
        return None
    arch = (raw.get("architectures") or [None])[0]
    if arch and _shipped(arch):
        return None
    if not arch:
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

        if raw.get("model_type") in CONFIG_MAPPING_NAMES:
            return None
        return f"a model of type {raw.get('model_type')!r}"
    return arch


def _shipped(name: str) -> bool:
    import transformers

    try:
        return isinstance(getattr(transformers, name), type)
    except (AttributeError, ImportError, RuntimeError):
        return False


def _head_classes(model_type: str | None) -> list[str]:
    """Class names of the auto head tables for ``model_type``, in :data:`HEAD_TABLES` order."""
    from transformers.models.auto import modeling_auto

    out: list[str] = []
    for table in HEAD_TABLES:
        names = getattr(modeling_auto, table, {}).get(model_type)
        for n in (names if isinstance(names, (list, tuple)) else [names]):
            if n and n not in out and _shipped(n):
                out.append(n)
    return out


def _remote_class(config_dir: str, raw: dict):
    from transformers.dynamic_module_utils import get_class_from_dynamic_module

    auto_map = raw.get("auto_map") or {}
    arch = (raw.get("architectures") or [None])[0]
    ref = None
    for key, value in auto_map.items():
        v = value[0] if isinstance(value, (list, tuple)) else value
        if isinstance(v, str) and arch and v.rsplit(".", 1)[-1] == arch:
            ref = v
    ref = ref or auto_map.get("AutoModelForCausalLM") or auto_map.get("AutoModel")
    if not isinstance(ref, str):
        raise Skip("config.json's auto_map names no model class")
    try:
        return get_class_from_dynamic_module(ref, config_dir)
    except Exception as e:  # noqa: BLE001 - the remote code itself failed
        raise Skip(f"the remote code {ref} cannot be loaded ({type(e).__name__}: {e})") from None


def build_model(cls, config):
    """A ``cls`` model built from ``config`` on the meta device (no memory for weights, no
    download), transformers' warnings silenced. Raises Skip when transformers cannot build it.
    """
    archcache.require_warm(f"building {getattr(cls, '__name__', cls)}")
    import torch
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        with torch.device("meta"):
            return cls._from_config(config)
    except Exception as e:  # noqa: BLE001 - a class that cannot be built from this config
        raise _cannot_build(cls.__name__, e) from None
    finally:
        hf_logging.set_verbosity(level)


def _cannot_build(name: str, e: Exception) -> Skip:
    text = str(e).splitlines()[0] if str(e) else type(e).__name__
    return Skip(f"transformers cannot build {name} from the config ({text})")


def expected_tensors(cls, config, model=None) -> Expected:
    """The tensors ``save_pretrained`` of a ``cls`` model built from ``config`` writes (see
    the module docstring for the steps), built on the meta device: no memory for weights
    (``model``: that model already built, e.g. by :func:`meta_model`).
    Raises Skip when transformers cannot build the model."""
    import torch
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.modeling_utils import remove_tied_weights_from_state_dict
    from transformers.utils import logging as hf_logging

    if model is None:
        model = build_model(cls, config)
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        full = model.state_dict()
        for key in model._keys_to_ignore_on_save or ():
            full.pop(key, None)
        kept = remove_tied_weights_from_state_dict(dict(full), model)
        dropped = [n for n in full if n not in kept]
        saved = revert_weight_conversion(model, dict(kept))
        aliases: dict[str, str] = {}
        for name in dropped:
            obj = model.get_parameter_or_buffer(name)
            source = next((k for k in kept if model.get_parameter_or_buffer(k) is obj), None)
            if source is None:
                continue
            aliases[name] = source
            alias_saved, source_saved = (_saved_name(model, n, revert_weight_conversion)
                                         for n in (name, source))
            if alias_saved and source_saved:
                aliases.setdefault(alias_saved, source_saved)
    except Exception as e:  # noqa: BLE001 - transformers fails on this model's state dict
        raise _cannot_build(cls.__name__, e) from None
    finally:
        hf_logging.set_verbosity(level)
    tensors = {}
    for name, t in saved.items():
        t = t[0] if isinstance(t, list) else t
        kind = ("bool" if t.dtype == torch.bool else "complex" if t.is_complex()
                else "float" if t.is_floating_point() else "int")
        tensors[name] = (tuple(t.shape), kind)
    return Expected(cls.__name__, tensors, aliases)


def _saved_name(model, name: str, revert) -> str | None:
    """``name``'s on-disk spelling after transformers' renamings, or None."""
    import torch

    try:
        out = revert(model, {name: torch.empty(0, device="meta")})
    except Exception:  # noqa: BLE001 - a converter needs its sibling tensors: no plain rename
        return None
    return next(iter(out), None) if len(out) == 1 else None


def _expected_cached(key: tuple, cls_name: str, build) -> Expected:
    with _lock:
        hit = _cache.get((key, cls_name))
    if hit is None:
        with _build_lock:
            with _lock:
                hit = _cache.get((key, cls_name))
            if hit is None:
                hit = build()
                with _lock:
                    _cache[(key, cls_name)] = hit
    if isinstance(hit, Skip):
        raise hit
    return hit


def candidates(config_dir: str | None = None, config_fields: dict | None = None,
               trust_remote_code: bool = False):
    """(config, [(class name, get class)], named, note) for a config: the class config.json
    names first (``named``; None when it names none transformers or its code provides), then
    the other heads of its ``model_type``. Raises Skip."""
    from .phases import phase

    archcache.require_warm("the model classes of the config")
    phase("importing torch and transformers for the architecture check")
    import transformers

    config, raw = _load_config(config_dir, config_fields, trust_remote_code)
    arch = (raw.get("architectures") or [None])[0]
    model_type = getattr(config, "model_type", None) or raw.get("model_type")
    out: list[tuple[str, Any]] = []
    named = note = None
    if arch and _shipped(arch):
        named = arch
        out.append((arch, lambda: getattr(transformers, arch)))
    elif arch and config_dir is not None and raw.get("auto_map"):
        named = arch
        out.append((arch, lambda: _remote_class(config_dir, raw)))
    elif arch:
        note = f"config.json names {arch}, which transformers does not ship"
    for name in _head_classes(model_type):
        if name not in (n for n, _ in out):
            out.append((name, lambda a=name: getattr(transformers, a)))
    if not out:
        raise Skip(f"transformers has no model class for model_type {model_type!r}")
    return config, out, named, note


def compare(tensors: Mapping[str, tuple[tuple[int, ...], str]], exp: Expected) -> Verdict:
    """A :class:`Verdict` for ``tensors`` (name -> (shape, safetensors dtype)) against
    ``exp``. A tied copy whose kept tensor is present is not extra (save_pretrained drops
    it); it is listed in ``aliases``."""
    v = Verdict(exp.architecture, expected=len(exp.tensors))
    for name in sorted(tensors):
        shape, dtype = tensors[name]
        want = exp.tensors.get(name)
        if want is None:
            kept = exp.aliases.get(name)
            if kept is not None and kept in tensors:
                v.aliases[name] = kept
            else:
                v.extra.append(name)
            continue
        if tuple(shape) != want[0]:
            v.shape.append((name, tuple(shape), want[0]))
        elif dtype_kind(dtype) != want[1]:
            v.dtype.append((name, dtype, want[1]))
        else:
            v.matched += 1
    v.missing = sorted(n for n in exp.tensors if n not in tensors)
    from .plan import natural_key

    for lst in (v.missing, v.extra):
        lst.sort(key=natural_key)
    return v


def check(tensors: Mapping[str, tuple[tuple[int, ...], str]], config_dir: str | None = None,
          config_fields: dict | None = None, trust_remote_code: bool = False) -> Verdict:
    """Judge ``tensors`` (output name -> (shape, safetensors dtype)) against the model of the
    config in ``config_dir`` (or built from ``config_fields``, e.g. Megatron's derived
    ``{"model_type": ..., ...}``). Never raises for a config it cannot use: the verdict is
    then ``skipped`` with the reason. Model builds are cached per config and class."""
    if config_dir is None and not config_fields:
        return Verdict(skipped="no config.json (pass --hf-config DIR to check the weights "
                               "against the model)")
    try:
        key = _config_key(config_dir, config_fields, trust_remote_code)
        ckey = archcache.config_key(config_dir, config_fields, trust_remote_code)
        classes, named, note, model_type = _facts(key, ckey, config_dir, config_fields,
                                                  trust_remote_code)
    except Skip as e:
        return Verdict(skipped=str(e))
    except OSError as e:
        return Verdict(skipped=f"config.json cannot be read ({e.strerror or e})")
    first: Verdict | None = None
    for i, name in enumerate(classes):
        try:
            exp = _expected(key, ckey, name, config_dir, config_fields, trust_remote_code)
        except Skip as e:
            if i == 0:
                return Verdict(skipped=str(e))
            continue
        v = compare(tensors, exp)
        first = first or v
        if v.ok:
            if named and i > 0:
                v.named = named
                v.note = f"config.json names {named}; the weights are those of {name}"
            elif not named:
                v.note = ((note + "; ") if note else "config.json names no class; ") + \
                    f"chosen among the model classes for model_type {model_type!r}"
            return v
    first.note = note
    return first


def meta_model(names, config_dir: str | None = None, config_fields: dict | None = None,
               trust_remote_code: bool = False):
    """The model, built on the meta device, that holds the in-memory tensor ``names`` (a
    checkpoint's ``model.state_dict()`` names), chosen among the classes :func:`check` tries
    (:func:`candidates`: the class config.json names, its remote code with
    ``trust_remote_code``, then the heads of its ``model_type``): the first whose state dict
    holds every name (a verl critic's ``score`` head picks ``*ForTokenClassification`` over
    the ``*ForCausalLM`` config.json names), else the named class when it holds some (the
    class save_pretrained ran on), else the one holding most. None when the check would be
    skipped (no usable config, remote code not trusted) or no class can be built. The models
    are the ones :func:`check` judges with, built once per config and class."""
    if config_dir is None and not config_fields:
        return None
    try:
        key = _config_key(config_dir, config_fields, trust_remote_code)
        config, classes, named, _ = _expected_cached(key, "", lambda: _candidates_or_skip(
            config_dir, config_fields, trust_remote_code))
    except (Skip, OSError):
        return None
    names = set(names)
    best, best_hits, fallback = None, -1, None
    for name, get_cls in classes:
        try:
            model = _model_cached(key, name, get_cls, config)
        except Skip:
            continue
        hits = len(names & set(model.state_dict()))
        if hits == len(names):
            return model
        if name == named and hits:
            fallback = model
        if hits > best_hits:
            best, best_hits = model, hits
    return fallback if fallback is not None else best


def _candidates_or_skip(config_dir, config_fields, trust):
    try:
        return candidates(config_dir, config_fields, trust)
    except Skip as e:
        return e


def _build_or_skip(key, name, get_cls, config):
    """The Expected of class ``name`` (or the Skip saying why not), from the cached model."""
    from .phases import phase

    try:
        phase(f"architecture check: building {name} on the meta device")
        cls = get_cls()
        return expected_tensors(cls, config, _model_cached(key, name, lambda: cls, config))
    except Skip as e:
        return e


def _model_cached(key: tuple, name: str, get_cls, config):
    """The meta model of class ``name`` for the config of ``key``, built once (a build that
    failed is remembered as its Skip, raised again)."""
    with _lock:
        hit = _models.get((key, name))
    if hit is None:
        with _build_lock:
            with _lock:
                hit = _models.get((key, name))
            if hit is None:
                try:
                    hit = build_model(get_cls(), config)
                except Skip as e:
                    hit = e
                with _lock:
                    hit = _models.setdefault((key, name), hit)
    if isinstance(hit, Skip):
        raise hit
    return hit


# -- the persistent cache (core/archcache.py) -------------------------------------------------


def _facts(key: tuple, ckey: str | None, config_dir, config_fields, trust):
    """(class names tried in order, named, note, model_type) of :func:`candidates` for a
    config, from the persistent cache when ``ckey`` (:func:`core.archcache.config_key`) has
    them, else from transformers (then stored). Raises Skip (a Skip is cached too: it depends
    only on the config and the installed versions)."""
    def build():
        dkey = archcache.digest(ckey, "candidates") if ckey else None
        if dkey:
            hit = _decode_facts(archcache.load(dkey))
            if hit is not None:
                return hit
        try:
            with paused_gc():  # the imports of torch and transformers
                config, classes, named, note = _expected_cached(key, "", lambda: (
                    _candidates_or_skip(config_dir, config_fields, trust)))
            res: Any = ([n for n, _ in classes], named, note,
                        getattr(config, "model_type", None))
        except Skip as e:
            res = e
        if dkey:
            archcache.store(dkey, {"skip": str(res)} if isinstance(res, Skip) else
                            {"classes": res[0], "named": res[1], "note": res[2],
                             "model_type": res[3]})
        return res

    return _expected_cached(key, "#facts", build)


def _decode_facts(v):
    try:
        if "skip" in v:
            return Skip(str(v["skip"]))
        classes = [str(n) for n in v["classes"]]
        opt = [v[k] if v[k] is None else str(v[k]) for k in ("named", "note", "model_type")]
        return (classes, *opt) if classes else None
    except (TypeError, KeyError, ValueError):
        return None


def _expected(key: tuple, ckey: str | None, name: str, config_dir, config_fields,
              trust) -> Expected:
    """The :class:`Expected` of class ``name`` for a config, from the persistent cache when
    it has it, else built on the meta device (then stored). Raises Skip."""
    def build():
        dkey = archcache.digest(ckey, "expected", name) if ckey else None
        if dkey:
            hit = _decode_expected(archcache.load(dkey))
            if hit is not None:
                return hit
        with paused_gc():  # the imports, the model class's module, the meta-device build
            config, classes, _, _ = _expected_cached(key, "", lambda: _candidates_or_skip(
                config_dir, config_fields, trust))
            res = _build_or_skip(key, name, dict(classes)[name], config)
        if dkey:
            archcache.store(dkey, {"skip": str(res)} if isinstance(res, Skip) else
                            {"architecture": res.architecture,
                             "tensors": [[n, list(s), k] for n, (s, k) in res.tensors.items()],
                             "aliases": [[a, b] for a, b in res.aliases.items()]})
        return res

    return _expected_cached(key, name, build)


def _decode_expected(v):
    try:
        if "skip" in v:
            return Skip(str(v["skip"]))
        tensors = {str(n): (tuple(int(x) for x in s), str(k)) for n, s, k in v["tensors"]}
        aliases = {str(a): str(b) for a, b in v["aliases"]}
        return Expected(str(v["architecture"]), tensors, aliases)
    except (TypeError, KeyError, ValueError):
        return None


def check_layout(layout, hf_config: str | None = None,
                 trust_remote_code: bool = False) -> Verdict:
    """Judge a checkpoint as ``inspect --check`` sees it: its tensors under the names a merge
    writes (a LoRA checkpoint's base-model names; adapter tensors aside) against its config
    (``hf_config``, else the checkpoint's own config folder, else Megatron's derived fields).
    """
    from . import lora as lora_mod

    lora = layout.lora if hasattr(layout.lora, "adapters") else None
    adapter = sorted(lora.adapters)[0] if lora is not None and lora.adapters else ""
    tensors = {}
    for name, t in layout.tensors.items():
        out = name if lora is None else lora_mod.output_name(name, "base", adapter)
        if out is not None:
            tensors[out] = (t.shape, t.dtype)
    config_dir = hf_config or layout.config_dir
    fields = None if config_dir else layout.derived_config
    return check(tensors, config_dir, fields, trust_remote_code)


def tied_aliases(config_dir: str | None, trust_remote_code: bool = False) -> dict[str, str]:
    """Tied copies of the model class of the config in ``config_dir``: alias name ->
    the name ``save_pretrained`` keeps (e.g. ``lm_head.weight`` -> ``model.embed_tokens.weight``
    for a tied Llama; T5's ``encoder.embed_tokens.weight`` -> ``shared.weight``). Empty
    when there is no config or no class to build."""
    if config_dir is None or not os.path.isfile(os.path.join(config_dir, "config.json")):
        return {}
    try:
        key = _config_key(config_dir, None, trust_remote_code)
        ckey = archcache.config_key(config_dir, None, trust_remote_code)
        classes = _facts(key, ckey, config_dir, None, trust_remote_code)[0]
        return dict(_expected(key, ckey, classes[0], config_dir, None,
                              trust_remote_code).aliases)
    except (Skip, OSError):
        return {}


def default_tie_word_embeddings(config_dir: str, trust_remote_code: bool = False) -> bool | None:
    """``tie_word_embeddings`` of the config class transformers resolves for ``config_dir``
    (``AutoConfig.from_pretrained``: the class's default when config.json does not set it), or
    None when transformers cannot read the config. Kept in the persistent cache
    (:mod:`core.archcache`) like the other answers. ``trust_remote_code`` is passed as a bool,
    never None: None makes transformers ask "run the custom code? [y/N]" on the terminal
    (transformers/dynamic_module_utils.py ``resolve_trust_remote_code``), which hangs CI."""
    ckey = archcache.config_key(config_dir, None, trust_remote_code)
    dkey = archcache.digest(ckey, "tie_word_embeddings") if ckey else None
    hit = archcache.load(dkey) if dkey else None
    if isinstance(hit, dict) and hit.get("tie") in (True, False, None):
        return hit["tie"]
    archcache.require_warm("the config class's tie_word_embeddings")
    try:
        from transformers import AutoConfig

        with paused_gc():
            tie = bool(AutoConfig.from_pretrained(
                config_dir, trust_remote_code=bool(trust_remote_code)).tie_word_embeddings)
    except Exception:  # noqa: BLE001 - unknown model type: fall back to the key's absence
        tie = None
    if dkey:
        archcache.store(dkey, {"tie": tie})
    return tie


def config_json_for_fields(fields: dict) -> bytes:
    """``config.json`` bytes for config fields derived from a checkpoint (``model_type`` plus
    the family's field names), written by transformers' config class of that family
    (``AutoConfig.for_model``) so the file has every default ``from_pretrained`` expects. Kept
    in the persistent cache (:mod:`core.archcache`). Raises what transformers raises."""
    ckey = archcache.config_key(None, fields, False)
    dkey = archcache.digest(ckey, "config_json") if ckey else None
    hit = archcache.load(dkey) if dkey else None
    if isinstance(hit, dict) and isinstance(hit.get("json"), str):
        return hit["json"].encode()
    archcache.require_warm("config.json from the checkpoint's fields")
    from transformers import AutoConfig

    kw = dict(fields)
    with paused_gc():
        text = AutoConfig.for_model(kw.pop("model_type"), **kw).to_json_string(use_diff=False)
    if dkey:
        archcache.store(dkey, {"json": text})
    return text.encode()


def warm(config_dir: str | None, config_fields: dict | None,
         trust_remote_code: bool = False) -> None:
    """Compute (and keep in the persistent cache) what a merge's plan asks of the config's
    model without the tensors: the classes tried and the first class's expected tensors
    (:func:`tied_aliases`, and :func:`check` when the weights fit that class), the config
    class's ``tie_word_embeddings`` and, for derived fields, their config.json. Never raises
    for a config it cannot use (the plan then says why). core/archworker.py runs it."""
    try:
        key = _config_key(config_dir, config_fields, trust_remote_code)
        ckey = archcache.config_key(config_dir, config_fields, trust_remote_code)
        classes = _facts(key, ckey, config_dir, config_fields, trust_remote_code)[0]
        _expected(key, ckey, classes[0], config_dir, config_fields, trust_remote_code)
    except (Skip, OSError):
        pass
    if config_dir is not None:
        default_tie_word_embeddings(config_dir, trust_remote_code)
    elif config_fields:
        try:
            config_json_for_fields(config_fields)
        except Exception:  # noqa: BLE001 - the plan raises it again, with its own message
            pass


def facts_missing(config_dir: str, trust_remote_code: bool = False) -> bool:
    """True when the config in ``config_dir`` can be cached but the persistent cache does not
    hold its classes yet (what a merge asks first); nothing imported."""
    ckey = archcache.config_key(config_dir, None, trust_remote_code)
    return ckey is not None and archcache.load(archcache.digest(ckey, "candidates")) is None
