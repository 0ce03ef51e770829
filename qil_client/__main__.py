"""``python -m qil_client --target HOST:PORT generate --token-ids '[1,2,3]'``.

Commands: generate (streams tokens, then prints the metrics), submit, cancel, events, info, health.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from qil_client import Client, QilError, TLS
from qil_client.results import ResultBuilder


def _ids(text: str) -> list[int]:
    value = json.loads(text)
    if not isinstance(value, list) or not all(isinstance(v, int) for v in value):
        raise argparse.ArgumentTypeError("expected a JSON list of integers, e.g. '[1,2,3]'")
    return value


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m qil_client", description="qil gRPC client")
    p.add_argument("--target", default="127.0.0.1:50051",
                   help="HOST:PORT, several comma-separated, or dns:///name:port")
    p.add_argument("--token", default=os.environ.get("QIL_AUTH_TOKEN"), help="bearer token ($QIL_AUTH_TOKEN)")
    p.add_argument("--tls", action="store_true", help="use TLS")
    p.add_argument("--tls-ca", default=None, help="PEM CA to check the server with")
    p.add_argument("--timeout", type=float, default=None, help="deadline of the call, seconds")
    p.add_argument("--wait-ready", type=float, default=30.0, help="wait this long for SERVING (0: no wait)")
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate and stream the tokens")
    s = sub.add_parser("submit", help="queue a request; prints its id")
    for q in (g, s):
        q.add_argument("--token-ids", type=_ids, required=True, help="JSON list, e.g. '[1,2,3]'")
        q.add_argument("--max-new-tokens", type=int, default=None)
        q.add_argument("--stop-token-ids", type=_ids, default=[])
        q.add_argument("--request-id", default="")
    g.add_argument("--json", action="store_true", help="print one JSON object per event")
    c = sub.add_parser("cancel", help="cancel requests")
    c.add_argument("request_ids", nargs="+")
    e = sub.add_parser("events", help="stream a request's events (replayed from --from-seq)")
    e.add_argument("request_id")
    e.add_argument("--from-seq", type=int, default=0)
    sub.add_parser("info", help="model, limits, page pool, worker")
    sub.add_parser("health", help="grpc.health.v1 status")
    return p


def _print_events(events, as_json: bool) -> int:
    builder = ResultBuilder()
    for ev in events:
        builder.add(ev)
        if as_json:
            from google.protobuf.json_format import MessageToDict

            print(json.dumps(MessageToDict(ev, preserving_proto_field_name=True)), flush=True)
        elif ev.token_ids:
            print(" ".join(str(t) for t in ev.token_ids), end=" ", flush=True)
    r = builder.result()
    if not as_json:
        print(flush=True)
        m = r.metrics
        print(
            f"request {r.request_id}: {r.num_output_tokens} tokens, finish={r.finish_reason}"
            + (f" error={r.error!r}" if r.error else "")
            + f" | queue {m.queue_time_s * 1e3:.1f} ms, ttft {m.ttft_s * 1e3:.1f} ms,"
            f" itl mean {m.mean_itl_s * 1e3:.2f} ms max {m.max_itl_s * 1e3:.2f} ms,"
            f" e2e {m.e2e_s * 1e3:.1f} ms, preemptions {m.num_preemptions}",
            flush=True,
        )
    return 0 if r.finish_reason in ("stop", "length") else 1


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    tls = TLS(root_certificates=args.tls_ca) if args.tls_ca else (True if args.tls else None)
    client = Client(args.target, token=args.token, tls=tls)
    try:
        if args.wait_ready and args.command != "health":
            client.wait_ready(args.wait_ready)
        if args.command == "generate":
            events = client.stream(args.token_ids, args.max_new_tokens, args.stop_token_ids,
                                   args.request_id, timeout=args.timeout)
            return _print_events(events, args.json)
        if args.command == "submit":
            print(client.submit(args.token_ids, args.max_new_tokens, args.stop_token_ids,
                                args.request_id, timeout=args.timeout))
            return 0
        if args.command == "cancel":
            for rid, active in client.cancel(*args.request_ids, timeout=args.timeout).items():
                print(f"{rid}\t{'cancelled' if active else 'not active'}")
            return 0
        if args.command == "events":
            return _print_events(client.events(args.request_id, args.from_seq, timeout=args.timeout), False)
        if args.command == "info":
            from google.protobuf.json_format import MessageToDict

            info = client.info(timeout=args.timeout)
            print(json.dumps(MessageToDict(info, preserving_proto_field_name=True), indent=2))
            return 0
        if args.command == "health":
            print(client.health())
            return 0
    except QilError as err:
        print(f"error: {err}" + (f" (field {err.field})" if err.field else ""), file=sys.stderr)
        return 1
    except TimeoutError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    finally:
        client.close()
    return 2


if __name__ == "__main__":
    sys.exit(main())
