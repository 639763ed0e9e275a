"""An independent small model as drafter (classic speculative decoding).

It shares the target's tokenizer and keeps its own KV cache. Each round it first catches up
on the tokens the target accepted since its cache was last valid (ragged across rows, done
as one padded forward followed by a per-row rollback), then drafts K tokens one at a time.
Its cache stays correct by bookkeeping alone: accepted drafts equal the tokens it wrote, so
the valid prefix is min(its length, the target's), and the rest is rolled back.
"""

from __future__ import annotations

import torch

from specdraft.drafters.base import Draft, Drafter, DraftInput
from specdraft.errors import SpecdraftError
from specdraft.models.kernels.sample_rows import draw_tokens
from specdraft.models.kernels.truncated_probs import truncated_probabilities
from specdraft.sampling import RowStreams, SamplingParams


class DraftModelDrafter(Drafter):
    kind = "draft-model"

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.cache = None

    @classmethod
    def sharing_tokenizer(cls, target_rt, draft_rt) -> "DraftModelDrafter":
        """The draft runtime's model, once its tokenizer is checked against the target's
        (both are loaded runtimes: model, tokenizer, config)."""
        check_same_tokenizer(target_rt.tokenizer, draft_rt.tokenizer, target_rt.config.vocab_size,
                             draft_rt.config.vocab_size)
        return cls(draft_rt.model)

    def prepare(self, batch_size: int, capacity: int) -> None:
        self.cache = self.model.new_cache(batch_size, capacity + 1)

    def reset_row(self, row: int) -> None:
        self.cache.reset_row(row)

    def move_row(self, src: int, dst: int) -> None:
        self.cache.copy_row(src, dst)

    def nbytes(self) -> int:
        weights = sum(p.numel() * p.element_size() for p in self.model.parameters())
        return weights + (self.cache.nbytes() if self.cache is not None else 0)

    @torch.inference_mode()
    def propose(self, inp: DraftInput, k: int, sampling: SamplingParams,
                generator: torch.Generator | RowStreams | None) -> Draft:
        cache, dev = self.cache.rows(0, inp.tokens.shape[0]), inp.tokens.device  # the round's rows
        seq_len = inp.position + 2  # tokens known per row, b included
        cache.rollback(seq_len - 1)  # never beyond what the target accepted
        start = cache.lengths.clone()
        todo = seq_len - start  # >= 1 per row
        width = int(todo.max())
        cols = (start[:, None] + torch.arange(width, device=dev)[None, :]).clamp(max=inp.tokens.shape[1] - 1)
        hidden = self.model(inp.tokens.gather(1, cols), cache)
        cache.rollback(seq_len)
        rows = torch.arange(len(seq_len), device=dev)
        last = hidden[rows, todo - 1]
        tokens, probs = [], []
        for step in range(k):
            if sampling.greedy:
                token = self.model.greedy_tokens(last)
            else:
                q = truncated_probabilities(self.model.logits(last), sampling)
                token = draw_tokens(q, generator)
                probs.append(q)
            tokens.append(token)
            if step + 1 < k:
                last = self.model(token[:, None], cache)[:, 0]
        return Draft(torch.stack(tokens, 1), torch.where(inp.active, k, 0), torch.stack(probs, 1) if probs else None)


def check_same_tokenizer(target_tok, draft_tok, target_vocab: int, draft_vocab: int) -> None:
    """A draft model must map text to the same ids; compare vocabularies on a probe text."""
    probe = "The quick brown fox, 123 + 456 = 579; def f(x): return x * 2\n"
    if target_vocab != draft_vocab or target_tok.encode(probe) != draft_tok.encode(probe):
        raise SpecdraftError("the draft model's tokenizer differs from the target's "
                             f"(vocab {draft_vocab} vs {target_vocab}); a draft model must share the tokenizer")
