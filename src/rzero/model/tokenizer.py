"""Tiny Qwen-style byte-level BPE tokenizer, trained locally on a synthetic corpus.

`build_tokenizer` writes a Hugging Face tokenizer directory (tokenizer.json +
tokenizer_config.json) that `transformers.AutoTokenizer` loads offline;
`load_tokenizer` gives the engine the raw (fast) `tokenizers.Tokenizer`.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"
TOOL_RESPONSE_START, TOOL_RESPONSE_END = "<tool_response>", "</tool_response>"
THINK_START, THINK_END = "<think>", "</think>"

SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END]
# Added as single tokens but not "special": they must survive decode(skip_special_tokens=True)
# because tool calls are parsed out of decoded text.
EXTRA_TOKENS = [TOOL_CALL_START, TOOL_CALL_END, TOOL_RESPONSE_START, TOOL_RESPONSE_END, THINK_START, THINK_END]

BOS_TOKEN = None  # Qwen3 uses no BOS
EOS_TOKEN = IM_END
PAD_TOKEN = ENDOFTEXT

SEED = 0

# Qwen3/Hermes-style tool-calling template (no thinking logic).
_CHAT_TEMPLATE = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- elif message.role == 'assistant' %}
        {{- '<|im_start|>assistant\\n' }}
        {%- if message.content %}
            {{- message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls or [] %}
            {%- if loop.first and message.content or not loop.first %}
                {{- '\\n' }}
            {%- endif %}
            {%- if tool_call.function %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '<tool_call>\\n{"name": "' + tool_call.name + '", "arguments": ' }}
            {%- if tool_call.arguments is string %}
                {{- tool_call.arguments }}
            {%- else %}
                {{- tool_call.arguments | tojson }}
            {%- endif %}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == 'tool' %}
        {#- consecutive tool results share one user turn #}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""


def chat_template() -> str:
    """The Jinja chat template stored in tokenizer_config.json."""
    return _CHAT_TEMPLATE


# ---------------------------------------------------------------------------
# Synthetic corpus: what tiny models will actually see (math word problems,
# arithmetic, LaTeX, JSON tool calls, Python), so merges are spent on those.
# ---------------------------------------------------------------------------

_NAMES = ["Alice", "Bob", "Carol", "Dave", "Emma", "Frank", "Grace", "Henry", "Ivy", "Jack", "Tom", "Sara", "Lily", "Max"]
_ITEMS = ["apples", "oranges", "books", "pencils", "marbles", "cookies", "stickers", "coins", "cards", "eggs",
          "flowers", "candies", "bottles", "boxes", "toys", "shirts", "tickets", "cupcakes", "balloons", "stamps"]
_VERBS = ["has", "buys", "gives", "sells", "finds", "loses", "eats", "collects", "makes", "bakes", "gets", "keeps"]
_OPS = [("+", "plus", "sum"), ("-", "minus", "difference"), ("*", "times", "product"), ("/", "divided by", "quotient")]
_TOOLS = [("calculator", "expression", "Evaluate a math expression."),
          ("python", "code", "Run Python code and return the output."),
          ("search", "query", "Search the web for information.")]
_WORDS = ("the a an of to and in is it that for on with as at by from this be are was were will can each "
          "how many much more less than total left remaining after before every per day week hour minute "
          "price cost dollars cents money pay spend save earn number numbers answer question solve step "
          "first second third then next finally so therefore because we need find compute calculate result "
          "equal equals value let us think carefully what which who when where why if there their they he she "
          "his her them its all some half twice double triple quarter percent average ratio rate speed distance "
          "time area perimeter length width height square rectangle circle triangle angle degree sum difference "
          "product quotient remainder divide multiply add subtract fraction decimal integer prime even odd "
          "function return print def import range list true false none while else elif class self output input "
          "user assistant system tool tools call response arguments name expression code query json format "
          "please reason put your final within boxed you are helpful provided signatures tags object "
          "store shop farm school class teacher student students friend friends family mother father sister "
          "brother children kids car cars train bus bike miles kilometers meters feet inches pounds grams liters "
          "water milk juice pizza slices cake pie bread fruit garden trees plants seeds animals dogs cats birds "
          "chickens cows legs wheels pages chapters problems minutes hours days weeks months years morning "
          "evening night today yesterday tomorrow bought sold gave found lost ate made baked got kept took "
          "spent saved earned paid shared split among between into out up down over under again only also "
          "not no yes one two three four five six seven eight nine ten hundred thousand million dozen pair "
          "pairs group groups team teams row rows column columns table chart graph cell value values sequence "
          "pattern term terms series digit digits place ones tens hundreds thousands round rounded estimate "
          "exact exactly about nearly least most greater smaller larger largest smallest maximum minimum "
          "check verify correct wrong error mistake use using used given known unknown variable equation "
          "solution solutions simplify expand factor factors multiple multiples divisible power powers root "
          "roots square cube probability chance random choose chosen ways arrange arrangements count counting "
          "string integer float dict tuple append len sum max min sorted abs int str lambda yield with open "
          "try except raise assert break continue pass global not and or is in none true false").split()


def _num(rng: random.Random) -> int:
    return rng.choice([rng.randint(0, 9), rng.randint(10, 99), rng.randint(100, 999), rng.randint(1000, 99999)])


def _calc(a: int, op: str, b: int) -> str:
    if op == "/":
        return str(a // b) if b and a % b == 0 else f"{a / b:.2f}" if b else "undefined"
    return str({"+": a + b, "-": a - b, "*": a * b}[op])


def _corpus(n: int = 3000, seed: int = SEED) -> list[str]:
    rng = random.Random(seed)
    lines: list[str] = []
    for _ in range(n):
        a, b = _num(rng), _num(rng)
        op, word, noun = rng.choice(_OPS)
        ans = _calc(a, op, b)
        name, item, verb = rng.choice(_NAMES), rng.choice(_ITEMS), rng.choice(_VERBS)
        tool, arg, desc = rng.choice(_TOOLS)
        kind = rng.randrange(10)
        if kind == 0:
            lines.append(f"What is {a} {op} {b}?\nThe answer is \\boxed{{{ans}}}.")
        elif kind == 1:
            lines.append(f"{name} {verb} {a} {item}. Then {name} {verb} {b} more {item}. "
                         f"How many {item} does {name} have in total?\n"
                         f"{name} has {a} + {b} = {a + b} {item}. The answer is \\boxed{{{a + b}}}.")
        elif kind == 2:
            lines.append(f"Compute the {noun} of {a} and {b}. {a} {word} {b} is {ans}, so the final answer is $\\boxed{{{ans}}}$.")
        elif kind == 3:
            p, q = rng.randint(1, 9), rng.randint(2, 12)
            lines.append(f"$\\frac{{{p}}}{{{q}}} + \\frac{{1}}{{2}} = \\frac{{{2 * p + q}}}{{{2 * q}}}$, "
                         f"and $x^{{2}} \\cdot {a} = {b}$ gives $x = \\sqrt{{\\frac{{{b}}}{{{a}}}}}$.")
        elif kind == 4:
            expr = f"{a}{op}{b}"
            lines.append(f'{TOOL_CALL_START}\n{{"name": "{tool}", "arguments": {{"{arg}": "{expr}"}}}}\n{TOOL_CALL_END}')
        elif kind == 5:
            lines.append(f"{TOOL_RESPONSE_START}\n{ans}\n{TOOL_RESPONSE_END}\n"
                         f'{{"type": "function", "function": {{"name": "{tool}", "description": "{desc}", '
                         f'"parameters": {{"type": "object", "properties": {{"{arg}": {{"type": "string"}}}}, '
                         f'"required": ["{arg}"]}}}}}}')
        elif kind == 6:
            lines.append(f"def solve(a, b):\n    result = a {op} b\n    return result\n\n"
                         f"print(solve({a}, {b}))\nfor i in range({b % 20}):\n    if i % 2 == 0:\n        x += i\n")
        elif kind == 7:
            lines.append(f"{THINK_START}\nLet me think step by step. First, {a} {word} {b} equals {ans}.\n{THINK_END}\n"
                         f"Please reason step by step, and put your final answer within \\boxed{{}}.")
        elif kind == 8:
            # Fixed text from the chat template's tool prompt, so it tokenizes compactly.
            lines.append("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
                         "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
                         "</tools>\n\nFor each function call, return a json object with function name and "
                         "arguments within <tool_call></tool_call> XML tags:")
        else:
            words = rng.choices(_WORDS, k=rng.randint(6, 20))
            lines.append(" ".join(words).capitalize() + rng.choice([".", "?", "!", ":", ","]))
    return lines


def _train(vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    # Split every digit first (like Qwen) so multi-digit arithmetic is learnable digit by digit.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    # All added tokens go through the trainer so they sit at ids 0.. and count toward vocab_size.
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        show_progress=False,
        special_tokens=SPECIAL_TOKENS + EXTRA_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in EXTRA_TOKENS])
    if tok.get_vocab_size() != vocab_size:
        raise ValueError(f"corpus too small for vocab_size={vocab_size}: got {tok.get_vocab_size()} tokens")
    return tok


def build_tokenizer(out_dir: str | Path, vocab_size: int = 1024) -> None:
    """Train the tokenizer deterministically and write an AutoTokenizer-loadable directory.

    vocab_size counts everything (bytes, merges, added tokens); the built-in corpus supports
    up to about 1600, larger sizes raise ValueError rather than silently coming out smaller.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = _train(vocab_size)
    tok.save(str(out / "tokenizer.json"), pretty=True)

    added = {
        str(tok.token_to_id(t)): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                  "single_word": False, "special": t in SPECIAL_TOKENS}
        for t in SPECIAL_TOKENS + EXTRA_TOKENS
    }
    config = {
        # Generic fast tokenizer: Qwen2Tokenizer would rebuild its own pre-tokenizer and ignore ours.
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "additional_special_tokens": [IM_START, IM_END],
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "add_bos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,  # needed for exact decode round trips
        "errors": "replace",
        "model_max_length": 32768,
        "split_special_tokens": False,
        "chat_template": chat_template(),
    }
    special_map = {"additional_special_tokens": [IM_START, IM_END], "eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN}
    for name, obj in [("tokenizer_config.json", config), ("special_tokens_map.json", special_map)]:
        (out / name).write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def load_tokenizer(model_dir: str | Path) -> Tokenizer:
    """Load the raw fast tokenizer (used by the engine) from model_dir/tokenizer.json."""
    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"tokenizer file not found: {path} (build it with rzero.model.tokenizer.build_tokenizer)")
    return Tokenizer.from_file(str(path))
