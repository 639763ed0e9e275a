"""The whole `specdraft bench` path on a tiny random model, and peers reported as skipped.

The tiny model is a random Llama saved as an ordinary HF folder (safetensors + a word-level
tokenizer.json), so specdraft's own loader and transformers both read it, as for a real model.
No timing is asserted: only that the run completes and its outputs are well formed.
"""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest
import torch

from specdraft.bench import methods as bench_methods
from specdraft.bench.methods import BenchContext, Skip
from specdraft.bench.runner import build_method
from specdraft.bench.questions import PLAIN_TEMPLATE, Question, encode, read_questions, select
from specdraft.errors import SpecdraftError
from specdraft.sampling import SamplingParams
from specdraft.speculative.policy import AdaptivePolicy

VOCAB = 64
SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>"]
WORDS = SPECIALS + [f"w{i}" for i in range(VOCAB - len(SPECIALS))]


def _write_tokenizer(folder: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(SPECIALS)
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 2)])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<bos>", "eos_token": "<eos>",
                                                              "pad_token": "<pad>", "unk_token": "<unk>"}))


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("tiny_llama")
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
                      bos_token_id=2, eos_token_id=1, pad_token_id=0)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # a wider spread than the default init, so greedy outputs vary with the prompt
        for p in model.parameters():
            p.normal_(1.0 if p.dim() == 1 else 0.0, 0.3)
    model.save_pretrained(folder, safe_serialization=True)
    _write_tokenizer(folder)
    return folder


@pytest.fixture(scope="module")
def questions_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("q") / "question.jsonl"
    lines = [
        {"question_id": 1, "category": "writing", "turns": ["w5 w6 w7 w5 w6 w7 w5 w6", "second turn ignored"]},
        {"question_id": 2, "category": "coding", "turns": ["w10 w11 w12 w13 w10 w11"]},
        {"question_id": 3, "category": "coding", "turns": ["w20 w21"]},
    ]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    return path


def test_bench_cli_end_to_end(tiny_folder, questions_file, tmp_path, capsys):
    from specdraft.cli.main import main

    out = tmp_path / "out"
    rc = main(["bench", "--model", str(tiny_folder), "--questions", str(questions_file),
               "--limit-per-category", "1", "--methods", "plain,ngram", "--batch-sizes", "1,2",
               "--max-new-tokens", "8", "--dtype", "float32", "--device", "cpu", "--out", str(out),
               "--no-progress"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "batch size 1:" in printed and "ngram" in printed

    data = json.loads((out / "results.json").read_text())
    assert [q["category"] for q in data["questions"]] == ["writing", "coding"]
    assert {"cpu", "cpu_count", "torch", "dtype", "git_commit"} <= set(data["machine"])
    assert data["machine"]["dtype"] == "float32"
    # every raw measurement: 2 prompts x 2 methods x 2 batch sizes
    assert len(data["rows"]) == 8
    for r in data["rows"]:
        assert 1 <= r["new_tokens"] <= 8 and r["seconds"] > 0 and len(r["token_ids"]) == r["new_tokens"]
    ngram_rows = [r for r in data["rows"] if r["method"] == "ngram"]
    assert all(len(r["drafted_by_position"]) == 4 for r in ngram_rows)
    assert len([b for b in data["batches"] if b["batch_size"] == 2]) == 2  # one batch of 2 per method
    summary = data["summary"]["batch_sizes"]
    assert set(summary) == {"1", "2"}
    one = summary["1"]["methods"]
    assert one["plain"]["overall"]["speedup"] == pytest.approx(1.0)
    assert one["ngram"]["overall"]["tau"] >= 1.0
    # greedy speculative decoding in float32 is lossless: same tokens as plain
    assert one["ngram"]["overall"]["identical_rate"] == 1.0
    assert set(one["ngram"]["categories"]) == {"writing", "coding"}
    assert summary["2"]["methods"]["plain"]["throughput"] > 0
    assert data["methods"]["ngram"]["draft_tokens"] == 4
    assert data["prompt_format"] == {"style": "plain", "template": PLAIN_TEMPLATE}

    md = (out / "results.md").read_text()
    for heading in ("## Batch size 1", "## Batch size 2", "## Speedup by category", "## Acceptance by draft position",
                    "## Batch sweep", "## Memory", "Question: {prompt}"):
        assert heading in md
    assert set(data["plots"]) == {"speedup_by_category.png", "acceptance_by_position.png",
                                  "throughput_vs_batch_size.png"}
    for name in data["plots"]:
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"]({name})" in md


@pytest.fixture(scope="module")
def ctx(tiny_folder) -> BenchContext:
    from specdraft.runtime import Runtime

    rt = Runtime.load(str(tiny_folder), "float32", "cpu", progress=False)
    return BenchContext(rt, SamplingParams())


def test_missing_llama_cpp_is_skipped(ctx, monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # makes `import llama_cpp` raise ImportError
    with pytest.raises(Skip, match="llama-cpp-python is not installed"):
        build_method("llama-cpp", ctx)


def test_missing_transformers_is_skipped(ctx, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(Skip, match="transformers is not installed"):
        build_method("hf", BenchContext(ctx.rt, ctx.sampling))


def test_llama_cpp_without_gguf_is_skipped(ctx, monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", types.ModuleType("llama_cpp"))
    with pytest.raises(Skip, match="no GGUF"):
        build_method("llama-cpp", ctx)


def test_drafters_without_weights_are_skipped(ctx):
    for name in ("mtp", "mtp+ngram"):
        with pytest.raises(Skip, match="--drafter-path"):
            build_method(name, ctx)
    with pytest.raises(Skip, match="--draft-model"):
        build_method("draft-model", ctx)
    with pytest.raises(SpecdraftError, match="unknown method"):
        build_method("nope", ctx)


def test_skipped_peers_reported_in_outputs(tiny_folder, questions_file, tmp_path, monkeypatch):
    from specdraft.bench.runner import BenchConfig, run_bench

    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    out = tmp_path / "out"
    payload = run_bench(BenchConfig(questions=questions_file, model=str(tiny_folder), categories=["coding"],
                                    limit_per_category=1, methods=["llama-cpp", "mtp", "hf-pld"],
                                    max_new_tokens=4, dtype="float32", device="cpu", out=out, progress=False,
                                    plots=False, warmup=False))
    assert "plain" in payload["methods"]  # the reference always runs
    assert "hf-pld" in payload["methods"]  # transformers' prompt lookup on the same weights
    assert set(payload["skipped"]) == {"llama-cpp", "mtp"}
    md = (out / "results.md").read_text()
    assert "## Skipped" in md and "llama-cpp-python is not installed" in md
    assert json.loads((out / "results.json").read_text())["skipped"] == payload["skipped"]


def test_report_from_rebuilds_a_finished_runs_tables(tiny_folder, questions_file, tmp_path, capsys):
    """--report-from measures nothing: the tables come back from the raw records alone."""
    from specdraft.bench.runner import BenchConfig, run_bench
    from specdraft.cli.main import main

    out = tmp_path / "out"
    run_bench(BenchConfig(questions=questions_file, model=str(tiny_folder), limit_per_category=1, methods=["ngram"],
                          max_new_tokens=4, dtype="float32", device="cpu", out=out, progress=False, plots=False,
                          warmup=False))
    md = (out / "results.md").read_text()
    assert "against the reference and the best fixed method" not in md  # no `auto` in the run
    raw = json.loads((out / "results.json").read_text())
    summary = raw.pop("summary")
    (out / "results.json").write_text(json.dumps(raw))  # an older run's summary: gone or stale
    (out / "results.md").unlink()
    assert main(["bench", "--report-from", str(out), "--no-plots"]) == 0
    assert (out / "results.md").read_text() == md
    assert json.loads((out / "results.json").read_text())["summary"] == json.loads(json.dumps(summary))
    assert "rewrote" in capsys.readouterr().out
    for argv, needle in ((["bench", "--report-from", str(tmp_path / "none")], "does not exist"),
                         (["bench", "--methods", "nope"], "unknown method")):
        assert main(argv) != 0
        assert needle in capsys.readouterr().err
    (out / "results.json").write_text("{}")
    assert main(["bench", "--report-from", str(out)]) != 0
    assert "not a `specdraft bench` results file" in capsys.readouterr().err


def test_a_run_with_auto_reports_it_against_the_best_fixed_method(tiny_folder, questions_file, tmp_path):
    """The never-slower table: in results.md and in the printed summary, per category and overall."""
    from specdraft.bench.report import text_summary
    from specdraft.bench.runner import BenchConfig, run_bench

    out = tmp_path / "out"
    payload = run_bench(BenchConfig(questions=questions_file, model=str(tiny_folder), methods=["auto", "ngram"],
                                    max_new_tokens=4, dtype="float32", device="cpu", out=out, progress=False,
                                    plots=False, warmup=False))
    best = payload["summary"]["batch_sizes"]["1"]["methods"]["auto"]["against_best_fixed"]
    assert best["overall"]["method"] in ("plain", "ngram") and set(best["categories"]) == {"coding", "writing"}
    md = (out / "results.md").read_text()
    assert "## `auto` against the reference and the best fixed method (batch size 1)" in md
    assert "auto against the best fixed method, batch size 1" in text_summary(payload)


def test_ignore_eos_generates_every_token_past_an_eos(ctx, monkeypatch):
    """--ignore-eos: every method (specdraft's and transformers') generates max_new_tokens even
    where the target emits an EOS id, and greedy methods still agree token for token."""
    prompts = [[2, 5, 6, 7, 5, 6, 7]]
    free = build_method("plain", BenchContext(ctx.rt, ctx.sampling, ignore_eos=True)).generate(prompts, 12)
    tokens = free.rows[0].token_ids
    assert len(tokens) == 12
    monkeypatch.setattr(ctx.rt.tokenizer, "eos_token_ids", [tokens[2]])  # the target emits it at step 3
    stopping = build_method("plain", BenchContext(ctx.rt, ctx.sampling)).generate(prompts, 12).rows[0]
    assert stopping.token_ids == tokens[: tokens.index(tokens[2]) + 1] and stopping.finish_reason == "eos"
    ignoring = BenchContext(ctx.rt, ctx.sampling, ignore_eos=True)
    for name in ("plain", "ngram", "hf"):
        row = build_method(name, ignoring).generate(prompts, 12).rows[0]
        assert row.token_ids == tokens and row.finish_reason == "length", name


def test_bench_cli_ignore_eos(tiny_folder, questions_file, tmp_path):
    from specdraft.cli.main import main

    out = tmp_path / "out"
    assert main(["bench", "--model", str(tiny_folder), "--questions", str(questions_file), "--limit-per-category", "1",
                 "--methods", "plain,ngram", "--max-new-tokens", "9", "--temperature", "1", "--ignore-eos",
                 "--dtype", "float32", "--device", "cpu", "--out", str(out), "--no-progress", "--no-plots"]) == 0
    data = json.loads((out / "results.json").read_text())
    assert data["config"]["ignore_eos"] and all(r["new_tokens"] == 9 for r in data["rows"])
    assert "EOS ignored" in (out / "results.md").read_text()


def test_questions_formats_and_selection(tmp_path, ctx):
    txt = tmp_path / "prompts.txt"
    txt.write_text("w1 w2\n\nw3\n")
    assert read_questions(txt) == [Question("0", "all", "w1 w2"), Question("1", "all", "w3")]
    jl = tmp_path / "p.jsonl"
    jl.write_text('{"prompt": "w4"}\n{"prompt": "w5", "category": "x"}\n')
    assert [(q.category, q.text) for q in read_questions(jl)] == [("all", "w4"), ("x", "w5")]
    qs = [Question(str(i), c, "w1") for i, c in enumerate("aabbb")]
    assert [q.qid for q in select(qs, ["b"], 2)] == ["2", "3"]
    with pytest.raises(SpecdraftError, match="unknown category"):
        select(qs, ["z"], None)
    # a base model (no chat template) gets the plain template: <bos> Question: w1 \n Answer:
    ids = encode(ctx.rt.tokenizer, Question("0", "all", "w1"), "plain")
    assert ids == ctx.rt.tokenizer.encode(PLAIN_TEMPLATE.format(prompt="w1"))
    assert ids[0] == 2 and WORDS.index("w1") in ids


def test_cut_at_eos():
    assert bench_methods.cut_at_eos([5, 1, 7], {1}, 10) == ([5, 1], "eos")
    assert bench_methods.cut_at_eos([5, 6, 7], {1}, 2) == ([5, 6], "length")


def test_draft_model_method_runs(ctx, tiny_folder):
    dctx = BenchContext(ctx.rt, ctx.sampling, draft_tokens=3, draft_model=str(tiny_folder))
    method = build_method("draft-model", dctx)
    out = method.generate([[2, 5, 6, 7], [2, 9]], 6)
    assert all(1 <= len(r.token_ids) <= 6 for r in out.rows) and out.wall_seconds > 0
    # the target drafting for itself: every draft is accepted
    assert all(r.stats["accepted_by_position"] == r.stats["drafted_by_position"] for r in out.rows)
    assert sum(sum(r.stats["drafted_by_position"]) for r in out.rows) > 0
    assert method.draft_tokens == 3 and method.own_weight_bytes > 0


def test_mtp_with_lookup_method_reports_its_mix(tiny_folder, questions_file, tmp_path):
    """The bench runs mtp+ngram losslessly and says how often each part drafted."""
    from specdraft.bench.runner import BenchConfig, run_bench
    from specdraft.drafters.mtp import drafter_config_for, init_network, save_network
    from specdraft.runtime import Runtime

    rt = Runtime.load(str(tiny_folder), "float32", "cpu", progress=False)
    cfg = drafter_config_for(rt.model, hidden=16, layers=1, heads=2, head="own", clustered=False)
    save_network(init_network(cfg, rt.model, seed=0, std=0.1), tmp_path / "drafter")
    payload = run_bench(BenchConfig(model=str(tiny_folder), questions=questions_file, methods=["mtp+ngram"],
                                    drafter_path=str(tmp_path / "drafter"), max_new_tokens=8, dtype="float32",
                                    device="cpu", out=tmp_path / "out", plots=False, progress=False))
    notes = payload["methods"]["mtp+ngram"]["notes"]
    assert any("prompt lookup drafted" in n for n in notes), notes
    one = payload["summary"]["batch_sizes"]["1"]["methods"]["mtp+ngram"]["overall"]
    assert one["identical_rate"] == 1.0


@pytest.mark.parametrize("error", [RuntimeError("boom"), KeyboardInterrupt()])
def test_failing_or_interrupted_run_still_writes_outputs(tiny_folder, questions_file, tmp_path, monkeypatch, error):
    from specdraft.bench.report import text_summary
    from specdraft.bench.runner import BenchConfig, run_bench

    calls = []
    original = bench_methods.SpecdraftMethod.generate

    def flaky(self, prompts, max_new_tokens):
        calls.append(self.name)
        if self.name == "ngram":
            raise error
        return original(self, prompts, max_new_tokens)

    monkeypatch.setattr(bench_methods.SpecdraftMethod, "generate", flaky)
    out = tmp_path / "out"
    payload = run_bench(BenchConfig(questions=questions_file, model=str(tiny_folder), limit_per_category=1,
                                    methods=["ngram"], max_new_tokens=4, dtype="float32", device="cpu", out=out,
                                    progress=False, warmup=False))
    assert (out / "results.json").exists() and (out / "results.md").exists()
    if isinstance(error, KeyboardInterrupt):
        assert payload["interrupted"] and "Interrupted" in (out / "results.md").read_text()
        assert "interrupted" in text_summary(payload)
    else:
        assert "failed at batch size 1: RuntimeError: boom" in payload["skipped"]["ngram"]
        assert {r["method"] for r in payload["rows"]} == {"plain"} and len(payload["rows"]) == 2


def test_auto_method_is_what_generate_runs(ctx):
    """`auto` in the bench is load_drafter(auto) plus the adaptive policy: a model with no shipped
    drafter runs prompt lookup (and says so), exactly like `generate --drafter auto`."""
    method = build_method("auto", ctx)
    assert method.engine.drafter.kind == "ngram" and method.draft_tokens > 0
    assert method.engine.speculate_below == ctx.rt.speculate_below
    assert isinstance(method.engine.policy, AdaptivePolicy)
    assert any(note.startswith("auto = ngram; adaptive") for note in method.notes)
    out = method.generate([[2, 5, 6, 7]], 4)
    assert out.rows[0].token_ids == build_method("plain", ctx).generate([[2, 5, 6, 7]], 4).rows[0].token_ids


def test_two_drafters_in_one_run(ctx, tmp_path, capsys):
    """METHOD@FOLDER runs another drafter beside the run's: each method drafts with its own."""
    from specdraft.cli.main import main
    from specdraft.drafters.mtp import drafter_config_for, init_network, save_network

    folders = []
    for seed, hidden in ((0, 16), (1, 24)):
        cfg = drafter_config_for(ctx.rt.model, hidden=hidden, layers=1, heads=2, head="own", clustered=False)
        folders.append(tmp_path / f"d{seed}")
        save_network(init_network(cfg, ctx.rt.model, seed=seed, std=0.1), folders[-1])
    dctx = BenchContext(ctx.rt, ctx.sampling, drafter_path=str(folders[0]))
    first, second = build_method("mtp", dctx), build_method(f"mtp@{folders[1]}", dctx)
    assert first.engine.drafter.net.config.hidden_size == 16 and second.engine.drafter.net.config.hidden_size == 24
    assert second.name == f"mtp@{folders[1]}"
    adaptive = build_method(f"auto@{folders[1]}", dctx)
    assert adaptive.engine.drafter.mtp.net.config.hidden_size == 24
    plain = build_method("plain", ctx).generate([[2, 5, 6, 7]], 6).rows[0].token_ids
    assert second.generate([[2, 5, 6, 7]], 6).rows[0].token_ids == plain
    for methods, needle in (("plain@x", "only auto, mtp, mtp+ngram take a drafter folder after @"),
                            (f"mtp@{tmp_path / 'none'}", "is not a drafter folder (no config.json)"),
                            ("plain:int9", "METHOD:WEIGHTS takes one of specdraft's methods"),
                            ("llama-cpp:int8", "METHOD:WEIGHTS takes one of specdraft's methods")):
        code = main(["bench", "--model", "unused", "--questions", "unused.jsonl", "--methods", methods])
        err = capsys.readouterr().err
        assert code == 2 and needle in err and "Traceback" not in err, err


def test_another_weight_format_in_one_run(ctx):
    """METHOD:WEIGHTS loads the model once more with that format (once for every method asking)
    and runs the method on it; a format this model cannot take is skipped with the reason."""
    other = "dtype" if ctx.rt.weights != "dtype" else "fp16"
    fresh = BenchContext(ctx.rt, ctx.sampling)
    plain, ngram = build_method(f"plain:{other}", fresh), build_method(f"ngram:{other}", fresh)
    assert plain.engine.model is ngram.engine.model is not ctx.rt.model
    assert fresh.runtime(other).weights == other and fresh.runtime(None) is ctx.rt
    assert ngram.generate([[2, 5, 6, 7, 5, 6]], 6).rows[0].token_ids == plain.generate([[2, 5, 6, 7, 5, 6]], 6).rows[0].token_ids
    with pytest.raises(Skip, match="--weights gguf"):
        build_method("plain:gguf", fresh)  # a safetensors folder has no GGUF blocks


def test_the_shipped_spec_bench_questions_are_the_default():
    """Spec-Bench ships with the repository (with its license) and is what the bench measures by default."""
    from specdraft.bench.questions import DEFAULT_QUESTIONS
    from specdraft.bench.runner import BenchConfig

    questions = read_questions(DEFAULT_QUESTIONS)
    assert BenchConfig().questions == DEFAULT_QUESTIONS and (DEFAULT_QUESTIONS.parent / "LICENSE").is_file()
    assert len(questions) == 480 and len({q.category for q in questions}) == 13


def test_warm_up_reads_only_a_long_prompts_tail(tiny_folder, questions_file, tmp_path, monkeypatch):
    """The warm-up generation takes the prompt's last WARMUP_PROMPT_TOKENS tokens (first-call costs
    do not grow with the prompt); the timed generation takes the whole prompt."""
    from specdraft.bench import runner
    from specdraft.bench.runner import BenchConfig, run_bench

    lengths = []
    original = bench_methods.SpecdraftMethod.generate

    def recording(self, prompts, max_new_tokens):
        lengths.append((self.name, [len(p) for p in prompts]))
        return original(self, prompts, max_new_tokens)

    monkeypatch.setattr(bench_methods.SpecdraftMethod, "generate", recording)
    monkeypatch.setattr(runner, "WARMUP_PROMPT_TOKENS", 3)
    payload = run_bench(BenchConfig(questions=questions_file, model=str(tiny_folder), categories=["writing"],
                                    methods=["plain"], max_new_tokens=4, dtype="float32", device="cpu",
                                    out=tmp_path / "out", progress=False, plots=False))
    whole = payload["questions"][0]["prompt_tokens"]
    assert whole > 3 and lengths == [("plain", [3]), ("plain", [whole])]
