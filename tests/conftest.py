"""Shared factories for the test suite: tiny random Hugging Face models saved as safetensors
folders and loaded back through specdraft's real loader, tiny tokenizers, reference helpers.

Everything runs in float32 on the CPU. Weights are re-drawn from a fixed seed with a larger
spread than transformers' default init (std 0.02 gives near-uniform logits and one-token
loops), so greedy outputs vary with the prompt and logits differ enough between positions for
parity tests to mean something.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from specdraft.drafters.base import Draft, Drafter
from specdraft.loading import load_folder

# One intra-op thread: these models are tiny, and on a shared 2-core machine a second OpenMP
# thread that gets descheduled turns every small matmul into a spin-wait (100x slower).
torch.set_num_threads(1)
os.environ["SPECDRAFT_THREADS"] = "1"  # the CLI's --threads default, for commands tests run in-process

FP32 = torch.float32


@pytest.fixture
def float32_kv(monkeypatch):
    """A float32 KV cache (Gemma 4 stores float16 by default, kv_cache.kv_storage_dtype): for
    tests of float32 parity with transformers, whose bound counts summation order only
    (test_kv_half.py checks the float16 cache against its own bound)."""
    monkeypatch.setenv("SPECDRAFT_KV_DTYPE", "float32")


@pytest.fixture(scope="session", autouse=True)
def _costs_out_of_the_user_cache(tmp_path_factory):
    """The adaptive draft policy's measured step costs go to a temp dir of the test run, not
    $SPECDRAFT_CACHE/costs: tests time tiny throwaway models whose tables would pile up in the
    user's cache. $SPECDRAFT_CACHE itself stays (the converted real model is reused from there)."""
    from specdraft.speculative.costs import COSTS_ENV

    saved = os.environ.get(COSTS_ENV)
    os.environ[COSTS_ENV] = str(tmp_path_factory.mktemp("costs"))
    yield
    if saved is None:
        os.environ.pop(COSTS_ENV, None)
    else:
        os.environ[COSTS_ENV] = saved


# --------------------------------------------------------------------------- tiny HF models

# Small but complete: GQA (4 query heads over 2 KV heads), head_dim 16, several layers.
_BASE = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    bos_token_id=2,
    eos_token_id=1,
    pad_token_id=0,
)


def _family_classes(family: str):
    import transformers as tf

    return {
        "gemma3": (tf.Gemma3TextConfig, tf.Gemma3ForCausalLM),
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
        "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM),
        "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
    }[family]


def tiny_hf_config(family: str, **overrides):
    config_cls, _ = _family_classes(family)
    kwargs = dict(_BASE)
    if family == "gemma3":
        kwargs.update(query_pre_attn_scalar=16, sliding_window=8, tie_word_embeddings=True,
                      layer_types=["sliding_attention", "sliding_attention", "full_attention"])
    kwargs.update(overrides)
    cfg = config_cls(**kwargs)
    cfg._attn_implementation = "eager"
    return cfg


def randomize_(model: torch.nn.Module, seed: int = 0, std: float = 0.15, norm_std: float = 0.2) -> None:
    """Redraw every parameter: matrices and biases ~ N(0, std); norm weights around their
    neutral value (0 for Gemma's (1 + w) norms, 1 for the others) so a wrong norm convention shows."""
    gemma = "gemma" in type(model).__name__.lower()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if gemma and ("post_attention_layernorm" in name or "post_feedforward_layernorm" in name):
                # Scale 2 on each block's output: with a tied head, a weak residual update lets
                # the input token's own embedding win the argmax (every output repeats its input).
                p.copy_(1.0 + norm_std * noise)
            elif gemma and name == "model.norm.weight":
                # ... and a small tied table then needs a larger final scale for logits of ~unit spread.
                p.copy_(9.0 + norm_std * noise)
            elif "norm" in name:
                p.copy_((0.0 if gemma else 1.0) + norm_std * noise)
            elif name.endswith("embed_tokens.weight"):
                # Gemma multiplies embeddings by sqrt(hidden); its tied head then needs a
                # smaller table for logits of a similar spread as the other families.
                p.copy_(noise * (0.02 if gemma else 0.5))
            else:
                p.copy_(noise * std)


def build_hf(family: str, seed: int = 0, std: float = 0.15, **overrides):
    _, model_cls = _family_classes(family)
    cfg = tiny_hf_config(family, **overrides)
    torch.manual_seed(seed)
    model = model_cls(cfg).to(FP32).eval()
    randomize_(model, seed, std)
    return model


@dataclass
class TinyModel:
    family: str
    folder: Path
    hf: torch.nn.Module
    ours: torch.nn.Module
    cfg: object  # specdraft ModelConfig

    def hf_logits(self, ids: list[int] | torch.Tensor) -> torch.Tensor:
        """[T, V] float32 logits of the HF reference on one sequence."""
        t = torch.as_tensor(ids, dtype=torch.long)[None]
        with torch.no_grad():
            return self.hf(t).logits[0].float()


def save_hf(model, folder: Path, tokenizer: bool = True) -> Path:
    model.save_pretrained(folder, safe_serialization=True)
    if tokenizer:
        write_word_tokenizer(folder, model.config.vocab_size)
    return folder


def load_ours(folder: Path):
    model, cfg, notes = load_folder(folder, FP32, "cpu")
    return model, cfg


def make_tiny(folder: Path, family: str, seed: int = 0, std: float = 0.15, tokenizer: bool = True,
              **overrides) -> TinyModel:
    """Build a tiny random HF model, save it (safetensors), load it with specdraft's loader."""
    hf = build_hf(family, seed, std, **overrides)
    save_hf(hf, folder, tokenizer)
    ours, cfg = load_ours(folder)
    return TinyModel(family, folder, hf, ours, cfg)


@pytest.fixture
def tiny_factory(tmp_path):
    counter = iter(range(10**6))

    def factory(family: str, **kw) -> TinyModel:
        return make_tiny(tmp_path / f"{family}-{next(counter)}", family, **kw)

    return factory


@pytest.fixture(scope="session")
def gemma_tiny(tmp_path_factory) -> TinyModel:
    """Gemma 3 style: sliding window 8 shorter than most test sequences, GQA, tied head."""
    return make_tiny(tmp_path_factory.mktemp("gemma_tiny"), "gemma3", seed=1)


@pytest.fixture(scope="session")
def llama_tiny(tmp_path_factory) -> TinyModel:
    return make_tiny(tmp_path_factory.mktemp("llama_tiny"), "llama", seed=2)


@pytest.fixture(scope="session")
def real_runtime():
    """The real default model (Gemma 3 270M) in float32 on the CPU. The first use converts the
    GGUF preset into $SPECDRAFT_CACHE (~10-20 s); later test runs load the cached folder."""
    from specdraft.runtime import Runtime

    return Runtime.load("gemma3-270m", "float32", "cpu", progress=False)


# --------------------------------------------------------------------------- tiny tokenizer

SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>"]
PROBE_WORDS = ["The", "quick", "brown", "fox", "def", "return"]


def word_list(vocab_size: int, permute_seed: int | None = None) -> list[str]:
    """Token strings for a word-level vocabulary: 4 specials, a few English words (so the
    draft-model tokenizer probe sees real ids), then w<i>."""
    words = PROBE_WORDS + [f"w{i}" for i in range(vocab_size - len(SPECIALS) - len(PROBE_WORDS))]
    if permute_seed is not None:
        g = torch.Generator().manual_seed(permute_seed)
        words = [words[i] for i in torch.randperm(len(words), generator=g).tolist()]
    return SPECIALS + words


def write_word_tokenizer(folder: Path, vocab_size: int, permute_seed: int | None = None) -> None:
    """A WordLevel tokenizer.json (whitespace split, BOS prepended) + tokenizer_config.json."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {w: i for i, w in enumerate(word_list(vocab_size, permute_seed))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(SPECIALS)
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 2)])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<bos>", "eos_token": "<eos>",
                                                              "pad_token": "<pad>", "unk_token": "<unk>"}))


# --------------------------------------------------------------------------- helpers

FP32_EPS = torch.finfo(torch.float32).eps


def reduction_depth(cfg) -> int:
    """Additions behind one logit, roughly: every layer sums over its hidden and MLP widths
    (`cfg` is a specdraft ModelConfig)."""
    return cfg.num_layers * (cfg.hidden_size + cfg.intermediate_size)


def assert_fp32_close(got: torch.Tensor, ref: torch.Tensor, depth: int) -> None:
    """`got` and `ref` are the same float32 computation up to rounding.

    Two correct implementations add in different orders (a one-token step vs a prefill, the
    AVX-512 vs the AMX kernels of another CPU), and each addition may round by eps relative to
    the values' scale; so the bound is eps x depth x the largest |value|, not a fixed absolute
    number. A wrong formula moves logits by O(0.1), far above it."""
    tol = FP32_EPS * depth * float(ref.abs().max())
    diff = float((got.float() - ref.float()).abs().max())
    assert diff <= tol, f"max abs diff {diff:.3g} > {tol:.3g} (eps x depth {depth} x max|ref| {ref.abs().max():.3g})"


def prompts_of(lengths: list[int], vocab: int, seed: int = 0, low: int = 4) -> list[list[int]]:
    """Random prompts (ids >= `low`, so no special ids) of the given lengths."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(low, vocab, (n,), generator=g).tolist() for n in lengths]


def greedy_reference(tiny: TinyModel, prompt: list[int], n: int) -> list[int]:
    """n greedy tokens by re-running the HF model on the whole sequence each step (no cache)."""
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(tiny.hf_logits(seq)[-1].argmax()))
    return seq[len(prompt):]


# --------------------------------------------------------------------------- drafters for tests


class OracleDrafter(Drafter):
    """Proposes the known greedy continuation of each row (from a plain run), optionally
    corrupting each draft with probability `noise` (a fixed-seed coin per draft).

    It also checks the engine's bookkeeping: the sequence the engine hands over
    (`tokens[:, :p + 2]`) must be the true prefix for every active row.
    Requests are matched in the order they join to `sequences` (prompt + plain continuation,
    long enough), and followed as the engine moves them between rows.
    """

    kind = "oracle"

    def __init__(self, sequences: list[list[int]], noise: float = 0.0, seed: int = 0, vocab: int = 0):
        self.sequences, self.noise, self.vocab = sequences, noise, vocab
        self.gen = torch.Generator().manual_seed(seed)
        self.rounds: list[dict] = []  # per round: position, num_valid, active (for stats checks)

    def prepare(self, batch_size: int, capacity: int) -> None:
        assert batch_size >= len(self.sequences)
        self.joined = 0
        self.slot_seq: dict[int, int] = {}  # engine slot -> index into sequences

    def reset_row(self, row: int) -> None:
        # Requests join in order, so the n-th reset slot holds the n-th sequence.
        self.slot_seq[row] = self.joined
        self.joined += 1

    def move_row(self, src: int, dst: int) -> None:
        self.slot_seq[dst] = self.slot_seq[src]

    def nbytes(self) -> int:
        return 0

    def propose(self, inp, k, sampling, generator):
        b = inp.last_token.shape[0]
        drafts = torch.zeros(b, k, dtype=torch.long)
        for i in range(b):
            p = int(inp.position[i])
            seq = self.sequences[self.slot_seq[i]]
            if bool(inp.active[i]):
                assert inp.tokens[i, : p + 2].tolist() == seq[: p + 2], f"row {i}: engine history is wrong"
                assert int(inp.last_token[i]) == seq[p + 1]
                assert int(inp.cache.lengths[i]) == p + 1, "target cache must hold exactly 0..p"
            cont = seq[p + 2 : p + 2 + k]
            cont = cont + [0] * (k - len(cont))
            for j in range(k):
                if self.noise and float(torch.rand((), generator=self.gen)) < self.noise:
                    cont[j] = (cont[j] + 1 + int(torch.randint(self.vocab - 1, (), generator=self.gen))) % self.vocab
            drafts[i] = torch.tensor(cont)
        num_valid = torch.where(inp.active, k, 0)
        self.rounds.append(dict(position=inp.position.clone(), num_valid=num_valid.clone(), active=inp.active.clone()))
        return Draft(drafts, num_valid)
