"""`rzero serve`: an OpenAI-compatible HTTP server over rzero's engine (docs/serve.md)."""

from rzero.serve.app import build_app
from rzero.serve.chat_template import ChatTemplate

__all__ = ["ChatTemplate", "build_app"]
