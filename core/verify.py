"""Checks of a merged Hugging Face folder, alone or against a reference checkpoint."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from .errors import BadCheckpointError
from .layout import Problem


@dataclass
class Difference:
    """One disagreement between a folder and its reference: the tensor, what differs
    (``missing``, ``extra``, ``shape``, ``dtype``, ``values``) and a human description."""

    name: str
    kind: str
    detail: str


def verify_folder(path: str) -> list[Problem]:
    """Integrity of a Hugging Face folder: ``config.json`` parses, every shard named by the
    index exists and has a valid header, no key is missing or duplicated, and the weights agree
    with the config (:func:`core.checks.config_problems`). Returns problems (empty: sound)."""
    from .formats import hf

    root = Path(path)
    if not hf.sniff(path):
        return [Problem("not-hf-folder", "no model.safetensors or model.safetensors.index.json",
                        path)]
    layout = hf.read(path)
    problems = list(layout.problems)
    cfg_path = root / "config.json"
    if not cfg_path.is_file():
        problems.append(Problem("no-config", "config.json is missing", str(cfg_path), "warning"))
        return problems
    try:
        json.loads(cfg_path.read_text())
    except ValueError:
        problems.append(Problem("bad-config", "config.json is not valid JSON", str(cfg_path)))
        return problems
    from .checks import config_problems

    problems.extend(config_problems(layout))
    return problems


def architecture_problems(path: str, trust_remote_code: bool = False) -> list[Problem]:
    """The merged folder ``path`` against the model class of its own ``config.json`` (the
    architecture check a merge makes, :func:`core.judge.check_layout`): a tensor the model
    needs that is missing, or one of another shape, is an ``architecture-mismatch`` error
    (``from_pretrained`` would leave it randomly initialised or fail); extra tensors or another
    dtype kind are an ``architecture-extra`` warning (``from_pretrained`` drops or casts
    them); a check that cannot be made is an ``architecture-unchecked`` warning naming why.
    Empty when there is no config.json (``verify_folder`` reports that) or all matches.
    Imports transformers (the model is built on the meta device: no weights)."""
    from .formats import detect
    from .judge import check_layout

    if not (Path(path) / "config.json").is_file():
        return []
    layout = detect(path)
    if layout.errors:
        return []  # verify_folder lists them; nothing to judge
    verdict = check_layout(layout, None, trust_remote_code)
    cfg = str(Path(path) / "config.json")
    if verdict.skipped is not None:
        return [Problem("architecture-unchecked", verdict.summary(), cfg, "warning")]
    if verdict.ok:
        return []
    bad = verdict.missing or verdict.shape
    return [Problem("architecture-mismatch" if bad else "architecture-extra", verdict.summary(),
                    cfg, "error" if bad else "warning")]


def compare(path: str, reference: str, atol: float = 0.0, rtol: float = 0.0,
            on_tensor=None, crc: bool = True, on_layouts=None) -> list[Difference]:
    """Compare the tensors of the checkpoint at ``path`` with those at ``reference`` (any
    format the core reads): key sets, shapes, dtypes and values — bit-exact when ``atol`` and
    ``rtol`` are 0. Aliases of one tied tensor count as that tensor (:func:`tied_aliases`): a
    side holding only the kept name is compared through it. Reads one tensor at a time.
    Raises BadCheckpointError for unreadable input, and (``crc``, as ``merge``) for a
    ``torch.save`` storage record whose CRC-32 fails (checked in a thread overlapping the
    comparison): corruption is not reported as a difference.
    """
    from .formats import detect
    from .plan import natural_key

    a, b = detect(path), detect(reference)
    for lay in (a, b):
        if lay.errors:
            raise BadCheckpointError(lay.errors[0].message, lay.errors[0].path or lay.path)
    if on_layouts is not None:  # e.g. the config folders, for config_comparison
        on_layouts(a, b)
    diffs = []
    aliases = tied_aliases(a, b) if set(a.tensors) ^ set(b.tensors) else {}

    def named(lay, n: str) -> str | None:
        """``n`` in ``lay``, or the tensor it is tied to when ``lay`` holds only that."""
        if n in lay.tensors:
            return n
        kept = aliases.get(n)
        return kept if kept in lay.tensors else None

    pairs = []
    for n in sorted(set(a.tensors) | set(b.tensors), key=natural_key):
        na, nb = named(a, n), named(b, n)
        if na is None:
            diffs.append(Difference(n, "missing", "in the reference only"))
        elif nb is None:
            diffs.append(Difference(n, "extra", "not in the reference"))
        else:
            pairs.append((n, na, nb))
    checker = None
    if crc:
        from .integrity import layout_records, start_check

        checker = start_check(layout_records(a, [na for _, na, _ in pairs])[0]
                              + layout_records(b, [nb for _, _, nb in pairs])[0],
                              "not compared (--no-crc compares the bytes as they are)")
    try:
        _compare_pairs(a, b, pairs, diffs, atol, rtol, on_tensor, checker)
        if checker is not None:
            checker.result()  # raises for a record that fails its CRC-32
    finally:
        if checker is not None and checker.is_alive():
            checker.cancel.set()
            checker.join()
    return diffs


def _compare_pairs(a, b, pairs, diffs, atol, rtol, on_tensor, checker) -> None:
    for n, na, nb in pairs:
        if checker is not None and (checker.failed or checker.error):
            return  # refused by the caller
        ta, tb = a.tensors[na], b.tensors[nb]
        if ta.shape != tb.shape:
            diffs.append(Difference(n, "shape", f"{ta.shape} vs {tb.shape}"))
            continue
        if ta.dtype != tb.dtype and not (atol or rtol):
            diffs.append(Difference(n, "dtype", f"{ta.dtype} vs {tb.dtype} (compare values "
                                                "across dtypes with --atol/--rtol)"))
        xa, xb = read_tensor(a, na), read_tensor(b, nb)
        d = _value_difference(xa, xb, atol, rtol)
        if d:
            diffs.append(Difference(n, "values", d))
        if on_tensor:
            on_tensor(n)


#: config.json's name of a stored dtype (``dtype``, older ``torch_dtype``)
_CONFIG_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32", "float64": "F64"}


def _stored_float_dtype(layout) -> str | None:
    """The one floating dtype ``layout``'s tensors are stored in, or None (several, none)."""
    kinds = {t.dtype for t in layout.tensors.values() if t.dtype in _CONFIG_DTYPES.values()}
    return kinds.pop() if len(kinds) == 1 else None


def config_comparison(layout, reference) -> tuple[str, str, list, list]:
    """``layout``'s config.json against ``reference``'s (two layouts): ``(state, where,
    differences, as_tensors)``, ``state`` one of ``same``, ``differ`` (``differences``: see
    :func:`core.checks.config_differences`), ``unchecked`` (``where`` says which side has no
    readable config.json); ``where``: the reference's config.json otherwise. A ``dtype``
    (``torch_dtype``) that differs as each side's stored tensors do (``merge --dtype``
    writes both) is in ``as_tensors``, not ``differences``: the tensor comparison judges
    it (a difference bit for bit, accepted within --atol/--rtol)."""
    import os

    from .checks import config_differences

    for lay, who in ((layout, "the folder"), (reference, "the reference")):
        if lay.config_dir is None or not os.path.isfile(os.path.join(lay.config_dir,
                                                                      "config.json")):
            return "unchecked", f"{who} has no config.json", [], []
    where = os.path.join(reference.config_dir, "config.json")
    diffs = config_differences(layout.config_dir, reference.config_dir)
    if diffs is None:
        return "unchecked", "a config.json is not a readable JSON object", [], []
    stored = (_stored_float_dtype(layout), _stored_float_dtype(reference))
    as_tensors = [d for d in diffs if d[0] in ("dtype", "torch_dtype")
                  and (_CONFIG_DTYPES.get(str(d[1])), _CONFIG_DTYPES.get(str(d[2]))) == stored
                  and None not in stored]
    diffs = [d for d in diffs if d not in as_tensors]
    return ("differ" if diffs else "same"), where, diffs, as_tensors


def tied_aliases(*layouts) -> dict[str, str]:
    """Tied copies of the model of the first layout with a config (:func:`core.judge.
    tied_aliases`): alias -> the name ``save_pretrained`` keeps. A reference written by
    ``save_pretrained`` of a tied model lacks the aliases (``lm_head.weight``; T5's
    ``encoder.embed_tokens``, ``decoder.embed_tokens`` and ``lm_head`` beside ``shared``) that
    a training checkpoint holds: ``compare`` treats each alias as its kept tensor."""
    from .judge import tied_aliases as aliases_of

    for lay in layouts:
        found = aliases_of(lay.config_dir)
        if found:
            return found
    return {}


def _value_difference(xa, xb, atol, rtol) -> str:
    import torch

    if xa.dtype == xb.dtype and atol == 0 and rtol == 0:
        same = torch.equal(xa.reshape(-1).view(torch.uint8), xb.reshape(-1).view(torch.uint8)) \
            if xa.numel() else True
        if same:
            return ""
    fa, fb = xa.double(), xb.double()
    nan_a, nan_b = torch.isnan(fa), torch.isnan(fb)
    if not torch.equal(nan_a, nan_b):
        return "NaNs in different places"
    close = torch.isclose(fa, fb, rtol=rtol, atol=atol, equal_nan=True)
    if bool(close.all()) and (atol or rtol or xa.dtype != xb.dtype):
        return ""
    if bool(close.all()):
        return "bits differ (e.g. -0.0 vs 0.0)"
    bad = int((~close).sum())
    err = float((fa - fb).abs().nan_to_num(0).max())
    return f"{bad} of {fa.numel()} elements differ, max abs error {err:.3g}"


def read_tensor(layout, name: str):
    """The full tensor ``name`` of ``layout``, read from its pieces (a torch tensor)."""
    from .read import read_layout_tensor

    return read_layout_tensor(layout, name)
