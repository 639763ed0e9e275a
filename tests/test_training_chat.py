"""Training answers for a chat model: prompts go through its chat template as chat and serve send
them, and sampled answers can be drawn with a chat client's top-p."""

from __future__ import annotations

import pytest
import torch

from conftest import make_tiny
from specdraft.runtime import Runtime
from specdraft.training.data import DataConfig, build_dataset, load_sequences, read_slots, record_answers

# A template whose generation prompt ("w99") no plain encoding of the prompts contains.
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}w99 {% endif %}")
PROMPTS = ["w1 w2 w3", "The quick brown fox", "w5 w6 w5 w6 w5", "w20 w21", "fox fox brown w30 w31", "quick w3"]


@pytest.fixture(scope="module")
def chat_target(tmp_path_factory):
    t = make_tiny(tmp_path_factory.mktemp("chat_train") / "tiny", "llama", seed=41, max_position_embeddings=256)
    (t.folder / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return Runtime.load(str(t.folder), "float32", "cpu", progress=False)


def recorded_prompts(rt, tmp_path, cfg: DataConfig) -> list[list[int]]:
    seqs = load_sequences(build_dataset(rt, PROMPTS, tmp_path / "data", cfg))
    return sorted(s.tokens[: s.prompt_length].tolist() for s in seqs)


def test_answers_follow_the_chat_template_as_chat_sends_it(chat_target, tmp_path):
    cfg = DataConfig(max_new_tokens=6, batch_size=4, shard_prompts=8, topk=4, temperatures=(0.0,))
    got = recorded_prompts(chat_target, tmp_path, cfg)
    tok = chat_target.tokenizer
    # What chat and serve send for one user turn: render_chat over [{"role": "user", ...}].
    want = sorted(tok.encode(tok.render_chat([{"role": "user", "content": p}]), add_special_tokens=False)
                  for p in PROMPTS)
    assert got == want
    # Negative control: the plain encoding of the same prompts is something else.
    assert got != sorted(tok.encode(p) for p in PROMPTS)


def sampled_answers(rt, top_p: float) -> torch.Tensor:
    ids = [rt.tokenizer.encode_prompt(p, chat=True) for p in PROMPTS]
    rows = record_answers(rt.model, ids, 12, 1.0, seed=5, slots=read_slots(rt.model), topk=4, eos=set(),
                          top_p=top_p)
    return torch.stack([r["tokens"][-12:] for r in rows])


def test_top_p_limits_sampled_answers(chat_target):
    greedy = torch.stack([r["tokens"][-12:] for r in record_answers(
        chat_target.model, [chat_target.tokenizer.encode_prompt(p, chat=True) for p in PROMPTS], 12, 0.0, seed=5,
        slots=read_slots(chat_target.model), topk=4, eos=set())])
    # A top-p below any token's probability keeps only the most likely token: sampling is greedy.
    assert torch.equal(sampled_answers(chat_target, 1e-6), greedy)
    # Negative control: the whole distribution at temperature 1 strays from greedy.
    assert not torch.equal(sampled_answers(chat_target, 1.0), greedy)
