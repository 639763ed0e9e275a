"""`specdraft chat` in a pseudo-terminal, as a user runs it: several turns in the model's chat
template, the second prefilling only its own tokens (/stats says so), /reset, history trimmed to
the context with a notice, Ctrl-C stopping a reply but not the program, /exit and Ctrl-D.
A tiny Gemma 4 with a chat template (tools/gemma4_tiny.py); never the network.
"""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import select
import signal
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest

pytest.importorskip("transformers")

SRC = Path(__file__).resolve().parents[1] / "src"
GEMMA_LIKE = ("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else "
              "m['role'] }} {{ m['content'] }}<end_of_turn> {% endfor %}{% if add_generation_prompt %}"
              "<start_of_turn>model {% endif %}")
STATS = re.compile(r"last reply: (\d+) tokens .*? prefilled (\d+) tokens \((\d+) from the cache\)")


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    from gemma4_tiny import build

    folder, _ = build(tmp_path_factory.mktemp("chat_tiny"), text_only=True)
    # As Gemma's own template: the assistant's turns render as the `model` turn the generation
    # prompt opens, so a conversation's history re-renders as the model saw it.
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = GEMMA_LIKE
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def _own_terminal() -> None:
    """In the child: setsid() and the pty as its controlling terminal, so that
    Ctrl-C typed there is a SIGINT to it, as in a real terminal."""
    os.setsid()
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # as a background job's shell leaves it: chat must undo it


class Terminal:
    """A command on a pty: write keystrokes, read until a pattern shows."""

    def __init__(self, argv: list[str], env: dict):
        self.master, slave = pty.openpty()
        self.proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, env=env, close_fds=True,
                                     preexec_fn=_own_terminal)
        os.close(slave)
        self.seen, self.mark = "", 0

    def expect(self, pattern: str, timeout: float = 120) -> re.Match:
        deadline = time.time() + timeout
        while True:  # from the end of the last match: output may arrive with the one before
            m = re.compile(pattern).search(self.seen, self.mark)
            if m:
                self.mark = m.end()
                return m
            left = deadline - time.time()
            assert left > 0, f"no {pattern!r} in:\n{self.seen[-3000:]}"
            ready, _, _ = select.select([self.master], [], [], min(left, 1))
            if ready:
                try:
                    self.seen += os.read(self.master, 4096).decode(errors="replace")
                except OSError:  # the child closed the terminal
                    assert False, f"exited before {pattern!r}:\n{self.seen[-3000:]}"

    def send(self, text: str) -> None:
        os.write(self.master, text.encode())

    def close(self) -> int:
        try:
            return self.proc.wait(timeout=60)
        finally:
            os.close(self.master)


def chat(target: Path, *flags: str) -> Terminal:
    env = dict(os.environ, PYTHONPATH=str(SRC), HF_HUB_OFFLINE="1", SPECDRAFT_THREADS="1", TERM="dumb")
    return Terminal([sys.executable, "-m", "specdraft", "chat", "--model", str(target), "--dtype", "float32",
                     "--device", "cpu", "--draft-policy", "fixed", *flags], env)


def test_turns_reset_stats_and_trimming(target):
    t = chat(target, "--max-new-tokens", "6", "--max-context", "80", "--drafter", "ngram")
    t.expect(r"specdraft chat: .*drafter ngram")
    t.expect(r"> ")
    t.send("/stats\n")
    t.expect(r"no reply yet")
    t.send("hello world\n")
    t.expect(r"> ")
    t.send("/stats\n")
    first = t.expect(STATS)
    assert int(first[3]) == 0  # nothing cached before the first turn
    t.send("a b c\n")
    t.expect(r"> ")
    t.send("/stats\n")
    second = t.expect(STATS)
    # "<end_of_turn> <start_of_turn>user a b c<end_of_turn> <start_of_turn>model": 9 tokens of its
    # own, plus the first reply's last token unless it was an end of turn (never in the cache).
    assert int(second[3]) >= int(first[2]) + int(first[1]) - 1 and int(second[2]) <= 10
    t.send("/reset\n")
    t.expect(r"conversation cleared")
    t.send("a b c\n")
    t.expect(r"> ")
    t.send("/stats\n")
    fresh = t.expect(STATS)
    assert int(fresh[3]) == 0
    for _ in range(6):  # each turn adds ~15 tokens: the context of 80 fills
        t.send("hello world hello world\n")
        t.expect(r"> ")
    assert "history trimmed to the context" in t.seen
    t.send("/exit\n")
    assert t.close() == 0


def test_ctrl_c_stops_the_reply_not_the_program(target):
    t = chat(target, "--max-new-tokens", "900", "--drafter", "none")
    t.expect(r"> ")
    t.send("hello\n")
    t.expect(r"hello\r?\n\S")  # the reply started streaming
    t.send("\x03")
    t.expect(r"\[stopped\]")
    t.expect(r"> ")
    t.send("/stats\n")
    stopped = t.expect(STATS)
    assert int(stopped[1]) < 900
    t.expect(r"> ")
    t.send("\x03")  # at the prompt: a hint, not an exit
    t.expect(r"Ctrl-D quits")
    t.send("\x04")
    assert t.close() == 0
