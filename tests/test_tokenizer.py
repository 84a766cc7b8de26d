import json

import pytest

from rzero.model.tokenizer import (
    EOS_TOKEN,
    EXTRA_TOKENS,
    IM_END,
    IM_START,
    PAD_TOKEN,
    SPECIAL_TOKENS,
    TOOL_CALL_END,
    TOOL_CALL_START,
    TOOL_RESPONSE_END,
    TOOL_RESPONSE_START,
    build_tokenizer,
    chat_template,
    load_tokenizer,
)

TOOLS = [{
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate a math expression.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
    },
}]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    build_tokenizer(d)
    return d


@pytest.fixture
def hf_tok(tok_dir, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tok_dir))


def test_files_written(tok_dir):
    assert (tok_dir / "tokenizer.json").is_file()
    cfg = json.loads((tok_dir / "tokenizer_config.json").read_text())
    assert cfg["chat_template"] == chat_template()
    assert cfg["eos_token"] == EOS_TOKEN == IM_END
    assert cfg["pad_token"] == PAD_TOKEN
    assert cfg["bos_token"] is None


def test_deterministic(tmp_path, tok_dir):
    build_tokenizer(tmp_path / "b")
    assert (tmp_path / "b" / "tokenizer.json").read_bytes() == (tok_dir / "tokenizer.json").read_bytes()
    assert (tmp_path / "b" / "tokenizer_config.json").read_bytes() == (tok_dir / "tokenizer_config.json").read_bytes()


@pytest.mark.parametrize("size", [512, 1024])
def test_vocab_size(tmp_path, size):
    build_tokenizer(tmp_path, vocab_size=size)
    assert load_tokenizer(tmp_path).get_vocab_size() == size


def test_autotokenizer_loads_offline(hf_tok):
    assert len(hf_tok) == 1024
    assert hf_tok.eos_token == IM_END and hf_tok.pad_token == PAD_TOKEN and hf_tok.bos_token is None
    assert hf_tok.eos_token_id == hf_tok.convert_tokens_to_ids(IM_END)


def test_digits_split_individually(tok_dir):
    tok = load_tokenizer(tok_dir)
    pieces = tok.encode("What is 12345 + 678?").tokens
    digits = [p for p in pieces if any(c.isdigit() for c in p)]
    assert digits == list("12345678")


def test_added_tokens_single_ids(tok_dir, hf_tok):
    tok = load_tokenizer(tok_dir)
    for t in SPECIAL_TOKENS + EXTRA_TOKENS:
        tid = tok.token_to_id(t)
        assert tid is not None
        assert tok.encode(f"x{t}y").ids[1] == tid
        assert hf_tok.encode(t) == [tid]
    # tool markers must survive skip_special_tokens (the engine parses them from text)
    ids = hf_tok.encode(f"{IM_START}{TOOL_CALL_START}hi{TOOL_CALL_END}{IM_END}")
    assert hf_tok.decode(ids, skip_special_tokens=True) == f"{TOOL_CALL_START}hi{TOOL_CALL_END}"


@pytest.mark.parametrize("s", [
    "What is 123 + 456?\nThe answer is \\boxed{579}.",
    "  leading and trailing spaces  \n\n\tTabs too\n",
    '{"name": "calculator", "arguments": {"expression": "12*34"}}',
    "def f(x):\n    return x ** 2  # square\n",
    "$\\frac{1}{2} + \\frac{3}{4}$ ~!@#%^&*()_=[]|;:'<>,./`",
])
def test_round_trip(tok_dir, hf_tok, s):
    tok = load_tokenizer(tok_dir)
    assert tok.decode(tok.encode(s).ids) == s
    assert hf_tok.decode(hf_tok.encode(s)) == s


def test_chat_template_tools(hf_tok):
    messages = [
        {"role": "system", "content": "You are helpful."},
        {"role": "user", "content": "What is 12*34?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "12*34"}}}]},
        {"role": "tool", "content": "408"},
    ]
    out = hf_tok.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert out.startswith(f"{IM_START}system\nYou are helpful.\n\n# Tools")
    assert "<tools>\n" + json.dumps(TOOLS[0]) + "\n</tools>" in out
    assert (f'{IM_START}assistant\n{TOOL_CALL_START}\n{{"name": "calculator", "arguments": {{"expression": "12*34"}}}}'
            f"\n{TOOL_CALL_END}{IM_END}\n") in out
    assert f"{IM_START}user\n{TOOL_RESPONSE_START}\n408\n{TOOL_RESPONSE_END}{IM_END}\n" in out
    assert out.endswith(f"{IM_START}assistant\n")


def test_chat_template_plain(hf_tok):
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert hf_tok.apply_chat_template(msgs, tokenize=False) == (
        f"{IM_START}user\nhi{IM_END}\n{IM_START}assistant\nhello{IM_END}\n")


def test_load_tokenizer_missing(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        load_tokenizer(tmp_path)
