"""From token ids to response text: the completion's text, how much of it may be streamed, token bytes."""

from __future__ import annotations

from tokenizers import Tokenizer, decoders

from rzero.engine.sequence import cut_at_stop  # the engine stops on the token that completes one
from rzero.serve.tool_calls import TOOL_CALL_START


def completion_text(tokenizer: Tokenizer, token_ids: list[int], stop: list[str]) -> str:
    return cut_at_stop(tokenizer.decode(token_ids, skip_special_tokens=True), stop)


def settled_length(text: str, stop: list[str], hold_tool_calls: bool) -> int:
    """How much of a growing completion's text later tokens can no longer change or cut.

    Not settled: an incomplete UTF-8 character at the end (decoded as U+FFFD), a tail that may be the
    start of a stop string and, when tool calls are parsed out, everything from the first
    <tool_call> on, a tail that may start one, and the whitespace before either. So text streamed
    up to here is always a prefix of the final content.
    """
    end = len(text.rstrip("\ufffd"))
    end -= _partial_marker_length(text[:end], stop)
    if hold_tool_calls:
        start = text.find(TOOL_CALL_START, 0, end)
        end = start if start >= 0 else end - _partial_marker_length(text[:end], [TOOL_CALL_START])
        end = len(text[:end].rstrip())
    return end


def _partial_marker_length(text: str, markers: list[str]) -> int:
    """Length of the longest tail of text that is a proper prefix of one of the markers."""
    return max((k for m in markers for k in range(1, len(m)) if text.endswith(m[:k])), default=0)


class TokenPieces:
    """Each token's own text and exact bytes, for logprobs (a byte-level token may be part of a character)."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self._added = {i: t.content for i, t in tokenizer.get_added_tokens_decoder().items()}
        self._byte_level = isinstance(tokenizer.decoder, decoders.ByteLevel)

    def text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def bytes(self, token_id: int) -> list[int]:
        if token_id in self._added or not self._byte_level:
            return list(self.text(token_id).encode())
        return [_BYTE_OF_CHAR[c] for c in self.tokenizer.id_to_token(token_id)]


def _byte_level_chars() -> dict[str, int]:
    """Byte-level BPE writes each byte as one printable character; this maps them back to bytes.

    Printable Latin-1 bytes stand for themselves, the other 68 bytes for chr(256), chr(257), ... in
    byte order (the GPT-2 convention that `tokenizers`' ByteLevel pre-tokenizer follows).
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in printable}
    for i, b in enumerate(b for b in range(256) if b not in chars):
        chars[b] = chr(256 + i)
    return {c: b for b, c in chars.items()}


_BYTE_OF_CHAR = _byte_level_chars()
