"""The generation loop: prefill, then rounds of draft -> verify -> accept, for a batch of rows.

Plain decoding is the same loop with no drafter (every round verifies just [b], K = 0), so
there is one code path to make fast and to prove exact. Per round, per row:

    drafts d1..dK      = drafter.propose(b, hidden at p, target cache 0..p)
    P0..PK             = target([b, d1..dK]) at positions p+1..p+K+1   (one forward)
    n, t               = verify (greedy or rejection sampling)
    emit d1..dn, t;      cache.rollback(p + n + 2);  p += n + 1;  b = t

Rows keep their own p, acceptance and stop state; finished rows stay in the batch with their
cache frozen and their outputs ignored.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from specdraft.drafters.base import Draft, Drafter, DraftInput
from specdraft.errors import SpecdraftError
from specdraft.sampling import SamplingParams, probabilities, sample
from specdraft.speculative.stats import RequestStats, Timer
from specdraft.speculative.verify import verify_greedy, verify_sampling
from specdraft.tokenizer import Tokenizer

MAX_DRAFT_TOKENS = 32


@dataclass
class GenerationResult:
    prompt_ids: list[int]
    token_ids: list[int]  # new tokens only (EOS included when it ended the row)
    text: str
    finish_reason: str  # "eos" | "length" | "stop"
    stats: RequestStats
    seconds: float  # from the start of the batch until this row finished
    ttft: float  # time to first token (the batch's prefill)


@dataclass
class _Row:
    ids: list[int] = field(default_factory=list)
    done: bool = False
    finish_reason: str = "length"
    text: str = ""
    finished_at: float = 0.0


class Engine:
    def __init__(self, model: torch.nn.Module, tokenizer: Tokenizer | None = None,
                 drafter: Drafter | None = None, draft_tokens: int = 4):
        if drafter is not None and not 1 <= draft_tokens <= MAX_DRAFT_TOKENS:
            raise SpecdraftError(f"--draft-tokens must be between 1 and {MAX_DRAFT_TOKENS}, got {draft_tokens}")
        self.model = model
        self.tokenizer = tokenizer
        self.drafter = drafter
        self.k = draft_tokens if drafter is not None else 0
        self.width = drafter.max_drafts(self.k) if drafter is not None else 0  # most drafts per round

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    def max_context(self) -> int:
        return self.model.config.max_position_embeddings

    @torch.inference_mode()
    def generate(
        self,
        prompts: list[list[int]],
        max_new_tokens: int = 128,
        sampling: SamplingParams = SamplingParams(),
        stop: tuple[str, ...] = (),
        eos_token_ids: list[int] | None = None,
        on_tokens: Callable[[int, list[int]], None] | None = None,
    ) -> list[GenerationResult]:
        """Generate for a batch of tokenized prompts. `on_tokens(row, ids)` streams new ids."""
        self._check(prompts, max_new_tokens)
        dev, k, b_size = self.device, self.width, len(prompts)
        eos = set(eos_token_ids if eos_token_ids is not None else (self.tokenizer.eos_token_ids if self.tokenizer else []))
        generator = None
        if not sampling.greedy:
            generator = torch.Generator(device=dev)
            generator.manual_seed(sampling.seed if sampling.seed is not None else torch.seed())
        timer = Timer(dev)
        lengths = torch.tensor([len(p) for p in prompts], device=dev)
        # A row may overshoot max_new_tokens by a round (K + 1) and, once finished, keeps
        # writing a round's worth of filler past its frozen length.
        capacity = int(lengths.max()) + max_new_tokens + 2 * (k + 1)
        cache = self.model.new_cache(b_size, capacity)
        tokens = torch.zeros(b_size, capacity + k + 2, dtype=torch.long, device=dev)
        for i, p in enumerate(prompts):
            tokens[i, : len(p)] = torch.tensor(p)
        if self.drafter is not None:
            self.drafter.prepare(b_size, capacity)
        rows_idx = torch.arange(b_size, device=dev)
        stats = [RequestStats(k) for _ in prompts]

        # Prefill: the whole (right-padded) prompt batch in one forward, keep each row's length.
        with timer.phase("verify"):
            hidden = self.model(tokens[:, : int(lengths.max())], cache)
            cache.rollback(lengths)
            hidden = hidden[rows_idx, lengths - 1]
            logits = self.model.logits(hidden)
            last = logits.argmax(-1) if sampling.greedy else sample(probabilities(logits, sampling), generator)
        ttft = timer.elapsed()
        position = lengths - 1
        tokens[rows_idx, lengths] = last
        rows = [_Row() for _ in prompts]
        first = last.tolist()
        for i, row in enumerate(rows):
            stats[i].target_forwards += 1
            self._emit(i, row, [first[i]], max_new_tokens, eos, stop, on_tokens, timer)
        active = torch.tensor([not r.done for r in rows], device=dev)
        drafted_pos = torch.zeros(b_size, k, dtype=torch.long, device=dev)
        accepted_pos = torch.zeros(b_size, k, dtype=torch.long, device=dev)

        while not all(r.done for r in rows):
            with timer.phase("draft"):
                draft = self._draft(DraftInput(last, hidden, position, cache, tokens, active), sampling, generator)
            kk = draft.tokens.shape[1]
            with timer.phase("verify"):
                out = self.model(torch.cat([last[:, None], draft.tokens], dim=1), cache)
                logits = self.model.logits(out)
                if sampling.greedy:
                    n, nxt = verify_greedy(logits, draft.tokens, draft.num_valid)
                else:
                    probs = probabilities(logits, sampling)
                    n, nxt = verify_sampling(probs, draft.tokens, draft.probs, draft.num_valid, generator)
            with timer.phase("other"):
                # Accept: keep b and the n accepted drafts in the cache; frozen rows keep theirs.
                cache.rollback(torch.where(active, position + n + 2, position + 1))
                hidden = torch.where(active[:, None], out[rows_idx, n], hidden)
                steps = torch.arange(kk + 1, device=dev)
                emitted = torch.cat([draft.tokens, nxt[:, None]], dim=1)
                emitted = emitted.scatter(1, n[:, None], nxt[:, None])
                keep = (steps[None, :] <= n[:, None]) & active[:, None]
                slots = torch.where(keep, position[:, None] + 2 + steps[None, :], tokens.shape[1] - 1)
                tokens.scatter_(1, slots, emitted)
                position = torch.where(active, position + n + 1, position)
                last = torch.where(active, nxt, last)
                if kk:
                    valid = (steps[None, :kk] < draft.num_valid[:, None]) & active[:, None]
                    drafted_pos[:, :kk] += valid
                    accepted_pos[:, :kk] += (steps[None, :kk] < n[:, None]) & active[:, None]
                emitted_l, n_l, active_l = emitted.tolist(), n.tolist(), active.tolist()
                for i, row in enumerate(rows):
                    if active_l[i]:
                        stats[i].target_forwards += 1
                        self._emit(i, row, emitted_l[i][: n_l[i] + 1], max_new_tokens, eos, stop, on_tokens, timer)
                active = torch.tensor([not r.done for r in rows], device=dev)

        drafted_l, accepted_l = drafted_pos.tolist(), accepted_pos.tolist()
        results = []
        for i, (p, row) in enumerate(zip(prompts, rows)):
            s = stats[i]
            s.new_tokens = len(row.ids)
            s.drafted_by_position, s.accepted_by_position = drafted_l[i], accepted_l[i]
            s.times = dict(timer.totals)
            text = row.text if row.finish_reason == "stop" else self._decode(row.ids)
            results.append(GenerationResult(list(p), row.ids, text, row.finish_reason, s, row.finished_at, ttft))
        return results

    def _check(self, prompts: list[list[int]], max_new_tokens: int) -> None:
        if not prompts:
            raise SpecdraftError("no prompts given")
        if max_new_tokens < 1:
            raise SpecdraftError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if any(len(p) == 0 for p in prompts):
            raise SpecdraftError("a prompt is empty (no tokens after tokenization)")
        longest = max(len(p) for p in prompts)
        if longest + max_new_tokens > self.max_context():
            raise SpecdraftError(
                f"prompt of {longest} tokens + {max_new_tokens} new tokens exceeds the model's context of "
                f"{self.max_context()} tokens"
            )

    def _draft(self, inp: DraftInput, sampling: SamplingParams, generator: torch.Generator | None) -> Draft:
        if self.drafter is None:
            b = inp.last_token.shape[0]
            return Draft(inp.last_token.new_zeros(b, 0), inp.last_token.new_zeros(b))
        return self.drafter.propose(inp, self.k, sampling, generator)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids) if self.tokenizer else ""

    def _emit(self, i: int, row: _Row, new: list[int], max_new: int, eos: set[int], stop: tuple[str, ...],
              on_tokens, timer: Timer) -> None:
        """Append a round's tokens to a row, cutting at EOS, max_new_tokens or a stop string."""
        new = new[: max_new - len(row.ids)]
        for j, t in enumerate(new):
            if t in eos:
                new = new[: j + 1]
                row.done, row.finish_reason = True, "eos"
                break
        row.ids.extend(new)
        if len(row.ids) >= max_new and not row.done:
            row.done, row.finish_reason = True, "length"
        if stop and self.tokenizer is not None:
            # Token by token, as plain decoding checks: keep no tokens past the one that completes
            # a stop string, so token_ids do not depend on how many tokens a round emitted.
            for end in range(len(row.ids) - len(new) + 1, len(row.ids) + 1):
                text = self._decode(row.ids[:end])
                cut = min((text.find(s) for s in stop if s in text), default=-1)
                if cut >= 0:
                    new = new[: len(new) - (len(row.ids) - end)]
                    del row.ids[end:]
                    row.text = text[:cut]
                    row.done, row.finish_reason = True, "stop"
                    break
        if on_tokens is not None and new:
            on_tokens(i, new)
        if row.done:
            row.finished_at = timer.elapsed()
