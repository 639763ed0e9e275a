"""What people would use instead, on the same weights in the same process.

- hf:            transformers `generate()`, greedy, on the HF folder specdraft converted (same
                 weights, same dtype, same device).
- hf-pld:        the same with prompt lookup (`prompt_lookup_num_tokens=K`); transformers'
                 assisted generation runs batch size 1 only.
- llama-cpp:     llama-cpp-python on the GGUF the preset was converted from (its own quantized
                 kernels: the weights are the same numbers, the arithmetic is not); batch size 1.
- llama-cpp-pld: the same with llama-cpp-python's prompt-lookup draft model. Both get the same
                 context (`llama_cpp_context`): n_ctx = the run's longest prompt + max_new_tokens
                 + slack, and pld also logits_all=True (see there why).

All get the specdraft token ids (no re-tokenization), the same max_new_tokens and the same EOS
ids, and are timed around the generate call only. Optional imports: a missing package raises
Skip, which the benchmark reports.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from specdraft.bench import LLAMA_CPP_BUILD, method_profile, split_method
from specdraft.bench.methods import BatchOutput, BenchContext, Method, RowOutput, Skip, cut_at_eos, measure_load

PLD_MAX_NGRAM = 3  # the same longest n-gram specdraft's ngram drafter matches
LLAMA_CPP_N_BATCH = 512  # llama-cpp-python's default n_batch (and n_ubatch)


def build(name: str, ctx: BenchContext) -> Method:
    if name in ("hf", "hf-pld"):
        return _build_hf(name, ctx)
    if name in ("llama-cpp", "llama-cpp-pld") or split_method(name)[0] == "llama-cpp-mtp":
        return _build_llama_cpp(name, ctx)
    raise Skip(f"unknown peer {name!r}")


# ------------------------------------------------------------------ transformers


class _FirstToken:
    """A transformers streamer that only notes when the first new token arrives."""

    def __init__(self) -> None:
        self.calls, self.at = 0, None

    def put(self, value) -> None:
        self.calls += 1
        if self.calls == 2 and self.at is None:  # the first put is the prompt itself
            self.at = time.perf_counter()

    def end(self) -> None:
        pass


def _hf_model(ctx: BenchContext):
    """Load the HF model once for hf and hf-pld; (model, RSS it added, whether this call loaded it)."""
    if "hf" in ctx.shared:
        return ctx.shared["hf"], 0, False
    try:
        from transformers import AutoModelForCausalLM
    except ImportError:
        raise Skip("transformers is not installed (pip install 'specdraft[bench]')") from None
    rt = ctx.rt

    def load():
        model = AutoModelForCausalLM.from_pretrained(str(rt.folder), dtype=rt.dtype)
        return model.to(rt.device).eval()

    try:
        model, delta = measure_load(load)
    except Exception as e:  # an architecture transformers does not know, a missing file...
        raise Skip(f"transformers cannot load {rt.folder}: {type(e).__name__}: {e}") from None
    ctx.shared["hf"] = model
    return model, delta, True


class HFMethod(Method):
    def __init__(self, name: str, model, ctx: BenchContext, prompt_lookup: int | None):
        super().__init__()
        self.name, self.model, self.sampling = name, model, ctx.sampling
        self.eos = ctx.eos_token_ids  # [] under --ignore-eos
        pad, eos = ctx.rt.config.pad_token_id, ctx.rt.tokenizer.eos_token_ids
        self.pad = pad if pad is not None else (eos[0] if eos else 0)
        self.device = ctx.rt.device
        self.prompt_lookup = prompt_lookup
        self.draft_tokens = prompt_lookup or 0
        if prompt_lookup:
            self.max_batch_size = 1  # transformers: "assisted generate is only supported for batch_size = 1"

    def _kwargs(self, max_new_tokens: int) -> dict:
        s = self.sampling
        # No EOS ids (--ignore-eos): None, so generate() stops at max_new_tokens only.
        kw = dict(max_new_tokens=max_new_tokens, eos_token_id=self.eos or None, pad_token_id=self.pad)
        if s.greedy:
            kw.update(do_sample=False, top_k=None, top_p=None, temperature=None)
        else:
            kw.update(do_sample=True, temperature=s.temperature, top_k=s.top_k or None, top_p=s.top_p)
        if self.prompt_lookup:
            kw.update(prompt_lookup_num_tokens=self.prompt_lookup, max_matching_ngram_size=PLD_MAX_NGRAM)
        return kw

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], max_new_tokens: int) -> BatchOutput:
        width = max(len(p) for p in prompts)
        # Left padding: generate() appends new tokens at the right, so rows must end together.
        ids = torch.tensor([[self.pad] * (width - len(p)) + p for p in prompts], device=self.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=self.device)
        kwargs = self._kwargs(max_new_tokens)
        if not self.sampling.greedy and self.sampling.seed is not None:
            torch.manual_seed(self.sampling.seed)
        streamer = _FirstToken() if len(prompts) == 1 else None  # streamers take batch size 1 only
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = self.model.generate(input_ids=ids, attention_mask=mask, streamer=streamer, **kwargs)
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        eos = set(self.eos)
        ttft = streamer.at - t0 if streamer is not None and streamer.at is not None else None
        rows = []
        for row in out[:, width:].tolist():
            tokens, reason = cut_at_eos(row, eos, max_new_tokens)
            # generate() returns the whole batch at once: every row's latency is the batch's.
            rows.append(RowOutput(tokens, wall, ttft, reason))
        return BatchOutput(rows, wall)


def _build_hf(name: str, ctx: BenchContext) -> Method:
    model, delta, loaded = _hf_model(ctx)
    k = (ctx.draft_tokens or 4) if name == "hf-pld" else None
    method = HFMethod(name, model, ctx, k)
    from transformers import __version__ as transformers_version

    method.notes.append(f"transformers {transformers_version}, {ctx.rt.dtype_name}")
    if loaded:
        method.load_rss_delta = delta
        method.own_weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    else:
        method.notes.append("shares the transformers model loaded for the first hf method (memory counted there)")
    if k:
        method.notes.append(f"prompt_lookup_num_tokens={k}, max_matching_ngram_size={PLD_MAX_NGRAM}; batch size 1 only")
    return method


# ------------------------------------------------------------------ llama.cpp


def gguf_for(ctx: BenchContext) -> Path:
    """The GGUF the target came from: --gguf, the preset's file, or a .gguf --model."""
    from specdraft.errors import SpecdraftError
    from specdraft.loading.presets import PRESETS

    if ctx.gguf_path:
        return Path(ctx.gguf_path)
    name = ctx.rt.name
    if name in PRESETS:
        try:
            return PRESETS[name].locate_gguf()
        except SpecdraftError as e:
            raise Skip(str(e)) from None
    if str(name).endswith(".gguf") and Path(name).is_file():
        return Path(name)
    raise Skip(f"{name} is a Hugging Face folder with no GGUF; pass --gguf PATH to compare with llama.cpp")


def llama_cpp_context(n_ctx: int, prompt_lookup: bool, n_batch: int | None = None) -> dict:
    """The context arguments of `llama_cpp.Llama` for both llama.cpp peers.

    n_ctx is the run's longest prompt + max_new_tokens + slack (BenchContext.n_ctx), the same for
    both peers. n_batch (prompt tokens per decode call; default LLAMA_CPP_N_BATCH) and n_ubatch
    (tokens per compute pass) are equal and never above n_ctx, as llama-cpp-python clamps them.

    Prompt lookup needs logits_all=True. With a draft model llama-cpp-python always computes and
    stores the logits of every evaluated token (verification reads them), into its `scores`
    array; but it sizes that array from the logits_all *argument*: n_ctx rows when it is True,
    else only n_batch rows. Left False, any prompt or generated position past row n_batch (512)
    finds no room, e.g. "could not broadcast input array from shape (47448064,) into shape (0,)"
    for a 693-token prompt (its second decode call: 181 rows x 262144 vocab). True sizes it at
    n_ctx rows, n_ctx x n_vocab float32 of address space (1 MiB a row for Gemma's 262k vocab),
    resident as far as rows are written. The flag changes nothing else: with a draft model the
    library computes every token's logits either way. The plain peer samples from llama.cpp's
    last-row logits and keeps logits_all=False, as llama-cpp-python's users do.
    """
    if n_ctx < 1:
        raise ValueError(f"n_ctx must be positive, got {n_ctx}")
    n_batch = max(1, min(LLAMA_CPP_N_BATCH if n_batch is None else n_batch, n_ctx))
    return dict(n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_batch, logits_all=bool(prompt_lookup))


class LlamaCppMethod(Method):
    max_batch_size = 1  # llama-cpp-python's Llama runs one sequence at a time

    def __init__(self, name: str, llm, ctx: BenchContext, draft_tokens: int):
        super().__init__()
        self.name, self.llm, self.sampling = name, llm, ctx.sampling
        self.eos = set(ctx.eos_token_ids)  # empty under --ignore-eos: llm.generate never stops by itself
        self.draft_tokens = draft_tokens
        self.n_ctx = ctx.n_ctx

    def check_fits(self, prompt: list[int], max_new_tokens: int) -> None:
        """Fail clearly, before llama.cpp does, when a prompt and its answer overflow the context.

        Drafts need no room of their own: llama-cpp-python cuts them to what n_ctx has left (the
        bench's slack of 64 keeps that from happening before the last tokens)."""
        need = len(prompt) + max_new_tokens
        if need > self.n_ctx:
            raise ValueError(f"{self.name}: a {len(prompt)}-token prompt + {max_new_tokens} new tokens "
                             f"need a context of {need}, the model was loaded with n_ctx={self.n_ctx}")

    def _sampler_args(self) -> dict:
        s = self.sampling
        # Everything but temperature/top-k/top-p off, so greedy is plain argmax as elsewhere.
        args = dict(min_p=0.0, typical_p=1.0, repeat_penalty=1.0, frequency_penalty=0.0, presence_penalty=0.0)
        if s.greedy:
            return args | dict(temp=0.0, top_k=0, top_p=1.0)
        return args | dict(temp=s.temperature, top_k=s.top_k, top_p=s.top_p)

    def generate(self, prompts: list[list[int]], max_new_tokens: int) -> BatchOutput:
        if len(prompts) != 1:
            raise Skip("llama-cpp runs batch size 1 only")
        self.check_fits(prompts[0], max_new_tokens)
        args = self._sampler_args()
        # reset() forgets the previous prompt: no prefix-cache reuse, which specdraft does not do either.
        self.llm.reset()
        ids: list[int] = []
        ttft = None
        t0 = time.perf_counter()
        for token in self.llm.generate(prompts[0], reset=True, **args):
            if ttft is None:
                ttft = time.perf_counter() - t0
            ids.append(int(token))
            if token in self.eos or len(ids) >= max_new_tokens:
                break
        wall = time.perf_counter() - t0
        tokens, reason = cut_at_eos(ids, self.eos, max_new_tokens)
        return BatchOutput([RowOutput(tokens, wall, ttft, reason)], wall)

    def close(self) -> None:
        close = getattr(self.llm, "close", None)
        if close is not None:
            close()


def _build_llama_cpp(name: str, ctx: BenchContext) -> Method:
    """llama.cpp's own server where a native build is found (bench/llama_server.py; the only way
    to its MTP drafting), else llama-cpp-python's wheel in-process."""
    from specdraft.bench.llama_native import find_binary
    from specdraft.bench.llama_server import build_llama_server
    from specdraft.drafters.simulated import parse_profile

    if find_binary() is not None or split_method(name)[0] == "llama-cpp-mtp":
        if ctx.rt.device.type != "cpu":
            raise Skip("llama-cpp is compared on CPU runs only (this build is CPU-only)")
        spec = method_profile(name)
        return build_llama_server(name, ctx, gguf_for(ctx), torch.get_num_threads(),
                                  parse_profile(spec) if spec is not None else None)
    try:
        import llama_cpp
    except ImportError:
        raise Skip(f"llama-cpp-python is not installed (optional; build: {LLAMA_CPP_BUILD})") from None
    except Exception as e:  # e.g. the shared library fails to load
        raise Skip(f"llama-cpp-python failed to import: {type(e).__name__}: {e}") from None
    if ctx.rt.device.type != "cpu":
        raise Skip("llama-cpp is compared on CPU runs only (this build is CPU-only)")
    gguf = gguf_for(ctx)
    k = ctx.draft_tokens or 4
    kwargs = {}
    if name == "llama-cpp-pld":
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        kwargs["draft_model"] = LlamaPromptLookupDecoding(max_ngram_size=PLD_MAX_NGRAM, num_pred_tokens=k)
    threads = torch.get_num_threads()  # the same CPU budget torch gets

    sizes = llama_cpp_context(ctx.n_ctx, prompt_lookup=name == "llama-cpp-pld")

    def load():
        return llama_cpp.Llama(model_path=str(gguf), **sizes, n_threads=threads, n_threads_batch=threads,
                               seed=ctx.sampling.seed or 0, verbose=False, **kwargs)

    try:
        llm, delta = measure_load(load)
    except Exception as e:
        raise Skip(f"llama.cpp cannot load {gguf}: {type(e).__name__}: {e}") from None
    method = LlamaCppMethod(name, llm, ctx, k if name == "llama-cpp-pld" else 0)
    method.load_rss_delta = delta
    method.own_weight_bytes = gguf.stat().st_size
    method.notes.append(f"llama-cpp-python {llama_cpp.__version__}, {gguf.name}, {threads} threads, "
                        f"n_ctx={sizes['n_ctx']}, n_batch=n_ubatch={sizes['n_batch']}; batch size 1 only")
    if name == "llama-cpp-pld":
        method.notes.append(f"LlamaPromptLookupDecoding(max_ngram_size={PLD_MAX_NGRAM}, num_pred_tokens={k}); "
                            f"logits_all=True: the logits of every prompt and generated token are computed "
                            f"and copied out ({llm.n_vocab() * 4 / 2**20:.3g} MiB a token, prefill included)")
    return method
