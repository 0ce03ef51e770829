"""``python -m qil_worker serve``: the lead's ``__main__`` calls ``add_serve_parser`` and
``run_serve``. Torch-free: the model is loaded by the worker process only."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

from qil_client.cli_help import DefaultsHelpFormatter
from qil_worker.attention.names import ATTENTION_CHOICES
from qil_worker.cli_args import byte_size, fraction, non_negative_int, port_number, positive_int, positive_seconds
from qil_worker.engine.config import EngineConfig  # torch-free
from qil_worker.engine.schedule_policy import MAX_BYPASS, SCHEDULE_POLICIES
from qil_worker.huge_page_malloc import with_huge_page_malloc
from qil_worker.task import TASKS
from qil_worker.quantization import QUANTIZE_CHOICES
from qil_worker.service.front import limits
from qil_worker.service import logs
from qil_worker.service.front.front import FrontConfig
from qil_worker.service.protocol import WorkerConfig
from qil_worker.service.front.server import ServeConfig, serve


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
ENGINE = EngineConfig()  # the engine's defaults, which the flags start from


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "serve",
        help="serve a model over gRPC (qil.v1.Inference)",
        description="Serve a Qwen3 model over gRPC. Without --model, serves the embedded demo "
        "model (random weights, meaningless outputs) so the quick start needs no download.",
        formatter_class=DefaultsHelpFormatter,
    )
    add_serve_arguments(p)
    p.set_defaults(func=run_serve, run=run_serve)
    return p


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    """The serve flags, in groups: what the worker loads, how its engine runs, the front,
    the network and its security, logs and metrics, the HTTP API."""
    _add_model_arguments(p.add_argument_group('the model (the worker loads it)'))
    _add_engine_arguments(p.add_argument_group("the KV cache and the scheduler (the worker's engine)"))
    _add_text_arguments(p.add_argument_group('text and structured output'))
    _add_front_arguments(p.add_argument_group('the front: admission, restarts, finished requests'))
    _add_network_arguments(p.add_argument_group('ports, TLS and auth'))
    _add_observability_arguments(p.add_argument_group('logs and metrics'))
    _add_http_arguments(p.add_argument_group('the OpenAI-compatible HTTP API'))


def _add_model_arguments(p: argparse._ArgumentGroup) -> None:
    p.add_argument("--model", default=None, help="Qwen3 checkpoint directory (default: the embedded demo)")
    p.add_argument("--device", default="cpu", help="where the worker runs the model: cpu, cuda or cuda:N")
    p.add_argument("--dtype", default=None, help="float32, bfloat16, float16 or auto = the checkpoint's (default: bfloat16 on CUDA, float32 otherwise)")
    p.add_argument("--threads", type=positive_int, default=None,
                   help="torch threads in the worker (default: torch's, one per core)")
    p.add_argument("--tensor-parallel-size", type=positive_int, default=1,
                   help="split the model over N rank processes (gloo on CPU, NCCL on CUDA; --threads "
                   "each); --kv-memory-* sizes the pool on every rank, and the fewest pages are taken")
    p.add_argument("--nnodes", type=positive_int, default=1,
                   help="machines the --tensor-parallel-size ranks are spread over (as many on each); "
                   "node 0 serves, the others run ranks only")
    p.add_argument("--node-rank", type=non_negative_int, default=0,
                   help="this machine's place among --nnodes (0 serves gRPC/HTTP)")
    p.add_argument("--dist-init-addr", default=None, metavar="HOST:PORT",
                   help="with --nnodes > 1: node 0's address and a free port where the ranks meet "
                   "(torch.distributed's TCP store, hosted by node 0's first rank)")
    p.add_argument(
        "--quantize", choices=QUANTIZE_CHOICES, default="none",
        help="store the linear weights quantized at load: int8 = per-output-channel int8, "
        "activations in --dtype (half of bfloat16's weight bytes; CPU, or CUDA where torch has "
        "the kernel); int4 / int4-g32 = group-wise asymmetric 4-bit, one scale and zero per 128 / "
        "32 inputs (a quarter of bfloat16's bytes; a projection whose inputs are not whole groups "
        "stays int8); none = as loaded in --dtype",
    )
    p.add_argument("--no-compile", action="store_true",
                   help="run every kernel eagerly: do not compile, at load, the CPU kernels that measure "
                   "faster compiled (int8 experts' decode steps of a Qwen3-MoE; needs a C++ compiler)")
    p.add_argument("--compile-decode", action="store_true",
                   help="CPU: run a lone request's decode steps through the model's forward compiled by "
                   "inductor (faster per token, see docs/performance.md; compiled before the server is "
                   "ready, which takes minutes for a real model on a few cores; needs a C++ compiler)")
    p.add_argument(
        "--task", choices=TASKS, default="auto",
        help="what the server is for: auto = embed for an embedding checkpoint (no LM head, or a "
        "sentence-transformers directory), else generate (which also serves Embed and Rerank); "
        "generate, embed or rerank = only those requests, the others refused",
    )


def _add_engine_arguments(p: argparse._ArgumentGroup) -> None:
    pool = p.add_mutually_exclusive_group()
    pool.add_argument("--num-pages", type=positive_int, default=ENGINE.num_pages, help="KV pages")
    pool.add_argument(
        "--kv-memory-bytes", type=byte_size, default=None, metavar="N",
        help="size the KV pool from a byte budget instead of --num-pages (e.g. 4GiB, 512MiB, 1e9)",
    )
    pool.add_argument(
        "--kv-memory-fraction", type=fraction, default=None, metavar="F",
        help="size the KV pool from this fraction of the free device memory after loading the "
        "model, less the activation peak of a --token-budget step (CUDA only)",
    )
    p.add_argument("--page-size", type=positive_int, default=ENGINE.page_size, help="tokens per KV page")
    p.add_argument("--token-budget", type=positive_int, default=ENGINE.token_budget,
                   help="tokens computed per engine step, all requests together")
    p.add_argument("--prefill-chunk", type=positive_int, default=ENGINE.prefill_chunk,
                   help="prompt tokens of one request per step at most")
    p.add_argument("--max-active", type=positive_int, default=ENGINE.max_active,
                   help="requests running at once; more wait in the queue")
    p.add_argument(
        "--schedule-policy", choices=SCHEDULE_POLICIES, default=ENGINE.schedule_policy,
        help="order in which waiting requests are admitted: fcfs (arrival order), or "
        "shortest-first (fewest tokens left to compute after the cached prefix; lower mean TTFT "
        "under bursts, a request is overtaken at most %d times)" % MAX_BYPASS,
    )
    p.add_argument(
        "--no-prefix-cache", action="store_true",
        help="do not reuse the KV of shared prompt prefixes (on by default)",
    )
    p.add_argument(
        "--attention", choices=ATTENTION_CHOICES, default=ENGINE.attention,
        help="attention backend: auto (CUDA: the fastest at start-up of the varlen kernels this build "
        "runs and gather + SDPA), sdpa, varlen (paged varlen flash attention), varlen-packed "
        "(varlen flash attention over keys gathered without padding), or varlen-pages (decode rows "
        "attended page by page in place, for builds without a block table)",
    )
    p.add_argument(
        "--no-cuda-graphs", action="store_true",
        help="run every step eagerly instead of replaying captured CUDA graphs (CUDA only)",
    )
    p.add_argument(
        "--step-graphs", action=argparse.BooleanOptionalAction, default=None,
        help="replay steps with prefill chunks from CUDA graphs too, padded to buckets (varlen attention "
        "backends only; off by default: they measured slower than eager mixed steps on an H200)",
    )
    p.add_argument(
        "--no-overlap", action="store_true",
        help="read each step's tokens before scheduling the next, instead of scheduling it while "
        "the device computes (overlapped scheduling: on by default on CUDA, off elsewhere)",
    )


def _add_text_arguments(p: argparse._ArgumentGroup) -> None:
    tok = p.add_mutually_exclusive_group()
    tok.add_argument(
        "--tokenizer", default=None, metavar="DIR",
        help="tokenizer directory (default: the model directory's, when it has one and the "
        "'text' extra is installed)",
    )
    tok.add_argument(
        "--no-tokenizer", action="store_true",
        help="serve token ids only (requests with text, messages or stop strings fail)",
    )
    p.add_argument(
        "--no-structured-warmup", action="store_true",
        help="build the grammar library's token tables at the first constrained request instead "
        "of while the worker starts (1-2 s at a 151k vocabulary, before it reports ready); saves "
        "their memory (~110-180 MB at 151k) in a server that never sees one, but that first "
        "request waits for them and other streams stall meanwhile (the build holds the GIL)",
    )


def _add_front_arguments(p: argparse._ArgumentGroup) -> None:
    p.add_argument(
        "--max-queued", type=non_negative_int, default=1024,
        help="unfinished requests admitted beyond --max-active; more is RESOURCE_EXHAUSTED",
    )
    p.add_argument("--grace-seconds", type=float, default=10.0,
                   help="on SIGTERM/SIGINT, time for requests in flight to finish before they are cancelled")
    p.add_argument("--max-restarts", type=non_negative_int, default=5,
                   help="worker restarts in a row before the server gives up (health stays NOT_SERVING)")
    p.add_argument(
        "--retain-finished", type=non_negative_int, default=limits.RETAIN_FINISHED,
        help="finished requests kept for late subscribers (at most this many...)",
    )
    p.add_argument(
        "--retain-seconds", type=float, default=limits.RETAIN_SECONDS,
        help="...and for at most this long...",
    )
    p.add_argument(
        "--retain-tokens", type=non_negative_int, default=limits.RETAIN_TOKENS,
        help="...and at most this many output tokens in all (top logprobs count too)",
    )
    p.add_argument(
        "--max-stream-backlog", type=non_negative_int, default=limits.MAX_STREAM_BACKLOG, metavar="TOKENS",
        help="a streaming call whose client falls more than this many tokens behind (with one "
        "write stuck for a second) ends with "
        "RESOURCE_EXHAUSTED and its requests are cancelled (0: no bound)",
    )


def _add_network_arguments(p: argparse._ArgumentGroup) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: all interfaces)")
    p.add_argument("--port", type=port_number, default=50051, help="gRPC port; 0 picks a free one (printed at start)")
    p.add_argument(
        "--auth-token", default=None,
        help="require 'authorization: Bearer TOKEN' (default: $QIL_AUTH_TOKEN; unset: no auth)",
    )
    p.add_argument(
        "--open-reflection", action="store_true",
        help="with an auth token: answer server reflection without it too (grpcurl can then list "
        "the services and call health without the token; the other RPCs still need it)",
    )
    p.add_argument("--tls-cert", default=None, help="PEM certificate chain (enables TLS; default: plaintext)")
    p.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    p.add_argument("--tls-client-ca", default=None,
                   help="PEM CA; requires client certificates signed by it (mutual TLS; default: none asked)")



def _add_observability_arguments(p: argparse._ArgumentGroup) -> None:
    p.add_argument("--log-level", type=str.upper, choices=LOG_LEVELS, default="INFO",
                   help="of both processes")
    p.add_argument(
        "--log-format", choices=logs.FORMATS, default="text",
        help="text, or json: one JSON object per line (ts, level, logger, message, process, request_id)",
    )
    p.add_argument(
        "--metrics-port", type=port_number, default=None,
        help="serve Prometheus metrics at http://HOST:PORT/metrics (needs prometheus_client; "
        "default: off)",
    )
    p.add_argument("--metrics-host", default=None, help="address of the metrics endpoint (default: --host)")


def _add_http_arguments(p: argparse._ArgumentGroup) -> None:
    p.add_argument(
        "--http-port", type=port_number, default=None,
        help="also serve the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, "
        "/v1/models, /health; /metrics with --metrics-port) on this port, same front and auth "
        "(needs aiohttp: pip install 'qil[http]'; default: off)",
    )
    p.add_argument("--http-host", default=None, help="address of the HTTP API (default: --host)")
    p.add_argument(
        "--http-max-connections", type=positive_int, default=limits.HTTP_MAX_CONNECTIONS, metavar="N",
        help="HTTP connections held at once, at most half of the descriptor limit (ulimit -n) less the listen backlog; one "
        "more is answered 503 and closed",
    )
    p.add_argument(
        "--http-header-timeout", type=positive_seconds, default=limits.HTTP_HEADER_TIMEOUT_S, metavar="S",
        help="an HTTP connection that has not sent a request's line and headers within S seconds "
        "(of its connect, or of the next request's first byte) is closed",
    )
    p.add_argument(
        "--http-keepalive-timeout", type=positive_seconds, default=limits.HTTP_KEEPALIVE_TIMEOUT_S,
        metavar="S", help="an idle kept-alive HTTP connection is closed after S seconds",
    )
    p.add_argument(
        "--served-model-name", default=None,
        help="the model's name in the HTTP API (default: the model directory's name; qil-demo "
        "for the embedded demo)",
    )


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The engine flags → the worker's ``EngineConfig`` (an unset switch: the engine's default)."""
    return EngineConfig(
        num_pages=args.num_pages,
        page_size=args.page_size,
        token_budget=args.token_budget,
        prefill_chunk=args.prefill_chunk,
        max_active=args.max_active,
        prefix_cache=not args.no_prefix_cache,
        schedule_policy=args.schedule_policy,
        attention=args.attention,
        cuda_graphs=False if args.no_cuda_graphs else None,
        step_graphs=args.step_graphs,
        overlap=False if args.no_overlap else None,
        compile_decode=args.compile_decode,
    )


def worker_config(args: argparse.Namespace) -> WorkerConfig:
    return WorkerConfig(
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        threads=args.threads,
        quantize=None if args.quantize == "none" else args.quantize,
        compile=not args.no_compile,
        task=args.task,
        engine=engine_config(args),
        kv_memory_bytes=args.kv_memory_bytes,
        kv_memory_fraction=args.kv_memory_fraction,
        tokenizer=args.tokenizer,
        use_tokenizer=not args.no_tokenizer,
        structured_warmup=not args.no_structured_warmup,
        tensor_parallel_size=args.tensor_parallel_size,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        dist_init_addr=args.dist_init_addr,
        log_level=args.log_level.upper(),
        log_format=args.log_format,
    )


def config_from_args(args: argparse.Namespace) -> ServeConfig:
    """The serve flags → the one ``ServeConfig`` (its front's, its worker's and its engine's
    configs inside), made once."""
    token = args.auth_token if args.auth_token is not None else os.environ.get("QIL_AUTH_TOKEN")
    return ServeConfig(
        host=args.host,
        port=args.port,
        grace_seconds=args.grace_seconds,
        auth_token=token or None,
        open_reflection=args.open_reflection,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        tls_client_ca=args.tls_client_ca,
        metrics_port=args.metrics_port,
        metrics_host=args.metrics_host,
        http_port=args.http_port,
        http_host=args.http_host,
        http_max_connections=args.http_max_connections,
        http_header_timeout=args.http_header_timeout,
        http_keepalive_timeout=args.http_keepalive_timeout,
        served_model_name=args.served_model_name,
        front=FrontConfig(
            worker=worker_config(args),
            max_queued=args.max_queued,
            max_restarts=args.max_restarts,
            retain_finished=args.retain_finished,
            retain_seconds=args.retain_seconds,
            retain_tokens=args.retain_tokens,
            max_stream_backlog=args.max_stream_backlog,
        ),
    )


def nodes_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with the several-node flags, or None."""
    if args.nnodes == 1:
        if args.node_rank != 0 or args.dist_init_addr is not None:
            return "--node-rank and --dist-init-addr are for --nnodes > 1"
        return None
    if args.node_rank >= args.nnodes:
        return f"--node-rank {args.node_rank} is not below --nnodes {args.nnodes}"
    if args.tensor_parallel_size % args.nnodes:
        return (f"--tensor-parallel-size {args.tensor_parallel_size} does not split evenly over "
                f"--nnodes {args.nnodes}")
    host, _, port = (args.dist_init_addr or "").rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        return f"--nnodes > 1 needs --dist-init-addr HOST:PORT (got {args.dist_init_addr!r})"
    return None


def run_serve(args: argparse.Namespace) -> int:
    logs.setup(args.log_level.upper(), args.log_format)
    if args.metrics_port is not None:
        from qil_worker.service.front.metrics import MetricsUnavailable, require_prometheus

        try:
            require_prometheus()
        except MetricsUnavailable as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    if args.http_port is not None:
        try:
            import aiohttp  # noqa: F401
        except ImportError:
            print("error: --http-port needs aiohttp: pip install 'qil[http]' (or pip install aiohttp)",
                  file=sys.stderr)
            return 2
    if (args.tls_cert is None) != (args.tls_key is None):
        print("error: --tls-cert and --tls-key go together", file=sys.stderr)
        return 2
    if args.tls_client_ca is not None and args.tls_cert is None:
        # client certificates are a TLS feature: without it the server would run in plaintext
        print("error: --tls-client-ca needs --tls-cert and --tls-key", file=sys.stderr)
        return 2
    why = nodes_problem(args)
    if why is not None:
        print(f"error: {why}", file=sys.stderr)
        return 2
    config = config_from_args(args)
    # read by glibc when the worker process starts: the front spawns it with this environment
    os.environ.update(with_huge_page_malloc(os.environ, args.device))
    if args.node_rank > 0:  # ranks only: node 0 serves
        from qil_worker.service.worker.node import serve_node

        return serve_node(config.front.worker, announce=lambda line: print(line, flush=True))

    def announce(line: str) -> None:
        print(line, flush=True)

    return asyncio.run(serve(config, announce=announce))


def main(argv: list[str] | None = None) -> int:
    """Standalone entry (``python -m qil_worker.service``), same as ``qil_worker serve``."""
    parser = argparse.ArgumentParser(prog="python -m qil_worker.service", formatter_class=DefaultsHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    add_serve_parser(sub)
    args = parser.parse_args(argv)
    return args.func(args)
