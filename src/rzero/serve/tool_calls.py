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
from typing import NamedTuple

from rzero.envs.tools import TOOL_CALL_BLOCK, ToolCall, parse_tool_call
from rzero.model.tokenizer import TOOL_CALL_START


class ParsedToolCall(NamedTuple):
    name: str
    arguments: str  # a JSON object, as OpenAI's function.arguments carries it


def parse_tool_calls(text: str) -> tuple[str | None, list[ParsedToolCall]]:
    """Split text into (content before the calls, or None if blank; the calls), or (text, []) if none parse."""
    start = text.find(TOOL_CALL_START)
    if start < 0:
        return text, []
    calls, end = [], start
    for block in TOOL_CALL_BLOCK.finditer(text, start):
        call = _parse_call(block.group(1))
        if call is None or text[end : block.start()].strip():
            return text, []
        calls.append(call)
        end = block.end()
    if not calls or text[end:].strip():
        return text, []
    return text[:start].rstrip() or None, calls


def _parse_call(body: str) -> ParsedToolCall | None:
    call = parse_tool_call(body)
    if not isinstance(call, ToolCall):
        return None
    return ParsedToolCall(call.name, json.dumps(call.arguments, ensure_ascii=False))
