"""Crash-safe drafter training: `train-drafter` killed with SIGKILL while it records data, in a
training step and while it writes a checkpoint, then rerun with --resume, ends with nothing
corrupt and the same drafter, bit for bit, as a run never interrupted (same seed). The kills
are placed by SPECDRAFT_KILL_AT (training/durable.py). Corrupt files are detected and redone."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import make_tiny
from specdraft.training import durable
from specdraft.training.data import verified_shards

SRC = Path(__file__).resolve().parents[1] / "src"
# 150 distinct prompts: three shards of training answers (64 a shard), so a kill can land between them.
PROMPTS = "".join(f"w{i} w{i + 1} w{(i * 7) % 50 + 3}\n" for i in range(150))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("crash") / "tiny"
    make_tiny(folder, "llama", seed=5)
    (folder.parent / "prompts.txt").write_text(PROMPTS)
    return folder


def train(tiny: Path, out: Path, kill_at: str | None = None, resume: bool = False) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    env.pop(durable.KILL_ENV, None)
    if kill_at:
        env[durable.KILL_ENV] = kill_at
    cmd = [sys.executable, "-m", "specdraft", "train-drafter", "--model", str(tiny), "--dtype", "float32",
           "--device", "cpu", "--threads", "1", "--out", str(out), "--prompts", str(tiny.parent / "prompts.txt"),
           "--answer-tokens", "8", "--held-out", "4", "--steps", "6", "--eval-every", "2", "--batch-size", "4",
           "--anchors", "4", "--seed", "3", *(["--resume"] if resume else [])]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def uninterrupted(tiny) -> Path:
    out = tiny.parent / "straight"
    done = train(tiny, out)
    assert done.returncode == 0, done.stderr
    return out


def killed(tiny: Path, out: Path, kill_at: str, resume: bool) -> str:
    run = train(tiny, out, kill_at, resume)
    assert run.returncode == -signal.SIGKILL, run.stderr  # the kill point was reached
    assert not (out / "model.safetensors").exists()
    return run.stderr


def assert_same_drafter(out: Path, straight: Path) -> None:
    """Bit equality: every batch is seeded by its step, the data by its shard, and the optimizer's
    moments are checkpointed exactly, so a resumed run redoes exactly the lost work."""
    for name in ("model.safetensors", "config.json"):
        assert (out / name).read_bytes() == (straight / name).read_bytes(), name
    history = [{k: v for k, v in h.items() if k != "seconds"} for h in json.loads((out / "training.json").read_text())["history"]]
    straight_history = json.loads((straight / "training.json").read_text())["history"]
    assert history == [{k: v for k, v in h.items() if k != "seconds"} for h in straight_history]
    assert durable.manifest_problem(out / "checkpoint") is None
    assert not [p for p in out.rglob("*") if p.name.endswith((".tmp", ".prev"))]  # nothing half-written is left
    for part in ("train", "held_out"):
        assert durable.manifest_problem(out / "data" / part) is None
        assert sorted(p.name for p in (out / "data" / part).glob("shard-*")) == \
            sorted(p.name for p in (straight / "data" / part).glob("shard-*"))


def test_the_uninterrupted_run_wrote_three_training_shards(uninterrupted):
    assert len(list((uninterrupted / "data" / "train").glob("shard-*.safetensors"))) == 3
    assert json.loads((uninterrupted / "checkpoint" / "state.json").read_text())["step"] == 6


def test_killed_five_times_resume_gives_the_same_drafter(tiny, uninterrupted, tmp_path):
    """One run killed at each place in turn, each rerun with --resume (kill points count from 1 in
    every process), then finished."""
    out = tmp_path / "run"
    killed(tiny, out, "data-shard:2", resume=False)  # shard 2's answers recorded, not yet written
    assert [p.name for p in (out / "data" / "train").glob("shard-*")] == ["shard-00000.safetensors"]
    # Third atomic write of the rerun: held_out_prompts.jsonl, data.json, then shard 2's file,
    # fsynced and not yet renamed.
    killed(tiny, out, "before-rename:3", resume=True)
    assert (out / "data" / "train" / "shard-00001.safetensors.tmp").exists()
    killed(tiny, out, "train-step:3", resume=True)  # mid-step: the last checkpoint is step 2's
    assert json.loads((out / "checkpoint" / "state.json").read_text())["step"] == 2
    err = killed(tiny, out, "checkpoint-write:1", resume=True)  # step 4's checkpoint half-written
    assert "resumed from" in err and (out / "checkpoint.tmp").exists()
    # The rerun's second folder swap (step 4's best, then step 4's checkpoint, where step 4 is
    # the best so far): the old folder renamed aside, the new one not yet in place.
    killed(tiny, out, "between-renames:2", resume=True)
    aside = [p for p in out.iterdir() if p.name.endswith(".prev")]
    assert len(aside) == 1 and not (out / aside[0].name.removesuffix(".prev")).exists()
    resumed = train(tiny, out, resume=True)
    assert resumed.returncode == 0, resumed.stderr
    assert "previous complete copy restored" in resumed.stderr
    assert_same_drafter(out, uninterrupted)


def test_corrupt_shard_and_checkpoint_are_redone_not_trusted(tiny, uninterrupted, tmp_path):
    def damage(out: Path) -> None:
        shard = out / "data" / "train" / "shard-00000.safetensors"
        shard.write_bytes(shard.read_bytes()[:-100])  # cut short
        model = out / "checkpoint" / "model.safetensors"
        raw = bytearray(model.read_bytes())
        raw[-5] ^= 0xFF  # one flipped byte in a weight: the file still parses
        model.write_bytes(bytes(raw))

    out = tmp_path / "run"
    killed(tiny, out, "train-step:5", resume=False)
    damage(out)
    resumed = train(tiny, out, resume=True)
    assert resumed.returncode == 0, resumed.stderr
    assert "shard-00000.safetensors is incomplete or corrupt" in resumed.stderr
    assert "does not match its SHA-256" in resumed.stderr
    assert "resumed from" not in resumed.stderr  # the corrupt checkpoint was not used: training began again
    assert_same_drafter(out, uninterrupted)


def test_negative_control_without_manifests_a_cut_shard_would_be_trusted(tiny, uninterrupted, tmp_path):
    """The manifest is what catches a flipped byte: the legacy check (the file parses) passes it."""
    folder = tmp_path / "data"
    folder.mkdir()
    source = uninterrupted / "data" / "train" / "shard-00001.safetensors"
    raw = bytearray(source.read_bytes())
    raw[-5] ^= 0xFF
    (folder / source.name).write_bytes(bytes(raw))
    assert source.name in verified_shards(folder, log=lambda m: None)  # no manifest: only parsing is checked
    durable.write_manifest(folder, {source.name: durable.digest(source)})
    assert verified_shards(folder, log=lambda m: None) == {}
    assert not (folder / source.name).exists()


def test_kill_point_counts_and_ignores_other_names(monkeypatch):
    monkeypatch.setenv(durable.KILL_ENV, "somewhere:3")
    durable._passed.clear()
    durable.kill_point("elsewhere")
    durable.kill_point("somewhere")
    durable.kill_point("somewhere")
    assert durable._passed["somewhere"] == 2  # the third would kill this process


def test_a_run_without_held_out_prompts_says_so_instead_of_printing_empty_numbers(tiny, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    env.pop(durable.KILL_ENV, None)
    cmd = [sys.executable, "-m", "specdraft", "train-drafter", "--model", str(tiny), "--dtype", "float32",
           "--device", "cpu", "--threads", "1", "--out", str(tmp_path / "none"), "--prompts",
           str(tiny.parent / "prompts.txt"), "--answer-tokens", "8", "--held-out", "0", "--num-prompts", "8",
           "--steps", "2", "--batch-size", "4", "--anchors", "4", "--seed", "3"]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    assert "no held-out evaluation (--held-out 0)" in run.stderr
    assert "None" not in run.stderr.splitlines()[-1]
