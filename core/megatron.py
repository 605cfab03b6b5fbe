"""Megatron-LM layout reasoning, shared by the ``torch_dist`` and legacy readers: the model's
shape (:class:`Arch`), Megatron names normalised to one global form, and the cut of each
Megatron tensor into the Hugging Face tensors it holds.

This is the product's own code (no library maps Megatron pieces to Hugging Face byte ranges
without loading the tensors): each Hugging Face tensor is described as pieces that point into
the stored Megatron slices, so the merge streams them like any other checkpoint.

Format facts (FORMATS.md, checked on checkpoints written by megatron-core 0.16.1):

- ``linear_qkv`` rows are grouped per query group: ``[q x heads/groups, k, v]``, each
  ``head_dim`` rows; TP rank r holds groups/TP whole groups, so concatenating ranks along
  dim 0 gives the global order.
- gated ``linear_fc1`` (SwiGLU): each TP rank holds ``[gate_r; up_r]``; ``torch_dist`` stores
  the global tensor de-interleaved as ``[gate; up]``, which is the form used here.
- ``linear_proj``/``linear_fc2`` are split along dim 1, their biases replicated; embeddings and
  the output layer along dim 0, padded to ``padded_vocab_size`` rows.
- PP stage p holds consecutive layers numbered from 0; under VPP, chunk v of stage p comes at
  position ``v * PP + p`` in the global order. Expert ``j`` of EP rank e is ``e * local + j``.
- ``torch_dist`` stacks homogeneous layers (leading layer axis, experts a second axis) and names
  the input norm ``linear_qkv.layer_norm_weight`` and the pre-MLP norm
  ``linear_fc1.layer_norm_weight``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import Any

from .dtypes import ITEMSIZE
from .layout import Problem, TensorInfo

#: Hugging Face model types whose names this module writes (dense, and Mixtral-style MoE)
DENSE_TYPES = ("llama", "mistral", "qwen2", "qwen3")
MOE_TYPES = ("mixtral",)

LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
EXPERT_RE = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.+)$")

#: torch_dist names of the fused norms -> the module names of the legacy files
FUSED_NORMS = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
    "mlp.linear_fc1.layer_norm_bias": "pre_mlp_layernorm.bias",
}


def namespace(obj: Any) -> dict[str, Any]:
    """The fields of Megatron's ``args`` (an ``argparse.Namespace`` read as a record, or a
    dict); ``{}`` for anything else."""
    state = getattr(obj, "state", obj)
    if isinstance(state, tuple) and state and isinstance(state[0], dict):
        state = state[0]
    return dict(state) if isinstance(state, dict) else {}


def data_parallel(args: dict[str, Any], tp: int, pp: int) -> int:
    """The data-parallel size of the run that wrote the checkpoint, from Megatron's ``args``:
    ``data_parallel_size`` when recorded, else ``world_size / (TP x PP x CP)``
    (``megatron/training/arguments.py``, ``validate_args``; expert parallelism is carved out
    of data parallelism, so it does not divide). 1 when ``args`` say neither."""
    dp = args.get("data_parallel_size")
    if isinstance(dp, int) and not isinstance(dp, bool) and dp > 0:
        return dp
    world, cp = args.get("world_size"), args.get("context_parallel_size") or 1
    if isinstance(world, int) and isinstance(cp, int) and world > 0 and cp > 0 and \
            world % (tp * pp * cp) == 0:
        return world // (tp * pp * cp)
    return 1


@dataclass
class Arch:
    """What the cut needs to know of the model. Sizes in elements/rows; ``vocab`` is the true
    vocabulary (the Hugging Face config's), ``padded_vocab`` the rows stored."""

    layers: int
    hidden: int
    heads: int
    groups: int
    head_dim: int
    ffn: int
    padded_vocab: int
    vocab: int
    swiglu: bool = True
    tied: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    experts: int = 0
    topk: int = 2
    model_type: str = "llama"
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_positions: int = 4096
    dtype: str = "float32"
    #: config fields not found in a config or in ``args`` but guessed (from shapes or defaults)
    guessed: list[str] = field(default_factory=list)
    #: True when a separate output layer contradicts ``tied`` (set by the readers: torch_dist
    #: never stores one for tied embeddings; legacy PP > 1 stages keep a copy)
    tied_checked: bool = False

    @property
    def heads_per_group(self) -> int:
        return self.heads // self.groups

    def hf_config(self) -> dict[str, Any]:
        """``config.json`` fields of the Hugging Face model (with ``model_type``)."""
        cfg: dict[str, Any] = dict(
            model_type=self.model_type, architectures=[_ARCHITECTURES[self.model_type]],
            vocab_size=self.vocab, hidden_size=self.hidden, intermediate_size=self.ffn,
            num_hidden_layers=self.layers, num_attention_heads=self.heads,
            num_key_value_heads=self.groups, rms_norm_eps=self.norm_eps,
            rope_theta=self.rope_theta, max_position_embeddings=self.max_positions,
            tie_word_embeddings=self.tied, torch_dtype=self.dtype)
        if self.model_type in ("qwen3",) or self.head_dim * self.heads != self.hidden:
            cfg["head_dim"] = self.head_dim
        if self.model_type in ("llama",):
            cfg["attention_bias"] = self.qkv_bias
        if self.experts:
            cfg.update(num_local_experts=self.experts, num_experts_per_tok=self.topk)
        return cfg


_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                  "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                  "mixtral": "MixtralForCausalLM"}

_DTYPES = {"torch.bfloat16": "bfloat16", "torch.float16": "float16", "torch.float32": "float32"}


def arch_from(args: dict[str, Any], config: dict[str, Any] | None,
              shapes: dict[str, tuple[int, ...]], path: str,
              output_means_untied: bool = False) -> tuple[Arch | None, list[Problem]]:
    """The model's :class:`Arch` from the Hugging Face ``config`` (when given, it wins for the
    names and the vocabulary), Megatron's ``args`` and the global ``shapes`` of the normalised
    Megatron tensors, with ``config-mismatch`` problems where they contradict the tensors.
    ``output_means_untied``: a stored output layer proves untied embeddings (torch_dist; a
    legacy last stage keeps a copy of a tied one). Returns (None, [error]) when the attention
    layout cannot be known or the config holds non-numbers."""
    problems: list[Problem] = []
    cfg = config or {}
    guessed: list[str] = []
    bad = [k for k in INT_FIELDS if k in cfg and cfg[k] is not None
           and (not isinstance(cfg[k], int) or isinstance(cfg[k], bool) or cfg[k] < 0)]
    if bad:
        return None, [Problem("bad-config", f"config.json: {bad[0]} is {cfg[bad[0]]!r}, not a "
                              "count", path)]

    def pick(cfg_key: str | None, arg_key: str | None, default=None, guess=None):
        if cfg_key and cfg.get(cfg_key) is not None:
            return cfg[cfg_key]
        if arg_key and args.get(arg_key) is not None:
            return args[arg_key]
        value = guess() if guess else None
        if value is None:
            value = default
        if value is not None and cfg_key:
            guessed.append(f"{cfg_key}={value}")
        return value

    emb = shapes.get("embedding.word_embeddings.weight")
    qkv = shapes.get("decoder.layers.0.self_attention.linear_qkv.weight")
    layer_ids = {int(m[1]) for n in shapes if (m := LAYER_RE.match(n))}
    hidden = pick("hidden_size", "hidden_size", guess=lambda: emb[1] if emb else None)
    heads = pick("num_attention_heads", "num_attention_heads")
    if not hidden or not heads:
        return None, [Problem("no-model-config", "neither a Hugging Face config nor Megatron's "
                              "args give the number of attention heads: pass --hf-config DIR",
                              path)]
    # a config is taken as transformers reads it: no num_key_value_heads means one per head
    groups = (cfg.get("num_key_value_heads") or heads) if cfg else (
        args.get("num_query_groups") if args.get("group_query_attention") else None) or heads
    head_dim = cfg.get("head_dim") or args.get("kv_channels") or hidden // heads
    ffn = pick("intermediate_size", "ffn_hidden_size")
    padded = emb[0] if emb else args.get("padded_vocab_size")
    vocab = cfg.get("vocab_size") or args.get("vocab_size")
    if vocab is None:
        vocab = padded
        guessed.append(f"vocab_size={vocab} (the padded row count: args record no true "
                       "vocabulary)")
    swiglu = bool(args.get("swiglu", True)) if not cfg else cfg.get("hidden_act", "silu") in (
        "silu", "swiglu")
    experts = cfg.get("num_local_experts") or args.get("num_experts") or 0
    if "tie_word_embeddings" in cfg:
        tied = bool(cfg["tie_word_embeddings"])
    elif "untie_embeddings_and_output_weights" in args:
        tied = not args["untie_embeddings_and_output_weights"]
    else:
        tied = "output_layer.weight" not in shapes
        guessed.append(f"tie_word_embeddings={tied} (from the output layer's absence)")
    qk_norm = "decoder.layers.0.self_attention.q_layernorm.weight" in shapes
    qkv_bias = "decoder.layers.0.self_attention.linear_qkv.bias" in shapes
    model_type = cfg.get("model_type")
    if model_type is None:
        model_type = ("mixtral" if experts else "qwen3" if qk_norm else
                      "qwen2" if qkv_bias else "llama")
        guessed.append(f"model_type={model_type} (from the tensors present)")
    arch = Arch(
        layers=pick("num_hidden_layers", "num_layers", guess=lambda: len(layer_ids) or None),
        hidden=hidden, heads=heads, groups=groups, head_dim=head_dim, ffn=ffn or 0,
        padded_vocab=padded or vocab, vocab=vocab, swiglu=swiglu, tied=tied, qkv_bias=qkv_bias,
        qk_norm=qk_norm, experts=experts,
        topk=cfg.get("num_experts_per_tok") or args.get("moe_router_topk") or 2,
        model_type=model_type,
        norm_eps=pick("rms_norm_eps", "norm_epsilon", 1e-5),
        rope_theta=pick("rope_theta", "rotary_base", 10000.0),
        max_positions=pick("max_position_embeddings", "max_position_embeddings", 4096),
        dtype=cfg.get("torch_dtype") or ("bfloat16" if args.get("bf16") else "float16"
                                         if args.get("fp16") else _DTYPES.get(
                                             str(args.get("params_dtype")), "float32")),
        guessed=guessed if not cfg else [], tied_checked=output_means_untied)
    if model_type not in DENSE_TYPES + MOE_TYPES:
        problems.append(Problem("unsupported-model", f"model type {model_type!r}: shardscope "
                                "maps Megatron names to " + ", ".join(DENSE_TYPES + MOE_TYPES),
                                path))
    if heads % groups:
        problems.append(Problem("config-mismatch", f"{heads} heads do not divide into {groups} "
                                "query groups", path))
    elif qkv and qkv[0] != (heads + 2 * groups) * head_dim:
        problems.append(Problem(
            "config-mismatch", f"linear_qkv has {qkv[0]} rows; {heads} heads in {groups} query "
            f"groups of head dim {head_dim} need {(heads + 2 * groups) * head_dim}", path))
    if padded is not None and vocab > padded:
        problems.append(Problem("config-mismatch", f"the config's vocabulary ({vocab}) is "
                                f"larger than the embedding's {padded} rows", path))
    if not arch.swiglu:
        problems.append(Problem("unsupported-model", "a non-gated MLP has no Llama-family "
                                "Hugging Face name", path))
    untie = args.get("untie_embeddings_and_output_weights")
    if cfg.get("tie_word_embeddings") is not None and untie is not None and \
            bool(cfg["tie_word_embeddings"]) == bool(untie):
        problems.append(Problem("config-mismatch", f"the config says tie_word_embeddings="
                                f"{cfg['tie_word_embeddings']}, Megatron's args say "
                                f"untie_embeddings_and_output_weights={untie}", path))
    problems += _fit_problems(arch, cfg, shapes, layer_ids, path)
    return arch, problems


#: config.json fields that must be non-negative integers
INT_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
              "num_attention_heads", "num_key_value_heads", "head_dim", "num_local_experts",
              "num_experts_per_tok")


def _fit_problems(a: Arch, cfg: dict, shapes: dict, layer_ids: set, path: str) -> list[Problem]:
    """``config-mismatch`` errors where the model description (config or args) contradicts
    the tensors: layer count, hidden size, MLP width, experts, and the family's features
    (qkv bias, q/k norms, experts), so no merge writes a folder that loads wrongly."""
    out: list[str] = []
    emb = shapes.get("embedding.word_embeddings.weight")
    if layer_ids and a.layers != max(layer_ids) + 1:
        out.append(f"{a.layers} layers described, the checkpoint holds {max(layer_ids) + 1}")
    if emb and a.hidden != emb[1]:
        out.append(f"hidden size {a.hidden} described, the embedding has {emb[1]} columns")
    fc1 = shapes.get("decoder.layers.0.mlp.linear_fc1.weight") or shapes.get(
        "decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight")
    if fc1 and a.swiglu and a.ffn != fc1[0] // 2:
        out.append(f"MLP width {a.ffn} described, linear_fc1 holds {fc1[0] // 2} (x2 rows)")
    fc2 = shapes.get("decoder.layers.0.mlp.linear_fc2.weight") or shapes.get(
        "decoder.layers.0.mlp.experts.local_experts.0.linear_fc2.weight")
    if fc2 and len(fc2) == 2 and a.ffn != fc2[1]:
        out.append(f"MLP width {a.ffn} described, linear_fc2 holds {fc2[1]} columns")
    # the expert index of ``decoder.layers.{i}.mlp.experts.local_experts.{e}.*`` (not the
    # layer index i: a model's layer count and expert count differ, Mixtral-8x7B: 32 and 8)
    experts = {int(x[1]) for n in shapes if (m := LAYER_RE.match(n))
               and (x := EXPERT_RE.match(m[2]))}
    found = max(experts) + 1 if experts else 0
    if found != (a.experts or 0):
        out.append(f"{a.experts or 0} experts described, the checkpoint holds {found}")
    mt = a.model_type
    if a.qkv_bias and not (mt == "qwen2" or cfg.get("attention_bias") or not cfg):
        out.append(f"linear_qkv has a bias, which model type {mt} without attention_bias "
                   "would drop")
    if not a.qkv_bias and mt == "qwen2":
        out.append("model type qwen2 needs q/k/v biases, the checkpoint has none")
    if a.qk_norm != (mt == "qwen3"):
        out.append(f"model type {mt} " + ("has no q/k norms, the checkpoint has them"
                                         if a.qk_norm else "needs q/k norms, the checkpoint "
                                         "has none"))
    if (mt in MOE_TYPES) != bool(found):
        out.append(f"model type {mt} " + ("needs experts" if mt in MOE_TYPES else
                                         "has no experts") + ", the checkpoint " +
                   ("has none" if not found else "has them"))
    out_layer = "output_layer.weight" in shapes
    return [Problem("config-mismatch", m, path) for m in out] + (
        [Problem("config-mismatch", "the config ties the embeddings, but the checkpoint has its "
                 "own output layer: pass a config with tie_word_embeddings false", path)]
        if a.tied and out_layer and a.tied_checked else [])


def select(t: TensorInfo, index: tuple[int, ...], segments: list[tuple[int, int, int]] | None,
           name: str, shape: tuple[int, ...], placement: str | None = None,
           source: str | None = None) -> TensorInfo:
    """A tensor cut from ``t``: the dims in ``index`` fixed, then, along the next dim, each
    segment ``(src_start, rows, dst_start)`` of ``t`` placed at ``dst_start`` of the new
    tensor of ``shape`` (``None``: all of that dim). Trailing dims are kept whole.

    Each piece of ``t`` that meets a segment gives one piece of the result pointing into the
    same bytes (its offset moved by whole leading-dim steps, so a C-contiguous piece stays
    contiguous). Deferred pieces (``archive`` set) stay deferred, their offset relative.
    """
    d = len(index)
    if segments is None:
        segments = [(0, t.shape[d], 0)]
    out = TensorInfo(name, shape, t.dtype, placement or t.placement, source=source or t.name)
    size = ITEMSIZE[t.dtype]
    for p in t.pieces:
        go, sh, st = p.global_offsets, p.shape, p.stride
        if any(not go[k] <= index[k] < go[k] + sh[k] for k in range(d)):
            continue
        base = sum((index[k] - go[k]) * st[k] for k in range(d))
        for a, n, dst in segments:
            lo, hi = max(go[d], a), min(go[d] + sh[d], a + n)
            if lo >= hi:
                continue
            off = base + (lo - go[d]) * st[d]
            out.pieces.append(replace(p, byte_offset=p.byte_offset + off * size,
                                      shape=(hi - lo,) + sh[d + 1:], stride=st[d:],
                                      global_offsets=(dst + lo - a,) + go[d + 1:]))
    return out


def unstack(tensors: dict[str, TensorInfo]) -> dict[str, TensorInfo]:
    """``torch_dist`` names -> the global per-layer names of the legacy files: stacked
    ``decoder.layers.X`` (leading layer axis) become ``decoder.layers.{i}.X``, stacked experts
    ``mlp.experts.experts.Y`` (second axis) become ``mlp.experts.local_experts.{e}.Y``, and the
    fused norms get their module names (:data:`FUSED_NORMS`)."""
    out: dict[str, TensorInfo] = {}
    for name, t in tensors.items():
        if name.startswith("decoder.layers.") and not LAYER_RE.match(name):
            rest = name[len("decoder.layers."):]
            for i in range(t.shape[0]):
                if rest.startswith("mlp.experts.experts."):
                    leaf = rest[len("mlp.experts.experts."):]
                    for e in range(t.shape[1]):
                        n = f"decoder.layers.{i}.mlp.experts.local_experts.{e}.{leaf}"
                        out[n] = select(t, (i, e), None, n, t.shape[2:], source=n)
                    continue
                n = f"decoder.layers.{i}.{FUSED_NORMS.get(rest, rest)}"
                out[n] = select(t, (i,), None, n, t.shape[1:], source=n)
        elif (m := LAYER_RE.match(name)) and m[2] in FUSED_NORMS:
            n = f"decoder.layers.{m[1]}.{FUSED_NORMS[m[2]]}"
            out[n] = replace(t, name=n)
        else:
            out[name] = t
    return out


def to_hf(mt: dict[str, TensorInfo], arch: Arch, path: str
          ) -> tuple[dict[str, TensorInfo], list[Problem]]:
    """Cut the normalised Megatron tensors ``mt`` into Hugging Face tensors (Llama/Qwen2/
    Qwen3/Mistral names, Mixtral names for experts). Every Megatron tensor must be used:
    one with no Hugging Face name is an ``unmapped-tensor`` error, so no weight is dropped
    silently."""
    hf: dict[str, TensorInfo] = {}
    problems: list[Problem] = []
    used: set[str] = set()
    a = arch

    def put(src: str, dst: str, index=(), segments=None, shape=None, placement=None):
        t = mt.get(src)
        if t is None:
            return
        used.add(src)
        shp = shape if shape is not None else t.shape[len(index):]
        hf[dst] = select(t, index, segments, dst, shp, placement, source=src)

    def rows(src: str, dst: str, start: int, n: int, what: str):
        t = mt.get(src)
        if t is not None:
            put(src, dst, (), [(start, n, 0)], (n,) + t.shape[1:], f"{t.placement}; {what}")

    rows("embedding.word_embeddings.weight", "model.embed_tokens.weight", 0, a.vocab,
         f"rows 0..{a.vocab - 1} of {a.padded_vocab}")
    rows("output_layer.weight", "lm_head.weight", 0, a.vocab,
         f"rows 0..{a.vocab - 1} of {a.padded_vocab}")
    put("decoder.final_layernorm.weight", "model.norm.weight")
    hd, hpg, g = a.head_dim, a.heads_per_group, a.groups
    per_group = (hpg + 2) * hd
    qkv_cut = {"q_proj": [(k * per_group, hpg * hd, k * hpg * hd) for k in range(g)],
               "k_proj": [(k * per_group + hpg * hd, hd, k * hd) for k in range(g)],
               "v_proj": [(k * per_group + (hpg + 1) * hd, hd, k * hd) for k in range(g)]}
    for i in range(a.layers):
        m, h = f"decoder.layers.{i}.", f"model.layers.{i}."
        put(m + "input_layernorm.weight", h + "input_layernorm.weight")
        for kind in ("weight", "bias"):
            src = m + f"self_attention.linear_qkv.{kind}"
            t = mt.get(src)
            if t is None:
                continue
            for proj, segs in qkv_cut.items():
                n = sum(s[1] for s in segs)
                put(src, h + f"self_attn.{proj}.{kind}", (), segs, (n,) + t.shape[1:],
                    f"{t.placement}; {proj[0]} rows of {g} query groups")
        put(m + "self_attention.linear_proj.weight", h + "self_attn.o_proj.weight")
        put(m + "self_attention.linear_proj.bias", h + "self_attn.o_proj.bias")
        put(m + "self_attention.q_layernorm.weight", h + "self_attn.q_norm.weight")
        put(m + "self_attention.k_layernorm.weight", h + "self_attn.k_norm.weight")
        put(m + "pre_mlp_layernorm.weight", h + "post_attention_layernorm.weight")
        mlps = [(m + "mlp.", h + "mlp.", ("gate_proj", "up_proj", "down_proj"))]
        if a.experts:
            put(m + "mlp.router.weight", h + "block_sparse_moe.gate.weight")
            mlps = [(f"{m}mlp.experts.local_experts.{e}.", f"{h}block_sparse_moe.experts.{e}.",
                     ("w1", "w3", "w2")) for e in range(a.experts)]
        for src_mod, dst_mod, (gate, up, down) in mlps:
            for kind in ("weight", "bias"):
                src = f"{src_mod}linear_fc1.{kind}"
                t = mt.get(src)
                if t is not None:
                    f = t.shape[0] // 2
                    rows(src, f"{dst_mod}{gate}.{kind}", 0, f, "gate rows of [gate; up]")
                    rows(src, f"{dst_mod}{up}.{kind}", f, f, "up rows of [gate; up]")
                put(f"{src_mod}linear_fc2.{kind}", f"{dst_mod}{down}.{kind}")
    for name, t in mt.items():
        if name not in used:
            problems.append(Problem("unmapped-tensor", f"{name} {list(t.shape)} has no Hugging "
                                    f"Face name for model type {a.model_type}", path))
    return hf, problems


def cut_to_hf(layout, mt: dict[str, TensorInfo], args: dict[str, Any], config_dir,
              output_means_untied: bool = False) -> Arch | None:
    """The steps both Megatron readers end with: attach the Hugging Face config folder (or
    derive ``layout.derived_config`` from ``args``, a ``config-guessed`` warning per guessed
    field), work out the :class:`Arch`, and set ``layout.tensors`` to the Hugging Face tensors
    cut from ``mt``. Problems go to ``layout.problems``; returns None when the model cannot
    be described."""
    from .formats.common import attach_config, read_config

    layout.config_dir, layout.extra_files = None, []
    attach_config(layout, config_dir)
    config = read_config(config_dir)
    arch, probs = arch_from(args, config, {n: t.shape for n, t in mt.items()}, layout.path,
                            output_means_untied)
    layout.problems.extend(probs)
    if arch is None:
        return None
    if config is None:
        layout.derived_config = arch.hf_config()
        layout.problems.extend(Problem("config-guessed", f"no Hugging Face config: {g}",
                                       layout.path, "warning") for g in arch.guessed)
    layout.tensors, probs = to_hf(mt, arch, layout.path)
    layout.problems.extend(probs)
    return arch


def pipeline_text(stage_layers: dict[tuple[int, int], list[int]], pp: int, vpp: int) -> str:
    """``stage 0: layers 0-1; stage 1: layers 2-3`` from {(pp rank, vpp chunk): global
    layer numbers}."""
    parts = []
    for p in range(pp):
        spans = []
        for v in range(max(vpp, 1)):
            ids = stage_layers.get((p, v), [])
            if ids:
                spans.append(f"{ids[0]}-{ids[-1]}" if len(ids) > 1 else str(ids[0]))
        parts.append(f"stage {p}: layers {', '.join(spans) or 'none'}")
    return "; ".join(parts)


def describe(arch: Arch, par: dict[str, int], stages: str, embed_ranks: str,
             args_source: str, grouped_gemm: bool = False) -> dict[str, str]:
    """The details an inspector shows for a Megatron checkpoint (label -> text);
    ``grouped_gemm``: the experts were trained with ``--moe-grouped-gemm``."""
    a = arch
    att = f"{a.heads} heads, {a.groups} query groups"
    att += " (GQA)" if a.groups < a.heads else ""
    att += f", head dim {a.head_dim}" + (", qkv bias" if a.qkv_bias else "")
    att += ", q/k norm" if a.qk_norm else ""
    mlp = ("gated (SwiGLU)" if a.swiglu else "not gated") + f", ffn {a.ffn}"
    if a.experts:
        mlp += f"; {a.experts} experts, top-{a.topk}"
        if par.get("ep", 1) > 1:
            mlp += f", {a.experts // par['ep']} per EP rank"
        if grouped_gemm:
            mlp += ", grouped GEMM"
    vocab = str(a.vocab) + (f" (padded to {a.padded_vocab} rows in the checkpoint)"
                            if a.padded_vocab != a.vocab else "")
    return {
        "TP/PP/VPP/EP": " / ".join(str(par.get(k, 1)) if k != "vpp" or par.get(k) else "-"
                                   for k in ("tp", "pp", "vpp", "ep")),
        "layers": f"{a.layers}; {stages}",
        "embeddings": embed_ranks,
        "vocabulary": vocab,
        "attention": att,
        "MLP": mlp,
        "tied embeddings": "yes" if a.tied else "no",
        "HF names": a.model_type,
        "args": args_source,
    }
