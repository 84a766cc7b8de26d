"""rzero serve: the OpenAI-compatible HTTP server, exercised with the official `openai` client
against a real uvicorn server on a free port.

The central property: under invariant numerics a request returns the same tokens and logprobs,
bit for bit (==), whether it runs alone or inside a busy continuous batch, and those logprobs are
the engine's own. A standard-numerics negative control shows the comparison can fail.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import shutil
import socket
import threading
import time
import unicodedata

import httpx
import openai
import pytest
import torch
import uvicorn

from rzero import cli
from rzero.engine import Engine, SamplingParams
from rzero.engine.sequence import StepOutput
from rzero.model.io import load_model
from rzero.model.tokenizer import load_tokenizer
from rzero.ops import AttentionMeta
from rzero.rollout.record import Rollout
from rzero.serve import ChatTemplate, build_app
from rzero.serve.sample import Sample
from rzero.serve.text import TokenPieces, settled_length
from rzero.serve.tool_calls import ParsedToolCall, parse_tool_calls
from rzero.train.trainer import Trainer, TrainerSettings

MODEL = "tiny"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            # Non-ASCII and HTML characters: Jinja's own tojson would escape or reorder them.
            "description": "Evaluate a math expression like <b>2 & 3</b>, e.g. « 12 * 7 ».",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    }
]
TOOL_QUESTION = [{"role": "user", "content": "What is 12 * 7?"}]
TOOL_ANSWER = (
    'Let me compute it.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "12 * 7"}}\n</tool_call>'
)


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """One intra-op thread: these tests are about batching, and the machine is small and shared."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@contextlib.contextmanager
def running(app):
    """Serve the app with uvicorn on a free port in a background thread; yield the API's base URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
    finally:
        server.should_exit = True
        thread.join()
        sock.close()


@pytest.fixture(scope="module")
def model_dir(tiny_dense_dir):
    return tiny_dense_dir


@pytest.fixture(scope="module")
def template(model_dir) -> ChatTemplate:
    return ChatTemplate.from_model_dir(model_dir)


@pytest.fixture(scope="module")
def engine(model_dir) -> Engine:
    """The served engine (tests may look at it; only the server's thread steps it)."""
    return Engine(model_dir)


@pytest.fixture(scope="module")
def app(engine, template):
    return build_app(engine, MODEL, template)


@pytest.fixture(scope="module")
def base_url(app):
    with running(app) as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def reference(model_dir) -> Engine:
    """A separate engine, never served: what the server's answers must equal."""
    return Engine(model_dir)


def hf_chat_prompt(model_dir, messages, tools=None) -> str:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)


def prompt_ids(reference: Engine, template: ChatTemplate, messages, tools=None) -> list[int]:
    return reference.tokenizer.encode(template.render(messages, tools), add_special_tokens=False).ids


def token_bytes(choice) -> list[list[int]]:
    return [entry.bytes for entry in choice.logprobs.content]


# ---------------------------------------------------------------------------------------------
# parts
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, content, calls",
    [
        ("just text", "just text", []),
        (TOOL_ANSWER, "Let me compute it.", [ParsedToolCall("calculator", '{"expression": "12 * 7"}')]),
        (
            '<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n<tool_call>{"name": "b"}</tool_call>\n',
            None,
            [ParsedToolCall("a", "{}"), ParsedToolCall("b", "{}")],
        ),
        (
            'x <tool_call>\n{"name": "a", "arguments": {"q": 1}',
            'x <tool_call>\n{"name": "a", "arguments": {"q": 1}',
            [],
        ),
        (
            '<tool_call>{"name": "a", "arguments": {}</tool_call>',
            '<tool_call>{"name": "a", "arguments": {}</tool_call>',
            [],
        ),
        ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),
        (
            '<tool_call>{"name": "a", "arguments": "q"}</tool_call>',
            '<tool_call>{"name": "a", "arguments": "q"}</tool_call>',
            [],
        ),
        ('<tool_call>{"name": "a"}</tool_call> and more', '<tool_call>{"name": "a"}</tool_call> and more', []),
    ],
)
def test_parse_tool_calls(text, content, calls):
    assert parse_tool_calls(text) == (content, calls)


@pytest.mark.parametrize(
    "text, stop, tools, settled",
    [
        ("hello wor", [], False, 9),
        ("hello wor", ["world"], False, 6),  # "wor" may become "world"
        ("hello wor", ["xyz"], False, 9),
        ("caf\ufffd", [], False, 3),  # an incomplete UTF-8 character
        ("ok <tool_c", [], True, 2),  # may become <tool_call>; the space before it too
        ("ok <tool_c", [], False, 10),
        ("ok\n<tool_call>\n{", [], True, 2),
        ("ok <b>", [], True, 6),
    ],
)
def test_settled_length(text, stop, tools, settled):
    assert settled_length(text, stop, tools) == settled


def test_token_bytes_rebuild_multibyte_characters(reference):
    pieces = TokenPieces(reference.tokenizer)
    text = "héllo € 日本 <|im_end|>"
    ids = reference.tokenizer.encode(text, add_special_tokens=False).ids
    assert any("\ufffd" in pieces.text(i) for i in ids), "expected a token that is part of a character"
    assert b"".join(bytes(pieces.bytes(i)) for i in ids).decode() == text


def test_length_bound_never_exceeds_the_token_count(app):
    """The bound that refuses a prompt untokenized is sound, even on text made of the longest tokens."""
    serving = app.state.serving
    tokenizer = serving.tokenizer
    longest = sorted(tokenizer.get_vocab(with_added_tokens=True).items(), key=lambda item: -len(item[0]))[:20]
    texts = [tokenizer.decode([i], skip_special_tokens=False) * 50 for _, i in longest]
    texts += ["hi " * 1000, " " * 5000, "0123456789" * 300, "日本 € 🙂" * 500]
    texts += [unicodedata.normalize("NFD", "\u1f82") * 1000, "\u1100\u1161\u11a8" * 1000]  # NFC joins these
    for text in texts:
        num_tokens = len(tokenizer.encode(text, add_special_tokens=False).ids)
        assert 0 < serving._min_tokens(text) <= num_tokens, text[:40]


def test_chat_template_renders_like_transformers(model_dir, template):
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 12 * 7, and 3 + 4?"},
        {
            "role": "assistant",
            "content": "Let me compute.",
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "calculator", "arguments": '{"expression": "12 * 7"}'},
                },
                {
                    "id": "c2",
                    "type": "function",
                    "function": {"name": "calculator", "arguments": {"expression": "3 + 4"}},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "84"},
        {"role": "tool", "tool_call_id": "c2", "content": "7"},
        {"role": "user", "content": "Thanks — « and now? »"},
    ]
    rendered = template.render(messages, TOOLS)
    assert rendered == hf_chat_prompt(model_dir, messages, TOOLS)
    assert "<b>2 & 3</b>" in rendered and "«" in rendered
    assert template.render(messages[:2]) == hf_chat_prompt(model_dir, messages[:2])


def test_tool_call_response_from_model_text(reference):
    """Response building on a given text: the tool call comes back parsed, finish_reason tool_calls."""
    tokenizer = reference.tokenizer
    ids = tokenizer.encode(TOOL_ANSWER + "<|im_end|>", add_special_tokens=False).ids
    sample = Sample(tokenizer, stop=[], parse_tools=True)
    streamed = []
    for i, token in enumerate(ids):
        last = i == len(ids) - 1
        sample.add(StepOutput("r", token, -1.0, 0, last, "stop" if last else None))
        streamed.append(sample.content_delta())
    assert sample.result() == ("Let me compute it.", [ParsedToolCall("calculator", '{"expression": "12 * 7"}')])
    assert sample.finish_reason == "tool_calls"
    assert "".join(streamed) == "Let me compute it."


# ---------------------------------------------------------------------------------------------
# the server
# ---------------------------------------------------------------------------------------------


def test_models(client):
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_chat_completion(client, reference, template):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 3?"}]
    response = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, seed=7, n=3)
    assert response.object == "chat.completion" and response.model == MODEL
    assert response.system_fingerprint == "rzero-invariant-float32"
    assert [c.index for c in response.choices] == [0, 1, 2]
    assert len({c.message.content for c in response.choices}) > 1, "samples of one request should differ"
    for choice in response.choices:
        assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
        assert choice.finish_reason in ("stop", "length") and not choice.message.tool_calls
    assert response.usage.prompt_tokens == len(prompt_ids(reference, template, messages))
    assert response.usage.total_tokens == response.usage.prompt_tokens + response.usage.completion_tokens

    again = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, seed=7, n=3)
    assert [c.message.content for c in again.choices] == [c.message.content for c in response.choices]
    unseeded = [client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12) for _ in range(2)]
    assert unseeded[0].choices[0].message.content != unseeded[1].choices[0].message.content


@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_chat_logprobs_are_the_engines(client, reference, template, temperature):
    messages = [{"role": "user", "content": "Count to five."}]
    response = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=20, seed=3, temperature=temperature, top_p=0.9,
        logprobs=True, top_logprobs=3,
    )  # fmt: skip
    choice = response.choices[0]
    params = SamplingParams(max_tokens=20, seed=3, temperature=temperature, top_p=0.9, top_logprobs=3)
    expected = reference.generate(prompt_ids(reference, template, messages), params)[0]
    pieces = TokenPieces(reference.tokenizer)

    entries = choice.logprobs.content
    assert len(entries) == len(expected.token_ids) == response.usage.completion_tokens
    assert all(math.isfinite(e.logprob) for e in entries)
    assert [e.logprob for e in entries] == expected.logprobs  # bitwise: Python floats from fp32
    assert token_bytes(choice) == [pieces.bytes(t) for t in expected.token_ids]
    for entry, top in zip(entries, expected.top_logprobs):
        assert [(a.bytes, a.logprob) for a in entry.top_logprobs] == [(pieces.bytes(t), v) for t, v in top]
        assert 1 <= len(entry.top_logprobs) <= 3
        assert entry.top_logprobs[0].logprob >= entry.logprob
    text_tokens = entries[:-1] if choice.finish_reason == "stop" else entries  # the last is <|im_end|>
    assert b"".join(bytes(e.bytes) for e in text_tokens).decode(errors="replace") == choice.message.content


def test_streamed_chat_equals_non_streamed(client):
    request = dict(model=MODEL, messages=[{"role": "user", "content": "Tell me a story."}], max_tokens=40, seed=11)
    full = client.chat.completions.create(**request, logprobs=True, n=2)
    chunks = list(
        client.chat.completions.create(
            **request, logprobs=True, n=2, stream=True, stream_options={"include_usage": True}
        )
    )
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert chunks[-1].choices == [] and chunks[-1].usage == full.usage
    for index, choice in enumerate(full.choices):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == index]
        assert mine[0].delta.role == "assistant"
        assert "".join(c.delta.content or "" for c in mine) == choice.message.content
        assert [e for c in mine if c.logprobs for e in c.logprobs.content] == choice.logprobs.content
        assert [c.finish_reason for c in mine if c.finish_reason] == [choice.finish_reason]


def test_completions_token_prompts_n_and_logprobs(client, reference):
    prompts = [[5, 6, 7, 8, 9], list(range(100, 140))]
    response = client.completions.create(model=MODEL, prompt=prompts, n=2, max_tokens=10, seed=5, logprobs=2)
    assert len(response.choices) == 4 and response.usage.prompt_tokens == 45
    for prompt_index, prompt in enumerate(prompts):
        expected = reference.generate(prompt, SamplingParams(n=2, max_tokens=10, seed=5, top_logprobs=2))
        for sample, out in enumerate(expected):
            choice = response.choices[prompt_index * 2 + sample]
            assert choice.logprobs.token_logprobs == out.logprobs
            assert choice.text == reference.tokenizer.decode(out.token_ids)
            for token, value, top in zip(choice.logprobs.tokens, out.logprobs, choice.logprobs.top_logprobs):
                assert top[token] == value and len(top) <= 3


def test_completions_echo_stop_and_streaming(client):
    request = dict(model=MODEL, prompt="The answer is", max_tokens=30, seed=2)
    plain = client.completions.create(**request).choices[0]
    assert plain.finish_reason == "length" and len(plain.text) > 12
    stop = plain.text[8:10]
    cut = client.completions.create(**request, stop=[stop, "never appears"]).choices[0]
    assert cut.finish_reason == "stop" and cut.text == plain.text[: plain.text.find(stop)]
    chunks = list(client.completions.create(**request, stop=[stop, "never appears"], stream=True))
    assert "".join(c.choices[0].text for c in chunks) == cut.text
    assert chunks[-1].choices[0].finish_reason == "stop"
    echoed = client.completions.create(**request, echo=True).choices[0]
    assert echoed.text == "The answer is" + plain.text


BAD_REQUESTS = [
    ({"model": MODEL}, "messages"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, "temperature"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": -1}, "max_tokens"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "top_p": 0}, "top_p"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": 0}, "n"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stop": [""]}, "stop.0"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, None),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "logit_bias": {"5": 3}}, None),
    ({"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
    ({"model": MODEL, "messages": [{"role": "user"}]}, "messages.0"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5000}, "max_tokens"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi " * 2000}]}, "messages"),
    ({"model": MODEL, "prompt": [5000], "max_tokens": 2}, None),  # outside the vocabulary
    ({"model": MODEL, "prompt": [], "max_tokens": 2}, "prompt"),
]


@pytest.mark.parametrize("body, param", BAD_REQUESTS)
def test_bad_requests_get_openai_errors(base_url, body, param):
    path = "/completions" if "prompt" in body else "/chat/completions"
    response = httpx.post(base_url + path, json=body, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    assert error["param"] == param


def test_server_keeps_serving_after_errors(base_url, client):
    malformed = httpx.post(
        base_url + "/chat/completions",
        content=b'{"model": "tiny", "messages": [',
        headers={"content-type": "application/json"},
    )
    assert malformed.status_code == 400 and malformed.json()["error"]["code"] == "json_invalid"
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "hi"}])
    assert info.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="hi " * 2000)
    assert info.value.body["code"] == "context_length_exceeded"
    good = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert good.choices[0].finish_reason in ("stop", "length") and good.usage.completion_tokens >= 1


class GatedTokenizer:
    """The served tokenizer, except that encoding waits until the test has had /health answered
    while it waits: proof, without any timing, that tokenizing leaves the event loop free."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.encoding, self.health_answered = threading.Event(), threading.Event()
        self.answered_while_encoding: list[bool] = []

    def encode_batch_fast(self, *args, **kwargs):
        self.encoding.set()
        # Were encoding on the loop thread, /health could not be answered: the wait runs out.
        self.answered_while_encoding.append(self.health_answered.wait(timeout=20))
        return self.tokenizer.encode_batch_fast(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


def answered_alongside(base_url: str, request, gate: GatedTokenizer | None = None) -> httpx.Response:
    """request() sent from a thread. With a gate, /health is asked for once the server is encoding and
    the gate is opened when it answers. The server must answer /health afterwards too."""
    answered = {}
    thread = threading.Thread(target=lambda: answered.update(response=request()))
    with httpx.Client(base_url=base_url.removesuffix("/v1"), timeout=60) as health:
        thread.start()
        if gate is not None:
            assert gate.encoding.wait(timeout=60), "the server never began encoding the prompt"
            assert health.get("/health").status_code == 200
            gate.health_answered.set()
        thread.join()
        assert health.get("/health").status_code == 200
    return answered["response"]


def post_json(url: str, body: bytes, chunked: bool = False) -> httpx.Response:
    """POST a JSON body, with a Content-Length or, chunked, without one."""
    content = (body[i : i + 2**16] for i in range(0, len(body), 2**16)) if chunked else body
    return httpx.post(url, content=content, headers={"content-type": "application/json"}, timeout=120)


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_body_past_the_cap_gets_413_and_the_server_stays_up(base_url, chunked):
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi " * 3_000_000}]}).encode()
    assert len(body) > 9_000_000
    response = answered_alongside(base_url, lambda: post_json(base_url + "/chat/completions", body, chunked))
    assert response.status_code == 413, response.text[:300]
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "request_too_large"
    assert str(4 * 1024**2) in error["message"]


@pytest.mark.parametrize("length_bound", [True, False], ids=["refused-by-length", "tokenized"])
def test_prompt_past_the_context_gets_400_and_health_stays_responsive(app, base_url, monkeypatch, length_bound):
    """Just under the body cap: refused from its length alone, never tokenized, or (the bound turned
    off) tokenized on a worker thread, during which the server keeps answering."""
    serving = app.state.serving
    gate = GatedTokenizer(serving.tokenizer)
    monkeypatch.setattr(serving, "tokenizer", gate)
    if not length_bound:
        monkeypatch.setattr(serving, "_max_chars_per_token", None)
    overhead = len(json.dumps({"model": MODEL, "messages": [{"role": "user", "content": ""}]}))
    content = "hi " * ((4 * 1024**2 - overhead) // 3)
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": content}]}).encode()
    assert 4 * 1024**2 - 3 < len(body) <= 4 * 1024**2
    send = lambda: post_json(base_url + "/chat/completions", body)  # noqa: E731
    response = answered_alongside(base_url, send, None if length_bound else gate)
    assert response.status_code == 400, response.text[:300]
    error = response.json()["error"]
    assert error["code"] == "context_length_exceeded" and error["param"] == "messages"
    assert "context is 1024 tokens" in error["message"]
    assert ("characters, so at least" in error["message"]) == length_bound, error["message"]
    assert gate.answered_while_encoding == ([] if length_bound else [True])


def test_client_disconnect_aborts_the_request(base_url, engine, monkeypatch):
    aborted = []
    real_abort = engine.abort
    monkeypatch.setattr(engine, "abort", lambda request_id: (aborted.append(request_id), real_abort(request_id)))
    monkeypatch.setattr(engine, "eos_token_ids", set())  # both requests run the whole 900 tokens unless aborted
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 900, "seed": 1}
    with httpx.stream("POST", base_url + "/completions", json={**body, "stream": True}, timeout=30) as response:
        assert next(response.iter_lines()).startswith("data: ")
    with pytest.raises(httpx.ReadTimeout):  # a non-streamed request whose client gives up
        httpx.post(base_url + "/completions", json=body, timeout=0.3)
    deadline = time.monotonic() + 10
    while (len(aborted) < 2 or engine.sequences) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(aborted) == 2 and not engine.sequences


# ---------------------------------------------------------------------------------------------
# the command: a model directory that cannot be served is named in one line
# ---------------------------------------------------------------------------------------------


def test_serve_names_a_missing_model_directory(tmp_path, capsys):
    missing = tmp_path / "nonexistent"
    assert cli.main(["serve", "--model", str(missing)]) == 2
    assert capsys.readouterr().err == f"rzero serve: error: {missing}: no such model directory\n"


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_serve_names_a_damaged_weights_file(model_dir, tmp_path, capsys, damage):
    broken = shutil.copytree(model_dir, tmp_path / "broken")
    weights = broken / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2] if damage == "truncated" else b"not a safetensors file" * 100)
    assert cli.main(["serve", "--model", str(broken)]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"rzero serve: error: {weights}: not a valid safetensors file (")


# ---------------------------------------------------------------------------------------------
# tool calls end to end: a model fine-tuned to answer TOOL_QUESTION with TOOL_ANSWER
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tool_base_url(model_dir, template):
    """The tiny model, taught the tool call on the prompt transformers renders (a few seconds)."""
    tokenizer = load_tokenizer(model_dir)
    prompt = tokenizer.encode(hf_chat_prompt(model_dir, TOOL_QUESTION, TOOLS), add_special_tokens=False).ids
    target = tokenizer.encode(TOOL_ANSWER + "<|im_end|>", add_special_tokens=False).ids
    # The trainer's own supervised step (AdamW, no weight decay, no clipping = Adam).
    settings = TrainerSettings(lr=2e-2, grad_clip=math.inf, decompose=False)
    trainer = Trainer(load_model(model_dir, "fp32"), torch.float32, settings)
    model = trainer.master
    answer = Rollout(prompt, target, [0.0] * len(target), [0] * len(target), 0.0)
    tokens, targets = torch.tensor(prompt + target), torch.tensor(target)
    meta, _ = AttentionMeta.for_sequences([len(tokens)], row_tile=model.numerics.row_tile)
    for _ in range(300):  # until greedy decoding reproduces the answer (about 130 steps)
        with torch.no_grad():
            logits = model.logits(model(tokens, meta))[len(prompt) - 1 : -1]
        if torch.equal(logits.argmax(-1), targets):
            break
        trainer.supervised_step([answer])
    with running(build_app(Engine(model, tokenizer=tokenizer), MODEL, template)) as url:
        yield url


def test_tool_calls_end_to_end(tool_base_url):
    client = openai.OpenAI(base_url=tool_base_url, api_key="unused", max_retries=0, timeout=60)
    request = dict(model=MODEL, messages=TOOL_QUESTION, tools=TOOLS, temperature=0, max_tokens=60)
    choice = client.chat.completions.create(**request).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me compute it."
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "calculator" and json.loads(call.function.arguments) == {"expression": "12 * 7"}

    chunks = [c.choices[0] for c in client.chat.completions.create(**request, stream=True) if c.choices]
    assert "".join(c.delta.content or "" for c in chunks) == "Let me compute it."
    (streamed,) = [t for c in chunks for t in c.delta.tool_calls or []]
    assert (streamed.index, streamed.function.name, streamed.function.arguments) == (
        0,
        "calculator",
        call.function.arguments,
    )
    assert chunks[-1].finish_reason == "tool_calls"

    # tool_choice="none": the same text comes back as plain content.
    plain = client.chat.completions.create(**request, tool_choice="none").choices[0]
    assert plain.finish_reason == "stop" and plain.message.content == TOOL_ANSWER and not plain.message.tool_calls


# ---------------------------------------------------------------------------------------------
# batch invariance through the server
# ---------------------------------------------------------------------------------------------


async def alone_and_in_busy_batch(base_url: str, engine: Engine, probe: dict, busy: int = 16):
    """The probe request alone, then again while `busy` requests of different lengths and sampling
    settings are in flight (all decoding before it starts, most still running after it ends)."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)
    alone = await client.chat.completions.create(**probe)
    others = [
        asyncio.create_task(
            client.completions.create(
                model=MODEL, prompt="word " * (3 + 11 * i), max_tokens=160 + 3 * i, seed=100 + i,
                temperature=[1.0, 0.7, 0.0][i % 3], top_p=[1.0, 0.9][i % 2],
            )
        )
        for i in range(busy)
    ]  # fmt: skip
    # (read from outside the engine thread: only to wait). Long enough answers that the first are
    # still decoding when the last arrive, even at several decode steps per engine call.
    deadline = time.monotonic() + 60
    while len(engine.running) < busy:
        assert time.monotonic() < deadline, f"only {len(engine.running)} of {busy} requests ever ran together"
        await asyncio.sleep(0.002)
    in_batch = await client.chat.completions.create(**probe)
    still_running = sum(not task.done() for task in others)
    await asyncio.gather(*others)
    await client.close()
    assert still_running >= busy // 2
    return alone.choices[0], in_batch.choices[0]


PROBES = {
    "seeded-sampled": dict(temperature=1.0, top_p=0.95, seed=1234),
    "greedy": dict(temperature=0.0),
}


@pytest.mark.parametrize("kind", PROBES)
def test_same_request_alone_and_in_busy_batch_is_bitwise_identical(base_url, engine, kind):
    probe = dict(
        model=MODEL, messages=[{"role": "user", "content": "What is 2 + 3?"}], max_tokens=24, logprobs=True,
        **PROBES[kind],
    )  # fmt: skip
    alone, in_batch = asyncio.run(alone_and_in_busy_batch(base_url, engine, probe))
    assert len(alone.logprobs.content) >= 8
    assert token_bytes(in_batch) == token_bytes(alone)
    assert [e.logprob for e in in_batch.logprobs.content] == [e.logprob for e in alone.logprobs.content]
    assert in_batch.message.content == alone.message.content


def test_standard_numerics_negative_control(model_dir, template):
    """Under standard numerics the same comparison sees batch composition in the logprobs."""
    probe = dict(model=MODEL, messages=[{"role": "user", "content": "What is 2 + 3?"}], max_tokens=24, logprobs=True)
    engine = Engine(model_dir, numerics="standard")
    with running(build_app(engine, MODEL, template)) as url:
        alone, in_batch = asyncio.run(alone_and_in_busy_batch(url, engine, {**probe, "temperature": 0.0}))
    alone_lps = [e.logprob for e in alone.logprobs.content]
    batch_lps = [e.logprob for e in in_batch.logprobs.content]
    assert alone_lps != batch_lps, "standard numerics happened to be batch-invariant here"
