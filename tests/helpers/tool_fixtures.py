"""A tiny random model whose tokenizer has a Qwen3-style chat template with tools (rendered into
the system prompt, calls as ``<tool_call>`` blocks, results as ``<tool_response>``), and the
tool sets the tool tests call; built locally, nothing downloaded."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from checkpoints import make_checkpoint, make_tokenizer

# Qwen3's layout of tools and calls (its template's structure, written for these tests).
TOOLS_CHAT_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\n</tool_call><|im_end|>\n"
    "{%- elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n"
    "{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'system' and loop.first %}"
    "{%- elif m.role == 'assistant' %}<|im_start|>assistant\n"
    "{%- if m.reasoning_content %}<think>\n{{ m.reasoning_content }}\n</think>\n\n{% endif %}"
    "{{ m.content }}"
    "{%- for c in m.tool_calls or [] %}{% if m.content or not loop.first %}\n{% endif %}"
    "<tool_call>\n{\"name\": \"{{ c.function.name }}\", \"arguments\": {{ c.function.arguments | tojson }}}\n"
    "</tool_call>{% endfor %}<|im_end|>\n"
    "{%- elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
    "{%- endif %}"
)
# Qwen3's tags, each one token (added, not special: they stay in the output text)
TAGS = ["<think>", "</think>", "<tool_call>", "</tool_call>"]


def make_tool_checkpoint(path: Path, seed: int = 5) -> Path:
    """A random Qwen3 checkpoint whose tokenizer has ``TAGS`` and ``TOOLS_CHAT_TEMPLATE``."""
    tokenizer = make_tokenizer(path)
    tokenizer.add_tokens(TAGS)
    tokenizer.chat_template = TOOLS_CHAT_TEMPLATE
    tokenizer.save_pretrained(path)
    make_checkpoint(path, seed=seed, vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id,
                    max_position_embeddings=4096)
    return Path(path)


def function(name: str, parameters: dict[str, Any], description: str = "", strict: bool | None = None) -> dict:
    """A tool in the API's shape."""
    f: dict[str, Any] = {"name": name, "description": description, "parameters": parameters}
    if strict is not None:
        f["strict"] = strict
    return {"type": "function", "function": f}


WEATHER = function("get_weather", {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
}, "the weather in a city")
ADD = function("add", {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"], "additionalProperties": False,
}, "adds two integers", strict=True)
BOOK = function("book", {
    "type": "object",
    "properties": {
        "guests": {"type": "array", "items": {"type": "object", "properties": {
            "name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
            "required": ["name", "age"]}, "minItems": 1, "maxItems": 2},
        "vip": {"type": "boolean"},
    },
    "required": ["guests", "vip"],
})
NO_ARGS = function("ping", {"type": "object", "properties": {}})
TOOLS = [WEATHER, ADD, BOOK, NO_ARGS]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
