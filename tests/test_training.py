"""Drafter training: data, objective, resume, evaluation-set guard, and that it learns."""

from __future__ import annotations

import json
from dataclasses import replace
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import make_tiny, word_list
import specdraft.training
from specdraft.drafters.mtp import drafter_config_for, load_mtp_drafter, save_network
from specdraft.errors import SpecdraftError
from specdraft.runtime import Runtime
from specdraft.training.data import DataConfig, build_dataset, load_sequences
from specdraft.training.prompts import EvalGuard, load_prompt_set
from specdraft.training.evaluate import replay_greedy_decoding
from specdraft.training.labels import label_head, topk_log_probs
from specdraft.training.objective import distribution_loss
from specdraft.training.trainer import NEW_BLOCK_LR_SCALE, TrainConfig, Trainer

SPEC_BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "spec_bench" / "question.jsonl"


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    folder = tmp_path_factory.mktemp("train_target")
    make_tiny(folder, "gemma3", seed=3, max_position_embeddings=256)
    return Runtime.load(str(folder), "float32", "cpu", progress=False)


def word_prompts(n: int, seed: int) -> list[str]:
    words = word_list(128)[4:]
    g = torch.Generator().manual_seed(seed)
    return [" ".join(words[i] for i in torch.randint(0, len(words), (int(l),), generator=g).tolist())
            for l in torch.randint(3, 10, (n,), generator=g)]


@pytest.fixture(scope="module")
def tiny_data(tiny_target, tmp_path_factory):
    root = tmp_path_factory.mktemp("train_data")
    cfg = DataConfig(max_new_tokens=24, batch_size=16, shard_prompts=32, topk=4, temperatures=(0.0,))
    train = load_sequences(build_dataset(tiny_target, word_prompts(96, 0), root / "train", cfg))
    held = load_sequences(build_dataset(tiny_target, word_prompts(16, 1), root / "held", cfg))
    return train, held


def small_config(**kw) -> TrainConfig:
    base = dict(steps=150, batch_size=8, anchors_per_seq=16, k_steps=3, lr=3e-3, warmup=10, eval_every=10**6,
                save_every=10**6, shortlist_size=128, seed=0)
    base.update(kw)
    return TrainConfig(**base)


def make_trainer(rt, out: Path, data, cfg: TrainConfig) -> Trainer:
    dcfg = drafter_config_for(rt.model, hidden=64, layers=2, heads=4, head="target", clustered=True,
                              num_centroids=16, top_k_clusters=4)
    train, held = data
    return Trainer(rt, out, cfg, dcfg, train, held, log=lambda m: None)


def test_data_shards_hold_the_target_view(tiny_target, tiny_data):
    train, _ = tiny_data
    s = train[0]
    assert s.hidden.shape == (len(s.tokens), tiny_target.config.hidden_size)
    # Greedy answers: the target's top-1 at each answer position is the next token it emitted.
    answer = slice(s.prompt_length - 1, len(s.tokens) - 1)
    assert torch.equal(s.topk_ids[answer, 0], s.tokens[s.prompt_length :])


def test_training_raises_held_out_tau(tiny_target, tiny_data, tmp_path):
    trainer = make_trainer(tiny_target, tmp_path / "run", tiny_data, small_config())
    before = trainer.evaluate()["tau"]
    trainer.train()
    result = trainer.evaluate()
    assert result["tau"] > before + 0.5, (before, result["tau"])
    assert 1.0 <= result["decoding_tau"] <= 1 + trainer.cfg.k_steps


def test_resume_continues_exactly(tiny_target, tiny_data, tmp_path):
    straight = make_trainer(tiny_target, tmp_path / "a", tiny_data, small_config(steps=6, save_every=3))
    straight.train()
    first = make_trainer(tiny_target, tmp_path / "b", tiny_data, small_config(steps=3, save_every=3))
    first.train()
    resumed = make_trainer(tiny_target, tmp_path / "b", tiny_data, small_config(steps=6, save_every=3))
    assert resumed.step == 3
    resumed.train()
    for (name, a), (_, b) in zip(straight.net.state_dict().items(), resumed.net.state_dict().items()):
        assert torch.equal(a, b), name


def test_checkpoint_round_trip_same_logits(tiny_target, tiny_data, tmp_path):
    trainer = make_trainer(tiny_target, tmp_path / "run", tiny_data, small_config(steps=5))
    trainer.train()
    save_network(trainer.net, tmp_path / "saved")
    loaded = load_mtp_drafter(tmp_path / "saved", tiny_target.model, torch.float32, "cpu")
    z = torch.randn(3, trainer.net.config.hidden_size)
    state = torch.randn(3, tiny_target.config.hidden_size)
    from specdraft.drafters.mtp.drafter import MTPDrafter

    mine = MTPDrafter(trainer.net.eval(), tiny_target.model, trainer.sources).logits(z, state)
    theirs = loaded.logits(z, state)
    assert torch.equal(mine[1], theirs[1])
    torch.testing.assert_close(mine[0], theirs[0], rtol=0, atol=0)
    # The training checkpoint is a drafter folder too (its optimizer and shortlist files beside
    # model.safetensors are not read as weights), so any step can be compared in the engine.
    from_checkpoint = load_mtp_drafter(tmp_path / "run" / "checkpoint", tiny_target.model, torch.float32, "cpu")
    assert torch.equal(from_checkpoint.logits(z, state)[0], theirs[0])


def test_eval_guard_refuses_spec_bench_prompt(tmp_path):
    if not SPEC_BENCH.exists():
        pytest.skip("Spec-Bench file not present")
    question = json.loads(SPEC_BENCH.read_text().split("\n")[0])["turns"][0]
    guard = EvalGuard([SPEC_BENCH])
    assert guard.contaminated(question)
    assert guard.contaminated("Please help. " + question + " Thanks!")
    assert not guard.contaminated("Write a haiku about the sea in autumn, please, with a title and no rhyme.")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": question}) + "\n" + json.dumps({"prompt": "Name three rivers."}) + "\n")
    s = load_prompt_set([prompts], [SPEC_BENCH], held_out_fraction=0.0)
    assert s.refused == [question] and s.train == ["Name three rivers."]
    only_bad = tmp_path / "bad.jsonl"
    only_bad.write_text(json.dumps({"prompt": question}) + "\n")
    with pytest.raises(SpecdraftError):
        load_prompt_set([only_bad], [SPEC_BENCH])


PROMPT_SETS = Path(specdraft.training.__file__).parent / "prompt_sets"


def test_shipped_assistant_tasks_are_clean_training_prompts() -> None:
    """The assistant-style prompts written for drafter training (training/prompt_sets/*.jsonl):
    each has a prompt and a category, none repeats within or across the sets, none overlaps Spec-Bench."""
    paths = sorted(PROMPT_SETS.glob("*.jsonl"))
    assert [p.name for p in paths] == ["assistant_tasks.jsonl", "assistant_tasks_detailed.jsonl"]
    prompts = []
    for path in paths:
        records = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        assert len(records) >= 150 and all(r["category"] and r["prompt"].strip() for r in records)
        prompts += [r["prompt"] for r in records]
    assert len(set(prompts)) == len(prompts)
    if SPEC_BENCH.exists():
        kept, refused = EvalGuard([SPEC_BENCH]).filter(prompts)
        assert refused == [] and kept == prompts


@pytest.mark.slow
def test_torchrun_single_process_cpu(tiny_target, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(word_prompts(40, 5)) + "\n")
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=1", "-m", "specdraft",
           "train-drafter", "--model", str(tiny_target.folder), "--dtype", "float32", "--out", str(out),
           "--prompts", str(prompts), "--answer-tokens", "8", "--steps", "4", "--batch-size", "2",
           "--anchors", "4", "--hidden", "32", "--heads", "4", "--clusters", "0", "--eval-every", "2",
           "--held-out", "2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (out / "model.safetensors").exists() and (out / "training.json").exists()
    assert json.loads((out / "checkpoint" / "state.json").read_text())["step"] == 4


def test_recorded_features_equal_a_teacher_forced_pass(tiny_target, tiny_data):
    """What generation records (prefill + one-token steps) is what a full forward computes."""
    from specdraft.training.data import read_slots

    model = tiny_target.model
    for s in tiny_data[0][:3]:
        n = len(s.tokens)
        cache = model.new_cache(1, n + 1)
        with torch.no_grad():
            hidden = model(s.tokens[None], cache)[0]
        usable = n - 1  # the last position's hidden/KV are never computed (the row stopped)
        torch.testing.assert_close(s.hidden[:usable], hidden[:usable], atol=1e-4, rtol=1e-4)
        for slot in read_slots(model):
            k = cache.k[slot][0, :, :usable].transpose(0, 1).reshape(usable, -1)
            torch.testing.assert_close(s.keys[slot][:usable], k, atol=1e-4, rtol=1e-4)
        logp = torch.log_softmax(model.logits(hidden[s.prompt_length - 1 : n - 1]), -1)
        torch.testing.assert_close(s.topk_logp[s.prompt_length - 1 : n - 1], torch.topk(logp, 4).values,
                                   atol=1e-4, rtol=1e-4)
        if s.temperature == 0:  # greedy: each answer token is the head's top-1 at the position before
            answer = s.tokens[s.prompt_length : n]
            assert torch.equal(answer, s.topk_ids[s.prompt_length - 1 : n - 1, 0])


def test_decoding_replay_jumps_past_accepted_drafts():
    # Anchors 4..11 of an answer that starts after a 5-token prompt. A round at t emits
    # prefix[t] + 1 tokens and the next round starts there: t = 4 -> 7 -> 8 -> 11 -> end.
    anchors = torch.arange(4, 12)
    prefix = torch.tensor([2, 3, 3, 0, 2, 3, 3, 1])
    valid = torch.ones(8, dtype=torch.bool)
    assert replay_greedy_decoding(anchors, valid, prefix, prompt_length=5) == (3 + 1 + 3 + 2, 4)
    # Invalid anchors end the replay.
    valid[4] = False
    assert replay_greedy_decoding(anchors, valid, prefix, prompt_length=5) == (3 + 1, 2)


# --------------------------------------------------------------------------- prefill distillation


@pytest.fixture(scope="module")
def corpus_seqs(tiny_target, tmp_path_factory):
    from specdraft.training.corpus import CorpusConfig, build_corpus_dataset

    texts = [" ".join(word_prompts(24, seed)) for seed in range(10, 16)]  # ~130-200 tokens each
    cfg = CorpusConfig(chunk_tokens=48, min_tokens=8, batch_size=4, shard_texts=4, topk=4)
    out = tmp_path_factory.mktemp("corpus")
    return texts, load_sequences(build_corpus_dataset(tiny_target, texts, out, cfg))


def test_corpus_chunks_are_the_text_cut_at_chunk_length(tiny_target, corpus_seqs):
    from specdraft.training.corpus import text_chunks

    tok = tiny_target.tokenizer
    texts, seqs = corpus_seqs
    assert all(s.corpus and s.prompt_length == 1 for s in seqs)
    ids = tok.encode(texts[0])
    bos, body = ids[0], ids[1:]
    assert len(body) > 2 * 47
    pieces = text_chunks(tok, [texts[0]], 48, 8)
    # Pieces of 47 text tokens, each after its own BOS; a tail shorter than min_tokens is dropped.
    expect = [[bos] + body[i : i + 47] for i in range(0, len(body), 47)]
    assert pieces == [e for e in expect if len(e) >= 8]
    # Every shard sequence is one such piece of one of the texts.
    all_pieces = {tuple(c) for c in text_chunks(tok, texts, 48, 8)}
    assert {tuple(s.tokens.tolist()) for s in seqs} == all_pieces and len(seqs) == len(all_pieces)


def test_corpus_records_are_a_forward_pass_and_the_targets_top_k(tiny_target, corpus_seqs):
    """Every position's label is the target's own top-k, from the same forward the hidden states come from."""
    from specdraft.training.data import read_slots

    model = tiny_target.model
    for s in corpus_seqs[1][:4]:
        n = len(s.tokens)
        cache = model.new_cache(1, n)
        with torch.no_grad():
            hidden = model(s.tokens[None], cache)[0]
        # A 4-row padded prefill and this 1-row one sum in different orders (float32 GEMM blocking).
        torch.testing.assert_close(s.hidden, hidden, atol=1e-4, rtol=1e-4)
        for slot in read_slots(model):
            v = cache.v[slot][0].transpose(0, 1).reshape(n, -1)
            torch.testing.assert_close(s.values[slot], v, atol=1e-4, rtol=1e-4)
        # The labels' logits come from the label head (bf16 on CPUs with bf16 units) over the
        # recorded hidden states; test_label_head_* bounds that head against model.logits.
        logp = torch.log_softmax(label_head(model)(s.hidden), -1)
        torch.testing.assert_close(s.topk_logp, torch.topk(logp, 4).values, atol=1e-4, rtol=1e-4)
        # The recorded ids are the tokens of those values (a near-tie may order them either way).
        torch.testing.assert_close(logp.gather(1, s.topk_ids), s.topk_logp, atol=1e-4, rtol=1e-4)
    # The text is not the target's writing: its next token is often not the target's argmax.
    assert any(not torch.equal(s.tokens[1:], s.topk_ids[:-1, 0]) for s in corpus_seqs[1])


def test_uncertain_anchors_are_drawn_where_the_target_was_unsure():
    import random

    from specdraft.training.data import Sequence
    from specdraft.training.objective import pick_anchors

    n, prompt = 200, 10
    logp = torch.full((n, 4), -5.0)
    unsure = torch.arange(prompt - 1, n - 2) % 4 == 0  # a quarter of the anchors: top-1 probability 0.1
    logp[prompt - 1 : n - 2, 0] = torch.where(unsure, torch.tensor(0.1).log(), torch.tensor(0.99).log())
    seq = Sequence(tokens=torch.zeros(n, dtype=torch.long), prompt_length=prompt, temperature=0.0,
                   hidden=torch.zeros(n, 1), keys={}, values={}, topk_ids=torch.zeros(n, 4, dtype=torch.long),
                   topk_logp=logp)
    rng = random.Random(0)
    for where, low, high in (("uniform", 0.15, 0.35), ("uncertain", 0.6, 0.8)):
        share = []
        for _ in range(50):
            picked = pick_anchors(seq, 32, rng, where)
            assert picked == sorted(set(picked)) and len(picked) == 32
            assert picked[0] >= prompt - 1 and picked[-1] <= n - 3
            share.append(sum(unsure[t - prompt + 1].item() for t in picked) / 32)
        # weights 1.0 (unsure) against 0.11, without replacement: about 0.69 of the picks, uniform 1/4
        assert low < sum(share) / len(share) < high, (where, sum(share) / len(share))
    # every anchor when there are no more than asked for
    assert pick_anchors(seq, 1000, rng, "uncertain") == list(range(prompt - 1, n - 2))


def test_an_answer_window_keeps_each_answers_first_tokens_and_anchors_only_there():
    import random

    from specdraft.training.data import Sequence, answer_window
    from specdraft.training.objective import pick_anchors

    def seq(n: int, prompt: int, corpus: bool = False) -> Sequence:
        t = torch.arange(n)
        return Sequence(tokens=t, prompt_length=prompt, temperature=0.0, hidden=t[:, None].float(),
                        keys={3: t[:, None].float()}, values={3: -t[:, None].float()},
                        topk_ids=t[:, None].repeat(1, 2), topk_logp=torch.zeros(n, 2), corpus=corpus)

    long, short, text = seq(200, 30, False), seq(40, 30, False), seq(300, 1, True)
    assert answer_window([long, short, text], None) == [long, short, text]
    cut = answer_window([long, short, text], 64)
    assert [len(s.tokens) for s in cut] == [94, 40, 300]  # prompt + 64; shorter answers and corpus text whole
    for s in cut:  # every field cut alike, still the same positions
        n = len(s.tokens)
        assert torch.equal(s.hidden[:, 0], s.tokens.float()) and torch.equal(s.topk_ids[:, 0], s.tokens)
        assert s.keys[3].shape[0] == s.values[3].shape[0] == s.topk_logp.shape[0] == n
    picked = pick_anchors(cut[0], 1000, random.Random(0))
    assert picked == list(range(29, 92))  # anchors only inside the window


def test_top_k_log_probs_are_the_log_softmax_top_k(tiny_target):
    model = tiny_target.model
    hidden = torch.randn(900, model.config.hidden_size)  # more rows than one call scores
    ids, logp = topk_log_probs(model.logits, hidden, 5)
    full = torch.log_softmax(model.logits(hidden), -1)
    torch.testing.assert_close(logp, torch.topk(full, 5).values, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(full.gather(1, ids), logp, atol=1e-5, rtol=1e-5)


def test_the_overlap_term_is_the_chance_a_sampled_draft_is_rejected():
    """kl+tv adds 1 - sum min(p, q): for p = (.5, .5, 0, 0) over the top-k and q = (.7, .1, .1, .1)
    a draft sampled from q is accepted with chance .5 + .1 = .6, so the term is .4; where q
    equals p it is 0 and the loss is kl's. Shortlist index -1 (a top-k id outside it) drops out of
    p, and a masked anchor counts for neither."""
    q = torch.tensor([0.7, 0.1, 0.1, 0.1])
    logits = q.log()[None, None, :].repeat(1, 2, 1)  # 2 anchors over a shortlist of 4
    idx = torch.tensor([[[0, 1, -1], [0, 1, -1]]])  # top-3 ids; the third is not in the shortlist
    top_logp = torch.tensor([[[0.5, 0.5, 0.9], [0.5, 0.5, 0.9]]]).log()
    ok = torch.tensor([[True, False]])
    kl = distribution_loss(logits, idx, top_logp, ok)
    both = distribution_loss(logits, idx, top_logp, ok, overlap=True)
    assert torch.isclose(kl, -(0.5 * torch.log(q[:2])).sum(), atol=1e-6)
    assert torch.isclose(both - kl, torch.tensor(0.4), atol=1e-6)
    matched = torch.tensor([0.5, 0.5, 1e-9, 1e-9]).log()[None, None, :].repeat(1, 2, 1)
    assert torch.isclose(distribution_loss(matched, idx, top_logp, ok, overlap=True),
                         distribution_loss(matched, idx, top_logp, ok), atol=1e-6)


def test_label_head_is_the_heads_logits_within_bf16_rounding(tiny_target):
    """On a CPU with bf16 units the labels use a bf16 GEMM: each product carries the rounding of
    two bf16 operands (relative 2^-8 each) and is summed in float32, so a logit is off by at most
    ~2^-7 of the sum of |h_i w_i|. Elsewhere it is the model's own head."""
    model = tiny_target.model
    hidden = torch.randn(64, model.config.hidden_size)
    exact = model.logits(hidden)
    bound = (hidden.abs() @ model.head_weight.float().abs().T) * 2.0**-7 + 1e-5
    err = (label_head(model)(hidden) - exact).abs()
    assert bool((err <= bound).all()), float((err / bound).max())


def test_ce_on_corpus_text_learns_the_targets_argmax_not_the_text(tiny_target, corpus_seqs):
    """"ce" on a corpus sequence equals "kl" towards a one-hot on the target's top-1; the same
    sequence read as an answer (labels = the text's next tokens) gives another loss."""
    import dataclasses
    import random

    from specdraft.training.objective import collate, make_head_space, unrolled_loss

    model = tiny_target.model
    dcfg = drafter_config_for(model, hidden=32, layers=2, heads=4, head="target", clustered=False)
    from specdraft.drafters.mtp import init_network
    from specdraft.drafters.mtp.checkpoint import kv_sources

    net = init_network(dcfg, model, seed=1).float()
    sources = kv_sources(dcfg, model)
    kv_heads = {s.slot: s.num_kv_heads for s in sources}
    space = make_head_space(torch.arange(tiny_target.config.vocab_size), tiny_target.config.vocab_size, None)
    seqs = corpus_seqs[1][:4]
    one_hot = [dataclasses.replace(s, topk_logp=torch.where(torch.arange(4) == 0, 0.0, float("-inf")).expand_as(s.topk_logp))
               for s in seqs]
    as_answer = [dataclasses.replace(s, corpus=False) for s in seqs]

    def loss(batch_seqs, kind):
        batch = collate(batch_seqs, 8, kv_heads, random.Random(0), torch.float32)
        with torch.no_grad():
            return unrolled_loss(net, model, sources, batch, 3, space, kind)[0]

    ce = loss(seqs, "ce")
    torch.testing.assert_close(ce, loss(one_hot, "kl"), atol=1e-5, rtol=1e-5)
    assert abs(ce.item() - loss(as_answer, "ce").item()) > 1e-3


def test_init_from_starts_at_the_given_drafters_weights(tiny_target, tiny_data, tmp_path):
    first = make_trainer(tiny_target, tmp_path / "a", tiny_data, small_config(steps=20))
    first.train()
    save_network(first.net, tmp_path / "trained")
    dcfg = first.net.config
    second = Trainer(tiny_target, tmp_path / "b", small_config(), dcfg, *tiny_data, log=lambda m: None,
                     init_from=tmp_path / "trained")
    for (name, a), b in zip(first.net.state_dict().items(), second.net.state_dict().values()):
        assert torch.equal(a, b), name
    assert second.evaluate()["tau"] == first.evaluate()["tau"]
    second.cfg.steps = 1
    second.train()  # a continued drafter's history starts with where it started from
    assert second.history[0]["step"] == 0 and second.history[0]["tau"] == first.evaluate()["tau"]


def test_export_takes_the_best_held_out_decoding_tau(tiny_target, tiny_data, tmp_path):
    from safetensors.torch import load_file

    trainer = make_trainer(tiny_target, tmp_path / "run", tiny_data, small_config(steps=60, eval_every=20, save_every=20))
    real = trainer.evaluate
    # Held-out decoding tau peaks at step 40 here, so the export is not the last step's weights.
    trainer.evaluate = lambda: {**real(), "decoding_tau": {20: 1.5, 40: 2.0, 60: 1.8}[trainer.step]}
    trainer.train()
    best = trainer.best_step()
    assert best == 40
    assert json.loads((trainer.best_dir / "step.json").read_text())["step"] == best
    result = trainer.export(tmp_path / "export", {})
    assert result["step"] == best
    assert json.loads((tmp_path / "export" / "training.json").read_text())["exported_step"] == best
    exported = load_file(str(tmp_path / "export" / "model.safetensors"))
    kept = load_file(str(trainer.best_dir / "model.safetensors"))
    for name, value in kept.items():
        expect = value.to(torch.bfloat16) if value.is_floating_point() else value
        assert torch.equal(exported[name], expect), name
    final = trainer.net.state_dict()
    assert any(not torch.equal(final[n].to(torch.bfloat16), exported[n]) for n in kept if kept[n].is_floating_point())


def test_train_cli_with_a_corpus_and_init_from(tiny_target, tmp_path):
    from specdraft.cli.main import main

    (tmp_path / "prompts.txt").write_text("\n".join(word_prompts(24, 7)) + "\n")
    (tmp_path / "corpus.txt").write_text("\n".join(" ".join(word_prompts(10, s)) for s in range(20, 30)) + "\n")
    common = ["--model", str(tiny_target.folder), "--dtype", "float32", "--device", "cpu", "--prompts",
              str(tmp_path / "prompts.txt"), "--answer-tokens", "8", "--steps", "4", "--batch-size", "4",
              "--anchors", "4", "--eval-every", "2", "--held-out", "2", "--loss", "kl"]
    first = tmp_path / "first"
    assert main(["train-drafter", *common, "--out", str(first), "--corpus", str(tmp_path / "corpus.txt"),
                 "--hidden", "32", "--heads", "4", "--clusters", "0"]) == 0
    recipe = json.loads((first / "training.json").read_text())
    assert recipe["corpus_sequences"] >= 10 and recipe["target_tokens"] > 10 * 40
    assert any(s.corpus for s in load_sequences(sorted((first / "data" / "corpus").glob("shard-*.safetensors"))))
    second = tmp_path / "second"
    assert main(["train-drafter", *common, "--out", str(second), "--init-from", str(first), "--skip-prompts", "10",
                 "--copy-gate", "--data-from", str(first)]) == 0
    recipe = json.loads((second / "training.json").read_text())
    answers = [len(load_sequences(sorted((run / "data" / "train").glob("shard-*.safetensors")))) for run in (first, second)]
    assert min(answers) > 0 and recipe["train_sequences"] == sum(answers)  # its own answers and the first run's
    # --copy-gate added a gate to the continued drafter; the exported folder is a gated drafter.
    gated = load_mtp_drafter(second, tiny_target.model, torch.float32, "cpu")
    assert gated.net.config.copy_gate and gated.net.copy_gate is not None
    assert recipe["init_from"] == str(first) and recipe["history"][0]["step"] == 0
    assert recipe["corpus_sequences"] == 0
    assert json.loads((second / "data" / "train" / "data.json").read_text())["first_prompt"] == 10


def test_corpus_fraction_sets_the_batches_mix(tiny_target, tiny_data, corpus_seqs, tmp_path):
    import random

    train, held = tiny_data
    mixed = train[:20] + corpus_seqs[1]  # 20 answers and a few corpus pieces
    dcfg = drafter_config_for(tiny_target.model, hidden=32, layers=2, heads=4, head="target", clustered=False)
    share = {}
    for frac in (0.25, 0.75, None):
        trainer = Trainer(tiny_target, tmp_path / str(frac), small_config(corpus_fraction=frac), dcfg, mixed, held,
                          log=lambda m: None)
        rng = random.Random(0)
        share[frac] = sum(trainer._draw(rng).corpus for _ in range(400)) / 400
    assert abs(share[0.25] - 0.25) < 0.06 and abs(share[0.75] - 0.75) < 0.06, share
    uniform = len(corpus_seqs[1]) / len(mixed)  # None: every sequence equally likely
    assert abs(share[None] - uniform) < 0.08, (share, uniform)


def word_line_ends(tokenizer) -> set[int]:
    """The tiny word-level vocabulary has no line break: a third of its words stand in for one."""
    return {tokenizer.token_to_id(f"w{i}") for i in range(40)}


def test_synthetic_prompts_are_new_guarded_and_resume_to_the_same_list(tiny_target, tmp_path, monkeypatch):
    from specdraft.training import synthetic

    monkeypatch.setattr(synthetic, "line_end_ids", word_line_ends)
    seeds = word_prompts(16, 5)
    cfg = synthetic.SyntheticConfig(shots=3, max_tokens=12, batch_size=8, min_words=2)
    refuse = lambda p: "w60" in p.split()  # noqa: E731
    path = tmp_path / "synthetic.jsonl"
    made = synthetic.synthesize_prompts(tiny_target, seeds, 12, path, cfg, refuse=refuse)
    assert len(made) == 12 and len(set(made)) == 12
    assert not set(made) & set(seeds) and not any(map(refuse, made))
    assert all(len(p.split()) >= 2 and "\n" not in p for p in made)
    # Interrupted after the first batch, in the middle of writing the second: the rerun redoes
    # the second batch with the same seed and ends with the same prompts.
    lines = path.read_text().splitlines()
    first_done = lines.index(json.dumps({"batch_done": 0}))
    path.write_text("\n".join(lines[: first_done + 2]) + '\n{"prompt": "w1 w2')
    assert synthetic.synthesize_prompts(tiny_target, seeds, 12, path, cfg, refuse=refuse) == made
    # Enough cached: nothing is generated; more asked: the list grows at its end.
    monkeypatch.setattr(synthetic, "record_answers", None)
    assert synthetic.synthesize_prompts(tiny_target, seeds, 5, path, cfg, refuse=refuse) == made[:5]


def test_synthetic_prompts_need_single_line_examples(tiny_target, tmp_path):
    from specdraft.training.synthetic import SyntheticConfig, synthesize_prompts

    with pytest.raises(SpecdraftError, match="at least 4 single-line training prompts"):
        synthesize_prompts(tiny_target, ["w1 w2\nw3", "w4"], 3, tmp_path / "s.jsonl", SyntheticConfig())


def test_a_prompt_cut_by_the_token_limit_is_dropped():
    from specdraft.training.synthetic import SyntheticConfig, clean

    cfg = SyntheticConfig()
    assert clean(" Write a poem about rain.\nQuestion: more", True, cfg) == "Write a poem about rain."
    assert clean(" Write a poem about rain and", False, cfg) is None
    assert clean(" Hi there\n", True, cfg) is None  # fewer than min_words


def test_train_cli_adds_synthetic_prompts(tiny_target, tmp_path, monkeypatch):
    from specdraft.cli.main import main
    from specdraft.training import synthetic

    monkeypatch.setattr(synthetic, "line_end_ids", word_line_ends)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(word_prompts(12, 8)) + "\n")
    out = tmp_path / "run"
    assert main(["train-drafter", "--model", str(tiny_target.folder), "--dtype", "float32", "--device", "cpu",
                 "--prompts", str(prompts), "--synthetic-prompts", "6", "--synthetic-from", str(prompts),
                 "--answer-tokens", "8", "--steps", "2", "--batch-size", "4", "--anchors", "4", "--eval-every",
                 "2", "--held-out", "2", "--hidden", "32", "--heads", "4", "--clusters", "0",
                 "--out", str(out)]) == 0
    written = [json.loads(l)["prompt"] for l in (out / "data" / "synthetic_prompts.jsonl").read_text().splitlines()
               if "prompt" in json.loads(l)]
    assert len(written) == 6
    plain = load_prompt_set([prompts], [], held_out_fraction=0.05).train
    assert json.loads((out / "training.json").read_text())["train_sequences"] == len(plain) + 6


def test_a_copy_gate_added_to_a_trained_drafter_starts_closed_and_learns_to_copy(tiny_target, tiny_data, tmp_path):
    first = make_trainer(tiny_target, tmp_path / "a", tiny_data, small_config(steps=20))
    first.train()
    save_network(first.net, tmp_path / "trained")
    results = {}
    for gate in (False, True):
        cfg = replace(first.net.config, copy_gate=gate)
        more = Trainer(tiny_target, tmp_path / f"more-{gate}", small_config(steps=60), cfg, *tiny_data,
                       log=lambda m: None, init_from=tmp_path / "trained")
        if not gate:  # continued as it was: the trained drafter's own numbers
            assert more.evaluate()["tau"] == first.evaluate()["tau"]
        else:  # closed at the start: a bonus of 0 on every copy. The copies outside the kept
            # clusters still join the candidates, as they do once the gate opens, and can take
            # an argmax there; that is all that may move (a few anchors in a thousand).
            assert more.net.copy_gate is not None and not more.net.copy_gate.proj.weight.any()
            assert abs(more.evaluate()["tau"] - first.evaluate()["tau"]) <= 0.01
        more.train()
        results[gate] = more.evaluate()["tau"]
    # The tiny target's greedy answers repeat (where a token pair recurs, what followed it is the
    # next token 75% of the time): the gate learns to add to the copies, and the gated drafter,
    # trained as long, drafts better.
    assert (more.net.copy_gate.proj.bias > 0.1).all(), more.net.copy_gate.proj.bias
    assert results[True] > results[False], results


def test_a_deepened_drafter_starts_as_the_trained_one_and_opens_its_new_blocks(tiny_target, tiny_data, tmp_path):
    from specdraft.training.grow import grown_config

    first = make_trainer(tiny_target, tmp_path / "a", tiny_data, small_config(steps=20))
    first.train()
    save_network(first.net, tmp_path / "trained")
    cfg = grown_config(first.net.config, 4, tiny_target.model.config.layer_types)
    assert cfg.layer_types == ["sliding_attention"] * 2 + first.net.config.layer_types
    deeper = Trainer(tiny_target, tmp_path / "b", small_config(steps=30), cfg, *tiny_data, log=lambda m: None,
                     init_from=tmp_path / "trained")
    trained = first.net.state_dict()
    for i in range(2):  # the trained blocks, moved back by two
        for name, t in first.net.model.layers[i].state_dict().items():
            assert torch.equal(deeper.net.model.layers[i + 2].state_dict()[name], t), name
    assert torch.equal(deeper.net.pre_projection.weight, trained["pre_projection.weight"])
    before = first.evaluate()
    assert deeper.evaluate()["tau"] == pytest.approx(before["tau"], abs=1e-6)  # identity blocks in front
    deeper.train()
    new = deeper.net.model.layers[0]
    assert new.post_attention_layernorm.weight.abs().max() > 0 and new.self_attn.o_proj.weight.grad is not None
    scale = {id(p): g["lr_scale"] for g in deeper.opt.param_groups for p in g["params"]}
    assert scale[id(new.self_attn.q_proj.weight)] == NEW_BLOCK_LR_SCALE
    assert scale[id(deeper.net.model.layers[2].self_attn.q_proj.weight)] == 1.0
    deeper.save_checkpoint()  # a resumed run keeps the new blocks' rate
    resumed = Trainer(tiny_target, tmp_path / "b", small_config(steps=30), cfg, *tiny_data, log=lambda m: None)
    assert resumed.new_blocks == 2 and resumed.step == deeper.step
    with pytest.raises(SpecdraftError, match="can be deepened, not cut"):
        grown_config(cfg, 3, tiny_target.model.config.layer_types)
