"""Prometheus metrics of a server, on a registry of its own (several apps in one process, as in
the tests, never share counters)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from specdraft.speculative.request import GenerationResult

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("specdraft_requests", "HTTP requests by endpoint and status", ["endpoint", "status"],
                                registry=r)
        self.prompt_tokens = Counter("specdraft_prompt_tokens", "prompt tokens of finished requests", registry=r)
        self.generated = Counter("specdraft_generation_tokens", "tokens generated", registry=r)
        self.forwards = Counter("specdraft_target_forwards", "target forwards (prefill + verify rounds)", registry=r)
        self.finished = Counter("specdraft_finished_requests", "requests finished, by reason", ["reason"], registry=r)
        self.queue_depth = Gauge("specdraft_queue_depth", "requests waiting for a batch row", registry=r)
        self.batch_size = Gauge("specdraft_batch_size", "requests in the batch (prefilling or decoding)", registry=r)
        self.tau = Gauge("specdraft_mean_accepted_length",
                         "tokens per target forward over all finished requests (tau)", registry=r)
        self.drafted = Counter("specdraft_drafted_tokens", "drafts proposed, by draft position", ["position"],
                               registry=r)
        self.accepted = Counter("specdraft_accepted_tokens", "drafts accepted, by draft position", ["position"],
                                registry=r)
        self.phase = Counter("specdraft_phase_seconds", "engine time by phase (draft, verify, other)", ["phase"],
                             registry=r)
        self.latency = Histogram("specdraft_request_seconds", "time from arrival to the last token",
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("specdraft_time_to_first_token_seconds", "time from arrival to the first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self._phase_seen: dict[str, float] = {}
        self._tokens = self._forwards = 0  # for tau, without reading the counters back

    def observe_result(self, r: GenerationResult) -> None:
        s = r.stats
        self.finished.labels(r.finish_reason).inc()
        self.prompt_tokens.inc(len(r.prompt_ids))
        self.generated.inc(s.new_tokens)
        self.forwards.inc(s.target_forwards)
        for i, (d, a) in enumerate(zip(s.drafted_by_position, s.accepted_by_position)):
            self.drafted.labels(str(i + 1)).inc(d)
            self.accepted.labels(str(i + 1)).inc(a)
        self._tokens += s.new_tokens
        self._forwards += s.target_forwards
        self.tau.set(self._tokens / self._forwards if self._forwards else 0.0)
        if r.finish_reason != "abort":
            self.latency.observe(r.seconds)
            self.ttft.observe(r.ttft)

    def observe_engine(self, waiting: int, running: int, phase_totals: dict[str, float]) -> None:
        self.queue_depth.set(waiting)
        self.batch_size.set(running)
        for name, total in phase_totals.items():
            self.phase.labels(name).inc(max(0.0, total - self._phase_seen.get(name, 0.0)))
            self._phase_seen[name] = total

    def render(self) -> bytes:
        return generate_latest(self.registry)
