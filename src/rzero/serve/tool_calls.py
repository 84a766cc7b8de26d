"""Parse Hermes-style tool calls (what Qwen3 chat templates ask for) out of a completion's text.

    I will look it up.
    <tool_call>
    {"name": "search", "arguments": {"query": "rzero"}}
    </tool_call>

The calls must end the text: after the first <tool_call>, only well-formed call blocks and
whitespace may follow. Anything else (a truncated call, invalid JSON, a missing name) and the
whole text stays plain content, as the model wrote it.
"""

from __future__ import annotations

import json
import re
from typing import NamedTuple

TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"
_CALL_BLOCK = re.compile(re.escape(TOOL_CALL_START) + r"(.*?)" + re.escape(TOOL_CALL_END), re.DOTALL)


class ParsedToolCall(NamedTuple):
    name: str
    arguments: str  # a JSON object, as OpenAI's function.arguments carries it


def parse_tool_calls(text: str) -> tuple[str | None, list[ParsedToolCall]]:
    """Split text into (content before the calls, or None if blank; the calls), or (text, []) if none parse."""
    start = text.find(TOOL_CALL_START)
    if start < 0:
        return text, []
    calls, end = [], start
    for block in _CALL_BLOCK.finditer(text, start):
        call = _parse_call(block.group(1))
        if call is None or text[end : block.start()].strip():
            return text, []
        calls.append(call)
        end = block.end()
    if not calls or text[end:].strip():
        return text, []
    return text[:start].rstrip() or None, calls


def _parse_call(body: str) -> ParsedToolCall | None:
    try:
        call = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    arguments = call.get("arguments", {})
    if not isinstance(arguments, dict):
        return None
    return ParsedToolCall(call["name"], json.dumps(arguments, ensure_ascii=False))
