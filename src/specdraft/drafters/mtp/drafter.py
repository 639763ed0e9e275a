"""The MTP drafter at inference: K draft steps per round at the constant position p.

All K steps of a round query position p over the target's keys 0..p (sliding layers: the last
`window` of them); only the state changes between steps. So the attention context is built
once per round, the drafter keeps no cache, and a rollback of the target leaves it nothing to
undo.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from specdraft.drafters.base import Draft, Drafter, DraftInput, SparseProbs
from specdraft.drafters.mtp.copy import RoundCopies, add_copies, host_copy_columns
from specdraft.drafters.mtp.head import score
from specdraft.drafters.mtp.network import DraftStep, LayerContext, MTPNetwork
from specdraft.errors import SpecdraftError
from specdraft.kv_cache import KVCache, attention_span, ring_span
from specdraft.models.kernels.build import applies as kernels_apply
from specdraft.models.kernels.score_rows import draft_head
from specdraft.models.architectures.target import AttentionLayout
from specdraft.models.kernels.sample_rows import draw_tokens
from specdraft.models.kernels.truncated_probs import truncated_probabilities
from specdraft.sampling import RowStreams, SamplingParams

GREEDY_CONFIDENCE = SamplingParams(temperature=1.0)  # greedy drafts' confidence: the drafter's softmax
# Up to this many rows the copy gate places its copies among the candidates on the host (a few
# us a row) rather than by comparing with every candidate (~100 us a step); evaluation's
# thousands of anchors take the tensor path.
HOST_COLUMNS_ROWS = 64


def layer_contexts(sources: list[AttentionLayout], keys: list[torch.Tensor], values: list[torch.Tensor],
                   positions: torch.Tensor, dtype: torch.dtype, cache: KVCache | None = None) -> list[LayerContext]:
    """Contexts for queries at `positions` [B, T] over per-slot K/V [B, Hkv, S, D] (a KV cache's
    `k`/`v` lists at inference; the stored target K/V of whole sequences in training).

    Every query at q sees keys 0..q; in training T > 1 (one query per anchor), at inference
    T = 1 (q = p). Spans are shared between drafter layers that read the same target layer.
    `cache`: the cache the keys come from, where some slots keep a ring (kv_cache.py).
    """
    if positions.numel() <= HOST_COLUMNS_ROWS:  # a round's few rows: one host read, not four ops
        flat = positions.flatten().tolist()
        lowest, end = min(flat), max(flat) + 1
    else:
        lowest, end = (int(x) for x in torch.stack([positions.min(), positions.max() + 1]).tolist())
    built: dict[int, LayerContext] = {}
    out = []
    for src in sources:
        if src.slot not in built:
            ring = cache.rings[src.slot] if cache is not None else None
            if ring is None:
                span = attention_span(positions, lowest, end, src.window)
            else:
                span = ring_span(positions, cache.lengths, ring, max(cache.host_lengths), src.window)
            src.rope.ensure(end, positions.device)
            cos, sin = src.rope.lookup(positions, dtype)
            built[src.slot] = LayerContext(
                keys[src.slot][:, :, span.lo : span.hi], values[src.slot][:, :, span.lo : span.hi],
                span.mask, cos, sin, src.scale,
            )
        out.append(built[src.slot])
    return out


def stack_probs(steps: list, vocab: int) -> torch.Tensor | SparseProbs | None:
    """Per-step Q -> [B, K, V] (dense head) or SparseProbs (clustered head: (candidates, q) pairs)."""
    if not steps:
        return None
    if isinstance(steps[0], tuple):
        return SparseProbs(torch.stack([c for c, _ in steps], 1), torch.stack([q for _, q in steps], 1), vocab)
    return torch.stack(steps, 1)


def text_continuation(text: torch.Tensor, current: int) -> int | None:
    """The token that followed the most recent earlier occurrence of `current` in text, whose
    last entry is `current` itself (None if it did not occur before)."""
    hits = (text[:-1] == current).nonzero()
    return int(text[int(hits[-1]) + 1]) if len(hits) else None


def copy_unsure(inp: DraftInput, drafts: list[torch.Tensor], current: torch.Tensor, token: torch.Tensor,
                unsure: torch.Tensor) -> torch.Tensor:
    """`token` [B] with each unsure row's draft replaced by the text's continuation of its
    current token (the row's sequence so far and its drafts), where it has one."""
    # A vectorised scan of the row's text per unsure row (microseconds at a few thousand tokens).
    # drafters/lookup_index.py indexes emitted text only; the round's drafts count here too.
    token = token.clone()
    for row in unsure.nonzero().flatten().tolist():
        seen = inp.tokens[row, : int(inp.position[row]) + 2]
        text = torch.cat([seen] + [d[row : row + 1] for d in drafts])
        follow = text_continuation(text, int(current[row]))
        if follow is not None:
            token[row] = follow
    return token


class MTPDrafter(Drafter):
    """min_confidence (default: the drafter config's): a row stops drafting after a token the
    drafter gave less than this probability (among the tokens it scored); the round stops when
    every row has stopped. A
    late draft after an unsure one is rarely accepted, and each costs a drafter step and a
    wider verify. The choice reads only the drafter's own outputs, so sampling stays exact.

    copy_below (default: the config's; 0 = off), greedy only: where the drafter gives its pick
    less than this probability and the current token occurred earlier in the row's text, the
    draft is the token that followed it last time instead. Small base models repeat themselves,
    and the drafter misses most of those copies (BENCHMARKS.md, "Where the drafter's first draft
    fails, a copy fallback"). Verification is unchanged, so the output is still the target's."""

    kind = "mtp"
    source = "mtp"

    def __init__(self, net: MTPNetwork, target: torch.nn.Module, sources: list[AttentionLayout],
                 min_confidence: float | None = None, copy_below: float | None = None):
        self.net, self.target, self.sources = net, target, sources
        self.recommended_k = net.config.recommended_k
        self.min_confidence = net.config.min_confidence if min_confidence is None else min_confidence
        self.copy_below = net.config.copy_below if copy_below is None else copy_below
        self.round_copies = RoundCopies() if net.copy_gate is not None else None  # the gate's inputs
        self._token_slots = None  # the clustered head's token slots, on the host (host_copy_columns)
        self._slot_tensors = None  # the same as int32 tensors (_head_kernel)

    def reads_window(self) -> int | None:
        windows = [src.window for src in self.sources if src.window is not None]
        return max(windows) if windows else None

    def nbytes(self) -> int:
        return self.net.nbytes()

    def cost_key(self) -> str:
        """A clustered head's step reads the rows of the clusters it keeps: their count counts too."""
        kept = f":top{self.net.config.top_k_clusters}" if self.net.config.clustered else ""
        return super().cost_key() + kept

    @contextmanager
    def without_early_stop(self) -> Iterator[None]:
        stop = self.min_confidence
        self.min_confidence = 0.0
        try:
            yield
        finally:
            self.min_confidence = stop

    def set_min_confidence(self, value: float) -> None:
        """Override the config's early stop (0: every round drafts K)."""
        if not 0 <= value <= 1:  # NaN fails too
            raise SpecdraftError(f"min_confidence {value} must be between 0 and 1 (0: no early stop)")
        self.min_confidence = value

    def set_top_k_clusters(self, top_k: int) -> None:
        """Override how many clusters a clustered head keeps per draft step."""
        head = self.net.masked_embedding
        if head is None:
            raise SpecdraftError("this drafter has a dense head (no clusters to keep)")
        if not 1 <= top_k <= head.num_centroids:
            raise SpecdraftError(f"top-k clusters must be between 1 and {head.num_centroids}, got {top_k}")
        head.top_k = top_k

    def head_table_and_input(self, z: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the [V, d] table a clustered head scores its candidates against, the vectors it scores)."""
        if self.net.config.head == "own":
            return self.net.model.embed_tokens.weight, z
        return self.target.head_weight, state

    def dense_logits(self, z: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        """Every token's logit [N, V] (a dense head) through the head's own kernel where it has one:
        the drafter's table kept as GGUF blocks (`packed_head`), or the target's head; neither
        reads a float table (a GGUF target's and a GGUF assistant's stay in their files' blocks)."""
        if self.net.packed_head is not None:
            return self.net.packed_head(z).float()
        if self.net.config.head != "own":
            return self.target.head_scores(state).float()  # the target's own (packed) head
        return score(z, self.net.model.embed_tokens.weight, None)

    def logits(self, z: torch.Tensor, state: torch.Tensor, copies: torch.Tensor | None = None, sampled: bool = False,
               step: DraftStep | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """z [N, h], next state [N, H] -> (logits [N, M], candidate ids [N, M] or None for all V).
        `copies` [N, 2]: the current tokens' copy candidates (copy.py), for a drafter with a copy gate.
        `sampled`: for a sampled draft (a clustered head keeps its sampled_top_k clusters).
        `step`: the draft step z and state come from, with the head's inputs it computed, if any."""
        head, gated = self.net.masked_embedding, copies is not None and self.net.copy_gate is not None
        if head is None:  # every token scored; a copy's bonus is added in place (no table read)
            logits = self.dense_logits(z, state)
            if gated:
                logits, _ = add_copies(logits, None, copies, self.net.copy_gate(z), z, None)
            return logits, None
        table, vec = self.head_table_and_input(z, state)
        kept = head.sampled_top_k if sampled else head.top_k
        done = self._head_kernel(z, vec, table, copies if gated else None, kept=kept, step=step)
        if done is not None:
            return done
        top = head.top_clusters(z, kept)
        cands = head.candidates(z, top)
        logits = score(vec, table, cands)
        if gated:
            columns = None
            if len(copies) <= HOST_COLUMNS_ROWS:  # a few rows: find the columns on the host
                if self._token_slots is None:
                    self._token_slots = head.token_slots()
                cols, live = host_copy_columns(copies.tolist(), top.tolist(), self._token_slots, head.cluster_size)
                columns = (torch.tensor(cols, device=z.device), torch.tensor(live, device=z.device))
            logits, cands = add_copies(logits, cands, copies, self.net.copy_gate(z), vec, table, columns)
        return logits, cands

    def greedy_pick(self, step: DraftStep, copies: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(greedy draft [N], its probability [N]): the argmax and softmax of `logits`' logits, taken
        in the head's C call. None where that call does not serve (see _head_kernel)."""
        if self.net.masked_embedding is None:
            return None
        table, vec = self.head_table_and_input(step.z, step.state)
        gated = copies is not None and self.net.copy_gate is not None
        done = self._head_kernel(step.z, vec, table, copies if gated else None, pick=True, step=step)
        return None if done is None else done[2:]

    def _head_kernel(self, z: torch.Tensor, vec: torch.Tensor, table: torch.Tensor, copies: torch.Tensor | None,
                     pick: bool = False, kept: int | None = None, step: DraftStep | None = None) -> tuple | None:
        """The clustered head in one C call (score_rows.c draft_head): the top clusters, their tokens'
        scores and the copy bonuses, ~0.5 ms a step less than as tensor ops. None for a dense head,
        or where the kernels do not serve (not float32 on the CPU, SPECDRAFT_KERNELS=0). The centroid
        scores and copy bonus come from `step` where its C call computed them."""
        head = self.net.masked_embedding
        if head is None or not kernels_apply(vec) or table.dtype not in (torch.float16, torch.float32):
            return None
        if self._slot_tensors is None:
            self._slot_tensors = head.slot_tensors()
        scores, bonus = (step.centroid_scores, step.copy_bonus) if step is not None else (None, None)
        scores = head.centroids(z) if scores is None else scores
        if copies is None:
            bonus = None
        elif bonus is None:
            bonus = self.net.copy_gate(z)
        return draft_head(vec, table, scores, kept or head.top_k, head.clusters(), *self._slot_tensors,
                          copies, bonus, pick)

    def prepare(self, batch_size: int, capacity: int) -> None:
        if self.round_copies is not None:
            self.round_copies.index.reset(batch_size)

    def reset_row(self, row: int) -> None:
        if self.round_copies is not None:
            self.round_copies.index.reset_row(row)

    def move_row(self, src: int, dst: int) -> None:
        if self.round_copies is not None:
            self.round_copies.index.move_row(src, dst)

    def _pick(self, inp: DraftInput, drafts: list[torch.Tensor], current: torch.Tensor, step: DraftStep,
              copies: torch.Tensor | None, sampling: SamplingParams, generator: torch.Generator | RowStreams | None,
              drafting: torch.Tensor, probs: list, copy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A draft step's pick from `logits` (sampled drafts, copy_below, a dense head, no kernels):
        (token [N], its probability under the drafter, or None when nothing reads it). Sampled
        steps append the exact Q they drew from to `probs`."""
        if sampling.greedy:
            logits, cands = self.logits(step.z, step.state, copies)
        else:  # the step's centroid scores and copy bonus, where its C call computed them
            logits, cands = self.logits(step.z, step.state, copies, sampled=True, step=step)
        q = confidence = None
        if not sampling.greedy or self.min_confidence > 0 or copy:
            q = truncated_probabilities(logits, GREEDY_CONFIDENCE if sampling.greedy else sampling)
        if isinstance(generator, list):  # a row draws only while it drafts: its stream's use is its own
            generator = [g if d else None for g, d in zip(generator, drafting.tolist())]
        pick = logits.argmax(-1) if sampling.greedy else draw_tokens(q, generator)
        if q is not None:
            confidence = q.gather(1, pick[:, None]).squeeze(1)
        token = pick if cands is None else cands.gather(1, pick[:, None]).squeeze(1)
        if copy:
            unsure = drafting & (confidence < self.copy_below)
            if bool(unsure.any()):
                token = copy_unsure(inp, drafts, current, token, unsure)
        if not sampling.greedy:
            # The exact Q the token was drawn from: over the kept clusters' tokens only (0 elsewhere).
            probs.append(q if cands is None else (cands, q))
        return token, confidence

    @torch.inference_mode()
    def propose(self, inp: DraftInput, k: int, sampling: SamplingParams,
                generator: torch.Generator | RowStreams | None) -> Draft:
        b = inp.last_token.shape[0]
        dtype = inp.hidden.dtype
        contexts = layer_contexts(self.sources, inp.cache.k, inp.cache.v, inp.position[:, None], dtype, inp.cache)
        token, state = inp.last_token, inp.hidden
        tokens, probs = [], []
        vocab = self.target.config.vocab_size
        drafting = inp.active.clone()  # rows still drafting
        num_valid = torch.zeros(b, dtype=torch.long, device=inp.last_token.device)
        copy = sampling.greedy and self.copy_below > 0  # sampling needs Q: drafts stay the drafter's
        gated = self.round_copies is not None
        if gated:  # each row's text so far ends in its current token, at position + 1
            self.round_copies.start(inp.tokens, inp.position + 2)
        for _ in range(k):
            step = self.net.draft_step(self.target, token, state, contexts)
            state = step.state
            copies = self.round_copies.copies(token.device) if gated else None
            picked = self.greedy_pick(step, copies) if sampling.greedy and not copy else None
            if picked is None:
                picked = self._pick(inp, tokens, token, step, copies, sampling, generator, drafting, probs, copy)
            token, confidence = picked
            tokens.append(token)
            if gated:  # the draft is the next step's current token
                self.round_copies.extend(token)
            num_valid += drafting
            if self.min_confidence > 0:
                drafting &= confidence >= self.min_confidence
                if not bool(drafting.any()):
                    break
        return Draft(torch.stack(tokens, 1), num_valid, stack_probs(probs, vocab))
