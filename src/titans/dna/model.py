"""DNA models: a `TitansLM` over nucleotides (``DNATokenizer`` ids) and a classifier on its backbone.

    lm = TitansLM(dna_config("lmm"))
    clf = SequenceClassifier(lm, num_classes=2)     # tokens (B, T) -> logits (B, num_classes)

The classifier reuses the pre-trained LM's embedding, blocks and final norm, mean-pools the normed hidden
states over the sequence and applies a new linear head; fine-tuning trains all of it.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from titans.data.dna import DNATokenizer
from titans.models.config import TitansConfig
from titans.models.ids import check_token_ids
from titans.models.lm import TitansLM


def dna_config(
    variant: str, dim: int = 64, depth: int = 2, heads: int = 4, window: int = 64, **kw
) -> TitansConfig:
    """A small nucleotide LM config (vocab: `DNATokenizer`)."""
    return TitansConfig(
        variant=variant,
        vocab_size=DNATokenizer.vocab_size,
        dim=dim,
        depth=depth,
        heads=heads,
        segment_len=window,
        window=window,
        chunk_size=16,
        persistent_tokens=4,
        name=f"dna-{variant}",
        **kw,
    )


class SequenceClassifier(nn.Module):
    """tokens (B, T) -> class logits (B, num_classes): the LM's backbone, mean pooling, a linear head."""

    def __init__(self, lm: TitansLM, num_classes: int):
        super().__init__()
        if num_classes < 2:
            raise ValueError(f"num_classes must be >= 2, got {num_classes}")
        self.lm = lm
        self.head = nn.Linear(lm.config.dim, num_classes)

    def forward(self, tokens: Tensor) -> Tensor:
        if tokens.dim() != 2:
            raise ValueError(f"SequenceClassifier: tokens must be (batch, seq), got {tuple(tokens.shape)}")
        check_token_ids(tokens, self.lm.config.vocab_size)
        h = self.lm.embed(tokens.long())
        for block in self.lm.blocks:
            h, _ = block(h, None, None)
        return self.head(self.lm.norm(h).mean(dim=1))


@torch.no_grad()
def lm_bits_per_base(lm: TitansLM, windows, batch_size: int = 32) -> float:
    """Mean next-base cross-entropy in bits over windows (N, T) (every position after the first)."""
    lm.eval()
    total = 0.0
    n = 0
    for i in range(0, len(windows), batch_size):
        x = torch.as_tensor(windows[i : i + batch_size])
        logits, _ = lm(x[:, :-1])
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten(), reduction="sum")
        total += float(loss)
        n += x[:, 1:].numel()
    return total / n / float(torch.log(torch.tensor(2.0)))


__all__ = ["SequenceClassifier", "dna_config", "lm_bits_per_base"]
