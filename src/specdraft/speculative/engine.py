"""The generation loop, one step at a time: requests join and leave between rounds.

Plain decoding is the same loop with no drafter (every round verifies just [b], K = 0), so
there is one code path to make fast and to prove exact. Per round, per decoding row:

    drafts d1..dK      = drafter.propose(b, hidden at p, target cache 0..p)
    P0..PK             = target([b, d1..dK]) at positions p+1..p+K+1   (one forward)
    n, t               = verify (greedy or rejection sampling)
    emit d1..dn, t;      cache.rollback(p + n + 2);  p += n + 1;  b = t

Rows live in the slots of one preallocated cache: slots [0, n_dec) decode, the slots after them
hold requests still prefilling (chunk by chunk, so a long prompt never stalls the others for more
than one chunk per step). A finished row leaves at once: the last decoding row moves into its
slot, so a round always covers the contiguous rows 0..n_dec-1 and no compute goes to dead rows.
`generate()` is the same engine driven to completion for one batch. How many drafts a round
carries (0: a plain round) is the draft policy's choice (policy.py): fixed K, or adaptive. A
request's own bookkeeping is rows.py; verifying a round by sampling group is group_verify.py.

The file runs past 400 lines on purpose: slots, prefill and the round all move rows in the one
cache and its row buffers, and split apart each would reach into the others' state.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Callable, NamedTuple

import torch

from specdraft.drafters.base import Draft, Drafter, DraftInput
from specdraft.errors import SpecdraftError
from specdraft.kv_cache import PREFILL_CHUNK, SHORT_FORWARD
from specdraft.sampling import SamplingParams
from specdraft.speculative.group_verify import draft_sampling, verify_rows
from specdraft.speculative.policy import DraftPolicy, FixedPolicy
from specdraft.speculative.prefix_cache import PrefixCache
from specdraft.speculative.request import GenerationResult, Request, SamplingGroup
from specdraft.speculative.rows import ActiveRow
from specdraft.speculative.stats import Timer
from specdraft.speculative.stops import StopChecker
from specdraft.tokenizer import Tokenizer

MAX_DRAFT_TOKENS = 32


class Engine:
    def __init__(self, model: torch.nn.Module, tokenizer: Tokenizer | None = None,
                 drafter: Drafter | None = None, draft_tokens: int = 4, max_batch_size: int = 8,
                 capacity: int | None = None, prefill_chunk: int = PREFILL_CHUNK, speculate_below: int | None = None,
                 policy: DraftPolicy | None = None, prefix_cache: PrefixCache | None = None):
        """`capacity`: positions per row (prompt + new tokens + a round of drafts) for requests
        added with `add`; default the model's context. `generate` sizes its own batch.
        `policy`: how many drafts each round verifies (speculative/policy.py); `draft_tokens` is
        then the most the MTP drafter proposes. Default: a FixedPolicy, the drafter's full width
        every round, except plain rounds from `speculate_below` decoding rows on (None: never);
        `speculate_below` is read by that default only. `prefix_cache`: finished requests' K/V,
        restored for a joining request that starts with the same tokens (prefix_cache.py)."""
        if drafter is not None and not 1 <= draft_tokens <= MAX_DRAFT_TOKENS:
            raise SpecdraftError(f"draft_tokens (K) must be between 1 and {MAX_DRAFT_TOKENS}, got {draft_tokens}")
        self.model = model
        self.tokenizer = tokenizer
        self.drafter = drafter
        self.k = draft_tokens if drafter is not None else 0
        self.width = drafter.max_drafts(self.k) if drafter is not None else 0  # most drafts per round
        self.max_batch_size = max_batch_size
        self.serve_capacity = min(capacity or self.max_context(), self.max_context())
        self.prefill_chunk = prefill_chunk
        self.speculate_below = speculate_below
        self.policy = policy if policy is not None else FixedPolicy(self.width, speculate_below)
        self.prefix_cache = prefix_cache
        self.timer = Timer(self.device)
        self.waiting: deque[ActiveRow] = deque()
        self.slots: list[ActiveRow] = []  # slots[:n_dec] decode, the rest prefill
        self.n_dec = 0
        self.cache = None  # allocated by the first request (see _allocate)
        self.cache_bytes = 0
        self._finished: list[GenerationResult] = []

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    def max_context(self) -> int:
        return self.model.config.max_position_embeddings

    # --- the public step-wise API ---------------------------------------------------------
    def add(self, req: Request, group: SamplingGroup | None = None) -> None:
        """Queue a request; it joins the batch at the next step with a free slot."""
        if self.cache is None:
            self._allocate(self.max_batch_size, self.serve_capacity, self.serve_capacity)
        self.check(req)
        if group is None:
            group = SamplingGroup.create(req.sampling, self.device, sample_drafts=False)
        eos = set(req.eos_token_ids if req.eos_token_ids is not None else
                  (self.tokenizer.eos_token_ids if self.tokenizer else []))
        stops = StopChecker(self._decode, req.stop) if req.stop and self.tokenizer is not None else None
        self.waiting.append(ActiveRow(req, group, eos, stops, self.width, self.timer.totals,
                                 self.policy.new_row(self._source(False), self._mixes_lookups, req.prompt,
                                                     not group.params.greedy and group.params.shaping)))

    @torch.inference_mode()
    def abort(self, request_id: int) -> GenerationResult | None:
        """Drop a request wherever it is (queued, prefilling or decoding); its slot is free at once."""
        for row in self.waiting:
            if row.req.id == request_id:
                self.waiting.remove(row)
                return self._result(row, "abort")
        for slot, row in enumerate(self.slots):
            if row.req.id == request_id:
                self._save_prefix(slot)  # what it holds is valid: a stopped chat reply stays reusable
                self._remove(slot)
                return self._result(row, "abort")
        return None

    def reset(self) -> list[Request]:
        """Drop every request and free the cache: after an error mid-step no row's state can be
        trusted. Returns the queued requests, which never reached the cache and may be added again."""
        queued = [row.req for row in self.waiting]
        self.cache, self.hidden, self.slots, self.waiting, self.n_dec = None, None, [], deque(), 0
        if self.prefix_cache is not None:  # nor can what the failing step saved
            self.prefix_cache.clear()
        return queued

    def prepare_policy(self, rows: int) -> None:
        """Let the draft policy measure what it needs for batches of up to `rows` rows now (the
        adaptive policy's one-time step costs) rather than when the first batch starts, so that no
        timed generation or served request waits on it."""
        if self.drafter is not None:
            self.policy.prepare(self.model, self.drafter, rows, self.k, self.width)

    def check(self, req: Request) -> None:
        """Raise SpecdraftError if the request cannot run here (add checks it too)."""
        self._check_request(req)
        n = len(req.prompt)
        if n + req.max_new_tokens > self.room:
            raise SpecdraftError(f"prompt of {n} tokens + {req.max_new_tokens} new tokens exceeds the "
                                 f"engine's context of {self.room} tokens")

    @property
    def room(self) -> int:
        """Prompt + new tokens a request may have (a round may write width + 1 past its end)."""
        return (self.capacity if self.cache is not None else self.serve_capacity) - self.width - 1

    def has_work(self) -> bool:
        return bool(self.waiting or self.slots)

    @property
    def num_running(self) -> int:
        return len(self.slots)

    @torch.inference_mode()
    def step(self) -> list[GenerationResult]:
        """Admit waiting requests, prefill one chunk of the joining ones, run one round for the
        decoding rows. Returns the requests that finished in this step."""
        self._finished = []
        self._admit()
        self._prefill()
        if self.n_dec:
            self._round()
        return self._finished

    @torch.inference_mode()
    def generate(
        self,
        prompts: list[list[int]],
        max_new_tokens: int = 128,
        sampling: SamplingParams = SamplingParams(),
        stop: tuple[str, ...] = (),
        eos_token_ids: list[int] | None = None,
        on_tokens: Callable[[int, list[int]], None] | None = None,
        on_prefill: Callable[[int, int], None] | None = None,
    ) -> list[GenerationResult]:
        """Generate for a batch of tokenized prompts. `on_tokens(row, ids)` streams new ids;
        `on_prefill(done, total)` follows the prompts' prefill, after each step that ran some."""
        if self.has_work():
            raise SpecdraftError("generate() needs an idle engine (requests are being served)")
        self._check(prompts, max_new_tokens)
        longest = max(len(p) for p in prompts)
        self._allocate(len(prompts), longest + max_new_tokens + self.width + 2, longest)
        group = SamplingGroup.create(sampling, self.device, sample_drafts=True)
        reqs = [Request(p, max_new_tokens, sampling, stop, eos_token_ids, _row_callback(on_tokens, i))
                for i, p in enumerate(prompts)]
        for r in reqs:
            self.add(r, group)
        done: dict[int, GenerationResult] = {}
        total = sum(len(p) for p in prompts)
        try:
            while self.has_work():
                done.update((r.request_id, r) for r in self.step())
                if on_prefill is not None and (left := self._prompt_tokens_left()) < total:
                    on_prefill(total - left, total)
                    on_prefill = None if left == 0 else on_prefill
        finally:
            # A batch's cache lives as long as the batch (and an error leaves nothing behind).
            self.cache, self.slots, self.waiting, self.n_dec = None, [], deque(), 0
        return [done[r.id] for r in reqs]

    def _prompt_tokens_left(self) -> int:
        rows = list(self.slots) + list(self.waiting)
        return sum(len(r.req.prompt) - r.prefilled for r in rows)

    # --- checks -------------------------------------------------------------------------------
    def _check(self, prompts: list[list[int]], max_new_tokens: int) -> None:
        if not prompts:
            raise SpecdraftError("no prompts given")
        for p in prompts:
            self._check_request(Request(p, max_new_tokens))

    def _check_request(self, req: Request) -> None:
        if req.max_new_tokens < 1:
            raise SpecdraftError(f"max_new_tokens must be >= 1, got {req.max_new_tokens}")
        if len(req.prompt) == 0:
            raise SpecdraftError("a prompt is empty (no tokens after tokenization)")
        n, ctx = len(req.prompt), self.max_context()
        if n + req.max_new_tokens > ctx:
            raise SpecdraftError(f"prompt of {n} tokens + {req.max_new_tokens} new tokens exceeds the model's "
                                 f"context of {ctx} tokens")

    # --- slots --------------------------------------------------------------------------------
    def _allocate(self, rows: int, capacity: int, longest_prompt: int) -> None:
        """Cache and buffers for `rows` requests (+1 scratch row for swaps). A prefill forward pads
        every row to the widest chunk, so a row may write up to a chunk past its prompt."""
        dev, spare = self.device, min(self.prefill_chunk, longest_prompt)
        self.capacity = capacity
        # Sliding layers may keep rings: no forward here writes more than a prefill chunk or a
        # verify, and no rollback reaches back further than the forward it undoes.
        reads = self.drafter.reads_window() if self.drafter is not None else None
        # The scratch row serves swaps only, and one row is never swapped: at batch 1 the KV
        # cache (400 MB at E2B's 32k tokens) is not doubled for it.
        cache_rows = rows + 1 if rows > 1 else 1
        self.cache = self.model.new_cache(cache_rows, capacity + spare, max(self.prefill_chunk, self.width + 1), reads)
        self.cache_bytes = self.cache.nbytes()  # reported after a batch, when the cache is gone
        self.tokens = torch.zeros(rows + 1, capacity + spare + self.width + 2, dtype=torch.long, device=dev)
        self.last = torch.zeros(rows + 1, dtype=torch.long, device=dev)
        self.position = torch.zeros(rows + 1, dtype=torch.long, device=dev)
        self.hidden: torch.Tensor | None = None  # [rows + 1, H], shaped by the first prefill
        self.ones = torch.ones(rows + 1, dtype=torch.bool, device=dev)
        self.rows_max = rows
        if self.drafter is not None:
            # The policy may time the drafter on scratch state first: prepare the drafter after it.
            self.policy.prepare(self.model, self.drafter, rows, self.k, self.width)
            self.drafter.prepare(rows + 1, capacity + spare)

    def _admit(self) -> None:
        while self.waiting and len(self.slots) < self.rows_max:
            row = self.waiting.popleft()
            slot = len(self.slots)
            self.slots.append(row)
            self.cache.reset_row(slot)
            if self.drafter is not None:
                self.drafter.reset_row(slot)
            self.tokens[slot, : len(row.req.prompt)] = torch.tensor(row.req.prompt)
            if self.prefix_cache is not None:
                snapshot, n = self.prefix_cache.match(row.req.prompt, self.cache, self._restore_step())
                if n:
                    self.cache.restore_row(slot, snapshot, n)
                    row.prefilled = row.stats.cached_tokens = n

    def _move(self, src: int, dst: int) -> None:
        """Storage of slot src -> slot dst (the host list is the caller's business)."""
        self.cache.copy_row(src, dst)
        for t in (self.tokens, self.last, self.position) + ((self.hidden,) if self.hidden is not None else ()):
            t[dst] = t[src]
        if self.drafter is not None:
            self.drafter.move_row(src, dst)

    def _swap(self, a: int, b: int) -> None:
        scratch = self.rows_max
        self._move(a, scratch)
        self._move(b, a)
        self._move(scratch, b)
        self.slots[a], self.slots[b] = self.slots[b], self.slots[a]

    def _remove(self, slot: int) -> None:
        """Free a slot, keeping decoding rows at 0..n_dec-1 and prefilling ones right after."""
        last = len(self.slots) - 1
        if slot < self.n_dec:
            hole = self.n_dec - 1
            if slot != hole:
                self._move(hole, slot)
                self.slots[slot] = self.slots[hole]
            self.n_dec -= 1
            slot = hole
        if slot != last:  # a prefilling row fills the hole
            self._move(last, slot)
            self.slots[slot] = self.slots[last]
        self.slots.pop()

    def _remove_finished(self) -> None:
        # Highest slot first: a row moved into a freed slot is then always a live one.
        for slot in sorted((i for i, r in enumerate(self.slots) if r.done), reverse=True):
            self._save_prefix(slot)
            self._remove(slot)

    def _save_prefix(self, slot: int) -> None:
        """Keep a finished row's K/V under the ids of the positions it holds (prefix_cache.py)."""
        if self.prefix_cache is None:
            return
        n = self.cache.host_lengths[slot]
        prompt = self.slots[slot].req.prompt
        self.prefix_cache.save(self.tokens[slot, :n].tolist(), self.cache.snapshot_row(slot), len(prompt),
                               self._restore_step())

    def _restore_step(self) -> int:
        """What a restored prefix's length is a multiple of: 1 where the target computes each
        position alone whatever chunk it is in, else the prefill chunk (prefix_cache.py)."""
        return 1 if self.model.prefill_rows_alone(self.cache) else self.prefill_chunk

    # --- prefill ------------------------------------------------------------------------------
    def _prefill(self) -> None:
        """One chunk per joining row; while nobody decodes there is nobody to stall: keep going."""
        while len(self.slots) > self.n_dec:
            self._prefill_chunk()
            self._remove_finished()
            if self.n_dec:
                break

    def _prefill_chunk(self) -> None:
        lo, hi = self.n_dec, len(self.slots)
        rows = self.slots[lo:hi]
        # Chunks start at multiples of prefill_chunk from each prompt's start, whatever else
        # joins, and are grouped so that a row's arithmetic never depends on its neighbours
        # (_prefill_groups).
        starts = [r.prefilled for r in rows]
        counts = [min(self.prefill_chunk, len(r.req.prompt) - r.prefilled) for r in rows]
        last_hidden, done = [], []
        for a, b in _prefill_groups(counts):
            hidden = self._prefill_rows(lo + a, starts[a:b], counts[a:b])
            for j in range(a, b):
                rows[j].prefilled += counts[j]
                if rows[j].prefilled == len(rows[j].req.prompt):
                    done.append(j)
                    last_hidden.append(hidden[j - a, counts[j] - 1])
        if done:
            self._start_decoding([lo + j for j in done], torch.stack(last_hidden))

    def _prefill_rows(self, lo: int, starts: list[int], counts: list[int]) -> torch.Tensor:
        """One forward over slots lo.. of the next `counts` prompt tokens from `starts`."""
        dev, width = self.device, max(counts)
        cols = torch.tensor(starts, device=dev)[:, None] + torch.arange(width, device=dev)
        hi = lo + len(counts)
        cache = self.cache.rows(lo, hi)
        with self.timer.phase("verify"):
            hidden = self.model(self.tokens[lo:hi].gather(1, cols), cache)
        cache.rollback([s + c for s, c in zip(starts, counts)])
        return hidden

    def _start_decoding(self, slots: list[int], hidden: torch.Tensor) -> None:
        """Prefill done for the rows in `slots` (ascending): the first token comes from the
        prompt's last logits, and the rows move to the end of the decoding range."""
        rows = [self.slots[i] for i in slots]
        if self.hidden is None:
            self.hidden = hidden.new_zeros(self.tokens.shape[0], hidden.shape[-1])
        with self.timer.phase("verify"):
            none = torch.zeros(len(rows), 0, dtype=torch.long, device=self.device)
            _, first, _ = verify_rows(self.model, hidden[:, None], Draft(none, none.new_zeros(len(rows))), rows)
        for slot in slots:  # each swap only touches slots below the next one
            if slot != self.n_dec:
                self._swap(slot, self.n_dec)
            self.n_dec += 1
        lo, hi = self.n_dec - len(rows), self.n_dec
        lengths = torch.tensor([len(r.req.prompt) for r in rows], device=self.device)
        self.hidden[lo:hi] = hidden
        self.last[lo:hi] = first
        self.position[lo:hi] = lengths - 1
        self.tokens[lo:hi].scatter_(1, lengths[:, None], first[:, None])
        now = time.perf_counter()
        for row, t in zip(rows, first.tolist()):
            row.position, row.first_token_at = len(row.req.prompt) - 1, now
            row.stats.target_forwards += 1
            self._emit(row, [t], ["target"])

    # --- one round ----------------------------------------------------------------------------
    def _round(self) -> None:
        n, rows, timer = self.n_dec, self.slots[: self.n_dec], self.timer
        started = time.perf_counter()
        cache = self.cache.rows(0, n)
        last, position = self.last[:n], self.position[:n]
        with timer.phase("draft"):
            # Rows that asked for no drafting (Request.speculative) take no part in the choice.
            drafting = [r.acceptance for r in rows if r.req.speculative]
            width = self.policy.choose(drafting) if self.drafter is not None and drafting else 0
            inp = DraftInput(last, self.hidden[:n], position, cache, self.tokens[:n], self.ones[:n],
                             self._no_lookup(rows) if width else None)
            draft = self._draft(inp, rows, width)
        kk = draft.tokens.shape[1]
        with timer.phase("verify"):
            out = self.model(torch.cat([last[:, None], draft.tokens], dim=1), cache)
            block = self.policy.head_block() if kk else None  # positions per head call: the cheapest here
            accepted, nxt, chances = verify_rows(self.model, out, draft, rows, block)
        with timer.phase("other"):
            # Accept: write b's successors d1..dn, t into the history; the cache keeps b and d1..dn.
            steps = torch.arange(kk + 1, device=self.device)
            emitted = torch.cat([draft.tokens, nxt[:, None]], dim=1).scatter(1, accepted[:, None], nxt[:, None])
            keep = steps[None, :] <= accepted[:, None]
            cols = torch.where(keep, position[:, None] + 2 + steps[None, :], self.tokens.shape[1] - 1)
            self.tokens[:n].scatter_(1, cols, emitted)
            self.hidden[:n] = out[torch.arange(n, device=self.device), accepted]
            position += accepted + 1
            last.copy_(nxt)
            lookup = draft.lookup if draft.lookup is not None else torch.zeros_like(accepted, dtype=torch.bool)
            # One host sync for everything the bookkeeping needs: per row the emitted tokens, then
            # the accepted count, the drafts verified and whether they were looked up.
            host = torch.cat([emitted, accepted[:, None], draft.num_valid[:, None], lookup[:, None].long()], 1).tolist()
            self.policy.observe_round(time.perf_counter() - started)  # the host sync above ends the round's work
            chance_rows = chances.tolist() if chances is not None else [None] * n
            counts = [_RoundCounts(*h[kk + 1:]) for h in host]
            cache.rollback([r.position + c.accepted + 2 for r, c in zip(rows, counts)])
            for row, h, c, chance in zip(rows, host, counts, chance_rows):
                a, valid = c.accepted, c.drafted
                row.position += a + 1
                s = row.stats
                s.target_forwards += 1
                for j in range(valid):
                    s.drafted_by_position[j] += 1
                for j in range(a):
                    s.accepted_by_position[j] += 1
                source = self._source(c.looked_up)
                self.policy.observe(row.acceptance, source if kk else None, valid, a,
                                    None if row.group.params.greedy else chance, width)
                self._emit(row, h[: a + 1], [source] * a + ["target"])
            self._remove_finished()

    def _source(self, looked_up: bool) -> str:
        """Where a row's drafts came from, as the draft policy tells sources apart (Drafter.source)."""
        if looked_up:
            return "lookup"
        return self.drafter.source if self.drafter is not None else "draft"

    @property
    def _mixes_lookups(self) -> bool:
        """Whether some rounds' drafts are prompt lookups and others the drafter's own (mtp+ngram)."""
        return self.drafter is not None and self.drafter.mixes_lookups

    def _no_lookup(self, rows: list[ActiveRow]) -> torch.Tensor | None:
        """The rows whose drafts the policy wants from the drafter, not prompt lookup
        (DraftPolicy.skips_lookup), for a drafter that mixes lookups in; None where there are none."""
        if not self._mixes_lookups:
            return None
        skip = [self.policy.skips_lookup(r.acceptance) for r in rows]
        return torch.tensor(skip, device=self.device) if any(skip) else None

    def _draft(self, inp: DraftInput, rows: list[ActiveRow], width: int) -> Draft:
        """Up to `width` drafts per row (0: a plain round); the drafter runs at most min(width, K) steps."""
        n = inp.last_token.shape[0]
        if self.drafter is None or width == 0:
            return Draft(inp.last_token.new_zeros(n, 0), inp.last_token.new_zeros(n))
        k = min(width, self.k)
        draft = _truncate(self.drafter.propose(inp, k, *draft_sampling(rows)), width)
        if not all(r.req.speculative for r in rows):  # their drafts are filler: none is accepted
            asked = torch.tensor([r.req.speculative for r in rows], device=self.device)
            draft.num_valid = torch.where(asked, draft.num_valid, 0)
        return draft

    # --- output -------------------------------------------------------------------------------
    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids) if self.tokenizer else ""

    def _emit(self, row: ActiveRow, new: list[int], sources: list[str]) -> None:
        """Append a round's tokens to a row (ActiveRow.take), stream them, finish the row if it ended."""
        self.policy.extend(row.acceptance, new)
        new = row.take(new)
        if row.req.on_tokens is not None and new:
            row.req.on_tokens(new, sources[: len(new)])
        if row.done:
            self._finished.append(self._result(row, row.finish_reason))

    def _result(self, row: ActiveRow, reason: str) -> GenerationResult:
        return row.result(reason, self.timer.totals, self._decode)


class _RoundCounts(NamedTuple):
    """A row's round, as the host reads it back: drafts accepted, drafts verified, looked up."""

    accepted: int
    drafted: int
    looked_up: int


def _truncate(draft: Draft, width: int) -> Draft:
    """The first `width` drafts of each row (lookups may propose more than the policy wants). A
    prefix of sequentially drawn drafts is itself an exact draw, so sampling stays exact."""
    if draft.tokens.shape[1] <= width:
        return draft
    probs = draft.probs[:, :width] if draft.probs is not None else None
    return Draft(draft.tokens[:, :width], draft.num_valid.clamp(max=width), probs, draft.lookup)


def _row_callback(on_tokens: Callable[[int, list[int]], None] | None, i: int):
    if on_tokens is None:
        return None
    return lambda ids, sources: on_tokens(i, ids)


def _prefill_groups(counts: list[int]) -> list[tuple[int, int]]:
    """[a, b) ranges of joining rows prefilled in one forward each. Chunks of at most SHORT_FORWARD
    tokens go together: the step kernels compute every row alone, over keys masked past its own.
    A longer chunk goes by itself: its GEMM (maybe in bf16, models/formats/block_linear.py) and the CPU
    flash attention block their sums by the forward's width and key span, which padding to a
    neighbour's chunk would change. [5, 6, 40, 3] -> [(0, 2), (2, 3), (3, 4)]."""
    groups, a = [], 0
    for i in range(1, len(counts) + 1):
        if i == len(counts) or counts[i] > SHORT_FORWARD or counts[a] > SHORT_FORWARD:
            groups.append((a, i))
            a = i
    return groups
