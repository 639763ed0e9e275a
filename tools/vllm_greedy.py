"""Greedy tokens from vLLM for a Hugging Face folder, plain or with an MTP drafter.

    PYTHON_WITH_VLLM tools/vllm_greedy.py TARGET --prompts '[[2, 46, 47], ...]' --max-tokens 24 \\
        [--drafter DRAFTER --draft-tokens 3]

Prints one JSON object: {"tokens": [[...] per prompt], "spec": {"drafts", "draft_tokens", "accepted",
"accepted_per_pos"}} ("spec" only with --drafter). The drafter is passed the way `vllm serve`
takes it: speculative_config {"model": DRAFTER, "method": "mtp", "num_speculative_tokens": K}.

Runs in an environment with vLLM installed (vLLM pins its own transformers, so it usually lives
in a virtual environment of its own; `make test-vllm` makes one); it imports nothing from
specdraft. Prompts are token ids, so no tokenizer takes part; float32, so the tokens can be
compared exactly with other engines' float32 greedy output.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any


def counter(metrics: list[Any], name: str) -> Any:
    """A counter's value (a vector counter's values) summed over its label sets; 0 if absent."""
    found = [m for m in metrics if m.name == name]
    if not found:
        return 0
    if hasattr(found[0], "values"):
        return [sum(col) for col in zip(*(m.values for m in found))]
    return sum(m.value for m in found)


SPEC_COUNTERS = {"drafts": "vllm:spec_decode_num_drafts", "draft_tokens": "vllm:spec_decode_num_draft_tokens",
                 "accepted": "vllm:spec_decode_num_accepted_tokens",
                 "accepted_per_pos": "vllm:spec_decode_num_accepted_tokens_per_pos"}


def spec_counters(llm: Any) -> dict[str, Any]:
    metrics = llm.get_metrics()
    return {key: counter(metrics, name) for key, name in SPEC_COUNTERS.items()}


def greedy(target: str, drafter: str | None, prompts: list[list[int]], args: argparse.Namespace) -> dict[str, Any]:
    """One engine's greedy tokens (and, with a drafter, its draft counts for these prompts)."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    spec = None
    if drafter is not None:
        spec = {"model": drafter, "method": "mtp", "num_speculative_tokens": args.draft_tokens}
    # Eager: a tiny model's tokens are the same compiled or not, and compiling costs minutes on a CPU.
    llm = LLM(model=target, dtype="float32", max_model_len=args.max_model_len, seed=0, skip_tokenizer_init=True,
              speculative_config=spec, disable_log_stats=False, enforce_eager=True, compilation_config={"mode": 0},
              distributed_executor_backend="uni")
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True, detokenize=False)
    # Prometheus counters are process-wide: an engine's counts are the change over its own run.
    before = spec_counters(llm)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in prompts], params, use_tqdm=False)
    after = spec_counters(llm)
    run: dict[str, Any] = {"drafter": drafter, "tokens": [list(o.outputs[0].token_ids) for o in outputs]}
    if spec is not None:
        run["spec"] = {key: ([a - b for a, b in zip(after[key], before[key] or [0] * len(after[key]))]
                             if isinstance(after[key], list) else after[key] - before[key]) for key in after}
    del llm
    return run


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tools/vllm_greedy.py", description=__doc__.split("\n\n")[0])
    p.add_argument("target")
    p.add_argument("--prompts", required=True, help="JSON list of token id lists")
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--drafter", action="append", default=[],
                   help="an MTP drafter folder (Gemma4AssistantForCausalLM layout), or 'none' for plain "
                        "decoding; repeat for several runs, one engine each")
    p.add_argument("--draft-tokens", type=int, default=3)
    p.add_argument("--max-model-len", type=int, default=256)
    args = p.parse_args(argv)
    # A small KV cache (GiB) for tiny test models (vLLM's CPU default reserves several), and the
    # engine in this process: one engine process fewer to start for each run.
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    prompts = json.loads(args.prompts)
    runs = [greedy(args.target, None if d == "none" else d, prompts, args) for d in args.drafter or ["none"]]
    print("VLLM_GREEDY_RESULT " + json.dumps({"runs": runs}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
