"""The server's prefix cache over real HTTP: a conversation's next turn and a prompt sharing a
finished request's prefix restore its KV (usage.prompt_tokens_details.cached_tokens says how
many tokens) and answer exactly what a server without the cache answers, greedy and seeded. The
server's cache is exact: it restores whole prefill chunks (8 tokens here) of earlier prompts, or
any shared prefix where each position is computed alone (int8-activation weights)."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi", reason="the serve extra is not installed (pip install 'specdraft[serve]')")
openai = pytest.importorskip("openai")

from test_server import running_server, tiny  # noqa: E402,F401
from specdraft.drafters.ngram import NgramDrafter  # noqa: E402
from specdraft.serve import ServedModel  # noqa: E402
from specdraft.speculative.engine import Engine  # noqa: E402
from specdraft.speculative.prefix_cache import PrefixCache  # noqa: E402
from specdraft.tokenizer import Tokenizer  # noqa: E402

SHARED = " ".join(f"w{i % 50 + 10}" for i in range(80))
CHUNK = 8


def _client(tiny, store: PrefixCache | None):  # noqa: F811
    tok = Tokenizer(tiny.folder, tiny.cfg.eos_token_ids)
    engine = Engine(tiny.ours, tok, NgramDrafter(), 3, max_batch_size=2, capacity=200, prefill_chunk=CHUNK,
                    prefix_cache=store)
    return running_server(ServedModel("tiny", engine, tok, "ngram", 3))


def _ask(client, chat: bool, sent, seed=None):
    kw = dict(model="tiny", max_tokens=12, temperature=0 if seed is None else 1.0, seed=seed)
    if chat:
        return client.chat.completions.create(messages=sent, **kw)
    return client.completions.create(prompt=sent, **kw)


def _dialogue(url: str, seed=None):
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    out = []
    messages = [{"role": "system", "content": SHARED}, {"role": "user", "content": "w3 w4 w3"}]
    r = _ask(client, True, messages, seed)
    out.append(r)
    messages += [{"role": "assistant", "content": r.choices[0].message.content}, {"role": "user", "content": "w5"}]
    out.append(_ask(client, True, messages, seed))
    out.append(_ask(client, False, SHARED + " w7 w8", seed))
    out.append(_ask(client, False, SHARED + " w9", seed))
    return out


@pytest.mark.parametrize("seed", [None, 3])
def test_next_turn_and_shared_prefix_reuse_the_cache_with_the_same_answers(tiny, seed):  # noqa: F811
    with _client(tiny, None) as url:
        plain = _dialogue(url, seed)
    store = PrefixCache(64 << 20)
    with _client(tiny, store) as url:
        cached = _dialogue(url, seed)
    texts = [r.choices[0].message.content if hasattr(r.choices[0], "message") else r.choices[0].text
             for r in plain]
    assert texts == [r.choices[0].message.content if hasattr(r.choices[0], "message") else r.choices[0].text
                     for r in cached]
    reused = [r.usage.prompt_tokens_details.cached_tokens for r in cached]
    assert [r.usage.prompt_tokens_details.cached_tokens for r in plain] == [0, 0, 0, 0]
    assert reused[0] == 0
    # turn 2 restores turn 1's prompt up to its generation prompt (this template's `w99` becomes
    # `assistant` in the history; Gemma's renders the same words either way), in whole chunks of
    # turn 1's prompt: never its reply, never a part-chunk
    whole = lambda n: n - n % CHUNK  # noqa: E731
    assert reused[1] == whole(cached[0].usage.prompt_tokens - 1) > 0
    assert reused[1] == cached[1].model_extra["specdraft"]["cached_prompt_tokens"]
    assert reused[2] == 0  # the chat's prompt starts with its template's words
    # all but "w9" is shared with the request before, restored in whole chunks of its prompt
    assert reused[3] == whole(min(cached[3].usage.prompt_tokens - 1, cached[2].usage.prompt_tokens)) > 0
    assert all(n % CHUNK == 0 for n in reused)
    assert store.hits == 2


@pytest.fixture(scope="module")
def tiny_q8(tiny):  # noqa: F811
    """The same model with int8-activation weights (--weights q8, the default model's kernels):
    each position is computed alone, whatever chunk it is prefilled in."""
    from conftest import TinyModel, load_ours
    from specdraft.models.formats import q8_act_linear
    from specdraft.models.formats.quant import compact_weights

    if not q8_act_linear.kernel_available():
        pytest.skip("the int8-activation kernel does not build here")
    model, cfg = load_ours(tiny.folder)
    compact_weights(model, "q8")
    return TinyModel(tiny.family, tiny.folder, tiny.hf, model, cfg)


def test_where_positions_are_computed_alone_a_prefix_ending_mid_chunk_is_restored(tiny_q8):
    """On int8-activation weights the server restores the whole shared prefix, part-chunks
    included, and still answers exactly what a server without the cache answers."""
    with _client(tiny_q8, None) as url:
        plain = _dialogue(url)
    store = PrefixCache(64 << 20)
    with _client(tiny_q8, store) as url:
        cached = _dialogue(url)
    text = lambda r: r.choices[0].message.content if hasattr(r.choices[0], "message") else r.choices[0].text  # noqa: E731
    assert [text(r) for r in cached] == [text(r) for r in plain]
    reused = [r.usage.prompt_tokens_details.cached_tokens for r in cached]
    assert reused[1] > 0 and reused[2] == 0
    # all but "w9" is shared with the request before: every shared token, not whole chunks of them
    assert reused[3] == cached[3].usage.prompt_tokens - 1 and reused[3] % CHUNK != 0
