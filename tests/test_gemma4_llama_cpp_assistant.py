"""A Gemma 4 assistant (the MTP drafter) next to a Gemma 4 target, both as GGUF files written
by llama.cpp's own converter, run from the files' blocks.

The tiny target and assistant are test_gemma4_llama_cpp.py's checkpoint and tools/gemma4_tiny.py's
assistant with a clustered head, as E2B's and E4B's are; llama.cpp's converter leaves that head
out, so the file drafts with a dense head over its own table. The oracle for the drafter is the
checkpoint assistant beside the same target: the two differ only by Q8_0 rounding.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")

from conftest import prompts_of  # noqa: E402
from exactness import speculative_equals_plain  # noqa: E402
from gemma4_tiny import (  # noqa: E402
    assistant_config,
    follow_transitions_,
    greedy_sequences,
    randomize_,
    target_text_config,
)
from test_gemma4_llama_cpp import CONFIG, VOCAB, convert, converter_dir, write_bpe_tokenizer  # noqa: E402
from specdraft.drafters.base import DraftInput  # noqa: E402
from specdraft.drafters.mtp import gguf as assistant_gguf  # noqa: E402
from specdraft.drafters.mtp import load_mtp_drafter, network  # noqa: E402
from specdraft.errors import SpecdraftError  # noqa: E402
from specdraft.drafters.mtp.drafter import layer_contexts  # noqa: E402
from specdraft.models.formats import q8_act_linear  # noqa: E402
from specdraft.runtime import Runtime  # noqa: E402
from specdraft.sampling import SamplingParams  # noqa: E402

pytestmark = pytest.mark.skipif(not q8_act_linear.kernel_available(), reason="needs the int8 kernel (x86, AVX2)")
PROMPTS = prompts_of([7, 12, 9], VOCAB, seed=5)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """{"target", "assistant"}: the checkpoint folders; {"target.gguf", "assistant.gguf"}: llama.cpp's
    Q8_0 files of them."""
    converter = converter_dir()
    if converter is None:
        pytest.skip("llama.cpp's converter is not unpacked (make install-test, or SPECDRAFT_LLAMA_CPP_CONVERTER)")
    root = tmp_path_factory.mktemp("gemma4-pair")
    target = randomize_(transformers.Gemma4ForCausalLM(target_text_config(**CONFIG)), 0)
    target.save_pretrained(root / "target")
    write_bpe_tokenizer(root / "target", VOCAB)
    assistant = randomize_(transformers.Gemma4AssistantForCausalLM(assistant_config(target.config)), 12)
    assert assistant.config.use_ordered_embeddings  # clustered, as E2B's and E4B's heads are
    # a random assistant is never right: wire it to the target's continuations of the prompts the
    # tests generate from, so rounds accept some drafts and reject others
    follow_transitions_(assistant, target, greedy_sequences(target, PROMPTS, 20))
    assistant.save_pretrained(root / "assistant")
    write_bpe_tokenizer(root / "assistant", VOCAB)  # the converter reads the vocabulary from the folder
    out = {name: root / name for name in ("target", "assistant")}
    for name in ("target", "assistant"):
        out[f"{name}.gguf"] = convert(converter, root / name, "q8_0", root / f"{name}.gguf")
    return out


@pytest.fixture(scope="module")
def gguf_target(files, tmp_path_factory):
    """The target loaded from its GGUF's blocks (its tokenizer folder in a cache of the test's own)."""
    with pytest.MonkeyPatch.context() as m:
        m.setenv("SPECDRAFT_CACHE", str(tmp_path_factory.mktemp("cache")))
        return Runtime.load(str(files["target.gguf"]), progress=False).model


def _round(model, rows: int = 2, seen: int = 6, seed: int = 0) -> DraftInput:
    """The DraftInput of a drafting round after `seen` random tokens per row."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, VOCAB, (rows, seen), generator=gen)
    cache = model.new_cache(rows, seen + 8)
    hidden = model(ids, cache)
    p = seen - 2
    inp = DraftInput(ids[:, p + 1], hidden[:, p], torch.full((rows,), p), cache,
                     torch.cat([ids, torch.zeros(rows, 8, dtype=torch.long)], 1), torch.ones(rows, dtype=torch.bool))
    return inp


@pytest.mark.parametrize("source", ["assistant", "assistant.gguf"], ids=["checkpoint", "gguf"])
def test_the_one_call_draft_step_runs_beside_a_gguf_target(files, gguf_target, monkeypatch, source):
    """A target whose token table stays in its file's blocks: the drafter's draft step still runs
    in one C call (draft_step.c, handed the rows the table's own lookup gives), with the bits of
    the drafter's modules called one by one, and drafts the same tokens as without that call;
    for the checkpoint assistant (clustered head) and for its GGUF (dense head)."""
    model = gguf_target
    drafter = load_mtp_drafter(files[source], model, torch.float32, "cpu")
    calls = []
    real_call = network.draft_step
    monkeypatch.setattr(network, "draft_step", lambda *a: calls.append(1) or real_call(*a))
    with torch.inference_mode():
        inp = _round(model)
        contexts = layer_contexts(drafter.sources, inp.cache.k, inp.cache.v, inp.position[:, None], torch.float32,
                                  inp.cache)
        fused = drafter.net.draft_step(model, inp.last_token, inp.hidden, contexts)
        assert calls == [1]  # the control: before, a GGUF table sent every step down the modules' path
        z, state = drafter.net.step(model.embed(inp.last_token[:, None]), inp.hidden[:, None], contexts)
        assert torch.equal(fused.z, z[:, 0]) and torch.equal(fused.state, state[:, 0])
        head = drafter.net.masked_embedding
        if head is None:
            assert fused.centroid_scores is None
        else:
            assert torch.equal(fused.centroid_scores, head.centroids(z[:, 0]))
        fast = drafter.propose(inp, 4, SamplingParams(), None)
        assert len(calls) > 1
        monkeypatch.setattr(network.MTPNetwork, "_draft_net", lambda *a: None)  # the modules' path
        calls.clear()
        slow = drafter.propose(inp, 4, SamplingParams(), None)
        assert not calls
    assert fast.tokens.tolist() == slow.tokens.tolist()


def test_the_assistant_gguf_runs_from_its_blocks(files, gguf_target, capsys, monkeypatch):
    """No float copy: every matrix is a kernel linear over the file's blocks (each MLP's gate and
    up as one), the token table is the dense head's kernel linear and nothing else, and the float
    tensors are norms and scalars; the missing clustered head is said once per file."""
    monkeypatch.setattr(assistant_gguf, "_noted", set())  # as in a fresh process
    drafter = load_mtp_drafter(files["assistant.gguf"], gguf_target, torch.float32, "cpu")
    net = drafter.net
    assert net.masked_embedding is None and net.model.embed_tokens is None
    assert isinstance(net.packed_head, q8_act_linear.Q8ActLinear)
    assert net.packed_head.out_features == VOCAB
    kinds = {type(m).__name__ for m in net.modules()}
    assert "Linear" not in kinds, kinds
    assert all(layer.mlp.gate_up_proj is not None and not hasattr(layer.mlp, "gate_proj") for layer in net.model.layers)
    largest = max(p.numel() for p in net.parameters())  # the kernel linears hold codes and scales as buffers
    assert largest <= net.config.hidden_size, largest  # norms only
    assert net.nbytes() < 0.4 * sum(t.numel() * 4 for t in _checkpoint_state(files).values())
    load_mtp_drafter(files["assistant.gguf"], gguf_target, torch.float32, "cpu")
    assert capsys.readouterr().err.count("carries no clustered head") == 1


def _checkpoint_state(files) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(files["assistant"] / "model.safetensors"))


def q8_head_bound(table: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """|the Q8_0 head's logits - z . table| at most, per (row, token) [N, V]: each weight is off by
    at most half a code step (its block's largest / 254) plus its fp16 scale's rounding (127
    codes times 2^-11 of the step), and z is rounded to int8 per 32 inputs, off by at most its
    block's largest / 254; summed per block over the other factor's magnitudes, with the product
    of both errors, and float32's summation error."""
    v, h = table.shape
    w, x = table.double().abs().view(v, h // 32, 32), z.double().abs().view(len(z), h // 32, 32)
    w_err = w.amax(-1) * (1 / 254 + 2.0**-11)  # [V, B]
    x_err = x.amax(-1) / 254  # [N, B]
    sums = torch.einsum("nb,vb->nv", x.sum(-1), w_err) + torch.einsum("nb,vb->nv", x_err, w.sum(-1))
    cross = 32 * torch.einsum("nb,vb->nv", x_err, w_err)
    return (sums + cross + 1e-5 * (x.flatten(1) @ w.flatten(1).T)).float()


def test_the_assistant_gguf_drafts_as_the_checkpoint_does_up_to_q8_0(files, gguf_target):
    """The file's drafter against the checkpoint assistant it was converted from, both beside the
    same target: the head's logits on the same z differ by no more than Q8_0 rounding of the
    table and int8 rows explain (q8_head_bound; a table read in another row order breaks it),
    and a draft step's outputs by a few percent of their spread (both networks' linears are
    8-bit; the step of another token differs by far more)."""
    model = gguf_target
    from_file = load_mtp_drafter(files["assistant.gguf"], model, torch.float32, "cpu")
    checkpoint = load_mtp_drafter(files["assistant"], model, torch.float32, "cpu")
    table = _checkpoint_state(files)["model.embed_tokens.weight"].float()
    with torch.inference_mode():
        inp = _round(model, rows=3)
        contexts = layer_contexts(from_file.sources, inp.cache.k, inp.cache.v, inp.position[:, None],
                                  torch.float32, inp.cache)
        ours = from_file.net.draft_step(model, inp.last_token, inp.hidden, contexts)
        theirs = checkpoint.net.draft_step(model, inp.last_token, inp.hidden, contexts)
        shifted = checkpoint.net.draft_step(model, (inp.last_token + 1) % VOCAB, inp.hidden, contexts)
        logits = from_file.dense_logits(ours.z, ours.state)
    exact = ours.z.double() @ table.double().T
    bound = q8_head_bound(table, ours.z)
    assert ((logits - exact).abs() <= bound).all(), ((logits - exact).abs() - bound).max()
    assert not ((logits - exact.roll(1, dims=1)).abs() <= bound).all()  # the control: rows in another order
    for a, b, c in ((ours.z, theirs.z, shifted.z), (ours.state, theirs.state, shifted.state)):
        assert (a - b).abs().max() < 0.1 * b.std()  # int8 weights and rows through 4 blocks: a few percent
        assert (c - b).abs().max() > 0.5 * b.std()  # the control: another token's step is far off
    assert from_file.propose(inp, 4, SamplingParams(), None).tokens.shape == (3, 4)


def test_speculative_equals_plain_with_the_assistant_gguf(files, gguf_target, monkeypatch):
    """Target and assistant both from llama.cpp's files: greedy speculative output is plain
    output, with drafts accepted and rejected (exactness.py, with its negative controls)."""
    drafter = load_mtp_drafter(files["assistant.gguf"], gguf_target, torch.float32, "cpu")
    stats = speculative_equals_plain(gguf_target, PROMPTS, batch=2, max_new=20, monkeypatch=monkeypatch,
                                     make_drafter=lambda sequences: drafter, k=3)
    assert stats.accepted < stats.drafted


def test_an_assistant_gguf_that_cannot_fit_is_refused_before_its_weights(files, gguf_target, monkeypatch):
    """One line naming what it needs and what is left, before any tensor is read (the filler is
    replaced by one that fails the test); with room, the same file loads (the control)."""
    from specdraft.loading.footprint import estimate_gguf_drafter
    from specdraft.loading.gguf_description import describe_gguf

    need = estimate_gguf_drafter(describe_gguf(files["assistant.gguf"])).total
    fill = assistant_gguf._fill

    def must_not_fill(*a, **k):
        raise AssertionError("weights were read before the memory check refused")

    monkeypatch.setattr(assistant_gguf, "_fill", must_not_fill)
    monkeypatch.setenv("SPECDRAFT_MEMORY_LIMIT", str(need // 2))
    with pytest.raises(SpecdraftError) as refused:
        load_mtp_drafter(files["assistant.gguf"], gguf_target, torch.float32, "cpu")
    message = str(refused.value)
    assert "\n" not in message and "assistant.gguf needs" in message and "--drafter ngram" in message, message
    monkeypatch.setattr(assistant_gguf, "_fill", fill)
    monkeypatch.setenv("SPECDRAFT_MEMORY_LIMIT", str(need * 2))
    assert load_mtp_drafter(files["assistant.gguf"], gguf_target, torch.float32, "cpu").net.packed_head is not None


def test_generate_with_both_files(files, tmp_path, monkeypatch, capsys):
    """The command a llama.cpp user types: `generate --model target.gguf --drafter mtp
    --drafter-path assistant.gguf` drafts (--json's stats) and prints the plain run's text
    (acceptance is test_speculative_equals_plain_with_the_assistant_gguf's, on prompts the
    assistant was wired to)."""
    import json

    from specdraft.cli.main import main

    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path / "cache"))
    common = ["generate", "hello world", "--model", str(files["target.gguf"]), "--max-new-tokens", "16", "--json"]
    assert main(common + ["--drafter", "none"]) == 0
    plain = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert main(common + ["--drafter", "mtp", "--drafter-path", str(files["assistant.gguf"]),
                          "--draft-policy", "fixed"]) == 0
    spec = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert spec["text"] == plain["text"] and spec["drafter"] == "mtp" and spec["drafted"] > 0
