"""Publishing a merged folder: its model card, and the upload to a Hugging Face Hub repository
with huggingface_hub (``create_repo(exist_ok=True)``, then ``upload_folder``; before
huggingface_hub 1.20 ``upload_large_folder`` above :data:`LARGE` bytes, so that an interrupted
upload resumes — from 1.20 ``upload_folder`` itself resumes, and 2.0 removed
``upload_large_folder``). With a ``progress`` callback (the app), the files go one by one through
``preupload_lfs_files`` and one ``create_commit``, so that bytes done can be reported.

The token comes from huggingface_hub's usual places (``HF_TOKEN``, the saved login), never from
our command line; ``HF_ENDPOINT`` selects a private hub. Nothing here prints the token.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Callable

from .errors import ShardscopeError, UsageError

#: with huggingface_hub < 1.20, folders above this many bytes go through upload_large_folder
LARGE = 10 * 10**9


class UploadError(ShardscopeError):
    """The upload failed; the local folder is intact (exit code 4)."""

    exit_code = 4


def model_card(plan, version: str) -> str:
    """README.md text for a merged folder: architecture, source format and layout, parallel
    degrees, dtypes, LoRA handling, and the shardscope version that wrote it."""
    layout = plan.layout
    arch = "unknown"
    texts = [plan.generated["config.json"]] if "config.json" in plan.generated else []
    for src, rel in plan.copy_files:
        if rel == "config.json":
            try:
                texts.append(Path(src).read_bytes())
            except OSError:
                pass
    for text in texts:
        try:
            cfg = json.loads(text)
            arch = (cfg.get("architectures") or [None])[0] or cfg.get("model_type") or arch
        except (ValueError, AttributeError):
            pass
    mesh = layout.mesh_text
    par = ", ".join(f"{k}={v}" for k, v in sorted(layout.parallel.items()) if v > 1) or "none"
    dtypes = sorted({t.dtype for f in plan.files for t in f.tensors})
    lora = "none in the checkpoint"
    if layout.lora is not None:
        lora = f"{plan.options.lora} ({_lora_summary(plan)})"
    return f"""---
library_name: transformers
tags:
- shardscope
---

# Merged model

This folder was written by shardscope {version} from a sharded training checkpoint.

| | |
|---|---|
| architecture | {arch} |
| source format | {layout.format} |
| world size | {layout.world_size} |
| device mesh | {mesh} |
| parallelism | {par} |
| tensors | {plan.tensor_count} |
| dtypes | {", ".join(dtypes)} |
| LoRA | {lora} |

{provenance(plan)}
{_check_section(getattr(plan, "check", None))}"""


#: names listed per kind in the model card before "and N more"
CARD_NAMES = 50


def _check_section(verdict) -> str:
    """The model card's account of the architecture check (:mod:`core.judge`): its one-line
    result, and when the merge was written with ``--no-strict`` despite a mismatch, every
    missing, extra or mis-shaped tensor (up to :data:`CARD_NAMES` per kind)."""
    if verdict is None:
        return ""
    text = f"\nArchitecture check: {verdict.summary().removeprefix('architecture check ')}.\n"
    if verdict.skipped is not None:
        return text + ("\n## Written with --no-strict, names unchecked\n\nThe tensors keep the "
                       "checkpoint's own names (the model's names in memory, as training "
                       "saved them): without the model class nothing checked them against the "
                       "names `save_pretrained` writes, which differ for some models (a "
                       "vision-language model's `model.language_model.*`, experts kept fused "
                       "in memory).\n")
    if not verdict.mismatched:
        return text
    text += ("\n## Written with --no-strict\n\nThese weights do not match the model class of "
             "the config; `from_pretrained` initialises missing tensors at random and ignores "
             "extra ones.\n")
    rows = [("Missing (not in the checkpoint)", [f"`{n}`" for n in verdict.missing]),
            ("Extra (not in the model)", [f"`{n}`" for n in verdict.extra]),
            ("Other shape", [f"`{n}`: {list(a)}, the model has {list(b)}"
                             for n, a, b in verdict.shape]),
            ("Other dtype kind", [f"`{n}`: {a}, the model has {k}"
                                  for n, a, k in verdict.dtype])]
    for title, items in rows:
        if items:
            more = (f"\n- and {len(items) - CARD_NAMES} more" if len(items) > CARD_NAMES
                    else "")
            text += f"\n{title} ({len(items)}):\n\n" + "\n".join(
                f"- {i}" for i in items[:CARD_NAMES]) + more + "\n"
    return text


def provenance(plan) -> str:
    """The card's sentence on how the weights were made: copied bit for bit, cast (``--dtype``),
    or, after a LoRA fold, which weights got ``W + (B @ A) * scale`` (``execute.fold_lora``:
    float32, one rounding to the weight's dtype) from which adapter (r, alpha, scale)."""
    folded = sorted(t.name for f in plan.files for t in f.tensors if t.fold is not None)
    cast = plan.options.dtype
    rest = "Every tensor was" if not folded else "The other tensors were"
    if cast:
        rest = (f"Floating-point tensors were cast with --dtype {cast}; the others were"
                if not folded else f"The other tensors were cast with --dtype {cast} (floating "
                "point) or")
    copied = f"{rest} copied bit for bit from the shards."
    from .plan import ADAPTER_DIR, lora_choice

    if not folded:
        if plan.layout.lora is not None and plan.options.lora == "base":
            return copied + " The LoRA adapter was dropped: these are the base weights alone."
        if plan.layout.lora is not None and plan.options.lora == "adapter":
            return copied + (" They are the base weights; the LoRA adapter is not folded in: "
                             f"it is written as a PEFT folder in {ADAPTER_DIR}/.")
        return copied

    _, adapter = lora_choice(plan.layout, plan.options)  # with --lora-alpha applied
    rs = ", rsLoRA" if adapter.use_rslora else ""
    shown = ", ".join(f"`{n}`" for n in folded[:6]) + (
        f" and {len(folded) - 6} more" if len(folded) > 6 else "")
    groups = adapter.groups()
    scales = {s for _, _, s, _ in groups}
    if len(scales) == 1:
        formula = f"W + (B @ A) * {scales.pop():g}"
    else:  # rank_pattern / alpha_pattern: each module its own rank and scale (peft's scaling)
        formula = ("W + (B @ A) * scale, each module with its own rank and scale (" + ", ".join(
            f"{g} r={r} scale={s:g}" for g, r, s, _ in groups) + ")")
    if adapter.dora:
        formula += (", then DoRA's magnitude vector over the column norms of the sum (for "
                    f"{len(adapter.dora)} module(s))")
    text = (f"The LoRA adapter `{adapter.name}` (r={adapter.r}, alpha={adapter.lora_alpha:g}"
            f"{rs}) was folded into {len(folded)} weight(s): {formula}, "
            "computed in float32 and rounded once to the weight's "
            f"{'output ' if cast else ''}dtype, as peft's merge_and_unload does, so these "
            f"differ from the base checkpoint's weights: {shown}. {copied}")
    if plan.options.lora == "both":
        text += f" The adapter is also written, unfolded, as a PEFT folder in {ADAPTER_DIR}/."
    return text


def _lora_summary(plan) -> str:
    """The LoRA row of the card: the adapters as merged, i.e. with ``--lora-config`` and
    ``--lora-alpha`` applied (each module's rank and scale as folded), not as first detected."""
    import dataclasses

    from .plan import lora_choice

    lora, adapter = lora_choice(plan.layout, plan.options)
    if lora is None:
        return plan.layout.lora.summary()
    return dataclasses.replace(lora, adapters={**lora.adapters, adapter.name: adapter}).summary()


def upload_files(folder: str) -> list[tuple[str, Path]]:
    """The files of ``folder`` that an upload sends, as (path in the repo, local path), sorted:
    all but ``.git/`` and huggingface_hub's own bookkeeping in ``.cache/huggingface/`` (which
    an interrupted upload leaves behind), as ``upload_folder`` does."""
    root = Path(folder)
    out = []
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root)
        parts = rel.parts
        if not p.is_file() or ".git" in parts or any(
                a == ".cache" and b == "huggingface" for a, b in zip(parts, parts[1:])):
            continue
        out.append((rel.as_posix(), p))
    return out


def _has_resumable_upload_folder() -> bool:
    import huggingface_hub

    major, minor = (int(x) for x in huggingface_hub.__version__.split(".")[:2])
    return (major, minor) >= (1, 20)


def upload(folder: str, repo_id: str, private: bool = False, revision: str | None = None,
           commit_message: str | None = None,
           progress: Callable[[int, int], None] | None = None) -> str:
    """Create ``repo_id`` if needed and upload ``folder`` to it; returns the commit URL (or the
    repository URL for a large-folder upload). ``progress(done, total)``, if given, is called
    (from this thread) with the bytes of the folder's files that have reached the Hub; without
    it huggingface_hub shows its own bars. Raises :class:`UploadError` (the message says how
    to retry) on any failure; the folder is never changed."""
    from huggingface_hub import HfApi

    api = HfApi()
    message = commit_message or "Upload model merged by shardscope"
    try:
        api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        if revision:
            api.create_branch(repo_id, branch=revision, exist_ok=True)
        if progress is not None:
            return _upload_counted(api, folder, repo_id, revision, message, progress)
        size = sum(p.stat().st_size for _, p in upload_files(folder))
        if size > LARGE and not _has_resumable_upload_folder():
            api.upload_large_folder(repo_id=repo_id, folder_path=folder, repo_type="model",
                                    revision=revision, private=private)
            return f"{api.endpoint}/{repo_id}"
        info = api.upload_folder(folder_path=folder, repo_id=repo_id, revision=revision,
                                 commit_message=message)
        return str(getattr(info, "commit_url", info))
    except Exception as e:  # noqa: BLE001 - network, auth, server: all end the same way
        text = str(e).splitlines()[0] if str(e) else type(e).__name__
        retry = retry_command(folder, repo_id, private, revision, commit_message)
        raise UploadError(f"upload to {repo_id} failed ({text}); the merged folder is intact: "
                          f"retry with `{retry}`", folder) from None


def check_repo_id(repo_id: str) -> None:
    """Raise :class:`UsageError` (exit 2) unless ``repo_id`` is a Hub model repository id that
    huggingface_hub accepts (``validate_repo_id``: ``NAME`` or ``NAMESPACE/NAME``): said before
    any merge or network use, not as a failed upload (exit 4) with a retry that fails again."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError:
        raise UsageError(f"{repo_id!r} is not a Hub repository id (NAME or NAMESPACE/NAME: "
                         "letters, digits, '-', '_' and '.', no '--' or '..', at most 96 "
                         "characters each)") from None


def retry_command(folder: str, repo_id: str, private: bool = False, revision: str | None = None,
                  commit_message: str | None = None) -> str:
    """The ``shardscope upload`` command line that repeats an upload with every option that
    decides where and how it lands (``--private``: a retry must not create the repository
    public; ``--revision``; ``--commit-message``), each path and value shell-quoted."""
    argv = ["shardscope", "upload", folder, repo_id]
    if private:
        argv.append("--private")
    if revision:
        argv += ["--revision", revision]
    if commit_message:
        argv += ["--commit-message", commit_message]
    return shlex.join(argv)


def _upload_counted(api, folder, repo_id, revision, message, progress) -> str:
    """The upload with bytes counted, through huggingface_hub's public commit API: each file is
    pre-uploaded alone (``preupload_lfs_files``: LFS/Xet files are sent now, small "regular"
    files ride inline in the commit), then one ``create_commit``. huggingface_hub has no public
    byte-level hook (its bars are internal, and hf_xet reads the files itself, so a counting
    file object would force the slower non-Xet transfer), hence the file-by-file steps. A
    re-run resumes: files already on the Hub are not sent again."""
    from huggingface_hub import CommitOperationAdd

    ops = [CommitOperationAdd(path_in_repo=rel, path_or_fileobj=str(p))
           for rel, p in upload_files(folder)]
    total = sum(op.upload_info.size for op in ops)
    done = 0
    progress(done, total)
    for op in ops:
        api.preupload_lfs_files(repo_id, [op], revision=revision)
        if op.path_or_fileobj == b"":  # documented: pre-uploaded content is released
            done += op.upload_info.size
            progress(done, total)
    info = api.create_commit(repo_id, operations=ops, commit_message=message, revision=revision)
    progress(total, total)
    return str(info.commit_url)
