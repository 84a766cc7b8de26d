"""Several decode steps in one model call (Engine(decode_steps_per_call=...), Model.decode_steps,
csrc/kernels.c rz_decode_steps): the same tokens, logprobs, versions, finish reasons and prefix
cache as the steps one by one, and the one-by-one path wherever a batch cannot run that way."""

from __future__ import annotations

import random

import pytest
import torch
from test_cpu_kernel import needs_bf16_gemm

from rzero.engine import Engine, SamplingParams
from rzero.model.io import load_model
from rzero.ops import cpu_kernel
from rzero.ops.sampling import UniformStream

pytestmark = pytest.mark.skipif(cpu_kernel.library() is None, reason="needs the C kernels (a C compiler)")


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


_MODELS: dict = {}


def model(model_dir, dtype: str):
    key = (str(model_dir), dtype)
    if key not in _MODELS:
        _MODELS[key] = load_model(model_dir, dtype)
    return _MODELS[key]


def prompts(count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 1024) for _ in range(rng.randint(5, 40))] for _ in range(count)]


class Counted:
    """An engine's model forwards and multi-step calls, counted."""

    def __init__(self, engine: Engine):
        self.forwards, self.calls = 0, 0
        engine.model.register_forward_pre_hook(lambda *_: setattr(self, "forwards", self.forwards + 1))
        inner = engine.model.decode_steps

        def decode_steps(*args):
            out = inner(*args)
            self.calls += out is not None
            return out

        engine.model.decode_steps = decode_steps


def run(model_dir, dtype, steps_per_call, requests, **engine_kwargs):
    """(per request id: tokens, logprobs, versions, finish reason), the prefix cache's hashes, counts."""
    engine = Engine(model(model_dir, dtype), dtype=dtype, eos_token_ids=[], decode_steps_per_call=steps_per_call,
                    **engine_kwargs)
    counted = Counted(engine)
    ids = [rid for prompt, params in requests for rid in engine.add_request(prompt, params)]
    while engine.has_unfinished():
        engine.step()
    outputs = {rid: engine.pop_output(rid) for rid in ids}
    assert engine.blocks.num_free == engine.blocks.num_blocks  # every block back, extra ones included
    result = {rid: (o.token_ids, o.logprobs, o.versions, o.finish_reason) for rid, o in outputs.items()}
    return result, sorted(h for h in engine.blocks.hash_of if h is not None), counted


@pytest.mark.parametrize("dtype", ["fp32", pytest.param("bf16", marks=needs_bf16_gemm)])
def test_several_steps_per_call_give_the_steps_one_by_one(tiny_dense_dir, dtype):
    stops = list(range(3, 40))  # ~4 % of the vocabulary: samples end at different steps, mid-call
    requests = [(p, SamplingParams(max_tokens=23, seed=i, stop_token_ids=stops, temperature=(1.0, 0.7)[i % 2]))
                for i, p in enumerate(prompts(20))]  # with the group below: 24 rows, a chunk of 16 and one of 8
    requests.append((prompts(1, seed=5)[0], SamplingParams(max_tokens=19, seed=50, n=4)))  # a forked group
    one, one_cache, one_counts = run(tiny_dense_dir, dtype, 1, requests)
    several, several_cache, counts = run(tiny_dense_dir, dtype, 8, requests)
    assert several == one
    assert several_cache == one_cache  # the same full blocks registered for reuse
    assert one_counts.calls == 0 and counts.calls > 0
    assert counts.forwards < one_counts.forwards / 3  # most decode steps ran inside the calls
    assert len({r[3] for r in one.values()}) == 2  # both "stop" and "length" endings happened


def test_batches_that_cannot_run_together_step_one_by_one(tiny_dense_dir):
    """Greedy, top-k, top-p or top-logprob rows, or a request waiting for a slot: one step per
    forward, and the same results as without the multi-step path."""
    for params in (SamplingParams(max_tokens=9, temperature=0.0), SamplingParams(max_tokens=9, seed=1, top_k=20),
                   SamplingParams(max_tokens=9, seed=2, top_p=0.9), SamplingParams(max_tokens=9, seed=3, top_logprobs=2)):
        requests = [(p, params) for p in prompts(3)]
        several, _, counts = run(tiny_dense_dir, "fp32", 8, requests)
        assert counts.calls == 0
        assert several == run(tiny_dense_dir, "fp32", 1, requests)[0]
    requests = [(p, SamplingParams(max_tokens=12, seed=i)) for i, p in enumerate(prompts(5))]
    several, _, counts = run(tiny_dense_dir, "fp32", 8, requests, max_num_seqs=2)
    assert several == run(tiny_dense_dir, "fp32", 1, requests, max_num_seqs=2)[0]
    assert counts.calls > 0  # once nothing waits, the last requests decode several steps a call


def test_a_model_without_the_call_keeps_its_draws(tiny_moe_dir):
    """An MoE model has no one-call backbone: the engine learns it on the first decode and samples
    one step at a time from the same draws (the ones taken for the call are put back)."""
    requests = [(p, SamplingParams(max_tokens=10, seed=i)) for i, p in enumerate(prompts(3))]
    engine_kwargs = dict(num_kv_blocks=64)
    several, _, counts = run(tiny_moe_dir, "fp32", 8, requests, **engine_kwargs)
    assert counts.calls == 0
    assert several == run(tiny_moe_dir, "fp32", 1, requests, **engine_kwargs)[0]


def test_the_stream_gives_back_its_draws():
    stream, plain = UniformStream(torch.Generator().manual_seed(3)), UniformStream(torch.Generator().manual_seed(3))
    taken = [stream.next() for _ in range(40)]  # across a block boundary
    stream.give_back(taken[30:])
    assert taken[:30] + [stream.next() for _ in range(50)] == [plain.next() for _ in range(80)]


def test_steps_per_call_below_one_is_refused(tiny_dense_dir):
    with pytest.raises(ValueError, match="decode_steps_per_call must be >= 1"):
        Engine(model(tiny_dense_dir, "fp32"), decode_steps_per_call=0)


def test_a_decode_batch_lays_out_its_rows():
    from rzero.ops import DecodeBatch

    batch = DecodeBatch.build([7, 8], [20, 3], [4, 2], [{2, 5}, []], [[4, 9], [1]], [1.0, 0.5], [[0.1, 0.2], [0.3, 0.4]])
    assert batch.stop_ids.tolist() in ([2, 5], [5, 2]) and batch.stop_start.tolist() == [0, 2, 2]
    assert batch.block_tables.tolist() == [[4, 9], [1, 0]]
    assert batch.uniform.tolist() == [[pytest.approx(0.1), pytest.approx(0.3)], [pytest.approx(0.2), pytest.approx(0.4)]]
    assert batch.uniform.is_contiguous() and batch.temperature.dtype == torch.float32
