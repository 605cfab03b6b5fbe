"""``merge --dtype`` that makes finite values ±Inf (trial report A5): the output stays exactly
torch's ``.to()`` (the cast's definition), and the merge says which tensors overflowed and by
how many elements (finite in the checkpoint, Inf in the output) — it said nothing, and
``verify`` then said ok."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import ROOT, run_cli


def cli(*args):
    return run_cli(*args, cwd=ROOT)


def _edited_reference(fixtures_root, tmp_path):
    """A copy of a real save_pretrained folder with values beyond F16's range (and an Inf
    and a NaN that were there before the cast, which are not the cast's doing)."""
    src = tmp_path / "big"
    src.mkdir()
    ref = fixtures_root / "w2-qwen2-f32.reference"
    for f in ref.iterdir():
        if f.is_file():
            (src / f.name).write_bytes(f.read_bytes())
    d = load_file(src / "model.safetensors")
    norm, emb = d["model.norm.weight"], d["model.embed_tokens.weight"]
    norm[0], norm[1], norm[2], norm[3] = 1e6, -7e4, float("inf"), float("nan")
    emb[3, 4] = 65520.0  # the smallest F32 value that rounds to F16's Inf
    emb[3, 5] = 65519.0  # rounds to 65504: finite
    emb[7, 1] = 3.4e38  # beyond BF16's largest value too: Inf in BF16 as well
    save_file(d, src / "model.safetensors", metadata={"format": "pt"})
    return src, d


@pytest.mark.parametrize("dtype,want", [
    ("fp16", {"model.embed_tokens.weight": 2, "model.norm.weight": 2}),
    ("bf16", {"model.embed_tokens.weight": 1}),
])
def test_cast_out_of_range_is_torch_s_bits_and_named_in_a_warning(fixtures_root, tmp_path,
                                                                   dtype, want):
    src, d = _edited_reference(fixtures_root, tmp_path)
    out = tmp_path / "out"
    r = cli("merge", src, "-o", out, "--dtype", dtype)
    assert r.returncode == 0, r.stderr
    tdtype = torch.float16 if dtype == "fp16" else torch.bfloat16
    got = load_file(out / "model.safetensors")
    for name, x in d.items():  # the spec: exactly .to()
        assert torch.equal(got[name].view(torch.int16), x.to(tdtype).view(torch.int16)), name
    lines = [w for w in r.stderr.splitlines() if "±Inf" in w]
    total = sum(want.values())
    listed = ", ".join(f"{n} ({k})" for n, k in sorted(want.items()))
    assert lines == [f"warning: --dtype {dtype}: {total} finite value{'s' if total > 1 else ''} out of {dtype}'s range "
                     f"became ±Inf (as torch's .to() makes them) in {len(want)} tensor"
                     f"{'s' if len(want) > 1 else ''}: {listed}"], r.stderr


def test_fold_that_overflows_the_cast_is_named(lora_root, tmp_path):
    """The LoRA fold casts its result too: a huge alpha (q_proj's, k_proj's, o_proj's scale
    alpha/r) makes the folded weights too large for F16; v_proj and up_proj keep their own
    alpha_pattern values and stay in range. The output is the F32 fold, then ``.to()``."""
    out = tmp_path / "out"
    r = cli("merge", lora_root / "w2-lora-patterns", "-o", out, "--lora", "fold",
            "--lora-alpha", "1e9", "--dtype", "fp16")
    assert r.returncode == 0, r.stderr
    from shardscope.core.execute import overflow_warning

    r32 = cli("merge", lora_root / "w2-lora-patterns", "-o", tmp_path / "f32", "--lora", "fold",
              "--lora-alpha", "1e9")
    assert r32.returncode == 0 and "±Inf" not in r32.stderr, r32.stderr
    got = load_file(out / "model.safetensors")
    fold = load_file(tmp_path / "f32" / "model.safetensors")
    for name, x in got.items():  # the folded weights are finite: every Inf is the cast's
        assert torch.isfinite(fold[name]).all()
        assert torch.equal(x.view(torch.int16), fold[name].to(torch.float16).view(torch.int16))
    over = {n: int(torch.isinf(x).sum()) for n, x in got.items() if torch.isinf(x).any()}
    assert over and all("q_proj" in n or "k_proj" in n or "o_proj" in n for n in over)
    lines = [w for w in r.stderr.splitlines() if "±Inf" in w]
    assert lines == [f"warning: {overflow_warning(over, 'fp16')}"], r.stderr


@pytest.mark.parametrize("dtype,np_dtype", [("F16", np.float16), ("F32", np.float32),
                                            ("F64", np.float64)])
def test_count_inf_counts_both_signs_and_skips_nan(dtype, np_dtype):
    from shardscope.core.cast import count_inf

    x = np.array([0, 1, -1, np.inf, -np.inf, np.nan, -np.nan, -np.inf, 5], np_dtype)
    assert count_inf(x.view(np.uint8), dtype) == 3
    assert count_inf(x[:3].view(np.uint8), dtype) == 0
    assert count_inf(np.array([np.nan, -np.nan], np_dtype).view(np.uint8), dtype) == 0
    assert count_inf(np.array([], np_dtype).view(np.uint8), dtype) == 0


def test_overflowed_counts_what_the_cast_made_inf():
    from shardscope.core.cast import overflowed

    x = torch.tensor([1e6, -1e6, float("inf"), float("nan"), 3.0, 65519.0, -65520.0])
    y = x.to(torch.float16)
    words = lambda v: v.view(torch.uint8).numpy()  # noqa: E731
    assert overflowed(words(x), "F32", words(y), "F16") == 3
    b = x.to(torch.bfloat16)
    assert overflowed(words(x), "F32", words(b), "BF16") == 0
    assert overflowed(words(y), "F16", words(y.float()), "F32") == 0  # widening: never


def test_tensor_parallel_pieces_cast_in_memory_are_counted_too(megatron_root, tmp_path):
    """Megatron TP=2 (legacy torch.save files, edited): row-parallel columns (placed in
    memory, then cast by numpy) and the QKV split count their overflows as the streamed
    rows do; the output is the F32 merge's ``.to()`` bit for bit."""
    import shutil

    src = tmp_path / "mg"
    shutil.copytree(megatron_root / "llama" / "tp2_pp1" / "legacy", src)
    f = src / "iter_0000010" / "mp_rank_01" / "model_optim_rng.pt"
    state = torch.load(f, weights_only=False)
    m = state["model"]
    m["decoder.layers.1.self_attention.linear_proj.weight"][3, 5] = 1e6  # o_proj columns
    m["decoder.layers.1.self_attention.linear_qkv.weight"][2, 7] = -1e6
    m["decoder.layers.1.mlp.linear_fc2.weight"][0, 0] = 1e5  # down_proj columns
    m["decoder.layers.1.mlp.linear_fc2.weight"][1, 1] = float("-inf")  # not the cast's
    m["embedding.word_embeddings.weight"][0, 0] = 7e4  # rows
    torch.save(state, f)
    ref = megatron_root / "llama" / "reference"
    r16 = cli("merge", src, "-o", tmp_path / "o16", "--hf-config", ref, "--dtype", "fp16")
    r32 = cli("merge", src, "-o", tmp_path / "o32", "--hf-config", ref)
    assert r16.returncode == 0 and r32.returncode == 0, r16.stderr + r32.stderr
    a = load_file(tmp_path / "o16" / "model.safetensors")
    b = load_file(tmp_path / "o32" / "model.safetensors")
    for name, x in b.items():
        assert torch.equal(a[name].view(torch.int16), x.half().view(torch.int16)), name
    want = {n: int(torch.isinf(a[n]).sum() - torch.isinf(x).sum()) for n, x in b.items()}
    want = {n: k for n, k in want.items() if k}
    assert set(want) == {"model.embed_tokens.weight", "model.layers.1.mlp.down_proj.weight",
                         "model.layers.1.self_attn.o_proj.weight",
                         "model.layers.1.self_attn.q_proj.weight"}
    from shardscope.core.execute import overflow_warning

    assert [w for w in r16.stderr.splitlines() if "±Inf" in w] == [
        f"warning: {overflow_warning(want, 'fp16')}"], r16.stderr


@pytest.mark.asyncio
async def test_the_app_shows_the_overflow_warning(fixtures_root, tmp_path):
    """The app's merge run lists the result's warnings: the cast's overflow line is one."""
    from textual.widgets import Select

    from conftest import inspector_ready, wait_for
    from test_app import open_form, run_to_end
    from shardscope.tui.app import make_app

    src, _ = _edited_reference(fixtures_root, tmp_path)
    app = make_app(str(src))
    async with app.run_test(size=(160, 40)) as pilot:
        await inspector_ready(pilot, app)
        form = await open_form(pilot, app, tmp_path / "out")
        form.query_one("#dtype", Select).value = "fp16"
        run = await run_to_end(pilot, app)
        await wait_for(pilot, lambda: "verified" in str(run.query_one("#result").render()))
        result = str(run.query_one("#result").render())
    assert ("warning: --dtype fp16: 4 finite values out of fp16's range became ±Inf (as "
            "torch's .to() makes them) in 2 tensors: model.embed_tokens.weight (2), "
            "model.norm.weight (2)") in " ".join(result.split()), result
