"""Prefill distillation: the target reads existing text in one forward pass, and every position
becomes a training example.

Self-distillation (data.py) pays a decode step per answer token. Here a batch of text chunks
goes through one prefill, and at every position the shard keeps what generation would have
kept: the final-normed hidden state, the K/V the drafter reads, and the target's top-k
next-token log-probabilities. The labels are the target's (its top-k distribution, or its
argmax for the "ce" loss), never the text's next token: the drafter learns to predict the
target, and the text only supplies contexts. Text is not the target's own writing, so this
data is mixed with self-generated answers rather than replacing them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from specdraft.training.data import read_slots, write_shards
from specdraft.training.labels import label_head, labels_in_bf16, topk_log_probs


@dataclass
class CorpusConfig:
    chunk_tokens: int = 384  # tokens per chunk, BOS included; longer texts are cut into several
    min_tokens: int = 32  # shorter pieces are dropped: too few anchors for K-step training
    batch_size: int = 8  # chunks per prefill
    shard_texts: int = 64
    topk: int = 8


def text_chunks(tokenizer, texts: list[str], chunk_tokens: int, min_tokens: int) -> list[list[int]]:
    """Each text tokenised once (with BOS) and cut into pieces of chunk_tokens; every piece
    after the first starts with BOS again, so each is a context the target sees from its start."""
    chunks = []
    for text in texts:
        ids = tokenizer.encode(text)
        bos, body = ids[:1], ids[1:]
        step = chunk_tokens - 1
        for start in range(0, len(body), step):
            piece = bos + body[start : start + step]
            if len(piece) >= min_tokens:
                chunks.append(piece)
    return chunks


@torch.inference_mode()
def record_prefill(model: torch.nn.Module, chunks: list[list[int]], slots: list[int], topk: int,
                   head=None) -> list[dict]:
    """One prefill over a batch of chunks (right-padded: causal attention never lets a real
    position see the padding) -> one record per chunk, in the shard format of data.py. `head`
    computes the labels' logits (labels.label_head; default: the model's own head)."""
    head = head or model.logits
    lengths = [len(c) for c in chunks]
    width = max(lengths)
    tokens = torch.zeros(len(chunks), width, dtype=torch.long)
    for i, c in enumerate(chunks):
        tokens[i, : len(c)] = torch.tensor(c)
    cache = model.new_cache(len(chunks), width)
    hidden = model(tokens.to(model.embed_tokens.weight.device), cache)
    out = []
    for i, n in enumerate(lengths):
        ids, lp = topk_log_probs(head, hidden[i, :n], topk)
        rec = {"prompt_length": 1, "temperature": 0.0, "corpus": True, "tokens": tokens[i, :n].int(),
               "hidden": hidden[i, :n].cpu(), "topk_ids": ids.int().cpu(), "topk_logp": lp.float().cpu()}
        for s in slots:
            for name, store in (("k", cache.k), ("v", cache.v)):  # a float16 cache: widened (exact)
                rec[f"{name}.{s}"] = store[s][i, :, :n].transpose(0, 1).reshape(n, -1).to(hidden.dtype).cpu()
        out.append(rec)
    return out


def build_corpus_dataset(rt, texts: list[str], out_dir: Path, cfg: CorpusConfig,
                         desc: str = "prefill distillation") -> list[Path]:
    """Shards of prefill-distilled text in out_dir, resumable like build_dataset's."""
    slots = read_slots(rt.model)
    context = rt.config.max_position_embeddings
    chunk_tokens = min(cfg.chunk_tokens, context)
    head = label_head(rt.model)

    def records_for(shard: int, chunk: list[str]) -> list[dict]:
        pieces = text_chunks(rt.tokenizer, chunk, chunk_tokens, cfg.min_tokens)
        pieces.sort(key=len)  # similar lengths share a prefill: little padding
        records = []
        for start in range(0, len(pieces), cfg.batch_size):
            records += record_prefill(rt.model, pieces[start : start + cfg.batch_size], slots, cfg.topk, head)
        return records

    # Shards labelled by another head must not mix into a resumed folder.
    meta = {"model": rt.name, "dtype": rt.dtype_name, "source": "corpus", **asdict(cfg),
            "label_head": "bfloat16" if labels_in_bf16(rt.model) else rt.dtype_name}
    return write_shards(out_dir, meta, texts, cfg.shard_texts, records_for, slots, desc, "text")
