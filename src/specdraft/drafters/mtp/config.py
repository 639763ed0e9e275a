"""MTP drafter configuration, stored as a Gemma 4 assistant config.json.

Official `*-it-assistant` checkpoints and the drafters specdraft trains share this layout
(model_type "gemma4_assistant", a nested gemma4_text `text_config`), so one loader reads both.
specdraft's own additions live under the "specdraft" key, which other readers ignore:
  head: "own" (the tied V x h table, as Gemma 4) or "target" (score with the target's own
        embedding table after post_projection: no extra V x h memory)
  recommended_k: the K the drafter was tuned for
  min_confidence: a row stops drafting after a draft the drafter gave less probability (0: never)
  copy_below: greedy drafting copies the text instead of a draft the drafter gave less
        probability, where the current token occurred before (0: never; drafter.py)
  copy_gate: the network has a learned copy gate (copy.py; tensors copy_gate.proj.*)
  sampling_top_k_clusters: clusters a sampled draft step keeps (default: as greedy,
        centroid_intermediate_top_k). Greedy drafts need only the clusters that hold the argmax;
        a sampled draft is accepted with chance sum(min(P, Q)), and Q is 0 outside its clusters.
  specdraft_only: why other engines cannot run this folder (written by the saver, see
        `specdraft_only_reasons`); such folders also carry model_type "specdraft_mtp".

The assistant's own `sliding_window`, `rope_parameters` and `max_position_embeddings` (in
text_config) are what its queries use, as in transformers' Gemma4AssistantForCausalLM; a
file that leaves one out (drafters written by older specdraft versions) takes the target's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from specdraft.config import FULL, SLIDING, RopeParams
from specdraft.errors import SpecdraftError
from specdraft.models.architectures.gemma4_config import head_shapes


# The keys under "specdraft" that MTPConfig reads; others are kept in `extra` and written back.
OWN_KEYS = ("head", "q_norm", "recommended_k", "min_confidence", "copy_below", "copy_gate", "sampling_top_k_clusters",
            "specdraft_only")
# model_type of the layout other engines read, and of folders only specdraft runs (other
# engines refuse an unknown model_type instead of running a network they would compute wrongly).
PORTABLE_MODEL_TYPE = "gemma4_assistant"
SPECDRAFT_MODEL_TYPE = "specdraft_mtp"


def _optional_int(value: Any) -> int | None:
    return None if value is None else int(value)


@dataclass
class MTPConfig:
    backbone_hidden_size: int  # H: the target's hidden size
    hidden_size: int  # h
    intermediate_size: int
    layer_types: list[str]
    num_heads: int
    head_dim: dict[str, int]  # per attention type (Gemma 4: head_dim sliding, global_head_dim full)
    num_kv_heads: dict[str, int]  # of the target layers read, per type (GQA grouping)
    vocab_size: int
    rms_norm_eps: float = 1e-6
    hidden_act: str = "gelu_pytorch_tanh"
    clustered: bool = False  # use_ordered_embeddings: the centroid ("efficient embedder") head
    num_centroids: int = 2048
    top_k_clusters: int = 32
    head: str = "own"  # "own" | "target"
    q_norm: bool = True
    recommended_k: int | None = None
    min_confidence: float = 0.0
    copy_below: float = 0.0
    copy_gate: bool = False
    sampling_top_k_clusters: int | None = None  # None: top_k_clusters
    # The assistant's own attention settings; None where the file does not state them (the
    # target's are used then). `rope_parameters` is kept as written, per layer type.
    sliding_window: int | None = None
    rope_parameters: dict[str, dict[str, Any]] | None = None
    max_position_embeddings: int | None = None
    # Set by the saver: what the network computes that other engines do not (empty: portable).
    specdraft_only: list[str] = field(default_factory=list)
    # The softmax scale of the target layers read, once known (checkpoint.kv_sources); not stored.
    attention_scale: float | None = field(default=None, compare=False)
    extra: dict[str, Any] = field(default_factory=dict)  # anything else under "specdraft"

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def cluster_size(self) -> int:
        return self.vocab_size // self.num_centroids

    def rope(self) -> dict[str, RopeParams] | None:
        """The stated RoPE per layer type (None: not stated; the target's applies)."""
        if self.rope_parameters is None:
            return None
        return {t: RopeParams.from_dict(d) for t, d in self.rope_parameters.items()}

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "MTPConfig":
        if raw.get("model_type") not in (PORTABLE_MODEL_TYPE, SPECDRAFT_MODEL_TYPE):
            raise SpecdraftError(
                f"drafter config has model_type {raw.get('model_type')!r}; expected 'gemma4_assistant'"
            )
        text = raw.get("text_config") or {}
        try:
            n = int(text["num_hidden_layers"])
            types = list(text.get("layer_types") or [FULL] * n)
            # Both spellings of per-type shapes (global_* fields, or transformers' per_layer_config);
            # specdraft's own files state num_global_key_value_heads without attention_k_eq_v.
            head_dim, kv = head_shapes(text, types, k_eq_v_gates_kv="attention_k_eq_v" in text)
            ours = raw.get("specdraft") or {}
            cfg = cls(
                backbone_hidden_size=int(raw["backbone_hidden_size"]),
                hidden_size=int(text["hidden_size"]),
                intermediate_size=int(text["intermediate_size"]),
                layer_types=types,
                num_heads=int(text["num_attention_heads"]),
                head_dim=head_dim,
                num_kv_heads=kv,
                vocab_size=int(text["vocab_size"]),
                rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
                hidden_act=text.get("hidden_activation") or text.get("hidden_act") or "gelu_pytorch_tanh",
                clustered=bool(raw.get("use_ordered_embeddings", False)),
                num_centroids=int(raw.get("num_centroids", 2048)),
                top_k_clusters=int(raw.get("centroid_intermediate_top_k", 32)),
                head=ours.get("head", "own"),
                q_norm=bool(ours.get("q_norm", True)),
                recommended_k=ours.get("recommended_k"),
                min_confidence=float(ours.get("min_confidence", 0.0)),
                copy_below=float(ours.get("copy_below", 0.0)),
                copy_gate=bool(ours.get("copy_gate", False)),
                sampling_top_k_clusters=_optional_int(ours.get("sampling_top_k_clusters")),
                sliding_window=_optional_int(text.get("sliding_window")),
                rope_parameters=_rope_parameters(text.get("rope_parameters")),
                max_position_embeddings=_optional_int(text.get("max_position_embeddings")),
                specdraft_only=list(ours.get("specdraft_only") or []),
                extra={k: v for k, v in ours.items() if k not in OWN_KEYS},
            )
            cfg.rope()  # an unsupported rope type is refused here, by name
        except (KeyError, TypeError, ValueError) as e:
            raise SpecdraftError(f"drafter config.json is missing or has a bad field: {e}") from None
        if len(types) != n:
            raise SpecdraftError(f"drafter layer_types has {len(types)} entries for {n} layers")
        if not 0 <= cfg.min_confidence < 1:
            raise SpecdraftError(f"drafter min_confidence must be in [0, 1), got {cfg.min_confidence}")
        if not 0 <= cfg.copy_below <= 1:
            raise SpecdraftError(f"drafter copy_below must be in [0, 1], got {cfg.copy_below}")
        if cfg.head not in ("own", "target"):
            raise SpecdraftError(f"drafter head must be 'own' or 'target', got {cfg.head!r}")
        sampled = cfg.sampling_top_k_clusters
        if cfg.clustered and sampled is not None and not 1 <= sampled <= cfg.num_centroids:
            raise SpecdraftError(f"drafter sampling_top_k_clusters must be in [1, num_centroids = {cfg.num_centroids}], "
                                 f"got {sampled}")
        if cfg.clustered and cfg.vocab_size % cfg.num_centroids:
            raise SpecdraftError(f"vocab size {cfg.vocab_size} is not divisible by num_centroids {cfg.num_centroids}")
        return cfg

    def to_dict(self) -> dict[str, Any]:
        """The Gemma 4 assistant config.json for this drafter: model_type "gemma4_assistant" when
        other engines compute the same network from it, "specdraft_mtp" (with the reasons under
        "specdraft") when `specdraft_only` is set."""
        sliding = self.layer_types and SLIDING in self.layer_types
        portable = not self.specdraft_only
        attention: dict[str, Any] = {}
        if self.sliding_window is not None:
            attention["sliding_window"] = self.sliding_window
        if self.rope_parameters is not None:
            attention["rope_parameters"] = self.rope_parameters
        if self.max_position_embeddings is not None:
            attention["max_position_embeddings"] = self.max_position_embeddings
        return {
            "model_type": PORTABLE_MODEL_TYPE if portable else SPECDRAFT_MODEL_TYPE,
            "architectures": ["Gemma4AssistantForCausalLM" if portable else "SpecdraftMTPForCausalLM"],
            "backbone_hidden_size": self.backbone_hidden_size,
            "use_ordered_embeddings": self.clustered,
            "num_centroids": self.num_centroids,
            "centroid_intermediate_top_k": self.top_k_clusters,
            "tie_word_embeddings": True,
            "text_config": {
                "model_type": "gemma4_text",
                "hidden_size": self.hidden_size,
                "intermediate_size": self.intermediate_size,
                "num_hidden_layers": self.num_layers,
                "layer_types": self.layer_types,
                "num_attention_heads": self.num_heads,
                "num_key_value_heads": self.num_kv_heads[SLIDING if sliding else FULL],
                "num_global_key_value_heads": self.num_kv_heads[FULL],
                # transformers reads num_global_key_value_heads only with this flag (harmless for a
                # drafter, which has no K/V projections).
                "attention_k_eq_v": self.num_kv_heads[FULL] != self.num_kv_heads[SLIDING if sliding else FULL],
                "head_dim": self.head_dim[SLIDING if sliding else FULL],
                "global_head_dim": self.head_dim[FULL],
                "vocab_size": self.vocab_size,
                "rms_norm_eps": self.rms_norm_eps,
                "hidden_activation": self.hidden_act,
                "num_kv_shared_layers": self.num_layers,
                "hidden_size_per_layer_input": 0,
                "vocab_size_per_layer_input": 0,
                "enable_moe_block": False,
                "use_double_wide_mlp": False,
                **attention,
            },
            "specdraft": {"head": self.head, "q_norm": self.q_norm, "recommended_k": self.recommended_k,
                          **({"min_confidence": self.min_confidence} if self.min_confidence else {}),
                          **({"copy_below": self.copy_below} if self.copy_below else {}),
                          **({"copy_gate": True} if self.copy_gate else {}),
                          **({"sampling_top_k_clusters": self.sampling_top_k_clusters}
                             if self.sampling_top_k_clusters is not None else {}),
                          **({"specdraft_only": self.specdraft_only} if self.specdraft_only else {}), **self.extra},
        }


def rope_dict(rope: RopeParams) -> dict[str, Any]:
    """`rope` as a config.json's rope_parameters entry (transformers' keys): what
    RopeParams.from_dict reads back to the same values."""
    out: dict[str, Any] = {"rope_type": rope.kind, "rope_theta": rope.theta}
    if rope.factor != 1.0 or rope.kind in ("linear", "llama3", "yarn"):
        out["factor"] = rope.factor
    if rope.partial != 1.0:
        out["partial_rotary_factor"] = rope.partial
    if rope.kind == "llama3":
        out.update(low_freq_factor=rope.low_freq_factor, high_freq_factor=rope.high_freq_factor)
    if rope.kind == "yarn":
        out.update(beta_fast=rope.beta_fast, beta_slow=rope.beta_slow)
        if rope.attention_factor is not None:
            out["attention_factor"] = rope.attention_factor
    if rope.original_max_position_embeddings is not None:
        out["original_max_position_embeddings"] = rope.original_max_position_embeddings
    return out


def _rope_parameters(value: Any) -> dict[str, dict[str, Any]] | None:
    """A text config's rope_parameters as {layer type: params}; one flat dict applies to both types."""
    if not value:
        return None
    if not isinstance(value, dict):
        raise TypeError(f"rope_parameters must be an object, got {type(value).__name__}")
    if all(isinstance(v, dict) for v in value.values()):
        return {str(k): dict(v) for k, v in value.items()}
    return {SLIDING: dict(value), FULL: dict(value)}
