"""Loading and saving MTP drafters (Gemma 4 assistant layout), checked against their target.

A drafter path is a folder (config.json + safetensors) or a llama.cpp `gemma4-assistant` GGUF
(run from its own blocks beside a target on the C kernels, drafters/mtp/gguf.py; beside a float
target its weights are dequantised in memory, loading/gguf_file.py). `check_drafter_fits` compares a
drafter with a target from their configs alone, before either one's weights are read.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

from specdraft.config import FULL, SLIDING, RopeParams
from specdraft.drafters.mtp.config import MTPConfig, rope_dict
from specdraft.drafters.mtp.drafter import MTPDrafter
from specdraft.drafters.mtp.head import checked_token_ordering
from specdraft.drafters.mtp.network import MTPNetwork, kernels_like_target
from specdraft.errors import SpecdraftError
from specdraft.drafters.mtp.source import kv_source
from specdraft.models.architectures.rope import RopeTable
from specdraft.models.architectures.target import AttentionLayout
from specdraft.loading.weights import read_safetensors, safetensors_files

# Reasons a folder is specdraft-only (config.specdraft_only), each naming the setting.
ATTENTION_SCALE_REASON = "attention scale"


def kv_sources(cfg: MTPConfig, target: torch.nn.Module) -> list[AttentionLayout]:
    """The target layer each drafter layer reads, after checking the drafter fits it, with the
    drafter's own RoPE and sliding window where its config states them (`own_attention`).

    Mismatches are refused by name: a drafter trained for another target would otherwise run
    and silently draft garbage (still lossless, but slow). Records the softmax scale of the
    layers read in `cfg.attention_scale` (the saver's portability check needs it).
    """
    tc = target.config
    problems = []
    if cfg.backbone_hidden_size != tc.hidden_size:
        problems.append(f"backbone_hidden_size {cfg.backbone_hidden_size} != target hidden size {tc.hidden_size}")
    if cfg.vocab_size != tc.vocab_size:
        problems.append(f"vocabulary {cfg.vocab_size} != target vocabulary {tc.vocab_size}")
    sources = []
    for i, layer_type in enumerate(cfg.layer_types):
        src = kv_source(target, layer_type)
        sources.append(src)
        wanted = layer_type if layer_type in (SLIDING, FULL) else FULL
        if cfg.head_dim[wanted] != src.head_dim:
            problems.append(f"layer {i} ({layer_type}) head_dim {cfg.head_dim[wanted]} != target layer "
                            f"{src.layer} head_dim {src.head_dim}")
        if cfg.num_kv_heads[wanted] != src.num_kv_heads:
            problems.append(f"layer {i} ({layer_type}) KV heads {cfg.num_kv_heads[wanted]} != target layer "
                            f"{src.layer} KV heads {src.num_kv_heads}")
        if cfg.num_heads % src.num_kv_heads:
            problems.append(f"{cfg.num_heads} query heads are not a multiple of the target's {src.num_kv_heads} KV heads")
    if problems:
        raise SpecdraftError("drafter does not fit this target: " + "; ".join(dict.fromkeys(problems)))
    cfg.attention_scale = sources[0].scale if len({s.scale for s in sources}) == 1 else None
    return own_attention(cfg, sources, target.config.max_position_embeddings)


def own_attention(cfg: MTPConfig, sources: list[AttentionLayout], target_max_positions: int) -> list[AttentionLayout]:
    """`sources` with the drafter's stated RoPE and window for its layers' queries, as
    transformers' Gemma4AssistantForCausalLM computes them from its own text_config; the target's
    where the drafter's config is silent. Equal settings keep the target's RoPE table (one
    cos/sin table in memory, not two)."""
    rope = cfg.rope()
    max_positions = cfg.max_position_embeddings or target_max_positions
    tables: dict[str, RopeTable] = {}  # per layer type
    out = []
    for layer_type, src in zip(cfg.layer_types, sources):
        kind = layer_type if layer_type in (SLIDING, FULL) else FULL
        table = src.rope
        if rope is not None and kind in rope:
            if kind not in tables:
                same = _same_rope(src.rope, rope[kind], src.head_dim, max_positions)
                tables[kind] = src.rope if same else RopeTable(rope[kind], cfg.head_dim[kind], max_positions)
            table = tables[kind]
        window = src.window
        if kind == SLIDING and cfg.sliding_window is not None:
            window = cfg.sliding_window
        out.append(dataclasses.replace(src, rope=table, window=window))
    return out


def _same_rope(table: RopeTable, params: RopeParams, head_dim: int, max_positions: int) -> bool:
    """Whether `params` give exactly `table`'s frequencies (then the table is shared)."""
    from specdraft.models.architectures.rope import inverse_frequencies

    inv, scaling = inverse_frequencies(params, head_dim, max_positions)
    return scaling == table.scaling and inv.shape == table.inv_freq.shape and bool(torch.equal(inv, table.inv_freq))


def read_drafter_config(folder: Path) -> MTPConfig:
    """A drafter's config from its folder's config.json, or from a gemma4-assistant GGUF's header."""
    if folder.is_file() and folder.suffix == ".gguf":
        from specdraft.loading.gguf_description import assistant_config_dict

        return MTPConfig.from_dict(assistant_config_dict(folder))
    path = folder / "config.json"
    if not path.exists():
        raise SpecdraftError(f"{folder}: no config.json (expected an MTP drafter folder or a gemma4-assistant GGUF)")
    try:
        return MTPConfig.from_dict(json.loads(path.read_text()))
    except json.JSONDecodeError as e:
        raise SpecdraftError(f"{path}: invalid JSON ({e})") from None


def check_drafter_fits(drafter: Path, target: str | Path) -> MTPConfig:
    """Refuse a drafter that does not fit a target, from the two configs alone: no weights of
    either are read, so a mismatched pair fails in a second, before a large target loads.

    `drafter`: a drafter folder or a gemma4-assistant GGUF. `target`: what the target is loaded
    from (a preset name, a Hugging Face folder or a .gguf file; only its config or header is
    read). Raises a one-line SpecdraftError naming every mismatch (the same checks `kv_sources`
    makes at load); returns the drafter's config."""
    from specdraft.loading import build_model
    from specdraft.loading.presets import model_config_dict
    from specdraft.models.architectures.hf_config import read_model_config

    drafter = Path(drafter).expanduser()
    if not drafter.exists():
        raise SpecdraftError(f"drafter path {drafter} does not exist")
    cfg = read_drafter_config(drafter)
    target_cfg = read_model_config(model_config_dict(str(target)))
    with torch.device("meta"):  # the module tree only: shapes and RoPE settings, no weights
        model = build_model(target_cfg)
    kv_sources(cfg, model)
    return cfg


def _drafter_folder(path: Path) -> Path:
    if not path.is_dir():
        raise SpecdraftError(f"drafter path {path} is not a folder or a .gguf file")
    return path


def load_network(folder: Path, target: torch.nn.Module, dtype: torch.dtype, device) -> tuple[MTPNetwork, list[AttentionLayout]]:
    """A drafter's network from a folder, or from a gemma4-assistant GGUF read in memory (no
    converted folder)."""
    folder = Path(folder).expanduser()
    gguf = folder.is_file() and folder.suffix == ".gguf"
    if not gguf:
        folder = _drafter_folder(folder)
    cfg = read_drafter_config(folder)
    sources = kv_sources(cfg, target)
    if gguf:
        from specdraft.loading.gguf_description import assistant_state

        state = assistant_state(folder)
    else:
        state = read_safetensors(safetensors_files(folder))
    state.pop("lm_head.weight", None)  # tied to model.embed_tokens
    if "masked_embedding.token_ordering" in state:  # before the shape check: its dtype is checked too
        try:
            state["masked_embedding.token_ordering"] = checked_token_ordering(state["masked_embedding.token_ordering"],
                                                                              cfg.vocab_size)
        except ValueError as e:
            raise SpecdraftError(f"{folder}: {e}") from None
    with torch.device("meta"):
        net = MTPNetwork(cfg)
    expected = dict(net.named_parameters()) | dict(net.named_buffers())
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise SpecdraftError(f"{folder}: drafter weights do not match its config.json "
                             f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
    for name, t in expected.items():
        if tuple(state[name].shape) != tuple(t.shape):
            raise SpecdraftError(f"{folder}: tensor {name} has shape {tuple(state[name].shape)}, config implies {tuple(t.shape)}")
    converted = {n: (v.to(device) if not v.is_floating_point() else v.to(device=device, dtype=dtype)) for n, v in state.items()}
    net.load_state_dict(converted, strict=True, assign=True)
    return net.eval().requires_grad_(False), sources


def load_mtp_drafter(folder: Path, target: torch.nn.Module, dtype: torch.dtype, device) -> MTPDrafter:
    """A drafter from a folder or a gemma4-assistant GGUF, checked against `target`. A GGUF runs
    from its own blocks beside a target on the C kernels (drafters/mtp/gguf.py)."""
    from specdraft.drafters.mtp.gguf import load_gguf_network, loads_from_blocks

    folder = Path(folder).expanduser()
    if loads_from_blocks(folder, target, dtype, device):
        cfg = read_drafter_config(folder)
        sources = kv_sources(cfg, target)  # refused before the memory check and any weight
        net = load_gguf_network(folder, cfg)
    else:
        net, sources = load_network(folder, target, dtype, device)
    kernels_like_target(net, target)
    return MTPDrafter(net, target, sources)


def specdraft_only_reasons(cfg: MTPConfig) -> list[str]:
    """What in this drafter other engines (transformers' Gemma4AssistantForCausalLM, vLLM, SGLang,
    llama.cpp) do not compute, so that they would draft differently or not load it; empty for a
    folder they run as specdraft does. Inference hints (recommended_k, min_confidence, copy_below,
    sampling_top_k_clusters) change no network output and keep a folder portable."""
    reasons = []
    if cfg.head == "target":
        reasons.append("head 'target' (scores against the target's embedding table; others use the drafter's own "
                       "tied table model.embed_tokens)")
    if cfg.copy_gate:
        reasons.append("copy_gate (a learned copy gate, tensors copy_gate.proj.*)")
    if not cfg.q_norm:
        reasons.append("q_norm false (others always RMS-normalise the drafter's queries)")
    if cfg.attention_scale is not None and cfg.attention_scale != 1.0:
        reasons.append(f"{ATTENTION_SCALE_REASON} {cfg.attention_scale:g} of the target layers it reads (a Gemma 4 "
                       "assistant attends with scale 1, as Gemma 4 targets do)")
    elif cfg.attention_scale is None:  # not measured against a target here: keep what the file said
        reasons += [r for r in cfg.specdraft_only if r.startswith(ATTENTION_SCALE_REASON)]
    return reasons


def save_network(net: MTPNetwork, folder: Path) -> None:
    """config.json + model.safetensors. A drafter other engines cannot run as specdraft does
    (`specdraft_only_reasons`) is written with model_type "specdraft_mtp" and the reasons in
    config.json, so that they refuse it rather than compute something else; a portable one keeps
    the Gemma 4 assistant layout (model_type "gemma4_assistant") and loads in them as is."""
    folder.mkdir(parents=True, exist_ok=True)
    net.config.specdraft_only = specdraft_only_reasons(net.config)
    (folder / "config.json").write_text(json.dumps(net.config.to_dict(), indent=2) + "\n")
    state = {n: t.detach().contiguous().cpu() for n, t in net.state_dict().items()}
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})


# Defaults for a drafter's own shape (what `train-drafter` / `init-drafter` use when the user
# gives none). On Gemma 3 270M (1 KV head, V = 262144) they give the shipped drafter's shape.
DEFAULT_HIDDEN = 384
DEFAULT_LAYERS = 2
MIN_DEFAULT_HEADS = 4
DEFAULT_TOP_K_CLUSTERS = 32
CLUSTER_TOKENS = 128  # tokens per cluster of the default clustered head (as Gemma 4 E2B/E4B)


def default_layer_types(target: torch.nn.Module, layers: int) -> list[str]:
    """Gemma 4 pattern: sliding layers first, a full layer last (all full for all-full targets)."""
    if SLIDING in target.config.layer_types:
        return [SLIDING] * (layers - 1) + [FULL]
    return [FULL] * layers


def kv_head_group(target: torch.nn.Module, layer_types: list[str]) -> int:
    """Drafter query heads must be a multiple of this: the least common multiple of the KV-head
    counts of the target layers the drafter's layers read (GQA grouping)."""
    return math.lcm(*(kv_source(target, t).num_kv_heads for t in dict.fromkeys(layer_types)))


def default_heads(group: int) -> int:
    """The smallest multiple of the KV-head group that is at least MIN_DEFAULT_HEADS (4 for a
    1-KV-head Gemma 3 target, 6 for SmolLM2's 3 KV heads, 8 for a Llama with 8)."""
    return -(-MIN_DEFAULT_HEADS // group) * group


def nearest_head_counts(heads: int, group: int) -> list[int]:
    """Valid head counts next to `heads` (the multiples of `group` either side), for messages."""
    below = heads // group * group
    return [n for n in (below, below + group) if n >= 1]


def default_clusters(vocab: int) -> int:
    """Clusters of the default head: V/128 when V is a multiple of 128 and at least 4096, else
    0 (a dense head: small vocabularies gain nothing from clustering)."""
    return vocab // CLUSTER_TOKENS if vocab % CLUSTER_TOKENS == 0 and vocab >= 32 * CLUSTER_TOKENS else 0


def cluster_count_near(vocab: int) -> int:
    """A cluster count that divides `vocab`, closest to V/128 (at least 2); 0 if only 1 and V do
    (then a dense head is the choice). For messages suggesting a valid --clusters."""
    want = max(2, vocab // CLUSTER_TOKENS)
    divisors = {d for i in range(1, math.isqrt(vocab) + 1) if vocab % i == 0 for d in (i, vocab // i)}
    divisors -= {1, vocab}
    return min(divisors, key=lambda d: (abs(d - want), d)) if divisors else 0


def default_top_k_clusters(clusters: int) -> int:
    """Clusters kept per draft step: 32, but never more than an eighth of them (32 is stored,
    unused, for a dense head)."""
    return min(DEFAULT_TOP_K_CLUSTERS, max(1, clusters // 8)) if clusters > 0 else DEFAULT_TOP_K_CLUSTERS


def drafter_config_for(target: torch.nn.Module, hidden: int = 256, layers: int = 2, heads: int | None = None,
                       intermediate: int | None = None, layer_types: list[str] | None = None,
                       head: str = "own", clustered: bool = False, num_centroids: int | None = None,
                       top_k_clusters: int = 32, recommended_k: int | None = None) -> MTPConfig:
    """A drafter config whose q-path fits `target` (head dims, KV heads from the layers it reads).

    `heads` defaults to `default_heads` for the target's KV-head grouping."""
    tc = target.config
    if layer_types is None:
        layer_types = default_layer_types(target, layers)
    head_dim, kv = {}, {}
    for t in (SLIDING, FULL):
        src = kv_source(target, t)
        head_dim[t], kv[t] = src.head_dim, src.num_kv_heads
    group = kv_head_group(target, layer_types)
    if heads is None:
        heads = default_heads(group)
    if heads < 1 or heads % group:
        raise SpecdraftError(f"drafter heads ({heads}) must be a multiple of the target's {group} KV heads (try "
                             + " or ".join(map(str, nearest_head_counts(max(heads, 1), group))) + ")")
    if clustered and num_centroids is None:
        num_centroids = tc.vocab_size // 128 if tc.vocab_size % 128 == 0 else None
        if num_centroids is None:
            raise SpecdraftError(f"vocabulary {tc.vocab_size} is not a multiple of 128; pass --clusters C dividing it")
    # The attention settings its queries use, stated where other engines could run the drafter
    # (a target attending with scale 1, as Gemma 4), so that they read the same ones; elsewhere
    # the config stays silent and the target's apply, as in drafters written before.
    sources = {t: kv_source(target, t) for t in dict.fromkeys(layer_types)}
    scales = {s.scale for s in sources.values()}
    stated = scales == {1.0}
    rope = {t: rope_dict(tc.rope[t]) for t in (SLIDING, FULL) if t in tc.rope} if stated else {}
    window = next((s.window for s in sources.values() if s.window is not None), tc.sliding_window)
    return MTPConfig(
        backbone_hidden_size=tc.hidden_size, hidden_size=hidden, intermediate_size=intermediate or 4 * hidden,
        layer_types=layer_types, num_heads=heads, head_dim=head_dim, num_kv_heads=kv, vocab_size=tc.vocab_size,
        rms_norm_eps=tc.rms_norm_eps, clustered=clustered, num_centroids=num_centroids or 1,
        top_k_clusters=top_k_clusters, head=head, q_norm=kv_source(target, FULL).q_norm,
        recommended_k=recommended_k, sliding_window=window if stated else None, rope_parameters=rope or None,
        max_position_embeddings=tc.max_position_embeddings if stated else None,
        attention_scale=scales.pop() if len(scales) == 1 else None,
    )


def init_network(cfg: MTPConfig, target: torch.nn.Module, seed: int = 0, std: float = 0.02) -> MTPNetwork:
    """Random weights (float32, CPU): the starting point of training, and a worst-case drafter for tests."""
    gen = torch.Generator().manual_seed(seed)
    net = MTPNetwork(cfg)
    for name, p in net.named_parameters():
        if name.endswith("norm.weight") or name.startswith("copy_gate."):
            continue  # ones; the copy gate starts closed (zeros)
        with torch.no_grad():
            p.copy_(torch.randn(p.shape, generator=gen) * std)
    if net.masked_embedding is not None:
        order = torch.randperm(cfg.vocab_size, generator=gen)
        net.masked_embedding.token_ordering.copy_(order)
    return net
