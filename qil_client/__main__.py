"""``python -m qil_client --target HOST:PORT generate --prompt 'Once upon a time' --temperature 0.7``.

Commands: generate (streams the text as it is produced, or the token ids when the server has no
tokenizer, then prints the metrics), submit, cancel, events, info, health, and tokenize /
detokenize (a prompt's ids as a submit of it would get them, and ids back to text). The sampling
and structured-output flags have the names of ``python -m qil_worker generate``'s; unset flags
leave the server's defaults.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from qil_client import Client, QilError, TLS, constraints, options
from qil_client.cli_help import DefaultsHelpFormatter
from qil_client.json_output import message_to_dict
from qil_client.results import ResultBuilder, submit_request

# --wait-ready when not given: commands wait for a server that is starting; health, a probe, does not
WAIT_READY_S = 30.0


def _ids(text: str) -> list[int]:
    """An argparse type (argparse's error then names the flag, not this function)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise argparse.ArgumentTypeError(f"expected a JSON list of integers, e.g. '[1,2,3]', got {text!r}")
    return value


def add_sampling_arguments(p: argparse.ArgumentParser) -> None:
    """The per-request generation flags, named as those of ``python -m qil_worker generate``
    (``qil_worker.cli_generate.add_sampling_arguments``); the sampling flags of both come from
    ``qil_client.options``, which the client package owns so that it needs no worker package."""
    p.add_argument("--max-new-tokens", type=int, default=None, help="tokens to generate at most (default: 16)")
    p.add_argument("--stop-token-ids", type=_ids, default=[], help="JSON list of extra stop ids (default: none)")
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    options.add_flags(p, options.SAMPLING)
    options.add_logit_bias_flag(p)


def _messages_arg(text: str) -> list[dict]:
    """An argparse type: a JSON list of {"role": ..., "content": ...} objects."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, list) or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in value
    ):
        raise argparse.ArgumentTypeError(
            f'expected a JSON list of {{"role": ..., "content": ...}} objects, got {text!r}')
    return value


def tokenize_kwargs(args: argparse.Namespace) -> dict:
    """``Client.tokenize``'s keyword arguments from the tokenize flags (the prompt built as
    generate --prompt [--chat] builds it)."""
    if args.messages is not None:
        return {"messages": args.messages, "enable_thinking": args.enable_thinking}
    if args.chat:
        messages = [{"role": "system", "content": args.system}] if args.system else []
        return {"messages": messages + [{"role": "user", "content": args.prompt}],
                "enable_thinking": args.enable_thinking}
    return {"text": args.prompt}


def request_kwargs(args: argparse.Namespace) -> dict:
    """The submit_request keyword arguments of generate / submit (unset flags are left out)."""
    kw: dict = options.given(args)  # --thinking included: main() refuses it without --prompt --chat
    if args.token_ids is not None:
        kw["token_ids"] = args.token_ids
    elif args.chat:
        messages = [{"role": "system", "content": args.system}] if args.system else []
        kw["messages"] = messages + [{"role": "user", "content": args.prompt}]
    else:
        kw["text"] = args.prompt
    if args.stop:
        kw["stop_strings"] = args.stop
    if args.logit_bias:
        kw["logit_bias"] = dict(args.logit_bias)
    kw.update(constraints.from_args(args))
    kw.update(max_new_tokens=args.max_new_tokens, stop_token_ids=args.stop_token_ids,
              request_id=args.request_id)
    return kw


def _parser() -> argparse.ArgumentParser:
    fmt = DefaultsHelpFormatter
    p = argparse.ArgumentParser(prog="python -m qil_client", description="qil gRPC client",
                                formatter_class=fmt)
    p.add_argument("--target", default="127.0.0.1:50051",
                   help="HOST:PORT, several comma-separated, or dns:///name:port")
    p.add_argument("--token", default=os.environ.get("QIL_AUTH_TOKEN"),
                   help="bearer token (default: $QIL_AUTH_TOKEN; unset: none)")
    p.add_argument("--tls", action="store_true", help="use TLS (system roots unless --tls-ca)")
    p.add_argument("--tls-ca", default=None, help="PEM CA to check the server with (implies --tls)")
    p.add_argument("--timeout", type=float, default=None, help="deadline of the call, seconds (default: none)")
    p.add_argument(
        "--wait-ready", type=float, default=None, metavar="SECONDS",
        help="first wait this long for the server to report SERVING; a refused connection fails at "
        f"once (0: no wait; default: {WAIT_READY_S:g}, and 0 for health)",
    )
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate and stream the tokens", formatter_class=fmt)
    s = sub.add_parser("submit", help="queue a request; prints its id", formatter_class=fmt)
    for q in (g, s):
        src = q.add_mutually_exclusive_group(required=True)
        src.add_argument("--token-ids", type=_ids, help="prompt as a JSON list, e.g. '[1,2,3]'")
        src.add_argument("--prompt", help="prompt text (the server needs a tokenizer)")
        q.add_argument("--chat", action="store_true", help="send --prompt as a user chat message")
        q.add_argument("--system", default=None, help="with --chat: a system message first")
        q.add_argument("--thinking", dest="enable_thinking", action=argparse.BooleanOptionalAction,
                       default=None, help="with --chat: Qwen3's enable_thinking (default: the template's)")
        add_sampling_arguments(q)
        q.add_argument("--logprobs", action="store_true", default=None,
                       help="ask for each token's log-probability (shown with --json)")
        q.add_argument("--top-logprobs", type=int, default=None, help="and the N most likely (<= 20)")
        q.add_argument("--prompt-logprobs", type=int, default=None, metavar="N",
                       help="ask for each prompt token's log-probability after the first and the N "
                       "most likely there (0 to 20; with the first event, shown with --json; "
                       "default: off)")
        q.add_argument("--include-stop-string", action="store_true", default=None,
                       help="keep the stop string at the end of the text")
        q.add_argument("--keep-special-tokens", dest="skip_special_tokens", action="store_false",
                       default=None, help="show special tokens in the text")
        q.add_argument("--request-id", default="", help="client-chosen id (default: the server makes one)")
        constraints.add_flags(q)
    g.add_argument("--json", action="store_true", help="print one JSON object per event")
    g.add_argument("--ids", action="store_true", help="print token ids even when text comes")
    c = sub.add_parser("cancel", help="cancel requests", formatter_class=fmt)
    c.add_argument("request_ids", nargs="+", help="ids of the requests to cancel")
    e = sub.add_parser("events", help="stream a request's events (replayed from --from-seq)",
                       formatter_class=fmt)
    e.add_argument("request_id", help="id of a request submitted earlier")
    e.add_argument("--from-seq", type=int, default=0, help="first event to replay")
    t = sub.add_parser("tokenize", formatter_class=fmt,
                       help="print a prompt's token ids, as a submit of it would get them")
    src = t.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (with --chat: a user message)")
    src.add_argument("--messages", type=_messages_arg,
                     help='chat as a JSON list, e.g. \'[{"role": "user", "content": "hi"}]\'')
    t.add_argument("--chat", action="store_true", help="send --prompt as a user chat message")
    t.add_argument("--system", default=None, help="with --chat: a system message first")
    t.add_argument("--thinking", dest="enable_thinking", action=argparse.BooleanOptionalAction,
                   default=None, help="chat only: Qwen3's enable_thinking (default: the template's)")
    t.add_argument("--json", action="store_true",
                   help="print a JSON object (token_ids, num_tokens, max_position_embeddings)")
    d = sub.add_parser("detokenize", help="print the text of token ids", formatter_class=fmt)
    d.add_argument("--token-ids", type=_ids, required=True, help="a JSON list, e.g. '[1,2,3]'")
    d.add_argument("--keep-special-tokens", dest="skip_special_tokens", action="store_false",
                   default=None, help="show special tokens in the text")
    d.add_argument("--json", action="store_true", help='print a JSON object {"text": ...}')
    em = sub.add_parser("embed", help="print the embeddings of texts (one JSON list per line)",
                        formatter_class=fmt)
    em.add_argument("texts", nargs="+", help="the texts to embed")
    em.add_argument("--dimensions", type=int, default=None, help="keep the first N components")
    em.add_argument("--no-normalize", dest="normalize", action="store_false", default=None,
                    help="the raw hidden state, not L2-normalised")
    rr = sub.add_parser("rerank", help="print documents by relevance to a query, best first",
                        formatter_class=fmt)
    rr.add_argument("--query", required=True, help="what the documents are judged against")
    rr.add_argument("documents", nargs="+", help="the documents to rank")
    rr.add_argument("--instruction", default=None, help="the reranker's task (default: web search)")
    rr.add_argument("--top-n", type=int, default=None, help="print only the best N (default: all)")
    sub.add_parser("info", help="model, limits, page pool, worker", formatter_class=fmt)
    sub.add_parser("health", formatter_class=fmt,
                   help="print the grpc.health.v1 status; exit 0 only when SERVING",
                   description="Print the server's grpc.health.v1 status. Exits 0 when it is "
                   "SERVING and 1 otherwise (NOT_SERVING while the model loads, a worker restarts "
                   "or the server drains; or no answer). One check unless --wait-ready asks to wait.")
    return p


def _error_line(err: QilError) -> str:
    """One line that names the field once: the server's details already start with it."""
    named = not err.field or err.details.startswith(f"{err.field}:")
    return f"error: {err}" + ("" if named else f" (field {err.field})")


def _print_events(events, as_json: bool, ids: bool = False, from_seq: int = 0) -> int:
    """Stream the output (of sample 0, with several samples: the others are printed at the
    end), then one summary line per sample; ``--json``: every event as it comes."""
    builder = ResultBuilder(start_seq=from_seq)
    for ev in events:
        builder.add(ev)
        if as_json:
            print(json.dumps(message_to_dict(ev)), flush=True)
        elif ev.sample_index:
            continue
        elif ev.HasField("text") and not ids:
            print(ev.text, end="", flush=True)
        elif ev.token_ids:
            print(" ".join(str(t) for t in ev.token_ids), end=" ", flush=True)
    result = builder.result()
    samples = result.samples or [result]
    if not as_json:
        print(flush=True)
        for r in samples:
            if r.sample_index:
                print(f"--- sample {r.sample_index} ---")
                shown = r.text if r.text is not None and not ids else " ".join(str(t) for t in r.token_ids)
                print(shown, flush=True)
            _print_summary(r, len(samples) > 1)
    return 0 if all(r.finish_reason in ("stop", "length") for r in samples) else 1


def _print_summary(r, several: bool) -> None:
    m = r.metrics
    print(
        f"request {r.request_id}" + (f" sample {r.sample_index}" if several else "")
        + f": {r.num_output_tokens} tokens, finish={r.finish_reason}"
        + (f" stop={r.stop_reason!r}" if r.stop_reason is not None else "")
        + (f" error={r.error!r}" if r.error else "")
        + f" | prompt {r.num_prompt_tokens} tokens ({r.num_cached_tokens} cached)"
        + f" | queue {m.queue_time_s * 1e3:.1f} ms, ttft {m.ttft_s * 1e3:.1f} ms,"
        f" itl mean {m.mean_itl_s * 1e3:.2f} ms max {m.max_itl_s * 1e3:.2f} ms,"
        f" e2e {m.e2e_s * 1e3:.1f} ms, preemptions {m.num_preemptions}",
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    tls = TLS(root_certificates=args.tls_ca) if args.tls_ca else (True if args.tls else None)
    try:
        client = Client(args.target, token=args.token, tls=tls)
    except (ValueError, OSError) as err:  # --target not HOST:PORT or unresolved; --tls-ca unreadable
        print(f"error: {err}", file=sys.stderr)
        return 2
    try:
        chat_flags = args.command in ("generate", "submit") and (
            args.system or args.enable_thinking is not None
        )
        if chat_flags and not (args.chat and args.token_ids is None):
            print("error: --system and --thinking go with --prompt --chat", file=sys.stderr)
            return 2
        if args.command in ("generate", "submit") and args.token_ids is not None and args.chat:
            print("error: --chat goes with --prompt", file=sys.stderr)
            return 2
        if args.command == "tokenize" and (
            (args.chat and args.messages is not None)
            or (args.system and not args.chat)
            or (args.enable_thinking is not None and not args.chat and args.messages is None)
        ):
            print("error: --chat, --system and --thinking go with --prompt --chat "
                  "(--thinking also with --messages)", file=sys.stderr)
            return 2
        wait = args.wait_ready if args.wait_ready is not None else (
            0.0 if args.command == "health" else WAIT_READY_S)
        if args.command == "health":
            return _health(client, wait, args.timeout)
        if args.command in ("generate", "submit"):
            submit_request(**request_kwargs(args))  # what the wire cannot carry fails before any call
        if wait:
            client.wait_ready(wait, fail_when_refused=True)
        if args.command == "generate":
            events = client.stream(timeout=args.timeout, **request_kwargs(args))
            return _print_events(events, args.json, args.ids)
        if args.command == "submit":
            print(client.submit(timeout=args.timeout, **request_kwargs(args)))
            return 0
        if args.command == "cancel":
            for rid, active in client.cancel(*args.request_ids, timeout=args.timeout).items():
                print(f"{rid}\t{'cancelled' if active else 'not active'}")
            return 0
        if args.command == "events":
            events = client.events(args.request_id, args.from_seq, timeout=args.timeout)
            return _print_events(events, False, from_seq=args.from_seq)
        if args.command == "tokenize":
            tok = client.tokenize(timeout=args.timeout, **tokenize_kwargs(args))
            if args.json:
                print(json.dumps({"token_ids": tok.token_ids, "num_tokens": tok.num_tokens,
                                  "max_position_embeddings": tok.max_position_embeddings}))
            else:
                print(json.dumps(tok.token_ids))
                print(f"{tok.num_tokens} tokens (the model's context: {tok.max_position_embeddings})")
            return 0
        if args.command == "detokenize":
            text = client.detokenize(args.token_ids, args.skip_special_tokens, timeout=args.timeout)
            print(json.dumps({"text": text}) if args.json else text)
            return 0
        if args.command == "embed":
            for vector in client.embed(args.texts, args.dimensions, args.normalize, timeout=args.timeout).vectors:
                print(json.dumps(vector))
            return 0
        if args.command == "rerank":
            for r in client.rerank(args.query, args.documents, args.instruction, args.top_n, timeout=args.timeout):
                print(f"{r.relevance_score:.6f}\t{r.index}\t{args.documents[r.index]}")
            return 0
        if args.command == "info":
            info = client.info(timeout=args.timeout)
            print(json.dumps(message_to_dict(info), indent=2))
            return 0
    except QilError as err:
        print(_error_line(err), file=sys.stderr)
        return 1
    except (TypeError, ValueError) as err:  # a value the wire cannot carry (e.g. a negative seed)
        print(f"error: {err}", file=sys.stderr)
        return 2
    except TimeoutError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    finally:
        client.close()
    return 2


def _health(client: Client, wait: float, timeout: float | None) -> int:
    """Print the status; 0 only for SERVING, as a probe (Docker's HEALTHCHECK) needs."""
    if wait:
        try:
            client.wait_ready(wait, fail_when_refused=True)
        except TimeoutError:
            pass  # the check below prints what the server says now
    status = client.health(timeout=timeout if timeout is not None else 5.0)
    print(status)
    return 0 if status == "SERVING" else 1


if __name__ == "__main__":
    sys.exit(main())
