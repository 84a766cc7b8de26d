"""Per-thread fp32 buffers that outlive a call, for outputs a few MB and more in size.

A fresh buffer that size is fresh pages on every call (glibc maps an allocation anew when it is
the size of the last one freed, and always from 32 MB on), and faulting them in can cost more than
the work that fills it: 157 against 76 ms for a 0.6B model's LM head on panels, three times the
exp for the sampler at a 152k vocabulary. Each caller names its own buffer, so two that are in
use at once never alias; one per thread, since an engine thread and the trainer may share a
process. Made outside inference mode, so the same buffer serves the engine (inference mode) and
the trainer or a replay (plain no-grad) alike.
"""

from __future__ import annotations

import threading

import torch

_KEPT = threading.local()


def scratch(name: str, numel: int) -> torch.Tensor:
    """The first `numel` elements of this thread's fp32 buffer `name` (grown when too small)."""
    buffers = _KEPT.__dict__.setdefault("buffers", {})
    flat = buffers.get(name)
    if flat is None or flat.numel() < numel:
        with torch.inference_mode(False):
            flat = buffers[name] = torch.empty(numel, dtype=torch.float32)
    return flat[:numel]
