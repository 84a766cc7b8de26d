"""One choice of a response as it is generated: its tokens, their logprobs, its text and tool calls."""

from __future__ import annotations

from tokenizers import Tokenizer

from rzero.engine.sequence import StepOutput
from rzero.serve.text import completion_text, settled_length
from rzero.serve.tool_calls import ParsedToolCall, parse_tool_calls


class Sample:
    def __init__(self, tokenizer: Tokenizer, stop: list[str], parse_tools: bool):
        self.tokenizer = tokenizer
        self.stop = stop
        self.parse_tools = parse_tools
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.top_logprobs: list[list[tuple[int, float]] | None] = []
        self.engine_finish_reason: str | None = None
        self._streamed = 0  # characters of content already streamed

    def add(self, out: StepOutput) -> None:
        self.token_ids.append(out.token_id)
        self.logprobs.append(out.logprob)
        self.top_logprobs.append(out.top_logprobs)
        if out.finished:
            self.engine_finish_reason = out.finish_reason

    @property
    def finished(self) -> bool:
        return self.engine_finish_reason is not None

    @property
    def text(self) -> str:
        # Decodes all tokens each time: simple and exact, and cheap next to a forward pass.
        return completion_text(self.tokenizer, self.token_ids, self.stop)

    def result(self) -> tuple[str | None, list[ParsedToolCall]]:
        """The content and the tool calls parsed out of it."""
        return parse_tool_calls(self.text) if self.parse_tools else (self.text, [])

    @property
    def finish_reason(self) -> str | None:
        if self.finished and self.parse_tools and self.result()[1]:
            return "tool_calls"
        return self.engine_finish_reason

    def content_delta(self) -> str:
        """Content settled since the last call; once finished, all the rest (content is a prefix of text)."""
        text = self.text
        if self.finished:
            end = len(self.result()[0] or "")
        else:
            end = settled_length(text, self.stop, self.parse_tools)
        delta = text[self._streamed : max(end, self._streamed)]
        self._streamed += len(delta)
        return delta
