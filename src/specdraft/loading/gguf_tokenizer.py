"""GGUF tokenizer metadata -> Hugging Face tokenizer files (tokenizer.json + tokenizer_config.json).

A GGUF carries no tokenizer.json, only llama.cpp's description of one: the token strings, a type
per token, scores or merges, and a few flags. This rebuilds an equivalent `tokenizers.Tokenizer`
from that, for the two tokenizer families llama.cpp calls:

* "llama": SentencePiece BPE (Gemma, Llama 2). The file has scores but no merges, so the merges
  are derived from the vocabulary, ranked by how early SentencePiece would apply them.
* "gpt2": byte-level BPE (SmolLM, Llama 3, Qwen). The file has the merges; only the regex that
  splits text before BPE is missing, and it is looked up by the file's `tokenizer.ggml.pre` name.
* "gemma4": SentencePiece-style BPE with the merges in the file (Gemma 4). As llama.cpp's
  gemma4 pre-type: spaces become "▁", text is split into runs of newlines and runs of anything
  else ([^\n]+|[\n]+), merges act on characters (not GPT-2 bytes), a character without a
  token falls back to <0xNN> byte tokens, and BOS is added. Ollama's Gemma 4 files spell the same
  tokenizer as model "llama" with pre-tokenizer "gemma4" (and the merges).

Only `gguf` and `tokenizers` are used; transformers' own GGUF loader serves as the test oracle.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import gguf
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from specdraft.loading.gguf_reader import GGUFFile

# SentencePiece spells a space inside a piece as U+2581 ("▁").
_SPACE_MARK = "\u2581"

# llama.cpp token types (gguf.TokenType): which tokens the text matcher must keep whole.
_NORMAL = int(gguf.TokenType.NORMAL)
_UNKNOWN = int(gguf.TokenType.UNKNOWN)
_CONTROL = int(gguf.TokenType.CONTROL)
_USER_DEFINED = int(gguf.TokenType.USER_DEFINED)
_UNUSED = int(gguf.TokenType.UNUSED)
_BYTE = int(gguf.TokenType.BYTE)
# SentencePiece never produces these by merging, so no merge may end in one.
_NOT_MERGEABLE = {_UNKNOWN, _CONTROL, _UNUSED, _BYTE}

_SPECIAL_TOKEN_KEYS = {
    "bos_token": "tokenizer.ggml.bos_token_id",
    "eos_token": "tokenizer.ggml.eos_token_id",
    "pad_token": "tokenizer.ggml.padding_token_id",
    "unk_token": "tokenizer.ggml.unknown_token_id",
}

# Pre-tokenizer regexes for byte-level vocabularies, keyed by llama.cpp's `tokenizer.ggml.pre`.
# None means GPT-2's own regex, which `pre_tokenizers.ByteLevel(use_regex=True)` has built in.
_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT2_PRE = {"default", "gpt2", "gpt-2", "mpt", "olmo"}
# llama.cpp splits every digit off first for these, then applies GPT-2's regex (StarCoder style).
_DIGITS_THEN_GPT2_PRE = {"smollm", "starcoder", "refact", "codeshell"}
_REGEX_PRE = {
    "llama3": _LLAMA3_REGEX,
    "llama-v3": _LLAMA3_REGEX,
    "llama-bpe": _LLAMA3_REGEX,
    "smaug-bpe": _LLAMA3_REGEX,
    "qwen2": _QWEN2_REGEX,
    "deepseek-r1-qwen": _QWEN2_REGEX,
}


@dataclass(frozen=True)
class GGUFVocab:
    """The tokenizer facts a GGUF stores, as plain Python values."""

    architecture: str
    model: str
    pre: str | None
    tokens: list[str]
    token_types: list[int]
    scores: list[float] | None
    merges: list[str] | None
    special_ids: dict[str, int]
    add_bos: bool
    add_eos: bool
    add_space_prefix: bool


def read_vocab(reader: GGUFFile) -> GGUFVocab:
    """Collect the tokenizer metadata, filling in llama.cpp's defaults for absent flags."""
    model = reader.value("tokenizer.ggml.model")
    tokens = reader.value("tokenizer.ggml.tokens")
    if model is None or tokens is None:
        raise ValueError("GGUF file has no tokenizer (tokenizer.ggml.model / tokenizer.ggml.tokens missing)")
    special_ids = {name: reader.value(key) for name, key in _SPECIAL_TOKEN_KEYS.items()}
    return GGUFVocab(
        architecture=reader.value("general.architecture", ""),
        model=model,
        pre=reader.value("tokenizer.ggml.pre"),
        tokens=tokens,
        # Old files lack types; treating everything as normal keeps them usable.
        token_types=reader.value("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens),
        scores=reader.value("tokenizer.ggml.scores"),
        merges=reader.value("tokenizer.ggml.merges"),
        special_ids={name: i for name, i in special_ids.items() if i is not None and 0 <= i < len(tokens)},
        # llama.cpp adds BOS for SentencePiece vocabularies unless the file says otherwise (and
        # always for gemma4's).
        add_bos=model == "gemma4" or reader.value("tokenizer.ggml.pre") == "gemma4"
        or bool(reader.value("tokenizer.ggml.add_bos_token", model == "llama")),
        add_eos=bool(reader.value("tokenizer.ggml.add_eos_token", False)),
        add_space_prefix=bool(reader.value("tokenizer.ggml.add_space_prefix", model == "llama")),
    )


# ---------------------------------------------------------------- SentencePiece BPE ("llama")


def _sentencepiece_spelling(token: str) -> str:
    # llama.cpp writes some user-defined pieces (Gemma's runs of spaces) with real spaces; inside
    # the BPE model a space is always "▁", since the normalizer turns every space into one.
    return token.replace(" ", _SPACE_MARK)


def _ranks_follow_position(vocab: GGUFVocab) -> bool:
    """True when the normal tokens' scores never rise along the vocabulary.

    Then the position is the merge rank (SentencePiece stores pieces best-first) and it also ranks
    pieces whose score is only a placeholder, like Gemma's space runs at -1000, where the scores
    would wrongly put them last.
    """
    if vocab.scores is None:
        return True
    normal = [s for s, t in zip(vocab.scores, vocab.token_types) if t == _NORMAL]
    return all(a >= b for a, b in zip(normal, normal[1:]))


def _derived_merges(pieces: list[str], vocab: GGUFVocab) -> list[tuple[str, str]]:
    """Every split of a mergeable piece into two pieces, best piece first.

    SentencePiece BPE merges the adjacent pair whose concatenation is the best-ranked piece, so a
    merge list sorted by the rank of its result reproduces it in `tokenizers`' BPE. Between splits
    of the same piece, the longer left part goes first, as transformers orders them.
    """
    by_position = _ranks_follow_position(vocab)
    known = {piece: index for index, piece in enumerate(pieces)}
    keyed = []
    for index, (piece, kind) in enumerate(zip(pieces, vocab.token_types)):
        if kind in _NOT_MERGEABLE:
            continue
        rank = index if by_position else -vocab.scores[index]
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in known and right in known:
                keyed.append((rank, -len(left), -len(right), index, left, right))
    keyed.sort()
    return [(left, right) for *_, left, right in keyed]


def _sentencepiece_tokenizer(vocab: GGUFVocab) -> Tokenizer:
    pieces = [_sentencepiece_spelling(t) for t in vocab.tokens]
    unk_id = vocab.special_ids.get("unk_token")
    bpe = models.BPE(
        vocab={piece: index for index, piece in enumerate(pieces)},
        merges=_derived_merges(pieces, vocab),
        unk_token=pieces[unk_id] if unk_id is not None else None,
        fuse_unk=True,
        byte_fallback=True,  # characters outside the vocabulary become <0xNN> byte tokens
    )
    tokenizer = Tokenizer(bpe)
    decode = [decoders.Replace(_SPACE_MARK, " "), decoders.ByteFallback(), decoders.Fuse()]
    if vocab.add_space_prefix:
        # Llama 2 style: "▁" before the first word only (not after each special token).
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement=_SPACE_MARK, prepend_scheme="first", split=False)
        decode.append(decoders.Strip(content=" ", left=1, right=0))
    else:
        # Gemma style: spaces are kept as they are, spelled "▁"; text is one BPE word.
        tokenizer.normalizer = normalizers.Replace(" ", _SPACE_MARK)
    tokenizer.decoder = decoders.Sequence(decode)
    return tokenizer


# ---------------------------------------------------------------- byte-level BPE ("gpt2")


@lru_cache(maxsize=1)
def _byte_alphabet() -> tuple[str, ...]:
    """GPT-2's printable stand-in for each byte value: printable Latin-1 bytes stand for
    themselves, the rest are mapped in order onto code points from 256 up."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    spelling = {byte: chr(byte) for byte in printable}
    extra = 0
    for byte in range(256):
        if byte not in spelling:
            spelling[byte] = chr(256 + extra)
            extra += 1
    return tuple(spelling[byte] for byte in range(256))


def _byte_level_spelling(token: str, alphabet: frozenset[str]) -> str:
    # A token with a character outside the byte alphabet was stored as plain text; spell its
    # UTF-8 bytes the way the merges and the ByteLevel pre-tokenizer see them.
    if set(token) <= alphabet:
        return token
    table = _byte_alphabet()
    return "".join(table[b] for b in token.encode("utf-8"))


def _byte_level_pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    name = pre or "default"
    if name in _GPT2_PRE:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if name in _DIGITS_THEN_GPT2_PRE:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    if name in _REGEX_PRE:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_REGEX_PRE[name]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    # Guessing a regex would tokenize silently differently from the model's training.
    known = sorted(_GPT2_PRE | _DIGITS_THEN_GPT2_PRE | set(_REGEX_PRE))
    raise ValueError(f"unsupported GGUF byte-level pre-tokenizer {name!r} (tokenizer.ggml.pre); supported: {known}")


def _byte_level_tokenizer(vocab: GGUFVocab) -> Tokenizer:
    if not vocab.merges:
        raise ValueError("GGUF 'gpt2' tokenizer has no tokenizer.ggml.merges")
    alphabet = frozenset(_byte_alphabet())
    pieces = [_byte_level_spelling(t, alphabet) for t in vocab.tokens]
    # Byte-level pieces never contain a real space, so one space separates a merge's halves.
    merges = [tuple(merge.split(" ", 1)) for merge in vocab.merges]
    bpe = models.BPE(
        vocab={piece: index for index, piece in enumerate(pieces)},
        merges=merges,
        continuing_subword_prefix="",
        end_of_word_suffix="",
        fuse_unk=False,
    )
    tokenizer = Tokenizer(bpe)
    tokenizer.pre_tokenizer = _byte_level_pre_tokenizer(vocab.pre)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


# ---------------------------------------------------------------- SentencePiece-style BPE ("gemma4")


def _gemma4_tokenizer(vocab: GGUFVocab) -> Tokenizer:
    if not vocab.merges:
        raise ValueError("GGUF 'gemma4' tokenizer has no tokenizer.ggml.merges")
    unk_id = vocab.special_ids.get("unk_token")
    # A merge joins two pieces that hold no real space ("▁" stands for one), so one space splits it.
    merges = [tuple(merge.split(" ", 1)) for merge in vocab.merges]
    bpe = models.BPE(
        vocab={token: index for index, token in enumerate(vocab.tokens)},
        merges=merges,
        unk_token=vocab.tokens[unk_id] if unk_id is not None else None,
        fuse_unk=True,
        byte_fallback=True,
    )
    tokenizer = Tokenizer(bpe)
    tokenizer.normalizer = normalizers.Replace(" ", _SPACE_MARK)
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[^\n]+|[\n]+"), behavior="isolated")
    tokenizer.decoder = decoders.Sequence([decoders.Replace(_SPACE_MARK, " "), decoders.ByteFallback(), decoders.Fuse()])
    return tokenizer


# ---------------------------------------------------------------- shared


def _added_tokens(vocab: GGUFVocab, tokenizer: Tokenizer) -> tuple[list[AddedToken], list[AddedToken]]:
    """(special, plain) tokens that must match whole in raw text before BPE sees it.

    Control and unknown tokens, and the named specials, are special (dropped by
    skip_special_tokens). User-defined tokens like "<start_of_image>" or "\\n\\n" are matched whole
    by llama.cpp too, but decode as text. A token whose stored spelling is not its spelling in the
    model (Gemma's space runs, non-byte-alphabet strings in a byte-level vocabulary) is reached by
    BPE instead, so it is skipped here.
    """
    in_model = tokenizer.get_vocab(with_added_tokens=False)
    named = set(vocab.special_ids.values())
    special, plain = [], []
    for index, (token, kind) in enumerate(zip(vocab.tokens, vocab.token_types)):
        if in_model.get(token) != index:
            continue
        if kind in (_CONTROL, _UNKNOWN) or index in named:
            special.append(AddedToken(token, special=True, normalized=False))
        elif kind == _USER_DEFINED:
            plain.append(AddedToken(token, special=False, normalized=False))
    return special, plain


def _post_processor(vocab: GGUFVocab) -> processors.TemplateProcessing:
    """BOS/EOS around each sequence exactly as the file's add_bos/add_eos flags say."""
    bos_id, eos_id = vocab.special_ids.get("bos_token"), vocab.special_ids.get("eos_token")
    bos = vocab.tokens[bos_id] if vocab.add_bos and bos_id is not None else None
    eos = vocab.tokens[eos_id] if vocab.add_eos and eos_id is not None else None

    def around(sequence: str, type_id: int) -> str:
        parts = [f"{bos}:{type_id}"] if bos else []
        parts.append(f"${sequence}:{type_id}")
        parts += [f"{eos}:{type_id}"] if eos else []
        return " ".join(parts)

    specials = [(bos, bos_id)] if bos else []
    specials += [(eos, eos_id)] if eos and eos != bos else []
    return processors.TemplateProcessing(
        single=around("A", 0), pair=f"{around('A', 0)} {around('B', 1)}", special_tokens=specials
    )


_BUILDERS = {"llama": _sentencepiece_tokenizer, "gpt2": _byte_level_tokenizer, "gemma4": _gemma4_tokenizer}


def build_tokenizer(vocab: GGUFVocab) -> Tokenizer:
    """The `tokenizers.Tokenizer` equivalent to the GGUF's tokenizer."""
    builder = _BUILDERS.get(vocab.model)
    if vocab.pre == "gemma4" and vocab.merges:  # Ollama's Gemma 4 files: model "llama", Gemma 4's BPE
        builder = _gemma4_tokenizer
    if builder is None:
        raise ValueError(
            f"unsupported GGUF tokenizer model {vocab.model!r} (tokenizer.ggml.model); supported: {sorted(_BUILDERS)}"
        )
    tokenizer = builder(vocab)
    special, plain = _added_tokens(vocab, tokenizer)
    tokenizer.add_special_tokens(special)
    tokenizer.add_tokens(plain)
    tokenizer.post_processor = _post_processor(vocab)
    return tokenizer


def tokenizer_config(reader: GGUFFile, vocab: GGUFVocab) -> dict[str, Any]:
    """tokenizer_config.json content: special token strings, BOS/EOS flags, template, length."""
    config: dict[str, Any] = {
        # Lets transformers' AutoTokenizer open the folder too, not only `tokenizers`.
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    for name in _SPECIAL_TOKEN_KEYS:
        token_id = vocab.special_ids.get(name)
        config[name] = vocab.tokens[token_id] if token_id is not None else None
    config["add_bos_token"] = vocab.add_bos
    config["add_eos_token"] = vocab.add_eos
    template = reader.value("tokenizer.chat_template")
    if template is not None:
        config["chat_template"] = template
    context_length = reader.value(f"{vocab.architecture}.context_length")
    if context_length is not None:
        config["model_max_length"] = int(context_length)
    return config


def convert_gguf_tokenizer(reader: GGUFFile, out_dir: Path) -> None:
    """Write tokenizer.json and tokenizer_config.json (HF layout) into out_dir."""
    vocab = read_vocab(reader)
    tokenizer = build_tokenizer(vocab)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    config = tokenizer_config(reader, vocab)
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
