"""The architecture check's answers computed in a second process, for a merge that writes
meanwhile (core/overlap.py).

``python -m shardscope.core.archworker [--preload]`` reads one JSON object from stdin (at EOF
it exits), the ``question`` of a speculative plan (:func:`core.plan.plan_merge`):
``config_dir`` or ``config_fields``, ``trust_remote_code``, and ``form`` (:func:`core.hf_names.form_signature`: the in-memory names,
shapes and dtypes the plan asks about). It imports torch and transformers, builds the config's
model on the meta device and stores in the persistent cache (:mod:`core.archcache`) every
answer the real plan then asks for: the classes tried, the first class's expected tensors, the
config class's ``tie_word_embeddings`` (or the derived config.json) and the names
``save_pretrained`` writes for those tensors. It prints nothing and its exit status is not
read: the merge's own plan is what decides, and computes anything missing itself. With
``--preload`` it imports torch and transformers' modeling code first, while the merge is still
reading the checkpoint (:func:`core.overlap.start_worker`).

A process rather than a thread: importing transformers is Python code holding the GIL for
seconds, which a thread would take from the merge's writer; on 2 cores the second process
runs beside it.
"""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace


def answer(question: dict) -> None:
    """Fill the persistent cache with what a plan with ``question`` asks (see the module
    docstring). Raises nothing for a config the check cannot use (the plan says why)."""
    from . import hf_names, judge
    from .errors import ShardscopeError
    from .gcpause import paused_gc

    config_dir = question.get("config_dir")
    fields = question.get("config_fields")
    trust = bool(question.get("trust_remote_code"))
    with paused_gc():
        judge.warm(config_dir, fields, trust)
        form = question.get("form")
        if config_dir and form:
            tensors = {e[0]: SimpleNamespace(shape=tuple(e[1]), dtype=e[2])
                       for e in form if len(e) == 3}
            layout = SimpleNamespace(tensors=tensors, path=config_dir)
            try:
                hf_names.cached_form(layout, {e[0]: e[0] for e in form}, config_dir, trust)
            except (ShardscopeError, judge.Skip, OSError, KeyError):
                pass  # the plan meets it again and reports it


def preload() -> None:
    """Import torch and transformers' modeling code (most of the check's cost, the same for
    every model), the garbage collector paused, before the question is known."""
    from .gcpause import paused_gc

    with paused_gc():
        import torch  # noqa: F401
        import transformers.modeling_utils  # noqa: F401


def main(argv: list[str]) -> int:
    if "--preload" in argv:  # started before the merge read its checkpoint
        preload()
    try:
        question = json.loads(sys.stdin.readline() or "null")
    except ValueError:
        return 2
    if not isinstance(question, dict):
        return 2
    answer(question)
    return 0


if __name__ == "__main__":
    code = main(sys.argv[1:])
    # the answers are on disk (each entry renamed into place): skip the interpreter's teardown
    # of torch and transformers (0.5-1 CPU s) that the waiting merge would pay for
    sys.stdout.flush()
    sys.stderr.flush()
    import os

    os._exit(code)
