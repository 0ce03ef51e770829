"""LangChain's ``ChatOpenAI`` against a real ``serve --http-port`` process (the issue's first
user): ``bind_tools`` with ``tool_choice`` required and named, streamed too, and
``with_structured_output`` by function calling, on a tiny random model with a Qwen3-style
chat template with tools (``tool_fixtures``). The random model's arguments are noise, but they
always validate: LangChain parses them into its own models here."""

from __future__ import annotations

import jsonschema
import pytest
from pydantic import BaseModel, Field

langchain_openai = pytest.importorskip(
    "langchain_openai", reason="LangChain's OpenAI integration is not installed (pip install langchain-openai)"
)

from service_fixtures import serve_process, stop_server_process  # noqa: E402
from tool_fixtures import ADD, SCHEMAS, TOOLS, make_tool_checkpoint  # noqa: E402

NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


class Booking(BaseModel):
    """A table booked for guests."""

    guests: int = Field(ge=1, le=12)
    name: str = Field(max_length=10)
    vip: bool


@pytest.fixture(scope="module")
def base_url(tmp_path_factory):
    model = make_tool_checkpoint(tmp_path_factory.mktemp("langchain"))
    proc, _, _ = serve_process("--model", str(model), "--http-port", "0", "--served-model-name", "tiny")
    http = proc.announcement.split("(HTTP on ", 1)[1].split(")")[0]
    yield f"http://{http}/v1"
    stop_server_process(proc)


def chat(base_url: str, seed: int, **kw):
    return langchain_openai.ChatOpenAI(base_url=base_url, api_key="unused", model="tiny", temperature=1.0, seed=seed,
                                       max_tokens=1500, max_retries=0, timeout=120, extra_body=NO_THINKING, **kw)


@pytest.mark.parametrize("seed", [1, 2])
def test_bind_tools_with_tool_choice_required_gives_valid_calls(base_url, seed):
    llm = chat(base_url, seed).bind_tools(TOOLS, tool_choice="required", parallel_tool_calls=False)
    message = llm.invoke("hello world")
    assert message.response_metadata["finish_reason"] == "tool_calls"
    assert len(message.tool_calls) == 1 and not message.invalid_tool_calls
    call = message.tool_calls[0]
    jsonschema.validate(call["args"], SCHEMAS[call["name"]])
    assert call["id"].startswith("call_")


def test_bind_tools_named_and_streamed(base_url):
    llm = chat(base_url, 3).bind_tools([ADD, TOOLS[0]], tool_choice="add")
    whole = llm.invoke("add two numbers")
    chunks = list(llm.stream("add two numbers"))
    streamed = chunks[0]
    for chunk in chunks[1:]:
        streamed = streamed + chunk
    assert [c["name"] for c in whole.tool_calls] == ["add"]
    assert [(c["name"], c["args"]) for c in streamed.tool_calls] == [(c["name"], c["args"]) for c in whole.tool_calls]
    jsonschema.validate(streamed.tool_calls[0]["args"], SCHEMAS["add"])


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_with_structured_output_by_function_calling_parses(base_url, seed):
    booking = chat(base_url, seed).with_structured_output(Booking, method="function_calling").invoke("book a table")
    assert isinstance(booking, Booking)  # pydantic validated it: bounds and types hold
