"""The drafter training loop: AdamW with warm-up and cosine decay, bf16 autocast where the
hardware has bf16 units, periodic held-out acceptance, checkpoints and exact resume, and DDP
under torchrun (a single process on CPU otherwise).

Checkpoints hold no pickle: weights and optimizer moments are safetensors, the rest JSON. They
are written crash-safe (durable.py): sealed with a manifest, swapped in by renames, verified on
resume.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import time
from collections import Counter
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from specdraft.drafters.mtp import MTPNetwork, init_network, save_network
from specdraft.drafters.mtp.checkpoint import kv_sources, load_network, read_drafter_config
from specdraft.drafters.mtp.config import MTPConfig
from specdraft.drafters.mtp.drafter import MTPDrafter
from specdraft.errors import SpecdraftError
from specdraft.training import durable
from specdraft.training.clustering import balanced_clusters, cluster_of
from specdraft.training.data import Sequence
from specdraft.training.evaluate import teacher_forced_acceptance
from specdraft.training.grow import close_new_blocks, front_blocks, grown_state
from specdraft.training.objective import UnrolledLoss, collate, make_head_space, to_device


@dataclass
class TrainConfig:
    steps: int = 2000
    batch_size: int = 16  # sequences per step
    anchors_per_seq: int = 64
    k_steps: int = 4
    lr: float = 1e-3
    warmup: int = 100
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    loss: str = "ce"  # "ce" (the target's emitted tokens), "kl" (its top-k distribution) or "kl+tv"
    step_decay: float = 0.8
    cluster_weight: float = 0.2
    shortlist_size: int = 32768
    eval_every: int = 250
    save_every: int = 250
    seed: int = 0
    # Share of each batch's sequences drawn from prefill-distilled corpus text (None: every
    # sequence equally likely). Corpus text is cheap but not the target's own writing.
    corpus_fraction: float | None = None
    anchors_where: str = "uniform"  # or "uncertain" (objective.pick_anchors)


# The copy gate's learning rate over the drafter's: Adam moves a parameter by about the learning
# rate per step, and the gate's bonuses are logits of a few units that a continued drafter (lr
# 3e-4, a few hundred steps) would otherwise move by a tenth at most.
GATE_LR_SCALE = 30.0
# Blocks put in front of a trained drafter (grow.py) start closed, at post-norm scales of zero; at
# a continued drafter's small rate (2e-4) Adam would move those scales ~0.1 in 500 steps, so the
# new blocks learn at the rate a drafter is trained from scratch with.
NEW_BLOCK_LR_SCALE = 5.0


def lr_at(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = min(1.0, (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def shortlist_from(seqs: list[Sequence], size: int) -> torch.Tensor:
    """The `size` tokens the target produces most often (answer tokens and its top-4 guesses),
    most frequent first."""
    counts: Counter[int] = Counter()
    for s in seqs:
        if not s.corpus:  # a corpus text's own tokens are not the target's
            counts.update(s.tokens[s.prompt_length :].tolist())
        counts.update(s.topk_ids[s.prompt_length - 1 : len(s.tokens) - 1, :4].flatten().tolist())
    return torch.tensor([t for t, _ in counts.most_common(size)], dtype=torch.long)


def _uses_bf16(device: torch.device) -> bool:
    from specdraft.device import cpu_has_bf16_units

    return device.type == "cuda" or (device.type == "cpu" and cpu_has_bf16_units())


def autocast_for(device: torch.device):
    return torch.autocast(device.type, dtype=torch.bfloat16) if _uses_bf16(device) else nullcontext()


def batch_dtype(device: torch.device) -> torch.dtype:
    """What training batches (target states and K/V) are collated in: bf16 where autocast runs the
    drafter in bf16; float32 elsewhere (a CPU without bf16 units, e.g. AVX2 only), where the
    float32 drafter would otherwise meet bf16 inputs."""
    return torch.bfloat16 if _uses_bf16(device) else torch.float32


class Trainer:
    def __init__(self, target_rt, out_dir: Path, cfg: TrainConfig, drafter_cfg: MTPConfig,
                 train: list[Sequence], held_out: list[Sequence], log=print, init_from: Path | None = None):
        self.rt, self.out, self.cfg, self.log = target_rt, out_dir, cfg, log
        self.target = target_rt.model
        self.device = target_rt.device
        self.train_seqs, self.held_out = train, held_out
        self.corpus_pool = [q for q in train if q.corpus]
        self.answer_pool = [q for q in train if not q.corpus]
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.ckpt = out_dir / "checkpoint"
        # After a kill: the newest complete checkpoint (and best) found again, a corrupt one dropped.
        resume = self.rank == 0 and durable.recover_dir(self.ckpt, log) or (self.ckpt / "state.json").exists()
        if self.rank == 0:
            durable.recover_dir(self.best_dir, log)
        if resume:
            drafter_cfg = read_drafter_config(self.ckpt)
        self.sources = kv_sources(drafter_cfg, self.target)
        self.kv_heads = {s.slot: s.num_kv_heads for s in self.sources}
        shortlist = self._shortlist(resume)
        self.init_from = init_from
        # How many blocks in front are new (a deepened drafter, grow.py); kept in the checkpoint.
        self.new_blocks = json.loads((self.ckpt / "state.json").read_text()).get("new_blocks", 0) if resume else 0
        self.net = self._build(drafter_cfg, resume, shortlist).to(self.device)
        self.space = self._head_space(shortlist)
        self.opt = torch.optim.AdamW(self._param_groups(), lr=cfg.lr, betas=(0.9, 0.95))
        self.step = 0
        self.history: list[dict] = []
        if resume:
            self._load_checkpoint()
        self.loss_fn = UnrolledLoss(self.net, self.target, self.sources, self.space, cfg.k_steps, cfg.loss,
                                    cfg.step_decay, cfg.cluster_weight)
        if dist.is_initialized():
            self.loss_fn = torch.nn.parallel.DistributedDataParallel(self.loss_fn)

    # --- setup ----------------------------------------------------------------------------
    def _shortlist(self, resume: bool) -> torch.Tensor:
        """Token ids the softmax is computed over, most frequent first."""
        path = self.ckpt / "shortlist.safetensors"
        if resume and path.exists():
            with safe_open(str(path), framework="pt") as f:
                return f.get_tensor("shortlist")
        return shortlist_from(self.train_seqs, self.cfg.shortlist_size)

    def _build(self, cfg: MTPConfig, resume: bool, shortlist: torch.Tensor) -> MTPNetwork:
        net = init_network(cfg, self.target, seed=self.cfg.seed)
        if resume:
            with safe_open(str(self.ckpt / "model.safetensors"), framework="pt") as f:
                net.load_state_dict({k: f.get_tensor(k) for k in f.keys()})
        elif self.init_from is not None:
            # Continue a trained drafter (its clusters included) on new data.
            trained, _ = load_network(self.init_from, self.target, torch.float32, "cpu")
            added = cfg.num_layers - trained.config.num_layers  # > 0: deepened (grow.py)
            missing, unexpected = net.load_state_dict(grown_state(trained.state_dict(), added), strict=False)
            missing = [k for k in missing if not (added and k.startswith(front_blocks(added)))]
            # Only a copy gate and blocks put in front may be new (both start closed: the continued
            # drafter's own outputs).
            if unexpected or any(not k.startswith("copy_gate.") for k in missing):
                raise SpecdraftError(f"{self.init_from}: weights do not fit this drafter "
                                     f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
            close_new_blocks(net, added)
            self.new_blocks = added
        elif net.masked_embedding is not None:
            table = self.target.head_weight.detach().cpu().float()
            net.masked_embedding.token_ordering.copy_(balanced_clusters(table, cfg.num_centroids, hot=shortlist,
                                                                         progress=self.rank == 0))
        return net.float()

    def _param_groups(self) -> list[dict]:
        """Weight decay on matrices only; the copy gate (GATE_LR_SCALE) and new blocks in front
        (NEW_BLOCK_LR_SCALE) learn at larger rates."""
        new = front_blocks(self.new_blocks)
        kinds = {"body": [], "gate": [], "new": []}
        for name, p in self.net.named_parameters():
            kind = "gate" if name.startswith("copy_gate.") else "new" if new and name.startswith(new) else "body"
            kinds[kind].append(p)
        groups = []
        for kind, scale in (("body", 1.0), ("new", NEW_BLOCK_LR_SCALE)):
            groups += [{"params": [p for p in kinds[kind] if p.dim() >= 2], "weight_decay": self.cfg.weight_decay,
                        "lr_scale": scale},
                       {"params": [p for p in kinds[kind] if p.dim() < 2], "weight_decay": 0.0, "lr_scale": scale}]
        groups.append({"params": kinds["gate"], "weight_decay": 0.0, "lr_scale": GATE_LR_SCALE})
        return [g for g in groups if g["params"]]

    def _head_space(self, shortlist: torch.Tensor):
        clusters = None
        if self.net.masked_embedding is not None:
            clusters = cluster_of(self.net.masked_embedding.token_ordering.cpu(), self.net.config.num_centroids)
        return make_head_space(shortlist, self.net.config.vocab_size, clusters).to(self.device)

    # --- checkpoints ----------------------------------------------------------------------
    def save_checkpoint(self) -> None:
        """Weights, optimizer moments, shortlist and state into OUT/checkpoint.tmp, each file
        fsynced and listed with its size and SHA-256 in the folder's manifest, then swapped in by
        renames (durable.replace_dir): a kill at any point leaves a complete checkpoint, the new
        or the previous one."""
        if self.rank != 0:
            return
        tmp = self.ckpt.with_name("checkpoint.tmp")
        if tmp.exists():
            shutil.rmtree(tmp)
        save_network(self.net, tmp)
        durable.kill_point("checkpoint-write")
        moments = {}
        names = {id(p): n for n, p in self.net.named_parameters()}
        for group in self.opt.param_groups:
            for p in group["params"]:
                st = self.opt.state.get(p)
                if st:
                    for key in ("exp_avg", "exp_avg_sq"):
                        moments[f"{names[id(p)]}.{key}"] = st[key].detach().cpu().contiguous()
                    moments[f"{names[id(p)]}.step"] = torch.as_tensor(st["step"]).float().reshape(1)
        save_file(moments, str(tmp / "optimizer.safetensors"))
        save_file({"shortlist": self.space.shortlist.cpu()}, str(tmp / "shortlist.safetensors"))
        (tmp / "state.json").write_text(json.dumps({"step": self.step, "history": self.history,
                                                    "train_config": asdict(self.cfg),
                                                    "new_blocks": self.new_blocks}, indent=1))
        durable.seal_dir(tmp)
        durable.replace_dir(tmp, self.ckpt)

    def _load_checkpoint(self) -> None:
        state = json.loads((self.ckpt / "state.json").read_text())
        self.step, self.history = state["step"], state["history"]
        params = dict(self.net.named_parameters())
        with safe_open(str(self.ckpt / "optimizer.safetensors"), framework="pt") as f:
            keys = set(f.keys())
            for name, p in params.items():
                if f"{name}.exp_avg" in keys:
                    self.opt.state[p] = {
                        "step": f.get_tensor(f"{name}.step").reshape(()),
                        "exp_avg": f.get_tensor(f"{name}.exp_avg").to(p.device),
                        "exp_avg_sq": f.get_tensor(f"{name}.exp_avg_sq").to(p.device),
                    }
        self.log(f"resumed from {self.ckpt} at step {self.step}")

    # --- training -------------------------------------------------------------------------
    def batch_for(self, step: int):
        # Seeded by step and rank: a resumed run draws exactly the batches it would have.
        rng = random.Random(self.cfg.seed * 7_919 + step * 104_729 + self.rank)
        seqs = [self._draw(rng) for _ in range(self.cfg.batch_size)]
        batch = collate(seqs, self.cfg.anchors_per_seq, self.kv_heads, rng, batch_dtype(self.device), self.cfg.anchors_where)
        return to_device(batch, self.device)

    def _draw(self, rng: random.Random) -> Sequence:
        frac = self.cfg.corpus_fraction
        if frac is None or not self.corpus_pool or not self.answer_pool:
            return self.train_seqs[rng.randrange(len(self.train_seqs))]
        pool = self.corpus_pool if rng.random() < frac else self.answer_pool
        return pool[rng.randrange(len(pool))]

    def train(self) -> dict:
        cfg = self.cfg
        self.net.train()
        # Training seconds add up across resumes (checkpoints are taken at evaluation steps).
        started = time.time() - (self.history[-1]["seconds"] if self.history else 0.0)
        if self.step == 0 and self.init_from is not None:  # where the continued drafter starts
            self.history.append({"step": 0, "seconds": 0.0, **self.evaluate()})
            self.log(json.dumps(self.history[-1]))
        bar = tqdm(total=cfg.steps, initial=self.step, desc="training drafter", unit="step", disable=self.rank != 0)
        while self.step < cfg.steps:
            for g in self.opt.param_groups:
                g["lr"] = lr_at(self.step, cfg) * g.get("lr_scale", 1.0)
            batch = self.batch_for(self.step)
            with autocast_for(self.device):
                loss, metrics = self.loss_fn(batch)
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            durable.kill_point("train-step")
            torch.nn.utils.clip_grad_norm_(self.net.parameters(), cfg.grad_clip)
            self.opt.step()
            self.step += 1
            acc = (metrics["correct"].float() / metrics["count"].clamp(min=1)).tolist()
            bar.set_postfix(loss=f"{loss.item():.3f}", acc="/".join(f"{a:.2f}" for a in acc))
            bar.update(1)
            if self.step % cfg.eval_every == 0 or self.step == cfg.steps:
                self.history.append({"step": self.step, "loss": round(loss.item(), 4), "seconds": round(time.time() - started, 1),
                                     **self.evaluate()})
                self.log(json.dumps(self.history[-1]))
                self._keep_if_best()
            if self.step % cfg.save_every == 0 or self.step == cfg.steps:
                self.save_checkpoint()
        bar.close()
        return self.history[-1] if self.history else {}

    @property
    def best_dir(self) -> Path:
        return self.out / "best"

    def best_step(self) -> int | None:
        """The evaluated step with the highest held-out decoding tau (what the engine gets),
        not teacher-forced tau: the two rank checkpoints differently (BENCHMARKS.md)."""
        scored = [h for h in self.history if h.get("decoding_tau") is not None and h["step"] > 0]
        return max(scored, key=lambda h: (h["decoding_tau"], h["step"]))["step"] if scored else None

    def _keep_if_best(self) -> None:
        if self.rank == 0 and self.best_step() == self.step:
            tmp = self.best_dir.with_name("best.tmp")
            if tmp.exists():
                shutil.rmtree(tmp)
            save_network(self.net, tmp)
            (tmp / "step.json").write_text(json.dumps({"step": self.step}))
            durable.seal_dir(tmp)
            durable.replace_dir(tmp, self.best_dir)

    @torch.no_grad()
    def evaluate(self, max_sequences: int = 64) -> dict:
        """Teacher-forced acceptance on held-out greedy answers, through the inference head."""
        self.net.eval()
        drafter = MTPDrafter(self.net, self.target, self.sources)
        seqs = [s for s in self.held_out if s.temperature == 0.0][:max_sequences]
        with autocast_for(self.device):
            result = teacher_forced_acceptance(drafter, seqs, self.cfg.k_steps, self.kv_heads, self.device)
        self.net.train()
        return result

    def export(self, folder: Path, recipe: dict) -> dict:
        """The drafter of the evaluation with the best held-out decoding tau, in bf16 (what
        ships), plus the recipe and metrics. Returns that evaluation."""
        if self.rank != 0:
            return {}
        state, exported = self.net.state_dict(), self.step
        best, saved = self.best_step(), self.best_dir / "step.json"
        if best is not None and best != self.step and saved.exists() and json.loads(saved.read_text())["step"] == best:
            with safe_open(str(self.best_dir / "model.safetensors"), framework="pt") as f:
                state, exported = {k: f.get_tensor(k) for k in f.keys()}, best
        recipe = {**recipe, "exported_step": exported}
        export = MTPNetwork(self.net.config)
        export.load_state_dict(state)
        export.to(torch.bfloat16)  # token_ordering stays int64: .to(dtype) only casts floating tensors
        # Into a sealed folder first, then each file renamed into place: a kill leaves the
        # earlier export's files or the new ones, each whole.
        staged = folder / "export.tmp"
        if staged.exists():
            shutil.rmtree(staged)
        save_network(export, staged)
        (staged / "training.json").write_text(json.dumps({**recipe, "history": self.history}, indent=1) + "\n")
        durable.seal_dir(staged)
        for name in ("config.json", "model.safetensors", "training.json"):
            os.replace(staged / name, folder / name)
        durable.fsync_dir(folder)
        shutil.rmtree(staged)
        return next((h for h in self.history if h["step"] == exported), {})


def init_distributed() -> bool:
    """Join the torchrun process group when launched by torchrun (gloo on CPU, nccl on CUDA)."""
    if "RANK" not in os.environ or dist.is_initialized():
        return dist.is_initialized()
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend)
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    return True


def is_first_rank() -> bool:
    """Whether this process records data and prints results: rank 0 of torchrun, or the only one."""
    return not dist.is_initialized() or dist.get_rank() == 0


def barrier() -> None:
    """Wait for every torchrun process (nothing to wait for in a single process)."""
    if dist.is_initialized():
        dist.barrier()
