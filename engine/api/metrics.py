"""What the head counts, and ``GET /metrics`` in the Prometheus text format (0.0.4).

Counters and the time-to-first-token histogram live here, per head process;
the fleet gauges (queue, lanes, KV occupancy) are read from the fleet at scrape
time. No client library: the text format is small and written out directly.
"""

from __future__ import annotations

import bisect
import math
from collections import defaultdict
from typing import Any

from aiohttp import web

from engine.api.context import HEAD

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# seconds from a request's arrival to its first token: CPU prefill can take minutes
TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
MAX_LABEL_SETS = 2_000  # bounds the label sets a scanner of random paths can create


class ApiMetrics:
    def __init__(self) -> None:
        self.requests: dict[tuple[str, str, int], int] = defaultdict(int)
        self.prompt_tokens: dict[str, int] = defaultdict(int)
        self.completion_tokens: dict[str, int] = defaultdict(int)
        self.cached_tokens: dict[str, int] = defaultdict(int)
        self.stream_errors: dict[str, int] = defaultdict(int)
        self.refused: dict[str, int] = defaultdict(int)  # 401/403/429 by reason
        self.keepalives = 0
        self.in_flight = 0
        self._ttft_counts = [0] * (len(TTFT_BUCKETS) + 1)
        self._ttft_sum = 0.0
        self._ttft_count = 0

    def request(self, route: str, method: str, status: int) -> None:
        key = (route, method, status)
        if key not in self.requests and len(self.requests) >= MAX_LABEL_SETS:
            key = ("other", method, status)
        self.requests[key] += 1

    def ttft(self, seconds: float) -> None:
        if not math.isfinite(seconds) or seconds < 0:
            return
        self._ttft_counts[bisect.bisect_left(TTFT_BUCKETS, seconds)] += 1
        self._ttft_sum += seconds
        self._ttft_count += 1

    def tokens(self, model: str, prompt: int, completion: int, cached: int = 0) -> None:
        self.prompt_tokens[model] += prompt
        self.completion_tokens[model] += completion
        self.cached_tokens[model] += cached

    def render(self, head: Any) -> str:
        out = _Writer()
        out.family("shoal_requests_total", "counter",
                   "HTTP requests answered, by route, method and status")
        for (route, method, status), n in sorted(self.requests.items()):
            out.sample("shoal_requests_total", n,
                       route=route, method=method, status=str(status))
        out.family("shoal_requests_in_flight", "gauge", "HTTP requests being answered now")
        out.sample("shoal_requests_in_flight", self.in_flight)
        out.family("shoal_refused_total", "counter",
                   "requests refused before any work, by reason")
        for reason, n in sorted(self.refused.items()):
            out.sample("shoal_refused_total", n, reason=reason)
        for name, what, table in (
                ("shoal_prompt_tokens_total", "prompt tokens of finished requests",
                 self.prompt_tokens),
                ("shoal_completion_tokens_total", "tokens generated for finished requests",
                 self.completion_tokens),
                ("shoal_cached_prompt_tokens_total",
                 "prompt tokens served from a node's prompt cache", self.cached_tokens)):
            out.family(name, "counter", what)
            for model, n in sorted(table.items()):
                out.sample(name, n, model=model)
        out.family("shoal_stream_errors_total", "counter",
                   "failures reported inside an answer already begun, by code")
        for code, n in sorted(self.stream_errors.items()):
            out.sample("shoal_stream_errors_total", n, code=code)
        out.family("shoal_keepalives_total", "counter",
                   "keepalive writes (SSE comments or leading whitespace)")
        out.sample("shoal_keepalives_total", self.keepalives)
        name = "shoal_time_to_first_token_seconds"
        out.family(name, "histogram", "time from a request's arrival to its first token")
        cumulative = 0
        for bound, n in zip(TTFT_BUCKETS, self._ttft_counts, strict=False):
            cumulative += n
            out.sample(name + "_bucket", cumulative, le=_num(bound))
        out.sample(name + "_bucket", self._ttft_count, le="+Inf")
        out.sample(name + "_sum", self._ttft_sum)
        out.sample(name + "_count", self._ttft_count)
        _fleet(out, head)
        return out.text()


def _fleet(out: _Writer, head: Any) -> None:
    runner = head.runner
    out.family("shoal_queue_length", "gauge", "requests waiting for a free lane")
    out.sample("shoal_queue_length", runner.queued)
    out.family("shoal_session_moves_total", "counter",
               "sessions moved to another node after a node failed")
    out.sample("shoal_session_moves_total", runner.moves_total)
    out.family("shoal_placement_seconds", "summary",
               "time the head spent deciding where sessions go (views of every node and "
               "the policy)")
    out.sample("shoal_placement_seconds_sum", runner.placement_s)
    out.sample("shoal_placement_seconds_count", runner.placements)
    pools = list(head.fleet.pools.values())
    rows = [(p, p.describe()) for p in pools]
    gauges = (("shoal_node_up", "gauge", "1 when the node is ready to take sessions"),
              ("shoal_node_lanes", "gauge", "lanes (parallel sessions) a node offers"),
              ("shoal_node_lanes_busy", "gauge", "lanes busy on a node, all heads together"),
              ("shoal_node_kv_used", "gauge", "KV cache cells in use on a node"),
              ("shoal_node_kv_total", "gauge", "KV cache cells a node has"),
              ("shoal_node_kv_parked", "gauge",
               "KV cache cells a node's parked prompt prefixes hold (within kv_used; a new "
               "session may reclaim them)"),
              ("shoal_node_own_sessions", "gauge", "this head's sessions on a node"),
              ("shoal_node_sessions_total", "counter", "sessions this head placed on a node"),
              ("shoal_node_memory_used_bytes", "gauge",
               "bytes of memory a node holds now (0: it did not say)"),
              ("shoal_node_memory_budget_bytes", "gauge",
               "bytes of memory a node keeps within (0: it did not say)"),
              ("shoal_node_gpu_layers", "gauge",
               "layers of a node's model on its GPU (0: all on the CPU)"),
              ("shoal_node_model_layers", "gauge",
               "layers of a node's model, its output layer counted (0: it did not say)"))
    keys = {"shoal_node_up": None, "shoal_node_lanes": "lanes",
            "shoal_node_lanes_busy": "lanes_busy", "shoal_node_kv_used": "kv_used",
            "shoal_node_kv_total": "kv_total", "shoal_node_kv_parked": "kv_parked",
            "shoal_node_own_sessions": "own_sessions",
            "shoal_node_sessions_total": "sessions_total",
            "shoal_node_memory_used_bytes": "mem_used",
            "shoal_node_memory_budget_bytes": "mem_budget",
            "shoal_node_gpu_layers": "gpu_layers", "shoal_node_model_layers": "model_layers"}
    labelled = [(p, d, {"node": str(d.get("identity") or p.address), "address": str(p.address),
                        "model": str(d.get("model") or "")}) for p, d in rows]
    for name, kind, what in gauges:
        out.family(name, kind, what)
        for _pool, d, labels in labelled:
            key = keys[name]
            value = (1 if d.get("state") == "ready" else 0) if key is None else d.get(key)
            out.sample(name, _as_number(value), **labels)
    name = "shoal_node_prompt_tokens_total"
    out.family(name, "counter", "prompt tokens a node has served, by where they came from: "
               "reused from a lane (lane), restored from its host-memory cache (host), "
               "prefilled (prefill); as the node counts them since it started")
    for _pool, d, labels in labelled:
        for source, key in (("lane", "prompt_from_lanes"), ("host", "prompt_from_host"),
                            ("prefill", "prompt_prefilled")):
            out.sample(name, _as_number(d.get(key)), **labels, source=source)
    ready = [d for _p, d in rows if d.get("state") == "ready"]
    out.family("shoal_lanes", "gauge", "lanes of the ready nodes")
    out.sample("shoal_lanes", sum(_as_number(d.get("lanes")) for d in ready))
    out.family("shoal_lanes_busy", "gauge", "busy lanes of the ready nodes")
    out.sample("shoal_lanes_busy", sum(_as_number(d.get("lanes_busy")) for d in ready))
    out.family("shoal_kv_used", "gauge", "KV cache cells in use on the ready nodes")
    out.sample("shoal_kv_used", sum(_as_number(d.get("kv_used")) for d in ready))
    out.family("shoal_kv_total", "gauge", "KV cache cells of the ready nodes")
    out.sample("shoal_kv_total", sum(_as_number(d.get("kv_total")) for d in ready))


def _as_number(value: object) -> float:
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, int | float):
        return float(value)
    return 0.0


def _num(v: float) -> str:
    if isinstance(v, int):
        return str(v)
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    if math.isnan(v):
        return "NaN"
    if v.is_integer() and abs(v) < 1e15:
        return str(int(v))
    return repr(v)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


class _Writer:
    def __init__(self) -> None:
        self._lines: list[str] = []

    def family(self, name: str, kind: str, what: str) -> None:
        self._lines.append(f"# HELP {name} {what}")
        self._lines.append(f"# TYPE {name} {kind}")

    def sample(self, name: str, value: float, **labels: str) -> None:
        if labels:
            inner = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
            self._lines.append(f"{name}{{{inner}}} {_num(value)}")
        else:
            self._lines.append(f"{name} {_num(value)}")

    def text(self) -> str:
        return "\n".join(self._lines) + "\n"


METRICS: web.AppKey[ApiMetrics] = web.AppKey("metrics", ApiMetrics)


async def metrics_route(request: web.Request) -> web.Response:
    text = request.app[METRICS].render(request.app[HEAD])
    return web.Response(body=text.encode(), headers={"Content-Type": CONTENT_TYPE})
