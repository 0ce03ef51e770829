"""Prometheus metrics of the server, served by the front process (``--metrics-port``).

``prometheus_client`` is imported only when metrics are asked for, so the server runs without it
(``pip install 'qil[metrics]'``). Each ``Metrics`` has its own registry, so several servers in one
process (tests) do not collide.

Sources: the worker's per-step ``StepBatch`` (running/waiting requests, page pool, step time,
batch size) and each request's final record (tokens, finish reason, TTFT, ITL, queue and
end-to-end time, preemptions); the front counts worker restarts.

An inference gateway's endpoint picker (the Kubernetes Gateway API Inference Extension, llm-d)
routes on three gauges of its model-server protocol, told their names by configuration
(docs/deploy.md): queued requests (``qil_requests_waiting``), running requests
(``qil_requests_running``) and the fraction of the KV cache in use, 0 to 1
(``qil_kv_cache_usage_ratio``); its prefix scorer reads the page size and count from the labels
``block_size`` and ``num_gpu_blocks`` of an info gauge (``qil_cache_config_info``), the label
names vLLM's ``cache_config_info`` uses, which the picker expects.
"""

from __future__ import annotations

import logging

from qil_worker.service import protocol as P

log = logging.getLogger("qil.metrics")

MISSING = (
    "--metrics-port needs the prometheus_client package: pip install 'qil[metrics]' "
    "(or pip install prometheus_client)"
)

LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
    120.0, 300.0,
)
ITL_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0,
    2.5, 5.0,
)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


class MetricsUnavailable(RuntimeError):
    pass


def require_prometheus():
    try:
        import prometheus_client
    except ImportError as exc:
        raise MetricsUnavailable(MISSING) from exc
    return prometheus_client


class Metrics:
    def __init__(self) -> None:
        pc = require_prometheus()
        self._pc = pc
        self.registry = r = pc.CollectorRegistry()
        self._http = None
        G, C, H = pc.Gauge, pc.Counter, pc.Histogram
        self.running = G("qil_requests_running", "Requests being computed (worker's last step)", registry=r)
        self.waiting = G("qil_requests_waiting", "Requests waiting for pages or a batch slot", registry=r)
        self.unfinished = G("qil_requests_unfinished", "Requests admitted by the front and not over", registry=r)
        self.pages_total = G("qil_kv_pages_total", "Pages of the KV pool", registry=r)
        self.pages_used = G("qil_kv_pages_used", "KV pages held by requests", registry=r)
        self.pages_free = G("qil_kv_pages_free", "KV pages free (cached ones included)", registry=r)
        self.pages_cached = G("qil_kv_pages_cached", "Free KV pages kept for their prompt prefix", registry=r)
        self.kv_usage = G("qil_kv_cache_usage_ratio",
                          "Fraction of the KV pool's pages held by requests (0 to 1)", registry=r)
        self.cache_config = G("qil_cache_config_info",
                              "The KV pool's page size in tokens and its page count (value 1)",
                              ["block_size", "num_gpu_blocks"], registry=r)
        self.finished = C(
            "qil_requests_finished", "Requests over, by finish reason", ["reason"], registry=r
        )
        self.prompt_tokens = C("qil_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = C(
            "qil_generation_tokens", "Output tokens of finished requests", registry=r
        )
        self.preemptions = C("qil_preemptions", "Preemptions of finished requests", registry=r)
        self.restarts = C("qil_worker_restarts", "Worker processes restarted after a death", registry=r)
        self.stream_backlog = C(
            "qil_streams_backlog_exceeded", "Streams ended because their reader fell behind", registry=r
        )
        self.ttft = H("qil_time_to_first_token_seconds", "Arrival to first token", registry=r,
                      buckets=LATENCY_BUCKETS)
        self.itl = H("qil_inter_token_latency_seconds", "Mean inter-token latency of a request",
                     registry=r, buckets=ITL_BUCKETS)
        self.queue = H("qil_queue_time_seconds", "Arrival to first scheduled", registry=r,
                       buckets=LATENCY_BUCKETS)
        self.e2e = H("qil_e2e_seconds", "Arrival to finish", registry=r, buckets=LATENCY_BUCKETS)
        self.step = H("qil_step_seconds", "Worker time of one engine step", registry=r,
                      buckets=LATENCY_BUCKETS)
        self.batch = H("qil_batch_size", "Requests with events in one engine step", registry=r,
                       buckets=BATCH_BUCKETS)
        for reason in P.FinishReason:
            self.finished.labels(reason.label)  # export zeros from the start

    # -- hooks of the front ----------------------------------------------------------------

    def on_worker(self, info: P.WorkerInfo) -> None:
        """A worker is ready: its pool's shape (a restarted worker may size it differently)."""
        self.cache_config.clear()
        self.cache_config.labels(str(info.page_size), str(info.stats.pages_total)).set(1)

    def on_stats(self, stats: P.PoolStats, num_unfinished: int) -> None:
        self.pages_total.set(stats.pages_total)
        self.kv_usage.set(stats.pages_used / stats.pages_total if stats.pages_total else 0.0)
        self.pages_used.set(stats.pages_used)
        self.pages_free.set(stats.pages_free)
        self.pages_cached.set(stats.pages_cached)
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.unfinished.set(num_unfinished)

    def on_step(self, step: P.StepTiming | None) -> None:
        if step is None:
            return
        self.step.observe(step.seconds)
        self.batch.observe(step.batch_size)

    def on_finished(
        self, reason: str, prompt_tokens: int, output_tokens: int, metrics: P.RequestTimings | None
    ) -> None:
        self.finished.labels(reason).inc()
        self.prompt_tokens.inc(max(prompt_tokens, 0))
        self.generation_tokens.inc(max(output_tokens, 0))
        if metrics is None:
            return
        for hist, value in ((self.queue, metrics.queue_time_s), (self.ttft, metrics.ttft_s),
                            (self.itl, metrics.mean_itl_s), (self.e2e, metrics.e2e_s)):
            if value is not None:
                hist.observe(value)
        if metrics.num_preemptions:
            self.preemptions.inc(metrics.num_preemptions)

    def on_restart(self) -> None:
        self.restarts.inc()

    def on_backlog_exceeded(self) -> None:
        self.stream_backlog.inc()

    # -- the HTTP endpoint -----------------------------------------------------------------

    def exposition(self) -> tuple[bytes, str]:
        """The registry in Prometheus' text format, and its content type (for /metrics served
        beside the HTTP API)."""
        return self._pc.generate_latest(self.registry), self._pc.CONTENT_TYPE_LATEST

    def serve(self, host: str, port: int) -> None:
        """``GET /metrics`` on ``host:port`` from a daemon thread."""
        result = self._pc.start_http_server(port, addr=host, registry=self.registry)
        self._http = result[0] if isinstance(result, tuple) else None
        if self._http is not None:  # port 0: the one the system picked
            port = self._http.server_port
        log.info("metrics on http://%s:%d/metrics", f"[{host}]" if ":" in host else host, port)

    def close(self) -> None:
        if self._http is not None:
            try:
                self._http.shutdown()
                self._http.server_close()
            except Exception:  # noqa: BLE001
                pass
            self._http = None
