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
