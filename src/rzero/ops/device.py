"""Which device a model, its engine and its trainer run on (`model.device`, `--device`).

There is no silent fallback: asking for CUDA where torch sees no CUDA device is an error that
says why, never a quiet run on the CPU.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import torch

DEVICE_NAMES = ("cpu", "cuda", "auto")


def resolve_device(name: str | torch.device) -> torch.device:
    """"cpu", "cuda" (or "cuda:N"), or "auto" (CUDA when torch sees a CUDA device) -> a torch.device."""
    if isinstance(name, torch.device):
        name = str(name)
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cpu":
        return torch.device("cpu")
    if name == "cuda" or name.startswith("cuda:"):
        if not torch.cuda.is_available():
            built = "without CUDA" if torch.version.cuda is None else f"with CUDA {torch.version.cuda}, but no GPU is visible"
            raise RuntimeError(
                f"device {name!r} was asked for, but torch {torch.__version__} is built {built}; "
                "use --device cpu (model.device = 'cpu') or run on a machine with a CUDA GPU"
            )
        device = torch.device(name)
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise RuntimeError(f"device {name!r}: only {torch.cuda.device_count()} CUDA device(s) are visible")
        # fp32 matmuls in IEEE fp32, not TF32, in both numerics modes (cuBLAS for `standard`).
        torch.set_float32_matmul_precision("highest")
        torch.backends.cudnn.allow_tf32 = False
        return device
    raise ValueError(f"unknown device {name!r}; choose one of {', '.join(DEVICE_NAMES)} (or cuda:N)")


# Below this hidden size, one intra-op thread by default: every op is small, and a second OpenMP
# thread costs more in fork/join and spinning than it gains (the default job: 147 s on 2 threads,
# 77 s on 1; docs/benchmarks.md). Async runs still use two cores: engine and trainer threads.
SMALL_MODEL_HIDDEN = 1024


def cpu_threads(hidden_size: int, requested: int = 0, dtype: str = "bf16", numerics: str = "invariant") -> int:
    """Torch intra-op threads to run a model of this hidden size with: `requested`, or for 0 one
    below SMALL_MODEL_HIDDEN and PyTorch's current count (one per core by default) above it,
    except fp32 under invariant numerics, which stays on one: from K = 1024 on, MKL splits a
    one-tile fp32 GEMM across threads (the invariant linear now runs such a tile beside a zero
    tile, but `rzero check` has only been run on one thread there; docs/numerics.md)."""
    if requested:
        return requested
    exact_fp32 = str(dtype).removeprefix("torch.") in ("fp32", "float32") and str(numerics) == "invariant"
    return 1 if hidden_size < SMALL_MODEL_HIDDEN or exact_fp32 else torch.get_num_threads()


def model_dir_threads(model_dir: str | Path, requested: int = 0, dtype: str = "bf16", numerics: str = "invariant") -> int:
    """`cpu_threads` for a Hugging Face model directory (PyTorch's count if its config.json is
    missing or names no hidden size: loading the model then says what is wrong)."""
    config = Path(model_dir) / "config.json"
    hidden = json.loads(config.read_text()).get("hidden_size", SMALL_MODEL_HIDDEN) if config.is_file() else SMALL_MODEL_HIDDEN
    return cpu_threads(hidden, requested, dtype, numerics)


@contextlib.contextmanager
def intra_op_threads(threads: int) -> Iterator[None]:
    """Run the block on this many torch intra-op threads, then give the caller back its count."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)
