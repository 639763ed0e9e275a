"""specdraft's GGUF reader against the `gguf` package's own (the oracle) on files written here."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from specdraft.errors import SpecdraftError
from specdraft.loading.gguf_file import open_gguf
from specdraft.loading.gguf_reader import GGUFFile


def _write(path: Path, alignment: int | None = None) -> Path:
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), "llama")
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    writer.add_uint8("t.u8", 200)
    writer.add_int8("t.i8", -5)
    writer.add_uint16("t.u16", 60000)
    writer.add_int16("t.i16", -30000)
    writer.add_uint32("t.u32", 4_000_000_000)
    writer.add_int32("t.i32", -2_000_000_000)
    writer.add_float32("t.f32", 0.1)
    writer.add_uint64("t.u64", 2**63 + 5)
    writer.add_int64("t.i64", -(2**62))
    writer.add_float64("t.f64", 1 / 3)
    writer.add_bool("t.bool", True)
    writer.add_string("t.str", "héllo ▁world\n")
    writer.add_string("t.empty", "")
    writer.add_token_list(["<s>", "▁a", "é", "", "<0x0A>"] * 50)
    writer.add_token_scores(rng.standard_normal(250).astype(np.float32).tolist())
    writer.add_token_types([1, 2, 3, 4, 6] * 50)
    writer.add_array("t.bools", [True, False, True])
    writer.add_array("t.empty_list", [])
    writer.add_tensor("f32", rng.standard_normal((3, 64)).astype(np.float32))
    writer.add_tensor("f16", rng.standard_normal((2, 32)).astype(np.float16))
    weights = rng.standard_normal((4, 256)).astype(np.float32)
    for kind in (gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_0):
        q = gguf.quants.quantize(weights, kind)
        writer.add_tensor(f"q.{kind.name}", q, raw_shape=q.shape, raw_dtype=kind)
    writer.add_tensor("vector", rng.standard_normal(7).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("alignment", [None, 64])
def test_reader_matches_the_gguf_package(tmp_path: Path, alignment: int | None) -> None:
    path = _write(tmp_path / "t.gguf", alignment)
    ours, oracle = GGUFFile(path), gguf.GGUFReader(str(path))
    # The package adds three pseudo-fields of its own (GGUF.version, GGUF.tensor_count, GGUF.kv_count).
    stored = {k: f for k, f in oracle.fields.items() if not k.startswith("GGUF.")}
    assert list(ours.fields) == list(stored)
    for key, field in stored.items():
        assert ours.fields[key].contents() == field.contents(), key
    assert ours.fields["t.u64"].contents() == 2**63 + 5 and ours.fields["t.str"].contents() == "héllo ▁world\n"
    assert ours.value("t.str") == "héllo ▁world\n" and ours.value("t.absent", 7) == 7 and ours.value("t.absent") is None
    assert [t.name for t in ours.tensors] == [t.name for t in oracle.tensors]
    for mine, theirs in zip(ours.tensors, oracle.tensors):
        assert mine.tensor_type == theirs.tensor_type
        assert list(mine.shape) == theirs.shape.tolist()
        assert mine.data.dtype == theirs.data.dtype and mine.data.shape == theirs.data.shape
        assert np.array_equal(mine.data, theirs.data)
    q8 = next(t for t in ours.tensors if t.tensor_type == gguf.GGMLQuantizationType.Q8_0)
    assert gguf.quants.dequantize(q8.data, q8.tensor_type).shape == (4, 256)


def test_bad_files_are_refused_in_one_line(tmp_path: Path) -> None:
    path = _write(tmp_path / "t.gguf")
    data = path.read_bytes()
    cases = {
        "magic.gguf": b"GGUX" + data[4:],
        "version.gguf": data[:4] + (1).to_bytes(4, "little") + data[8:],
        "header.gguf": data[:200],  # cut inside the key/value pairs
        "tensor.gguf": data[:-100],  # the last tensor's bytes missing
    }
    for name, content in cases.items():
        (tmp_path / name).write_bytes(content)
        with pytest.raises(SpecdraftError, match="not a valid GGUF file.*truncated or corrupt"):
            open_gguf(tmp_path / name)
