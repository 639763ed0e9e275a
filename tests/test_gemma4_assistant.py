"""Official-layout Gemma 4 assistants (Gemma4AssistantForCausalLM checkpoints) as MTP drafters.

Parity: given identical inputs (target hidden state at p, last token, the target's K/V for
positions 0..p, query position p), specdraft's drafter and transformers' assistant produce the
same states, the same selected clusters and the same logits over them, step after step.
transformers' generate loop queries at p + 1 and can see one more (possibly rejected) K/V; that
is a different convention, not a different network, so the comparison calls the assistant
directly at position p. Its bidirectional sliding mask admits window + 1 keys, so it is handed
exactly the `window` keys the target's own sliding layer sees at p.

End to end: speculative greedy generation with target + assistant equals transformers' plain
greedy generation, token for token, for K in {1, 3} and a ragged batch.
"""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from conftest import assert_fp32_close, reduction_depth  # noqa: E402
from gemma4_tiny import (  # noqa: E402
    assistant_config,
    follow_transitions_,
    greedy_sequences,
    moe_overrides,
    randomize_,
    target_text_config,
)
from specdraft.config import FULL, SLIDING  # noqa: E402
from specdraft.drafters.base import DraftInput  # noqa: E402
from specdraft.drafters.mtp import drafter_config_for, init_network, load_mtp_drafter, save_network  # noqa: E402
from specdraft.drafters.mtp.checkpoint import check_drafter_fits  # noqa: E402
from specdraft.errors import SpecdraftError  # noqa: E402
from specdraft.loading import load_folder  # noqa: E402
from specdraft.sampling import SamplingParams  # noqa: E402
from specdraft.speculative.engine import Engine  # noqa: E402

TARGETS = {"ple_kv_shared": {}, "moe": moe_overrides()}


@pytest.fixture(scope="module", params=list(TARGETS))
def target(request, tmp_path_factory):
    """(transformers target, specdraft target loaded from its folder)."""
    ref = randomize_(transformers.Gemma4ForCausalLM(target_text_config(**TARGETS[request.param])), seed=11)
    folder = tmp_path_factory.mktemp(f"target_{request.param}")
    ref.save_pretrained(folder)
    model, _, _ = load_folder(folder, torch.float32, "cpu")
    return ref, model


def _assistant(target_ref, tmp_path_factory, name: str, **overrides):
    """(transformers assistant, its folder) for `target_ref`."""
    ref = randomize_(transformers.Gemma4AssistantForCausalLM(assistant_config(target_ref.config, **overrides)),
                     seed=12)
    folder = tmp_path_factory.mktemp(name)
    ref.save_pretrained(folder)
    return ref, folder


@pytest.mark.usefixtures("float32_kv")  # float32 parity: summation order only
@pytest.mark.parametrize("clustered", [True, False], ids=["clustered", "dense"])
def test_drafter_matches_transformers_assistant(target, clustered, tmp_path_factory):
    ref_t, model = target
    ref_a, folder = _assistant(ref_t, tmp_path_factory, "assistant", use_ordered_embeddings=clustered)
    drafter = load_mtp_drafter(folder, model, torch.float32, "cpu")
    compare_drafts(ref_t, model, ref_a, drafter, ref_t.config.sliding_window, clustered)


@pytest.mark.usefixtures("float32_kv")  # float32 parity: summation order only
def test_assistant_uses_its_own_window_and_rope(target, tmp_path_factory):
    """An assistant whose config states another sliding window and other RoPE thetas than its
    target's queries with its own, as transformers' assistant does (the target's would give
    other clusters and logits; the comparison below fails with them)."""
    ref_t, model = target
    rope = {SLIDING: {"rope_type": "default", "rope_theta": 500.0},
            FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.5, "rope_theta": 20_000.0}}
    ref_a, folder = _assistant(ref_t, tmp_path_factory, "own_attention", text_sliding_window=5,
                               text_rope_parameters=rope)
    drafter = load_mtp_drafter(folder, model, torch.float32, "cpu")
    assert drafter.sources[0].window == 5 and drafter.sources[-1].window is None
    assert drafter.sources[0].rope is not model.attention_layout(drafter.sources[0].layer).rope
    compare_drafts(ref_t, model, ref_a, drafter, 5, clustered=True)


def compare_drafts(ref_t, model, ref_a, drafter, window: int, clustered: bool) -> None:
    """Three greedy draft steps of ours and of transformers' assistant on the same inputs: the
    target's hidden state at p, its K/V for 0..p (sliding layers: the last `window`)."""
    ids = torch.randint(3, 250, (2, 16), generator=torch.Generator().manual_seed(13))
    p = 13  # query position: more than `window` keys before it

    # The target's K/V (0..p) and final-normed hidden state at p; ours must equal transformers'.
    cache = model.new_cache(2, 24)
    hidden = model(ids[:, : p + 1], cache)
    with torch.no_grad():
        out = ref_t(ids[:, : p + 1], return_shared_kv_states=True, output_hidden_states=True)
    depth = reduction_depth(model.config)
    assert_fp32_close(hidden, out.hidden_states[-1], depth)
    kv = {}
    for kind, src in ((SLIDING, drafter.sources[0]), (FULL, drafter.sources[-1])):
        k, v = cache.k[src.slot][:, :, : p + 1], cache.v[src.slot][:, :, : p + 1]
        assert_fp32_close(k, out.shared_kv_states[kind][0], depth)
        assert_fp32_close(v, out.shared_kv_states[kind][1], depth)
        lo = 0 if kind == FULL else p + 1 - window
        kv[kind] = (k[:, :, lo:], v[:, :, lo:])

    # Ours: three greedy draft steps at position p, recording what the head saw.
    seen = []
    head = drafter.logits

    def recording_head(z, state, copies=None):
        logits, cands = head(z, state, copies)
        seen.append((state.clone(), logits, cands))
        return logits, cands

    drafter.logits = recording_head
    drafter.greedy_pick = lambda *a: None  # picks in C what `logits` picks (test_mtp_internals.py)
    token = ids[:, p + 1]
    draft = drafter.propose(DraftInput(token, hidden[:, p], torch.full((2,), p), cache,
                                       torch.zeros(2, 24, dtype=torch.long), torch.ones(2, dtype=torch.bool)),
                            3, SamplingParams(), None)

    # transformers: the same three steps, fed its own previous token and state.
    tok, state = token[:, None], hidden[:, p : p + 1]
    for step in range(3):
        with torch.no_grad():
            o = ref_a(inputs_embeds=torch.cat([ref_t.get_input_embeddings()(tok), state], dim=-1),
                      position_ids=torch.full((2, 1), p), shared_kv_states=kv)
        logits = o.logits[:, 0]
        our_state, our_logits, cands = seen[step]
        # The drafter's steps add their own layers' sums to the target's.
        step_depth = depth + (step + 1) * reduction_depth(drafter.net.config)
        assert_fp32_close(our_state, o.last_hidden_state[:, 0], step_depth)
        if clustered:
            for row in range(2):  # the same clusters: exactly the tokens not filled with the mask value
                kept = (logits[row] > logits[row].min()).nonzero().flatten()
                assert sorted(cands[row].tolist()) == kept.tolist()
            assert_fp32_close(our_logits, logits.gather(1, cands), step_depth)
        else:
            assert cands is None
            assert_fp32_close(our_logits, logits, step_depth)
        tok, state = logits.argmax(-1, keepdim=True), o.last_hidden_state
        assert draft.tokens[:, step].tolist() == tok[:, 0].tolist()


@pytest.mark.parametrize("k", [1, 3])
def test_speculative_greedy_equals_transformers_greedy(target, k, tmp_path_factory):
    ref_t, model = target
    gen = torch.Generator().manual_seed(14)
    prompts = [torch.randint(3, 250, (n,), generator=gen).tolist() for n in (6, 11, 17)]
    expected = greedy_sequences(ref_t, prompts, 24)
    # A random assistant is never right; wire one to the target's continuations of two of the
    # prompts, so rounds accept some drafts and reject others.
    ref_a = transformers.Gemma4AssistantForCausalLM(assistant_config(ref_t.config))
    follow_transitions_(randomize_(ref_a, seed=15), ref_t, expected[:2])
    folder = tmp_path_factory.mktemp(f"assistant_k{k}")
    ref_a.save_pretrained(folder)
    drafter = load_mtp_drafter(folder, model, torch.float32, "cpu")
    results = Engine(model, drafter=drafter, draft_tokens=k).generate(prompts, max_new_tokens=24, eos_token_ids=[])
    assert [r.token_ids for r in results] == [s[len(p):] for s, p in zip(expected, prompts)]
    accepted = sum(r.stats.accepted for r in results)
    drafted = sum(r.stats.drafted for r in results)
    assert 0 < accepted < drafted


def test_mismatched_assistant_is_refused_by_name(target, tmp_path_factory):
    ref_t, model = target
    cases = {
        "backbone_hidden_size 48 != target hidden size 64": dict(backbone_hidden_size=48),
        "head_dim 16 != target layer": dict(text_global_head_dim=16),
        "KV heads 2 != target layer": dict(text_num_global_key_value_heads=2, text_attention_k_eq_v=True),
    }
    assert model.params.num_kv_heads[FULL] == 1 and model.params.head_dim[FULL] == 32
    for message, overrides in cases.items():
        _, folder = _assistant(ref_t, tmp_path_factory, "mismatch", **overrides)
        with pytest.raises(SpecdraftError, match=message):
            load_mtp_drafter(folder, model, torch.float32, "cpu")


def test_specdraft_written_drafter_reads_back_in_transformers(target, tmp_path):
    """Drafters specdraft trains use the same layout: transformers reads their per-type shapes
    as we do (full-layer KV heads included), and specdraft reads them back unchanged."""
    _, model = target
    cfg = drafter_config_for(model, hidden=32, layers=4, heads=4, clustered=True, num_centroids=8, top_k_clusters=2)
    save_network(init_network(cfg, model), tmp_path)
    hf = transformers.Gemma4AssistantConfig.from_dict(json.loads((tmp_path / "config.json").read_text()))
    text = hf.get_text_config()
    full = text.layer_types.index(FULL)
    assert text.per_layer_config[full].head_dim == model.params.head_dim[FULL]
    assert text.per_layer_config[full].num_key_value_heads == model.params.num_kv_heads[FULL]
    drafter = load_mtp_drafter(tmp_path, model, torch.float32, "cpu")
    assert drafter.net.config.num_kv_heads == cfg.num_kv_heads and drafter.net.config.head_dim == cfg.head_dim


# ---------------------------------------------------------------- checked before anything loads


def _garbage_weights(folder) -> None:
    """Replace a folder's weights with bytes no safetensors reader accepts."""
    for f in folder.glob("*.safetensors"):
        f.write_bytes(b"\x00garbage, not a safetensors file")


def test_mismatched_pair_is_refused_from_the_configs_alone(target, tmp_path_factory):
    """check_drafter_fits reads the two config.json files only: with both folders' weights
    garbage, a mismatched pair is refused by name and a fitting pair passes."""
    ref_t, _ = target
    target_folder = tmp_path_factory.mktemp("garbage_target")
    ref_t.save_pretrained(target_folder)
    _garbage_weights(target_folder)
    _, bad = _assistant(ref_t, tmp_path_factory, "garbage_bad", backbone_hidden_size=48, text_global_head_dim=16)
    _, good = _assistant(ref_t, tmp_path_factory, "garbage_good")
    for folder in (bad, good):
        _garbage_weights(folder)
    with pytest.raises(SpecdraftError, match=r"^drafter does not fit this target: backbone_hidden_size 48 != target "
                                             r"hidden size 64; .*head_dim 16 != target layer \d+ head_dim 32") as e:
        check_drafter_fits(bad, str(target_folder))
    assert "\n" not in str(e.value)
    assert check_drafter_fits(good, str(target_folder)).backbone_hidden_size == 64
    with pytest.raises(SpecdraftError, match="cannot read safetensors"):  # the weights really are garbage
        load_mtp_drafter(good, target[1], torch.float32, "cpu")


def _rewrite_ordering(folder, order: torch.Tensor) -> None:
    from safetensors.torch import load_file, save_file

    state = load_file(str(folder / "model.safetensors"))
    state["masked_embedding.token_ordering"] = order
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})


def test_int32_token_ordering_is_widened_for_the_head(target, tmp_path_factory):
    """An int32 token_ordering (as some exports write it) loads as the int64 ids the head's C
    call reads, and drafts exactly what the int64 file drafts."""
    ref_t, model = target
    ref_a, folder = _assistant(ref_t, tmp_path_factory, "ordering64")
    narrow = tmp_path_factory.mktemp("ordering32")
    ref_a.save_pretrained(narrow)
    _rewrite_ordering(narrow, ref_a.masked_embedding.token_ordering.to(torch.int32))
    wide, thin = (load_mtp_drafter(f, model, torch.float32, "cpu") for f in (folder, narrow))
    order = thin.net.masked_embedding.token_ordering
    assert order.dtype == torch.int64 and torch.equal(order, wide.net.masked_embedding.token_ordering)
    ids = torch.randint(3, 250, (2, 12), generator=torch.Generator().manual_seed(16))
    cache = model.new_cache(2, 20)
    hidden = model(ids, cache)
    inp = DraftInput(ids[:, 11], hidden[:, 10], torch.full((2,), 10), cache, torch.zeros(2, 20, dtype=torch.long),
                     torch.ones(2, dtype=torch.bool))
    a, b = (d.propose(inp, 3, SamplingParams(), None) for d in (wide, thin))
    assert a.tokens.tolist() == b.tokens.tolist()


@pytest.mark.parametrize("bad, message", [
    (lambda o: o.float(), r"token_ordering has dtype float32; expected int32 or int64"),
    (lambda o: torch.cat([o[:1], o[:-1]]), r"token_ordering is not a permutation of range\(256\): id \d+ appears 2 "
                                           r"times and 1 id\(s\) never"),
    (lambda o: torch.where(o == 7, 256, o), r"not a permutation of range\(256\): 1 id\(s\) outside it"),
    (lambda o: o[:128], r"token_ordering has shape \(128,\); expected \(256,\)"),
], ids=["float", "repeated", "outside", "short"])
def test_bad_token_ordering_is_refused_in_one_line(target, tmp_path_factory, bad, message):
    ref_t, model = target
    ref_a, folder = _assistant(ref_t, tmp_path_factory, "bad_ordering")
    _rewrite_ordering(folder, bad(ref_a.masked_embedding.token_ordering.clone()))
    with pytest.raises(SpecdraftError, match=message) as e:
        load_mtp_drafter(folder, model, torch.float32, "cpu")
    assert "\n" not in str(e.value)


# ---------------------------------------------------------------- --device cuda:N (a real-size run's GPU)


@pytest.mark.parametrize("cuda, count, name, message", [
    (False, 0, "cuda:0", "--device cuda:0 requested but no CUDA device is available"),
    (False, 0, "cuda", "--device cuda requested but no CUDA device is available"),
    (True, 2, "cuda:2", r"--device cuda:2 requested but this machine has 2 CUDA device\(s\) \(cuda:0..cuda:1\)"),
    (True, 2, "cuda:x", "unknown device 'cuda:x'"),
    (True, 2, "cuda:-1", "unknown device 'cuda:-1'"),
])
def test_cuda_index_is_checked_like_cuda(monkeypatch, cuda, count, name, message):
    """`cuda:N` gets the check `cuda` gets (and an index past the devices is refused) as a
    one-line SpecdraftError, not a torch error later in the load."""
    from specdraft.device import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    with pytest.raises(SpecdraftError, match=message) as e:
        resolve_device(name)
    assert "\n" not in str(e.value)


def test_cuda_index_within_the_devices_is_accepted(monkeypatch):
    from specdraft.device import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    assert resolve_device("cpu") == torch.device("cpu")
