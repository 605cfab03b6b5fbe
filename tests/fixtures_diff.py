"""Two steps of real training on a tiny model, for ``shardscope diff``: a fixture's
``save_pretrained`` reference is loaded with transformers, its embedding, layer 0 and final
norm frozen (``requires_grad=False``), and trained with torch's AdamW on random tokens; the
model is saved with ``save_pretrained`` after step 1 and after step 2. Every trainable tensor
changes between the two saves, the frozen ones do not."""

from __future__ import annotations

from pathlib import Path

#: parameters kept frozen (prefixes of the in-memory names)
FROZEN = ("model.embed_tokens.", "model.layers.0.", "model.norm.")


def write_training_steps(reference: Path, out: Path) -> None:
    """``out/step1`` and ``out/step2``: ``save_pretrained`` of ``reference``'s model after one
    and two AdamW steps (lr 1e-2, seed 0) with :data:`FROZEN` frozen."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(str(reference), dtype=torch.float32)
    for name, p in model.named_parameters():
        p.requires_grad_(not name.startswith(FROZEN))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    vocab = model.config.vocab_size
    for step in (1, 2):
        ids = torch.randint(0, vocab, (2, 16))
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        model.save_pretrained(str(out / f"step{step}"))
