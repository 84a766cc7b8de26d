"""Request and response bodies of the OpenAI-compatible API (the subset `rzero serve` implements)."""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, field_validator, model_serializer, model_validator

# JSON clients lose integer precision past 2**53, and the engine seeds sample i of a request with
# seed * 1009 + i, which must stay below 2**64.
MAX_SEED = 2**53
MAX_TOP_LOGPROBS = 20

# OpenAI parameters this server cannot honour, with the values that ask for nothing: any other
# value is rejected rather than silently ignored.
_NEUTRAL_VALUES: dict[str, tuple] = {
    "logit_bias": (None, {}),
    "presence_penalty": (None, 0),
    "frequency_penalty": (None, 0),
    "best_of": (None, 1),
    "suffix": (None, ""),
    "response_format": (None, {"type": "text"}),
}


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingRequest(BaseModel):
    """Fields that chat and text completions share."""

    model: str
    temperature: float = Field(1.0, ge=0)  # 0: greedy
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)  # not in OpenAI's API (pass it in extra_body); 0 disables it
    n: int = Field(1, ge=1, le=128)
    max_tokens: int | None = Field(None, ge=1)
    stop: list[Annotated[str, Field(min_length=1)]] = Field(default_factory=list, max_length=16)
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    stream: bool = False
    stream_options: StreamOptions | None = None

    @model_validator(mode="before")
    @classmethod
    def _check_parameters(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        for name, neutral in _NEUTRAL_VALUES.items():
            if name in data and data[name] not in neutral:
                raise ValueError(f"{name} is not supported by this server")
        # In OpenAI's API an explicit null means "the default".
        return {key: value for key, value in data.items() if value is not None}

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_list(cls, stop: Any) -> Any:
        return [stop] if isinstance(stop, str) else stop

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


# ---------------------------------------------------------------------------- chat requests


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    name: str
    arguments: str | dict[str, Any]


class MessageToolCall(BaseModel):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _has_content(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs content")
        return self

    def template_data(self) -> dict[str, Any]:
        """The message as the chat template reads it: text parts joined, unset fields left out."""
        data = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            data["content"] = "\n".join(part.text for part in self.content)
        return data


class FunctionDefinition(BaseModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(BaseModel):
    type: Literal["function"]
    function: FunctionDefinition


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    # Kept as sent: the template prints them with tojson, so key order and extra keys matter.
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["auto", "none"] = "auto"  # "required" or a named function would need constrained decoding
    logprobs: bool = False
    top_logprobs: int = Field(0, ge=0, le=MAX_TOP_LOGPROBS)
    max_completion_tokens: int | None = Field(None, ge=1)

    @field_validator("tools")
    @classmethod
    def _tool_schemas(cls, tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        for tool in tools or []:
            Tool.model_validate(tool)
        return tools

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        return self


# ---------------------------------------------------------------------------- text completion requests


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int = Field(16, ge=1)  # OpenAI's default for text completions
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    @model_validator(mode="after")
    def _echo_without_logprobs(self) -> CompletionRequest:
        # Prompt logprobs from the prefix cache are not recomputed, so echoed tokens would lack them.
        if self.echo and self.logprobs is not None:
            raise ValueError("echo together with logprobs is not supported")
        return self

    def prompts(self) -> list[str | list[int]]:
        """The prompt(s) as a list: one text or token-id list per prompt."""
        if isinstance(self.prompt, str) or (self.prompt and isinstance(self.prompt[0], int)):
            return [self.prompt]
        return list(self.prompt)


# ---------------------------------------------------------------------------- responses


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob]


class ResponseFunctionCall(BaseModel):
    name: str
    arguments: str


class ResponseToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: ResponseFunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ResponseToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str


class _Response(BaseModel):
    id: str
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    system_fingerprint: str


class ChatCompletion(_Response):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage


class DeltaToolCall(ResponseToolCall):
    index: int


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer(mode="wrap")
    def _only_what_changed(self, handler) -> dict[str, Any]:
        return {key: value for key, value in handler(self).items() if value is not None}


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(_Response):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class Completion(_Response):
    """A text completion, and also each chunk of a streamed one."""

    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "rzero"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
