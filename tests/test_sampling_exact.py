"""Speculative sampling is lossless: the first three generated tokens follow the target's exact
distribution, for point-mass (argmax, n-gram) drafts and for drafts sampled through the
clustered MTP head, with and without top-k/top-p. Negative controls show the test can fail.

Target: a tiny Llama with a 16-token vocabulary. Its exact joint distribution of the first
three tokens (16^3 cells) is computed from the reference HF model's logits (16 + 256 prefixes in
one batch), with temperature/top-k/top-p applied by an implementation written here. Samples
come from many rows of one prompt in a few Engine.generate calls (fixed seeds, so the test is
deterministic).

Sample size. We want to detect an error of total-variation distance delta = 0.02. For any
perturbation q of p with TV(p, q) = delta, Cauchy-Schwarz gives
    sum (p - q)^2 / p  >=  (sum |p - q|)^2 = (2 delta)^2,
so Pearson's chi-square has non-centrality lambda >= 4 N delta^2 (pooling cells with expected
count < 5 into one loses a little of this; the pooled mass is < 1% here). With N = 100,000:
lambda >= 160. The pooled tables have df ~ 300 (asserted below); the alpha = 1e-3 critical
value is ~ df + 3.1 sqrt(2 df) ~ 376, while under the alternative the statistic has mean
df + lambda ~ 460 and sd sqrt(2 (df + 2 lambda)) ~ 35, so the power is ~ 0.99. `detection_power`
recomputes this for the actual df of each case and the test asserts it is >= 0.98.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from conftest import TinyModel, build_hf, load_ours, save_hf
from specdraft.drafters.base import Draft, Drafter, DraftInput, SparseProbs
from specdraft.drafters.mtp import drafter_config_for, init_network, load_mtp_drafter, save_network
from specdraft.drafters.mtp.drafter import MTPDrafter
from specdraft.drafters.mtp_lookup import MTPWithLookup
from specdraft.drafters.ngram import NgramDrafter
from specdraft.models.kernels.sample_rows import draw_tokens
from specdraft.sampling import SamplingParams, sample
from specdraft.speculative import engine as engine_module
from specdraft.speculative import group_verify
from specdraft.speculative.engine import Engine
from specdraft.speculative.request import Request
from specdraft.speculative.policy import MARGIN, AdaptivePolicy, DraftPolicy

V = 16
PROMPT = [5, 9, 5, 9, 7, 5]  # repeats, so the n-gram drafter finds matches
N = 100_000
CHUNK = 4000
NEGATIVE_N = 20_000  # the negative controls' errors are large (TV several %): fewer samples suffice
ALPHA = 1e-3
DELTA = 0.02


# ------------------------------------------------------------------ the target and its exact law


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> TinyModel:
    hf = build_hf("llama", seed=3, std=0.2, vocab_size=V, hidden_size=32, intermediate_size=64,
                  num_hidden_layers=2, head_dim=8)
    with torch.no_grad():
        hf.lm_head.weight.mul_(3.0)  # next-token entropy ~1 nat: ~300 cells carry the joint law
    folder = save_hf(hf, tmp_path_factory.mktemp("v16"), tokenizer=False)
    ours, cfg = load_ours(folder)
    return TinyModel("llama", folder, hf, ours, cfg)


def reference_filter(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Independent temperature / top-k / top-p: keep the k best (ties at the k-th kept), then the
    shortest best-first prefix whose mass reaches top_p; renormalise. float64, one row at a time."""
    out = torch.zeros(logits.shape, dtype=torch.float64)
    for idx in range(logits.shape[0]):
        z = logits[idx].double() / temperature
        keep = torch.ones(V, dtype=torch.bool)
        if top_k:
            kth = sorted(z.tolist(), reverse=True)[top_k - 1]
            keep &= z >= kth
        p = torch.where(keep, z, torch.tensor(-math.inf, dtype=torch.float64)).softmax(-1)
        if top_p < 1.0:
            order = sorted(range(V), key=lambda t: -p[t].item())
            mass, chosen = 0.0, []
            for t in order:
                chosen.append(t)
                mass += p[t].item()
                if mass >= top_p:
                    break
            mask = torch.zeros(V, dtype=torch.bool)
            mask[chosen] = True
            p = torch.where(mask, p, torch.zeros((), dtype=torch.float64))
            p = p / p.sum()
        out[idx] = p
    return out


def exact_joint(target: TinyModel, temperature=1.0, top_k=0, top_p=1.0) -> torch.Tensor:
    """P(t1, t2, t3) [V^3] under the target alone, from the HF model's logits."""
    seqs = torch.tensor([PROMPT + [a, b] for a in range(V) for b in range(V)])
    with torch.no_grad():
        logits = target.hf(seqs).logits.float()
    n = len(PROMPT)
    p1 = reference_filter(logits[:1, n - 1], temperature, top_k, top_p)[0]
    p2 = reference_filter(logits[::V, n], temperature, top_k, top_p)  # [t1, t2]
    p3 = reference_filter(logits[:, n + 1], temperature, top_k, top_p).view(V, V, V)  # [t1, t2, t3]
    return (p1[:, None, None] * p2[:, :, None] * p3).flatten()


def sample_counts(target: TinyModel, drafter, k: int, sampling: SamplingParams, n: int, seed: int):
    """Counts over V^3 of the first three tokens of n rows; also the merged acceptance stats."""
    counts = torch.zeros(V**3, dtype=torch.long)
    drafted = accepted = 0
    engine = Engine(target.ours, None, drafter, k)
    for c in range(0, n, CHUNK):
        params = SamplingParams(sampling.temperature, sampling.top_k, sampling.top_p, seed=seed + c)
        results = engine.generate([PROMPT] * min(CHUNK, n - c), 3, params, eos_token_ids=[])
        ids = torch.tensor([r.token_ids for r in results])
        assert ids.shape[1] == 3
        counts += torch.bincount(ids[:, 0] * V * V + ids[:, 1] * V + ids[:, 2], minlength=V**3)
        drafted += sum(r.stats.drafted for r in results)
        accepted += sum(sum(r.stats.accepted_by_position) for r in results)
    return counts, (accepted / drafted if drafted else None)


def chi_square(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0):
    """Pearson chi-square with cells of expected count < min_expected pooled into one.
    Returns (statistic, df, p-value, pooled mass, TV distance of the empirical law)."""
    n = counts.sum().item()
    expected = probs * n
    big = expected >= min_expected
    obs = torch.cat([counts[big].double(), counts[~big].sum().double()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    if exp[-1] < min_expected:  # pooled cell too small to test on its own: merge into the smallest
        obs, exp = obs[:-1], exp[:-1]
        obs[exp.argmin()] += counts[~big].sum()
        exp[exp.argmin()] += expected[~big].sum()
    stat = (((obs - exp) ** 2) / exp).sum().item()
    df = len(obs) - 1
    p_value = torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                      torch.tensor(stat / 2, dtype=torch.float64)).item()
    tv = 0.5 * (counts.double() / n - probs).abs().sum().item()
    return stat, df, p_value, expected[~big].sum().item() / n, tv


def detection_power(n: int, df: int, delta: float = DELTA, alpha: float = ALPHA) -> float:
    """Power (normal approximation to the non-central chi-square) against any TV-delta error."""
    normal = torch.distributions.Normal(0.0, 1.0)
    lam = 4 * n * delta**2
    crit = df + normal.icdf(torch.tensor(1 - alpha)).item() * math.sqrt(2 * df)
    mean, sd = df + lam, math.sqrt(2 * (df + 2 * lam))
    return 1 - normal.cdf(torch.tensor((crit - mean) / sd)).item()


# ------------------------------------------------------------------ drafters


class ArgmaxDrafter(Drafter):
    """Point-mass drafts (probs None) from a fixed bigram table: the next draft after token t is
    the target's argmax after PROMPT + [t]. Cheap, and often but not always right."""

    kind = "argmax"

    def __init__(self, table: torch.Tensor):
        self.table = table

    def propose(self, inp, k, sampling, generator):
        tok, out = inp.last_token, []
        for _ in range(k):
            tok = self.table[tok]
            out.append(tok)
        return Draft(torch.stack(out, 1), torch.where(inp.active, k, 0), None)


class WrongQDrafter(Drafter):
    """NEGATIVE CONTROL: samples from its Q but reports a sharpened Q' (∝ Q^2, same support)."""

    kind = "wrong-q"

    def __init__(self, inner):
        self.inner = inner

    def propose(self, inp, k, sampling, generator):
        d = self.inner.propose(inp, k, sampling, generator)
        q = d.probs.dense() ** 2
        return Draft(d.tokens, d.num_valid, q / q.sum(-1, keepdim=True))


@pytest.fixture(scope="module")
def drafters(target: TinyModel, tmp_path_factory):
    folder = tmp_path_factory.mktemp("mtp16")
    # Clustered head: 4 clusters of 4 tokens, the top 2 kept, so Q covers only 8 of 16 tokens and
    # every other token must come from the residual.
    cfg = drafter_config_for(target.ours, hidden=32, layers=2, heads=4, head="own", clustered=True,
                             num_centroids=4, top_k_clusters=2)
    save_network(init_network(cfg, target.ours, seed=0, std=0.3), folder)
    mtp = load_mtp_drafter(folder, target.ours, torch.float32, "cpu")
    with torch.no_grad():
        seqs = torch.tensor([PROMPT + [t] for t in range(V)])
        table = target.hf(seqs).logits[:, -1].argmax(-1)
    # The same network stopping each row's drafts after an unsure one: ragged draft lengths.
    early = MTPDrafter(mtp.net, mtp.target, mtp.sources, min_confidence=EARLY_STOP)
    # With an open copy gate: the text's continuations get a bonus, often from outside the kept
    # clusters (an extra candidate in Q).
    gated = init_network(replace(cfg, copy_gate=True), target.ours, seed=0, std=0.3)
    with torch.no_grad():
        gated.copy_gate.proj.weight.normal_(0, 0.3, generator=torch.Generator().manual_seed(1))
        gated.copy_gate.proj.bias.fill_(1.5)
    gate_folder = tmp_path_factory.mktemp("mtp16-gate")
    save_network(gated, gate_folder)
    gate = load_mtp_drafter(gate_folder, target.ours, torch.float32, "cpu")
    # The same network keeping 3 clusters (12 of 16 tokens) for sampled drafts, 2 for greedy ones.
    wide_folder = tmp_path_factory.mktemp("mtp16-wide")
    save_network(init_network(replace(cfg, sampling_top_k_clusters=3), target.ours, seed=0, std=0.3), wide_folder)
    wide = load_mtp_drafter(wide_folder, target.ours, torch.float32, "cpu")
    return {"mtp-wide": wide, "mtp": mtp, "argmax": ArgmaxDrafter(table), "ngram": NgramDrafter(), "mtp+ngram": MTPWithLookup(mtp, min_match=1),
            "mtp-early-stop": early, "mtp-early-stop+ngram": MTPWithLookup(early, min_match=1), "mtp-gate": gate}


# ------------------------------------------------------------------ the tests

T1 = SamplingParams(1.0)
GREEDY = SamplingParams(0.0)
EARLY_STOP = 0.3  # about half of this random drafter's sampled drafts are less sure than this
FILTERED = SamplingParams(1.0, top_k=6, top_p=0.9)

CASES = {
    # name: (drafter key, K, sampling, seed)
    "plain-no-drafter": (None, 0, T1, 5),  # the harness itself: plain sampling must pass too
    "argmax-point-mass-K2": ("argmax", 2, T1, 10),
    "ngram-point-mass-K1": ("ngram", 1, T1, 20),
    "mtp-clustered-sampled-K2": ("mtp", 2, T1, 30),
    "mtp-clustered-sampled-topk-topp-K1": ("mtp", 1, FILTERED, 40),
    # Rows whose last token occurred in PROMPT look up (point mass), the others sample from the
    # MTP drafter, in the same batch.
    "mtp+ngram-mixed-K2": ("mtp+ngram", 2, T1, 50),
    # Rows stop drafting after a draft Q gave < EARLY_STOP: 1, 2 or 3 drafts per row and round.
    "mtp-early-stop-K3": ("mtp-early-stop", 3, T1, 70),
    "mtp-early-stop+ngram-mixed-K3": ("mtp-early-stop+ngram", 3, T1, 80),
    # The copy gate's bonus is part of Q, copies from outside the kept clusters included.
    "mtp-copy-gate-K3": ("mtp-gate", 3, T1, 90),
    # Sampled drafts over more clusters than greedy ones (sampling_top_k_clusters).
    "mtp-wider-sampled-clusters-K2": ("mtp-wide", 2, T1, 100),
}


@pytest.mark.parametrize("case", list(CASES))
def test_speculative_sampling_matches_target_distribution(case: str, target, drafters) -> None:
    key, k, sampling, seed = CASES[case]
    probs = exact_joint(target, sampling.temperature, sampling.top_k, sampling.top_p)
    assert probs.sum().item() == pytest.approx(1.0, abs=1e-9)
    counts, acceptance = sample_counts(target, drafters[key] if key else None, k, sampling, N, seed)
    stat, df, p_value, pooled, tv = chi_square(counts, probs)
    print(f"{case}: chi2 {stat:.1f} / {df} df, p {p_value:.3f}, TV {tv:.4f}, acceptance {acceptance}, "
          f"power vs TV {DELTA}: {detection_power(N, df):.4f}")
    assert pooled < 0.01
    assert detection_power(N, df) >= 0.98, f"df {df} too large for N {N} to detect TV {DELTA}"
    # Both the accept and the reject paths were taken often (tens of thousands of times). The
    # random MTP drafter is accepted ~10% of the time, so its case mostly tests the residual
    # (including tokens outside the kept clusters); the point-mass cases accept ~65%.
    if key is not None and key.endswith("+ngram"):
        rounds = drafters[key].row_rounds
        assert min(rounds.values()) > 0.1 * sum(rounds.values()), rounds
    if key is not None:
        assert acceptance is not None and 0.05 < acceptance < 0.9, acceptance
    assert p_value > ALPHA, f"{case}: chi2 {stat:.1f} on {df} df, p = {p_value:.2e}, TV {tv:.4f}"


def draft_input(target: TinyModel, n: int) -> DraftInput:
    """n rows after PROMPT, each with its own last token, as the engine hands them to a drafter."""
    cache = target.ours.new_cache(n, 16)
    with torch.inference_mode():
        hidden = target.ours(torch.tensor([PROMPT] * n), cache)[:, -1]
    tokens = torch.zeros(n, 20, dtype=torch.long)
    tokens[:, : len(PROMPT)] = torch.tensor(PROMPT)
    last = torch.arange(n) % V
    return DraftInput(last, hidden, torch.full((n,), len(PROMPT) - 1), cache, tokens, torch.ones(n, dtype=torch.bool))


def test_early_stop_gives_ragged_draft_lengths(target, drafters) -> None:
    """The early-stop case is only meaningful if rows really stop at different lengths."""
    n = 64
    inp = draft_input(target, n)
    d = drafters["mtp-early-stop"].propose(inp, 3, T1, torch.Generator().manual_seed(0))
    lengths = set(d.num_valid.tolist())
    assert {1, 3} <= lengths, lengths
    # Every draft a row keeps was at least EARLY_STOP likely under Q, except its last one.
    q = d.probs.dense().gather(2, d.tokens[..., None]).squeeze(2)
    for row in range(n):
        kept = int(d.num_valid[row])
        assert (q[row, : kept - 1] >= EARLY_STOP).all()
        assert kept == 3 or q[row, kept - 1] < EARLY_STOP


def test_acceptance_chances_are_the_verifiers_acceptance_probabilities() -> None:
    """min(1, P/Q) per draft (P itself for point masses), 0 past a row's valid drafts; and over
    many draws the verifier accepts the first draft that often."""
    from specdraft.speculative.verify import acceptance_chances, verify_sampling

    gen = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(2, 3, V, generator=gen), -1)  # P_0..P_2 for 2 rows
    q = torch.softmax(torch.randn(2, 2, V, generator=gen), -1)
    drafts = torch.tensor([[3, 7], [1, 2]])
    valid = torch.tensor([2, 1])
    want = (p[:, :2].gather(2, drafts[..., None]).squeeze(2) / q.gather(2, drafts[..., None]).squeeze(2)).clamp(max=1)
    want[1, 1] = 0.0
    assert torch.allclose(acceptance_chances(p, drafts, q, valid), want)
    point = acceptance_chances(p, drafts, None, valid)
    assert torch.equal(point[0], p[0, :2].gather(1, drafts[0, :, None]).squeeze(1))
    n = 20_000
    rows = verify_sampling(p[:1].expand(n, -1, -1), drafts[:1].expand(n, -1), q[:1].expand(n, -1, -1),
                           valid[:1].expand(n), torch.Generator().manual_seed(1))[0]
    rate = (rows >= 1).double().mean().item()
    assert abs(rate - want[0, 0].item()) < 4 * math.sqrt(want[0, 0] * (1 - want[0, 0]) / n) + 1e-9


def _recording_probs(weight: torch.Tensor, seen: list[int]):
    """Probabilities from a fixed random table (peaked, so drafts drawn from them are often
    accepted), each row on its own as the head kernels compute them, recording how many rows each
    call scored."""
    def probs_of(rows: torch.Tensor) -> torch.Tensor:
        seen.append(rows.shape[0])
        return torch.stack([torch.softmax(3 * weight @ row, -1) for row in rows]).view(len(rows), -1)
    return probs_of


@pytest.mark.parametrize("q_kind", ["point", "dense", "sparse"])
def test_blockwise_sampled_probs_give_the_full_verdicts_and_draws(q_kind: str) -> None:
    """P computed a block of positions at a time, only for rows still unrejected, gives
    verify_sampling the verdicts, the correction draws and (up to the first rejection) the
    acceptance chances of every P computed, from the same random stream, for ragged rows; and
    drawing the uniforms inside verify_sampling takes them from the stream as drawing them first."""
    from specdraft.speculative.verify import (acceptance_chances, acceptance_uniforms, sampled_probs_blockwise,
                                              verify_sampling)

    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(V, 8, generator=gen)
    for trial in range(48):
        k, block, b = (0, 1, 2, 3, 5, 8)[trial % 6], 1 + trial % 4, 1 + trial % 3
        hidden = torch.randn(b, k + 1, 8, generator=gen)
        full = _recording_probs(weight, [])(hidden.reshape(-1, 8)).view(b, k + 1, V)
        q = torch.softmax(torch.randn(b, k, V, generator=gen), -1)
        drafts = sample(full[:, :k] if trial % 2 else q, gen)  # from P: mostly accepted; from Q: less
        num_valid = torch.randint(0, k + 1, (b,), generator=gen)
        if q_kind == "point":
            q = None
        elif q_kind == "sparse":
            ids = torch.argsort(torch.rand(b, k, V, generator=gen), -1)[..., : V // 2]
            ids[..., 0] = drafts  # the drafts inside each support
            kept = q.gather(2, ids)
            q = SparseProbs(ids, kept / kept.sum(-1, keepdim=True), V)
        seed = 100 + trial
        first = torch.Generator().manual_seed(seed)
        uniforms = acceptance_uniforms(b, k, first, drafts.device)
        want = verify_sampling(full, drafts, q, num_valid, first, uniforms)
        inside = verify_sampling(full, drafts, q, num_valid, torch.Generator().manual_seed(seed))
        seen: list[int] = []
        again = torch.Generator().manual_seed(seed)
        uniforms = acceptance_uniforms(b, k, again, drafts.device)
        probs = sampled_probs_blockwise(_recording_probs(weight, seen), hidden, drafts, q, num_valid, uniforms, block)
        got = verify_sampling(probs, drafts, q, num_valid, again, uniforms)
        for a, c, d in zip(want, inside, got):
            assert torch.equal(a, c) and torch.equal(a, d)
        given = sampled_probs_blockwise(_recording_probs(weight, later := []), hidden, drafts, q, num_valid, uniforms,
                                        block, first=full[:, : min(block, k + 1)])
        assert torch.equal(given, probs) and sum(later) == sum(seen) - b * min(block, k + 1)  # block 0 not scored again
        assert sum(seen) <= b * (k + 1)
        judged = torch.arange(k)[None, :] <= want[0][:, None]  # up to each row's first rejection
        chances = acceptance_chances(probs, drafts, q, num_valid)
        assert torch.equal(chances[judged], acceptance_chances(full, drafts, q, num_valid)[judged])


def test_blockwise_sampled_probs_stop_scoring_after_a_rejection() -> None:
    """Row 0's first draft has P = 0 (always rejected), row 1's drafts are P's only token (always
    accepted): with blocks of 2 over 5 positions row 0 is scored for its first block only."""
    from specdraft.speculative.verify import sampled_probs_blockwise, verify_sampling

    sure = torch.eye(V)  # distribution i: all mass on token i
    def probs_of(rows: torch.Tensor) -> torch.Tensor:
        seen.append(rows.shape[0])
        return sure[rows[:, 0].long()]

    seen: list[int] = []
    hidden = torch.zeros(2, 5, 1)
    hidden[1, :, 0] = torch.tensor([3.0, 4, 5, 6, 7])  # row 1's P_j: token 3 + j; row 0's: token 0
    drafts = torch.tensor([[9, 9, 9, 9], [3, 4, 5, 6]])
    uniforms = torch.rand(2, 4, generator=torch.Generator().manual_seed(0))
    probs = sampled_probs_blockwise(probs_of, hidden, drafts, None, torch.tensor([4, 4]), uniforms, 2)
    assert seen == [4, 2, 1]
    assert probs[0, 2:].abs().sum() == 0  # never computed
    n, token = verify_sampling(probs, drafts, None, torch.tensor([4, 4]), torch.Generator(), uniforms)
    assert n.tolist() == [0, 4] and token.tolist() == [0, 7]


def test_clustered_q_really_excludes_tokens(target, drafters) -> None:
    """The MTP case is only meaningful if Q misses tokens P gives mass to: check Q's support."""
    inp = draft_input(target, 4)
    d = drafters["mtp"].propose(inp, 2, T1, torch.Generator().manual_seed(0))
    assert isinstance(d.probs, SparseProbs)  # no [B, K, V] tensor per draft step
    q = d.probs.dense()
    support = (q > 0).sum(-1)
    assert (support == 8).all()
    assert torch.allclose(q.sum(-1), torch.ones(4, 2))
    assert (q.gather(2, d.tokens[:, :, None]) > 0).all()
    assert torch.equal(d.probs.at(d.tokens), q.gather(2, d.tokens[:, :, None]).squeeze(2))
    rows, pos = torch.arange(4), torch.tensor([0, 1, 1, 0])
    assert torch.equal(d.probs.row(rows, pos), q[rows, pos])


def test_sampled_drafts_keep_their_own_number_of_clusters(target, drafters) -> None:
    """sampling_top_k_clusters widens Q for sampled drafts only: greedy drafts keep top_k."""
    wide = drafters["mtp-wide"]
    inp = draft_input(target, 4)
    d = wide.propose(inp, 2, T1, torch.Generator().manual_seed(0))
    q = d.probs.dense()
    assert ((q > 0).sum(-1) == 12).all() and torch.allclose(q.sum(-1), torch.ones(4, 2))
    z, state = torch.randn(4, 32, generator=torch.Generator().manual_seed(1)), inp.hidden
    _, greedy = wide.logits(z, state)
    _, sampled = wide.logits(z, state, sampled=True)
    assert greedy.shape[1] == 8 and sampled.shape[1] == 12
    assert all(set(g) <= set(s) for g, s in zip(greedy.tolist(), sampled.tolist()))  # the best 2 of the best 3
    assert torch.equal(wide.propose(inp, 2, GREEDY, None).tokens, drafters["mtp"].propose(inp, 2, GREEDY, None).tokens)


def test_negative_control_wrong_q_is_detected(target, drafters) -> None:
    probs = exact_joint(target)
    counts, _ = sample_counts(target, WrongQDrafter(drafters["mtp"]), 2, T1, NEGATIVE_N, 50)
    stat, df, p_value, _, tv = chi_square(counts, probs)
    print(f"wrong Q: chi2 {stat:.1f} / {df} df, p {p_value:.2e}, TV {tv:.4f}")
    assert p_value < 1e-9, f"a drafter lying about Q went unnoticed (p = {p_value:.2e}, TV {tv:.4f})"


def test_negative_control_biased_verifier_is_detected(target, drafters, monkeypatch) -> None:
    """A verifier that accepts correctly but draws the correction token from P instead of the
    residual norm(max(P - Q, 0)) (a classic bug) must be caught."""
    real = group_verify.verify_sampling

    def resamples_from_p(target_probs, drafts, draft_probs, num_valid, generator, uniforms=None, likelihoods=None):
        n, _ = real(target_probs, drafts, draft_probs, num_valid, generator, uniforms, likelihoods)
        rows = torch.arange(drafts.shape[0])
        return n, torch.multinomial(target_probs[rows, n], 1, generator=generator).squeeze(1)

    monkeypatch.setattr(group_verify, "verify_sampling", resamples_from_p)
    probs = exact_joint(target)
    counts, _ = sample_counts(target, drafters["mtp"], 2, T1, NEGATIVE_N, 60)
    stat, df, p_value, _, tv = chi_square(counts, probs)
    print(f"biased verifier: chi2 {stat:.1f} / {df} df, p {p_value:.2e}, TV {tv:.4f}")
    assert p_value < 1e-9, f"a biased verifier went unnoticed (p = {p_value:.2e}, TV {tv:.4f})"


def test_plain_sampling_is_seeded_and_speculative_greedy_unaffected(target, drafters) -> None:
    """Same seed, same tokens; different seed, different tokens (the sampler is really seeded)."""
    engine = Engine(target.ours, None, drafters["mtp"], 2)
    a = [r.token_ids for r in engine.generate([PROMPT] * 64, 6, SamplingParams(1.0, seed=5), eos_token_ids=[])]
    b = [r.token_ids for r in engine.generate([PROMPT] * 64, 6, SamplingParams(1.0, seed=5), eos_token_ids=[])]
    c = [r.token_ids for r in engine.generate([PROMPT] * 64, 6, SamplingParams(1.0, seed=6), eos_token_ids=[])]
    assert a == b and a != c


# ------------------------------------------------------------------ adaptive draft widths
#
# The draft policy picks each round's width W (0 = a plain step) from what it has seen; the
# engine then asks the drafter for min(W, K) drafts and cuts longer proposals (prompt lookups, or
# a drafter that always drafts K) to their first W, tokens and Q together. Exactness needs only
# that W is chosen before the round's drafts and target outputs are known. Here rounds get
# widths from a script (every width from 0 to past K, changing every round; a generate call of
# ADAPTIVE_CHUNK rows is 1-2 rounds) or from the adaptive policy itself over an injected cost
# model, and the first three tokens are tested against the target's exact law as above.
#
# Sample size: N = 40,000 per case keeps each test near 20 s on one thread. The statistic has
# df ~ 180 here; against any error of TV 0.03 the non-centrality is >= 4 N 0.03^2 = 144 and the
# power at alpha 1e-3 is ~ 0.997 (asserted, recomputed for the actual df). The negative controls
# below are errors of TV ~ 0.05-0.1, found with p < 1e-9.

ADAPTIVE_N = 40_000
ADAPTIVE_CHUNK = 2_000  # 20 generate calls per case, each with its own round widths
ADAPTIVE_DELTA = 0.03
WIDTH_SCRIPT = [2, 0, 1, 3, 0, 2, 1, 1, 3, 0, 0, 1, 2, 3, 3, 1, 0, 3, 2, 2, 1, 0]  # all pairs of widths up to 3
MIXED_SCRIPT = [5, 1, 0, 8, 2, 3, 0, 6, 1, 2, 4, 0, 7, 1, 3, 3, 0, 2, 8, 1]  # lookups carry up to 8


class ScriptedPolicy(DraftPolicy):
    """Round widths from a list, cycled, whatever the rows; records what it chose."""

    def __init__(self, script: list[int]):
        self.script, self.chosen = script, []

    def prepare(self, model, drafter, rows, k, width):
        self.width = width

    def choose(self, states):
        w = min(self.script[len(self.chosen) % len(self.script)], self.width)
        self.chosen.append(w)
        return w


class RecordingPolicy(AdaptivePolicy):
    """The adaptive policy, its choices recorded."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.chosen = []

    def choose(self, states):
        self.chosen.append(super().choose(states))
        return self.chosen[-1]


class FakeCosts:
    """Each verified token adds 3% to a step, a drafter step 0.3%: at this drafter's acceptance
    one or two drafts pay and wider rounds do not, so the policy moves between widths 0, 1, 2
    (cutting 8-token lookups) as its estimates move."""

    def ensure(self, model, drafter, rows, k, width):
        pass

    def verify(self, n, w, alive=None, block=None):
        return 1.0 + 0.03 * (w - 1)

    def draft(self, n, steps):
        return 0.003 * steps


class AlwaysK(Drafter):
    """Drafts K tokens whatever the engine asks for, so the engine's cut to W is what is tested
    (a prefix of sequentially drawn drafts, with its Q, is an exact draw of W drafts)."""

    def __init__(self, inner, k: int):
        self.inner, self.k, self.kind = inner, k, inner.kind

    def propose(self, inp, k, sampling, generator):
        return self.inner.propose(inp, self.k, sampling, generator)


def adaptive_counts(target: TinyModel, drafter, k: int, policy, n: int, seed: int):
    """Counts over V^3 of the first three tokens of n rows at temperature 1 under `policy`."""
    counts = torch.zeros(V**3, dtype=torch.long)
    engine = Engine(target.ours, None, drafter, k, policy=policy)
    drafted = accepted = 0
    for c in range(0, n, ADAPTIVE_CHUNK):
        results = engine.generate([PROMPT] * min(ADAPTIVE_CHUNK, n - c), 3, SamplingParams(1.0, seed=seed + c),
                                  eos_token_ids=[])
        ids = torch.tensor([r.token_ids for r in results])
        counts += torch.bincount(ids[:, 0] * V * V + ids[:, 1] * V + ids[:, 2], minlength=V**3)
        drafted += sum(r.stats.drafted for r in results)
        accepted += sum(sum(r.stats.accepted_by_position) for r in results)
    return counts, (accepted / drafted if drafted else None)


def adaptive_drafter(drafters, key: str):
    if key == "mtp-always-K3":
        return AlwaysK(drafters["mtp"], 3), 3
    if key == "argmax-always-K3":
        return AlwaysK(drafters["argmax"], 3), 3
    return drafters[key], {"mtp": 3, "mtp+ngram": 2, "mtp-early-stop+ngram": 3}[key]


ADAPTIVE_CASES = {
    # name: (drafter key, policy: "scripted" or "adaptive", seed)
    # The MTP drafter asked for min(W, 3) sampled drafts, W from 0 to 3 changing every round.
    "mtp-clustered-scripted-widths": ("mtp", "scripted", 100),
    # Sampled K = 3 drafts cut by the engine to W (tokens and sparse Q).
    "mtp-clustered-cut-to-width": ("mtp-always-K3", "scripted", 110),
    # Point-mass (argmax) drafts, K = 3 cut to W.
    "argmax-point-mass-cut-to-width": ("argmax-always-K3", "scripted", 120),
    # Ragged batch: lookup rows (point masses, up to 8 drafts) next to MTP rows that stop early
    # (1-3 sampled drafts); widths 0..8 cut lookups, and the MTP drafts below K.
    "mtp-early-stop+ngram-mixed-scripted-widths": ("mtp-early-stop+ngram", "scripted", 130),
    # The adaptive policy itself over a fake cost model: widths follow the acceptance it sees
    # (mostly widths 1-2 cutting 8-token lookups; most rows look up here, so this case checks the
    # policy's cuts of point-mass drafts; the scripted cases above check sampled Q).
    "mtp+ngram-mixed-adaptive-policy": ("mtp+ngram", "adaptive", 140),
}


@pytest.mark.parametrize("case", list(ADAPTIVE_CASES))
def test_sampling_stays_exact_with_adaptive_widths(case: str, target, drafters) -> None:
    key, kind, seed = ADAPTIVE_CASES[case]
    drafter, k = adaptive_drafter(drafters, key)
    if kind == "scripted":
        policy = ScriptedPolicy(MIXED_SCRIPT if "ngram" in key else WIDTH_SCRIPT)
    else:
        # one margin for every round: these costs are built around it (batched rounds' extra
        # margin would make most rounds plain, and this case is about the policy's cuts)
        policy = RecordingPolicy(FakeCosts(), prior={"mtp": 0.5, "lookup": 0.5}, batch_margin=MARGIN)
    probs = exact_joint(target)
    counts, acceptance = adaptive_counts(target, drafter, k, policy, ADAPTIVE_N, seed)
    stat, df, p_value, pooled, tv = chi_square(counts, probs)
    power = detection_power(ADAPTIVE_N, df, ADAPTIVE_DELTA)
    widths = sorted(set(policy.chosen))
    print(f"{case}: chi2 {stat:.1f} / {df} df, p {p_value:.3f}, TV {tv:.4f}, acceptance {acceptance}, "
          f"widths {widths}, power vs TV {ADAPTIVE_DELTA}: {power:.4f}")
    assert pooled < 0.01
    assert power >= 0.98, f"df {df} too large for N {ADAPTIVE_N} to detect TV {ADAPTIVE_DELTA}"
    # The widths really varied, some narrower than K (scripted: plain rounds too).
    assert len(widths) >= 2 and any(0 < w < k for w in widths), widths
    assert kind != "scripted" or (0 in widths and len(widths) >= 4), widths
    assert sum(w > 0 for w in policy.chosen) > 0.5 * len(policy.chosen)  # mostly drafting rounds
    assert acceptance is not None and 0.05 < acceptance < 0.9, acceptance
    assert p_value > ALPHA, f"{case}: chi2 {stat:.1f} on {df} df, p = {p_value:.2e}, TV {tv:.4f}"


def served_counts(target: TinyModel, drafter, k: int, n: int, seed: int, sampling: SamplingParams = T1):
    """Counts over V^3 of the first three tokens of n requests served step by step, as the server
    runs them: each request its own sampling group and seed, so each row draws its drafts from
    its own random stream (group_verify.draft_sampling). Also the acceptance and how many rounds
    carried drafts sampled from Q."""
    counts = torch.zeros(V**3, dtype=torch.long)
    engine = Engine(target.ours, None, drafter, k, max_batch_size=SERVED_BATCH, capacity=32)
    for i in range(n):
        engine.add(Request(PROMPT, 3, replace(sampling, seed=seed + i), eos_token_ids=[]))
    results, sampled_rounds = [], [0]
    propose = drafter.propose

    def counting(inp, kk, params, generator):
        sampled_rounds[0] += isinstance(generator, list) and not params.greedy
        return propose(inp, kk, params, generator)

    drafter.propose = counting
    try:
        while engine.has_work():
            results += engine.step()
    finally:
        del drafter.propose
    ids = torch.tensor([r.token_ids for r in results])
    counts += torch.bincount(ids[:, 0] * V * V + ids[:, 1] * V + ids[:, 2], minlength=V**3)
    drafted = sum(r.stats.drafted for r in results)
    accepted = sum(sum(r.stats.accepted_by_position) for r in results)
    return counts, accepted / drafted, sampled_rounds[0]


SERVED_BATCH = 256  # rows a round: each its own request and random stream


SERVED_N = 20_000  # requests; each its own group, so a round verifies 256 groups one by one
SERVED_DELTA = 0.04


def test_served_requests_sample_drafts_from_their_own_streams_and_stay_exact(target, drafters) -> None:
    """A server's sampled requests (one group each) draw their drafts from the drafter's Q, row by
    row from each request's own stream (not argmax drafts as point masses), and the first three
    tokens still follow the target's law: MTP rows stopping early (ragged drafts) next to lookup
    rows (point masses), K = 3."""
    probs = exact_joint(target)
    counts, acceptance, sampled_rounds = served_counts(target, drafters["mtp-early-stop+ngram"], 3, SERVED_N, seed=200)
    stat, df, p_value, pooled, tv = chi_square(counts, probs)
    power = detection_power(SERVED_N, df, SERVED_DELTA)
    print(f"served: chi2 {stat:.1f} / {df} df, p {p_value:.3f}, TV {tv:.4f}, acceptance {acceptance}, "
          f"sampled rounds {sampled_rounds}, power vs TV {SERVED_DELTA}: {power:.4f}")
    assert sampled_rounds > 0.9 * (SERVED_N / SERVED_BATCH)  # every batch's rounds drew from Q
    assert pooled < 0.02 and power >= 0.98  # fewer samples than above: a little more mass pooled
    assert 0.05 < acceptance < 0.9, acceptance
    assert p_value > ALPHA, f"served: chi2 {stat:.1f} on {df} df, p = {p_value:.2e}, TV {tv:.4f}"


def test_served_request_draws_do_not_depend_on_company(target, drafters) -> None:
    """With a fixed width, a seeded request's tokens are the same alone and among other requests:
    its drafts and verdicts draw only from its own stream, and only while it drafts."""
    early = drafters["mtp-early-stop"]

    def run(prompts_and_seeds):
        engine = Engine(target.ours, None, early, 3, max_batch_size=8, capacity=32)
        reqs = [Request(p, 12, SamplingParams(1.0, seed=s), eos_token_ids=[]) for p, s in prompts_and_seeds]
        for r in reqs:
            engine.add(r)
        done = {}
        while engine.has_work():
            done.update((r.request_id, r.token_ids) for r in engine.step())
        return [done[r.id] for r in reqs]

    alone = run([(PROMPT, 7)])[0]
    crowd = run([(PROMPT, 7), ([3, 4, 5], 1), ([9, 9, 2, 1], 2), (PROMPT[:3], 3)])
    assert crowd[0] == alone
    assert run([(PROMPT, 8)])[0] != alone  # the seed matters


class _AcceptWithP(SparseProbs):
    """NEGATIVE CONTROL: Q reads 1 at each draft, so a draft is accepted with P(d) instead of
    min(1, P(d) / Q(d)); the residual still uses the true Q."""

    def at(self, tokens):
        return torch.ones(tokens.shape, dtype=self.probs.dtype, device=self.probs.device)


def test_negative_control_adaptive_widths_accept_with_p_is_detected(target, drafters, monkeypatch) -> None:
    real = group_verify.verify_sampling

    def accepts_with_p(target_probs, drafts, draft_probs, num_valid, generator, uniforms=None, likelihoods=None):
        if draft_probs is not None:  # None: a plain round (no drafts)
            draft_probs = _AcceptWithP(draft_probs.ids, draft_probs.probs, draft_probs.vocab)
        # the caller's likelihoods are the true Q's: left out, so the biased one is read
        return real(target_probs, drafts, draft_probs, num_valid, generator, uniforms)

    monkeypatch.setattr(group_verify, "verify_sampling", accepts_with_p)
    counts, _ = adaptive_counts(target, AlwaysK(drafters["mtp"], 3), 3, ScriptedPolicy(WIDTH_SCRIPT), NEGATIVE_N, 150)
    stat, df, p_value, _, tv = chi_square(counts, exact_joint(target))
    print(f"accept with P: chi2 {stat:.1f} / {df} df, p {p_value:.2e}, TV {tv:.4f}")
    assert p_value < 1e-9, f"accepting with P instead of min(1, P/Q) went unnoticed (p = {p_value:.2e}, TV {tv:.4f})"


def test_negative_control_q_cut_out_of_step_with_drafts_is_detected(target, drafters, monkeypatch) -> None:
    """A cut to W drafts that keeps the drafter's last W distributions instead of its first W
    (Q no longer the law of the draft it is read for) must be caught: it only differs from the
    right cut in rounds narrower than K, so this also shows such rounds are really tested."""
    real = engine_module._truncate

    def misaligned(draft, width):
        cut = real(draft, width)
        if draft.tokens.shape[1] > width and draft.probs is not None:
            cut.probs = draft.probs[:, draft.tokens.shape[1] - width:]
        return cut

    monkeypatch.setattr(engine_module, "_truncate", misaligned)
    counts, _ = adaptive_counts(target, AlwaysK(drafters["mtp"], 3), 3, ScriptedPolicy(WIDTH_SCRIPT), NEGATIVE_N, 160)
    stat, df, p_value, _, tv = chi_square(counts, exact_joint(target))
    print(f"Q cut out of step: chi2 {stat:.1f} / {df} df, p {p_value:.2e}, TV {tv:.4f}")
    assert p_value < 1e-9, f"a Q cut out of step with its drafts went unnoticed (p = {p_value:.2e}, TV {tv:.4f})"


@pytest.mark.parametrize("draw", [sample, draw_tokens])
def test_sample_draws_from_unnormalised_weights_and_never_a_zero(draw) -> None:
    """`sample` (inverse CDF in float64) and its C loop on weights that do not sum to 1, with zeros
    among them and at both ends: the counts fit the normalised law, and no zero-weight token is
    ever drawn."""
    weights = torch.tensor([0.0, 3.0, 0.0, 1.0, 0.5, 0.0, 2.5, 0.0])
    rows = weights.expand(20_000, -1) * torch.linspace(0.5, 2.0, 20_000)[:, None]  # any per-row scale
    with torch.inference_mode():  # where the decoding loop draws (the C loop's condition)
        drawn = draw(rows, torch.Generator().manual_seed(0))
    counts = torch.bincount(drawn, minlength=len(weights))
    assert counts[weights == 0].sum() == 0
    stat, df, p_value, _, _ = chi_square(counts[weights > 0], (weights[weights > 0] / weights.sum()).double())
    assert p_value > ALPHA, (stat, df, p_value)
    # A biased sampler (the first nonzero token favoured by 3%) fails the same test.
    biased = torch.where(torch.rand(20_000, generator=torch.Generator().manual_seed(1)) < 0.03, 1, drawn)
    counts = torch.bincount(biased, minlength=len(weights))
    assert chi_square(counts[weights > 0], (weights[weights > 0] / weights.sum()).double())[2] < ALPHA
