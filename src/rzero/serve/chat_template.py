"""A model's own Jinja chat template, rendered the way transformers' `apply_chat_template` renders it.

Same Jinja settings (sandboxed, trim_blocks, lstrip_blocks, loop controls), the same template
variables (messages, tools, documents, add_generation_prompt and the special tokens) and a
`tojson` that writes JSON as `json.dumps` does: Jinja's own filter sorts keys and escapes HTML
characters, which would change what the model reads about its tools.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class ChatTemplateError(ValueError):
    """The template could not render these messages (it raised, or they do not fit its expectations)."""


class ChatTemplate:
    def __init__(self, template: str | list[dict[str, str]], special_tokens: dict[str, str] | None = None):
        # Some models ship several named templates; transformers picks "tool_use" when tools are given.
        named = {"default": template} if isinstance(template, str) else {t["name"]: t["template"] for t in template}
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self._templates = {name: env.from_string(source) for name, source in named.items()}
        self.special_tokens = special_tokens or {}

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> ChatTemplate | None:
        """The template in chat_template.jinja or tokenizer_config.json; None if the model has none."""
        model_dir = Path(model_dir)
        config_path = model_dir / "tokenizer_config.json"
        config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.is_file() else {}
        jinja_file = model_dir / "chat_template.jinja"  # where newer transformers versions save it
        template = jinja_file.read_text(encoding="utf-8") if jinja_file.is_file() else config.get("chat_template")
        if not template:
            return None
        special = {k: _token_text(config[k]) for k in _SPECIAL_TOKEN_KEYS if _token_text(config.get(k))}
        return cls(template, special)

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> str:
        """The prompt text for these messages, ending where the assistant's reply begins."""
        name = "tool_use" if tools and "tool_use" in self._templates else "default"
        if name not in self._templates:
            raise ChatTemplateError(f"the model has chat templates {sorted(self._templates)} but no 'default'")
        try:
            return self._templates[name].render(
                messages=messages, tools=tools, documents=None, add_generation_prompt=True, **self.special_tokens
            )
        except (jinja2.TemplateError, TypeError, KeyError, AttributeError) as error:
            raise ChatTemplateError(f"the chat template could not render the messages: {error}") from error


def _tojson(value: Any, ensure_ascii: bool = False, indent=None, separators=None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str):
    raise jinja2.TemplateError(message)


def _token_text(token: str | dict | None) -> str | None:
    """Special tokens are stored as strings or as AddedToken dicts with a "content" field."""
    return token.get("content") if isinstance(token, dict) else token
