"""The judge (core/judge.py): every merge is checked against the config's model class, built
by transformers on the meta device in the form save_pretrained writes. Real checkpoints only:
FSDP2 critic/reward/T5 fixtures (core/sample_heads.py) and DCP saves of real models with a
tensor dropped or added (torch.distributed.checkpoint, no process group)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import ROOT, run_cli
from shardscope.core import BadCheckpointError, MergeOptions, detect, plan_merge, run_merge
from shardscope.core.judge import Expected, check, check_layout, compare as judge_compare
from shardscope.core.verify import compare
from test_merge_exact import assert_bit_equal, load


def merge(src, out, **kw):
    plan = plan_merge(detect(src), MergeOptions(output=str(out), workers=2, **kw))
    run_merge(plan)
    return plan


# -- heads other than a language-model head ----------------------------------------------------

@pytest.mark.parametrize("kind,arch", [("critic", "Qwen2ForTokenClassification"),
                                       ("reward", "LlamaForSequenceClassification"),
                                       ("t5", "T5ForConditionalGeneration")])
def test_heads_merge_bit_exact_through_the_gate(heads_root, tmp_path, kind, arch):
    layout = detect(heads_root / kind)
    assert not layout.errors, layout.errors  # the critic is no longer "untied, no lm_head"
    plan = merge(heads_root / kind, tmp_path / "out")
    assert plan.check.ok and plan.check.architecture == arch, plan.check.summary()
    assert_bit_equal(load(tmp_path / "out"), load(heads_root / f"{kind}.reference"))
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    if kind == "t5":  # its config.json names no class: the auto class for model_type t5
        assert "architectures" not in cfg and "model_type 't5'" in plan.check.note
    else:
        assert cfg["architectures"] == [arch]


def test_critic_config_names_the_class_of_its_weights(heads_root, tmp_path):
    """verl's critic keeps the actor's Qwen2ForCausalLM in config.json; the merged folder
    names Qwen2ForTokenClassification, so from_pretrained builds the score head it holds and
    gives the reference's values."""
    from transformers import AutoModelForTokenClassification

    src_cfg = json.loads((heads_root / "critic" / "huggingface" / "config.json").read_text())
    assert src_cfg["architectures"] == ["Qwen2ForCausalLM"]
    plan = merge(heads_root / "critic", tmp_path / "out")
    assert plan.check.named == "Qwen2ForCausalLM"
    assert any("architectures [Qwen2ForTokenClassification]" in w for w in plan.warnings)
    ids = torch.tensor([[1, 5, 9, 42, 7, 2]])
    got = AutoModelForTokenClassification.from_pretrained(tmp_path / "out").eval()
    want = AutoModelForTokenClassification.from_pretrained(
        heads_root / "critic.reference").eval()
    with torch.no_grad():
        assert torch.equal(got(ids).logits, want(ids).logits)


def test_verify_reference_treats_tied_aliases_as_one_tensor(heads_root, fixtures_root,
                                                            tmp_path):
    # FSDP2 keeps T5's one embedding under shared, encoder/decoder.embed_tokens and lm_head;
    # save_pretrained wrote shared alone: the same model, no difference
    assert {"shared.weight", "encoder.embed_tokens.weight", "decoder.embed_tokens.weight",
            "lm_head.weight"} <= set(detect(heads_root / "t5").tensors)
    assert compare(str(heads_root / "t5"), str(heads_root / "t5.reference")) == []
    assert compare(str(fixtures_root / "w2-qwen2-bf16-tied"),
                   str(fixtures_root / "w2-qwen2-bf16-tied.reference")) == []
    # an alias is compared as the tensor it is tied to: an lm_head that is not the
    # embedding is a difference, not a silently dropped name
    ref = fixtures_root / "w2-qwen2-bf16-tied.reference"

    def untie(sd):
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"] + 1

    diffs = compare(str(_dcp_of(ref, tmp_path / "ckpt", untie)), str(ref))
    assert [(d.name, d.kind) for d in diffs] == [("lm_head.weight", "values")]


# -- the gate refuses what does not fit -------------------------------------------------------

def _dcp_of(reference: Path, out: Path, edit) -> Path:
    """A real DCP checkpoint (torch.distributed.checkpoint.save, no process group) of the
    reference model's state dict after ``edit(state_dict)``."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file

    sd = load_file(str(reference / "model.safetensors"))
    edit(sd)
    dcp.save(sd, checkpoint_id=str(out))
    return out


def test_gate_refuses_a_missing_tensor_and_no_strict_writes_it(fixtures_root, tmp_path):
    ref = fixtures_root / "w2-qwen2-f32.reference"
    src = _dcp_of(ref, tmp_path / "ckpt", lambda sd: sd.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(BadCheckpointError, match=r"Qwen2ForCausalLM.*1 missing "
                       r"\(model.layers.1.mlp.up_proj.weight\).*--no-strict") as e:
        merge(src, tmp_path / "out", hf_config=str(ref))
    assert e.value.exit_code == 3
    assert not (tmp_path / "out").exists()
    plan = merge(src, tmp_path / "out", hf_config=str(ref), strict=False)
    assert any("--no-strict" in w and "1 missing" in w for w in plan.warnings)
    card = (tmp_path / "out" / "README.md").read_text()
    assert "## Written with --no-strict" in card
    assert "- `model.layers.1.mlp.up_proj.weight`" in card.split("Missing")[1]
    got, want = load(tmp_path / "out"), load(ref)
    assert set(want) - set(got) == {"model.layers.1.mlp.up_proj.weight"}


def test_gate_refuses_an_extra_tensor(fixtures_root, tmp_path):
    ref = fixtures_root / "w2-qwen2-f32.reference"

    def add(sd):
        sd["model.layers.0.mlp.gate_proj.scale"] = torch.ones(3)

    src = _dcp_of(ref, tmp_path / "ckpt", add)
    with pytest.raises(BadCheckpointError, match=r"1 extra \(model.layers.0.mlp.gate_proj."
                       r"scale\)"):
        merge(src, tmp_path / "out", hf_config=str(ref))


def test_gate_refuses_a_wrong_shape(fixtures_root, tmp_path):
    """A config whose intermediate_size is not the one the weights were trained with."""
    ref = fixtures_root / "w2-qwen2-f32.reference"
    cfg_dir = tmp_path / "cfg"
    shutil.copytree(ref, cfg_dir, ignore=shutil.ignore_patterns("*.safetensors"))
    cfg = json.loads((cfg_dir / "config.json").read_text())
    cfg["intermediate_size"] += 8
    (cfg_dir / "config.json").write_text(json.dumps(cfg))
    src = _dcp_of(ref, tmp_path / "ckpt", lambda sd: None)
    with pytest.raises(BadCheckpointError, match=r"6 of another shape \(model.layers.0.mlp."
                       r"down_proj.weight \[64, 176\] not \[64, 184\]"):
        merge(src, tmp_path / "out", hf_config=str(cfg_dir))
    merge(src, tmp_path / "ok", hf_config=str(ref))  # the right config passes
    assert_bit_equal(load(tmp_path / "ok"), load(ref))


def test_dtype_kind_and_aliases_in_compare():
    exp = Expected("M", {"a": ((2, 3), "float"), "b": ((4,), "int"), "emb": ((5, 2), "float")},
                   {"head": "emb"})
    v = judge_compare({"a": ((2, 3), "BF16"), "b": ((4,), "F32"), "emb": ((5, 2), "F16"),
                       "head": ((5, 2), "F16")}, exp)
    assert v.dtype == [("b", "F32", "int")] and v.matched == 2 and not v.extra
    assert v.aliases == {"head": "emb"} and v.mismatched
    v = judge_compare({"a": ((2, 3), "F32"), "b": ((4,), "I64"), "head": ((5, 2), "F32")}, exp)
    assert v.missing == ["emb"] and v.extra == ["head"]  # an alias without its tensor is extra


def test_no_config_is_refused_unless_not_strict(fixtures_root, tmp_path):
    """Without a config nothing vouches for the names: strict refuses saying why, --no-strict
    writes the stored names and says that they are unchecked."""
    with pytest.raises(BadCheckpointError) as e:
        plan_merge(detect(fixtures_root / "w2-dcp"), MergeOptions(str(tmp_path / "o")))
    assert "architecture check skipped: no config.json" in e.value.message
    assert "--hf-config" in e.value.message and "--no-strict" in e.value.message
    plan = plan_merge(detect(fixtures_root / "w2-dcp"),
                      MergeOptions(str(tmp_path / "o"), strict=False))
    assert plan.check.skipped and "--hf-config" in plan.check.skipped
    assert "architecture check skipped" in plan.check.summary()
    assert any("in-memory" in w and "skipped" in w for w in plan.warnings)
    card = plan.generated["README.md"].decode()
    assert "names unchecked" in card and card.endswith(".\n") and not card.endswith("\n\n")


def test_vlm_dcp_without_config_is_not_written_under_in_memory_names(models_root, tmp_path):
    """A DCP save of Qwen2.5-VL holds ``model.language_model.*`` (its names in memory;
    save_pretrained writes ``model.*``): without a config the merge refuses (exit 3) instead
    of writing them with exit 0; with the config it writes save_pretrained's names."""
    src = models_root / "qwen2_5_vl.dcp"
    assert any(n.startswith("model.language_model.") for n in detect(src).tensors)
    r = run_cli("merge", str(src), "-o", str(tmp_path / "a"), "-q", cwd=ROOT)
    assert r.returncode == 3 and not (tmp_path / "a").exists(), r.stderr
    assert r.stderr.count("\n") == 1 and "no config.json" in r.stderr and "--no-strict" in r.stderr
    r = run_cli("merge", str(src), "-o", str(tmp_path / "b"), "--no-strict", cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert "in-memory" in r.stderr and "names unchecked" in (tmp_path / "b" / "README.md").read_text()
    merge(src, tmp_path / "c", hf_config=str(models_root / "qwen2_5_vl" / "huggingface"))
    assert_bit_equal(load(tmp_path / "c"), load(models_root / "qwen2_5_vl.reference"))


# -- remote code -------------------------------------------------------------------------------

REMOTE_CODE = '''
import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel


class TinyRemoteConfig(PretrainedConfig):
    model_type = "tiny_remote_gate"

    def __init__(self, width=12, depth=2, **kw):
        self.width, self.depth = width, depth
        super().__init__(**kw)


class TinyRemoteForCausalLM(PreTrainedModel):
    config_class = TinyRemoteConfig

    def __init__(self, config):
        super().__init__(config)
        self.blocks = nn.ModuleList(nn.Linear(config.width, config.width)
                                    for _ in range(config.depth))
        self.post_init()

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x
'''


@pytest.fixture(scope="module")
def remote_folder(tmp_path_factory) -> Path:
    """A Hugging Face folder of a model transformers does not ship: save_pretrained of a
    custom class registered for the auto classes copies its code and writes auto_map."""
    root = tmp_path_factory.mktemp("remote")
    (root / "tiny_remote_gate.py").write_text(REMOTE_CODE)
    sys.path.insert(0, str(root))
    try:
        import tiny_remote_gate as mod

        mod.TinyRemoteConfig.register_for_auto_class()
        mod.TinyRemoteForCausalLM.register_for_auto_class("AutoModelForCausalLM")
        torch.manual_seed(0)
        mod.TinyRemoteForCausalLM(mod.TinyRemoteConfig()).save_pretrained(root / "model")
    finally:
        sys.path.remove(str(root))
        sys.modules.pop("tiny_remote_gate", None)
    cfg = json.loads((root / "model" / "config.json").read_text())
    assert cfg["auto_map"]["AutoModelForCausalLM"].endswith("TinyRemoteForCausalLM")
    return root / "model"


def test_remote_code_is_checked_only_when_trusted(remote_folder, tmp_path):
    layout = detect(remote_folder)
    v = check_layout(layout)
    assert v.skipped and "TinyRemoteForCausalLM" in v.skipped and "--trust-remote-code" in \
        v.skipped
    v = check_layout(layout, trust_remote_code=True)
    assert v.ok and v.summary() == "matches TinyRemoteForCausalLM: 4/4 tensors"
    with pytest.raises(BadCheckpointError) as e:  # strict: nothing vouches for the names
        merge(remote_folder, tmp_path / "a")
    assert "TinyRemoteForCausalLM" in e.value.message and "--trust-remote-code" in \
        e.value.message and "--no-strict" in e.value.message
    plan = merge(remote_folder, tmp_path / "a", strict=False)
    assert any("skipped" in w and "--trust-remote-code" in w for w in plan.warnings)
    plan = merge(remote_folder, tmp_path / "b", trust_remote_code=True)
    assert plan.check.ok
    r = subprocess.run([sys.executable, "-m", "shardscope.tui.cli", "inspect", str(remote_folder),
                        "--check", "--json"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    check_obj = json.loads(r.stdout)["check"]
    assert check_obj["skipped"] and not json.loads(r.stdout)["problems"]  # a stated skip
    assert any("architecture check skipped" in n for n in json.loads(r.stdout)["notes"])


def test_remote_code_never_prompts(remote_folder, tmp_path):
    """transformers asks "Do you wish to run the custom code? [y/N]" when trust_remote_code is
    None: a merge or an inspect of a remote-code config must never ask (a CI job or an SSH
    session would hang); the check says it was skipped because the class is remote code."""
    folder = shutil.copytree(remote_folder, tmp_path / "model")
    cfg = json.loads((folder / "config.json").read_text())
    cfg.pop("tie_word_embeddings", None)  # the merge then asks transformers for the default
    (folder / "config.json").write_text(json.dumps(cfg))
    for args in (["merge", str(folder), "-o", str(tmp_path / "o"), "--no-strict"],
                 ["inspect", str(folder), "--check"]):
        r = subprocess.run([sys.executable, "-m", "shardscope.tui.cli", *args], cwd=ROOT,
                           capture_output=True, text=True, stdin=subprocess.PIPE, timeout=300)
        assert r.returncode == 0, r.stderr
        assert "[y/N]" not in r.stdout + r.stderr and "custom code" not in r.stdout + r.stderr
        assert "remote code" in " ".join((r.stdout + r.stderr).split())


def test_unknown_model_type_says_check_skipped(fixtures_root, tmp_path):
    """A config.json whose model_type transformers does not know: inspect --check warns
    "check skipped" with the reason (exit 0: the files are sound), a strict merge refuses
    (exit 3, nothing vouches for the names) and --no-strict writes with the same reason."""
    from conftest import copy_checkpoint

    ck = copy_checkpoint(fixtures_root / "w2-qwen2-f32", tmp_path / "ck")
    path = ck / "huggingface" / "config.json"
    cfg = json.loads(path.read_text())
    cfg["model_type"] = "qwen2_private_fork"
    path.write_text(json.dumps(cfg))
    why = "does not know model_type 'qwen2_private_fork'"

    def run(*args):
        return subprocess.run([sys.executable, "-m", "shardscope.tui.cli", *args], cwd=ROOT,
                              capture_output=True, text=True, stdin=subprocess.PIPE)

    r = run("inspect", str(ck), "--check")
    out = " ".join(r.stdout.split())
    assert r.returncode == 0 and "architecture check skipped" in out and why in out, r.stdout
    r = run("merge", str(ck), "-o", str(tmp_path / "a"))
    assert r.returncode == 3 and r.stderr.count("\n") == 1 and why in r.stderr, r.stderr
    assert "check skipped" in r.stderr and not (tmp_path / "a").exists()
    r = run("merge", str(ck), "-o", str(tmp_path / "b"), "--no-strict")
    assert r.returncode == 0 and why in r.stderr and "check skipped" in r.stderr, r.stderr
    assert why in (tmp_path / "b" / "README.md").read_text()


# -- inspect ------------------------------------------------------------------------------------

def test_inspect_check_json_and_exit_code(fixtures_root, heads_root):
    r = run_cli("inspect", str(fixtures_root / "w2-qwen2-bf16-tied"), "--check", "--json",
                cwd=ROOT)
    assert r.returncode == 0, r.stderr
    c = json.loads(r.stdout)["check"]
    assert c["ok"] and c["summary"] == "matches Qwen2ForCausalLM: 26/26 tensors"
    r = run_cli("inspect", str(fixtures_root / "w3-buffers"), "--check", cwd=ROOT)
    assert r.returncode == 3 and "architecture-mismatch" in r.stdout
    assert "3 extra (model.loss_scale, model.no_elements, model.step_count)" in \
        " ".join(r.stdout.split())


def test_plain_inspect_imports_neither_torch_nor_transformers(fixtures_root):
    code = ("import sys\nfrom shardscope.tui.cli import main\n"
            f"main(['inspect', {str(fixtures_root / 'w2-qwen2-f32')!r}, '--json'])\n"
            "print([m for m in ('torch', 'transformers') if m in sys.modules])")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "[]"


def test_check_is_cached_per_config(fixtures_root):
    import time

    cfg = str(fixtures_root / "w2-qwen2-f32" / "huggingface")
    tensors = {n: (t.shape, t.dtype) for n, t in detect(fixtures_root / "w2-qwen2-f32")
               .tensors.items()}
    assert check(tensors, cfg).ok
    start = time.perf_counter()
    for _ in range(20):
        assert check(tensors, cfg).ok
    assert time.perf_counter() - start < 2  # no model build after the first
