"""llama.cpp's own server as a bench peer: plain, prompt lookup and its Gemma 4 MTP drafting.

- llama-cpp      llama-server on the GGUF, no drafting
- llama-cpp-pld  the same with `--spec-type ngram-simple` (a 3-token lookup n-gram, K drafted)
- llama-cpp-mtp  the same with `--spec-type draft-mtp` and the assistant (--drafter-path) as
                 llama.cpp's converter writes it (tools/llama_cpp_native.py convert-assistant),
                 drafting K a round (`--spec-draft-n-max`), as specdraft's K
- llama-cpp-mtp~PROFILE  the same with llama.cpp's own synthetic acceptance
                 (`--spec-synth-rates`, per-position unconditional rates: the profile's cumulative
                 shares), the counterpart of specdraft's METHOD~PROFILE

One server per method, started once (load outside every timer), one slot, the prompt cache off:
each request is timed around its HTTP call from the token ids to the last token, as the other
methods are. Greedy: temperature 0 with every other sampler neutral.
"""

from __future__ import annotations

import json
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from specdraft.bench.llama_native import TOOL, assistant_gguf, binary_env, find_binary
from specdraft.bench.methods import BatchOutput, BenchContext, Method, RowOutput, Skip, cut_at_eos

START_TIMEOUT = 900  # seconds for the server to load a model (a 30 GB GGUF from a cold disk)
NGRAM_SIZE = 3  # the longest n-gram specdraft's lookup matches


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaServerMethod(Method):
    max_batch_size = 1  # one slot: requests one at a time, as the wheel peer runs

    def __init__(self, name: str, args: list[str], ctx: BenchContext, draft_tokens: int, binary: Path):
        super().__init__()
        self.name, self.ctx, self.draft_tokens = name, ctx, draft_tokens
        self.port = _free_port()
        self.log = tempfile.TemporaryFile()  # its output, quoted when it fails
        cmd = [str(binary), "--host", "127.0.0.1", "--port", str(self.port), "-np", "1", "--no-webui", *args]
        self.cmd = cmd
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=binary_env(binary))
        self._wait_ready()
        self.drafted = self.accepted = 0  # llama.cpp's own counts, over every request

    def _url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def _wait_ready(self) -> None:
        deadline = time.time() + START_TIMEOUT
        while time.time() < deadline:
            if self.proc.poll() is not None:
                self.log.seek(0)
                tail = self.log.read().decode(errors="replace").strip().splitlines()[-3:]
                raise Skip(f"llama-server exited with code {self.proc.returncode} while loading "
                           f"({' '.join(self.cmd[1:])}): {' | '.join(tail)}")
            try:
                with urllib.request.urlopen(self._url("/health"), timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.5)
        self.close()
        raise Skip(f"llama-server did not come up within {START_TIMEOUT} s")

    def generate(self, prompts: list[list[int]], max_new_tokens: int) -> BatchOutput:
        if len(prompts) != 1:
            raise Skip(f"{self.name} runs batch size 1 only")
        body = {"prompt": prompts[0], "n_predict": max_new_tokens, "cache_prompt": False, "return_tokens": True,
                "stream": False, "temperature": 0.0, "top_k": 1, "top_p": 1.0, "min_p": 0.0, "typical_p": 1.0,
                "repeat_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0, "dry_multiplier": 0.0,
                "ignore_eos": self.ctx.ignore_eos}
        data = json.dumps(body).encode()
        request = urllib.request.Request(self._url("/completion"), data=data,
                                         headers={"Content-Type": "application/json"})
        t0 = time.perf_counter()
        with urllib.request.urlopen(request, timeout=3600) as r:
            out = json.loads(r.read())
        wall = time.perf_counter() - t0
        timings = out.get("timings", {})
        self.drafted += int(timings.get("draft_n", 0) or 0)
        self.accepted += int(timings.get("draft_n_accepted", 0) or 0)
        eos = set(self.ctx.eos_token_ids)
        tokens, reason = cut_at_eos([int(t) for t in out.get("tokens", [])], eos, max_new_tokens)
        ttft = timings.get("prompt_ms")
        return BatchOutput([RowOutput(tokens, wall, None if ttft is None else ttft / 1000, reason)], wall)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()


def server_args(name: str, ctx: BenchContext, gguf: Path, threads: int, profile=None) -> tuple[list[str], int]:
    """llama-server's arguments for a peer, and the drafts it proposes a round (0: none)."""
    k = ctx.draft_tokens or 3  # llama-server's own default n-max
    args = ["-m", str(gguf), "-t", str(threads), "-tb", str(threads), "-c", str(ctx.n_ctx), "-ngl", "0"]
    if name == "llama-cpp-pld":
        return args + ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", str(NGRAM_SIZE),
                       "--spec-ngram-simple-size-m", str(k), "--spec-draft-n-max", str(k)], k
    if not name.startswith("llama-cpp-mtp"):
        return args, 0
    if ctx.drafter_path is None:
        raise Skip("llama-cpp-mtp needs the assistant: --drafter-path FOLDER")
    assistant = Path(ctx.drafter_path)
    draft_gguf = assistant if assistant.suffix == ".gguf" else assistant_gguf(assistant)
    if not draft_gguf.is_file():
        raise Skip(f"the assistant is not converted for llama.cpp yet: {TOOL} convert-assistant "
                   f"{ctx.drafter_path} --source SOURCE")
    args += ["--spec-type", "draft-mtp", "-md", str(draft_gguf), "--spec-draft-n-max", str(k), "--spec-draft-n-min", "0"]
    if profile is not None:
        # llama.cpp takes exactly n-max unconditional rates: the profile's cumulative shares,
        # continued past its last position at its last conditional rate (as specdraft's).
        rates, share = [], 1.0
        for rate in profile.conditional(k):
            share *= rate
            rates.append(share)
        args += ["--spec-synth-rates", ",".join(f"{r:.4g}" for r in rates)]
    return args, k


def build_llama_server(name: str, ctx: BenchContext, gguf: Path, threads: int, profile=None) -> Method:
    """A llama-server peer; Skip where no native build is found."""
    binary = find_binary("llama-server")
    if binary is None:
        raise Skip(f"no native llama.cpp build (llama-server); build it once: {TOOL} build SOURCE")
    args, drafts = server_args(name, ctx, gguf, threads, profile)
    method = LlamaServerMethod(name, args, ctx, drafts, binary)
    method.own_weight_bytes = gguf.stat().st_size
    method.notes.append(f"llama-server (native build, {binary.parent}), {gguf.name}, {threads} threads, "
                        f"n_ctx={ctx.n_ctx}, one slot" + (f", {' '.join(args[args.index('--spec-type'):])}"
                                                         if "--spec-type" in args else ""))
    if profile is not None:
        method.notes.append(f"SIMULATED acceptance {profile.name} (llama.cpp's --spec-synth-rates, which accepts "
                            "drafts by the rates whatever they are: its output is not the target's)")
    return method
