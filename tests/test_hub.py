"""Hugging Face ids (`org/name[@revision]`, loading/hub.py) through huggingface_hub's real
download path, against a stand-in for the Hub's HTTP API (tests/hub_standin.py; never the real
Hub): the memory check refuses before a byte of weights is fetched, only the text shards are
fetched, `--drafter auto` pairs Gemma 4's assistant, a prepared cache works offline, and every
bad input is one line: an unknown id or revision, no network, a gated repository without a
token, a download cut half-way (retried in the run; a weight shard that a run gives up on is kept
in part, and the next run goes on from where it stopped).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
from pathlib import Path

import pytest

pytest.importorskip("huggingface_hub")
pytest.importorskip("transformers")

from hub_standin import StandinHub  # noqa: E402
from specdraft.cli.main import main  # noqa: E402
from specdraft.loading.weights import decoder_name  # noqa: E402

TARGET, ASSISTANT = "google/gemma-4-E2B-it", "google/gemma-4-E2B-it-assistant"
TEXT_SHARD, TOWER_SHARD = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
FLAGS = ["--dtype", "float32", "--device", "cpu", "--draft-policy", "fixed", "--max-new-tokens", "6", "--json"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A tiny multimodal Gemma 4 target, its text decoder and its towers in two shards, and its assistant."""
    from safetensors.torch import load_file, save_file

    from gemma4_tiny import build

    root = tmp_path_factory.mktemp("hub_repos")
    target, assistant = build(root)
    state = load_file(target / "model.safetensors")
    text = {k: v for k, v in state.items() if decoder_name(k) is not None}
    towers = {k: v for k, v in state.items() if decoder_name(k) is None}
    assert text and towers
    save_file(text, target / TEXT_SHARD, metadata={"format": "pt"})
    save_file(towers, target / TOWER_SHARD, metadata={"format": "pt"})
    (target / "model.safetensors").unlink()
    weight_map = {k: TEXT_SHARD for k in text} | {k: TOWER_SHARD for k in towers}
    (target / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (target / "preprocessor_config.json").write_text("{}")  # a vision-only file: never fetched
    return target, assistant


@pytest.fixture
def hub(checkpoints, tmp_path, monkeypatch):
    target, assistant = checkpoints
    gated = tmp_path / "gated"
    shutil.copytree(assistant, gated)
    with StandinHub({TARGET: target, ASSISTANT: assistant, "google/gated-model": gated},
                    gated=("google/gated-model",)) as h:
        monkeypatch.setenv("HF_ENDPOINT", h.url)
        monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
        monkeypatch.delenv("HF_HUB_CACHE", raising=False)
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        monkeypatch.delenv("HF_TOKEN", raising=False)
        monkeypatch.delenv("SPECDRAFT_MEMORY_LIMIT", raising=False)
        yield h


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def one_line_error(code, err, *words):
    lines = [line for line in err.splitlines() if line.startswith("specdraft: error:")]
    assert code == 2, err
    assert len(lines) == 1 and "Traceback" not in err, err
    for w in words:
        assert w in lines[0], lines[0]


def test_hub_id_fetches_the_text_model_and_pairs_the_assistant(hub, checkpoints, capsys, monkeypatch):
    target, assistant = checkpoints
    code, out, err = run(capsys, "generate", "hello world", "--model", TARGET, *FLAGS)
    assert code == 0, err
    got = json.loads(out)
    assert f"fetching {TARGET}:" in err and ASSISTANT in err and "GB" in err
    assert got["drafter"] == "mtp+ngram"
    # Only what the loader reads: no tower shard, no processor config.
    assert hub.downloaded(TEXT_SHARD) and not hub.downloaded(TOWER_SHARD)
    assert not hub.downloaded("preprocessor_config.json")
    # The same tokens as the local folders with the assistant named explicitly.
    code, out, err = run(capsys, "generate", "hello world", "--model", str(target), "--drafter", "mtp",
                         "--drafter-path", str(assistant), *FLAGS)
    assert code == 0, err
    assert json.loads(out)["token_ids"] == got["token_ids"]
    # A prepared cache works offline, without a single request; a local folder never asks either.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    before = len(hub.log)
    code, out, err = run(capsys, "generate", "hello world", "--model", TARGET, *FLAGS)
    assert code == 0, err
    assert json.loads(out)["token_ids"] == got["token_ids"] and json.loads(out)["drafter"] == "mtp+ngram"
    assert len(hub.log) == before and "fetching" not in err


def test_a_folder_whose_config_names_gemma4_pairs_a_cached_assistant(hub, checkpoints, capsys, monkeypatch,
                                                                    tmp_path):
    target, _ = checkpoints
    folder = tmp_path / "my-gemma"
    shutil.copytree(target, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"_name_or_path": TARGET}))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # not cached yet: prompt lookup, saying why
    code, out, err = run(capsys, "generate", "hello world", "--model", str(folder), *FLAGS)
    assert code == 0, err
    assert json.loads(out)["drafter"] == "ngram" and "HF_HUB_OFFLINE" in err and ASSISTANT in err
    assert hub.log == []
    monkeypatch.delenv("HF_HUB_OFFLINE")
    code, out, err = run(capsys, "generate", "hello world", "--model", str(folder), *FLAGS)
    assert code == 0, err
    assert json.loads(out)["drafter"] == "mtp+ngram" and f"fetching {ASSISTANT}" in err
    assert not hub.downloaded(TEXT_SHARD)  # the target came from the folder


def test_drafter_path_takes_a_hub_id(hub, checkpoints, capsys):
    target, _ = checkpoints
    code, out, err = run(capsys, "generate", "hello world", "--model", str(target), "--drafter", "mtp",
                         "--drafter-path", ASSISTANT, *FLAGS)
    assert code == 0, err
    assert json.loads(out)["drafter"] == "mtp"


def test_a_model_that_cannot_fit_is_refused_before_its_weights_download(hub, capsys, monkeypatch):
    monkeypatch.setenv("SPECDRAFT_MEMORY_LIMIT", "1M")
    code, _, err = run(capsys, "generate", "hello world", "--model", TARGET, *FLAGS)
    one_line_error(code, err, TARGET, "needs", "available")
    assert [p for m, p, _ in hub.log if m == "GET" and "/resolve/" in p] == [f"/{TARGET}/resolve/main/config.json"]


@pytest.mark.parametrize("model, words", [
    ("google/no-such-model", ["no such model"]),
    (f"{TARGET}@no-such-branch", ["no such revision"]),
    ("google/gated-model", ["gated", "HF_TOKEN"]),
])
def test_bad_ids_are_one_line(hub, capsys, model, words):
    code, _, err = run(capsys, "generate", "hello world", "--model", model, *FLAGS)
    one_line_error(code, err, model, *words)


def test_a_gated_repository_with_a_token_downloads(hub, checkpoints, capsys, monkeypatch):
    target, _ = checkpoints
    monkeypatch.setenv("HF_TOKEN", hub.token)
    code, out, err = run(capsys, "generate", "hello world", "--model", str(target), "--drafter", "mtp",
                         "--drafter-path", "google/gated-model", *FLAGS)
    assert code == 0, err


def test_no_network_and_offline_without_a_cache_are_one_line(hub, capsys, monkeypatch):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    code, _, err = run(capsys, "generate", "hello world", "--model", TARGET, *FLAGS)
    one_line_error(code, err, TARGET, "cannot reach")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code, _, err = run(capsys, "generate", "hello world", "--model", TARGET, *FLAGS)
    one_line_error(code, err, TARGET, "HF_HUB_OFFLINE")


def test_a_download_cut_half_way_is_retried_in_the_same_run(hub, capsys):
    """huggingface_hub retries a cut transfer (with a Range from what it kept, where a chunk of
    its own size arrived; from the start for a file smaller than that, as here)."""
    hub.cut.add(TEXT_SHARD)
    code, out, err = run(capsys, "generate", "hello world", "--model", TARGET, "--drafter", "none", *FLAGS)
    assert code == 0, err
    assert len(hub.downloaded(TEXT_SHARD)) == 2 and len(json.loads(out)["token_ids"]) == 6


def test_a_download_that_gives_up_is_one_line_and_the_next_run_completes_it(hub, capsys):
    hub.cut.add(TEXT_SHARD)
    hub.stay_down = True
    code, _, err = run(capsys, "generate", "hello world", "--model", TARGET, "--drafter", "none", *FLAGS)
    one_line_error(code, err, TARGET, "again")
    hub.down = hub.stay_down = False
    code, out, err = run(capsys, "generate", "hello world", "--model", TARGET, "--drafter", "none", *FLAGS)
    assert code == 0, err
    assert len(json.loads(out)["token_ids"]) == 6


@pytest.mark.parametrize("resumable", [True, False])
def test_a_shard_cut_off_in_one_run_resumes_in_the_next_from_where_it_stopped(hub, checkpoints, capsys, monkeypatch,
                                                                            resumable):
    """The Hub goes down half-way through the text shard and stays down: the run fails in one
    line, keeping the part it got as the cache's `.incomplete` blob; the next run asks for the
    rest only (a Range from that length) and the shard in the cache is the Hub's, byte for byte.
    huggingface_hub writes what arrives a chunk at a time (10 MB; 4 kB here, so that this small
    shard behaves as a large one). Negative control: huggingface_hub's own download alone keeps
    nothing of the cut shard and fetches it from its first byte again."""
    import huggingface_hub

    from specdraft.loading import hub as hub_module

    target, _ = checkpoints
    monkeypatch.setattr(huggingface_hub.constants, "DOWNLOAD_CHUNK_SIZE", 4096)
    if not resumable:
        monkeypatch.setattr(hub_module, "fetch_shards", lambda *a, **k: None)
    hub.cut.add(TEXT_SHARD)
    hub.stay_down = True
    argv = ["generate", "hello world", "--model", TARGET, "--drafter", "none", *FLAGS]
    code, _, err = run(capsys, *argv)
    one_line_error(code, err, TARGET, "again")
    cache = Path(os.environ["HF_HOME"])
    kept = [p.stat().st_size for p in cache.rglob("*.incomplete")]
    size = (target / TEXT_SHARD).stat().st_size
    hub.down = hub.stay_down = False
    code, out, err = run(capsys, *argv)
    assert code == 0, err and len(json.loads(out)["token_ids"]) == 6
    last_range = hub.downloaded(TEXT_SHARD)[-1][1]
    if resumable:
        assert len(kept) == 1 and 0 < kept[0] < size
        assert last_range == f"bytes={kept[0]}-"
    else:
        assert kept == [] and last_range is None
    (shard,) = [p for p in cache.rglob(TEXT_SHARD) if "snapshots" in p.parts]
    assert shard.read_bytes() == (target / TEXT_SHARD).read_bytes()
    assert not list(cache.rglob("*.incomplete"))


def test_bench_auto_pairs_the_assistant_as_generate_does(hub, checkpoints, capsys, tmp_path):
    """`specdraft bench`'s `auto` is `generate --drafter auto`: on a Gemma 4 target named by its
    Hub id it runs the official assistant with prompt lookup, says which, and gives plain's tokens."""
    from specdraft.bench.runner import BenchConfig, run_bench

    questions = tmp_path / "questions.jsonl"
    questions.write_text(json.dumps({"question_id": 1, "category": "writing", "turns": ["hello world"]}) + "\n")
    payload = run_bench(BenchConfig(questions=questions, model=TARGET, methods=["auto"], max_new_tokens=6,
                                    dtype="float32", device="cpu", out=tmp_path / "out", warmup=False,
                                    progress=False, plots=False))
    notes = payload["methods"]["auto"]["notes"]
    assert any(n.startswith("auto = mtp+ngram") for n in notes), notes
    assert any("gemma-4-E2B-it-assistant" in n for n in notes), notes  # the drafter auto chose
    rows = {r["method"]: r["token_ids"] for r in payload["rows"]}
    assert rows["auto"] == rows["plain"]
    code, out, err = run(capsys, "generate", "hello world", "--model", TARGET, *FLAGS)
    assert code == 0 and json.loads(out)["drafter"] == "mtp+ngram"
