"""rzero: asynchronous RL for language models with bitwise trainer-inference invariance."""

__version__ = "0.1.0"
