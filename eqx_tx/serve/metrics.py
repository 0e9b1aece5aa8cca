"""What a server counts, in Prometheus' text exposition format (`GET /metrics`).

The names follow vLLM's where they mean the same (`eqx_tx:` prefix): request counts
by endpoint and status, prompt and generated tokens, time to first token and
end-to-end latency as histograms, and the engine's gauges (requests waiting and
running, pages in use and cached, prefix-cache hit rate, preemptions). Counters only
grow; a scraper derives tokens/s with `rate()`. A recent-throughput gauge over the
last `window` seconds is given too, for a human reading the page.
"""

import collections
import threading
import time
from collections.abc import Mapping

# Histogram bucket bounds, seconds.
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class _Histogram:
    def __init__(self, buckets: tuple[float, ...]):
        self.buckets, self.counts, self.total, self.count = buckets, [0] * len(buckets), 0.0, 0

    def observe(self, value: float) -> None:
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += 1
        self.total += value
        self.count += 1

    def lines(self, name: str) -> list[str]:
        out = [f'{name}_bucket{{le="{b}"}} {c}' for b, c in zip(self.buckets, self.counts)]
        return out + [f'{name}_bucket{{le="+Inf"}} {self.count}', f"{name}_sum {self.total:.6f}",
                      f"{name}_count {self.count}"]


class ServerMetrics:
    """Thread-safe counters of one server (`window`: seconds of the recent-throughput gauge)."""

    def __init__(self, window: float = 10.0):
        self._lock = threading.Lock()
        self.window = window
        self.requests: collections.Counter[tuple[str, int]] = collections.Counter()
        self.prompt_tokens = self.generation_tokens = 0
        self.ttft = _Histogram(LATENCY_BUCKETS)
        self.latency = _Histogram(LATENCY_BUCKETS)
        self._recent: collections.deque[tuple[float, int]] = collections.deque()  # (time, tokens) of finished requests

    def finished(self, endpoint: str, status: int, *, prompt_tokens: int = 0, generated: int = 0,
                 ttft: float | None = None, latency: float | None = None) -> None:
        """Count one answered request."""
        now = time.monotonic()
        with self._lock:
            self.requests[(endpoint, status)] += 1
            self.prompt_tokens += prompt_tokens
            self.generation_tokens += generated
            if ttft is not None:
                self.ttft.observe(ttft)
            if latency is not None:
                self.latency.observe(latency)
            if generated:
                self._recent.append((now, generated))

    def recent_tokens_per_second(self) -> float:
        now = time.monotonic()
        with self._lock:
            while self._recent and self._recent[0][0] < now - self.window:
                self._recent.popleft()
            return sum(n for _, n in self._recent) / self.window

    def render(self, engine: Mapping[str, float]) -> str:
        """The exposition text: these counters and the engine's `stats()`."""
        rate = self.recent_tokens_per_second()
        with self._lock:
            lines = ["# HELP eqx_tx:requests_total Requests answered, by endpoint and HTTP status.",
                     "# TYPE eqx_tx:requests_total counter"]
            lines += [f'eqx_tx:requests_total{{endpoint="{e}",status="{s}"}} {n}'
                      for (e, s), n in sorted(self.requests.items())]
            lines += ["# HELP eqx_tx:prompt_tokens_total Prompt tokens of answered requests.",
                      "# TYPE eqx_tx:prompt_tokens_total counter", f"eqx_tx:prompt_tokens_total {self.prompt_tokens}",
                      "# HELP eqx_tx:generation_tokens_total Tokens generated for answered requests.",
                      "# TYPE eqx_tx:generation_tokens_total counter",
                      f"eqx_tx:generation_tokens_total {self.generation_tokens}",
                      "# HELP eqx_tx:time_to_first_token_seconds From a request's arrival to its first token.",
                      "# TYPE eqx_tx:time_to_first_token_seconds histogram"]
            lines += self.ttft.lines("eqx_tx:time_to_first_token_seconds")
            lines += ["# HELP eqx_tx:e2e_request_latency_seconds From a request's arrival to its answer.",
                      "# TYPE eqx_tx:e2e_request_latency_seconds histogram"]
            lines += self.latency.lines("eqx_tx:e2e_request_latency_seconds")
        gauges = {
            "num_requests_waiting": ("Engine requests waiting for a slot.", engine.get("waiting", 0)),
            "num_requests_running": ("Engine requests holding a slot.", engine.get("running", 0)),
            "kv_pages_total": ("Pages of the KV page pool.", engine.get("pages", 0)),
            "kv_pages_in_use": ("Pages in running requests' page tables.", engine.get("pages_in_use", 0)),
            "kv_pages_cached": ("Unreferenced pages kept for the prefix cache.", engine.get("pages_cached", 0)),
            "prefix_cache_hit_rate": ("Share of admitted prompt tokens served from the prefix cache.",
                                      engine.get("hit_rate", 0.0)),
            "recent_generation_tokens_per_second": (f"Tokens generated per second over the last {self.window:g} s.",
                                                    rate),
        }
        for name, (help_text, value) in gauges.items():
            lines += [f"# HELP eqx_tx:{name} {help_text}", f"# TYPE eqx_tx:{name} gauge", f"eqx_tx:{name} {value}"]
        lines += ["# HELP eqx_tx:num_preemptions_total Requests preempted for lack of pages.",
                  "# TYPE eqx_tx:num_preemptions_total counter",
                  f"eqx_tx:num_preemptions_total {engine.get('preemptions', 0)}"]
        return "\n".join(lines) + "\n"
