"""A request body of the OpenAI API → what the front's ``submit`` takes.

Only types and shapes are checked here, each failure naming the API's parameter; value ranges
are the engine's to check (once, for both fronts), and ``param_of`` maps the engine's field
names back to the API's parameter names for its messages.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from qil_worker.errors import InvalidRequestError
from qil_worker.request_limits import MAX_CALL_CHOICES, MAX_LOGIT_BIAS, check_count, check_stop_strings
from qil_worker.structured.spec import CONSTRAINT_KINDS, ConstraintSpec
from qil_worker.structured.tool_grammar import tool_options
from qil_worker.structured.tools import ToolRequest, tool_request
from qil_worker.text.tool_messages import tool_parts
from qil_worker.service.errors import invalid, invalid_from

# body parameter → (Engine.submit keyword, type) for those that pass straight through; the
# extras after the first five are vLLM's
_SAMPLING = {
    "temperature": ("temperature", float),
    "top_p": ("top_p", float),
    "presence_penalty": ("presence_penalty", float),
    "frequency_penalty": ("frequency_penalty", float),
    "seed": ("seed", int),
    "top_k": ("top_k", int),
    "min_p": ("min_p", float),
    "repetition_penalty": ("repetition_penalty", float),
    "min_tokens": ("min_new_tokens", int),
    "ignore_eos": ("ignore_eos", bool),
    "skip_special_tokens": ("skip_special_tokens", bool),
    "include_stop_str_in_output": ("include_stop_string", bool),
}
# the API's default where it differs from the engine's (greedy)
DEFAULT_TEMPERATURE = 1.0
# The API's defaults of max_tokens: 16 for completions; for chat, the rest of the context.
COMPLETIONS_MAX_TOKENS = 16

# parameters of the API that this server does not implement: refused unless left at their
# neutral value, so that a caller relying on one learns at once
_UNSUPPORTED_UNLESS = {
    "suffix": (None,),
    "functions": (None, []),
    "function_call": (None, "none"),
    "audio": (None,),
    "prediction": (None,),
    "modalities": (None, ["text"]),
}



# the API's newer names of the roles the chat template knows
ROLE_ALIASES = {"developer": "system"}
# reasoning_effort → Qwen3's thinking switch: the model has one way of thinking, on or off;
# the efforts that ask for (almost) none turn it off
REASONING_EFFORTS = {"none": False, "minimal": False, "low": True, "medium": True, "high": True}


def param_of(engine_field: str | None, chat: bool, max_tokens_param: str = "max_tokens") -> str | None:
    """The API parameter behind an engine field (for error messages); ``max_tokens_param``:
    the name the call gave its length limit by (chat has two)."""
    if engine_field is None:
        return None
    names = {
        "max_new_tokens": max_tokens_param,
        "min_new_tokens": "min_tokens",
        "stop_strings": "stop",
        "token_ids": "messages" if chat else "prompt",
        "text": "prompt",
        "prompt": "messages" if chat else "prompt",
        "top_logprobs": "top_logprobs" if chat else "logprobs",
        "include_stop_string": "include_stop_str_in_output",
        "enable_thinking": "chat_template_kwargs",
        # a constraint the worker refused (it does not compile, say)
        "json_schema": "response_format" if chat else "guided_json",
        "json_object": "response_format",
        "regex": "guided_regex",
        "grammar": "guided_grammar",
        "choice": "guided_choice",
        "tool_calls": "tools",
    }
    return names.get(engine_field, engine_field)


@dataclass
class Prompt:
    token_ids: list[int] | None = None  # or
    text: str | None = None  # or
    messages: list[dict[str, str]] | None = None


@dataclass
class CallParams:
    """What one completions or chat call asks for, endpoint-neutral."""

    model: str | None
    prompts: list[Prompt]
    n: int
    stream: bool
    include_usage: bool
    max_new_tokens: int | None  # None: the rest of the context (chat's default)
    stop_token_ids: list[int]
    # the keyword form of RequestSpec.of, shared by every request of the call (the prompt, its
    # length and its stop ids aside)
    options: dict[str, Any] = field(default_factory=dict)
    top_logprobs: int | None = None  # None: no logprobs
    echo: bool = False
    hide_output: bool = False  # max_tokens 0: the one token the engine ran is not answered
    max_tokens_param: str = "max_tokens"  # the parameter max_new_tokens came from
    tools: ToolRequest | None = None  # chat: the request's tools, and its tool_choice

    def api_param(self, engine_field: str | None, chat: bool) -> str | None:
        """``param_of`` for this call."""
        return param_of(engine_field, chat, self.max_tokens_param)


def _get(body: dict, name: str, kind: type, default: Any = None) -> Any:
    """``body[name]`` of type ``kind`` (null or absent: ``default``); ints pass as floats,
    booleans never as numbers."""
    value = body.get(name)
    if value is None:
        return default
    ok = isinstance(value, kind) and not (kind in (int, float) and isinstance(value, bool))
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        ok, value = True, float(value)
    if not ok:
        raise invalid(name, f"must be {_TYPE_NAMES[kind]}, got {type(value).__name__}")
    return value


_TYPE_NAMES = {float: "a number", int: "an integer", bool: "a boolean", str: "a string",
               dict: "an object", list: "an array"}


def token_ids_of(value: Any) -> list[int] | None:
    """``value`` when it is a list of ints (booleans are not), else None."""
    if isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        return value
    return None


def completion_prompts(body: dict, field: str = "prompt") -> list[Prompt]:
    """``prompt`` (or ``field``: embeddings' ``input``): a string, a list of strings, a list of
    token ids, or a list of such lists."""
    value = body.get(field)
    shape = "a string, a list of strings, a list of token ids or a list of lists of token ids"
    if isinstance(value, str):
        return [Prompt(text=value)]
    if not isinstance(value, list) or not value:
        raise invalid(field, f"must be {shape} (non-empty)")
    ids = token_ids_of(value)
    if ids is not None:
        return [Prompt(token_ids=ids)]
    if all(isinstance(p, str) for p in value):
        return [Prompt(text=p) for p in value]
    lists = [token_ids_of(p) for p in value]
    if all(ids is not None and ids for ids in lists):
        return [Prompt(token_ids=ids) for ids in lists]
    raise invalid(field, f"must be {shape}")


def chat_messages(body: dict) -> list[dict[str, Any]]:
    """``messages``: role and content (a string, or text parts, which are joined), and their
    tool parts (``tool_messages``)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid("messages", "must be a non-empty array of messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise invalid("messages", f"[{i}] must be an object with a string 'role'")
        content = m.get("content")
        if content is None:
            content = ""
        elif isinstance(content, list):
            parts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise invalid("messages", f"[{i}].content: only text parts are supported")
                parts.append(part["text"])
            content = "".join(parts)
        elif not isinstance(content, str):
            raise invalid("messages", f"[{i}].content must be a string or an array of text parts")
        role = m["role"]
        message = {"role": ROLE_ALIASES.get(role, role), "content": content}
        message.update(_checked(tool_parts, i, m))
        out.append(message)
    return out


def _stop_strings(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise invalid("stop", "must be a string or an array of strings")
    return _checked(check_stop_strings, stops, "stop")


def _checked(check, *args):
    """``check(*args)``, its ``InvalidRequestError`` as the front's INVALID_ARGUMENT."""
    try:
        return check(*args)
    except InvalidRequestError as exc:
        raise invalid_from(exc) from None


def _common(body: dict, chat: bool) -> CallParams:
    for name, neutral in _UNSUPPORTED_UNLESS.items():
        if body.get(name, None) not in neutral:
            raise invalid(name, "is not supported by this server")
    model = _get(body, "model", str)
    n = _get(body, "n", int, 1)
    if n < 1:
        raise invalid("n", f"must be at least 1, got {n}")
    best_of = _get(body, "best_of", int)
    if best_of is not None and best_of != n:
        raise invalid("best_of", "must equal n (this server returns every sample it draws)")
    stream = _get(body, "stream", bool, False)
    stream_options = _get(body, "stream_options", dict, {})
    if stream_options and not stream:
        raise invalid("stream_options", "is only allowed when stream is true")
    include_usage = bool(_get(stream_options, "include_usage", bool, False)) if stream_options else False
    options: dict[str, Any] = {"temperature": DEFAULT_TEMPERATURE}
    for name, (option, kind) in _SAMPLING.items():
        value = _get(body, name, kind)
        if value is not None:
            options[option] = value
    stops = _stop_strings(body)
    if stops:
        options["stop_strings"] = stops
    stop_ids = _get(body, "stop_token_ids", list, [])
    if token_ids_of(stop_ids) is None:
        raise invalid("stop_token_ids", "must be an array of token ids")
    logit_bias = body.get("logit_bias")
    if logit_bias is not None:
        options.update(_logit_bias(logit_bias))

    options.update(_constraint(body, chat))
    return CallParams(
        model=model, prompts=[], n=n, stream=stream, include_usage=include_usage,
        max_new_tokens=None, stop_token_ids=stop_ids, options=options,
    )


def _logit_bias(value: Any) -> dict[str, Any]:
    """``{"token id": bias}`` (JSON keys are strings) → the engine's ``{id: bias}``."""
    if not isinstance(value, dict):
        raise invalid("logit_bias", "must be an object mapping token ids to biases")
    _checked(check_count, "logit_bias", len(value), MAX_LOGIT_BIAS, "token ids")
    bias = {}
    for key, b in value.items():
        try:
            tid = int(key)
        except (TypeError, ValueError):
            raise invalid("logit_bias", f"keys must be token ids, got {key!r}") from None
        if isinstance(b, bool) or not isinstance(b, (int, float)):
            raise invalid("logit_bias", f"biases must be numbers, got {b!r}")
        bias[tid] = float(b)
    return {"logit_bias": bias} if bias else {}


def _constraint(body: dict, chat: bool) -> dict[str, Any]:
    """``response_format`` (chat) and vLLM's ``guided_*`` → one structured-output option."""
    found: list[tuple[str, dict[str, Any]]] = []
    fmt = body.get("response_format") if chat else None
    if fmt is not None:
        if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
            raise invalid("response_format", "must be an object with a 'type'")
        kind = fmt["type"]
        if kind == "json_object":
            found.append(("response_format", {"json_object": True}))
        elif kind == "json_schema":
            spec = fmt.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
                raise invalid("response_format", "json_schema must be an object with a 'schema' object")
            # strict or not, the output is held to the schema (the API's strict mode is what the
            # grammar guarantees anyway)
            found.append(("response_format", {"json_schema": json.dumps(spec.get("schema", {}))}))
        elif kind != "text":
            raise invalid("response_format", f"type must be text, json_object or json_schema, got {kind!r}")
    guided = body.get("guided_json")
    if guided is not None:
        if isinstance(guided, str):
            schema = guided
        elif isinstance(guided, dict):
            schema = json.dumps(guided)
        else:
            raise invalid("guided_json", "must be a JSON schema (an object or its text)")
        found.append(("guided_json", {"json_schema": schema}))
    regex = _get(body, "guided_regex", str)
    if regex is not None:
        found.append(("guided_regex", {"regex": regex}))
    grammar = _get(body, "guided_grammar", str)
    if grammar is not None:
        found.append(("guided_grammar", {"grammar": grammar}))
    choice = body.get("guided_choice")
    if choice is not None:
        if not isinstance(choice, list) or not choice or not all(isinstance(c, str) for c in choice):
            raise invalid("guided_choice", "must be a non-empty array of strings")
        found.append(("guided_choice", {"choice": choice}))
    if len(found) > 1:
        raise invalid(found[1][0], f"give one constraint, not {' and '.join(name for name, _ in found)}")
    if not found:
        return {}
    name, option = found[0]
    try:  # the worker's own rules (sizes, an empty choice...), before the option crosses the pipe
        ConstraintSpec.from_kwargs(**option)
    except InvalidRequestError as exc:
        raise invalid_from(exc, name) from None
    return option


def completion_params(body: dict) -> CallParams:
    params = _common(body, chat=False)
    params.prompts = completion_prompts(body)
    params.max_new_tokens = _get(body, "max_tokens", int, COMPLETIONS_MAX_TOKENS)
    params.echo = _get(body, "echo", bool, False)
    top = _get(body, "logprobs", int)
    if top is not None:
        params.options["logprobs"] = True
        params.options["top_logprobs"] = top
        params.top_logprobs = top
        if params.echo:
            params.options["prompt_logprobs"] = top
    if params.max_new_tokens == 0:
        # scoring a prompt (lm-eval's loglikelihood): echo it, generate nothing; the engine
        # runs one token, which the answer leaves out
        if not params.echo:
            raise invalid("max_tokens", "0 needs echo: true (a prompt scored, nothing generated)")
        params.max_new_tokens = 1
        params.hide_output = True
    _check_choices(params)
    return params


def chat_params(body: dict) -> CallParams:
    params = _common(body, chat=True)
    params.prompts = [Prompt(messages=chat_messages(body))]
    newer = _get(body, "max_completion_tokens", int)
    params.max_new_tokens = newer if newer is not None else _get(body, "max_tokens", int)
    if newer is not None:
        params.max_tokens_param = "max_completion_tokens"
    if _get(body, "logprobs", bool, False):
        top = _get(body, "top_logprobs", int, 0)
        params.options["logprobs"] = True
        params.options["top_logprobs"] = top
        params.top_logprobs = top
    elif body.get("top_logprobs") is not None:
        raise invalid("top_logprobs", "needs logprobs: true")
    thinking = thinking_of(body)
    if thinking is not None:
        params.options["enable_thinking"] = thinking
    _tools(body, params)
    _check_choices(params)
    return params


def chat_tools(body: dict) -> list[dict[str, Any]] | None:
    """The tools a chat body's template renders, checked as a call's (None: it gives none)."""
    tools = _tool_request(body)
    return None if tools is None else tools.template_tools()


def _tool_request(body: dict) -> ToolRequest | None:
    return _checked(tool_request, body.get("tools"), body.get("tool_choice"), body.get("parallel_tool_calls"))


def _tools(body: dict, params: CallParams) -> None:
    """``tools``, ``tool_choice`` and ``parallel_tool_calls``: the tools go to the chat template,
    and unless ``tool_choice`` is none, the calls are held to their schemas (``tool_grammar``)."""
    tools = _tool_request(body)
    if tools is None:
        return
    params.tools = tools
    given = next((k for k in CONSTRAINT_KINDS if k in params.options), None)
    options = tool_options(tools, constrained=given is not None)
    if given is not None and "tool_calls" in options:
        raise invalid(param_of(given, chat=True) or given,
                      "cannot be combined with tools unless tool_choice is none")
    params.options.update(options)


def thinking_of(body: dict) -> bool | None:
    """Qwen3's thinking switch as a chat body sets it: ``chat_template_kwargs.enable_thinking``
    or ``reasoning_effort`` (``REASONING_EFFORTS``), which must agree; None: the template's
    default."""
    kwargs = _get(body, "chat_template_kwargs", dict, {})
    thinking = kwargs.get("enable_thinking")
    if thinking is not None and not isinstance(thinking, bool):
        raise invalid("chat_template_kwargs", "enable_thinking must be a boolean")
    effort = _get(body, "reasoning_effort", str)
    if effort is None:
        return thinking
    if effort not in REASONING_EFFORTS:
        raise invalid("reasoning_effort", f"must be one of {', '.join(REASONING_EFFORTS)}, got {effort!r}")
    if thinking is not None and thinking != REASONING_EFFORTS[effort]:
        raise invalid("reasoning_effort", f"{effort!r} contradicts chat_template_kwargs.enable_thinking {thinking}")
    return REASONING_EFFORTS[effort]


def _check_choices(params: CallParams) -> None:
    count = len(params.prompts) * params.n
    if count > MAX_CALL_CHOICES:
        raise invalid("n", f"prompts x n is {count}; at most {MAX_CALL_CHOICES} in one call")
