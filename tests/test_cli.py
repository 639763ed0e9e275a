"""`specdraft generate` in-process: help text, one-line errors with exit code 2 (never a
traceback), and a working tiny-model run with --json and streaming output."""

from __future__ import annotations

import argparse
import inspect
import json
import re
import shutil
from pathlib import Path

import pytest

from conftest import make_tiny, write_word_tokenizer
from specdraft.drafters.kinds import DRAFTER_KINDS
from specdraft.cli.main import main
from specdraft.drafters.mtp import drafter_config_for, init_network, save_network
from specdraft.speculative.engine import Engine
from specdraft.tokenizer import Tokenizer

FLAGS = ["--model", "--dtype", "--device", "--drafter", "--drafter-path", "--draft-tokens", "--draft-policy",
         "--max-new-tokens", "--temperature", "--top-p", "--top-k", "--seed", "--stop", "--prompts-file",
         "--batch-size", "--max-context", "--chat", "--json", "--weights", "--prefill-dtype", "--threads", "--compile",
         "--simulate-acceptance"]
JSON_FIELDS = ["prompt", "text", "token_ids", "new_tokens", "seconds", "tokens_per_second", "model", "dtype",
               "drafter", "draft_tokens", "mean_accepted", "acceptance_by_position", "target_forwards"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A tiny Llama folder (config, safetensors, tokenizer) with a 64-token context."""
    return make_tiny(tmp_path_factory.mktemp("cli") / "tiny", "llama", seed=31, max_position_embeddings=64).folder


def run(capsys, *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()  # drop what fixtures printed (transformers' save progress bars)
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def base(model_dir: Path, *extra: str) -> list[str]:
    return ["generate", "w1 w2 w3", "--model", str(model_dir), "--dtype", "float32", "--device", "cpu", *extra]


def assert_one_line_error(code: int, err: str, *needles: str) -> None:
    assert code == 2
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("specdraft: error: "), err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


def summary_line_of(err: str) -> str:
    """The one speed summary on stderr, wherever it falls among the notes and the adaptive
    policy's one-time step-cost lines (printed only where no earlier test timed the model)."""
    summaries = [line for line in err.splitlines() if line.startswith("[specdraft] ")]
    assert len(summaries) == 1, err
    return summaries[0]


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    from specdraft.cli.main import build_parser

    return next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices


def test_generate_help_mentions_every_flag(capsys) -> None:
    with pytest.raises(SystemExit) as e:
        main(["generate", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    actions = {a.option_strings[0]: a for a in _subcommands()["generate"]._actions if a.option_strings}
    assert set(actions) == set(FLAGS) | {"-h", "--debug"}  # a new flag must be added to FLAGS
    for flag in FLAGS:
        # Listed as an option of its own ("--drafter" is not satisfied by "--drafter-path"), with help.
        assert re.search(rf"^\s+{re.escape(flag)}(?![\w-])", out, re.MULTILINE), flag
        assert actions[flag].help, flag
    for kind in DRAFTER_KINDS:
        assert re.search(rf"(^|; ){re.escape(kind)}:", actions["--drafter"].help), kind  # each kind explained


def test_serve_takes_the_draft_policy_and_passes_it_on(monkeypatch) -> None:
    """serve's --draft-policy is generate's (choices, default, help) and reaches load_served."""
    def policy_flag(name: str) -> argparse.Action:
        return next(a for a in _subcommands()[name]._actions if "--draft-policy" in a.option_strings)

    served, generated = policy_flag("serve"), policy_flag("generate")
    assert (served.choices, served.default, served.help) == (generated.choices, generated.default, generated.help)
    pytest.importorskip("uvicorn")
    import specdraft.serve
    import specdraft.serve.server

    seen = {}
    signature = inspect.signature(specdraft.serve.load_served)

    def fake_load_served(*args, **kwargs):
        seen.update(signature.bind(*args, **kwargs).arguments)
        return argparse.Namespace(name="m", drafter="none")

    monkeypatch.setattr(specdraft.serve, "load_served", fake_load_served)
    monkeypatch.setattr(specdraft.serve, "create_app", lambda *a, **k: None)
    monkeypatch.setattr(specdraft.serve.server, "serve", lambda *a, **k: 0)
    for policy in ["fixed", "adaptive"]:
        assert main(["serve", "--model", "m", "--draft-policy", policy]) == 0
        assert seen["draft_policy"] == policy


def test_serve_counts_its_prefix_cache_in_the_memory_check(capsys, model_dir, monkeypatch) -> None:
    """Memory for the model and its KV rows but not for --prefix-cache-mb 300: refused before
    loading, in one line that names the prefix cache that fits; that one loads."""
    pytest.importorskip("uvicorn")
    import torch

    import specdraft.serve
    import specdraft.serve.server
    from specdraft.loading import describe_folder
    from specdraft.loading.footprint import estimate

    _, shape = describe_folder(model_dir)
    need = estimate(shape, "dtype", torch.float32, 64, batch_size=8).total  # the tiny Llama's context: 64
    monkeypatch.setenv("SPECDRAFT_MEMORY_LIMIT", str(need + (100 << 20)))
    monkeypatch.setattr(specdraft.serve, "create_app", lambda *a, **k: None)
    monkeypatch.setattr(specdraft.serve.server, "serve", lambda *a, **k: 0)
    argv = ["serve", "--model", str(model_dir), "--dtype", "float32", "--weights", "dtype", "--device", "cpu",
            "--drafter", "none"]
    code, _, err = run(capsys, *argv, "--prefix-cache-mb", "300")
    assert_one_line_error(code, err, "prefix cache 0.29 GB", "--prefix-cache-mb 100 fits")
    code, _, err = run(capsys, *argv, "--prefix-cache-mb", "100")
    assert code == 0, err


def test_unknown_model(capsys) -> None:
    code, _, err = run(capsys, "generate", "hi", "--model", "no-such-model")
    assert_one_line_error(code, err, "unknown model 'no-such-model'")


def test_missing_prompts_file(capsys, model_dir, tmp_path) -> None:
    code, _, err = run(capsys, "generate", "--prompts-file", str(tmp_path / "nope.txt"), "--model", str(model_dir))
    assert_one_line_error(code, err, "nope.txt", "does not exist")


def test_corrupt_model_folder(capsys, model_dir, tmp_path) -> None:
    bad = tmp_path / "bad"
    shutil.copytree(model_dir, bad)
    data = (bad / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(data[: len(data) // 3])
    code, _, err = run(capsys, *base(bad))
    assert_one_line_error(code, err, "model.safetensors", "truncated or corrupt")
    (bad / "config.json").write_text("{")
    code, _, err = run(capsys, *base(bad))
    assert_one_line_error(code, err, "config.json", "invalid JSON")


def test_prompt_longer_than_context(capsys, model_dir, monkeypatch) -> None:
    """Refused in one line before the adaptive policy times its step costs (seconds on a real
    model); the default drafter here is prompt lookup, whose policy would time them."""
    from specdraft.speculative.engine import Engine as EngineClass

    def timed(*args, **kwargs):
        raise AssertionError("step costs timed for a prompt that cannot fit")

    monkeypatch.setattr(EngineClass, "prepare_policy", timed)
    long_prompt = " ".join(f"w{i % 50}" for i in range(70))
    code, _, err = run(capsys, "generate", long_prompt, "--model", str(model_dir), "--dtype", "float32")
    assert_one_line_error(code, err, "exceeds the model's context of 64 tokens")
    # The prompt fits, but not with the new tokens.
    code, _, err = run(capsys, *base(model_dir, "--max-new-tokens", "62"))
    assert_one_line_error(code, err, "4 tokens + 62 new tokens exceeds")


def test_max_context_bounds_requests_and_the_memory_check(capsys, model_dir, monkeypatch) -> None:
    code, _, err = run(capsys, *base(model_dir, "--max-context", "20", "--max-new-tokens", "17"))
    assert_one_line_error(code, err, "prompt of 4 tokens + 17 new tokens exceeds --max-context 20")
    code, out, _ = run(capsys, *base(model_dir, "--max-context", "20", "--max-new-tokens", "16"))
    assert code == 0 and out.strip()
    # the check before loading counts the context asked for: a limit that only a short one fits
    monkeypatch.setenv("SPECDRAFT_MEMORY_LIMIT", "1")
    code, _, err = run(capsys, *base(model_dir, "--max-context", "20"))
    assert_one_line_error(code, err, "KV cache", "for 20 tokens")


@pytest.mark.parametrize("args,needle", [
    (["--max-context", "8"], "--max-context must be >= 16"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
    (["--temperature", "-1"], "temperature must be a finite number >= 0"),
    (["--temperature", "nan"], "temperature must be a finite number >= 0, got nan"),
    (["--temperature", "inf"], "temperature must be a finite number >= 0, got inf"),
    (["--top-p", "nan"], "top-p must be in (0, 1]"),
    (["--stop", ""], "--stop needs a non-empty string"),
    (["--top-p", "0"], "top-p must be in (0, 1]"),
    (["--top-p", "1.5"], "top-p must be in (0, 1]"),
    (["--top-k", "-2"], "top-k must be >= 0"),
    (["--batch-size", "0"], "--batch-size must be >= 1"),
    (["--drafter", "ngram", "--draft-tokens", "0"], "--draft-tokens must be >= 1"),
    (["--drafter", "ngram", "--draft-tokens", "1000"], "--draft-tokens must be between 1 and 32, got 1000"),
    (["--drafter", "mtp"], "no drafter ships for"),
    (["--drafter", "draft-model"], "--drafter draft-model needs --drafter-path"),
    (["--device", "tpu"], "unknown device 'tpu'"),
])
def test_bad_arguments_give_one_line(capsys, model_dir, args, needle) -> None:
    code, out, err = run(capsys, *base(model_dir, *args))
    assert_one_line_error(code, err, needle)
    assert out == ""


@pytest.mark.parametrize("value", ["0", "1000"])
def test_bad_draft_tokens_are_refused_before_the_model_loads(capsys, model_dir, monkeypatch, value) -> None:
    loads = []
    monkeypatch.setattr("specdraft.cli.generate.load_target", lambda *a, **k: loads.append(a))
    code, _, err = run(capsys, *base(model_dir, "--draft-tokens", value))
    assert_one_line_error(code, err, "--draft-tokens must be")
    assert loads == []


def test_unknown_drafter_kind_is_an_argparse_error(capsys, model_dir) -> None:
    with pytest.raises(SystemExit) as e:
        main(base(model_dir, "--drafter", "bogus"))
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'bogus'" in err and "Traceback" not in err


def test_no_prompt(capsys, model_dir) -> None:
    code, _, err = run(capsys, "generate", "--model", str(model_dir))
    assert_one_line_error(code, err, "no prompt")


def test_drafter_that_does_not_fit_the_target(capsys, model_dir, tmp_path) -> None:
    other = make_tiny(tmp_path / "other", "llama", seed=32, hidden_size=48, head_dim=8)
    cfg = drafter_config_for(other.ours, hidden=32, layers=2, heads=4)
    save_network(init_network(cfg, other.ours), tmp_path / "drafter")
    code, _, err = run(capsys, *base(model_dir, "--drafter", "mtp", "--drafter-path", str(tmp_path / "drafter")))
    assert_one_line_error(code, err, "drafter does not fit this target", "backbone_hidden_size 48 != target hidden size 64",
                          "head_dim 8 != target layer 2 head_dim 16")
    code, _, err = run(capsys, *base(model_dir, "--drafter", "mtp", "--drafter-path", str(tmp_path / "nothing")))
    assert_one_line_error(code, err, "is not a folder")


def test_draft_model_with_a_different_tokenizer(capsys, model_dir, tmp_path) -> None:
    # Same architecture and vocabulary size; only the token -> id mapping differs.
    other = make_tiny(tmp_path / "draft", "llama", seed=33, max_position_embeddings=64)
    write_word_tokenizer(other.folder, 128, permute_seed=1)
    code, _, err = run(capsys, *base(model_dir, "--drafter", "draft-model", "--drafter-path", str(other.folder)))
    assert_one_line_error(code, err, "tokenizer differs")
    # The same model with the same tokenizer is accepted as a draft model.
    same = tmp_path / "same"
    shutil.copytree(model_dir, same)
    code, out, err = run(capsys, *base(model_dir, "--drafter", "draft-model", "--drafter-path", str(same),
                                       "--max-new-tokens", "5", "--json"))
    assert code == 0 and json.loads(out)["drafter"] == "draft-model"


def expected_ids(model_dir: Path, prompts: list[str], n: int) -> list[list[int]]:
    from conftest import load_ours

    model, cfg = load_ours(model_dir)
    tok = Tokenizer(model_dir, cfg.eos_token_ids)
    return [r.token_ids for r in Engine(model, tok).generate([tok.encode(p) for p in prompts], n)]


@pytest.mark.parametrize("drafter", ["none", "ngram"])
def test_json_run(capsys, model_dir, tmp_path, drafter) -> None:
    prompts = ["w1 w2 w3 w1 w2", "The quick brown fox", "w7"]
    (tmp_path / "prompts.txt").write_text("\n".join(prompts) + "\n")
    code, out, err = run(capsys, "generate", "--prompts-file", str(tmp_path / "prompts.txt"), "--model", str(model_dir),
                         "--dtype", "float32", "--device", "cpu", "--drafter", drafter, "--draft-tokens", "3",
                         "--max-new-tokens", "12", "--batch-size", "2", "--json")
    assert code == 0, err
    lines = out.strip().splitlines()
    assert len(lines) == 3
    records = [json.loads(line) for line in lines]
    want = expected_ids(model_dir, prompts, 12)
    tok = Tokenizer(model_dir)
    for prompt, rec, ids in zip(prompts, records, want):
        assert set(JSON_FIELDS) <= set(rec), set(JSON_FIELDS) - set(rec)
        assert rec["prompt"] == prompt
        assert rec["token_ids"] == ids
        assert rec["text"] == tok.decode(ids)
        assert rec["new_tokens"] == len(ids)
        assert rec["model"] == str(model_dir) and rec["dtype"] == "float32"
        assert rec["drafter"] == drafter
        assert rec["draft_tokens"] == (3 if drafter == "ngram" else 0)
        assert len(rec["acceptance_by_position"]) == rec["draft_tokens"]
        assert 1 <= rec["target_forwards"] <= rec["new_tokens"]
        assert rec["mean_accepted"] == pytest.approx(rec["new_tokens"] / rec["target_forwards"], abs=1e-4)
        assert rec["seconds"] > 0 and rec["tokens_per_second"] > 0
        if drafter == "none":
            assert rec["target_forwards"] == rec["new_tokens"]


def test_streaming_run(capsys, model_dir) -> None:
    code, out, err = run(capsys, *base(model_dir, "--max-new-tokens", "8", "--drafter", "ngram"))
    assert code == 0
    ids = expected_ids(model_dir, ["w1 w2 w3"], 8)[0]
    assert out == Tokenizer(model_dir).decode(ids) + "\n"
    assert "drafter ngram K=4" in summary_line_of(err)


def test_models_lists_presets(capsys, monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path))
    code, out, _ = run(capsys, "models")
    assert code == 0
    assert f"cache: {tmp_path}" in out and "gemma3-270m (default)" in out and "not converted yet" in out


def test_default_drafter_on_a_model_folder_is_prompt_lookup(capsys, model_dir) -> None:
    """--drafter auto (the default) only looks for shipped drafters of presets; a model folder
    (whose own config.json once passed for a shipped drafter) runs prompt lookup."""
    code, out, err = run(capsys, *base(model_dir, "--max-new-tokens", "3", "--json"))
    assert code == 0, err
    rec = json.loads(out)
    assert rec["drafter"] == "ngram" and rec["draft_tokens"] > 0 and rec["new_tokens"] == 3


def test_batched_text_output_numbers_every_prompt(capsys, model_dir, tmp_path) -> None:
    """Without --json, a batch prints '=== prompt N ===' per prompt, numbered by position even
    when two prompts are identical; the batch summary goes to stderr."""
    (tmp_path / "p.txt").write_text("w1 w2\nw3\nw1 w2\n")
    code, out, err = run(capsys, "generate", "--prompts-file", str(tmp_path / "p.txt"), "--model", str(model_dir),
                         "--dtype", "float32", "--device", "cpu", "--max-new-tokens", "4", "--batch-size", "3")
    assert code == 0, err
    headers = [line for line in out.splitlines() if line.startswith("=== prompt")]
    assert headers == ["=== prompt 1 ===", "=== prompt 2 ===", "=== prompt 3 ==="]
    summary = summary_line_of(err)
    assert summary.startswith("[specdraft] 12 tokens") and "drafter ngram" in summary


@pytest.mark.parametrize("args,note", [
    (["--drafter", "none", "--drafter-path", "x"], "--drafter-path is ignored with --drafter none"),
    (["--drafter", "ngram", "--drafter-path", "x"], "--drafter-path is ignored with --drafter ngram"),
    (["--drafter", "auto", "--drafter-path", "x"], "--drafter-path is ignored with --drafter auto"),
    (["--drafter", "none", "--draft-tokens", "3"], "--draft-tokens is ignored: no drafter runs"),
])
def test_flags_that_do_not_apply_are_named(capsys, model_dir, args, note) -> None:
    code, out, err = run(capsys, *base(model_dir, "--max-new-tokens", "2", "--json", *args))
    assert code == 0, err
    assert f"specdraft: note: {note}" in err


@pytest.mark.parametrize("drafter", ["ngram", "auto"])  # auto: prompt lookup here, which reads K
def test_no_note_where_flags_apply(capsys, model_dir, drafter) -> None:
    code, out, err = run(capsys, *base(model_dir, "--max-new-tokens", "2", "--json", "--drafter", drafter,
                                       "--draft-tokens", "3"))
    assert code == 0 and "note" not in err
    assert json.loads(out)["draft_tokens"] == 3


def test_corrupt_tokenizer_config(capsys, model_dir, tmp_path) -> None:
    bad = tmp_path / "bad"
    shutil.copytree(model_dir, bad)
    (bad / "tokenizer_config.json").write_text('{"bos_token": ')
    code, _, err = run(capsys, *base(bad))
    assert_one_line_error(code, err, "tokenizer_config.json", "cannot read it as JSON")


def test_unexpected_failure_is_one_line_with_a_hint(capsys, model_dir, monkeypatch) -> None:
    from specdraft.speculative.engine import Engine as EngineClass

    def out_of_memory(*args, **kwargs):
        raise RuntimeError("CUDA out of memory.\nTried to allocate 2.00 GiB")

    monkeypatch.setattr(EngineClass, "generate", out_of_memory)
    # a request that fits (generate refuses one that does not before the engine runs), decoded
    # plainly: no step-cost lines from the policy, whatever the tests before this one timed
    argv = base(model_dir, "--max-new-tokens", "4", "--drafter", "none")
    code, _, err = run(capsys, *argv)
    assert code == 1 and "Traceback" not in err
    lines = err.strip().splitlines()
    assert lines == ["specdraft: error: RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB (try a smaller "
                     "--batch-size or --max-new-tokens, --dtype bfloat16, or another --device)"]
    # --debug, before or after the subcommand, shows where it came from.
    for debug in (["--debug", *argv], [*argv, "--debug"]):
        code, _, err = run(capsys, *debug)
        assert code == 1 and "Traceback" in err and "out_of_memory" in err


def _assert_one_line_usage_error(capsys, argv: list[str]) -> None:
    capsys.readouterr()
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's own checks exit from inside parse_args
        code = e.code
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == 2, (argv, err)
    assert "Traceback" not in err and len(lines) == 1, (argv, err)
    assert re.match(r"specdraft( [\w-]+)?: error: ", lines[0]), lines[0]


def test_every_subcommand_refuses_bad_input_in_one_line(capsys, tmp_path) -> None:
    """Each subcommand `specdraft --help` lists, given input it cannot use: exit code 2, one line."""
    missing = str(tmp_path / "missing")
    cases = {
        "generate": [["generate", "hi", "--temperature", "nan"], ["generate", "hi", "--top-k", "many"]],
        "chat": [["chat", "--max-new-tokens", "0"], ["chat", "--model", missing], ["chat", "--draft-tokens", "0"]],
        "models": [["models", "--bogus"]],
        "bench": [["bench", "--methods", "nope"], ["bench", "--questions", missing, "--model", missing]],
        "train-drafter": [["train-drafter", "--out", missing, "--prompts", missing, "--steps", "0"],
                          ["train-drafter", "--out", missing, "--prompts", missing, "--model", missing]],
        "eval-drafter": [["eval-drafter", "--prompts", missing, "--ks", "x"],
                         ["eval-drafter", "--prompts", missing, "--temperatures", "nan"]],
        "init-drafter": [["init-drafter", "--out", missing, "--model", missing]],
        "serve": [["serve", "--port", "0"], ["serve", "--max-batch-size", "0"], ["serve", "--model", missing],
                  ["serve", "--draft-tokens", "0"]],
        "steps": [["steps", "--widths", "0"], ["steps", "--batch-sizes", "x"], ["steps", "--model", missing]],
        "weights": [["weights"], ["weights", "--texts", missing], ["weights", "--texts", missing, "--formats", "fp8"]],
    }
    assert set(cases) >= set(_subcommands()), "add bad-input cases for the new subcommand"
    for argvs in cases.values():
        for argv in argvs:
            _assert_one_line_usage_error(capsys, argv)
    _assert_one_line_usage_error(capsys, ["no-such-command"])


def test_weights_names_the_flag_of_a_missing_file(tmp_path: Path, capsys) -> None:
    code = main(["weights", "--texts", str(tmp_path / "missing")])
    assert code == 2
    assert "--texts file" in capsys.readouterr().err


def test_steps_prints_a_row_per_width_and_batch(model_dir: Path, capsys) -> None:
    code = main(["steps", "--model", str(model_dir), "--dtype", "float32", "--device", "cpu", "--widths", "1,3",
                 "--batch-sizes", "1,2", "--context", "8", "--repeats", "2"])
    assert code == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [tuple(r.split("|")[1:3]) for r in rows] == [(" 1 ", " 1 "), (" 1 ", " 3 "), (" 2 ", " 1 "), (" 2 ", " 3 ")]
    assert all(float(r.split("|")[4]) > 0 for r in rows)
    assert float(rows[0].split("|")[4]) == 1.0  # width 1 is its own yardstick


def test_weights_reports_each_format_against_unquantised(model_dir: Path, tmp_path: Path, capsys) -> None:
    texts = tmp_path / "texts.txt"
    texts.write_text("w1 w2 w3 w4 w5 w6 w7 w8 w9 w10 w11 w12\nw5 w9 w2 w7 w7 w3 w11 w4\n")
    code = main(["weights", "--model", str(model_dir), "--dtype", "bfloat16", "--device", "cpu", "--texts", str(texts),
                 "--prompts", str(texts), "--max-new-tokens", "4", "--json"])
    assert code == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["weights"] for r in rows] == ["int8", "int4"]
    for r in rows:
        assert r["tokens"] == 13 + 9 and r["prompts"] == 2  # every position of both texts, BOS included
        assert r["greedy_identical"] in (0.0, 0.5, 1.0)  # a share of the 2 prompts
        assert 0 <= r["kl_mean"] < 1 and 0 < r["top1_agreement"] <= 1
    assert rows[0]["kl_mean"] < rows[1]["kl_mean"]  # int8 is closer to the reference than int4
