"""Self-distillation data: the target answers the training prompts, and one teacher-forced pass
over each answer records what the drafter trains on.

Per token of every sequence (prompt + answer) a shard stores the target's final-normed hidden
state, the K/V of the target layers drafters read, and for answer positions the target's top-k
next-token log-probabilities, all recorded while the target generates (no second pass). Shards are safetensors files written one by one, each
atomically and listed in the folder's manifest, so an interrupted run resumes at the first
missing shard and never trusts a shard cut short.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from specdraft.config import FULL, SLIDING
from specdraft.drafters.mtp.source import kv_source
from specdraft.models.kernels.sample_rows import draw_tokens
from specdraft.models.kernels.truncated_probs import truncated_probabilities
from specdraft.sampling import SamplingParams
from specdraft.training import durable
from specdraft.training.labels import top_log_probs
from specdraft.training.prompts import BASE_TEMPLATE, format_prompt


@dataclass
class DataConfig:
    max_new_tokens: int = 160
    max_prompt_tokens: int = 256  # longer prompts are left out (--max-prompt-tokens)
    batch_size: int = 32
    shard_prompts: int = 64
    topk: int = 8
    # Answers are a mix of greedy and sampled decoding, so the drafter sees the target's
    # modes and its spread; batches cycle through these temperatures (0 = greedy).
    temperatures: tuple[float, ...] = (0.0, 0.0, 0.7, 1.0)
    # Sampled answers keep the smallest set of tokens holding this much probability (1 = all), as a
    # chat client's top-p does: a drafter for a chat model then learns the replies its users see.
    top_p: float = 1.0
    seed: int = 0
    first_prompt: int = 0  # where in the training prompts these answers start (--skip-prompts)


def read_slots(model: torch.nn.Module) -> list[int]:
    """Cache slots any drafter layer may read (last sliding and last full layer)."""
    return sorted({kv_source(model, t).slot for t in (SLIDING, FULL)})


def _encode(tokenizer, prompts: list[str], max_prompt_tokens: int) -> list[list[int]]:
    """Token ids; base models get the plain text for half the prompts and the Q/A template for
    the other half, so the drafter sees both ways people prompt a base model."""
    out = []
    for i, p in enumerate(prompts):
        ids = format_prompt(tokenizer, p, BASE_TEMPLATE if i % 2 else None)
        out.append(ids if len(ids) <= max_prompt_tokens else [])
    return out


@torch.inference_mode()
def record_answers(model: torch.nn.Module, prompts: list[list[int]], max_new_tokens: int, temperature: float,
                   seed: int, slots: list[int], topk: int, eos: set[int],
                   top_p: float = 1.0) -> list[dict[str, torch.Tensor]]:
    """Plain batched decoding that keeps what the drafter will see at inference time.

    Prompt positions get their hidden states from the prefill, answer positions from the
    one-token decode steps (as a verify pass would produce them); the K/V of every position are
    read from the cache at the end. Nothing is recomputed in a second pass.

    Greedy answers are the float32 model's own (its logits, not the bf16 label head of corpus
    text: that one moved 10 of 32 greedy answers within 48 tokens for a 1.06x faster step).
    Sampled rows draw by the inverse CDF (sampling.sample): torch.multinomial over 262k tokens
    took 229 ms a step at 32 rows, and sampled batches now generate 1.5x faster.
    """
    b = len(prompts)
    device = model.embed_tokens.weight.device  # the records are written from the CPU; the work runs here
    gen = torch.Generator(device).manual_seed(seed)
    lengths = torch.tensor([len(p) for p in prompts])
    width = int(lengths.max())
    cache = model.new_cache(b, width + max_new_tokens + 1)
    tokens = torch.zeros(b, width, dtype=torch.long)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = torch.tensor(p)
    hidden = model(tokens.to(device), cache)
    cache.rollback(lengths)
    prompt_hidden = hidden.cpu()
    last = hidden[torch.arange(b, device=device), lengths.to(device) - 1]
    stops = torch.tensor(sorted(eos), dtype=torch.long, device=device)
    steps_hidden, steps_ids, steps_logp, answer = [], [], [], []
    alive = torch.ones(b, dtype=torch.bool, device=device)
    for _ in range(max_new_tokens):
        logits = model.logits(last)
        top_ids, top_logp = top_log_probs(logits, topk)
        steps_ids.append(top_ids)
        steps_logp.append(top_logp)
        if temperature == 0:
            nxt = top_ids[:, 0]
        elif top_p < 1.0:
            nxt = draw_tokens(truncated_probabilities(logits, SamplingParams(temperature, top_p=top_p)), gen)
        else:
            nxt = draw_tokens(torch.softmax(logits / temperature, dim=-1), gen)
        answer.append(torch.where(alive, nxt, -1))
        alive &= ~torch.isin(nxt, stops)
        if not alive.any():
            break
        last = model(nxt[:, None], cache)[:, 0]
        steps_hidden.append(last)
    out = []
    answers = torch.stack(answer, 1).cpu()
    steps_hidden = [h.cpu() for h in steps_hidden]
    steps_ids, steps_logp = [t.cpu() for t in steps_ids], [t.cpu() for t in steps_logp]
    for i in range(b):
        n_ans = int((answers[i] >= 0).sum())  # tokens emitted, EOS included
        p = int(lengths[i])
        n = p + n_ans
        # Hidden at answer positions p .. n-1 come from the decode steps (the last token's
        # hidden is never computed when the row stops there; the drafter never needs it).
        h_ans = torch.stack([h[i] for h in steps_hidden[: n_ans - 1]]) if n_ans > 1 else prompt_hidden.new_zeros(0, prompt_hidden.shape[2])
        hid = torch.cat([prompt_hidden[i, :p], h_ans, prompt_hidden.new_zeros(1, prompt_hidden.shape[2])])
        ids = torch.zeros(n, topk, dtype=torch.int32)
        lp = torch.full((n, topk), float("-inf"))
        # The prediction made at position p - 1 + j produced answer token j; the last position
        # has none (the row stopped), so its row stays empty and is never used as a label.
        ids[p - 1 : n - 1] = torch.stack([t[i] for t in steps_ids[:n_ans]]).int()
        lp[p - 1 : n - 1] = torch.stack([t[i] for t in steps_logp[:n_ans]]).float()
        feats = {"tokens": torch.cat([torch.tensor(prompts[i]), answers[i, :n_ans]]).int(), "hidden": hid,
                 "topk_ids": ids, "topk_logp": lp}
        for s in slots:
            for name, store in (("k", cache.k), ("v", cache.v)):  # a float16 cache: widened (exact)
                feats[f"{name}.{s}"] = store[s][i, :, :n].transpose(0, 1).reshape(n, -1).to(hid.dtype).cpu()
        out.append({"prompt_length": p, "temperature": temperature, **feats})
    return out


def shard_features(records: list[dict]) -> dict[str, torch.Tensor]:
    """Concatenate per-sequence records into one flat shard (offsets mark the sequences)."""
    keys = [k for k in records[0] if isinstance(records[0][k], torch.Tensor)]
    out = {k: torch.cat([r[k] for r in records]).contiguous() for k in keys}
    lengths = [len(r["tokens"]) for r in records]
    out["offsets"] = torch.tensor([0] + lengths, dtype=torch.long).cumsum(0)
    out["prompt_lengths"] = torch.tensor([r["prompt_length"] for r in records], dtype=torch.long)
    out["temperatures"] = torch.tensor([r["temperature"] for r in records], dtype=torch.float32)
    out["corpus"] = torch.tensor([r.get("corpus", False) for r in records], dtype=torch.bool)
    return out


def build_dataset(rt, prompts: list[str], out_dir: Path, cfg: DataConfig, desc: str = "self-distillation data") -> list[Path]:
    """Write shard-NNNNN.safetensors files into out_dir, skipping shards that already exist."""
    slots = read_slots(rt.model)
    eos = set(rt.tokenizer.eos_token_ids)

    def records_for(shard: int, chunk: list[str]) -> list[dict]:
        # Shortest first: a batch is padded to its longest prompt, and documents of ~1000 tokens
        # next to one-line questions would multiply the prefill's work.
        ids = sorted((p for p in _encode(rt.tokenizer, chunk, cfg.max_prompt_tokens) if p), key=len)
        records = []
        for b, start in enumerate(range(0, len(ids), cfg.batch_size)):
            # Batches cycle through the temperatures, so every shard mixes greedy and sampled.
            temp = cfg.temperatures[(shard + b) % len(cfg.temperatures)]
            records += record_answers(rt.model, ids[start : start + cfg.batch_size], cfg.max_new_tokens,
                                      temp, cfg.seed * 1_000_003 + shard * 1000 + b, slots, cfg.topk, eos,
                                      cfg.top_p)
        return records

    meta = {"model": rt.name, "dtype": rt.dtype_name, **asdict(cfg)}
    if cfg.top_p == 1.0:  # folders recorded before top-p existed match (and resume) as they are
        del meta["top_p"]
    return write_shards(out_dir, meta, prompts, cfg.shard_prompts, records_for, slots, desc, "prompt")


def write_shards(out_dir: Path, meta: dict, items: list, per_shard: int, records_for, slots: list[int], desc: str,
                 unit: str) -> list[Path]:
    """Shard i holds records_for(i, items[i * per_shard : ...]). Shards already on disk that the
    folder's manifest vouches for are kept, so an interrupted run resumes at the first missing
    one; `meta` (the settings) must match the folder's, though the number of items may grow (more
    items = more shards). Each shard is written atomically (durable.py) and added to the manifest
    after it is on disk; a shard the manifest does not vouch for (cut short, changed, or written
    and never listed) is deleted and made again."""
    out_dir.mkdir(parents=True, exist_ok=True)
    meta_path = out_dir / "data.json"
    if meta_path.exists():
        old = json.loads(meta_path.read_text())
        if old != json.loads(json.dumps(meta)):
            raise_mismatch(meta_path, old, meta)
    durable.write_text_atomic(meta_path, json.dumps(meta, indent=2))
    entries = verified_shards(out_dir)
    shards = []
    n_shards = (len(items) + per_shard - 1) // per_shard
    with tqdm(total=len(items), desc=desc, unit=unit) as bar:
        for shard in range(n_shards):
            path = out_dir / f"shard-{shard:05d}.safetensors"
            chunk = items[shard * per_shard : (shard + 1) * per_shard]
            if path.name not in entries:
                records = records_for(shard, chunk)
                durable.kill_point("data-shard")
                if records:
                    durable.write_atomic(path, lambda tmp: save_file(shard_features(records), str(tmp),
                                                                     metadata={"slots": json.dumps(slots)}))
                    entries[path.name] = durable.digest(path)
                    durable.write_manifest(out_dir, entries)
            if path.exists():
                shards.append(path)
            bar.update(len(chunk))
    return shards


def verified_shards(out_dir: Path, log=None) -> dict[str, dict]:
    """The folder's shards that check out against its manifest ({name: digest}); every other
    shard file (and any temporary file a kill left) is removed. A folder written before manifests
    existed (no manifest at all) has each shard's safetensors header checked against the file's
    size instead, and gets a manifest."""
    log = log or (lambda m: print(m, file=sys.stderr))
    for tmp in out_dir.glob("*.tmp"):
        tmp.unlink()
    listed = durable.read_manifest(out_dir)
    legacy = listed is None and not (out_dir / durable.MANIFEST).exists()
    entries = {}
    for path in sorted(out_dir.glob("shard-*.safetensors")):
        if legacy and _opens(path):
            entries[path.name] = durable.digest(path)
            continue
        want = (listed or {}).get(path.name)
        if want is not None and path.stat().st_size == want.get("bytes") \
                and durable.digest(path)["sha256"] == want.get("sha256"):
            entries[path.name] = want
            continue
        log(f"{path} is incomplete or corrupt (not in the manifest, or not matching it): made again")
        path.unlink()
    if legacy or listed != entries:
        durable.write_manifest(out_dir, entries)
    return entries


def _opens(path: Path) -> bool:
    """Whether a safetensors file's header parses and its tensors fit the file (a cut file fails)."""
    try:
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                f.get_slice(key)
        return True
    except Exception:  # any failure to read is a file not to trust  # noqa: BLE001
        return False


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
    # Corpus text (training/corpus.py): the tokens are the text's, not the target's, so labels
    # come from topk_ids; and every position is a prediction (prompt_length is 1).
    corpus: bool = False


def answer_window(seqs: list[Sequence], tokens: int | None) -> list[Sequence]:
    """Each answer cut to its first `tokens` tokens (views, no copies; corpus text and None: as
    is). A base model's long answers drift into repeating themselves, which drafts easily: on
    held-out prompts the engine's greedy tau over 160 tokens read 3.03 against 2.57 over the
    first 64. Training and evaluating on a window puts every anchor where replies begin."""
    if tokens is None:
        return seqs
    out = []
    for s in seqs:
        end = len(s.tokens) if s.corpus else min(len(s.tokens), s.prompt_length + tokens)
        out.append(Sequence(tokens=s.tokens[:end], prompt_length=s.prompt_length, temperature=s.temperature,
                            hidden=s.hidden[:end], keys={k: v[:end] for k, v in s.keys.items()},
                            values={k: v[:end] for k, v in s.values.items()}, topk_ids=s.topk_ids[:end],
                            topk_logp=s.topk_logp[:end], corpus=s.corpus))
    return out


def load_sequences(shards: list[Path]) -> list[Sequence]:
    seqs = []
    for path in shards:
        with safe_open(str(path), framework="pt") as f:
            slots = json.loads(f.metadata()["slots"])
            t = {k: f.get_tensor(k) for k in f.keys()}
        off = t["offsets"].tolist()
        corpus = t.get("corpus", torch.zeros(len(off) - 1, dtype=torch.bool)).tolist()
        for i in range(len(off) - 1):
            a, b = off[i], off[i + 1]
            seqs.append(Sequence(
                tokens=t["tokens"][a:b].long(), prompt_length=int(t["prompt_lengths"][i]),
                temperature=float(t["temperatures"][i]), hidden=t["hidden"][a:b],
                keys={s: t[f"k.{s}"][a:b] for s in slots}, values={s: t[f"v.{s}"][a:b] for s in slots},
                topk_ids=t["topk_ids"][a:b].long(), topk_logp=t["topk_logp"][a:b], corpus=bool(corpus[i]),
            ))
    return seqs
