"""A ``SubmitRequest`` → the request's ``RequestSpec`` (front side, torch-free).

What only the wire form can get wrong is checked here (which prompt form, proto3 presence); the
spec checks the rest when it is made (counts, ranges, a constraint's size), before anything is
built from the request, naming the proto's own field names (``InvalidRequestError.field``),
which reach the caller as INVALID_ARGUMENT.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from qil_client._proto.qil.v1 import inference_pb2 as pb
from qil_client.options import NAMES as OPTION_NAMES
from qil_worker.engine.spec import DEFAULT_MAX_NEW_TOKENS, RequestSpec  # torch-free
from qil_worker.errors import InvalidRequestError
from qil_worker.service.errors import ServiceError, invalid, invalid_from
from qil_worker.service.front.front import release_outsized_later
from qil_worker.service.front.outsized_submit import OutsizedSubmit, PromptSize
from qil_worker.service.front.submit_tools import chat_messages, tools_options

if TYPE_CHECKING:
    from qil_worker.service.front.front import Front
    from qil_worker.service.front.request_log import FrontRequest

# the stand-in prompt of a request whose own is known only by its size (``refuse_unfit``)
_UNDECODED = {"token_ids": [0]}


def submit_spec(request: pb.SubmitRequest, prompt: PromptSize | None = None) -> RequestSpec:
    """The request's spec; ``ServiceError`` (INVALID_ARGUMENT) naming the field at fault.

    ``prompt``: ``request`` is an outsized request without its prompt fields
    (``OutsizedSubmit.rest``), which ``prompt`` stands for; the spec then has a stand-in prompt
    and is good for its checks only.
    """
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
    options: dict[str, Any] = dict(_UNDECODED) if prompt is not None else {}
    if prompt is None and given[0] == "token_ids":
        options["token_ids"] = list(request.token_ids)
    elif prompt is None and given[0] == "text":
        options["text"] = text
    elif prompt is None:
        options["messages"] = _checked(chat_messages, request.messages)
    if request.stop_strings:
        options["stop_strings"] = list(request.stop_strings)
    if request.logit_bias:
        options["logit_bias"] = dict(request.logit_bias)
    kind = request.WhichOneof("constraint")
    if kind is not None:
        options[kind] = list(request.choice.choices) if kind == "choice" else getattr(request, kind)
    for name in OPTION_NAMES:  # the spec takes each under its proto name
        if request.HasField(name):
            options[name] = getattr(request, name)
    tools = _checked(tools_options, request)
    if "tool_calls" in tools and kind is not None:
        raise invalid(kind, "cannot be combined with tools unless their choice is none")
    options.update(tools)
    max_new = request.max_new_tokens if request.HasField("max_new_tokens") else DEFAULT_MAX_NEW_TOKENS
    try:
        # (the id is the front's to check and give: ``Front.submit``)
        return RequestSpec.of(max_new_tokens=max_new, stop_token_ids=list(request.stop_token_ids), **options)
    except InvalidRequestError as exc:
        raise invalid_from(exc) from None


def _checked(check, *args):
    try:
        return check(*args)
    except InvalidRequestError as exc:
        raise invalid_from(exc) from None


def refuse_unfit(front: "Front", request: OutsizedSubmit) -> None:
    """Raise what ``submit_to`` would raise for ``request`` before it reaches the worker, when
    the rest of the request or the size of its prompt alone refuses it (its prompt undecoded);
    return when they do not: parse it whole (``request.whole()``) and submit that."""
    try:
        spec = submit_spec(request.rest, request.prompt)
        front.refuse_unfit(request.rest.request_id, spec.max_new_tokens, request.prompt)
    except ServiceError:
        request.drop()
        release_outsized_later()
        raise


async def submit_to(front: "Front", request: pb.SubmitRequest) -> "FrontRequest":
    """Check ``request`` and queue it through ``front``; returns once the engine accepted it."""
    return await front.submit(request.request_id, submit_spec(request))
