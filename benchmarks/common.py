"""What the HTTP client (bench.py) and the in-process studies share: one request's Timing,
a concurrency level's Result and its summary row, the progress line printed after each run,
the prompts of the chat and shared-prefix workloads, and time_call."""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass, field

# -- measurements -------------------------------------------------------------------------------


@dataclass
class Timing:
    """One request: seconds since it was sent."""

    ttft: float
    total: float
    tokens: int
    prompt_tokens: int = 0
    cached_tokens: int = 0
    text: str = ""
    arrivals: list[float] = field(default_factory=list)  # each token line's arrival, seconds since sent
    # The server's own time to first token (its summary's ttft_ms): from the request's arrival to
    # the first token drawn. Text can come later: bytes of an unfinished character are held back
    # (random weights' greedy ids are often such bytes), so `ttft` may count further steps.
    server_ttft: float | None = None

    @property
    def decode_rate(self) -> float:  # tokens after the first / time after the first
        return (self.tokens - 1) / (self.total - self.ttft) if self.tokens > 1 and self.total > self.ttft else 0.0

    @property
    def e2e_rate(self) -> float:
        return self.tokens / self.total


@dataclass
class Result:
    label: str
    mode: str  # http | in-process
    concurrency: int
    runs: list[list[Timing]] = field(default_factory=list)  # warm-up excluded
    wall: list[float] = field(default_factory=list)  # per run: first send to last done
    health_ms: list[float] = field(default_factory=list)
    peak_rss_gib: float | None = None

    def summary(self) -> dict:
        timings = [t for run in self.runs for t in run]
        latencies = sorted(t.total for t in timings)
        return {
            "label": self.label,
            "mode": self.mode,
            "concurrency": self.concurrency,
            "decode_tok_s": statistics.median(t.decode_rate for t in timings),
            "ttft_ms": statistics.median(t.ttft for t in timings) * 1000,
            "ttft_max_ms": max(t.ttft for t in timings) * 1000,
            "server_ttft_ms": median_ms([t.server_ttft for t in timings]),
            "e2e_tok_s": statistics.median(t.e2e_rate for t in timings),
            "p50_s": percentile(latencies, 50),
            "p95_s": percentile(latencies, 95),
            "aggregate_tok_s": statistics.median(
                sum(t.tokens for t in run) / wall for run, wall in zip(self.runs, self.wall, strict=False)
            ),
            "health_p50_ms": percentile(sorted(self.health_ms), 50) if self.health_ms else None,
            "health_p99_ms": percentile(sorted(self.health_ms), 99) if self.health_ms else None,
            "peak_rss_gib": self.peak_rss_gib,
            "requests": len(timings),
        }


def median_ms(seconds: list[float | None]) -> float | None:
    known = [s for s in seconds if s is not None]
    return statistics.median(known) * 1000 if known else None


def percentile(ordered: list[float], p: float) -> float:
    index = min(len(ordered) - 1, max(0, round(p / 100 * len(ordered) + 0.5) - 1))
    return ordered[index]


def progress(result: Result, run: int, timings: list[Timing], wall: float, warmup: bool) -> None:
    tokens = sum(t.tokens for t in timings)
    tag = "warm-up" if warmup else f"run {run}"
    print(
        f"[{result.mode} c={result.concurrency} {tag}] {len(timings)} requests, {tokens} tokens in {wall:.2f} s: "
        f"{tokens / wall:.1f} tok/s aggregate, TTFT {statistics.median(t.ttft for t in timings) * 1000:.1f} ms"
        + (f" (server's {server:.1f} ms)" if (server := median_ms([t.server_ttft for t in timings])) else ""),
        file=sys.stderr,
        flush=True,
    )


def time_call(fn) -> float:
    """Seconds one call of fn takes."""
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


# -- prompts: a growing chat, clients sharing a system prompt ------------------------------------

FILLER = (
    "Phi-2 is a Transformer with 2.7 billion parameters trained on synthetic and web data. "
    "Water boils at 100 degrees Celsius at sea level; it freezes at 0 degrees. "
    "Numbers like 3.14159, 2.71828 and 1.41421 are famous constants in mathematics. "
)
QUESTIONS = [
    "What is two plus two?",
    "How are you today?",
    "Why is the sky blue?",
    "Write a short poem about the sea.",
    "Name a famous constant.",
    "When does water boil?",
    "What is Phi-2?",
    "Tell me a story.",
]
