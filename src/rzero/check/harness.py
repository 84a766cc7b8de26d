"""The checklist's shared state and helpers: results, exact comparisons, the harness.

Every check compares numbers that trainer-inference invariance says are bitwise equal; the harness
gives each check the shipping trainer, engines, and inputs seeded from (`--seed`, check id).
"""

from __future__ import annotations

import copy
import math
import random
import zlib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from rzero import ops
from rzero.engine import Engine, RequestOutput, SamplingParams
from rzero.model.io import load_model, parse_dtype, read_config
from rzero.model.qwen3 import Qwen3ForCausalLM
from rzero.model.qwen3_moe import SparseMoeBlock
from rzero.ops import SamplingTransform
from rzero.rollout.record import Rollout
from rzero.train.trainer import Trainer, TrainerSettings

NA = "n/a"
PLAIN = SamplingTransform()  # temperature 1, no truncation: the model's own distribution
SAMPLER = SamplingTransform(temperature=0.7, top_k=20, top_p=0.9)  # the C7 transform


@dataclass
class CheckResult:
    id: str
    name: str
    compared: str  # one line: what was compared with what
    max_abs_diff: float | str | None  # max |Δ| seen; "n/a" (C8 on a dense model); None if it crashed
    passed: bool
    detail: str = ""  # a short explanation: what differed, leaked op names, sanity figures
    seconds: float = 0.0

    def to_json(self) -> dict:
        diff = self.max_abs_diff
        if isinstance(diff, float) and not math.isfinite(diff):
            diff = "inf" if diff > 0 else "nan"  # keep the output strict JSON
        return {
            "id": self.id,
            "name": self.name,
            "compared": self.compared,
            "max_abs_diff": diff,
            "passed": self.passed,
            "detail": self.detail,
            "seconds": round(self.seconds, 3),
        }


def max_abs_diff(a, b) -> float:
    """Largest |a - b| over two equal-length sequences of numbers (exact: 0.0 iff all equal).

    Equal infinities count as equal; a length mismatch or a NaN on either side counts as inf
    (callers map a missing value to NaN, so it can never compare equal).
    """
    # On the CPU: one side may be device tensors (the trainer's), the other Python floats (the engine's).
    a = torch.as_tensor(a, dtype=torch.float64).cpu().reshape(-1)
    b = torch.as_tensor(b, dtype=torch.float64).cpu().reshape(-1)
    if a.shape != b.shape:
        return math.inf
    if a.numel() == 0:
        return 0.0
    same = a == b
    d = (a - b).abs()
    d = torch.where(same, torch.zeros_like(d), d)
    d = torch.where(d.isnan(), torch.full_like(d, math.inf), d)
    return float(d.max())


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    a, b = a.cpu(), b.cpu()
    if a.is_floating_point():
        as_int = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        return torch.equal(a.contiguous().view(as_int), b.contiguous().view(as_int))
    return torch.equal(a, b)


def fmt(x: float) -> str:
    return "0.0" if x == 0 else f"{x:.3g}"


@contextmanager
def capture_moe(model: Qwen3ForCausalLM) -> Iterator[list[dict[str, torch.Tensor]]]:
    """Record, per SparseMoeBlock, the last `route` outputs (weights, expert ids) and block output."""
    blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
    records: list[dict[str, torch.Tensor]] = [{} for _ in blocks]
    handles = []
    for i, block in enumerate(blocks):
        original = block.route

        def route(x, nx, _original=original, _i=i):
            weights, experts = _original(x, nx)
            records[_i]["weights"], records[_i]["experts"] = weights.detach().clone(), experts.clone()
            return weights, experts

        block.route = route  # instance attribute shadows the method
        handles.append(
            block.register_forward_hook(lambda mod, inp, out, _i=i: records[_i].__setitem__("output", out.detach().clone()))
        )
    try:
        yield records
    finally:
        for block, handle in zip(blocks, handles):
            handle.remove()
            del block.route


class Harness:
    """Shared state of one checklist run: the trainer, an engine factory, seeded inputs.

    The trainer side is `rzero.train.trainer.Trainer` itself (fp32 master weights, the compute
    copy in the run dtype, `token_logprobs`, `forward_backward`, `supervised_step`); the engine
    side is `rzero.engine.Engine`, driven through its public request API. Both get the run's
    numerics at construction.
    """

    def __init__(self, model_dir: str | Path, numerics: str, dtype: str, seed: int = 0, device: str = "cpu"):
        self.model_dir = Path(model_dir)
        read_config(self.model_dir)  # a clear error for a directory that is not a model
        self.device = ops.resolve_device(device)
        self.numerics = ops.numerics(numerics)
        self.dtype_name = dtype
        self.dtype = parse_dtype(dtype)
        self.seed = seed
        self.reseed("setup")
        self.trainer = self.new_trainer(load_model(self.model_dir, "fp32"))  # at θ0, version 0
        self.master = self.trainer.master  # the trainer's fp32 master weights (θ0)
        self.model = self.trainer.compute  # its forward copy in the run dtype
        self.vocab = self.master.config.vocab_size
        self.is_moe = any(isinstance(m, SparseMoeBlock) for m in self.master.modules())
        self.has_tokenizer = (self.model_dir / "tokenizer.json").is_file()
        self.pad_id = 0  # padding token of the C5 padded rows: the tokenizer's pad token if any
        if self.has_tokenizer:
            from rzero.model.tokenizer import PAD_TOKEN, load_tokenizer

            pad = load_tokenizer(self.model_dir).token_to_id(PAD_TOKEN)
            self.pad_id = pad if pad is not None and pad < self.vocab else 0
        self._engine_model: Qwen3ForCausalLM | None = None
        self._update: tuple[Trainer, Engine] | None = None

    def new_trainer(self, master: Qwen3ForCausalLM) -> Trainer:
        """A trainer with the settings of the checklist's one update: AdamW lr 1e-3, weight decay
        0.01, no gradient clipping, one micro-batch."""
        settings = TrainerSettings(lr=1e-3, weight_decay=0.01, grad_clip=math.inf, micro_batch_tokens=1 << 30, decompose=False)
        return Trainer(master, self.dtype, settings, numerics=self.numerics, device=self.device)

    # ------------------------------------------------------------------ inputs

    def reseed(self, label: str) -> None:
        """Seed the input generators from (seed, label): each check draws the same inputs whether
        it runs alone or after the others."""
        stream = zlib.crc32(f"{self.seed}/{label}".encode())
        torch.manual_seed(stream)
        self.rng = random.Random(stream)
        self.gen = torch.Generator().manual_seed(stream)

    def tokens(self, n: int) -> list[int]:
        return torch.randint(0, self.vocab, (n,), generator=self.gen).tolist()

    def next_seed(self) -> int:
        return self.rng.randrange(2**31)

    # ------------------------------------------------------------------ engine

    def engine(self, *, own_weights: bool = False, max_num_batched_tokens: int = 8192, num_kv_blocks: int = 512) -> Engine:
        """A fresh engine (empty prefix cache). Engines share one model loaded from the directory,
        except `own_weights=True` (a private copy, for weight updates)."""
        kw = dict(
            numerics=self.numerics,
            dtype=self.dtype_name,
            device=self.device,
            num_kv_blocks=num_kv_blocks,
            max_num_batched_tokens=max_num_batched_tokens,
            seed=self.seed,
        )
        if own_weights or self._engine_model is None:
            if self.has_tokenizer:
                engine = Engine(self.model_dir, **kw)
            else:
                engine = Engine(load_model(self.model_dir, self.dtype), eos_token_ids=[], **kw)
            if not own_weights:
                self._engine_model = engine.model
            return engine
        return Engine(self._engine_model, eos_token_ids=[], **kw)  # requests set ignore_eos

    def run(self, requests: list[tuple[list[int], SamplingParams]], engine: Engine | None = None, **engine_kw) -> list[list[RequestOutput]]:
        """Add all requests, step the engine until they finish; outputs grouped per request."""
        engine = engine or self.engine(**engine_kw)
        ids = [engine.add_request(prompt, params) for prompt, params in requests]
        while engine.has_unfinished():
            engine.step()
        return [[engine.pop_output(i) for i in group] for group in ids]

    def params(self, **kw) -> SamplingParams:
        kw.setdefault("seed", self.next_seed())
        kw.setdefault("ignore_eos", True)
        return SamplingParams(**kw)

    # ------------------------------------------------------------------ trainer

    def trainer_logprobs(
        self, seqs: Sequence[Sequence[int]], transform: SamplingTransform = PLAIN, model: Qwen3ForCausalLM | None = None
    ) -> list[torch.Tensor]:
        """`Trainer.token_logprobs` of tokens 1..n-1 of each sequence (no grad), under `transform`,
        with the θ0 compute copy unless another `model` is given."""
        with torch.no_grad():  # on the CPU, where the engine's logprobs (Python floats) are compared
            return [x.cpu() for x in self.trainer.token_logprobs(model or self.model, whole_sequences(seqs, transform))]

    def update(self) -> tuple[Trainer, Engine]:
        """One trainer step from θ0 (`Trainer.supervised_step`: AdamW on the fp32 master, the
        forward in the run dtype), published to a fresh engine as version 1. Computed once; C1 and
        C10 share it."""
        if self._update is None:
            saved = self.rng, self.gen
            self.reseed("update")
            trainer = self.new_trainer(copy.deepcopy(self.master))
            seqs = [self.tokens(n) for n in (37, 21, 50)]
            trainer.supervised_step(whole_sequences(seqs))
            engine = self.engine(own_weights=True)
            engine.update_weights(trainer.engine_state_dict(), version=trainer.version)
            self._update = (trainer, engine)
            self.rng, self.gen = saved
        return self._update


def whole_sequences(seqs: Sequence[Sequence[int]], transform: SamplingTransform = PLAIN) -> list[Rollout]:
    """Each sequence as a rollout whose completion is tokens 1..n-1: the trainer scores them all."""
    return [Rollout(list(s[:1]), list(s[1:]), [0.0] * (len(s) - 1), [0] * (len(s) - 1), 0.0, transform) for s in seqs]
