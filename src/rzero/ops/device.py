"""Which device a model, its engine and its trainer run on (`model.device`, `--device`).

There is no silent fallback: asking for CUDA where torch sees no CUDA device is an error that
says why, never a quiet run on the CPU.
"""

from __future__ import annotations

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
