"""How the bench sizes the llama.cpp peers, so that every prompt fits.

llama-cpp-python with a draft model stores the logits of every evaluated token in an array it
sizes from the `logits_all` argument (n_ctx rows if True, else n_batch rows). Before the fix the
prompt-lookup peer left it False and failed on the first Spec-Bench prompt over 512 tokens
(summarization: 693 tokens = 512 + 181; "could not broadcast input array from shape (47448064,)
into shape (0,)"). The first tests model that fact with a fake `llama_cpp` and need nothing
installed; the last runs the real library (skipped without it) with a small n_batch, so a short
prompt crosses the same boundary quickly.
"""

from __future__ import annotations

import sys
import types
from types import SimpleNamespace

import pytest
import torch

from specdraft.bench import peers
from specdraft.bench.methods import BenchContext
from specdraft.bench.peers import LlamaCppMethod, llama_cpp_context
from specdraft.bench.runner import build_method
from specdraft.sampling import SamplingParams

SPEC_BENCH_LONGEST = 1518  # summarization's longest prompt, Gemma 3 tokenizer with the plain template


@pytest.mark.parametrize("pld", [False, True])
def test_both_peers_get_the_same_context(pld):
    sizes = llama_cpp_context(SPEC_BENCH_LONGEST + 64 + 64, prompt_lookup=pld)
    assert sizes == dict(n_ctx=1646, n_batch=512, n_ubatch=512, logits_all=pld)


def test_batch_never_exceeds_the_context():
    assert llama_cpp_context(100, prompt_lookup=True) == dict(n_ctx=100, n_batch=100, n_ubatch=100, logits_all=True)
    assert llama_cpp_context(100, prompt_lookup=False, n_batch=16)["n_ubatch"] == 16
    with pytest.raises(ValueError):
        llama_cpp_context(0, prompt_lookup=False)


class _FakeLlama:
    """The one fact under test: with a draft model, logits of all evaluated tokens are kept, in
    n_ctx rows if logits_all was passed True, else n_batch rows; the prompt goes in n_batch chunks."""

    def __init__(self, model_path, n_ctx=512, n_batch=512, n_ubatch=512, logits_all=False, draft_model=None, **kw):
        assert n_ubatch <= n_batch <= n_ctx
        self.n_ctx, self.n_batch, self.draft = n_ctx, n_batch, draft_model
        self.rows = n_ctx if logits_all else n_batch

    def reset(self):
        pass

    def n_vocab(self):
        return 8

    def _store(self, start, count):
        if self.draft is not None and start + count > self.rows:
            raise ValueError(f"could not broadcast {count} rows into {max(0, self.rows - start)}")

    def generate(self, tokens, reset=True, **sampler):
        n = 0
        for i in range(0, len(tokens), self.n_batch):
            chunk = tokens[i:i + self.n_batch]
            self._store(n, len(chunk))
            n += len(chunk)
        while n < self.n_ctx:
            yield 5
            self._store(n, 1)
            n += 1


@pytest.fixture
def fake_llama_cpp(monkeypatch, tmp_path):
    mod = types.ModuleType("llama_cpp")
    mod.__version__ = "fake"
    mod.Llama = _FakeLlama
    spec = types.ModuleType("llama_cpp.llama_speculative")
    spec.LlamaPromptLookupDecoding = lambda **kw: SimpleNamespace(**kw)
    monkeypatch.setitem(sys.modules, "llama_cpp", mod)
    monkeypatch.setitem(sys.modules, "llama_cpp.llama_speculative", spec)
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    return gguf


def _ctx(gguf, n_ctx, eos=()):
    rt = SimpleNamespace(device=torch.device("cpu"), name="fake", tokenizer=SimpleNamespace(eos_token_ids=list(eos)))
    return BenchContext(rt, SamplingParams(), gguf_path=str(gguf), n_ctx=n_ctx)


@pytest.mark.parametrize("name", ["llama-cpp", "llama-cpp-pld"])
def test_long_prompt_runs(fake_llama_cpp, name):
    prompt = list(range(693))  # Spec-Bench's first summarization prompt, where the run failed
    method = build_method(name, _ctx(fake_llama_cpp, SPEC_BENCH_LONGEST + 64 + 64))
    out = method.generate([prompt], 64)
    assert len(out.rows[0].token_ids) == 64
    assert any("n_ctx=1646, n_batch=n_ubatch=512" in n for n in method.notes)


def test_fake_reproduces_the_old_failure(fake_llama_cpp):
    llm = _FakeLlama(str(fake_llama_cpp), n_ctx=1646, n_batch=512, draft_model=object())  # the old arguments
    with pytest.raises(ValueError, match="181 rows into 0"):
        list(llm.generate(list(range(693))))


def test_overflowing_prompt_fails_clearly(fake_llama_cpp):
    method = build_method("llama-cpp-pld", _ctx(fake_llama_cpp, 100))
    assert isinstance(method, LlamaCppMethod)
    method.generate([list(range(36))], 64)  # exactly fits
    with pytest.raises(ValueError, match="37-token prompt \\+ 64 new tokens need a context of 101.*n_ctx=100"):
        method.generate([list(range(37))], 64)


def _real_gguf():
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is optional")
    from specdraft.errors import SpecdraftError
    from specdraft.loading.presets import PRESETS

    for name in ("smollm2-135m-instruct", "gemma3-270m"):  # the smaller vocabulary first: faster
        try:
            return PRESETS[name].locate_gguf()
        except SpecdraftError:
            pass
    pytest.skip("no preset GGUF installed")


def test_real_prompt_lookup_past_n_batch(monkeypatch):
    gguf = _real_gguf()
    monkeypatch.setattr(peers, "LLAMA_CPP_N_BATCH", 16)  # a 41-token prompt crosses n_batch twice
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    prompt = [1] + [100, 200, 300, 400, 500] * 8  # repetitive, so prompt lookup drafts
    outs = {}
    for name in ("llama-cpp", "llama-cpp-pld"):
        method = build_method(name, _ctx(gguf, len(prompt) + 8 + 64))
        try:
            outs[name] = method.generate([prompt], 8).rows[0].token_ids
        finally:
            method.close()
    assert all(len(t) == 8 for t in outs.values()), outs


def test_native_llama_cpp_is_built_for_the_cpu():
    """The peer build takes each AVX-512 / VNNI extension the CPU lists and no other, AMX never:
    a fixed list either left VNNI out (a slower llama.cpp than its users build) or put AVX-512 on
    a CPU without it (illegal instructions)."""
    from specdraft.bench.llama_native import cmake_flags

    zen4 = set(cmake_flags({"avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile"}))
    assert {"-DGGML_AVX512=ON", "-DGGML_AVX512_VNNI=ON", "-DGGML_AVX512_BF16=ON", "-DGGML_AVX512_VBMI=OFF",
            "-DGGML_AVX_VNNI=OFF", "-DGGML_NATIVE=OFF", "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF"} <= zen4
    avx2_only = cmake_flags({"avx2", "fma", "f16c"})
    assert not [f for f in avx2_only if f.endswith("=ON") and "AVX" in f]
