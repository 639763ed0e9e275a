"""The CUDA path: the CPU suite's guarantees, checked again where the arithmetic and the kernels
differ. Skipped where torch sees no CUDA device (CI has none); on a GPU machine run
`python -m pytest tests/test_cuda.py`.

What it checks, in float32 with TF32 off (IEEE fp32, so the CPU suite's tolerances apply):
logits parity with transformers (prefill and cached one-token steps); greedy speculative
output equal to plain greedy on the GPU, and plain greedy on the GPU equal to the CPU's, for
each drafter kind, eager and compiled; speculative sampling following the target's exact
distribution (chi-square, as tests/test_sampling_exact.py); the step-wise engine's concurrent
requests equal to one-at-a-time; Gemma 4 with its assistant equal to transformers; the CLI's
`generate` and `bench` with `--device cuda`; drafter training on the GPU (bf16 autocast).
"""

from __future__ import annotations

import json

import pytest
import torch

from conftest import FP32, TinyModel, assert_fp32_close, load_ours, make_tiny, prompts_of, reduction_depth
from specdraft.drafters.draft_model import DraftModelDrafter
from specdraft.drafters.mtp import drafter_config_for, init_network, load_mtp_drafter, save_network
from specdraft.drafters.mtp_lookup import MTPWithLookup
from specdraft.drafters.ngram import NgramDrafter
from specdraft.loading import load_folder
from specdraft.runtime import Runtime
from specdraft.sampling import SamplingParams
from specdraft.speculative.engine import Engine
from specdraft.speculative.request import Request

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CUDA = torch.device("cuda")
MAX_NEW = 24


@pytest.fixture(scope="module", autouse=True)
def ieee_fp32():
    """TF32 matmuls round to ~1e-3 and would hide real errors below the fp32 tolerances."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def on_cuda(tiny: TinyModel) -> torch.nn.Module:
    model, _, _ = load_folder(tiny.folder, FP32, "cuda")
    return model


@pytest.fixture(scope="module")
def gemma(tmp_path_factory) -> TinyModel:
    """Gemma 3 style (sliding window 8, GQA, tied head), as tests/conftest.py's gemma_tiny."""
    return make_tiny(tmp_path_factory.mktemp("cuda_gemma"), "gemma3", seed=1)


@pytest.fixture(scope="module")
def gemma_cuda(gemma: TinyModel) -> torch.nn.Module:
    return on_cuda(gemma)


@pytest.mark.parametrize("family", ["gemma3", "llama", "qwen3"])
def test_logits_match_transformers(family: str, tmp_path) -> None:
    tiny = make_tiny(tmp_path, family, seed=4)
    model = on_cuda(tiny)
    ids = prompts_of([40], tiny.cfg.vocab_size, seed=3)[0]
    ref = tiny.hf_logits(ids)
    depth = reduction_depth(tiny.cfg)
    cache = model.new_cache(1, 48)
    n = 32
    with torch.inference_mode():
        prefill = model.logits(model(torch.tensor([ids[:n]], device=CUDA), cache))[0]
        steps = [model.logits(model(torch.tensor([[t]], device=CUDA), cache))[0, -1] for t in ids[n:]]
    assert prefill.device.type == "cuda"
    assert_fp32_close(prefill.cpu(), ref[:n], depth)
    assert_fp32_close(torch.stack(steps).cpu(), ref[n:], depth)


def batch_prompts(vocab: int, b: int) -> list[list[int]]:
    lengths = {1: [9], 3: [4, 13, 1]}[b]
    prompts = prompts_of(lengths, vocab, seed=100 + b)
    return [p + p[:5] if len(p) > 8 else p for p in prompts]  # repeats for the n-gram drafter


@pytest.fixture(scope="module")
def cuda_drafters(gemma: TinyModel, gemma_cuda, tmp_path_factory):
    """name -> a fresh drafter on the GPU (drafters keep per-row state, so one per engine)."""
    folder = tmp_path_factory.mktemp("cuda_mtp")
    for name, clustered in (("dense", False), ("clustered", True)):
        cfg = drafter_config_for(gemma_cuda, hidden=32, layers=2, heads=4, head="target", clustered=clustered,
                                 num_centroids=16 if clustered else None, top_k_clusters=4)
        save_network(init_network(cfg, gemma.ours, seed=1, std=0.1), folder / name)
    # A draft model that often agrees: the target's weights times 1 + N(0, 0.07).
    noisy = on_cuda(gemma)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in noisy.parameters():
            p.mul_(1 + (torch.randn(p.shape, generator=gen) * 0.07).to(p.device))

    def make(name: str, target: torch.nn.Module | None = None):
        if name == "ngram":
            return NgramDrafter()
        if name == "draft-model":
            return DraftModelDrafter(noisy)
        network = folder / name.removesuffix("+ngram").removeprefix("mtp-")
        mtp = load_mtp_drafter(network, target if target is not None else gemma_cuda, FP32, "cuda")
        return MTPWithLookup(mtp) if name.endswith("+ngram") else mtp

    return make


@pytest.fixture(scope="module")
def plain_on_cpu(gemma: TinyModel) -> dict[int, list[list[int]]]:
    engine = Engine(gemma.ours)
    return {b: [r.token_ids for r in engine.generate(batch_prompts(gemma.cfg.vocab_size, b), MAX_NEW,
                                                     eos_token_ids=[])] for b in (1, 3)}


@pytest.mark.parametrize("b", [1, 3])
def test_plain_greedy_on_the_gpu_equals_the_cpu(b: int, gemma: TinyModel, gemma_cuda, plain_on_cpu) -> None:
    results = Engine(gemma_cuda).generate(batch_prompts(gemma.cfg.vocab_size, b), MAX_NEW, eos_token_ids=[])
    assert [r.token_ids for r in results] == plain_on_cpu[b]


@pytest.mark.parametrize("b", [1, 3])
@pytest.mark.parametrize("name", ["ngram", "mtp-dense", "mtp-clustered", "mtp-clustered+ngram", "draft-model"])
def test_greedy_speculative_equals_plain(name: str, b: int, gemma: TinyModel, gemma_cuda, cuda_drafters,
                                         plain_on_cpu) -> None:
    engine = Engine(gemma_cuda, None, cuda_drafters(name), 3)
    results = engine.generate(batch_prompts(gemma.cfg.vocab_size, b), MAX_NEW, eos_token_ids=[])
    assert [r.token_ids for r in results] == plain_on_cpu[b]
    assert sum(r.stats.drafted for r in results) > 0


def test_compiled_steps_equal_plain(gemma: TinyModel, cuda_drafters, plain_on_cpu) -> None:
    rt = Runtime.load(str(gemma.folder), "float32", "cuda", progress=False, compile=True)
    for name in ("none", "mtp-clustered+ngram"):
        drafter = None if name == "none" else cuda_drafters(name, rt.model)
        results = Engine(rt.model, None, drafter, 3).generate(batch_prompts(gemma.cfg.vocab_size, 3), MAX_NEW,
                                                              eos_token_ids=[])
        assert [r.token_ids for r in results] == plain_on_cpu[3], name


def test_speculative_sampling_matches_target_distribution(tmp_path) -> None:
    """test_sampling_exact.py's harness with the target and drafters on the GPU: MTP drafts
    sampled from the clustered head mixed with point-mass lookups, and a plain-sampling control."""
    import test_sampling_exact as ref

    hf = ref.build_hf("llama", seed=3, std=0.2, vocab_size=ref.V, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=2, head_dim=8)
    with torch.no_grad():
        hf.lm_head.weight.mul_(3.0)
    folder = ref.save_hf(hf, tmp_path / "v16", tokenizer=False)
    model, cfg, _ = load_folder(folder, FP32, "cuda")
    target = TinyModel("llama", folder, hf, model, cfg)
    dcfg = drafter_config_for(model, hidden=32, layers=2, heads=4, head="own", clustered=True,
                              num_centroids=4, top_k_clusters=2)
    save_network(init_network(dcfg, model, seed=0, std=0.3), tmp_path / "mtp16")
    mtp = load_mtp_drafter(tmp_path / "mtp16", model, FP32, "cuda")
    for name, drafter, k, seed in (("plain", None, 0, 5), ("mtp", mtp, 2, 30),
                                   ("mtp+ngram", MTPWithLookup(mtp, min_match=1), 2, 50)):
        probs = ref.exact_joint(target)
        counts, acceptance = ref.sample_counts(target, drafter, k, ref.T1, ref.N, seed)
        stat, df, p_value, pooled, tv = ref.chi_square(counts, probs)
        assert pooled < 0.01 and ref.detection_power(ref.N, df) >= 0.98
        if drafter is not None:
            assert acceptance is not None and 0.05 < acceptance < 0.9, acceptance
        assert p_value > ref.ALPHA, f"{name}: chi2 {stat:.1f} on {df} df, p = {p_value:.2e}, TV {tv:.4f}"


def test_concurrent_requests_equal_one_at_a_time(gemma: TinyModel, gemma_cuda, cuda_drafters) -> None:
    from test_step_engine import run_concurrently

    lengths, max_new = [3, 40, 7, 90, 1, 25, 60, 12], [5, 30, 12, 8, 25, 3, 18, 30]
    prompts = [p + p[: len(p) // 2] if len(p) > 10 else p for p in prompts_of(lengths, gemma.cfg.vocab_size, seed=7)]
    plain = Engine(gemma_cuda)
    expected = [plain.generate([p], m, eos_token_ids=[])[0].token_ids for p, m in zip(prompts, max_new)]
    engine = Engine(gemma_cuda, None, cuda_drafters("mtp-clustered+ngram"), 3, max_batch_size=4, capacity=256,
                    prefill_chunk=16)
    requests = [Request(p, m, eos_token_ids=[]) for p, m in zip(prompts, max_new)]
    done = run_concurrently(engine, requests, joins={i: (i % 3) * 2 for i in range(len(requests))})
    assert [done[r.id].token_ids for r in requests] == expected


def test_gemma4_with_its_assistant_equals_transformers(tmp_path) -> None:
    transformers = pytest.importorskip("transformers")
    from gemma4_tiny import assistant_config, follow_transitions_, greedy_sequences, randomize_, target_text_config

    ref_t = randomize_(transformers.Gemma4ForCausalLM(target_text_config()), seed=11)
    ref_t.save_pretrained(tmp_path / "target")
    model, _, _ = load_folder(tmp_path / "target", FP32, "cuda")
    gen = torch.Generator().manual_seed(14)
    prompts = [torch.randint(3, 250, (n,), generator=gen).tolist() for n in (6, 11, 17)]
    expected = greedy_sequences(ref_t, prompts, 24)
    ref_a = transformers.Gemma4AssistantForCausalLM(assistant_config(ref_t.config))
    follow_transitions_(randomize_(ref_a, seed=15), ref_t, expected[:2])
    ref_a.save_pretrained(tmp_path / "assistant")
    drafter = load_mtp_drafter(tmp_path / "assistant", model, FP32, "cuda")
    results = Engine(model, drafter=drafter, draft_tokens=3).generate(prompts, max_new_tokens=24, eos_token_ids=[])
    assert [r.token_ids for r in results] == [s[len(p):] for s, p in zip(expected, prompts)]
    assert 0 < sum(r.stats.accepted for r in results) < sum(r.stats.drafted for r in results)


def test_cli_generate_and_bench_on_cuda(gemma: TinyModel, capsys, tmp_path) -> None:
    from specdraft.cli.main import main
    from specdraft.tokenizer import Tokenizer

    prompts = ["w1 w2 w3 w1 w2", "The quick brown fox", "w7"]
    (tmp_path / "prompts.txt").write_text("\n".join(prompts) + "\n")
    tok = Tokenizer(gemma.folder, gemma.cfg.eos_token_ids)
    want = [r.token_ids for r in Engine(gemma.ours, tok).generate([tok.encode(p) for p in prompts], 12)]
    for drafter in ("none", "ngram"):
        capsys.readouterr()
        assert main(["generate", "--prompts-file", str(tmp_path / "prompts.txt"), "--model", str(gemma.folder),
                     "--dtype", "float32", "--device", "cuda", "--drafter", drafter, "--max-new-tokens", "12",
                     "--batch-size", "2", "--json"]) == 0
        records = [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]
        assert [r["token_ids"] for r in records] == want, drafter
    # The default dtype on CUDA (bfloat16) runs end to end.
    capsys.readouterr()
    assert main(["generate", "w1 w2 w3", "--model", str(gemma.folder), "--device", "cuda", "--drafter", "ngram",
                 "--max-new-tokens", "8", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["dtype"] == "bfloat16"

    questions = tmp_path / "question.jsonl"
    questions.write_text("\n".join(json.dumps({"question_id": i, "category": c, "turns": [t]}) for i, (c, t) in
                                   enumerate([("writing", "w5 w6 w7 w5 w6 w7"), ("coding", "w10 w11 w12 w10")])) + "\n")
    out = tmp_path / "bench"
    assert main(["bench", "--model", str(gemma.folder), "--questions", str(questions), "--limit-per-category", "1",
                 "--methods", "plain,ngram", "--batch-sizes", "1,2", "--max-new-tokens", "8", "--dtype", "float32",
                 "--device", "cuda", "--out", str(out), "--no-progress", "--no-plots"]) == 0
    data = json.loads((out / "results.json").read_text())
    by = {}
    for r in data["rows"]:
        by.setdefault((r["question_id"], r["batch_size"]), {})[r["method"]] = r["token_ids"]
    assert all(m["plain"] == m["ngram"] for m in by.values())
    assert any(b.get("cuda_peak") for b in data["batches"])


def test_drafter_training_on_cuda(gemma: TinyModel, gemma_cuda, plain_on_cpu, tmp_path) -> None:
    from specdraft.cli.main import main
    from test_training import word_prompts

    (tmp_path / "prompts.txt").write_text("\n".join(word_prompts(24, 7)) + "\n")
    (tmp_path / "corpus.txt").write_text("\n".join(" ".join(word_prompts(10, s)) for s in range(20, 30)) + "\n")
    out = tmp_path / "run"
    # Greedy and sampled answers, prefill-distilled corpus text, training, held-out decoding tau.
    assert main(["train-drafter", "--model", str(gemma.folder), "--device", "cuda", "--prompts",
                 str(tmp_path / "prompts.txt"), "--corpus", str(tmp_path / "corpus.txt"), "--answer-tokens", "8",
                 "--steps", "6", "--batch-size", "4", "--anchors", "4", "--eval-every", "3", "--held-out", "2",
                 "--hidden", "32", "--heads", "4", "--clusters", "16", "--top-k-clusters", "4", "--out", str(out),
                 "--debug"]) == 0
    recipe = json.loads((out / "training.json").read_text())
    assert recipe["corpus_sequences"] >= 10 and recipe["history"]
    assert json.loads((out / "checkpoint" / "state.json").read_text())["step"] == 6
    # Resumed on the GPU (optimizer state moved there), and the exported drafter drafts losslessly.
    assert main(["train-drafter", "--model", str(gemma.folder), "--device", "cuda", "--prompts",
                 str(tmp_path / "prompts.txt"), "--corpus", str(tmp_path / "corpus.txt"), "--answer-tokens", "8",
                 "--steps", "8", "--batch-size", "4", "--anchors", "4", "--eval-every", "3", "--held-out", "2",
                 "--hidden", "32", "--heads", "4", "--clusters", "16", "--top-k-clusters", "4", "--out", str(out),
                 "--resume", "--debug"]) == 0
    assert json.loads((out / "checkpoint" / "state.json").read_text())["step"] == 8
    drafter = load_mtp_drafter(out, gemma_cuda, FP32, "cuda")
    results = Engine(gemma_cuda, None, drafter, 3).generate(batch_prompts(gemma.cfg.vocab_size, 3), MAX_NEW,
                                                            eos_token_ids=[])
    assert [r.token_ids for r in results] == plain_on_cpu[3]
