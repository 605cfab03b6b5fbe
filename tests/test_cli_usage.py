"""Usage errors of the command line (issue 16, item 10 and 4): one line naming the problem,
exit 2, before any work; a failure to write the output is a usage problem too (exit 2, never
1, which `verify` uses for "differences found")."""

from __future__ import annotations

import errno
import os

import pytest

from shardscope.tui.cli import main


def one_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    return err


def test_missing_input_path_is_a_usage_error(tmp_path, capsys):
    missing = str(tmp_path / "no" / "such")
    assert main([missing]) == 2  # `shardscope PATH` does not open the app on a typo
    assert one_line(capsys) == f"shardscope: {missing}: no such file or folder"
    for argv in (["inspect", missing], ["merge", missing, "-o", str(tmp_path / "o")],
                 ["verify", missing]):
        assert main(argv) == 2
        assert one_line(capsys) == f"shardscope: {missing}: no such file or folder"
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("value", ["0", "-3"])
def test_workers_below_one_refused(fixtures_root, tmp_path, capsys, value):
    out = tmp_path / "o"
    assert main(["merge", str(fixtures_root / "w2-qwen2-f32"), "-o", str(out),
                 "--workers", value]) == 2
    assert one_line(capsys) == f"shardscope: --workers must be at least 1 (got {value})"
    assert not out.exists()


def test_lora_options_without_lora_refused(fixtures_root, tmp_path, capsys):
    src = fixtures_root / "w2-qwen2-f32"
    assert main(["merge", str(src), "-o", str(tmp_path / "o"), "--lora-alpha", "16"]) == 2
    assert one_line(capsys) == (f"shardscope: {src}: --lora-alpha given, but this checkpoint "
                                "holds no LoRA adapter")
    assert main(["merge", str(src), "-o", str(tmp_path / "o"), "--lora-adapter", "x"]) == 2
    assert "--lora-adapter given" in one_line(capsys)
    assert not (tmp_path / "o").exists()


def test_output_under_a_file_refused(fixtures_root, tmp_path, capsys):
    (tmp_path / "afile").write_text("x")
    out = tmp_path / "afile" / "sub" / "merged"
    assert main(["merge", str(fixtures_root / "w2-qwen2-f32"), "-o", str(out)]) == 2
    assert one_line(capsys) == (f"shardscope: {out}: cannot make the output folder: "
                                f"{tmp_path / 'afile'} is a file, not a folder")


def test_output_that_cannot_be_replaced_exits_2(fixtures_root, tmp_path, capsys, monkeypatch):
    """The tests run as root, where chmod cannot make a folder read-only: the rename that
    replaces the old output fails as it does on a read-only folder (EACCES on the output)."""
    src, out = fixtures_root / "w2-qwen2-f32", tmp_path / "merged"
    assert main(["merge", str(src), "-o", str(out), "-q"]) == 0
    capsys.readouterr()
    real = os.rename

    def refuse(a, b):
        if os.fspath(a) == str(out):
            raise PermissionError(errno.EACCES, "Permission denied", os.fspath(a))
        return real(a, b)

    monkeypatch.setattr(os, "rename", refuse)
    assert main(["merge", str(src), "-o", str(out), "-q", "--overwrite"]) == 2
    assert one_line(capsys) == f"shardscope: {out}: Permission denied"
    assert (out / "model.safetensors").is_file()  # the old output is still whole


def test_deepspeed_import_does_not_leak_into_json(fixtures_root):
    """Importing deepspeed during a command (as peft, accelerate or transformers may) logs
    "Setting accelerator to CPU" to stdout through DeepSpeed's own logger; `inspect --json`
    must stay one JSON document."""
    import json
    import subprocess
    import sys

    import pytest

    pytest.importorskip("deepspeed")
    code = ("import sys\nfrom shardscope.tui import cli\nreal = cli.cmd_inspect\n"
            "def wrapped(a):\n    import deepspeed  # noqa: F401\n    return real(a)\n"
            "cli.cmd_inspect = wrapped\nsys.exit(cli.main(['inspect', sys.argv[1], '--json']))")
    from conftest import ROOT

    r = subprocess.run([sys.executable, "-c", code, str(fixtures_root / "w2-qwen2-f32")],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["format"] == "fsdp"
    assert "accelerator" not in r.stdout + r.stderr


@pytest.mark.parametrize("command", ["verify", "diff"])
@pytest.mark.parametrize("flag,value", [("--atol", "-1"), ("--rtol", "-0.5"), ("--atol", "nan"),
                                        ("--rtol", "inf")])
def test_tolerance_that_is_negative_or_not_finite_is_a_usage_error(fixtures_root, capsys,
                                                                   command, flag, value):
    """verify gave "unexpected error (RuntimeError: rtol must be greater than or equal to zero)"
    exit 1 (torch.isclose's own check); diff took nan."""
    ref = fixtures_root / "w2-qwen2-f32.reference"
    args = [command, str(ref)] + (["--reference", str(ref)] if command == "verify" else
                                  [str(ref)])
    assert main(args + [flag, value]) == 2
    err = capsys.readouterr().err
    assert flag in err and "unexpected" not in err, err
