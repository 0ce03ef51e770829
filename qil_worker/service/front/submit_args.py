"""A ``SubmitRequest`` → the arguments of ``Engine.submit`` (front side, torch-free).

Only what the wire format itself cannot say is checked here (which prompt form, proto3 presence,
a constraint's size); every count and value range is checked by the engine's rules in
``Front.submit`` before anything is made from them (and by the engine), whose
``InvalidRequestError.field`` uses the same names as the proto fields and reaches the caller
through ``errors.classify_engine_error``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from qil_client._proto.qil.v1 import inference_pb2 as pb
from qil_client.options import NAMES as OPTION_NAMES
from qil_worker.errors import InvalidRequestError
from qil_worker.service.front import limits
from qil_worker.service.errors import ServiceError, invalid
from qil_worker.service.front.front import release_outsized_later
from qil_worker.service.front.outsized_submit import OutsizedSubmit, PromptSize
from qil_worker.structured.spec import ConstraintSpec  # torch- and llguidance-free

if TYPE_CHECKING:
    from qil_worker.service.front.front import Front
    from qil_worker.service.front.request_log import FrontRequest


@dataclass
class SubmitArgs:
    request_id: str
    token_ids: list[int] | None  # None: the prompt is text or messages (in options)
    max_new_tokens: int
    stop_token_ids: list[int]
    options: dict[str, Any] = field(default_factory=dict)  # keyword arguments of Engine.submit


def submit_args(request: pb.SubmitRequest, prompt: PromptSize | None = None) -> SubmitArgs:
    """Raise ``ServiceError`` (INVALID_ARGUMENT) for what only the wire form can get wrong.

    ``prompt``: ``request`` is an outsized request without its prompt fields
    (``OutsizedSubmit.rest``), which ``prompt`` stands for; the arguments then carry no prompt.
    """
    options: dict[str, Any] = {}
    if prompt is not None:
        given = prompt.given
    else:
        text = request.text  # (each read of a string field makes a new str: one for a prompt of megabytes)
        given = [name for name, present in (
            ("token_ids", bool(request.token_ids)),
            ("text", bool(text)),
            ("messages", bool(request.messages)),
        ) if present]
    if len(given) > 1:
        raise invalid(given[1], f"give exactly one of token_ids, text or messages, not {' and '.join(given)}")
    if not given:
        raise invalid("token_ids", "the prompt is empty: give token_ids, text or messages")
    token_ids: list[int] | None = None
    if prompt is None and given[0] == "token_ids":
        token_ids = list(request.token_ids)
    elif prompt is None and given[0] == "text":
        options["text"] = text
    elif prompt is None:
        options["messages"] = [{"role": m.role, "content": m.content} for m in request.messages]
    if request.stop_strings:
        options["stop_strings"] = list(request.stop_strings)
    if request.logit_bias:
        options["logit_bias"] = dict(request.logit_bias)
    options.update(_constraint(request))
    for name in OPTION_NAMES:  # Engine.submit takes each under its proto name
        if request.HasField(name):
            options[name] = getattr(request, name)
    max_new = request.max_new_tokens if request.HasField("max_new_tokens") else limits.DEFAULT_MAX_NEW_TOKENS
    return SubmitArgs(request.request_id, token_ids, max_new, list(request.stop_token_ids), options)


def _constraint(request: pb.SubmitRequest) -> dict[str, Any]:
    """The ``constraint`` oneof → its Engine.submit keyword (none for ``json_object: false``),
    checked here by the worker's own rules (``ConstraintSpec``: sizes, an empty choice list...)
    so that an oversized schema is refused before it crosses the pipe. Whether it compiles is
    the worker's to say."""
    kind = request.WhichOneof("constraint")
    if kind is None:
        return {}
    value = list(request.choice.choices) if kind == "choice" else getattr(request, kind)
    try:
        spec = ConstraintSpec.from_kwargs(**{kind: value})
    except InvalidRequestError as exc:
        raise invalid(exc.field, str(exc).removeprefix(f"{exc.field}: ")) from None
    return {} if spec is None else {kind: value}


def refuse_unfit(front: "Front", request: OutsizedSubmit) -> None:
    """Raise what ``submit_to`` would raise for ``request`` before it reaches the worker, when
    the rest of the request or the size of its prompt alone refuses it (its prompt undecoded);
    return when they do not: parse it whole (``request.whole()``) and submit that."""
    try:
        args = submit_args(request.rest, request.prompt)
        front.refuse_unfit(args.request_id, args.max_new_tokens, request.prompt, args.options)
    except ServiceError:
        request.drop()
        release_outsized_later()
        raise


async def submit_to(front: "Front", request: pb.SubmitRequest) -> "FrontRequest":
    """Check ``request`` and queue it through ``front``; returns once the engine accepted it."""
    args = submit_args(request)
    return await front.submit(
        args.request_id, args.token_ids, args.max_new_tokens, args.stop_token_ids, args.options
    )
