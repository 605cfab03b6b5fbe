"""Publishing a merged folder: its model card, and the upload to a Hugging Face Hub repository
with huggingface_hub (``create_repo(exist_ok=True)``, then ``upload_folder``, or
``upload_large_folder`` above :data:`LARGE` bytes so an interrupted upload resumes).

The token comes from huggingface_hub's usual places (``HF_TOKEN``, the saved login), never from
our command line; ``HF_ENDPOINT`` selects a private hub. Nothing here prints the token.
"""

from __future__ import annotations

import json
from pathlib import Path

from .errors import ShardscopeError

#: folders above this many bytes go through upload_large_folder (resumable)
LARGE = 10 * 10**9


class UploadError(ShardscopeError):
    """The upload failed; the local folder is intact (exit code 4)."""

    exit_code = 4


def model_card(plan, version: str) -> str:
    """README.md text for a merged folder: architecture, source format and layout, parallel
    degrees, dtypes, LoRA handling, and the shardscope version that wrote it."""
    layout = plan.layout
    arch = "unknown"
    for src, rel in plan.copy_files:
        if rel == "config.json":
            try:
                arch = (json.loads(Path(src).read_text()).get("architectures") or [arch])[0]
            except (OSError, ValueError, AttributeError):
                pass
    mesh = layout.mesh_text
    par = ", ".join(f"{k}={v}" for k, v in sorted(layout.parallel.items()) if v > 1) or "none"
    dtypes = sorted({t.dtype for f in plan.files for t in f.tensors})
    lora = "none in the checkpoint"
    if layout.lora is not None:
        lora = f"{plan.options.lora} ({layout.lora.summary()})"
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

Every tensor was copied bit for bit from the shards{", cast with --dtype " + plan.options.dtype
                                                   if plan.options.dtype else ""}.
"""


def upload(folder: str, repo_id: str, private: bool = False, revision: str | None = None,
           commit_message: str | None = None) -> str:
    """Create ``repo_id`` if needed and upload ``folder`` to it; returns the commit URL (or the
    repository URL for a large-folder upload). Raises :class:`UploadError` (the message says
    how to retry) on any failure; the folder is never changed."""
    from huggingface_hub import HfApi

    size = sum(p.stat().st_size for p in Path(folder).rglob("*") if p.is_file())
    api = HfApi()
    message = commit_message or "Upload model merged by shardscope"
    try:
        api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        if revision:
            api.create_branch(repo_id, branch=revision, exist_ok=True)
        if size > LARGE:
            api.upload_large_folder(repo_id=repo_id, folder_path=folder, repo_type="model",
                                    revision=revision, private=private)
            return f"{api.endpoint}/{repo_id}"
        info = api.upload_folder(folder_path=folder, repo_id=repo_id, revision=revision,
                                 commit_message=message)
        return str(getattr(info, "commit_url", info))
    except Exception as e:  # noqa: BLE001 - network, auth, server: all end the same way
        text = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise UploadError(f"upload to {repo_id} failed ({text}); the merged folder is intact: "
                          f"retry with `shardscope upload {folder} {repo_id}`", folder) from None
