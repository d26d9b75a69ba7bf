"""Wild scenarios of the sample behind a masked row (see ``nanguard.zoo.wild``).

A preprocessing step (a stop-word filter, truncation, an empty passage) leaves one sample with
no token; the collator pads it and its attention mask is all zeros. The softmax over its row is
0/0: ``op.masked_softmax`` at the softmax, and the evidence names the batch tensor and row the
empty mask came from (``masked_by``, ``rows``), so ``policy="auto"`` quarantines that sample.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nanguard.zoo.scenarios import Case, Expect, WildScenario

__all__ = ["SCENARIOS", "stopword_batch"]

_NEG = float("-inf")


class AttentionPool(nn.Module):
    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.score = nn.Linear(dim, 1)

    def forward(self, h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        scores = self.score(h).squeeze(-1).masked_fill(mask == 0, _NEG)
        return (torch.softmax(scores, -1)[..., None] * h).sum(1)


class BagClassifier(nn.Module):
    def __init__(self, vocab: int = 50, dim: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim, padding_idx=0)
        self.pool = AttentionPool(dim)
        self.out = nn.Linear(dim, 2)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.out(self.pool(self.embed(ids), mask))


def stopword_batch() -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    """``((input_ids, attention_mask), labels)`` of four reviews; the stop-word filter left review 3 empty."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 50, (4, 6), generator=g)
    lengths = torch.tensor([6, 4, 5, 0])
    mask = (torch.arange(6)[None, :] < lengths[:, None]).long()
    return (ids * mask, mask), torch.tensor([0, 1, 1, 0])


def _stopword_empty_sample_tuple_batch() -> Case:
    torch.manual_seed(0)
    model = BagClassifier()

    def fn(batch: tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        (ids, mask), labels = batch
        model.zero_grad()
        loss = F.cross_entropy(model(ids, mask), labels)
        loss.backward()
        return loss

    return Case(fn, (stopword_batch(),), model)


class HeadsAttention(nn.Module):
    def __init__(self, dim: int = 8, heads: int = 2) -> None:
        super().__init__()
        self.qkv = nn.Linear(dim, 3 * dim)
        self.heads = heads

    def forward(self, h: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        b, t, d = h.shape
        q, k, v = self.qkv(h).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2) / (d // self.heads) ** 0.5
        keep = attention_mask.bool()[:, None, None, :]
        scores = torch.where(keep, scores, torch.full_like(scores, _NEG))
        return (torch.softmax(scores, -1) @ v).transpose(1, 2).reshape(b, t, d)


class Reader(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(30, 8)
        self.attn = HeadsAttention()
        self.span = nn.Linear(8, 2)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.span(self.attn(self.embed(input_ids), attention_mask))


def _empty_passage_dict_where() -> Case:
    torch.manual_seed(0)
    model = Reader()
    ids = torch.randint(1, 30, (3, 5))
    attention_mask = torch.ones(3, 5, dtype=torch.long)
    attention_mask[1] = 0  # the retriever returned an empty passage for question 2
    attention_mask[2, 3:] = 0
    batch = {"input_ids": ids, "attention_mask": attention_mask, "start": torch.tensor([0, 0, 1])}

    def fn(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        model.zero_grad()
        logits = model(batch["input_ids"], batch["attention_mask"])
        loss = F.cross_entropy(logits[..., 0], batch["start"])
        loss.backward()
        return loss

    return Case(fn, (batch,), model)


SCENARIOS = (
    WildScenario(
        "stopword_empty_sample_tuple_batch",
        "LAION-AI/Open-Assistant#2001",
        "attention pooling over a tuple batch ((ids, mask), labels) where a stop-word filter emptied review 3",
        Expect("op.masked_softmax", "aten._softmax.default", "pool", "forward", "nan"),
        "review 3 has no token left, so its mask row is all 0, masked_fill makes its scores all -inf and the "
        "pool's softmax is 0/0; the mask is batch[0][1], row 3",
        _stopword_empty_sample_tuple_batch,
    ),
    WildScenario(
        "empty_passage_dict_where",
        "stevezheng23/reading_comprehension_tf#69",
        "multi-head attention masking with torch.where(mask, scores, -inf); one question's passage is empty",
        Expect("op.masked_softmax", "aten._softmax.default", "attn", "forward", "nan"),
        "batch['attention_mask'] row 1 is all zeros, so every key of that sample is -inf in every head and "
        "the attention softmax is 0/0",
        _empty_passage_dict_where,
    ),
)
