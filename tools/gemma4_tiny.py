"""Tiny random Gemma 4 checkpoints (target + assistant), in the exact Hugging Face layout.

    python tools/gemma4_tiny.py OUT_DIR [--text-only] [--moe] [--dense-head] [--seed N]

writes OUT_DIR/target (Gemma4ForConditionalGeneration with tiny vision and audio towers, or
Gemma4ForCausalLM with --text-only; plus tokenizer.json / tokenizer_config.json) and
OUT_DIR/assistant (Gemma4AssistantForCausalLM with a random permutation `token_ordering`), both
through transformers' own `save_pretrained`. The target's weights are random but scaled so
logits are well separated, which keeps greedy comparisons meaningful; the assistant is wired to
the target's greedy continuations of "hello world" (plain and chat), so that prompt shows both
accepted and rejected drafts. Useful to try the CLI end to end without downloading anything:

    specdraft generate "hello world" --model OUT_DIR/target --drafter mtp \\
        --drafter-path OUT_DIR/assistant --dtype float32

The config builders are also what the Gemma 4 tests use (pytest puts tools/ on the path).
A tool, not part of the package: it needs `transformers` (the test extra), which specdraft
itself never imports.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

from specdraft.config import FULL, SLIDING
SPECIAL_TOKENS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
DEMO_PROMPTS = ["hello world"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }} {{ m['content'] }}<end_of_turn> "
    "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model {% endif %}"
)


def target_text_config(**overrides: Any):
    """A small Gemma4TextConfig with every Gemma 4 text feature except MoE switched on:
    PLE, KV sharing, double-wide MLP in shared layers, k_eq_v with its own KV head count and
    head_dim on full layers, proportional RoPE, final softcap. `overrides` replace fields."""
    from transformers import Gemma4TextConfig

    fields: dict[str, Any] = dict(
        vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=6,
        layer_types=[SLIDING, SLIDING, FULL, SLIDING, SLIDING, FULL],
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True,
        sliding_window=8, hidden_size_per_layer_input=16, vocab_size_per_layer_input=256,
        num_kv_shared_layers=2, use_double_wide_mlp=True, final_logit_softcapping=30.0,
        max_position_embeddings=1024, pad_token_id=0, eos_token_id=1, bos_token_id=2,
    )
    fields.update(overrides)
    return Gemma4TextConfig(**fields)


def moe_overrides() -> dict[str, Any]:
    """26B-A4B-style: a routed expert block beside the dense MLP, no PLE, no KV sharing."""
    return dict(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32,
                hidden_size_per_layer_input=0, vocab_size_per_layer_input=0, num_kv_shared_layers=0,
                use_double_wide_mlp=False)


def multimodal_config(text_config):
    """A Gemma4Config wrapping `text_config` with tiny vision and audio towers (token ids kept
    inside the tiny vocabulary)."""
    from transformers import Gemma4AudioConfig, Gemma4Config, Gemma4VisionConfig

    vision = Gemma4VisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                num_key_value_heads=2, head_dim=8, position_embedding_size=64)
    audio = Gemma4AudioConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                              subsampling_conv_channels=[8, 4], output_proj_dims=16)
    v = text_config.vocab_size
    return Gemma4Config(text_config=text_config, vision_config=vision, audio_config=audio,
                        image_token_id=v - 1, boi_token_id=v - 2, eoi_token_id=v - 3, video_token_id=v - 4,
                        audio_token_id=v - 5, boa_token_id=v - 6, eoa_token_index=v - 7)


def assistant_config(target, **overrides: Any):
    """A Gemma4AssistantConfig whose q-path fits `target` (a Gemma4TextConfig): head dims and
    KV heads of the layers it reads, same RoPE and window. `overrides` go to the assistant
    config (backbone_hidden_size, use_ordered_embeddings, ...) or, prefixed `text_`, to its
    text config."""
    from transformers import Gemma4AssistantConfig, Gemma4TextConfig

    text: dict[str, Any] = dict(
        vocab_size=target.vocab_size, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
        layer_types=[SLIDING, SLIDING, SLIDING, FULL], num_attention_heads=4,
        num_key_value_heads=_layer_attr(target, SLIDING, "num_key_value_heads"),
        head_dim=_layer_attr(target, SLIDING, "head_dim"),
        global_head_dim=_layer_attr(target, FULL, "head_dim"),
        num_global_key_value_heads=_layer_attr(target, FULL, "num_key_value_heads"),
        attention_k_eq_v=True, sliding_window=target.sliding_window, rope_parameters=target.rope_parameters,
        hidden_size_per_layer_input=0, vocab_size_per_layer_input=0,
        max_position_embeddings=target.max_position_embeddings,
    )
    top: dict[str, Any] = dict(backbone_hidden_size=target.hidden_size, use_ordered_embeddings=True,
                               num_centroids=8, centroid_intermediate_top_k=2)
    for key, value in overrides.items():
        if key.startswith("text_"):
            text[key[5:]] = value
        else:
            top[key] = value
    return Gemma4AssistantConfig(text_config=Gemma4TextConfig(**text), **top)


def _layer_attr(cfg, layer_type: str, name: str) -> int:
    """A per-layer attribute of the first `layer_type` layer (transformers 5 refuses global reads
    of attributes that vary by layer)."""
    return getattr(cfg.per_layer_config[cfg.layer_types.index(layer_type)], name)


def randomize_(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Weights ~ N(0, 1/fan_in), norm and scalar weights ~ 1 +- 0.3 (so w vs 1 + w matters),
    and a random permutation for any `token_ordering`."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if name.endswith("token_ordering"):
                t.copy_(torch.randperm(t.numel(), generator=gen))
            elif not t.is_floating_point() or t.ndim == 0 or "inv_freq" in name or name.endswith("embed_scale"):
                continue
            elif t.ndim == 1:
                t.copy_(1.0 + 0.3 * torch.randn(t.shape, generator=gen))
            else:
                t.copy_(torch.randn(t.shape, generator=gen) * t.shape[-1] ** -0.5)
    return model.eval()


def greedy_sequences(target: torch.nn.Module, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Each prompt followed by the target's own greedy continuation (transformers' generate)."""
    out = []
    with torch.no_grad():
        for ids in prompts:
            seq = target.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False,
                                  eos_token_id=None, pad_token_id=0)
            out.append(seq[0].tolist())
    return out


def follow_transitions_(assistant: torch.nn.Module, target: torch.nn.Module,
                        sequences: list[list[int]]) -> torch.nn.Module:
    """Hand-wire a random assistant to draft "after token a comes b" for the transitions seen
    in `sequences` (the most frequent b per a), so drafts are often right and sometimes wrong.

    The assistant then reads only the token embedding (pre_projection ignores the state), its
    attention adds nothing (o_proj zero) while its random MLPs make z a nonlinear feature of the
    token, and its tied table is the least-squares solution putting a logit of 10 on b for every
    seen a (exact while there are no more distinct a than hidden units); each centroid is the
    sum of its cluster's rows, so the right cluster scores highest. Still an ordinary
    Gemma4AssistantForCausalLM checkpoint.
    """
    text = assistant.config.get_text_config()
    h, vocab = text.hidden_size, text.vocab_size
    embed = target.get_input_embeddings()
    big = embed.weight.shape[1]
    counts: dict[int, dict[int, int]] = {}
    for seq in sequences:
        for a, b in zip(seq, seq[1:]):
            counts.setdefault(a, {}).setdefault(b, 0)
            counts[a][b] += 1
    src = torch.tensor(sorted(counts))
    dst = torch.tensor([max(counts[a], key=counts[a].get) for a in src.tolist()])
    gen = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        proj = torch.randn(h, big, generator=gen) * big**-0.5
        assistant.pre_projection.weight.copy_(torch.cat([proj, torch.zeros(h, big)], dim=1))
        x = torch.nn.functional.linear(embed(src), proj)
        for layer in assistant.model.layers:  # each layer as the assistant runs it, attention output 0
            layer.self_attn.o_proj.weight.zero_()
            x = x + layer.post_feedforward_layernorm(layer.mlp(layer.pre_feedforward_layernorm(x)))
            x = x * layer.layer_scalar
        z = assistant.model.norm(x)  # [m, h]
        wanted = torch.zeros(len(src), vocab).index_put_((torch.arange(len(src)), dst), torch.tensor(10.0))
        table = torch.linalg.lstsq(z, wanted).solution.T  # [V, h]: z @ table.T ~ wanted
        assistant.model.embed_tokens.weight.copy_(table)
        if assistant.masked_embedding is not None:
            me = assistant.masked_embedding
            me.centroids.weight.copy_(table[me.token_ordering.view(me.num_centroids, -1)].sum(1))
    return assistant


def write_tokenizer(folder: Path, vocab_size: int) -> None:
    """A WordLevel tokenizer.json over `vocab_size` ids (specials, letters, digits, a few words,
    then filler words w0, w1, ...) and a tokenizer_config.json with a small chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    words = SPECIAL_TOKENS + list("abcdefghijklmnopqrstuvwxyz0123456789.,!?") + [
        "hello", "world", "the", "a", "is", "of", "and", "to", "in", "it", "user", "model"]
    words += [f"w{i}" for i in range(vocab_size - len(words))]
    vocab = {w: i for i, w in enumerate(words[:vocab_size])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.add_special_tokens(SPECIAL_TOKENS)
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 2)])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>",
              "chat_template": CHAT_TEMPLATE, "tokenizer_class": "PreTrainedTokenizerFast"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def build(out_dir: Path, text_only: bool = False, moe: bool = False, dense_head: bool = False,
          seed: int = 0) -> tuple[Path, Path]:
    """Write OUT_DIR/target and OUT_DIR/assistant; returns both folders."""
    from transformers import Gemma4AssistantForCausalLM, Gemma4ForCausalLM, Gemma4ForConditionalGeneration

    text = target_text_config(**(moe_overrides() if moe else {}))
    target = Gemma4ForCausalLM(text) if text_only else Gemma4ForConditionalGeneration(multimodal_config(text))
    randomize_(target, seed)
    target_dir, assistant_dir = out_dir / "target", out_dir / "assistant"
    target.save_pretrained(target_dir)
    write_tokenizer(target_dir, text.vocab_size)
    # A random assistant would never be right; wire it to the target's continuations of a few
    # demo prompts so a run shows accepted and rejected drafts.
    from specdraft.tokenizer import Tokenizer

    tok = Tokenizer(target_dir)
    prompts = [tok.encode(p) for p in DEMO_PROMPTS] + [tok.encode_prompt(p, chat=True) for p in DEMO_PROMPTS]
    assistant = Gemma4AssistantForCausalLM(assistant_config(text, use_ordered_embeddings=not dense_head))
    follow_transitions_(randomize_(assistant, seed + 1), target, greedy_sequences(target, prompts, 64))
    assistant.save_pretrained(assistant_dir)
    return target_dir, assistant_dir


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python tools/gemma4_tiny.py",
                                description="Write tiny random Gemma 4 target + assistant checkpoints (HF layout).")
    p.add_argument("out_dir", type=Path)
    p.add_argument("--text-only", action="store_true", help="Gemma4ForCausalLM instead of the multimodal wrapper")
    p.add_argument("--moe", action="store_true", help="26B-A4B-style mixture-of-experts target (no PLE)")
    p.add_argument("--dense-head", action="store_true", help="assistant without the clustered head")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    try:
        import transformers  # noqa: F401
    except ImportError:
        print("gemma4_tiny needs transformers: pip install 'specdraft[test]'", file=sys.stderr)
        return 2
    target_dir, assistant_dir = build(args.out_dir, args.text_only, args.moe, args.dense_head, args.seed)
    print(f"target:    {target_dir}\nassistant: {assistant_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
