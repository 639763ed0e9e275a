"""The drafter's copy gate: a learned bonus for the tokens the text itself suggests.

Small base models repeat themselves, and where the target is sure of a repeat the drafter still
misses many of them (BENCHMARKS.md, "Where the drafter's first draft fails, a copy fallback").
The drafter reads the target's K/V, so in principle its attention can copy, but a 2-layer
network trained on a few hundred thousand tokens does not learn to. The gate gives it the copy
directly, as a pointer network does: for the current input token, two candidates are read off
the text (the prompt, the emitted tokens and the round's drafts so far),

    copy 1: the token that followed the most recent earlier occurrence of the current token
    copy 2: the token that followed the most recent earlier occurrence of the last two tokens

and each gets a bonus b = w . z + c added to its logit (z: the drafter's final normed state,
w and c learned per copy kind, zero at init so a gated drafter starts as the drafter it was
continued from). The bonus is part of the drafter's distribution Q, so sampled drafts and
rejection sampling stay exact, and greedy drafts need no special rule.
"""

from __future__ import annotations

import torch
from torch import nn

from specdraft.drafters.lookup_index import LookupIndex
from specdraft.drafters.mtp.head import score

KINDS = 2  # copy 1 (one-token match), copy 2 (two-token match)
NONE = -1  # no earlier occurrence: no copy candidate


class CopyGate(nn.Module):
    """z [N, h] -> bonus [N, KINDS], one per copy kind. Named `copy_gate` in checkpoints."""

    def __init__(self, hidden: int):
        super().__init__()
        self.proj = nn.Linear(hidden, KINDS)
        nn.init.zeros_(self.proj.weight)
        nn.init.zeros_(self.proj.bias)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.proj(z).float()


def sequence_copies(tokens: list[int]) -> torch.Tensor:
    """[L, KINDS]: for every position j of a sequence, its copy candidates as position j's token
    sees them (only tokens 0..j read; NONE where there is no earlier occurrence)."""
    last1: dict[int, int] = {}
    last2: dict[tuple[int, int], int] = {}
    out = torch.full((len(tokens), KINDS), NONE, dtype=torch.long)
    for j, t in enumerate(tokens):
        i = last1.get(t)
        if i is not None:
            out[j, 0] = tokens[i + 1]
        if j >= 1:
            pair = (tokens[j - 1], t)
            i = last2.get(pair)
            if i is not None:
                out[j, 1] = tokens[i + 1]
            last2[pair] = j
        last1[t] = j
    return out


class RoundCopies:
    """The copy candidates of each row's current token during a drafting round, looked up on the
    host: a LookupIndex of each row's emitted text (updated with the tokens new since the last
    round, as prompt lookup's is) plus the round's drafts so far: microseconds a step, where the
    same scan as tensor ops over the whole text cost a sizeable part of a gated step (BENCHMARKS.md,
    "A copy gate in the drafter")."""

    def __init__(self):
        self.index = LookupIndex(1, KINDS)
        self.rows, self.drafts = [], []

    def start(self, tokens: torch.Tensor, lengths: torch.Tensor) -> None:
        """A round over rows whose text so far (their current token last) is tokens[:, :lengths]."""
        self.rows = self.index.sync(tokens, lengths)
        self.drafts = [[] for _ in self.rows]

    def copies(self, device: torch.device) -> torch.Tensor:
        """[B, KINDS] for the rows' current tokens (NONE where there is none)."""
        found = [[LookupIndex.follower(row, extra, n) for n in range(1, KINDS + 1)]
                 for row, extra in zip(self.rows, self.drafts)]
        return torch.tensor(found, dtype=torch.long, device=device)

    def extend(self, drafts: torch.Tensor) -> None:
        """The round's next draft per row [B]: the next step's current tokens."""
        for extra, t in zip(self.drafts, drafts.tolist()):
            extra.append(t)


def copy_columns(cands: torch.Tensor, copies: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Where each copy's bonus goes among candidates cands [N, M] followed by one column per copy:
    (column [N, KINDS], live [N, KINDS]). A copy that is a candidate goes to that column; one
    that repeats an earlier copy goes to that copy's column; otherwise to its own new column,
    which is then live (scored). Columns of no copy (NONE) are not live and get no bonus."""
    m = cands.shape[1]
    marks = torch.cat([cands, copies], 1)  # NONE never matches a token
    columns, live = [], []
    for c in range(copies.shape[1]):
        earlier = marks[:, : m + c] == copies[:, c : c + 1]
        seen = earlier.any(1)
        columns.append(torch.where(seen, earlier.int().argmax(1), m + c))
        live.append(~seen & (copies[:, c] >= 0))
    return torch.stack(columns, 1), torch.stack(live, 1)


def host_copy_columns(copies: list[list[int]], top: list[list[int]], slots: tuple[list[int], list[int]],
                      cluster_size: int) -> tuple[list[list[int]], list[list[bool]]]:
    """copy_columns for a clustered head's candidates, on the host from its top clusters
    (ClusteredHead.top_clusters) and token slots (ClusteredHead.token_slots): no pass over the
    M candidates per copy."""
    cluster_of, place = slots
    m = len(top[0]) * cluster_size
    columns, live = [], []
    for row_copies, row_top in zip(copies, top):
        rank = {cl: i for i, cl in enumerate(row_top)}
        cols, lives = [], []
        for c, tok in enumerate(row_copies):
            if tok < 0:
                cols.append(m + c)
                lives.append(False)
            elif tok in row_copies[:c]:  # the same token as an earlier copy: its column
                cols.append(cols[row_copies.index(tok)])
                lives.append(False)
            elif cluster_of[tok] in rank:
                cols.append(rank[cluster_of[tok]] * cluster_size + place[tok])
                lives.append(False)
            else:
                cols.append(m + c)
                lives.append(True)
        columns.append(cols)
        live.append(lives)
    return columns, live


def add_copies(logits: torch.Tensor, cands: torch.Tensor | None, copies: torch.Tensor, bonus: torch.Tensor,
               vectors: torch.Tensor, table: torch.Tensor | None, columns: tuple[torch.Tensor, torch.Tensor] | None = None
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logits [N, M] over candidates cands [N, M] (None: all V) with each copy's bonus added to its
    token's logit. A copy outside the candidates becomes a candidate of its own (its score
    `vectors` . table[copy] plus the bonus; with all V scored, vectors and table go unread); a copy
    that is already a candidate, or none, adds a
    column with logit -inf (kept for a fixed shape), so no token is counted twice. `columns`:
    copy_columns' answer, if the caller has it (host_copy_columns)."""
    bonus = torch.where(copies >= 0, bonus, 0.0).to(logits.dtype)
    if cands is None:  # every token scored: add in place
        return logits.scatter_add(1, copies.clamp(min=0), bonus), None
    tokens = copies.clamp(min=0)
    column, live = copy_columns(cands, copies) if columns is None else columns
    extra = score(vectors, table, tokens).to(logits.dtype).masked_fill(~live, float("-inf"))
    out = torch.cat([logits, extra], 1).scatter_add_(1, column, bonus)
    return out, torch.cat([cands, tokens], 1)
