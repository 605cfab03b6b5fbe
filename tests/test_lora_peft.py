"""LoRA as peft trains it (issue 19): per-module rank and alpha (rank_pattern, alpha_pattern),
rsLoRA, DoRA, embedding LoRA, LoRA on fused expert parameters, adapter-only checkpoints. Real
peft models sharded by FSDP2 on gloo (2 and 3 ranks, :mod:`core.sample_lora`); folds compared
bit for bit with peft's ``merge_and_unload``, exported adapters by outputs after loading in
peft. One is a DCP save (torch.distributed.checkpoint) instead of verl's rank files."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import warnings

import pytest
import torch
from safetensors.torch import load_file

from conftest import ROOT, copy_checkpoint, run_cli
from shardscope.core import MergeOptions, UsageError, detect, plan_merge, run_merge
from test_lora import exact

FOLDED = ["w2-lora-patterns", "w2-lora-dcp-patterns", "w2-lora-embed",
          "w3-lora-rslora-patterns-bf16", "w3-lora-dora-bf16", "w3-lora-embed-bf16-tied"]


def merge(src, out, **kw):
    return run_merge(plan_merge(detect(src), MergeOptions(output=str(out), **kw)))


def cli(*args):
    return run_cli(*args, cwd=ROOT)  # in this process (conftest.run_cli)


def test_pattern_keys_match_as_peft_matches_them():
    from peft.utils.other import get_pattern_key

    from shardscope.core.lora import _pattern_key

    patterns = ["k_proj", "layers.1.self_attn.o_proj", r"layers\.[02]\..*v_proj", "proj"]
    for module in ["model.layers.0.self_attn.k_proj", "model.layers.1.self_attn.o_proj",
                   "model.layers.0.self_attn.o_proj", "model.layers.2.self_attn.v_proj",
                   "model.layers.1.self_attn.v_proj", "model.embed_tokens",
                   "model.layers.3.mlp.up_proj"]:
        assert _pattern_key(patterns, module) == get_pattern_key(patterns, module), module


def test_each_module_has_peft_s_rank_and_scale(lora_root):
    """Rank and scale of every module equal those of the peft model rebuilt from its own
    adapter folder (peft's ``r`` and ``scaling`` per layer)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    for name in ("w2-lora-patterns", "w2-lora-dcp-patterns", "w3-lora-rslora-patterns-bf16"):
        a = detect(lora_root / name).lora.adapters["default"]
        assert a.alpha_source == "lora_adapter/adapter_config.json"
        peft_model = PeftModel.from_pretrained(
            AutoModelForCausalLM.from_pretrained(lora_root / f"{name}.reference"),
            lora_root / f"{name}.adapter")
        seen = 0
        for mod_name, mod in peft_model.base_model.model.named_modules():
            if hasattr(mod, "scaling") and "default" in getattr(mod, "r", {}):
                assert a.ranks[mod_name] == mod.r["default"], mod_name
                assert a.scale_for(mod_name) == mod.scaling["default"], mod_name
                seen += 1
        assert seen == len(a.modules) and len({*a.ranks.values()}) > 1
    summary = detect(lora_root / "w2-lora-patterns").lora.summary()
    assert "k_proj r=2 scale=8, o_proj r=8 scale=2, o_proj r=12 scale=1.33333" in summary
    assert "up_proj r=8 scale=0.625, v_proj r=8 scale=3" in summary


@pytest.mark.parametrize("name", FOLDED)
def test_fold_is_peft_merge_and_unload(lora_root, tmp_path, name):
    # a DCP save holds no config: the reference's, so that the names are checked
    cfg = {} if detect(lora_root / name).config_dir else {
        "hf_config": str(lora_root / f"{name}.reference")}
    merge(lora_root / name, tmp_path / "o", lora="fold", **cfg)
    exact(load_file(tmp_path / "o" / "model.safetensors"),
          load_file(lora_root / f"{name}.fold" / "model.safetensors"))


def test_adapter_config_wins_over_run_metadata_and_a_disagreement_is_reported(lora_root,
                                                                             tmp_path):
    ck = copy_checkpoint(lora_root / "w2-lora-patterns", tmp_path / "ck")
    (ck / "lora_train_meta.json").write_text(json.dumps({"r": 8, "lora_alpha": 7}))
    layout = detect(ck)
    assert [(p.code, p.severity) for p in layout.problems if p.code.startswith("lora")] == [
        ("lora-meta-mismatch", "warning")]
    assert "lora_alpha=7" in layout.problems[-1].message
    merge(ck, tmp_path / "o", lora="fold")
    exact(load_file(tmp_path / "o" / "model.safetensors"),
          load_file(lora_root / "w2-lora-patterns.fold" / "model.safetensors"))


def test_run_metadata_alone_cannot_give_per_module_alpha(lora_root, tmp_path):
    """verl's lora_train_meta.json records one r and alpha: with other ranks in the adapter,
    the per-module alphas are unknown, so the merge asks for the adapter config."""
    ck = copy_checkpoint(lora_root / "w2-lora-patterns", tmp_path / "ck")
    shutil.rmtree(ck / "lora_adapter")
    r = cli("merge", ck, "-o", tmp_path / "a", "--lora", "fold")
    assert r.returncode == 2 and "rank_pattern" in r.stderr and "--lora-config" in r.stderr
    assert not (tmp_path / "a").exists()
    r = cli("merge", ck, "-o", tmp_path / "b", "--lora", "fold", "--lora-config",
            lora_root / "w2-lora-patterns.adapter")
    assert r.returncode == 0, r.stderr
    exact(load_file(tmp_path / "b" / "model.safetensors"),
          load_file(lora_root / "w2-lora-patterns.fold" / "model.safetensors"))
    r = cli("merge", ck, "-o", tmp_path / "c", "--lora", "fold", "--lora-config", tmp_path)
    assert r.returncode == 2 and "adapter_config.json" in r.stderr


def _logits(model, ids):
    with torch.no_grad():
        return model.eval()(ids).logits


@pytest.mark.parametrize("name", ["w2-lora-patterns", "w2-lora-embed",
                                  "w3-lora-rslora-patterns-bf16", "w3-lora-dora-bf16",
                                  "w3-lora-embed-bf16-tied"])
def test_exported_adapter_loads_in_peft_with_the_trained_outputs(lora_root, tmp_path, name):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out = tmp_path / "o"
    merge(lora_root / name, out, lora="adapter")
    ref = lora_root / f"{name}.adapter"
    exact(load_file(out / "lora_adapter" / "adapter_model.safetensors"),
          load_file(ref / "adapter_model.safetensors"))
    exact(load_file(out / "model.safetensors"),
          load_file(lora_root / f"{name}.reference" / "model.safetensors"))
    got_cfg = json.loads((out / "lora_adapter" / "adapter_config.json").read_text())
    want_cfg = json.loads((ref / "adapter_config.json").read_text())
    for k in ("r", "lora_alpha", "use_rslora", "use_dora", "rank_pattern", "alpha_pattern"):
        assert got_cfg[k] == want_cfg[k], k
    ids = torch.tensor([[1, 5, 9, 42, 7, 3, 250]])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(out),
                                        out / "lora_adapter")
    assert not [w for w in caught if any(s in str(w.message).lower() for s in
                                         ("missing", "unexpected", "mismatch", "not found"))]
    want = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(lora_root / f"{name}.reference"), ref)
    got_logits = _logits(got, ids)
    assert torch.equal(got_logits, _logits(want, ids))
    if "tied" in name:
        return  # folding an embedding LoRA also changes the tied lm_head: peft's fold differs
    folded = _logits(AutoModelForCausalLM.from_pretrained(lora_root / f"{name}.fold"), ids)
    tol = 5e-2 if "bf16" in name else 1e-4
    torch.testing.assert_close(got_logits, folded, atol=tol, rtol=tol)


def test_exported_adapter_without_a_config_carries_each_module_s_rank(lora_root, tmp_path):
    """Without the adapter's config (alpha given by hand), every module whose rank differs from
    r gets an exact rank_pattern entry, so peft rebuilds each module at its trained rank and
    the adapter gives what the fold with the same alpha gives."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    ck = copy_checkpoint(lora_root / "w2-lora-patterns", tmp_path / "ck")
    shutil.rmtree(ck / "lora_adapter")
    merge(ck, tmp_path / "ad", lora="adapter", lora_alpha=16)
    merge(ck, tmp_path / "fold", lora="fold", lora_alpha=16)
    cfg = json.loads((tmp_path / "ad" / "lora_adapter" / "adapter_config.json").read_text())
    assert cfg["alpha_pattern"] == {} and len(cfg["rank_pattern"]) == 4  # 3 k_proj, 1 o_proj
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tmp_path / "ad"),
                                        tmp_path / "ad" / "lora_adapter")
    assert not [w for w in caught if "missing" in str(w.message).lower()
                or "unexpected" in str(w.message).lower()]
    ids = torch.tensor([[1, 5, 9, 42, 7, 3, 250]])
    torch.testing.assert_close(
        _logits(got, ids),
        _logits(AutoModelForCausalLM.from_pretrained(tmp_path / "fold"), ids),
        atol=1e-4, rtol=1e-4)


def test_adapter_only_checkpoint_needs_the_base_model(lora_root, tmp_path):
    ck, base = lora_root / "w2-lora-only", lora_root / "w2-lora-only.reference"
    layout = detect(ck)
    assert layout.lora.lora_only
    assert "lora-adapter-only" in {p.code for p in layout.problems}
    for mode in ("fold", "adapter", "both", "base"):
        r = cli("merge", ck, "-o", tmp_path / mode, "--lora", mode)
        assert r.returncode == 2 and "--base-model" in r.stderr and "base weights" in r.stderr
        assert not (tmp_path / mode).exists()
    r = cli("merge", ck, "-o", tmp_path / "f", "--lora", "fold", "--base-model", base)
    assert r.returncode == 0, r.stderr
    exact(load_file(tmp_path / "f" / "model.safetensors"),
          load_file(lora_root / "w2-lora-only.fold" / "model.safetensors"))
    merge(ck, tmp_path / "a", lora="adapter", base_model=str(base))
    exact(load_file(tmp_path / "a" / "model.safetensors"), load_file(base / "model.safetensors"))
    exact(load_file(tmp_path / "a" / "lora_adapter" / "adapter_model.safetensors"),
          load_file(lora_root / "w2-lora-only.adapter" / "adapter_model.safetensors"))
    with pytest.raises(UsageError, match="holds its own base weights"):
        plan_merge(detect(lora_root / "w2-lora-embed"),
                   MergeOptions(str(tmp_path / "x"), lora="fold", base_model=str(base)))


def test_adapter_only_refuses_a_base_model_of_other_shapes(lora_root, tmp_path):
    """A base model whose weights do not fit the adapter is refused: by its config (another
    model than the checkpoint's huggingface/config.json: exit 2 naming the fields, even with
    --no-strict), and a base whose config was made to agree by that config's check against its
    own weights (exit 3)."""
    other = lora_root / "w2-lora-embed.reference"
    for extra in ((), ("--no-strict",)):
        r = cli("merge", lora_root / "w2-lora-only", "-o", tmp_path / "o", "--lora", "fold",
                "--base-model", other, *extra)
        assert r.returncode == 2 and "another model than the one this adapter was trained on" \
            in r.stderr and "hidden_size 32, not 40" in r.stderr, r.stderr
        assert not (tmp_path / "o").exists()
    base = shutil.copytree(other, tmp_path / "base")
    shutil.copy(lora_root / "w2-lora-only" / "huggingface" / "config.json", base)
    args = ("merge", lora_root / "w2-lora-only", "-o", tmp_path / "o", "--lora", "fold",
            "--base-model", base)
    for extra in ((), ("--no-strict",)):  # the base's own config against its weights
        r = cli(*args, *extra)
        assert r.returncode == 3 and "config.json says hidden_size 40" in r.stderr, r.stderr
        assert "Traceback" not in r.stderr and not (tmp_path / "o").exists()


def test_lora_on_expert_parameters_is_refused_by_name_and_base_strips_every_wrapper(
        lora_root, tmp_path):
    ck = lora_root / "w2-lora-moe-params"
    lora = detect(ck).lora
    assert lora.unsupported == ["LoRA on parameters (peft target_parameters: "
                                "mlp.experts.down_proj, mlp.experts.gate_up_proj)"]
    for mode in ("fold", "adapter", "both"):
        r = cli("merge", ck, "-o", tmp_path / mode, "--lora", mode)
        assert r.returncode == 3 and "LoRA on parameters" in r.stderr, r.stderr
        assert "gate_up_proj" in r.stderr and not (tmp_path / mode).exists()
    merge(ck, tmp_path / "b", lora="base")
    got = load_file(tmp_path / "b" / "model.safetensors")
    assert not [n for n in got if "base_layer" in n or "lora" in n]
    # the fused in-memory names, or the per-expert names save_pretrained writes (when a
    # conversion of fused experts runs): either way the untouched base, bit for bit
    memory = load_file(lora_root / "w2-lora-moe-params.memory" / "model.safetensors")
    saved = load_file(lora_root / "w2-lora-moe-params.reference" / "model.safetensors")
    exact(got, memory if set(got) == set(memory) else saved)


@pytest.mark.asyncio
async def test_merge_form_takes_the_base_model_of_an_adapter_only_checkpoint(lora_root,
                                                                             tmp_path):
    from test_app import open_form, open_inspector, refused, run_to_end
    from shardscope.tui.app import make_app

    app = make_app(str(lora_root / "w2-lora-only"))
    async with app.run_test(size=(120, 50)) as pilot:
        await open_inspector(pilot, app)
        form = await open_form(pilot, app, tmp_path / "out")
        await refused(pilot, form, "#base-model", "", "the base model folder field")
        form.query_one("#base-model").value = str(lora_root / "w2-lora-only.reference")
        await run_to_end(pilot, app)
    exact(load_file(tmp_path / "out" / "model.safetensors"),
          load_file(lora_root / "w2-lora-only.fold" / "model.safetensors"))


def test_trainable_tokens_are_refused_by_name_and_base_keeps_the_embedding(lora_root, tmp_path):
    ck = lora_root / "w3-lora-tokens"
    assert detect(ck).lora.unsupported == ["trainable tokens (peft trainable_token_indices)"]
    r = cli("merge", ck, "-o", tmp_path / "f", "--lora", "fold")
    assert r.returncode == 3 and "trainable tokens" in r.stderr
    merge(ck, tmp_path / "b", lora="base")
    exact(load_file(tmp_path / "b" / "model.safetensors"),
          load_file(lora_root / "w3-lora-tokens.reference" / "model.safetensors"))


def test_inspect_of_patterns_stays_free_of_torch(lora_root):
    """Per-module ranks and scales come from metadata alone: no torch, transformers or peft."""
    code = ("import sys, json; from shardscope.core import detect; "
            f"l = detect({str(lora_root / 'w2-lora-patterns')!r}); "
            "d = l.to_dict()['lora']['adapters']['default']; print(l.lora.summary()); "
            "print(json.dumps(d['groups'])); "
            "print(sorted(m for m in ('torch', 'transformers', 'peft') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    summary, groups, imported = r.stdout.splitlines()
    assert imported == "[]" and "v_proj r=8 scale=3" in summary
    assert {"module": "k_proj", "r": 2, "scale": 8.0, "count": 3} in json.loads(groups)


def test_inspect_shows_no_invented_scale_when_per_module_alpha_is_unknown(lora_root, tmp_path):
    """Run metadata alone (one r and alpha) beside modules of other ranks: inspect gives each
    group's rank but no scale (peft's would differ: v_proj has alpha 24 by alpha_pattern),
    and warns why, naming what a fold needs; with the adapter's config the scales are peft's."""
    ck = copy_checkpoint(lora_root / "w2-lora-patterns", tmp_path / "ck")
    shutil.rmtree(ck / "lora_adapter")
    layout = detect(ck)
    summary = layout.lora.summary()
    assert "scale=" not in summary and "each module's alpha unknown" in summary
    assert "k_proj r=2, o_proj r=8, o_proj r=12, q_proj r=8, up_proj r=8, v_proj r=8" in summary
    warn = [p for p in layout.problems if p.code == "lora-alpha-unknown"]
    assert len(warn) == 1 and warn[0].severity == "warning" and "--lora-config" in warn[0].message
    assert not layout.errors
    r = cli("inspect", ck, "--json")
    d = json.loads(r.stdout)
    assert all(g["scale"] is None for g in d["lora"]["adapters"]["default"]["groups"])
    assert "lora-alpha-unknown" in {p["code"] for p in d["problems"]}
    assert "v_proj r=8 scale=3" in detect(lora_root / "w2-lora-patterns").lora.summary()


@pytest.mark.asyncio
async def test_merge_form_asks_for_alpha_when_the_run_metadata_cannot_give_it(lora_root,
                                                                               tmp_path):
    """Run metadata alone beside other ranks: the form's alpha field is empty (not the
    doubtful recorded value), the form refuses naming the adapter config; the adapter's
    config typed in its field gives peft's fold, bit for bit."""
    from conftest import wait_for
    from test_app import open_inspector, refused, run_to_end
    from shardscope.tui.app import make_app
    from shardscope.tui.screens.merge_options import MergeOptionsScreen

    ck = copy_checkpoint(lora_root / "w2-lora-patterns", tmp_path / "ck")
    shutil.rmtree(ck / "lora_adapter")
    app = make_app(str(ck))
    async with app.run_test(size=(120, 50)) as pilot:
        await open_inspector(pilot, app)
        await pilot.press("m")
        await wait_for(pilot, lambda: isinstance(app.screen, MergeOptionsScreen)
                       and bool(app.screen.query("#lora-config")), tries=400)
        await pilot.pause(0.3)  # the form's Selects mounted
        form = app.screen
        form.query_one("#output").value = str(tmp_path / "out")
        form.query_one("#lora-mode").value = "fold"
        assert form.query_one("#lora-alpha").value == ""
        await refused(pilot, form, "#lora-config", "", "adapter_config.json")
        form.query_one("#lora-config").value = str(lora_root / "w2-lora-patterns.adapter")
        await run_to_end(pilot, app)
    exact(load_file(tmp_path / "out" / "model.safetensors"),
          load_file(lora_root / "w2-lora-patterns.fold" / "model.safetensors"))


def test_lora_alpha_overrides_lora_alpha_and_says_alpha_pattern_is_kept(lora_root, tmp_path):
    """``--lora-alpha A`` is peft's ``lora_alpha``, the default alpha: the modules named by
    the adapter config's alpha_pattern keep their own alpha, as peft keeps them when only
    lora_alpha changes (its merge_and_unload of the adapter folder with lora_alpha 8 is the
    fold, bit for bit), and the warning says so, naming them (trial report A4: it said only
    that lora_alpha was overridden). The exported adapter records the same."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    r = cli("merge", lora_root / "w2-lora-patterns", "-o", tmp_path / "o", "--lora", "both",
            "--lora-alpha", "8")
    assert r.returncode == 0, r.stderr
    assert r.stderr.splitlines()[0] == (
        "warning: --lora-alpha 8 overrides the lora_alpha 16 the checkpoint records "
        "(lora_adapter/adapter_config.json), not its alpha_pattern: 6 modules keep their own "
        "alpha (up_proj 5 on 3 modules, v_proj 24 on 3 modules); another alpha_pattern takes "
        "an adapter_config.json given by --lora-config FILE")
    adapter = tmp_path / "peft8"
    shutil.copytree(lora_root / "w2-lora-patterns.adapter", adapter)
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    cfg["lora_alpha"] = 8
    (adapter / "adapter_config.json").write_text(json.dumps(cfg))
    want = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(
        lora_root / "w2-lora-patterns.reference"), adapter).merge_and_unload().state_dict()
    got = load_file(tmp_path / "o" / "model.safetensors")
    exact(got, {k: v for k, v in want.items() if k in got})
    written = json.loads((tmp_path / "o" / "lora_adapter" / "adapter_config.json").read_text())
    assert written["lora_alpha"] == 8 and written["alpha_pattern"] == {"up_proj": 5, "v_proj": 24}
    # the same alpha as recorded: nothing overridden, nothing said
    r = cli("merge", lora_root / "w2-lora-patterns", "-o", tmp_path / "p", "--lora", "fold",
            "--lora-alpha", "16")
    assert r.returncode == 0 and "--lora-alpha" not in r.stderr, r.stderr
