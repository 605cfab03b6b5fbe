"""The model card says what a LoRA fold changed (issue 16, item 9), on real peft checkpoints."""

from __future__ import annotations

import pytest

from shardscope.core import MergeOptions, detect, plan_merge


def card(path, tmp_path, **opts) -> str:
    plan = plan_merge(detect(str(path)), MergeOptions(output=str(tmp_path / "o"), **opts))
    return plan.generated["README.md"].decode(), plan


def test_card_after_a_fold_names_the_folded_weights(fixtures_root, tmp_path):
    text, plan = card(fixtures_root / "w2-lora-qv", tmp_path, lora="fold")
    folded = [t.name for f in plan.files for t in f.tensors if t.fold is not None]
    assert len(folded) == 4
    assert "Every tensor was copied bit for bit" not in text
    assert "The LoRA adapter `default` (r=8, alpha=16) was folded into 4 weight(s): " \
           "W + (B @ A) * 2," in text
    assert all(f"`{n}`" in text for n in folded)
    assert "The other tensors were copied bit for bit" in text


def test_card_with_lora_alpha_given_and_rslora(fixtures_root, tmp_path):
    text, _ = card(fixtures_root / "w2-lora-qv", tmp_path, lora="fold", lora_alpha=4)
    assert "alpha=4) was folded" in text and "* 0.5," in text
    text, plan = card(fixtures_root / "w3-lora-rslora-bf16", tmp_path, lora="fold")
    _, adapter = __import__("shardscope.core.plan",
                            fromlist=["lora_choice"]).lora_choice(plan.layout,
                                                                             plan.options)
    assert ", rsLoRA) was folded" in text and f"* {adapter.scale:g}," in text


@pytest.mark.parametrize("mode,words", [
    ("base", "The LoRA adapter was dropped: these are the base weights alone."),
    ("adapter", "the LoRA adapter is not folded in: it is written as a PEFT folder"),
    ("both", "The adapter is also written, unfolded, as a PEFT folder in lora_adapter/."),
])
def test_card_for_the_other_lora_modes(fixtures_root, tmp_path, mode, words):
    text, _ = card(fixtures_root / "w2-lora-qv", tmp_path, lora=mode)
    assert words in text


def test_card_without_lora_unchanged(fixtures_root, tmp_path):
    text, _ = card(fixtures_root / "w2-qwen2-f32", tmp_path)
    assert "\nEvery tensor was copied bit for bit from the shards.\n" in text
    # then the architecture check's verdict, nothing about LoRA
    assert text.rstrip().endswith("Architecture check: matches Qwen2ForCausalLM: 27/27 tensors.")
    assert "LoRA adapter" not in text


def test_card_row_shows_the_alpha_given_on_the_command_line(fixtures_root, tmp_path):
    """The LoRA row of the card describes the adapter as folded (--lora-alpha applied), not
    the alpha first recorded."""
    text, _ = card(fixtures_root / "w2-lora-qv", tmp_path, lora="fold", lora_alpha=4)
    assert "| LoRA | fold (default: r=8, alpha=4 on q_proj r=8 scale=0.5, v_proj r=8 " \
           "scale=0.5 (" in text
    assert "alpha=16" not in text and "scale=2" not in text


def test_card_names_each_module_s_rank_and_scale(lora_root, tmp_path):
    """rank_pattern/alpha_pattern (peft): the card gives each module group's own rank and
    scale (the values test_lora_peft checks against peft's own modules), never one scale for
    all; with the adapter's config passed by --lora-config, the row shows its alpha_pattern."""
    import shutil

    from conftest import copy_checkpoint

    groups = ("k_proj r=2 scale=8, o_proj r=8 scale=2, o_proj r=12 scale=1.33333, q_proj r=8 "
              "scale=2, up_proj r=8 scale=0.625, v_proj r=8 scale=3")
    text, _ = card(lora_root / "w2-lora-patterns", tmp_path, lora="fold")
    assert f"W + (B @ A) * scale, each module with its own rank and scale ({groups})," in text
    assert "W + (B @ A) * 2," not in text
    ck = copy_checkpoint(lora_root / "w2-lora-patterns", tmp_path / "ck")
    shutil.move(ck / "lora_adapter", tmp_path / "cfg")
    text, _ = card(ck, tmp_path, lora="fold", lora_config=str(tmp_path / "cfg"))
    assert f"on {groups} (" in text and f"own rank and scale ({groups})," in text


def test_card_of_a_dora_fold_says_so(lora_root, tmp_path):
    text, _ = card(lora_root / "w3-lora-dora-bf16", tmp_path, lora="fold")
    assert "W + (B @ A) * 2, then DoRA's magnitude vector over the column norms" in text
