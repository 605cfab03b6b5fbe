"""Checkpoints of every torch release and every FSDP2 layout merge bit for bit.

- Golden files written by real torch releases (tests/data/torch_releases/<version>/<layout>/,
  see its README and make_golden.py) merge into their reference with today's torch.
- FSDP2 + tensor parallelism written by today's torch (``_StridedShard`` on the dp dimension),
  on 2x2, 3x2 and 2x3 meshes with uneven rows, sequence-parallel norms and ``Shard(1)``
  row-parallel weights: bit-exact against the reference and against torch's own
  ``full_tensor()``.
- DTensor records of an unknown layout are refused naming the field, never an IndexError.
"""

from __future__ import annotations

import hashlib
import json
import zipfile
from pathlib import Path

import pytest
from safetensors.torch import load_file

from conftest import ROOT, _cache_root, cached, run_cli
from shardscope.core import MergeOptions, detect, plan_merge, run_merge
from test_merge_exact import assert_bit_equal, load

GOLDEN = ROOT / "tests" / "data" / "torch_releases"
GOLDEN_CASES = sorted(p.parent for p in GOLDEN.glob("*/*/golden.json"))


def _merge(src: Path, out: Path, hf_config=None):
    layout = detect(src)
    assert not layout.errors, layout.errors
    plan = plan_merge(layout, MergeOptions(output=str(out), workers=2, hf_config=hf_config))
    run_merge(plan)
    return layout


def test_golden_files_exist_for_several_releases():
    releases = {p.parent.name for p in GOLDEN_CASES}
    assert len(releases) >= 2, releases


@pytest.mark.parametrize("case", GOLDEN_CASES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_golden_release_merges_bit_exact(case, tmp_path):
    info = json.loads((case / "golden.json").read_text())
    layout = _merge(case / "checkpoint", tmp_path / "out", hf_config=str(case / "reference"))
    assert_bit_equal(load(tmp_path / "out"), load(case / "reference"))
    if info["kind"] != "dcp":
        assert layout.world_size == info["world_size"]
        if info["mesh"] and info["kind"] != "fsdp1":
            assert list(layout.mesh_shape) == info["mesh"]


def test_readme_table_lists_every_golden_case():
    text = (GOLDEN / "README.md").read_text()
    for case in GOLDEN_CASES:
        row = next((line for line in text.splitlines() if line.startswith(f"| {case.name} ")),
                   None)
        assert row is not None, case.name
        assert case.parent.name in text
    # every cell of the table is tested or a refusal recorded by that release (skipped.json)
    assert "not written" not in text.split("| layout |", 1)[1]


# --- FSDP2 + TP written by today's torch -------------------------------------------------

def _tp_variants():
    from shardscope.core.sample_tp import TPVariant

    return {
        4: [TPVariant("tp-2x2"), TPVariant("tp-2x2-qwen-bf16", family="qwen2", dtype="BF16",
                                            sequence_parallel=False, seed=51, vocab=301)],
        6: [TPVariant("tp-3x2", mesh_shape=(3, 2), seed=52, vocab=271, hidden=32),
            TPVariant("tp-2x3", mesh_shape=(2, 3), mesh_names=("data", "model"), seed=53,
                      vocab=277, hidden=48)],
    }


@pytest.fixture(scope="session")
def tp_root() -> Path:
    """FSDP2 + TP checkpoints (:mod:`core.sample_tp`), written once and cached."""
    import torch

    from shardscope.core.sample_tp import write_tp_checkpoints

    variants = _tp_variants()
    key = hashlib.sha256(json.dumps(
        [torch.__version__, repr(variants), (ROOT / "core" / "sample_tp.py").read_text(),
         (ROOT / "core" / "sample.py").read_text()]).encode()).hexdigest()[:16]

    def write(tmp: Path) -> None:
        for vs in variants.values():
            write_tp_checkpoints(tmp, vs)

    return cached(_cache_root().parent / f"tp-{key}", write, lock="lock-tp")


TP_NAMES = ["tp-2x2", "tp-2x2-qwen-bf16", "tp-3x2", "tp-2x3"]


@pytest.mark.parametrize("name", TP_NAMES)
def test_fsdp2_tp_merges_bit_exact(tp_root, tmp_path, name):
    layout = _merge(tp_root / name, tmp_path / "out")
    merged = load(tmp_path / "out")
    assert_bit_equal(merged, load(tp_root / f"{name}.reference"))
    # torch's own gather of the same DTensors agrees
    full = load_file(str(tp_root / f"{name}.full" / "full.safetensors"))
    for k, t in merged.items():
        assert t.equal(full[k]), k
    placements = {t.placement for t in layout.tensors.values()}
    assert any("StridedShard(0" in p for p in placements), placements
    assert any("Shard(1)" in p for p in placements), placements
    assert layout.parallel.get("tp", 1) * layout.parallel.get("fsdp", 1) == layout.world_size


def test_strided_shard_offsets_follow_torch():
    """The issue's example: a (2, 2) mesh, a 1000-row embedding: rank (dp 1, tp 0) starts at
    row 250, rank (dp 0, tp 1) at row 500; torch's docstring example (mesh (4, 3, 2),
    ``(_S(0, 2), _S(0, 2), S(0))``) applies mesh dims in the order 2, 0, 1."""
    from shardscope.core.formats.fsdp import local_box, shard_orders
    from shardscope.core.formats.torchsave import Record

    def S(d):
        return Record("torch.distributed.tensor.placement_types", "Shard", state={"dim": d})

    def SS(d, sf):
        return Record("torch.distributed.tensor.placement_types", "_StridedShard",
                      state={"dim": d, "split_factor": sf})

    pl = [SS(0, 2), S(0)]
    assert local_box((1000, 8), (2, 2), (1, 0), pl) == ((250, 0), (250, 8))
    assert local_box((1000, 8), (2, 2), (0, 1), pl) == ((500, 0), (250, 8))
    assert local_box((1000, 8), (2, 2), (0, 1), [S(0), S(0)]) == ((250, 0), (250, 8))
    assert shard_orders(1, (4, 3, 2), [SS(0, 2), SS(0, 2), S(0)]) == {0: [2, 0, 1]}
    # uneven: 7 rows, tp 2 -> 4 + 3, each cut by dp 2 -> 2 + 2, 2 + 1
    boxes = {c: local_box((7,), (2, 2), c, pl) for c in [(0, 0), (1, 0), (0, 1), (1, 1)]}
    assert boxes == {(0, 0): ((0,), (2,)), (1, 0): ((2,), (2,)), (0, 1): ((4,), (2,)),
                     (1, 1): ((6,), (1,))}
    with pytest.raises(ValueError, match="split factor"):
        shard_orders(1, (2, 2), [SS(0, 3), S(0)])
    partial = Record("torch.distributed.tensor.placement_types", "Partial", state={})
    with pytest.raises(ValueError, match="Partial"):
        local_box((4,), (2,), (0,), [partial])


def _rewrite_pickle(path: Path, old: bytes, new: bytes) -> None:
    """Damage a real rank file: replace bytes inside its data.pkl (whole length-prefixed
    strings, so the pickle stays well-formed), keeping every other zip entry as is."""
    with zipfile.ZipFile(path) as z:
        entries = [(i, z.read(i)) for i in z.infolist()]
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        for info, data in entries:
            if info.filename.endswith("data.pkl"):
                assert old in data
                data = data.replace(old, new)
            z.writestr(info.filename, data)


def test_unknown_mesh_record_is_refused_naming_the_field(tp_root, tmp_path):
    import shutil

    ck = shutil.copytree(tp_root / "tp-2x2", tmp_path / "ck")
    f = ck / "model_world_size_4_rank_1.pt"
    # the field name as the pickle stores it (BINUNICODE, 7 characters), not the global
    # torch.serialization._get_layout
    _rewrite_pickle(f, b"\x07\x00\x00\x00_layout", b"\x07\x00\x00\x00_lay0ut")
    layout = detect(ck)
    probs = [p for p in layout.problems if p.code == "unsupported-record"]
    assert probs and Path(probs[0].path).name == f.name
    assert "DeviceMesh" in probs[0].message and "_lay0ut" in probs[0].message
    assert "torch release" in probs[0].message
    assert not any("IndexError" in p.message for p in layout.problems)
    r = run_cli("merge", str(ck), "-o", str(tmp_path / "out"), cwd=ROOT)
    assert r.returncode == 3 and "DeviceMesh" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "out").exists()


def test_unknown_placement_is_refused_naming_it(tp_root, tmp_path):
    import shutil

    ck = shutil.copytree(tp_root / "tp-2x2", tmp_path / "ck")
    for r in range(4):
        _rewrite_pickle(ck / f"model_world_size_4_rank_{r}.pt", b"_StridedShard",
                        b"_StridedShaxd")
    layout = detect(ck)
    probs = [p for p in layout.problems if p.code == "unsupported-placement"]
    assert probs and "_StridedShaxd" in probs[0].message
    assert layout.errors


# --- HSDP: a lost replica is not a lost model ----------------------------------------------

@pytest.fixture
def hsdp(fixtures_root, tmp_path):
    """A copy of the real HSDP checkpoint (mesh (2, 2) ``(ddp, fsdp)``: ranks r and r + 2
    hold the same shards)."""
    from conftest import copy_checkpoint

    return copy_checkpoint(fixtures_root / "w4-hsdp", tmp_path / "ck")


def test_hsdp_missing_ranks_served_by_the_other_replica(hsdp, fixtures_root, tmp_path):
    import os

    os.remove(hsdp / "model_world_size_4_rank_1.pt")
    os.remove(hsdp / "model_world_size_4_rank_2.pt")
    layout = detect(hsdp)
    assert not layout.errors, layout.errors
    missing = [p for p in layout.problems if p.code == "missing-rank"]
    assert len(missing) == 2 and all(p.severity == "warning" for p in missing)
    note = next(n for n in layout.notes if n.startswith("HSDP"))
    assert "rank 1 from rank 3" in note and "rank 2 from rank 0" in note and "agree" in note
    _merge(hsdp, tmp_path / "out")
    assert_bit_equal(load(tmp_path / "out"), load(fixtures_root / "w4-hsdp.reference"))


def test_hsdp_shard_without_any_copy_is_refused_naming_it(hsdp, tmp_path):
    import os

    os.remove(hsdp / "model_world_size_4_rank_1.pt")
    os.remove(hsdp / "model_world_size_4_rank_3.pt")  # both copies of fsdp shard 1
    layout = detect(hsdp)
    assert layout.errors[0].code == "lost-shard"
    assert "ranks 1, 3" in layout.errors[0].message and ".weight" in layout.errors[0].message
    assert any(p.code == "coverage-gap" for p in layout.errors)
    r = run_cli("merge", str(hsdp), "-o", str(tmp_path / "out"), cwd=ROOT)
    assert r.returncode == 3 and "no HSDP replica" in r.stderr
    assert not (tmp_path / "out").exists()


def test_hsdp_replicas_that_disagree_are_refused(hsdp):
    import os

    from shardscope.core.formats.torchsave import read_torch_archive

    os.remove(hsdp / "model_world_size_4_rank_1.pt")
    f = hsdp / "model_world_size_4_rank_2.pt"  # replica of rank 0, stands in for nobody
    ref = read_torch_archive(str(f)).root["model.norm.weight"]
    local = ref.state[1]["_local_tensor"]
    data = bytearray(f.read_bytes())
    data[local.byte_offset] ^= 0x40
    f.write_bytes(bytes(data))
    layout = detect(hsdp)
    probs = [p for p in layout.errors if p.code == "replica-mismatch"]
    assert probs and "model.norm.weight" in probs[0].message


HSDP_GOLDEN = [c for c in GOLDEN_CASES if c.name.startswith("fsdp2_hsdp_2x2_")]


@pytest.mark.parametrize("case", HSDP_GOLDEN, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_hsdp_golden_of_each_release_survives_a_lost_replica(case, tmp_path):
    """Every release's HSDP mesh record (a ``mesh`` tensor, ``_MeshLayout(shape, stride)``,
    ``_layout.axes``): with one rank of each replica gone, the other replica serves them and
    the merge is still bit-exact; with both copies of one fsdp shard gone, the refusal names
    the ranks and a tensor."""
    import shutil

    ck = shutil.copytree(case / "checkpoint", tmp_path / "ck")
    (ck / "model_world_size_4_rank_0.pt").unlink()
    (ck / "model_world_size_4_rank_3.pt").unlink()
    layout = _merge(ck, tmp_path / "out", hf_config=str(case / "reference"))
    assert layout.mesh_shape == (2, 2) and layout.parallel == {"dp": 2, "fsdp": 2}
    note = next(n for n in layout.notes if n.startswith("HSDP"))
    assert "rank 0 from rank 2" in note and "rank 3 from rank 1" in note, note
    assert_bit_equal(load(tmp_path / "out"), load(case / "reference"))
    (ck / "model_world_size_4_rank_2.pt").unlink()  # rank 0's last copy of fsdp shard 0
    layout = detect(ck)
    assert layout.errors[0].code == "lost-shard", layout.errors
    assert "ranks 0, 2, 3" in layout.errors[0].message
    assert ".weight" in layout.errors[0].message


def test_dcp_safetensors_without_last_rank_says_a_rank_file_is_missing(fixtures_root, tmp_path):
    """DCP's ``HuggingFaceStorageWriter`` records no global shape: with its last rank file
    gone the inferred embedding is short, and the refusal says a rank file is probably
    missing rather than only that the config disagrees."""
    import shutil

    ck = shutil.copytree(fixtures_root / "w3-dcp-hf", tmp_path / "ck")
    (ck / "shard-00003-model-00001-of-00001.safetensors").unlink()
    r = run_cli("merge", str(ck), "-o", str(tmp_path / "out"), cwd=ROOT)
    assert r.returncode == 3 and "rank file is probably missing" in r.stderr
    assert not (tmp_path / "out").exists()


def test_dcp_safetensors_without_config_warns_that_a_lost_last_rank_cannot_be_seen(
        fixtures_root, tmp_path):
    """Without a config nothing records the global shapes: the merge says so in a warning
    rather than passing the short tensors of a set that lost its last rank file silently."""
    import shutil

    ck = shutil.copytree(fixtures_root / "w3-dcp-hf", tmp_path / "ck")
    (ck / "shard-00003-model-00001-of-00001.safetensors").unlink()
    shutil.rmtree(ck / "huggingface")
    # strict (the default): no config, so the architecture check cannot vouch for the output
    r = run_cli("merge", str(ck), "-o", str(tmp_path / "out"), cwd=ROOT)
    assert r.returncode == 3 and "architecture check skipped: no config.json" in r.stderr
    assert not (tmp_path / "out").exists()
    r = run_cli("merge", str(ck), "-o", str(tmp_path / "out"), "--no-strict", cwd=ROOT)
    assert "a missing last rank file cannot be detected" in r.stderr, r.stderr
    assert "2 rank files present" in r.stderr


def test_mesh_slice_without_root_link_joins_its_mesh(tp_root, tmp_path):
    """Norms without sequence parallelism stay on FSDP2's ``dp`` slice of the (dp, tp) mesh.
    torch 2.11+ links the slice to its root (``_root_mesh``); older releases pickle no link:
    with the field renamed away the slice is still matched to the mesh by its dim names."""
    import shutil

    ck = shutil.copytree(tp_root / "tp-2x2-qwen-bf16", tmp_path / "ck")
    for r in range(4):
        _rewrite_pickle(ck / f"model_world_size_4_rank_{r}.pt",
                        b"\x0a\x00\x00\x00_root_mesh", b"\x0a\x00\x00\x00_root_mesx")
    layout = _merge(ck, tmp_path / "out")
    assert layout.mesh_shape == (2, 2) and layout.parallel == {"fsdp": 2, "tp": 2}
    assert_bit_equal(load(tmp_path / "out"), load(tp_root / "tp-2x2-qwen-bf16.reference"))


def test_gpu_written_records_read_like_cpu_ones(fixtures_root, tmp_path):
    """Files saved from GPU tensors record their storages at ``cuda:N`` and meshes of device
    type ``cuda`` (seen in torch 2.11 files written on a GPU). No GPU here: the real HSDP
    files get those strings in place of ``cpu`` and merge exactly as before."""
    import shutil

    ck = shutil.copytree(fixtures_root / "w4-hsdp", tmp_path / "ck")
    for r in range(4):
        _rewrite_pickle(ck / f"model_world_size_4_rank_{r}.pt", b"\x03\x00\x00\x00cpu",
                        b"\x06\x00\x00\x00cuda:%d" % r)
    from shardscope.core.formats.torchsave import read_torch_archive

    arch = read_torch_archive(str(ck / "model_world_size_4_rank_3.pt"))
    assert {s.location for s in arch.storages.values()} == {"cuda:3"}
    layout = _merge(ck, tmp_path / "out")
    assert layout.mesh_shape == (2, 2)
    assert_bit_equal(load(tmp_path / "out"), load(fixtures_root / "w4-hsdp.reference"))


def _as_if_written_on_a_gpu(path: Path) -> None:
    """Damage a real CPU-written rank file of torch 2.11 into what the same release writes on
    one GPU (each rank in turn on ``cuda:0``; compared field by field with such a file):
    the DTensor's device ``torch.device("cpu")`` becomes ``torch.device("cuda", 0)``, every
    parameter storage is recorded at ``cuda:0``, the mesh's ``_device_type`` is ``cuda``, and
    the mesh's ``_rank_map`` stays a CPU tensor."""
    import re

    from shardscope.core.formats.torchsave import read_torch_archive

    root = read_torch_archive(str(path)).root
    mesh = next(iter(root.values())).state[1]["_spec"].get("mesh")
    rank_map_key = mesh.state["_rank_map"].storage.key.encode()
    memo = rb"(?:q.|r.{4})?"
    # the string "cpu" as pickled: a literal (maybe memoised) or a memo reference to one
    cpu = rb"(X\x03\x00\x00\x00cpu" + memo + rb"|h.|j.{4})"

    def put(tok: bytes, new: bytes) -> bytes:
        """``new`` in place of the string ``tok``; a memoised literal stays in the memo for
        later references (pushed, memoised, POPped)."""
        return tok + b"0" + new if tok[:1] == b"X" and len(tok) > 8 else new

    with zipfile.ZipFile(path) as z:
        entries = [(i, z.read(i)) for i in z.infolist()]
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        for info, data in entries:
            if info.filename.endswith("data.pkl"):
                n = {}
                data, n["device"] = re.subn(  # torch.device("cpu") -> torch.device("cuda", 0)
                    rb"X\x03\x00\x00\x00cpu(" + memo + rb")\x85",
                    lambda m: b"X\x04\x00\x00\x00cuda" + m[1] + b"K\x00\x86", data,
                    flags=re.S)
                data, n["storage"] = re.subn(  # storage record: (..., key, location, numel)
                    rb"(X[\x01-\x09]\x00\x00\x00)(\d+)(" + memo + rb")" + cpu,
                    lambda m: m[0] if m[2] == rank_map_key else
                    m[1] + m[2] + m[3] + put(m[4], b"X\x06\x00\x00\x00cuda:0"), data,
                    flags=re.S)
                data, n["mesh"] = re.subn(
                    rb"(X\x0c\x00\x00\x00_device_type" + memo + rb")" + cpu,
                    lambda m: m[1] + put(m[2], b"X\x04\x00\x00\x00cuda"), data, flags=re.S)
                assert n["device"] and n["storage"] > 1 and n["mesh"] == 1, n
            z.writestr(info.filename, data)


def test_torch211_hsdp_as_written_on_a_gpu_merges_exactly(tmp_path):
    """The issue's failing input: torch 2.11 HSDP 2x2 saved from CUDA tensors. The golden
    2.11 files, given the GPU records, merge bit for bit (storages at ``cuda:0``, devices
    ``torch.device("cuda", 0)``, mesh device type ``cuda``)."""
    import shutil

    case = GOLDEN / "2.11.0" / "fsdp2_hsdp_2x2_named"
    ck = shutil.copytree(case / "checkpoint", tmp_path / "ck")
    for r in range(4):
        _as_if_written_on_a_gpu(ck / f"model_world_size_4_rank_{r}.pt")
    from shardscope.core.formats.torchsave import read_torch_archive

    arch = read_torch_archive(str(ck / "model_world_size_4_rank_2.pt"))
    assert {s.location for s in arch.storages.values()} == {"cuda:0", "cpu"}
    mesh = next(iter(arch.root.values())).state[1]["_spec"].get("mesh")
    assert mesh.state["_device_type"] == "cuda"
    layout = _merge(ck, tmp_path / "out", hf_config=str(case / "reference"))
    assert layout.mesh_shape == (2, 2) and not layout.problems
    assert_bit_equal(load(tmp_path / "out"), load(case / "reference"))
