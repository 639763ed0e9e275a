"""`specdraft chat`: a conversation in the terminal, in the model's chat template.

Each turn's prompt is the whole conversation, but only its new tokens are prefilled: the engine
keeps each finished reply's KV in its prefix cache (speculative/prefix_cache.py, the server's
mechanism) and the next turn restores it. So that the restored prefix matches token for token,
the conversation's ids are kept as the model saw them: the previous prompt, the reply's own
tokens, then the template's text for the new turn (where the template re-renders the history
differently, the prefix cache reuses what still matches).

/reset forgets the conversation, /stats shows the last reply's speed, tau, acceptance by
position, time to first token and the tokens prefilled; Ctrl-C stops a reply (at the next round),
Ctrl-D or /exit quits. A conversation longer than the context drops its oldest turns, saying so.
"""

from __future__ import annotations

import select
import signal
import sys

from specdraft.cli.args import (add_drafter_args, add_max_context_arg, add_model_args, add_policy_arg,
                                add_sampling_args, add_stop_arg, check_generation_args, load_target)
from specdraft.errors import SpecdraftError

COMMANDS = "/reset forgets the conversation, /stats shows the last reply's numbers, /exit quits"
# For a model without a chat template (a base model): a plain transcript it can continue.
TRANSCRIPT = ("{% for m in messages %}{{ m['role'] | capitalize }}: {{ m['content'] }}\n{% endfor %}"
              "{% if add_generation_prompt %}Assistant:{% endif %}")
TRANSCRIPT_STOP = "\nUser:"
PROMPT = "> "


def register(sub) -> None:
    p = sub.add_parser(
        "chat",
        help="chat with a model in the terminal (its chat template, speculative decoding)",
        description="A multi-turn conversation in the terminal with the model's chat template. Replies stream as "
                    "rounds are accepted; each turn prefills only its own tokens (the conversation's KV cache is "
                    "kept). " + COMMANDS + "; Ctrl-C stops a reply, Ctrl-D quits.",
    )
    add_model_args(p)
    add_drafter_args(p)
    add_policy_arg(p)
    add_sampling_args(p, max_new_tokens=1024)
    add_stop_arg(p)
    add_max_context_arg(p)
    p.add_argument("--system", default=None, help="a system prompt that opens the conversation")
    p.set_defaults(run=run)


def run(args) -> int:
    from specdraft.engine_builder import build_engine
    from specdraft.sampling import SamplingParams
    from specdraft.speculative.prefix_cache import PrefixCache

    check_generation_args(args)
    sampling = SamplingParams(args.temperature, args.top_k, args.top_p, args.seed)
    rt = load_target(args)
    # One conversation: the store holds its latest turn (each save replaces the turn it extends);
    # every position is reused, replies included (prefix_cache.py: exact=False).
    store = PrefixCache(1 << 62, exact=False)
    built = build_engine(rt, args.drafter, args.drafter_path, args.draft_tokens, args.draft_policy, prepare_rows=1,
                         progress=True, max_batch_size=1, capacity=rt.context, prefix_cache=store)
    stops = tuple(args.stop)
    if rt.tokenizer.chat_template is None:
        print(f"specdraft: note: {args.model} has no chat template (a base model?); using a plain "
              "'User: ... Assistant:' transcript", file=sys.stderr)
        rt.tokenizer.chat_template = TRANSCRIPT
        stops += (TRANSCRIPT_STOP,)
    chat = Conversation(rt.tokenizer, built.engine, store, args.system)
    if sys.stdin.isatty():  # a terminal's Ctrl-C must reach us, even if a launching shell ignored SIGINT
        signal.signal(signal.SIGINT, signal.default_int_handler)
    print(f"specdraft chat: {args.model}, drafter {built.drafter}. {COMMANDS}; Ctrl-C stops a reply, Ctrl-D quits.",
          file=sys.stderr, flush=True)
    state = {"last": None}
    while True:
        try:
            if not step(chat, state, args, sampling, stops, built):
                return 0
        except KeyboardInterrupt:  # at the prompt (a reply catches its own): not an exit
            print("\n(/exit or Ctrl-D quits)", flush=True)


def step(chat: "Conversation", state: dict, args, sampling, stops: tuple[str, ...], built) -> bool:
    """Read one line and act on it; False when the user quits."""
    line = read_line(PROMPT)
    if line is None:  # Ctrl-D
        print()
        return False
    text = line.strip()
    if text == "/exit":
        return False
    if text == "/reset":
        chat.reset()
        state["last"] = None
        print("(conversation cleared)", flush=True)
    elif text == "/stats":
        last = state["last"]
        print(stats_line(last, built.drafter, built.draft_tokens) if last else "(no reply yet)", flush=True)
    elif text.startswith("/"):
        print(f"(unknown command {text.split()[0]}: {COMMANDS})", flush=True)
    elif text:
        try:
            state["last"] = chat.turn(text, args.max_new_tokens, sampling, stops)
        except SpecdraftError as e:  # a turn too long for the context: the conversation goes on
            print(f"specdraft: error: {e}", file=sys.stderr, flush=True)
    return True


def read_line(prompt: str) -> str | None:
    """A line from stdin, None at its end. On a terminal it waits in short selects, not a blocking
    read: Ctrl-C's SIGINT may land on one of torch's threads, which does not interrupt a read of
    the main thread, so the main thread must wake now and then to run the handler."""
    sys.stdout.write(prompt)
    sys.stdout.flush()
    if sys.stdin.isatty():
        while not select.select([sys.stdin], [], [], 0.2)[0]:
            pass
    line = sys.stdin.readline()
    return line or None


class Conversation:
    """The messages and the ids the model saw, and one turn at a time through the engine."""

    def __init__(self, tokenizer, engine, store, system: str | None):
        self.tokenizer, self.engine, self.store, self.system = tokenizer, engine, store, system
        self.reset()

    def reset(self) -> None:
        self.messages = [{"role": "system", "content": self.system}] if self.system else []
        self.ids: list[int] = []  # the last prompt, then its reply
        self.text = ""  # the last prompt's rendered text, then its reply's
        self.store.clear()

    def turn(self, user: str, max_new_tokens: int, sampling, stops: tuple[str, ...]):
        from specdraft.speculative.request import Request

        self.messages.append({"role": "user", "content": user})
        ids, text = self._prompt(max_new_tokens)
        decoder = Streamer(self.tokenizer)
        req = Request(ids, max_new_tokens, sampling, stops, on_tokens=lambda new, sources: decoder.show(new))
        result = self._drive(req)
        decoder.finish(result.finish_reason == "abort")
        reply = result.text if result.finish_reason != "abort" else self.tokenizer.decode(result.token_ids)
        eos = set(self.tokenizer.eos_token_ids)
        kept = result.token_ids[:-1] if result.token_ids and result.token_ids[-1] in eos else result.token_ids
        self.messages.append({"role": "assistant", "content": reply.strip()})
        self.ids, self.text = ids + kept, text + reply
        result.prefilled = len(ids) - result.stats.cached_tokens
        return result

    def _prompt(self, max_new_tokens: int) -> tuple[list[int], str]:
        """The ids of the conversation in the template, history trimmed to fit the context."""
        room = self.engine.room - max_new_tokens
        dropped = 0
        while True:
            text = self.tokenizer.render_chat(self.messages)
            ids = self._continue(text)
            if len(ids) <= room:
                break
            first = 1 if self.messages and self.messages[0]["role"] == "system" else 0
            if len(self.messages) - first <= 1:
                self.messages.pop()
                raise SpecdraftError(f"this message takes {len(ids)} tokens with the template; with "
                                     f"--max-new-tokens {max_new_tokens} the context leaves room for {room}")
            del self.messages[first : first + 2]  # the oldest user turn and its reply
            dropped += 1
        if dropped:
            print(f"(history trimmed to the context: dropped the {dropped} oldest turn(s))", file=sys.stderr,
                  flush=True)
        return ids, text

    def _continue(self, text: str) -> list[int]:
        """`text`'s ids, as the last prompt and reply's own ids plus the new turn's where `text`
        extends them (the prefix cache restores exactly those), else tokenized afresh."""
        if self.ids and text.startswith(self.text):
            return self.ids + self.tokenizer.encode(text[len(self.text):], add_special_tokens=False)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _drive(self, req):
        """Run one request to its end; Ctrl-C aborts it at the next round (the engine's state stays whole)."""
        stop = []
        previous = signal.signal(signal.SIGINT, lambda *_: stop.append(True))
        self.engine.add(req)
        result = None
        try:
            while self.engine.has_work():
                if stop:
                    result = self.engine.abort(req.id)
                    break
                for r in self.engine.step():
                    result = r
        finally:
            signal.signal(signal.SIGINT, previous)
        return result


class Streamer:
    """Reply text to the terminal as rounds are accepted."""

    def __init__(self, tokenizer):
        from specdraft.tokenizer import StreamDecoder

        self.decoder = StreamDecoder(tokenizer)

    def show(self, ids: list[int]) -> None:
        sys.stdout.write(self.decoder.push(ids))
        sys.stdout.flush()

    def finish(self, stopped: bool) -> None:
        print(" [stopped]" if stopped else "", flush=True)


def stats_line(r, drafter: str, k: int) -> str:
    """The last reply: speed, tau, acceptance by position, time to first token, tokens prefilled."""
    s = r.stats
    decode = r.seconds - r.ttft
    rate = (s.new_tokens - 1) / decode if decode > 0 and s.new_tokens > 1 else 0.0
    line = (f"last reply: {s.new_tokens} tokens in {r.seconds:.2f} s ({rate:.1f} tok/s after the first) | "
            f"TTFT {r.ttft * 1000:.0f} ms | prefilled {r.prefilled} tokens ({s.cached_tokens} from the cache)")
    if drafter == "none":
        return line + " | plain decoding"
    acc = " ".join("-" if a is None else f"{a:.2f}" for a in s.acceptance_by_position)
    return line + f" | drafter {drafter} K={k} | tau {s.mean_accepted:.2f} | acceptance by position {acc}"

