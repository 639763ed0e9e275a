"""Simulated acceptance: a real drafter's cost with a chosen acceptance (`--simulate-acceptance`).

Random-weight checkpoints at real sizes measure what drafting and verifying cost, never how often
drafts land. This drafter runs the real drafter every round (its time is paid) and then replaces
its proposals: draft i matches the target's own continuation, read from a plain pass over the
same prompt run first (the reference), with probability p_i / p_(i-1) once draft i-1 matched,
drawn from a seeded generator; a draft that does not match proposes a token that differs from
the reference. Rounds, verify widths, rollbacks, KV rings and the draft policy then run exactly
as with a drafter of that acceptance, and the output is still the target's: drafts are only
proposals. Greedy decoding only (a sampled target has no single continuation to match).

Profiles are data with their sources (acceptance_profiles.json): per position the share of
rounds whose first i drafts were all accepted, as vLLM and llama.cpp report acceptance.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from importlib import resources

import torch

from specdraft.drafters.base import Draft, Drafter, DraftInput
from specdraft.errors import SpecdraftError
from specdraft.sampling import RowStreams, SamplingParams


@dataclass(frozen=True)
class AcceptanceProfile:
    name: str  # a shipped profile's name, or the values as given ("0.8,0.5")
    cumulative: tuple[float, ...]  # p_i: share of rounds whose first i drafts were all accepted
    source: str

    def conditional(self, k: int) -> list[float]:
        """The chance draft i is accepted once draft i-1 was, for i = 1..k. Past the profile's
        last position the last conditional rate repeats (a steady per-draft rate goes on)."""
        p = (1.0,) + self.cumulative
        rates = [p[i] / p[i - 1] if p[i - 1] > 0 else 0.0 for i in range(1, len(p))]
        return [rates[min(i, len(rates) - 1)] for i in range(k)]

    def describe(self) -> dict:
        """What reports say about a simulated run."""
        return {"profile": self.name, "cumulative": list(self.cumulative), "source": self.source}


def shipped_profiles() -> dict[str, AcceptanceProfile]:
    text = resources.files("specdraft").joinpath("drafters", "acceptance_profiles.json").read_text(encoding="utf-8")
    return {name: AcceptanceProfile(name, tuple(p["cumulative"]), p["source"])
            for name, p in json.loads(text)["profiles"].items()}


PROFILE_NAMES = tuple(shipped_profiles())


def parse_profile(spec: str) -> AcceptanceProfile:
    """A shipped profile's name, or per-position cumulative shares "P1,P2,..." (each in [0, 1],
    none above the one before)."""
    profiles = shipped_profiles()
    if spec in profiles:
        return profiles[spec]
    try:
        values = tuple(float(v) for v in spec.split(","))
    except ValueError:
        raise SpecdraftError(f"--simulate-acceptance {spec!r}: give a profile ({', '.join(profiles)}) or "
                             "per-position shares such as 0.8,0.55,0.35") from None
    if not all(0.0 <= v <= 1.0 for v in values):  # NaN fails too
        raise SpecdraftError(f"--simulate-acceptance {spec!r}: every share must be between 0 and 1")
    if any(b > a for a, b in zip(values, values[1:])):
        raise SpecdraftError(f"--simulate-acceptance {spec!r}: shares are cumulative (rounds whose first i drafts "
                             "were all accepted), so none may exceed the one before")
    return AcceptanceProfile(spec, values, "given on the command line")


class SimulatedAcceptance(Drafter):
    """Wraps a drafter (its `step_drafter()`: prompt lookups are left out, their acceptance is
    the text's) and replaces its drafts as the module doc says. `add_references` must have been
    given every prompt's plain continuation before the engine runs it."""

    mixes_lookups = False

    def __init__(self, inner: Drafter, profile: AcceptanceProfile, seed: int = 0):
        self.inner, self.profile = inner.step_drafter(), profile
        self.kind, self.source = self.inner.kind, self.inner.source
        self.recommended_k = getattr(self.inner, "recommended_k", None)
        self.generator = torch.Generator().manual_seed(seed)
        # prompt -> (prompt + its plain continuation, the max_new_tokens it was generated for)
        self.references: dict[tuple[int, ...], tuple[torch.Tensor, int]] = {}
        # row -> its reference's key (None: none matches, or the text left it); absent: not looked up yet
        self.row_reference: dict[int, tuple[int, ...] | None] = {}
        self.diverged = 0  # requests whose text found no reference or left it (rounding at a near-tie)

    def add_reference(self, prompt: list[int], continuation: list[int], max_new_tokens: int) -> None:
        """The target's plain (greedy) continuation of `prompt`, generated for `max_new_tokens`."""
        self.references[tuple(prompt)] = (torch.tensor(list(prompt) + list(continuation), dtype=torch.long),
                                          max_new_tokens)

    def has_reference(self, prompt: list[int], max_new_tokens: int) -> bool:
        found = self.references.get(tuple(prompt))
        return found is not None and found[1] >= max_new_tokens

    # --- delegated: the wrapped drafter's cost, memory and per-row state -------------------------
    def prepare(self, batch_size: int, capacity: int) -> None:
        self.inner.prepare(batch_size, capacity)
        self.row_reference = {}

    def reset_row(self, row: int) -> None:
        self.inner.reset_row(row)
        self.row_reference.pop(row, None)

    def move_row(self, src: int, dst: int) -> None:
        self.inner.move_row(src, dst)
        self.row_reference.pop(dst, None)
        if src in self.row_reference:
            self.row_reference[dst] = self.row_reference.pop(src)

    def max_drafts(self, k: int) -> int:
        return self.inner.max_drafts(k)

    def nbytes(self) -> int:
        return self.inner.nbytes()

    def reads_window(self) -> int | None:
        return self.inner.reads_window()

    def cost_key(self) -> str:
        return self.inner.cost_key()

    def step_drafter(self) -> Drafter:
        return self.inner

    @contextmanager
    def without_early_stop(self) -> Iterator[None]:
        with self.inner.without_early_stop():
            yield

    # --- the round ----------------------------------------------------------------------------
    def propose(self, inp: DraftInput, k: int, sampling: SamplingParams,
                generator: torch.Generator | RowStreams | None) -> Draft:
        if not sampling.greedy:
            raise SpecdraftError("--simulate-acceptance needs greedy decoding (--temperature 0): a sampled "
                                 "target has no one continuation for drafts to match")
        # Every round drafts all k steps: an early stop would follow the real drafter's confidence,
        # which says nothing about the simulated acceptance.
        with self.inner.without_early_stop():
            real = self.inner.propose(inp, k, sampling, generator)
        tokens = real.tokens.clone()
        n, m = tokens.shape
        rates = torch.tensor(self.profile.conditional(m))
        matched = (torch.rand(n, m, generator=self.generator) < rates).long().cumprod(1).bool()
        ends = (inp.position + 2).tolist()
        for row, end in enumerate(ends):
            ref = self._reference(row, inp.tokens[row, :end])
            if ref is None:
                continue  # no reference: the real drafter's tokens stand
            want = torch.full((m,), -1, dtype=torch.long)
            got = ref[end: end + m]
            want[: len(got)] = got
            have = want >= 0
            # A mismatch proposes a token other than the reference's; past the reference's end
            # the real draft stands (those tokens are cut by the length limit anyway).
            own = real.tokens[row].cpu()
            other = torch.where(own == want, torch.where(want > 0, want - 1, want + 1), own)
            row_tokens = torch.where(have & matched[row], want, torch.where(have, other, own))
            tokens[row] = row_tokens.to(tokens.device)
        num_valid = torch.full_like(real.num_valid, m)
        return Draft(tokens, num_valid)

    def _reference(self, row: int, seq: torch.Tensor) -> torch.Tensor | None:
        """The reference whose prefix is this row's text so far (None once the text left it:
        verify rounding at a near-tie, in bfloat16). The whole prefix is compared every round: an
        accepted mismatching draft would otherwise go unseen."""
        seq = seq.cpu()
        n = len(seq)
        if row not in self.row_reference:  # the request's first round
            self.row_reference[row] = next((key for key, (r, _) in self.references.items()
                                            if len(r) >= n and torch.equal(r[:n], seq)), None)
            if self.row_reference[row] is None:
                self.diverged += 1
        key = self.row_reference[row]
        if key is None:
            return None
        ref = self.references[key][0]
        if len(ref) < n or not torch.equal(ref[:n], seq):
            self.row_reference[row] = None
            self.diverged += 1
            return None
        return ref
