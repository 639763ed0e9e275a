"""Self-distillation data: the target answers the training prompts, and one teacher-forced pass
over each answer records what the drafter trains on.

Per token of every sequence (prompt + answer) a shard stores the target's final-normed hidden
state, the K/V of the target layers drafters read, and for answer positions the target's top-k
next-token log-probabilities. Shards are safetensors files written one by one, so an
interrupted run resumes at the first missing shard.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from specdraft.config import FULL, SLIDING
from specdraft.sampling import SamplingParams
from specdraft.training.prompts import BASE_TEMPLATE, format_prompt


@dataclass
class DataConfig:
    max_new_tokens: int = 160
    max_prompt_tokens: int = 256
    batch_size: int = 16
    shard_prompts: int = 64
    topk: int = 8
    # Answers are a mix of greedy and sampled decoding, so the drafter sees the target's
    # modes and its spread; batches cycle through these temperatures (0 = greedy).
    temperatures: tuple[float, ...] = (0.0, 0.0, 0.7, 1.0)
    seed: int = 0


def read_slots(model: torch.nn.Module) -> list[int]:
    """Cache slots any drafter layer may read (last sliding and last full layer)."""
    return sorted({model.drafter_source(t).slot for t in (SLIDING, FULL)})


def _encode(tokenizer, prompts: list[str], max_prompt_tokens: int) -> list[list[int]]:
    """Token ids; base models get the plain text for half the prompts and the Q/A template for
    the other half, so the drafter sees both ways people prompt a base model."""
    out = []
    for i, p in enumerate(prompts):
        ids = format_prompt(tokenizer, p, BASE_TEMPLATE if i % 2 else None)
        out.append(ids if len(ids) <= max_prompt_tokens else [])
    return out


def generate_answers(engine, prompt_ids: list[list[int]], cfg: DataConfig, shard: int) -> list[tuple[list[int], list[int], float]]:
    """(prompt ids, answer ids, temperature) for each non-empty prompt, in batches."""
    todo = [p for p in prompt_ids if p]
    out = []
    for b, start in enumerate(range(0, len(todo), cfg.batch_size)):
        batch = todo[start : start + cfg.batch_size]
        temp = cfg.temperatures[(shard + b) % len(cfg.temperatures)]
        params = SamplingParams(temperature=temp, seed=cfg.seed * 1_000_003 + shard * 1000 + b)
        for p, r in zip(batch, engine.generate(batch, cfg.max_new_tokens, params)):
            out.append((p, r.token_ids, temp))
    return out


@torch.inference_mode()
def teacher_forced_features(model: torch.nn.Module, seqs: list[tuple[list[int], list[int], float]],
                            slots: list[int], topk: int) -> dict[str, torch.Tensor]:
    """Run the target over whole sequences and flatten what training needs into one shard."""
    tensors: dict[str, list[torch.Tensor]] = {k: [] for k in ["tokens", "hidden", "topk_ids", "topk_logp"]}
    for s in slots:
        tensors[f"k.{s}"], tensors[f"v.{s}"] = [], []
    offsets, prompt_lens, temps = [0], [], []
    for prompt, answer, temp in seqs:
        ids = torch.tensor(prompt + answer)[None]
        cache = model.new_cache(1, ids.shape[1] + 1)
        hidden = model(ids, cache)[0]
        start = len(prompt) - 1  # the first position whose prediction is part of the answer
        logp = torch.log_softmax(model.logits(hidden[start:]), dim=-1)
        top = torch.topk(logp, topk, dim=-1)
        top_ids = torch.zeros(ids.shape[1], topk, dtype=torch.int32)
        top_logp = torch.full((ids.shape[1], topk), float("-inf"))
        top_ids[start:], top_logp[start:] = top.indices.int(), top.values.float()
        tensors["tokens"].append(ids[0].int())
        tensors["hidden"].append(hidden.cpu())
        tensors["topk_ids"].append(top_ids)
        tensors["topk_logp"].append(top_logp)
        for s in slots:
            # [1, Hkv, L, D] -> [L, Hkv * D]: one row per position.
            for name, store in (("k", cache.k), ("v", cache.v)):
                kv = store[s][0, :, : ids.shape[1]].transpose(0, 1).reshape(ids.shape[1], -1)
                tensors[f"{name}.{s}"].append(kv.cpu())
        offsets.append(offsets[-1] + ids.shape[1])
        prompt_lens.append(len(prompt))
        temps.append(temp)
    out = {k: torch.cat(v).contiguous() for k, v in tensors.items()}
    out["offsets"] = torch.tensor(offsets, dtype=torch.long)
    out["prompt_lengths"] = torch.tensor(prompt_lens, dtype=torch.long)
    out["temperatures"] = torch.tensor(temps, dtype=torch.float32)
    return out


def build_dataset(rt, prompts: list[str], out_dir: Path, cfg: DataConfig, desc: str = "self-distillation data") -> list[Path]:
    """Write shard-NNNNN.safetensors files into out_dir, skipping shards that already exist."""
    out_dir.mkdir(parents=True, exist_ok=True)
    meta_path = out_dir / "data.json"
    # Shard i always holds prompts[i * shard_prompts:...], so the prompt count may change between
    # runs (more prompts = more shards); the generation settings may not.
    meta = {"model": rt.name, "dtype": rt.dtype_name, **asdict(cfg)}
    if meta_path.exists():
        old = json.loads(meta_path.read_text())
        if old != json.loads(json.dumps(meta)):
            raise_mismatch(meta_path, old, meta)
    meta_path.write_text(json.dumps(meta, indent=2))
    engine = rt.engine()
    slots = read_slots(rt.model)
    shards = []
    n_shards = (len(prompts) + cfg.shard_prompts - 1) // cfg.shard_prompts
    with tqdm(total=len(prompts), desc=desc, unit="prompt") as bar:
        for shard in range(n_shards):
            path = out_dir / f"shard-{shard:05d}.safetensors"
            chunk = prompts[shard * cfg.shard_prompts : (shard + 1) * cfg.shard_prompts]
            if not path.exists():
                seqs = generate_answers(engine, _encode(rt.tokenizer, chunk, cfg.max_prompt_tokens), cfg, shard)
                if seqs:
                    feats = teacher_forced_features(rt.model, seqs, slots, cfg.topk)
                    tmp = path.with_suffix(".tmp")
                    save_file(feats, str(tmp), metadata={"slots": json.dumps(slots)})
                    tmp.rename(path)
            if path.exists():
                shards.append(path)
            bar.update(len(chunk))
    return shards


def raise_mismatch(path: Path, old: dict, new: dict) -> None:
    from specdraft.errors import SpecdraftError

    diff = {k: (old.get(k), new.get(k)) for k in set(old) | set(new) if old.get(k) != new.get(k)}
    raise SpecdraftError(f"{path} was written with other settings {diff}; use a new --out folder or the same settings")


@dataclass
class Sequence:
    tokens: torch.Tensor  # [L] long
    prompt_length: int
    temperature: float
    hidden: torch.Tensor  # [L, H]
    keys: dict[int, torch.Tensor]  # slot -> [L, Hkv * D]
    values: dict[int, torch.Tensor]
    topk_ids: torch.Tensor  # [L, k]
    topk_logp: torch.Tensor  # [L, k]


def load_sequences(shards: list[Path]) -> list[Sequence]:
    seqs = []
    for path in shards:
        with safe_open(str(path), framework="pt") as f:
            slots = json.loads(f.metadata()["slots"])
            t = {k: f.get_tensor(k) for k in f.keys()}
        off = t["offsets"].tolist()
        for i in range(len(off) - 1):
            a, b = off[i], off[i + 1]
            seqs.append(Sequence(
                tokens=t["tokens"][a:b].long(), prompt_length=int(t["prompt_lengths"][i]),
                temperature=float(t["temperatures"][i]), hidden=t["hidden"][a:b],
                keys={s: t[f"k.{s}"][a:b] for s in slots}, values={s: t[f"v.{s}"][a:b] for s in slots},
                topk_ids=t["topk_ids"][a:b].long(), topk_logp=t["topk_logp"][a:b],
            ))
    return seqs
