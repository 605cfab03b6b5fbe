"""Framework-native tensor names (torchtitan, torchtune, Meta's Llama) -> Hugging Face names
(Llama; torchtitan's dense Qwen3 too).

torchtitan and torchtune train their own model classes, so their checkpoints hold their own
names (``tok_embeddings``, ``layers.N.attention.wq``, ``sa_norm.scale``, ...) and their own
row order of the query and key projections. Written as-is under a ``LlamaForCausalLM``
config they would load as a randomly initialised model. This module recognises those naming
schemes from the tensor names alone and converts a layout to the names ``save_pretrained``
writes, as the frameworks' own exporters do — or refuses, naming the framework.

Format facts (read in the frameworks' sources, checked by tests on checkpoints they wrote):

- torchtitan 0.3.0, ``torchtitan/models/llama3/state_dict_adapter.py``
  (``Llama3StateDictAdapter.from_hf_map`` / ``to_hf``): ``tok_embeddings`` ->
  ``model.embed_tokens``; ``layers.N.attention.qkv_linear.{wq,wk,wv}`` -> ``self_attn.{q,k,v}
  _proj``; ``attention.wo`` -> ``o_proj``; ``feed_forward.{w1,w3,w2}`` -> ``mlp.{gate,up,down}
  _proj``; ``attention_norm`` -> ``input_layernorm``; ``ffn_norm`` ->
  ``post_attention_layernorm``; ``norm`` -> ``model.norm``; ``lm_head`` -> ``lm_head`` (dropped
  when the weights are tied). Its checkpoints are DCP folders ``step-N/`` whose model keys are
  flat beside ``train_state`` (``torchtitan/components/checkpointer/{base,dcp}.py``).
- Meta's Llama names (``consolidated.*.pth``; torchtitan's Llama before ``qkv_linear``):
  ``attention.{wq,wk,wv,wo}``, ``output`` — torchtune ``models/convert_weights.py``
  ``_FROM_META``.
- torchtune 0.6.1, ``torchtune/models/convert_weights.py`` (``_FROM_HF`` / ``tune_to_hf``):
  ``layers.N.attn.{q,k,v}_proj``, ``attn.output_proj``, ``mlp.{w1,w3,w2}``,
  ``sa_norm.scale``, ``mlp_norm.scale``, ``norm.scale``, ``output`` (absent when tied:
  ``TiedLinear``). Its ``DistributedCheckpointer`` writes DCP with the model under ``model``.
- The rotary permutation: both exporters apply, per head, ``w.view(heads, head_dim // 2, 2,
  dim).transpose(1, 2).reshape(heads * head_dim, dim)`` to q (``num_attention_heads``) and k
  (``num_key_value_heads``) — the native rows of a head are interleaved pairs, Hugging Face's
  are halves: Hugging Face row ``h*hd + k*hd/2 + j`` = native row ``h*hd + 2*j + k``.
  Here that is a set of strided pieces of the stored slices (no data read while planning).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from pathlib import Path

from .dtypes import ITEMSIZE
from .layout import CheckpointLayout, Problem, TensorInfo

#: details key under which a converted layout says what was done
DETAIL = "framework names"

#: rotary-embedding tables some native models save as buffers; Hugging Face recomputes them
ROTARY_BUFFERS = ("freqs_cis", "rope.freqs", "rope.cache", "rope_cache")


@dataclass(frozen=True)
class Scheme:
    """One framework's naming: native name template -> Hugging Face template (``{}`` = the
    layer number), the templates of the q and k projections (rows to permute) and the keys
    whose presence identifies the scheme."""

    framework: str
    source: str
    names: dict[str, str]
    q: str
    k: str
    marks: tuple[str, ...]


_LAYER_HF = {
    "o": "model.layers.{}.self_attn.o_proj.weight",
    "q": "model.layers.{}.self_attn.q_proj.weight",
    "k": "model.layers.{}.self_attn.k_proj.weight",
    "v": "model.layers.{}.self_attn.v_proj.weight",
    "gate": "model.layers.{}.mlp.gate_proj.weight",
    "up": "model.layers.{}.mlp.up_proj.weight",
    "down": "model.layers.{}.mlp.down_proj.weight",
    "in": "model.layers.{}.input_layernorm.weight",
    "post": "model.layers.{}.post_attention_layernorm.weight",
}


def _scheme(framework, source, q, k, v, o, w1, w2, w3, attn_norm, ffn_norm, norm, output):
    names = {"tok_embeddings.weight": "model.embed_tokens.weight", norm: "model.norm.weight",
             output: "lm_head.weight",
             q: _LAYER_HF["q"], k: _LAYER_HF["k"], v: _LAYER_HF["v"], o: _LAYER_HF["o"],
             w1: _LAYER_HF["gate"], w3: _LAYER_HF["up"], w2: _LAYER_HF["down"],
             attn_norm: _LAYER_HF["in"], ffn_norm: _LAYER_HF["post"]}
    return Scheme(framework, source, names, q, k,
                  ("tok_embeddings.weight", q.format(0), attn_norm.format(0)))


SCHEMES = (
    _scheme("torchtitan", "torchtitan's Llama3StateDictAdapter.to_hf",
            "layers.{}.attention.qkv_linear.wq.weight", "layers.{}.attention.qkv_linear.wk.weight",
            "layers.{}.attention.qkv_linear.wv.weight", "layers.{}.attention.wo.weight",
            "layers.{}.feed_forward.w1.weight", "layers.{}.feed_forward.w2.weight",
            "layers.{}.feed_forward.w3.weight", "layers.{}.attention_norm.weight",
            "layers.{}.ffn_norm.weight", "norm.weight", "lm_head.weight"),
    _scheme("torchtitan or Meta Llama", "the conversion of Meta's Llama names (torchtune's "
            "_FROM_META with tune_to_hf)",
            "layers.{}.attention.wq.weight", "layers.{}.attention.wk.weight",
            "layers.{}.attention.wv.weight", "layers.{}.attention.wo.weight",
            "layers.{}.feed_forward.w1.weight", "layers.{}.feed_forward.w2.weight",
            "layers.{}.feed_forward.w3.weight", "layers.{}.attention_norm.weight",
            "layers.{}.ffn_norm.weight", "norm.weight", "output.weight"),
    _scheme("torchtune", "torchtune's convert_weights.tune_to_hf",
            "layers.{}.attn.q_proj.weight", "layers.{}.attn.k_proj.weight",
            "layers.{}.attn.v_proj.weight", "layers.{}.attn.output_proj.weight",
            "layers.{}.mlp.w1.weight", "layers.{}.mlp.w2.weight",
            "layers.{}.mlp.w3.weight", "layers.{}.sa_norm.scale",
            "layers.{}.mlp_norm.scale", "norm.scale", "output.weight"),
)

#: torchtitan's dense Qwen3 (torchtitan/models/qwen3/state_dict_adapter.py,
#: ``Qwen3StateDictAdapter.from_hf_map``): torchtitan's Llama names plus the q/k norms; its
#: rotary embedding (``CosSinRoPE``) already uses Hugging Face's row order, so ``to_hf`` only
#: renames. Its MoE experts (``moe.routed_experts``) are not converted here (unmapped-tensor).
QWEN3_NAMES = {"layers.{}.attention.q_norm.weight": "model.layers.{}.self_attn.q_norm.weight",
               "layers.{}.attention.k_norm.weight": "model.layers.{}.self_attn.k_norm.weight"}
QWEN3_SOURCE = "torchtitan's Qwen3StateDictAdapter.to_hf"

_NUM = re.compile(r"(?<=\.)(\d+)(?=\.)")


def recognise(names) -> Scheme | None:
    """The naming scheme whose identifying keys (``tok_embeddings.weight`` and layer 0's query
    projection and attention norm) are all among ``names``, or None."""
    names = set(names)
    for s in SCHEMES:
        if all(m in names for m in s.marks):
            return s
    return None


def _template(name: str) -> tuple[str, str | None]:
    """``layers.3.attn.q_proj.weight`` -> (``layers.{}.attn.q_proj.weight``, ``"3"``)."""
    m = _NUM.search(name)
    if m is None or not name.startswith("layers."):
        return name, None
    return name[:m.start()] + "{}" + name[m.end():], m[1]


def _heads(config: dict, hidden: int) -> tuple[int, int, int] | str:
    """(query heads, key/value heads, head dim) from a Llama ``config.json``, or the reason
    they cannot be read."""
    heads = config.get("num_attention_heads")
    if not isinstance(heads, int) or heads <= 0:
        return "config.json has no num_attention_heads"
    kv = config.get("num_key_value_heads") or heads
    hd = config.get("head_dim") or (config.get("hidden_size") or hidden) // heads
    if not isinstance(kv, int) or not isinstance(hd, int) or hd <= 0:
        return "config.json has no usable num_key_value_heads/head_dim"
    return heads, kv, hd


def permute_rows(t: TensorInfo, heads: int, head_dim: int, name: str) -> TensorInfo:
    """``t`` (rows = ``heads * head_dim``) with each head's rows put in Hugging Face's rotary
    order: output row ``h*hd + k*hd/2 + j`` takes native row ``h*hd + 2*j + k`` (k = 0, 1).

    Expressed as pieces: for each stored piece, head and half, the rows of that piece the
    half needs form an arithmetic progression (step 2), i.e. one piece with its row stride
    doubled, pointing into the same bytes (deferred pieces keep a relative offset). The
    other dims are kept as stored.
    """
    half = head_dim // 2
    size = ITEMSIZE[t.dtype]
    out = TensorInfo(name, t.shape, t.dtype,
                     f"{t.placement}; rotary rows", source=t.name)
    for p in t.pieces:
        r0, r1 = p.global_offsets[0], p.global_offsets[0] + p.shape[0]
        for h in range(heads):
            for k in (0, 1):
                first = h * head_dim + k  # native row of j = 0
                j_lo = max(0, -((first - r0) // 2))  # ceil((r0 - first) / 2), at least 0
                j_hi = min(half - 1, (r1 - 1 - first) // 2)
                if j_lo > j_hi:
                    continue
                row = first + 2 * j_lo
                out.pieces.append(replace(
                    p, byte_offset=p.byte_offset + (row - r0) * p.stride[0] * size,
                    shape=(j_hi - j_lo + 1,) + p.shape[1:],
                    stride=(2 * p.stride[0],) + p.stride[1:],
                    global_offsets=(h * head_dim + k * half + j_lo,) + p.global_offsets[1:]))
    return out


def convert(layout: CheckpointLayout, hf_config: str | None = None) -> Scheme | None:
    """Convert ``layout`` in place when its tensors carry a framework's native names.

    ``hf_config``: the Hugging Face config folder the user gave (``--hf-config``); else the
    layout's own config folder. Without a config (the head counts the q/k permutation needs
    are not in the weights) the layout keeps its native names and gets a
    ``native-names-no-config`` error naming the framework. The config's ``model_type`` picks
    the target: ``llama`` (q/k rows permuted), or ``qwen3`` for torchtitan's names (renamed
    only). A native tensor the target does not name (``unmapped-tensor``), a config of another
    family (``config-mismatch``) and q/k shapes that disagree with the config
    (``shape-mismatch``) are errors too: nothing is written under a Hugging Face name it does
    not have. Returns the scheme recognised, or None (layout untouched).
    """
    scheme = recognise(layout.tensors)
    if scheme is None:
        return None
    from .formats.common import attach_config, read_config

    fw = scheme.framework
    what = f"{fw} checkpoint ({fw} names such as {scheme.q.format(0)})"
    if hf_config:
        attach_config(layout, hf_config)
    config = read_config(layout.config_dir)
    where = str(Path(layout.config_dir, "config.json")) if layout.config_dir else layout.path
    if config is None:
        layout.problems.append(Problem(
            "native-names-no-config", f"{what}: its names and q/k row order differ from "
            "Hugging Face's, and the head counts to convert them are not in the weights; pass "
            "--hf-config DIR (the folder of the model's Hugging Face config.json)", layout.path))
        return scheme
    mtype = config.get("model_type")
    names, permute, source, family = scheme.names, True, scheme.source, "Llama"
    if mtype == "qwen3" and scheme is SCHEMES[0]:
        names, permute, source, family = {**names, **QWEN3_NAMES}, False, QWEN3_SOURCE, "Qwen3"
        if "layers.0.attention.q_norm.weight" not in layout.tensors:
            layout.problems.append(Problem(
                "config-mismatch", f"{what}: config.json says model_type 'qwen3', but the "
                "weights have no q_norm/k_norm (a torchtitan Llama?)", where))
            return scheme
    elif mtype != "llama":
        known = "llama or qwen3" if scheme is SCHEMES[0] else "llama"
        layout.problems.append(Problem(
            "config-mismatch", f"{what}, but config.json says model_type {mtype!r}: only "
            f"conversion to {known} names is known", where))
        return scheme
    emb = layout.tensors["tok_embeddings.weight"]
    hd_info = _heads(config, emb.shape[-1])
    if isinstance(hd_info, str):
        layout.problems.append(Problem("config-mismatch", f"{what}: {hd_info}", where))
        return scheme
    heads, kv, hd = hd_info
    if hd % 2:
        layout.problems.append(Problem("config-mismatch", f"{what}: head_dim {hd} is odd, "
                                       "rotary pairs cannot be formed", where))
        return scheme
    hidden = emb.shape[-1]
    converted: dict[str, TensorInfo] = {}
    dropped = []
    for name, t in layout.tensors.items():
        tmpl, layer = _template(name)
        target = names.get(tmpl)
        if target is None:
            if name.endswith(ROTARY_BUFFERS) or name.split(".")[-1] in ROTARY_BUFFERS:
                dropped.append(name)
                continue
            layout.problems.append(Problem(
                "unmapped-tensor", f"{name}: a tensor of a {fw} checkpoint that {source} "
                "does not convert", layout.path))
            continue
        hf_name = target.format(layer) if layer is not None else target
        if tmpl in (scheme.q, scheme.k):
            n = heads if tmpl == scheme.q else kv
            if t.flat or len(t.shape) != 2 or t.shape != (n * hd, hidden):
                layout.problems.append(Problem(
                    "shape-mismatch", f"{name} is {list(t.shape)}, config.json implies "
                    f"[{n * hd}, {hidden}] ({n} heads of {hd})", where))
                continue
            converted[hf_name] = (permute_rows(t, n, hd, hf_name) if permute
                                  else replace(t, name=hf_name, source=name))
        else:
            converted[hf_name] = replace(t, name=hf_name, source=name)
    layout.tensors = converted
    heads_text = f"{heads} query, {kv} key/value heads of {hd}"
    layout.details[DETAIL] = (f"{fw}: {len(converted)} tensors renamed to Hugging Face "
                              f"{family} names, " + (f"q/k rows permuted for rotary embeddings "
                                                     f"({heads_text})" if permute else
                                                     f"q/k rows kept ({heads_text})")
                              + f", as {source}")
    layout.notes.append(f"{fw} names converted to Hugging Face names (inspect --params shows "
                        "each tensor's native name)")
    if dropped:
        layout.notes.append(f"rotary tables not written (Hugging Face recomputes them): "
                            f"{', '.join(dropped[:3])}{' ...' if len(dropped) > 3 else ''}")
    return scheme

