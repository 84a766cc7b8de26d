"""POST /v1/chat/completions: messages rendered with the model's chat template, tool calls parsed back."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

from fastapi import Request, Response

from rzero.serve.async_engine import RequestStream
from rzero.serve.chat_template import ChatTemplateError
from rzero.serve.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatDelta,
    ChoiceLogprobs,
    DeltaToolCall,
    ResponseFunctionCall,
    ResponseToolCall,
)
from rzero.serve.sample import Sample
from rzero.serve.serving import APIError, Serving, collect, event_stream, until_done_or_disconnected, usage
from rzero.serve.tool_calls import ParsedToolCall


async def create_chat_completion(
    serving: Serving, request: ChatCompletionRequest, http: Request
) -> Response | ChatCompletion:
    serving.check_model(request.model)
    if serving.chat_template is None:
        raise APIError("This model has no chat template; use /v1/completions", param="messages")
    messages = [m.template_data() for m in request.messages]
    try:  # on a worker thread, as tokenizing: a template is arbitrary code, over a body of up to the cap
        text = await asyncio.to_thread(serving.chat_template.render, messages, request.tools)
    except ChatTemplateError as error:
        raise APIError(str(error), param="messages") from error
    prompt = await serving.tokenize(text, "messages")
    max_tokens = serving.completion_budget(len(prompt), request.max_completion_tokens or request.max_tokens, "messages")
    params = serving.sampling_params(request, max_tokens, request.top_logprobs)
    response_id = f"chatcmpl-{uuid.uuid4().hex}"
    stream = await serving.submit([prompt], params, response_id)
    parse_tools = bool(request.tools) and request.tool_choice == "auto"
    samples = [Sample(serving.tokenizer, request.stop, parse_tools) for _ in stream.sample_ids]
    meta = {"id": response_id, "model": request.model, "system_fingerprint": serving.system_fingerprint}
    if request.stream:
        return event_stream(_chunks(serving, request, stream, samples, len(prompt), meta), stream)

    if not await until_done_or_disconnected(http, collect(stream, samples)):
        return Response(status_code=499)  # nobody is listening any more
    choices = [_choice(serving, i, s, request.logprobs) for i, s in enumerate(samples)]
    return ChatCompletion(choices=choices, usage=usage(len(prompt), samples), **meta)


def _choice(serving: Serving, index: int, sample: Sample, logprobs: bool) -> ChatChoice:
    content, calls = sample.result()
    return ChatChoice(
        index=index,
        message=AssistantMessage(content=content, tool_calls=[_tool_call(c) for c in calls] or None),
        logprobs=_logprobs(serving, sample, range(len(sample.token_ids))) if logprobs else None,
        finish_reason=sample.finish_reason,
    )


async def _chunks(
    serving: Serving,
    request: ChatCompletionRequest,
    stream: RequestStream,
    samples: list[Sample],
    num_prompt_tokens: int,
    meta: dict,
) -> AsyncIterator[ChatCompletionChunk]:
    for index in range(len(samples)):
        yield ChatCompletionChunk(
            choices=[ChatChunkChoice(index=index, delta=ChatDelta(role="assistant", content=""))], **meta
        )
    async for index, out in stream:
        sample = samples[index]
        sample.add(out)
        content = sample.content_delta()
        calls = sample.result()[1] if sample.finished else []
        if not (content or calls or request.logprobs or sample.finished):
            continue
        delta = ChatDelta(content=content or None, tool_calls=[_tool_call(c, k) for k, c in enumerate(calls)] or None)
        logprobs = _logprobs(serving, sample, [len(sample.token_ids) - 1]) if request.logprobs else None
        choice = ChatChunkChoice(index=index, delta=delta, logprobs=logprobs, finish_reason=sample.finish_reason)
        yield ChatCompletionChunk(choices=[choice], **meta)
    if request.include_usage:
        yield ChatCompletionChunk(choices=[], usage=usage(num_prompt_tokens, samples), **meta)


def _tool_call(call: ParsedToolCall, index: int | None = None) -> ResponseToolCall:
    fields = {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "function": ResponseFunctionCall(name=call.name, arguments=call.arguments),
    }
    return ResponseToolCall(**fields) if index is None else DeltaToolCall(index=index, **fields)


def _logprobs(serving: Serving, sample: Sample, positions) -> ChoiceLogprobs:
    return ChoiceLogprobs(
        content=[
            serving.token_logprob(sample.token_ids[i], sample.logprobs[i], sample.top_logprobs[i]) for i in positions
        ]
    )
