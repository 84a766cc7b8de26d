"""`rzero serve`: the FastAPI app over one engine, its error answers, and the command's entry point."""

from __future__ import annotations

import argparse
import time
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from rzero.engine import Engine
from rzero.ops.device import intra_op_threads, model_dir_threads
from rzero.serve.chat import create_chat_completion
from rzero.serve.chat_template import ChatTemplate
from rzero.serve.completions import create_completion
from rzero.serve.protocol import (
    ChatCompletion,
    ChatCompletionRequest,
    Completion,
    CompletionRequest,
    ErrorInfo,
    ErrorResponse,
    ModelCard,
    ModelList,
)
from rzero.serve.serving import APIError, Serving


def build_app(
    engine: Engine, model_name: str, chat_template: ChatTemplate | None = None, max_request_bytes: int = 4 * 1024**2
) -> FastAPI:
    """The app; its lifespan starts and stops the thread that steps the engine. Request bodies
    past max_request_bytes are answered 413."""
    dtype = str(engine.model.dtype).removeprefix("torch.")
    serving = Serving(engine, model_name, chat_template, system_fingerprint=f"rzero-{engine.numerics.mode}-{dtype}")
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        serving.async_engine.start()
        try:
            yield
        finally:
            serving.async_engine.stop()

    app = FastAPI(title="rzero", lifespan=lifespan)
    app.state.serving = serving
    app.add_middleware(_BodyLimit, max_bytes=max_request_bytes)

    @app.get("/health")
    async def health() -> dict:
        return {}

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=model_name, created=created, max_model_len=serving.max_model_len)])

    @app.post("/v1/chat/completions", response_model=ChatCompletion, responses={400: {"model": ErrorResponse}})
    async def chat_completions(request: ChatCompletionRequest, http: Request) -> Response | ChatCompletion:
        return await create_chat_completion(serving, request, http)

    @app.post("/v1/completions", response_model=Completion, responses={400: {"model": ErrorResponse}})
    async def completions(request: CompletionRequest, http: Request) -> Response | Completion:
        return await create_completion(serving, request, http)

    _answer_errors_as_openai_does(app)
    return app


class _BodyTooLarge(HTTPException):
    # An HTTPException, so that FastAPI lets it out of its body parsing unchanged.
    def __init__(self, max_bytes: int):
        super().__init__(413, f"The request body is larger than this server's limit of {max_bytes} bytes")


class _BodyLimit:
    """Refuse a request body past max_bytes before it is held in memory, parsed and tokenized:
    before reading any of it when its Content-Length says so, else (a chunked body) as soon as the
    bytes received pass the limit. Only endpoints that read their body are concerned."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        received = 0

        async def receive_within_limit() -> Message:
            nonlocal received
            if declared is not None and int(declared) > self.max_bytes:
                raise _BodyTooLarge(self.max_bytes)
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_bytes:
                raise _BodyTooLarge(self.max_bytes)
            return message

        await self.app(scope, receive_within_limit, send)


def _answer_errors_as_openai_does(app: FastAPI) -> None:
    @app.exception_handler(_BodyTooLarge)
    async def body_too_large(_: Request, error: _BodyTooLarge) -> JSONResponse:
        return _error(413, error.detail, code="request_too_large")

    @app.exception_handler(APIError)
    async def api_error(_: Request, error: APIError) -> JSONResponse:
        return _error(error.status, error.message, error.param, error.code)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(_: Request, error: RequestValidationError) -> JSONResponse:
        errors = error.errors()
        if errors[0]["type"] == "json_invalid":
            return _error(400, f"The body is not valid JSON: {errors[0]['ctx']['error']}", code="json_invalid")
        # A value matching no member of a union gets one error per member: say them all.
        places = [".".join(str(part) for part in e["loc"] if part != "body") for e in errors]
        message = "; ".join(f"{place}: {e['msg']}" if place else e["msg"] for place, e in zip(places, errors))
        return _error(400, message, places[0] or None, errors[0]["type"])

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, error: HTTPException) -> JSONResponse:
        return _error(error.status_code, str(error.detail))

    @app.exception_handler(Exception)
    async def internal_error(_: Request, error: Exception) -> JSONResponse:
        return _error(500, f"internal error: {error!r}", kind="internal_error")


def _error(
    status: int, message: str, param: str | None = None, code: str | None = None, kind: str = "invalid_request_error"
) -> JSONResponse:
    body = ErrorResponse(error=ErrorInfo(message=message, type=kind, param=param, code=code))
    return JSONResponse(body.model_dump(), status_code=status)


def main(args: argparse.Namespace) -> int:
    import uvicorn

    if not Path(args.model).is_dir():  # else the first file looked for would be named as missing
        raise FileNotFoundError(f"{args.model}: no such model directory")
    with intra_op_threads(model_dir_threads(args.model, args.threads, args.dtype, args.numerics)):
        engine = Engine(
            args.model,
            numerics=args.numerics,
            device=args.device,
            dtype=args.dtype, max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len, seed=args.seed,
            decode_steps_per_call=args.decode_steps_per_call,
        )
        name = args.served_model_name or Path(args.model).resolve().name
        app = build_app(engine, name, ChatTemplate.from_model_dir(args.model), args.max_request_bytes)
        print(f"serving {name} ({args.numerics} numerics, {args.dtype}, {engine.device}) at http://{args.host}:{args.port}/v1")
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0
