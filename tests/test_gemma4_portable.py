"""Drafters specdraft writes for a Gemma 4 target stay portable, and the others say they are not.

Portable: a drafter `train-drafter` starts (drafter_config_for + init_network) or continues from
an official assistant, with a head of its own, no copy gate and q_norm, saved by save_network:
transformers' Gemma4AssistantForCausalLM opens the folder with no missing or unexpected tensors
and drafts the same tokens, with the same clusters and logits, on the same target hidden state
and K/V. The settings only specdraft computes (head 'target', a copy gate, no q_norm, a target
whose attention scale is not 1) are written as model_type "specdraft_mtp" with the reasons, so
that other engines refuse the folder instead of computing another network; specdraft still
loads it as it was.
"""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from gemma4_tiny import assistant_config, randomize_, target_text_config  # noqa: E402
from test_gemma4_assistant import compare_drafts  # noqa: E402
from specdraft.config import FULL, SLIDING  # noqa: E402
from specdraft.drafters.base import DraftInput  # noqa: E402
from specdraft.drafters.mtp import drafter_config_for, init_network, load_mtp_drafter, save_network  # noqa: E402
from specdraft.drafters.mtp.checkpoint import load_network  # noqa: E402
from specdraft.loading import load_folder  # noqa: E402
from specdraft.sampling import SamplingParams  # noqa: E402


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """(transformers Gemma4ForCausalLM, specdraft's model of the same folder)."""
    ref = randomize_(transformers.Gemma4ForCausalLM(target_text_config()), seed=31)
    folder = tmp_path_factory.mktemp("portable_target")
    ref.save_pretrained(folder)
    model, _, _ = load_folder(folder, torch.float32, "cpu")
    return ref, model


def _fresh(model, **kw):
    """A drafter as `train-drafter` starts one, with weights spread enough for distinct drafts."""
    cfg = drafter_config_for(model, hidden=32, layers=4, heads=4, clustered=True, num_centroids=8, top_k_clusters=2,
                             **kw)
    return init_network(cfg, model, seed=32, std=0.3)


@pytest.mark.usefixtures("float32_kv")  # float32 parity: summation order only
def test_fresh_drafter_for_gemma4_opens_and_drafts_the_same_in_transformers(target, tmp_path):
    ref_t, model = target
    save_network(_fresh(model), tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["model_type"] == "gemma4_assistant" and raw["architectures"] == ["Gemma4AssistantForCausalLM"]
    assert "specdraft_only" not in raw["specdraft"]
    text = raw["text_config"]
    assert text["sliding_window"] == ref_t.config.sliding_window
    assert text["rope_parameters"] == {t: ref_t.config.rope_parameters[t] for t in (SLIDING, FULL)}
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert type(hf).__name__ == "Gemma4AssistantForCausalLM"
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    drafter = load_mtp_drafter(tmp_path, model, torch.float32, "cpu")
    compare_drafts(ref_t, model, hf.eval(), drafter, ref_t.config.sliding_window, clustered=True)


@pytest.mark.usefixtures("float32_kv")  # float32 parity: summation order only
def test_continued_official_assistant_keeps_its_settings_and_layout(target, tmp_path_factory):
    """Continuing an official assistant (its own window and RoPE included) and saving it gives
    a folder transformers runs as specdraft does."""
    ref_t, model = target
    rope = {SLIDING: {"rope_type": "default", "rope_theta": 700.0},
            FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 50_000.0}}
    official = randomize_(transformers.Gemma4AssistantForCausalLM(
        assistant_config(ref_t.config, text_sliding_window=6, text_rope_parameters=rope)), seed=33)
    start = tmp_path_factory.mktemp("official")
    official.save_pretrained(start)
    net, _ = load_network(start, model, torch.float32, "cpu")
    with torch.no_grad():  # a training step's worth of change
        net.model.layers[0].mlp.up_proj.weight.mul_(1.1)
    out = tmp_path_factory.mktemp("continued")
    save_network(net, out)
    raw = json.loads((out / "config.json").read_text())
    assert raw["model_type"] == "gemma4_assistant"
    assert raw["text_config"]["sliding_window"] == 6 and raw["text_config"]["rope_parameters"] == rope
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    drafter = load_mtp_drafter(out, model, torch.float32, "cpu")
    compare_drafts(ref_t, model, hf, drafter, 6, clustered=True)


def test_resaving_a_portable_folder_changes_nothing(target, tmp_path_factory):
    _, model = target
    first, second = tmp_path_factory.mktemp("first"), tmp_path_factory.mktemp("second")
    save_network(_fresh(model), first)
    net, _ = load_network(first, model, torch.float32, "cpu")
    save_network(net, second)
    assert json.loads((second / "config.json").read_text()) == json.loads((first / "config.json").read_text())


def _target_head(cfg):
    cfg.head = "target"


def _copy_gate(cfg):
    cfg.copy_gate = True


def _no_q_norm(cfg):
    cfg.q_norm = False


@pytest.mark.parametrize("change, reason", [
    (_target_head, "head 'target'"),
    (_copy_gate, "copy_gate"),
    (_no_q_norm, "q_norm false"),
], ids=["target-head", "copy-gate", "no-q-norm"])
def test_specdraft_only_settings_are_marked(target, tmp_path, change, reason):
    """Other engines refuse such a folder (an unknown model_type) rather than run a different
    network; specdraft loads it back and drafts exactly what it drafted before saving."""
    _, model = target
    cfg = drafter_config_for(model, hidden=32, layers=4, heads=4, clustered=True, num_centroids=8, top_k_clusters=2)
    change(cfg)
    net = init_network(cfg, model, seed=34, std=0.3)
    if net.copy_gate is not None:
        with torch.no_grad():
            net.copy_gate.proj.weight.normal_(0, 0.3, generator=torch.Generator().manual_seed(35))
    save_network(net, tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["model_type"] == "specdraft_mtp" and raw["architectures"] == ["SpecdraftMTPForCausalLM"]
    assert [r for r in raw["specdraft"]["specdraft_only"] if r.startswith(reason)]
    with pytest.raises(ValueError, match="specdraft_mtp"):
        transformers.AutoConfig.from_pretrained(tmp_path)
    _same_drafts(model, net, load_mtp_drafter(tmp_path, model, torch.float32, "cpu"))


def test_a_drafter_for_a_gemma3_target_is_marked_for_its_attention_scale(gemma_tiny, tmp_path):
    """Gemma 3 attends with query_pre_attn_scalar ** -0.5; a Gemma 4 assistant with scale 1."""
    model = gemma_tiny.ours
    save_network(init_network(drafter_config_for(model, hidden=32, layers=2, heads=4), model), tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["model_type"] == "specdraft_mtp"
    assert [r for r in raw["specdraft"]["specdraft_only"] if r.startswith("attention scale 0.25 ")]
    # Loaded without a target in between, then saved again: the reason stays.
    assert load_network(tmp_path, model, torch.float32, "cpu")[0].config.specdraft_only == \
        raw["specdraft"]["specdraft_only"]


def _same_drafts(model, net, loaded) -> None:
    from specdraft.drafters.mtp import MTPDrafter
    from specdraft.drafters.mtp.checkpoint import kv_sources

    original = MTPDrafter(net.eval(), model, kv_sources(net.config, model))
    ids = torch.randint(3, 250, (2, 12), generator=torch.Generator().manual_seed(36))
    cache = model.new_cache(2, 20)
    hidden = model(ids, cache)
    inp = DraftInput(ids[:, 11], hidden[:, 10], torch.full((2,), 10), cache, ids.new_zeros(2, 20),
                     torch.ones(2, dtype=torch.bool))
    a, b = (d.propose(inp, 3, SamplingParams(), None) for d in (original, loaded))
    assert a.tokens.tolist() == b.tokens.tolist()


@pytest.mark.usefixtures("float32_kv")  # float32 parity: summation order only
def test_drafter_trained_and_exported_for_gemma4_runs_in_transformers(target, tmp_path):
    """train-drafter's own path (self-distillation data from the target, a few optimizer steps,
    the bf16 export) with portable settings (head own, no copy gate): transformers opens the
    exported folder and drafts what specdraft drafts."""
    from gemma4_tiny import write_tokenizer
    from specdraft.runtime import Runtime
    from specdraft.training.data import DataConfig, build_dataset, load_sequences
    from specdraft.training.trainer import TrainConfig, Trainer

    ref_t, _ = target
    folder = tmp_path / "target"
    ref_t.save_pretrained(folder)
    write_tokenizer(folder, ref_t.config.vocab_size)
    rt = Runtime.load(str(folder), "float32", "cpu", weights="dtype", progress=False)
    words = ["hello", "world", "the", "a", "is", "of", "and", "to", "in", "it"]
    prompts = [" ".join(words[(i * 3 + j) % len(words)] for j in range(3 + i % 4)) for i in range(20)]
    data = DataConfig(max_new_tokens=12, batch_size=8, shard_prompts=16, topk=4, temperatures=(0.0,))
    train = load_sequences(build_dataset(rt, prompts[:16], tmp_path / "data" / "train", data))
    held = load_sequences(build_dataset(rt, prompts[16:], tmp_path / "data" / "held", data))
    cfg = drafter_config_for(rt.model, hidden=32, layers=4, heads=4, head="own", clustered=True, num_centroids=8,
                             top_k_clusters=2)
    settings = TrainConfig(steps=3, batch_size=4, anchors_per_seq=4, k_steps=2, lr=3e-3, warmup=1, eval_every=10**6,
                           save_every=10**6, shortlist_size=64, seed=0)
    trainer = Trainer(rt, tmp_path / "run", settings, cfg, train, held, log=lambda m: None)
    trainer.train()
    trainer.export(tmp_path / "drafter", {"test": True})
    raw = json.loads((tmp_path / "drafter" / "config.json").read_text())
    assert raw["model_type"] == "gemma4_assistant" and "specdraft_only" not in raw["specdraft"]
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "drafter", dtype=torch.float32,
                                                                 output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    drafter = load_mtp_drafter(tmp_path / "drafter", rt.model, torch.float32, "cpu")
    compare_drafts(ref_t, rt.model, hf.eval(), drafter, ref_t.config.sliding_window, clustered=True)
