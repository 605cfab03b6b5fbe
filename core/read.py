"""Read one tensor from its located pieces: the one public way to get a tensor's values out of
any checkpoint shardscope reads, used by ``diff`` and ``verify``. The byte placement is
:mod:`core.execute`'s (``assemble_bytes``: pieces copied into their boxes, strided pieces
allowed, never converted); this module adds the plan-level steps (a LoRA fold, a cast) so a
reader gets exactly the tensor a merge would write."""

from __future__ import annotations

from .execute import _Sources, assemble, assemble_bytes, fold_lora
from .layout import Piece

#: open source files shared between reads (positional reads only; thread-safe); ``close()``
Sources = _Sources


def read_words(pieces: list[Piece], shape: tuple[int, ...], dtype: str, sources: Sources,
               flat: bool = False):
    """The tensor of ``shape`` (elements) filled from its located ``pieces`` as a numpy array
    of unsigned integers as wide as ``dtype``'s elements (the stored bit patterns, no torch
    import). ``flat``: the pieces are ranges of the flattened tensor. Raises
    :class:`BadCheckpointError` when a file cannot be opened or is short."""
    return assemble_bytes(pieces, tuple(shape), dtype, sources, flat)


def read_tensor(pieces: list[Piece], shape: tuple[int, ...], dtype: str, sources: Sources,
                flat: bool = False):
    """Like :func:`read_words`, as a torch tensor of ``dtype`` (same bits)."""
    return assemble(pieces, tuple(shape), dtype, sources, flat)


def read_output_tensor(t, sources: Sources):
    """The values of one planned output tensor (:class:`core.plan.OutputTensor`) exactly as
    ``run_merge`` writes them: its pieces placed, the LoRA fold applied (``t.fold``, peft's
    operations) and cast to ``t.dtype``. A torch tensor of ``t.shape``."""
    from .dtypes import torch_dtype

    if t.fold is not None:
        f = t.fold
        w = read_tensor(t.pieces, t.shape, t.source.dtype, sources, t.source.flat)
        a = read_tensor(f.a_pieces, f.a.shape, f.a.dtype, sources, f.a.flat)
        b = read_tensor(f.b_pieces, f.b.shape, f.b.dtype, sources, f.b.flat)
        m = (read_tensor(f.m_pieces, f.magnitude.shape, f.magnitude.dtype, sources,
                         f.magnitude.flat) if f.magnitude is not None else None)
        return fold_lora(w, a, b, f.scale, torch_dtype(t.dtype), f.kind, m)
    x = read_tensor(t.pieces, t.shape, t.source.dtype, sources, t.source.flat)
    return x if t.dtype == t.source.dtype else x.to(torch_dtype(t.dtype))


def read_layout_tensor(layout, name: str, sources: Sources | None = None):
    """The full stored tensor ``name`` of ``layout`` (a torch tensor), its pieces resolved by
    the reader (``layout.resolve_piece``). Opens and closes its own files unless ``sources``
    is given."""
    t = layout.tensors[name]
    pieces = [p if layout.resolve_piece is None or p.numel == 0 else layout.resolve_piece(p)
              for p in t.pieces]
    own = sources is None
    src = Sources() if own else sources
    try:
        return read_tensor(pieces, t.shape, t.dtype, src, t.flat)
    finally:
        if own:
            src.close()
