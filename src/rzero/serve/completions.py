"""POST /v1/completions: raw prompts (text or token ids, one or several), no chat template."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

from fastapi import Request, Response

from rzero.serve.async_engine import RequestStream
from rzero.serve.protocol import Completion, CompletionChoice, CompletionLogprobs, CompletionRequest
from rzero.serve.sample import Sample
from rzero.serve.serving import APIError, Serving, collect, event_stream, until_done_or_disconnected, usage


async def create_completion(serving: Serving, request: CompletionRequest, http: Request) -> Response | Completion:
    serving.check_model(request.model)
    prompts = [await serving.tokenize(p, "prompt") if isinstance(p, str) else p for p in request.prompts()]
    if not prompts:
        raise APIError("prompt must not be empty", param="prompt")
    for prompt in prompts:  # each must leave room for max_tokens
        serving.completion_budget(len(prompt), request.max_tokens, "prompt")
    params = serving.sampling_params(request, request.max_tokens, request.logprobs or 0)
    response_id = f"cmpl-{uuid.uuid4().hex}"
    stream = await serving.submit(prompts, params, response_id)
    samples = [Sample(serving.tokenizer, request.stop, parse_tools=False) for _ in stream.sample_ids]
    # Choice i continues prompt i // n; echo puts the prompt as sent in front of its completions.
    texts = [
        p if isinstance(p, str) else serving.tokenizer.decode(p, skip_special_tokens=False) for p in request.prompts()
    ]
    echoes = [texts[i // request.n] if request.echo else "" for i in range(len(samples))]
    meta = {"id": response_id, "model": request.model, "system_fingerprint": serving.system_fingerprint}
    num_prompt_tokens = sum(len(p) for p in prompts)
    if request.stream:
        return event_stream(_chunks(serving, request, stream, samples, echoes, num_prompt_tokens, meta), stream)

    if not await until_done_or_disconnected(http, collect(stream, samples)):
        return Response(status_code=499)  # nobody is listening any more
    choices = [
        CompletionChoice(
            index=i,
            text=echoes[i] + sample.text,
            logprobs=_logprobs(serving, sample, range(len(sample.token_ids))) if request.logprobs is not None else None,
            finish_reason=sample.finish_reason,
        )
        for i, sample in enumerate(samples)
    ]
    return Completion(choices=choices, usage=usage(num_prompt_tokens, samples), **meta)


async def _chunks(
    serving: Serving,
    request: CompletionRequest,
    stream: RequestStream,
    samples: list[Sample],
    echoes: list[str],
    num_prompt_tokens: int,
    meta: dict,
) -> AsyncIterator[Completion]:
    for index, echo in enumerate(echoes):
        if echo:
            yield Completion(choices=[CompletionChoice(index=index, text=echo)], **meta)
    async for index, out in stream:
        sample = samples[index]
        sample.add(out)
        text = sample.content_delta()
        if not (text or request.logprobs is not None or sample.finished):
            continue
        last = len(sample.token_ids) - 1
        logprobs = _logprobs(serving, sample, [last]) if request.logprobs is not None else None
        choice = CompletionChoice(index=index, text=text, logprobs=logprobs, finish_reason=sample.finish_reason)
        yield Completion(choices=[choice], **meta)
    if request.include_usage:
        yield Completion(choices=[], usage=usage(num_prompt_tokens, samples), **meta)


def _logprobs(serving: Serving, sample: Sample, positions) -> CompletionLogprobs:
    """The legacy format: each top_logprobs entry also holds the sampled token, as OpenAI's does."""
    pieces = [serving.pieces.text(t) for t in sample.token_ids]
    offsets = [0]  # text_offset: where each token's text starts in the completion
    for piece in pieces[:-1]:
        offsets.append(offsets[-1] + len(piece))
    top = []
    for i in positions:
        alternatives = {serving.pieces.text(t): value for t, value in sample.top_logprobs[i] or []}
        top.append({**alternatives, pieces[i]: sample.logprobs[i]})
    return CompletionLogprobs(
        tokens=[pieces[i] for i in positions],
        token_logprobs=[sample.logprobs[i] for i in positions],
        top_logprobs=top,
        text_offset=[offsets[i] for i in positions],
    )
