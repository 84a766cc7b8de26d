"""What the endpoints share: the engine thread, the tokenizer, the model's name and limits, errors."""

from __future__ import annotations

import asyncio
import unicodedata
from collections.abc import AsyncIterator, Coroutine

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel
from tokenizers import Tokenizer, decoders, normalizers

from rzero.engine import Engine, SamplingParams
from rzero.serve.async_engine import AsyncEngine, RequestStream
from rzero.serve.chat_template import ChatTemplate
from rzero.serve.protocol import SamplingRequest, TokenLogprob, TopLogprob, Usage
from rzero.serve.sample import Sample
from rzero.serve.text import TokenPieces


class APIError(Exception):
    """An error the client caused, answered as OpenAI answers it: {"error": {...}} with a 4xx status."""

    def __init__(self, message: str, *, status: int = 400, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message, self.status, self.param, self.code = message, status, param, code


class Serving:
    def __init__(self, engine: Engine, model_name: str, chat_template: ChatTemplate | None, system_fingerprint: str):
        if engine.tokenizer is None:
            raise ValueError("rzero serve needs an engine with a tokenizer")
        self.async_engine = AsyncEngine(engine)
        self.tokenizer = engine.tokenizer
        self.pieces = TokenPieces(engine.tokenizer)
        self._max_chars_per_token = _max_chars_per_token(engine.tokenizer)
        self.max_model_len = engine.max_model_len
        self.model_name = model_name
        self.chat_template = chat_template
        self.system_fingerprint = system_fingerprint

    def check_model(self, name: str) -> None:
        if name != self.model_name:
            raise APIError(f"The model `{name}` does not exist", status=404, param="model", code="model_not_found")

    async def tokenize(self, text: str, prompt_param: str) -> list[int]:
        """The text's token ids, computed on a worker thread: a long prompt takes seconds to tokenize,
        and the event loop must keep answering meanwhile. A text whose length alone proves that it
        overflows the context is refused without being tokenized."""
        at_least = self._min_tokens(text)
        if at_least >= self.max_model_len:
            raise APIError(
                f"The prompt has {len(text)} characters, so at least {at_least} tokens, but the model's context "
                f"is {self.max_model_len} tokens",
                param=prompt_param,
                code="context_length_exceeded",
            )
        # encode_batch_fast: encode holds the GIL throughout (the loop would stall anyway), and the
        # offsets that the fast variant skips would cost half as much again in time and memory.
        (encoding,) = await asyncio.to_thread(self.tokenizer.encode_batch_fast, [text], add_special_tokens=False)
        return encoding.ids

    def _min_tokens(self, text: str) -> int:
        """A lower bound on the text's token count, from its length alone (0 if the tokenizer gives none)."""
        if self._max_chars_per_token is None:
            return 0
        chars = len(text)
        if not unicodedata.is_normalized("NFC", text):
            # NFC joins at most 4 code points into one (the longest canonical decomposition, e.g. U+1F82).
            chars = -(-chars // 4)
        return -(-chars // self._max_chars_per_token)

    def completion_budget(self, num_prompt_tokens: int, requested: int | None, prompt_param: str) -> int:
        """max_tokens as requested (an error if prompt and completion overflow the context), or,
        if none was requested, all the context the prompt leaves."""
        room = self.max_model_len - num_prompt_tokens
        if room < 1:
            raise APIError(
                f"The prompt has {num_prompt_tokens} tokens but the model's context is {self.max_model_len} "
                "tokens, and at least one must be left for the completion",
                param=prompt_param,
                code="context_length_exceeded",
            )
        if requested is not None and requested > room:
            raise APIError(
                f"The model's context is {self.max_model_len} tokens, but {num_prompt_tokens} prompt tokens and "
                f"max_tokens={requested} need {num_prompt_tokens + requested}",
                param="max_tokens",
                code="context_length_exceeded",
            )
        return room if requested is None else requested

    @staticmethod
    def sampling_params(request: SamplingRequest, max_tokens: int, top_logprobs: int) -> SamplingParams:
        return SamplingParams(
            temperature=request.temperature,
            top_p=request.top_p,
            top_k=request.top_k,
            max_tokens=max_tokens,
            stop=request.stop,
            seed=request.seed,  # None: the engine derives one per request
            n=request.n,
            top_logprobs=top_logprobs,
        )

    async def submit(self, prompts: list[list[int]], params: SamplingParams, request_id: str) -> RequestStream:
        try:
            return await self.async_engine.submit(prompts, params, request_id)
        except ValueError as error:  # the engine's own input checks (token ids, cache size, ...)
            raise APIError(str(error)) from error

    def token_logprob(self, token_id: int, logprob: float, top: list[tuple[int, float]] | None) -> TokenLogprob:
        return TokenLogprob(
            token=self.pieces.text(token_id),
            logprob=logprob,
            bytes=self.pieces.bytes(token_id),
            top_logprobs=[
                TopLogprob(token=self.pieces.text(i), logprob=value, bytes=self.pieces.bytes(i))
                for i, value in top or []
            ],
        )


def _max_chars_per_token(tokenizer: Tokenizer) -> int | None:
    """The most characters of NFC text one token can stand for, if the tokenizer bounds it.

    Byte-level BPE (rzero's models) puts every byte of the normalized text in exactly one token, and
    a token's vocabulary entry has one character per byte, so no token stands for more characters
    than the longest entry has. Other tokenizers may drop characters (whitespace splitting, strip
    normalizers), and other normalizers may merge them: no bound.
    """
    if not isinstance(tokenizer.decoder, decoders.ByteLevel):
        return None
    if tokenizer.normalizer is not None and not isinstance(tokenizer.normalizer, normalizers.NFC):
        return None
    return max(len(token) for token in tokenizer.get_vocab(with_added_tokens=True))


async def collect(stream: RequestStream, samples: list[Sample]) -> None:
    """Run the request to its end, filling in its samples."""
    try:
        async for index, out in stream:
            samples[index].add(out)
    finally:
        stream.close()


def usage(num_prompt_tokens: int, samples: list[Sample]) -> Usage:
    completion_tokens = sum(len(s.token_ids) for s in samples)
    return Usage(
        prompt_tokens=num_prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=num_prompt_tokens + completion_tokens,
    )


def event_stream(events: AsyncIterator[BaseModel], stream: RequestStream) -> StreamingResponse:
    """Server-sent events: one `data: {json}` per event, then `data: [DONE]`."""

    async def lines() -> AsyncIterator[str]:
        try:
            async for event in events:
                yield f"data: {event.model_dump_json()}\n\n"
            yield "data: [DONE]\n\n"
        finally:  # also when the client disconnects: Starlette cancels the stream
            stream.close()

    return StreamingResponse(lines(), media_type="text/event-stream")


async def until_done_or_disconnected(request: Request, work: Coroutine) -> bool:
    """Run work unless the client disconnects first (then cancel it); True if it ran to its end."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if task in done:
        task.result()  # re-raises its error
        return True
    return False


async def _disconnect(request: Request) -> None:
    # The body has been read, so the next ASGI message is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass
