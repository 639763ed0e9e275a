"""Gemma 4 GGUF files as llama.cpp's own tools write them, loaded from their own blocks.

A tiny Gemma 4 Hugging Face checkpoint (PLE, KV sharing, double-wide MLP, k_eq_v, proportional
RoPE) is converted by llama.cpp's convert_hf_to_gguf.py (Q8_0 and F32), the F32 file
requantised to Q4_0 with gguf-py's quantizer, and, where the native `llama-quantize` is found
($SPECDRAFT_LLAMA_CPP_BIN), to Q4_K_M and Q6_K. `make install-test` unpacks the converter from
llama-cpp-python's source release into the virtualenv ($SPECDRAFT_LLAMA_CPP_CONVERTER elsewhere).

The oracle is transformers' model holding exactly the weights the file holds (each tensor
dequantised with the gguf package, which shares no code with specdraft's block decoder); each of
those is first checked against the checkpoint's own tensor of that name, so a wrong name mapping
cannot pass. What remains between specdraft and the oracle is the int8 rounding of activations
(llama.cpp's Q8_0 activation arithmetic), bounded per linear in test_q8_act_linear.py.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from conftest import OracleDrafter, prompts_of  # noqa: E402
from gemma4_tiny import randomize_, target_text_config  # noqa: E402
from specdraft.errors import SpecdraftError  # noqa: E402
from specdraft.loading.gguf_file import hf_name  # noqa: E402
from specdraft.models.formats import q8_act_linear  # noqa: E402
from specdraft.runtime import Runtime  # noqa: E402
from specdraft.speculative.engine import Engine  # noqa: E402

pytestmark = pytest.mark.skipif(not q8_act_linear.kernel_available(), reason="needs the int8 kernel (x86, AVX2)")

VOCAB = 512
# hidden and MLP widths of 256: llama-quantize's k-quants need rows of 256 inputs (narrower
# matrices fall back to its 32-wide types, so a Q4_K_M file here mixes several formats)
CONFIG = dict(vocab_size=VOCAB, vocab_size_per_layer_input=VOCAB, hidden_size=256, intermediate_size=256,
              hidden_size_per_layer_input=32)
SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<|turn>", "<turn|>"]
MERGES = [("h", "e"), ("l", "l"), ("he", "ll"), ("hell", "o"), ("\u2581", "w"), ("\u2581w", "o"), ("\u2581wo", "r"),
          ("\u2581wor", "l"), ("\u2581worl", "d"), ("b", "c"), ("a", "b")]


def converter_dir() -> Path | None:
    """llama.cpp's converter (convert_hf_to_gguf.py, conversion/, gguf-py/): where make install-test
    unpacks it, or $SPECDRAFT_LLAMA_CPP_CONVERTER."""
    for base in (os.environ.get("SPECDRAFT_LLAMA_CPP_CONVERTER"), Path(sys.prefix) / "llama-cpp-converter"):
        if base and (Path(base) / "convert_hf_to_gguf.py").exists():
            return Path(base)
    return None


def native_quantize() -> Path | None:
    """llama.cpp's own llama-quantize, from $SPECDRAFT_LLAMA_CPP_BIN (a folder of its binaries)."""
    folder = os.environ.get("SPECDRAFT_LLAMA_CPP_BIN")
    tool = Path(folder) / "llama-quantize" if folder else None
    return tool if tool is not None and tool.exists() else None


def write_bpe_tokenizer(folder: Path, vocab_size: int) -> None:
    """A SentencePiece-style BPE tokenizer.json with byte fallback (what llama.cpp's Gemma 4
    converter reads through LlamaHfVocab): specials, characters, merged pieces, the 256 byte
    tokens, filler."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers

    chars = ["\u2581", "\n"] + list("abcdefghijklmnopqrstuvwxyz")
    words = SPECIALS + chars + [a + b for a, b in MERGES] + [f"<0x{i:02X}>" for i in range(256)]
    words += [f"<unused{i}>" for i in range(vocab_size - len(words))]
    tok = Tokenizer(models.BPE({w: i for i, w in enumerate(words)}, MERGES, unk_token="<unk>", byte_fallback=True,
                               fuse_unk=True))
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.add_special_tokens([AddedToken(s, special=True) for s in SPECIALS])
    tok.save(str(folder / "tokenizer.json"))
    config = {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>",
              "tokenizer_class": "PreTrainedTokenizerFast"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


def convert(converter: Path, folder: Path, outtype: str, out: Path) -> Path:
    env = {**os.environ, "PYTHONPATH": str(converter / "gguf-py")}
    done = subprocess.run([sys.executable, str(converter / "convert_hf_to_gguf.py"), str(folder), "--outtype", outtype,
                           "--outfile", str(out)], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    return out


def requantise(src: Path, dst: Path, qtype) -> Path:
    """The file `src` with every F32 matrix of whole blocks in `qtype` (gguf-py's quantizer), keys
    and other tensors as they are."""
    block, _ = gguf.GGML_QUANT_SIZES[qtype]
    reader = gguf.GGUFReader(str(src))
    writer = gguf.GGUFWriter(str(dst), str(reader.get_field("general.architecture").contents()))
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        sub = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), field.types[0], sub)
    for t in reader.tensors:
        data = np.asarray(t.data)
        if t.tensor_type == gguf.GGMLQuantizationType.F32 and data.ndim >= 2 and data.shape[-1] % block == 0 \
                and not t.name.startswith("rope_freqs"):
            writer.add_tensor(t.name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(t.name, data, raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """The tiny Gemma 4 checkpoint (transformers' model and its folder)."""
    folder = tmp_path_factory.mktemp("gemma4-hf")
    model = transformers.Gemma4ForCausalLM(target_text_config(**CONFIG))
    randomize_(model, 0)
    model.save_pretrained(folder)
    write_bpe_tokenizer(folder, VOCAB)
    return model.eval(), folder


FILES = ["Q8_0", "Q4_0", "Q4_K_M", "Q6_K"]


@pytest.fixture(scope="module", params=FILES)
def llama_gguf(request, checkpoint, tmp_path_factory):
    """(format, path) of the checkpoint as a GGUF file written by llama.cpp's own tools."""
    converter = converter_dir()
    if converter is None:
        pytest.skip("llama.cpp's converter is not unpacked (make install-test, or SPECDRAFT_LLAMA_CPP_CONVERTER)")
    _, folder = checkpoint
    out = tmp_path_factory.mktemp(f"gguf-{request.param}")
    if request.param == "Q8_0":
        return request.param, convert(converter, folder, "q8_0", out / "tiny-q8_0.gguf")
    f32 = convert(converter, folder, "f32", out / "tiny-f32.gguf")
    if request.param == "Q4_0":
        return request.param, requantise(f32, out / "tiny-q4_0.gguf", gguf.GGMLQuantizationType.Q4_0)
    tool = native_quantize()
    if tool is None:
        pytest.skip("llama-quantize not found (set SPECDRAFT_LLAMA_CPP_BIN to llama.cpp's binaries)")
    dst = out / f"tiny-{request.param.lower()}.gguf"
    done = subprocess.run([str(tool), str(f32), str(dst), request.param], capture_output=True)
    assert done.returncode == 0, done.stderr[-2000:].decode(errors="replace")
    return request.param, dst


def file_weights_model(checkpoint, path: Path):
    """transformers' model holding the file's weights, each checked against the checkpoint's own."""
    model, _ = checkpoint
    reader = gguf.GGUFReader(str(path))
    state = model.state_dict()
    oracle = transformers.Gemma4ForCausalLM(model.config).eval()
    loaded = {}
    types = set()
    for t in reader.tensors:
        name = hf_name(t.name, "gemma4")
        if name is None:
            continue
        types.add(t.tensor_type.name)
        values = torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(t.data, t.tensor_type))).float()
        original = state[name].float()
        assert values.shape == original.shape, name
        # the file's tensor is the checkpoint's tensor of that name, up to 4-bit rounding
        assert (values - original).abs().max() <= 0.15 * original.abs().max() + 1e-6, name
        loaded[name] = values
    missing = set(state) - set(loaded) - {"lm_head.weight"}
    assert not missing, sorted(missing)[:4]
    oracle.load_state_dict(loaded, strict=False)
    oracle.tie_weights()
    return oracle, types


def our_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        cache = model.new_cache(1, len(ids) + 1)
        return model.logits(model(torch.tensor([ids]), cache))[0]


def test_llama_cpp_files_load_from_their_blocks_near_the_files_weights(llama_gguf, checkpoint, tmp_path, monkeypatch):
    fmt, path = llama_gguf
    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path / "cache"))
    rt = Runtime.load(str(path), progress=False)
    assert rt.weights == "gguf-q8"
    oracle, types = file_weights_model(checkpoint, path)
    if fmt == "Q4_K_M":
        assert {"Q4_K", "Q6_K"} <= types  # the mix llama-quantize makes, each read by its own decoder
    ids = prompts_of([24], VOCAB, seed=3)[0]
    ours = our_logits(rt.model, ids)
    with torch.inference_mode():
        ref = oracle(torch.tensor([ids])).logits[0].float()
    kl = torch.nn.functional.kl_div(ours.log_softmax(-1), ref.log_softmax(-1), log_target=True,
                                    reduction="batchmean").item()
    # int8 rows per 32 inputs (each linear within its bound, test_q8_act_linear.py): a code that
    # flips moves a value by a 127th of its block's largest, and this random model's layers
    # amplify that, to ~40% of the logits' spread at worst and a KL of ~3e-3 (measured)
    assert 0 < (ours - ref).abs().max().item() < 0.6 * ref.std().item()
    assert kl < 1e-2, (fmt, kl)
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean() > 0.8


def test_the_direct_load_gives_the_converted_folders_bits(llama_gguf, tmp_path, monkeypatch):
    """The file loaded from its blocks computes exactly what the float32 folder converted from it
    computes under --weights gguf-q8 (whose folder test_gemma4_gguf.py checks against
    transformers), that path's table kept in float32 rather than fp16 so both read the same rows.
    The one matrix that path leaves in float32 (the model-level per-layer projection, outside the
    layers it packs) is given the direct model's kernel linear."""
    import specdraft.runtime as runtime
    from specdraft.models.formats import quant

    fmt, path = llama_gguf
    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path / "cache"))
    ids = prompts_of([20], VOCAB, seed=4)[0]
    model = Runtime.load(str(path), progress=False).model
    direct = our_logits(model, ids)
    monkeypatch.setattr(runtime, "_direct_gguf", lambda *a, **k: None)
    monkeypatch.setattr(quant, "narrow_tables", lambda model: None)
    converted = Runtime.load(str(path), progress=False, weights="gguf-q8").model
    assert (tmp_path / "cache" / "models").exists()  # the control: this one did convert
    assert type(converted.per_layer_model_projection) is torch.nn.Linear
    assert not torch.equal(direct, our_logits(converted, ids))  # int8 rows there do change the bits
    converted.per_layer_model_projection = model.per_layer_model_projection
    assert torch.equal(direct, our_logits(converted, ids))


def test_no_float_copy_and_no_converted_weights(llama_gguf, tmp_path, monkeypatch):
    """Every matrix of the layers and the head is a kernel linear over the file's blocks, the
    tables are views of the file, and the cache holds a tokenizer folder, no weights."""
    from specdraft.models.formats.gguf_table import GGUFEmbedding
    from specdraft.models.formats.q8_act_linear import Q8ActLinear

    fmt, path = llama_gguf
    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path / "cache"))
    rt = Runtime.load(str(path), progress=False)
    model = rt.model
    kinds = {type(m).__name__ for m in model.modules()}
    assert "Linear" not in kinds and "BlockLinear" not in kinds, kinds
    assert isinstance(model.packed_head, Q8ActLinear)
    assert isinstance(model.embed_tokens, GGUFEmbedding) and isinstance(model.embed_tokens_per_layer, GGUFEmbedding)
    largest_float = max(p.numel() for p in model.parameters() if p.is_floating_point())
    assert largest_float <= 256, largest_float  # norms and scalars only (the widest: hidden 256)
    assert rt.mapped_bytes == model.embed_tokens.weight.numel() + model.embed_tokens_per_layer.weight.numel()
    written = sorted(p.name for p in (tmp_path / "cache").rglob("*") if p.is_file() and not p.name.startswith("."))
    assert written == ["config.json", "tokenizer.json", "tokenizer_config.json"], written
    assert not list((tmp_path / "cache").rglob("*.safetensors"))


def test_speculative_equals_plain_with_accepted_drafts(llama_gguf, tmp_path, monkeypatch):
    fmt, path = llama_gguf
    if fmt not in ("Q8_0", "Q4_K_M"):
        pytest.skip("one 8-bit and one mixed 4/6-bit file suffice here")
    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path / "cache"))
    model = Runtime.load(str(path), progress=False).model
    prompts = prompts_of([7, 12], VOCAB, seed=5)
    plain = Engine(model).generate(prompts, 20, eos_token_ids=[])
    sequences = [p + r.token_ids for p, r in zip(prompts, plain)]
    drafter = OracleDrafter(sequences, noise=0.3, seed=1, vocab=VOCAB)
    spec = Engine(model, drafter=drafter, draft_tokens=4).generate(prompts, 20, eos_token_ids=[])
    assert [r.token_ids for r in spec] == [r.token_ids for r in plain]
    accepted = sum(sum(r.stats.accepted_by_position) for r in spec)
    drafted = sum(sum(r.stats.drafted_by_position) for r in spec)
    assert 0 < accepted < drafted  # drafts were accepted, and some rejected


def test_the_tokenizer_comes_from_the_file(llama_gguf, checkpoint, tmp_path, monkeypatch):
    fmt, path = llama_gguf
    if fmt != "Q8_0":
        pytest.skip("the tokenizer is the same in every file")
    _, folder = checkpoint
    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path / "cache"))
    rt = Runtime.load(str(path), progress=False)
    hf = transformers.AutoTokenizer.from_pretrained(folder)
    text = "hello world abc"
    assert rt.tokenizer.encode(text) == [2] + hf(text)["input_ids"]  # the file says add_bos_token


def test_a_gguf_that_cannot_fit_is_refused_from_its_header(llama_gguf, tmp_path, monkeypatch):
    """One line naming a setting that fits, before any tensor is read (the loader is replaced by
    one that fails the test); with room, the same file loads (the control)."""
    import specdraft.loading.gguf_direct as direct

    fmt, path = llama_gguf
    if fmt != "Q8_0":
        pytest.skip("the refusal reads the header only; one file suffices")
    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path / "cache"))
    loader = direct.load_gguf

    def must_not_load(*a, **k):
        raise AssertionError("weights were read before the memory check refused")

    from specdraft.loading.footprint import estimate_gguf
    from specdraft.loading.gguf_description import describe_gguf

    monkeypatch.setattr(direct, "load_gguf", must_not_load)
    desc = describe_gguf(path)
    _, meta = direct.describe_model(desc)
    need, small = estimate_gguf(meta, desc, 1024).total, estimate_gguf(meta, desc, 1024, as_type="Q4_0").total
    assert small < need
    monkeypatch.setenv("SPECDRAFT_MEMORY_LIMIT", str((need + small) // 2))  # a Q4_0 file would fit
    with pytest.raises(SpecdraftError) as refused:
        Runtime.load(str(path), progress=False, context=1024)
    message = str(refused.value)
    assert "\n" not in message and "its GGUF blocks" in message and "GB is available" in message
    assert "a Q4_0 file of this model fits" in message, message
    monkeypatch.setattr(direct, "load_gguf", loader)
    monkeypatch.setenv("SPECDRAFT_MEMORY_LIMIT", "2G")
    assert Runtime.load(str(path), progress=False, context=1024).footprint.total < 2 << 30


def test_an_explicit_format_refuses_a_conversion_that_cannot_fit(llama_gguf, tmp_path, monkeypatch):
    """--weights q8 on a GGUF converts it to a float32 folder first, every weight in float32 at
    once: where that cannot fit, one line naming --weights gguf-q8 (the file's own blocks, which
    does), and where the converted model itself cannot, check_fits' line, each before anything is
    converted (the converter is replaced by one that fails the test); with room, it converts and
    loads (the control)."""
    import specdraft.loading.gguf_direct as direct
    import specdraft.loading.gguf_file as gguf_file
    from specdraft.loading.footprint import estimate, estimate_gguf, estimate_gguf_conversion
    from specdraft.loading.gguf_description import describe_gguf

    fmt, path = llama_gguf
    if fmt != "Q8_0":
        pytest.skip("the refusal reads the header only; one file suffices")
    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path / "cache"))
    desc = describe_gguf(path)
    _, meta = direct.describe_model(desc)
    need = estimate_gguf_conversion(desc)
    runs = max(estimate_gguf(meta, desc, 1024).total, estimate(meta, "q8", torch.float32, 1024).total)
    assert runs < need
    converter = gguf_file.convert_gguf

    def must_not_convert(*a, **k):
        raise AssertionError("the file was converted before the memory check refused")

    monkeypatch.setattr(gguf_file, "convert_gguf", must_not_convert)
    for limit, expected in (((need + runs) // 2, "converts the file to a float32 folder first, which needs"),
                            (runs // 2, "GB as q8, KV cache")):
        monkeypatch.setenv("SPECDRAFT_MEMORY_LIMIT", str(limit))
        with pytest.raises(SpecdraftError) as refused:
            Runtime.load(str(path), progress=False, weights="q8", context=1024)
        message = str(refused.value)
        assert "\n" not in message and expected in message and "GB is available" in message, message
        if limit > runs // 2:
            assert message.endswith("--weights gguf-q8 runs the file from its own blocks, no conversion (~0.4 GB)")
    assert not (tmp_path / "cache" / "models").exists()
    monkeypatch.setattr(gguf_file, "convert_gguf", converter)
    monkeypatch.setenv("SPECDRAFT_MEMORY_LIMIT", str(need + 1))
    assert Runtime.load(str(path), progress=False, weights="q8", context=1024).weights == "q8"


def test_a_31b_sized_gguf_is_refused_from_its_header(tmp_path, monkeypatch):
    """A header declaring Gemma 4 31B's tensors at their real shapes (Q8_0 matrices; a sparse
    file, its weights never written): refused on a 24 GB budget, naming the smaller file that fits
    (the 262144 x 5376 head's decoding transients are counted too)."""
    from gemma4_real_size import GGUFStream, GGUFTensor, gguf_tensor, rope_freqs, target_tensors, text_config

    cfg = text_config("31b")
    rope = GGUFTensor("rope_freqs.weight", (cfg["global_head_dim"] // 2,), gguf.GGMLQuantizationType.F32)
    tensors = [rope] + [gguf_tensor(s) for s in target_tensors(cfg)]
    path = tmp_path / "31b-q8_0.gguf"
    stream = GGUFStream(path, cfg, tensors, "31b", {})
    stream.begin(rope)
    start = stream.out.tell()
    stream.write(rope_freqs(cfg))
    stream.end()
    stream.close()
    total = start + sum(-(-stream._nbytes(t) // 32) * 32 for t in tensors)
    os.truncate(path, total)  # sparse: the weights' bytes read as zeros, and take no disk
    assert path.stat().st_size > 30 << 30 and path.stat().st_blocks * 512 < 64 << 20
    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("SPECDRAFT_MEMORY_LIMIT", "24G")
    with pytest.raises(SpecdraftError, match=r"needs ~\d\d\.\d GB \(weights 3\d\.\d GB as its GGUF blocks.* but 24\.0 GB "
                                             r"is available; a Q4_0 file of this model with --max-context \d+ fits$"):
        Runtime.load(str(path), progress=False)
    assert not (tmp_path / "cache").exists()  # refused before anything was written


def test_an_unsupported_tensor_type_is_named(checkpoint, tmp_path, monkeypatch):
    converter = converter_dir()
    if converter is None:
        pytest.skip("llama.cpp's converter is not unpacked")
    _, folder = checkpoint
    f32 = convert(converter, folder, "f32", tmp_path / "f32.gguf")
    path = requantise(f32, tmp_path / "tq2_0.gguf", gguf.GGMLQuantizationType.TQ2_0)
    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path / "cache"))
    with pytest.raises(SpecdraftError, match=r"tensor \S+ is stored as TQ2_0, which specdraft does not read"):
        Runtime.load(str(path), progress=False)


def test_unpacked_converter_is_where_make_puts_it():
    """The Makefile unpacks the converter where converter_dir looks (a check of the wiring)."""
    makefile = (Path(__file__).parents[1] / "Makefile").read_text()
    assert "llama-cpp-converter" in makefile and "convert_hf_to_gguf.py" in makefile
    assert shutil.which("tar") is not None


def test_a_tied_head_drafter_cannot_read_the_blocks_table(llama_gguf, tmp_path, monkeypatch):
    """The token table stays as the file's bytes: anything that would score against it as [V, H]
    values (a drafter tied to the target's head, drafter training) is refused in one line, never
    fed raw bytes; the checkpoint-loaded model (the control) hands its table over."""
    from specdraft.errors import SpecdraftError

    fmt, path = llama_gguf
    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path / "cache"))
    rt = Runtime.load(str(path), progress=False)
    with pytest.raises(SpecdraftError, match="GGUF file's .* blocks"):
        rt.model.head_weight
    model = rt.model
    model.embed_tokens.weight = torch.nn.Parameter(torch.zeros(3, 4), requires_grad=False)  # values, not bytes
    assert model.head_weight.shape == (3, 4)


def test_full_layers_with_their_own_kv_heads_without_k_eq_v(tmp_path, monkeypatch):
    """Full layers with their own head dim and KV heads that keep v_proj (no attention_k_eq_v;
    transformers states both shapes in per_layer_config), converted by llama.cpp's converter: the
    header reads back as those shapes, and the file loads from its blocks and computes near
    transformers' model holding the file's weights."""
    from specdraft.config import FULL, SLIDING
    from specdraft.loading.gguf_file import gguf_config
    from specdraft.models.architectures.gemma4_config import gemma4_params
    from specdraft.models.architectures.hf_config import read_model_config

    converter = converter_dir()
    if converter is None:
        pytest.skip("llama.cpp's converter is not unpacked")
    types = target_text_config(**CONFIG).layer_types
    own = {str(i): {"head_dim": 32, "num_key_value_heads": 1} for i, t in enumerate(types) if t == FULL}
    model = randomize_(transformers.Gemma4ForCausalLM(target_text_config(**CONFIG, attention_k_eq_v=False,
                                                                         per_layer_config=own)), 6).eval()
    full = types.index(FULL)
    assert model.model.layers[full].self_attn.v_proj.out_features == 32  # V kept, 1 KV head of 32
    folder = tmp_path / "hf"
    model.save_pretrained(folder)
    write_bpe_tokenizer(folder, VOCAB)
    path = convert(converter, folder, "q8_0", tmp_path / "own-kv.gguf")
    params = gemma4_params(read_model_config(gguf_config(path)))
    assert params.head_dim == {SLIDING: 16, FULL: 32} and params.num_kv_heads == {SLIDING: 2, FULL: 1}
    assert not params.attention_k_eq_v
    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path / "cache"))
    ours = our_logits(Runtime.load(str(path), progress=False).model, prompts_of([16], VOCAB, seed=8)[0])
    oracle, _ = file_weights_model((model, folder), path)
    with torch.inference_mode():
        ref = oracle(torch.tensor([prompts_of([16], VOCAB, seed=8)[0]])).logits[0].float()
    assert (ours - ref).abs().max().item() < 0.6 * ref.std().item()  # as the main test's bound (int8 rows)
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean() > 0.8
