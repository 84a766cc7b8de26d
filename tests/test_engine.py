"""rzero.engine: continuous batching, paged KV cache, sampling, versioned weight updates.

The central property (docs/design.md, checklist C3/C5/C6/C7): under invariant numerics a seeded request
samples the same tokens with the same behaviour logprobs, bit for bit, whatever else the engine is
doing (batch neighbours, arrival order, chunked prefill, shared prefixes, preemption), and those
logprobs equal the trainer's teacher-forced logprobs under the same sampling transform. "Equal"
always means bitwise (Python floats from fp32 tensors compared with ==), never a tolerance. A
standard-numerics negative control shows the comparison can fail.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import random

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from test_cpu_kernel import needs_bf16_gemm

from rzero.engine import Engine, SamplingParams
from rzero.engine.sequence import Status
from rzero.model.io import load_model
from rzero.ops import ATTN_BLOCK, AttentionMeta
from rzero.rollout.record import Rollout
from rzero.train.trainer import Trainer

DTYPES = ["fp32", "bf16"]
# A fixed, reproducible set of examples by default; RZERO_ENGINE_EXAMPLES=500 explores at random.
_EXPLORE = os.environ.get("RZERO_ENGINE_EXAMPLES")
PROPERTY = settings(
    max_examples=int(_EXPLORE or 20),
    deadline=None,
    derandomize=not _EXPLORE,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
MAX_STEPS = 3000  # a livelocked engine fails the test instead of hanging it


# ---------------------------------------------------------------------------------------------
# fixtures and helpers
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """These tests are about batch composition, not thread count; one intra-op thread keeps the
    tiny model's many small matmuls fast and predictable on a shared 2-core machine (with two
    threads and a busy machine, OpenMP barriers make each step ~50x slower).
    RZERO_ENGINE_THREADS=2 runs them with another thread count."""
    threads = torch.get_num_threads()
    torch.set_num_threads(int(os.environ.get("RZERO_ENGINE_THREADS", 1)))
    yield
    torch.set_num_threads(threads)


_MODELS: dict[tuple, torch.nn.Module] = {}


def trainer_model(model_dir, dtype: str, numerics: str = "invariant"):
    """The trainer's copy of the weights (loaded once per dtype and numerics; tests must not modify it)."""
    key = (str(model_dir), dtype, numerics)
    if key not in _MODELS:
        _MODELS[key] = load_model(model_dir, dtype, numerics=numerics)
    return _MODELS[key]


def next_version_model(model_dir, dtype: str):
    """Version 1 of the trainer's weights: version 0 plus noise (loaded once per dtype)."""
    key = (str(model_dir), dtype, "v1")
    if key not in _MODELS:
        _MODELS[key] = perturbed_model(trainer_model(model_dir, dtype), seed=1)
    return _MODELS[key]


@pytest.fixture(scope="module")
def model_dir(tiny_dense_dir):
    return tiny_dense_dir


def make_engine(model_dir, dtype: str = "fp32", numerics: str = "invariant", **kwargs) -> Engine:
    """An engine over the model object (no tokenizer, no EOS) unless told otherwise."""
    kwargs.setdefault("num_kv_blocks", 64)
    kwargs.setdefault("eos_token_ids", [])
    return Engine(trainer_model(model_dir, dtype), numerics=numerics, dtype=dtype, **kwargs)


def teacher_forced(model, outputs, transforms) -> list[list[float]]:
    """The trainer's logprobs of each output's completion tokens: `Trainer.token_logprobs` (one
    packed no-grad forward over the whole sequences) under the same sampling transforms."""
    rollouts = [Rollout(o.prompt_token_ids, o.token_ids, o.logprobs, o.versions, 0.0, t) for o, t in zip(outputs, transforms)]
    with torch.no_grad():
        return [lp.tolist() for lp in Trainer.token_logprobs(model, rollouts)]


def assert_block_accounting(engine: Engine) -> None:
    """Every block is either free with ref count 0, or held by exactly ref_count live sequences."""
    blocks = engine.blocks
    held = [0] * blocks.num_blocks
    for seq in engine.sequences.values():
        if seq.status == Status.FINISHED or seq in engine.waiting:
            assert not seq.block_table, f"{seq.request_id} ({seq.status}) still holds blocks"
        for b in seq.block_table:
            held[b] += 1
    assert held == blocks.ref_count
    assert set(blocks.free) == {b for b in range(blocks.num_blocks) if blocks.ref_count[b] == 0}


def assert_all_free(engine: Engine) -> None:
    assert not engine.has_unfinished()
    assert engine.blocks.num_free == engine.blocks.num_blocks
    assert all(c == 0 for c in engine.blocks.ref_count)


def run_to_completion(engine: Engine, arrivals=(), aborts=(), updates=(), check_blocks: bool = False):
    """Drive the step-level API until nothing is left. Before the step with index i: add the
    requests of arrivals [(i, prompt, params, request_id)], abort the ids of aborts [(i, id)] and
    apply updates [(i, state_dict, version)]. Returns {id: RequestOutput}, {id: [StepOutput]}."""
    events = sorted([(a[0], 0, a[1:]) for a in arrivals] + [(a[0], 1, a[1:]) for a in aborts]
                    + [(u[0], 2, u[1:]) for u in updates], key=lambda e: e[:2])
    ids, streamed = [], {}
    for step in range(MAX_STEPS):
        while events and events[0][0] <= step:
            _, kind, args = events.pop(0)
            if kind == 0:
                prompt, params, rid = args
                ids += engine.add_request(prompt, params, request_id=rid)
            elif kind == 1:
                engine.abort(*args)
            else:
                engine.update_weights(*args)
        if not events and not engine.has_unfinished():
            break
        for out in engine.step():
            streamed.setdefault(out.request_id, []).append(out)
        if check_blocks:
            assert_block_accounting(engine)
    else:
        raise AssertionError(f"engine did not finish within {MAX_STEPS} steps (livelock?)")
    outputs = {rid: engine.pop_output(rid) for rid in ids}
    for rid, out in outputs.items():  # the streamed tokens are the final output
        stream = streamed.get(rid, [])
        assert [s.token_id for s in stream] == out.token_ids
        assert [s.logprob for s in stream] == out.logprobs
        assert [s.version for s in stream] == out.versions
        if out.finish_reason == "abort":
            assert not any(s.finished for s in stream)
        else:
            assert [s.finished for s in stream] == [False] * (len(stream) - 1) + [True]
            assert stream[-1].finish_reason == out.finish_reason
    return outputs, streamed


def count_prefix_hits(engine: Engine) -> list[int]:
    """Record how many cached blocks each admission reuses (for hypothesis statistics)."""
    hits, match = [], engine.blocks.match_prefix

    def counting(tokens, max_tokens):
        blocks = match(tokens, max_tokens)
        hits.append(len(blocks))
        return blocks

    engine.blocks.match_prefix = counting
    return hits


def generate_alone(model_dir, dtype, prompt, params, request_id="alone"):
    """The same request in a fresh engine with nothing else in it (roomy cache, no chunking)."""
    engine = make_engine(model_dir, dtype, num_kv_blocks=64)
    outputs, _ = run_to_completion(engine, [(0, prompt, params, request_id)])
    return list(outputs.values())


def random_prompt(rng: random.Random, length: int, vocab: int = 1024) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(length)]


# ---------------------------------------------------------------------------------------------
# 1. the invariance property
# ---------------------------------------------------------------------------------------------


@st.composite
def workloads(draw):
    """Requests (some sharing a system prompt, some n>1 groups) arriving at random steps, some
    aborted a few steps later, a chunk size (max_num_batched_tokens), a cap on running sequences,
    and a KV cache that is sometimes just big enough for the longest sequence."""
    rng = random.Random(draw(st.integers(0, 2**32 - 1), label="token seed"))
    shared = random_prompt(rng, draw(st.integers(0, 40), label="shared prefix"))
    requests, aborts = [], []
    for i in range(draw(st.integers(1, 5), label="requests")):
        prefix = shared if draw(st.booleans(), label="uses shared prefix") else []
        prompt = prefix + random_prompt(rng, draw(st.integers(0 if prefix else 1, 20), label="suffix"))
        params = SamplingParams(
            temperature=draw(st.sampled_from([0.0, 0.7, 1.0]), label="temperature"),
            top_k=draw(st.sampled_from([0, 0, 5]), label="top_k"),
            top_p=draw(st.sampled_from([1.0, 1.0, 0.8]), label="top_p"),
            max_tokens=draw(st.integers(1, 12), label="max_tokens"),
            n=draw(st.sampled_from([1, 1, 2, 3]), label="n"),
            seed=draw(st.integers(0, 2**20), label="seed"),
            prompt_logprobs=draw(st.booleans(), label="prompt_logprobs"),
        )
        arrival = draw(st.integers(0, 8), label="arrival step")
        requests.append((arrival, prompt, params, f"r{i}"))
        if draw(st.sampled_from([False, False, False, True]), label="aborted"):
            sample = draw(st.integers(0, params.n - 1), label="aborted sample")
            rid = f"r{i}" if params.n == 1 else f"r{i}/{sample}"
            aborts.append((arrival + draw(st.integers(0, 12), label="abort after"), rid))
    chunk = draw(st.sampled_from([4, 7, 16, 29, 2048]), label="max_num_batched_tokens")
    # The longest single sequence must fit the cache; "tight" leaves at most 1 block to spare,
    # so that requests preempt each other.
    need = max(-(-(len(p) + sp.max_tokens) // ATTN_BLOCK) for _, p, sp, _ in requests)
    tight = draw(st.sampled_from([True, True, False]), label="tight")
    blocks = need + draw(st.integers(0, 1), label="spare blocks") if tight else 64
    max_num_seqs = draw(st.sampled_from([2, 256]), label="max_num_seqs")
    return requests, aborts, chunk, blocks, max_num_seqs


def sample_ids(rid: str, params: SamplingParams) -> list[str]:
    return [rid] if params.n == 1 else [f"{rid}/{i}" for i in range(params.n)]


def run_workload(model_dir, dtype, workload, updates=()):
    requests, aborts, chunk, blocks, max_num_seqs = workload
    engine = make_engine(
        model_dir, dtype, num_kv_blocks=blocks, max_num_batched_tokens=chunk, max_num_seqs=max_num_seqs
    )
    reused = count_prefix_hits(engine)
    outputs, streamed = run_to_completion(engine, requests, aborts, updates, check_blocks=True)
    assert_all_free(engine)
    event(f"preempted: {engine.num_preemptions > 0}")
    event(f"chunked prefill: {chunk < max(len(p) for _, p, _, _ in requests)}")
    event(f"prefix cache hit: {sum(reused) > 0}")
    event(f"aborted: {any(o.finish_reason == 'abort' for o in outputs.values())}")
    transforms = {i: params.transform for _, _, params, rid in requests for i in sample_ids(rid, params)}
    for _, prompt, params, rid in requests:
        for i in sample_ids(rid, params):
            out = outputs[i]
            assert out.prompt_token_ids == prompt
            if out.finish_reason == "abort":
                assert len(out.token_ids) < params.max_tokens
            else:
                assert out.finish_reason == "length" and len(out.token_ids) == params.max_tokens
    return outputs, streamed, transforms


@pytest.mark.parametrize("dtype", DTYPES)
@PROPERTY
@given(workload=workloads())
def test_request_is_bitwise_identical_to_running_alone_and_to_the_trainer(model_dir, dtype, workload):
    outputs, _, transforms = run_workload(model_dir, dtype, workload)
    for _, prompt, params, rid in workload[0]:
        alone = generate_alone(model_dir, dtype, prompt, params, request_id=rid)
        for i, solo in zip(sample_ids(rid, params), alone):
            out, k = outputs[i], len(outputs[i].token_ids)  # an aborted request: a prefix
            assert out.token_ids == solo.token_ids[:k], f"{i}: tokens depend on the batch"
            assert out.logprobs == solo.logprobs[:k], f"{i}: behaviour logprobs depend on the batch"
            if params.prompt_logprobs:  # every position the engine did compute has the same bits
                for got, ref in zip(out.prompt_logprobs, solo.prompt_logprobs):
                    assert got is None or ref is None or got == ref
    ordered = list(outputs.values())
    trainer = teacher_forced(trainer_model(model_dir, dtype), ordered, [transforms[o.request_id] for o in ordered])
    for out, expected in zip(ordered, trainer):
        assert out.logprobs == expected, f"{out.request_id}: behaviour logprob != trainer logprob"


@pytest.mark.parametrize("dtype", DTYPES)
@PROPERTY
@given(workload=workloads(), update_step=st.integers(0, 14))
def test_weight_update_at_any_step_matches_the_trainer_at_each_tokens_version(model_dir, dtype, workload, update_step):
    """update_weights between any two steps: nothing is dropped, later tokens carry version 1, and
    (recompute_on_update) each token's logprob is the trainer's at the weights of its version."""
    v0, v1 = trainer_model(model_dir, dtype), next_version_model(model_dir, dtype)
    outputs, streamed, transforms = run_workload(model_dir, dtype, workload, [(update_step, v1.state_dict(), 1)])
    ordered = list(outputs.values())
    order = [transforms[o.request_id] for o in ordered]
    by_version = {0: teacher_forced(v0, ordered, order), 1: teacher_forced(v1, ordered, order)}
    event(f"tokens of both versions in one request: {any(len(set(o.versions)) == 2 for o in ordered)}")
    for i, out in enumerate(ordered):
        assert out.versions == sorted(out.versions)
        expected = [by_version[v][i][t] for t, v in enumerate(out.versions)]
        assert out.logprobs == expected, f"{out.request_id}: behaviour logprob != trainer logprob at its version"


@pytest.mark.parametrize("dtype", DTYPES)
def test_standard_numerics_negative_control(model_dir, dtype):
    """Stock kernels: the engine's behaviour logprobs (decode path, chunked prefill, batch of 3)
    differ from the trainer's teacher-forced pass on the same tokens. Proves the check above can fail."""
    rng = random.Random(1)
    prompts = [random_prompt(rng, n) for n in (37, 5, 21)]
    params = SamplingParams(temperature=1.0, max_tokens=12, seed=3)
    engine = make_engine(model_dir, dtype, numerics="standard", max_num_batched_tokens=16)
    outputs = engine.generate(prompts, params)
    trainer = teacher_forced(trainer_model(model_dir, dtype, "standard"), outputs, [params.transform] * 3)
    diffs = [abs(a - b) for out, ref in zip(outputs, trainer) for a, b in zip(out.logprobs, ref)]
    assert max(diffs) > 0.0, "standard numerics happened to match the trainer bitwise"


def test_engines_of_both_numerics_run_side_by_side_in_threads(model_dir):
    """No process-wide mode: an invariant and a standard engine stepping at the same time in two
    threads each give exactly the bits they give alone, and the two modes' bits differ."""
    import threading

    rng = random.Random(11)
    prompts = [random_prompt(rng, n) for n in (37, 5, 21)]
    params = SamplingParams(temperature=1.0, max_tokens=12, seed=3)

    def generate(numerics: str) -> list[list[float]]:
        engine = make_engine(model_dir, numerics=numerics, max_num_batched_tokens=16)
        return [o.logprobs for o in engine.generate(prompts, params)]

    alone = {mode: generate(mode) for mode in ("invariant", "standard")}
    together: dict[str, list[list[float]]] = {}
    errors: list[BaseException] = []

    def worker(mode: str) -> None:
        try:
            for _ in range(3):  # overlap many steps of the two engines
                together[mode] = generate(mode)
        except BaseException as err:  # noqa: BLE001 (surfaced below)
            errors.append(err)

    threads = [threading.Thread(target=worker, args=(mode,)) for mode in alone]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert together == alone
    assert alone["invariant"] != alone["standard"]  # the modes really are different code paths
    assert [len(x) for x in alone["invariant"]] == [12, 12, 12]


# ---------------------------------------------------------------------------------------------
# 3. continuous batching, abort, block accounting
# ---------------------------------------------------------------------------------------------


def test_requests_join_and_leave_at_any_step_and_abort_frees_blocks(model_dir):
    rng = random.Random(2)
    params = SamplingParams(max_tokens=12, seed=7)
    a_prompt, b_prompt, c_prompt, d_prompt = (random_prompt(rng, n) for n in (20, 35, 9, 18))
    engine = make_engine(model_dir, max_num_batched_tokens=24, decode_steps_per_call=1)  # a token per step
    assert engine.add_request(a_prompt, params, request_id="a") == ["a"]
    seen = {}
    for _ in range(3):
        for out in engine.step():
            seen.setdefault(out.request_id, []).append(out.token_id)
    engine.add_request(b_prompt, params, request_id="b")  # joins mid-generation
    group = engine.add_request(c_prompt, SamplingParams(max_tokens=6, seed=9, n=3), request_id="c")
    assert group == ["c/0", "c/1", "c/2"]
    for out in engine.step():
        seen.setdefault(out.request_id, []).append(out.token_id)
    assert engine.sequences["b"].status == Status.RUNNING and engine.sequences["b"].block_table
    free_before = engine.blocks.num_free
    held_by_b = len(engine.sequences["b"].block_table)
    engine.abort("b")  # running request
    assert engine.blocks.num_free == free_before + held_by_b
    assert engine.get_output("b").finish_reason == "abort"
    engine.abort("c/0")  # a group leader: its followers go on without it
    engine.add_request(d_prompt, params, request_id="d")
    engine.abort("d")  # still waiting: never scheduled
    assert_block_accounting(engine)
    with pytest.raises(ValueError, match="has not finished"):
        engine.pop_output("a")
    steps = 0
    while engine.has_unfinished():
        for out in engine.step():
            seen.setdefault(out.request_id, []).append(out.token_id)
        assert_block_accounting(engine)
        steps += 1
        assert steps < MAX_STEPS
    engine.abort("a")  # aborting a finished request changes nothing
    outputs = {rid: engine.pop_output(rid) for rid in ["a", "b", "c/0", "c/1", "c/2", "d"]}
    assert_all_free(engine)
    assert engine.sequences == {}

    assert outputs["a"].finish_reason == "length" and outputs["a"].token_ids == seen["a"]
    assert [outputs[r].finish_reason for r in ("b", "c/0", "d")] == ["abort"] * 3
    assert outputs["d"].token_ids == [] and "d" not in seen
    assert outputs["a"].token_ids == generate_alone(model_dir, "fp32", a_prompt, params)[0].token_ids
    group_alone = generate_alone(model_dir, "fp32", c_prompt, SamplingParams(max_tokens=6, seed=9, n=3))
    for i in (1, 2):
        assert outputs[f"c/{i}"].finish_reason == "length"
        assert outputs[f"c/{i}"].token_ids == group_alone[i].token_ids
        assert outputs[f"c/{i}"].logprobs == group_alone[i].logprobs


# ---------------------------------------------------------------------------------------------
# 4. paged cache: memory bound and preemption
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_small_cache_preempts_and_gives_the_unpreempted_bits(model_dir, dtype):
    rng = random.Random(3)
    prompts = [random_prompt(rng, rng.randint(15, 30)) for _ in range(6)]
    params = SamplingParams(temperature=1.0, max_tokens=36, seed=11)
    small = make_engine(model_dir, dtype, num_kv_blocks=9)  # 144 slots; the requests need ~360
    assert all(k.shape[0] == v.shape[0] == 9 for k, v in small.kv_caches)  # the memory bound
    arrivals = [(0, p, params, f"q{i}") for i, p in enumerate(prompts)]
    preempted, _ = run_to_completion(small, arrivals, check_blocks=True)
    assert small.num_preemptions > 0
    assert_all_free(small)
    roomy = make_engine(model_dir, dtype, num_kv_blocks=64)
    reference, _ = run_to_completion(roomy, arrivals)
    assert roomy.num_preemptions == 0
    for rid, out in preempted.items():
        assert out.finish_reason == "length" and len(out.token_ids) == 36
        assert out.token_ids == reference[rid].token_ids
        assert out.logprobs == reference[rid].logprobs


def test_request_longer_than_the_whole_cache_finishes_with_length(model_dir):
    """Regression: a sequence outgrowing every block of the cache used to be preempted and never
    rescheduled (step() returned [] forever and generate() spun)."""
    engine = make_engine(model_dir, num_kv_blocks=2)  # 32 slots
    other = engine.add_request([5, 6, 7], SamplingParams(max_tokens=4, seed=0), request_id="other")
    outputs, _ = run_to_completion(engine, [(0, list(range(10, 20)), SamplingParams(max_tokens=40, seed=1), "long")])
    long = outputs["long"]
    assert long.finish_reason == "length"
    assert len(long.prompt_token_ids) + len(long.token_ids) == 2 * ATTN_BLOCK + 1
    assert engine.pop_output(other[0]).finish_reason == "length"
    assert_all_free(engine)


# ---------------------------------------------------------------------------------------------
# 5. sampling parameters
# ---------------------------------------------------------------------------------------------


def test_greedy_is_argmax_and_top_k_1_is_greedy(model_dir):
    rng = random.Random(4)
    prompts = [random_prompt(rng, n) for n in (13, 30)]
    engine = make_engine(model_dir)
    greedy = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=10))
    top1 = engine.generate(prompts, SamplingParams(temperature=0.8, top_k=1, max_tokens=10, seed=5))
    model = trainer_model(model_dir, "fp32")
    for out, t1 in zip(greedy, top1):
        seq = out.prompt_token_ids + out.token_ids
        meta, _ = AttentionMeta.for_sequences([len(seq)], row_tile=model.numerics.row_tile)
        with torch.no_grad():
            logits = model.logits(model(torch.tensor(seq), meta))
        prompt = len(out.prompt_token_ids)
        assert out.token_ids == logits[prompt - 1 : -1].argmax(-1).tolist()
        # temperature 0 is scored under temperature 1
        expected = model.numerics.log_softmax(logits[prompt - 1 : -1]).gather(1, torch.tensor(out.token_ids)[:, None])
        assert out.logprobs == expected[:, 0].tolist()
        assert t1.token_ids == out.token_ids
        assert t1.logprobs == [0.0] * 10  # the truncated distribution has one token


def test_seed_reproducibility(model_dir):
    prompt = random_prompt(random.Random(5), 17)
    engine = make_engine(model_dir)
    runs = [engine.generate(prompt, SamplingParams(max_tokens=10, seed=s))[0] for s in (42, 42, 43)]
    other_engine = make_engine(model_dir, seed=123)
    again = other_engine.generate(prompt, SamplingParams(max_tokens=10, seed=42))[0]
    assert runs[0].token_ids == runs[1].token_ids == again.token_ids
    assert runs[0].logprobs == runs[1].logprobs == again.logprobs
    assert runs[0].token_ids != runs[2].token_ids
    # Unseeded requests draw from the engine seed: a fresh engine with the same seed repeats them.
    unseeded = [make_engine(model_dir, seed=s).generate([prompt, prompt], SamplingParams(max_tokens=8)) for s in (1, 1)]
    assert [o.token_ids for o in unseeded[0]] == [o.token_ids for o in unseeded[1]]
    assert unseeded[0][0].token_ids != unseeded[0][1].token_ids


def test_max_tokens_stop_token_ids_and_eos(model_dir):
    prompt = random_prompt(random.Random(6), 11)
    greedy = SamplingParams(temperature=0.0, max_tokens=16)
    engine = make_engine(model_dir)
    ref = engine.generate(prompt, greedy)[0]
    assert ref.finish_reason == "length" and len(ref.token_ids) == 16
    stop_at = 5
    token = ref.token_ids[stop_at]
    first = ref.token_ids.index(token)

    out = engine.generate(prompt, SamplingParams(temperature=0.0, max_tokens=16, stop_token_ids=[token]))[0]
    assert out.finish_reason == "stop" and out.token_ids == ref.token_ids[: first + 1]

    eos_engine = make_engine(model_dir, eos_token_ids=[token])
    out = eos_engine.generate(prompt, greedy)[0]
    assert out.finish_reason == "stop" and out.token_ids == ref.token_ids[: first + 1]
    ignored = eos_engine.generate(prompt, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))[0]
    assert ignored.finish_reason == "length" and ignored.token_ids == ref.token_ids

    short = engine.generate(prompt, SamplingParams(temperature=0.0, max_tokens=1))[0]
    assert short.finish_reason == "length" and short.token_ids == ref.token_ids[:1]
    capped = make_engine(model_dir, max_model_len=len(prompt) + 4).generate(prompt, greedy)[0]
    assert capped.finish_reason == "length" and capped.token_ids == ref.token_ids[:4]
    assert_all_free(engine)


def test_stop_strings_stop_and_truncate_text(model_dir):
    engine = Engine(model_dir, num_kv_blocks=64)  # tokenizer and EOS ids from the model directory
    tok = engine.tokenizer
    assert engine.eos_token_ids == {tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")}
    prompt = "def solve(a, b):\n    result = a + b"
    free = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    ref = engine.generate(prompt, free)[0]
    assert ref.prompt_token_ids == tok.encode(prompt, add_special_tokens=False).ids
    full = tok.decode(ref.token_ids, skip_special_tokens=False)
    middle = len(full) // 2
    stop = full[middle : middle + 3]
    assert stop, f"greedy text too short to pick a stop string from: {full!r}"
    # the first token count whose decoded text contains a stop string
    k = next(k for k in range(1, 25) if stop in tok.decode(ref.token_ids[:k], skip_special_tokens=False))
    text = tok.decode(ref.token_ids[:k], skip_special_tokens=False)

    stopping = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop, "never seen"])
    out = engine.generate(prompt, stopping)[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == ref.token_ids[:k]
    assert out.text == text[: text.find(stop)]
    assert stop not in out.text
    assert ref.text == tok.decode(ref.token_ids, skip_special_tokens=True)


def test_n_samples_share_prompt_blocks(model_dir):
    prompt = random_prompt(random.Random(7), 2 * ATTN_BLOCK + 8)  # two full blocks and a partial one
    params = SamplingParams(temperature=1.0, max_tokens=6, n=4, seed=21, prompt_logprobs=True)
    engine = make_engine(model_dir, decode_steps_per_call=1)  # one forward per step, counted below
    computed = []
    engine.model.register_forward_pre_hook(lambda module, args: computed.append(args[0].numel()))
    ids = engine.add_request(prompt, params, request_id="g")
    assert ids == ["g/0", "g/1", "g/2", "g/3"]
    engine.step()  # the leader computes the prompt; the others fork from it in the same step
    tables = [engine.sequences[i].block_table for i in ids]
    shared = tables[0][:2]
    assert all(t[:2] == shared for t in tables)
    assert len({t[2] for t in tables}) == 4  # the partial block is private
    assert [engine.blocks.ref_count[b] for b in shared] == [4, 4]
    assert engine.blocks.num_blocks - engine.blocks.num_free == 2 + 4  # not 4 * 3
    assert all(len(engine.sequences[i].token_ids) == len(prompt) + 1 for i in ids)  # all sampled a first token
    run_to_completion(engine)
    outputs = [engine.pop_output(i) for i in ids]
    assert_all_free(engine)
    # the prompt ran once (40 tokens), then 4 decode tokens per step
    assert computed[:2] == [len(prompt), 4]
    # the followers start from the leader's K/V (the partial block copied): the trainer's bits
    assert [o.logprobs for o in outputs] == teacher_forced(engine.model, outputs, [params.transform] * 4)
    assert len(outputs) == 4 and len({tuple(o.token_ids) for o in outputs}) > 1
    # the prompt's logprobs are the leader's: a forked sample computed none of its prompt
    assert None not in outputs[0].prompt_logprobs
    assert all(out.prompt_logprobs == [None] * (len(prompt) - 1) for out in outputs[1:])


@pytest.mark.parametrize(
    "prompt_len, budget, max_seqs, blocks",
    [(40, 24, 8, 64), (40, 33, 8, 64), (40, 40, 8, 64), (5, 2048, 8, 64), (2 * ATTN_BLOCK, 2048, 8, 64),
     (40, 2048, 2, 64), (17, 16, 3, 64), (40, 2048, 8, 5)],
)
def test_group_samples_fork_from_the_leaders_prompt(model_dir, prompt_len, budget, max_seqs, blocks):
    """A group's samples fork from the leader once its prompt is computed, also when that took
    several steps (chunked prefill), when the prompt ends on a block edge or is shorter than a block,
    and when max_num_seqs or the cache (5 blocks) leaves room for only some of them (the rest start
    later from the cached prefix); every sample keeps the trainer's bits."""
    prompt = random_prompt(random.Random(prompt_len), prompt_len)
    params = SamplingParams(temperature=1.0, max_tokens=5, n=4, seed=5)
    engine = make_engine(model_dir, max_num_batched_tokens=budget, max_num_seqs=max_seqs, num_kv_blocks=blocks)
    ids = engine.add_request(prompt, params)
    run_to_completion(engine, check_blocks=True)
    outputs = [engine.pop_output(i) for i in ids]
    assert_all_free(engine)
    assert all(len(o.token_ids) == 5 for o in outputs)
    assert [o.logprobs for o in outputs] == teacher_forced(engine.model, outputs, [params.transform] * 4)


# ---------------------------------------------------------------------------------------------
# 6. weight updates with versions
# ---------------------------------------------------------------------------------------------


def perturbed_model(model, seed: int, scale: float = 0.01):
    """The next version of the trainer's weights (its state dict holds tied tensors once each)."""
    gen = torch.Generator().manual_seed(seed)
    new = copy.deepcopy(model)
    with torch.no_grad():
        for param in new.parameters():
            param.add_((scale * torch.randn(param.shape, generator=gen)).to(param.dtype))
    return new


def perturbed_state_dict(model, seed: int) -> dict[str, torch.Tensor]:
    return perturbed_model(model, seed).state_dict()


@pytest.mark.parametrize("recompute", [True, False])
def test_update_weights_between_steps_keeps_requests_and_stamps_versions(model_dir, recompute):
    rng = random.Random(8)
    prompts = [random_prompt(rng, n) for n in (26, 9)]
    params = SamplingParams(temperature=1.0, max_tokens=10, seed=13)
    group = SamplingParams(temperature=0.9, top_p=0.9, max_tokens=10, seed=14, n=2)
    v0 = trainer_model(model_dir, "fp32")
    v1 = perturbed_model(v0, seed=1)
    state1 = v1.state_dict()
    engine = make_engine(model_dir, recompute_on_update=recompute, max_num_batched_tokens=32)
    ids = engine.add_request(prompts[0], params, request_id="a") + engine.add_request(prompts[1], group, "b")
    before = [out for _ in range(4) for out in engine.step()]
    engine.update_weights(state1, version=1)
    assert engine.version == 1
    ids += engine.add_request(prompts[1], params, request_id="late")
    after, steps = [], 0
    while engine.has_unfinished():
        after += engine.step()
        steps += 1
        assert steps < MAX_STEPS
    outputs = [engine.pop_output(i) for i in ids]
    assert_all_free(engine)
    assert before and after
    assert {o.version for o in before} == {0} and {o.version for o in after} == {1}
    for out in outputs:
        assert out.finish_reason == "length" and len(out.token_ids) == 10
        assert out.versions == sorted(out.versions)
    assert any(0 in o.versions and 1 in o.versions for o in outputs)

    transforms = [params.transform, group.transform, group.transform, params.transform]
    by_version = {0: teacher_forced(v0, outputs, transforms), 1: teacher_forced(v1, outputs, transforms)}
    mismatch = [
        abs(lp - by_version[v][i][t])
        for i, out in enumerate(outputs)
        for t, (lp, v) in enumerate(zip(out.logprobs, out.versions))
    ]
    if recompute:  # every token's behaviour logprob is the trainer's at that token's version
        assert max(mismatch) == 0.0
    else:  # negative control: stale K/V from version 0 feed version-1 tokens
        assert max(mismatch) > 0.0


@pytest.mark.parametrize("dtype", DTYPES)
def test_update_weights_casts_like_the_trainer(model_dir, dtype):
    """C1: after an update the engine's weights equal the trainer's after the same dtype cast."""
    state = perturbed_state_dict(trainer_model(model_dir, "fp32"), seed=2)
    engine = make_engine(model_dir, dtype)
    engine.update_weights(state, version=5)
    for name, param in engine.model.named_parameters():
        assert param.dtype == engine.model.dtype
        assert torch.equal(param, state[name].to(param.dtype)), name


def test_bad_state_dicts_raise_and_leave_weights_untouched(model_dir):
    prompt = random_prompt(random.Random(9), 12)
    params = SamplingParams(max_tokens=8, seed=3)
    engine = make_engine(model_dir)
    engine.add_request(prompt, params, request_id="a")
    engine.step()
    snapshot = {n: p.clone() for n, p in engine.model.named_parameters()}
    good = perturbed_state_dict(trainer_model(model_dir, "fp32"), seed=3)

    unknown = dict(good, **{"model.layers.0.mlp.extra.weight": torch.zeros(3)})
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.extra\.weight"):
        engine.update_weights(unknown, version=1)
    name = "model.layers.1.self_attn.q_proj.weight"
    wrong_shape = dict(good, **{name: good[name][:, :-1]})
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.q_proj\.weight.*shape"):
        engine.update_weights(wrong_shape, version=1)

    assert engine.version == 0
    for n, p in engine.model.named_parameters():
        assert torch.equal(p, snapshot[n]), f"{n} changed by a rejected update"
    run_to_completion(engine)
    out = engine.pop_output("a")
    assert out.finish_reason == "length" and out.versions == [0] * 8
    assert out.token_ids == generate_alone(model_dir, "fp32", prompt, params)[0].token_ids


def test_engine_copies_the_model_it_is_given(model_dir):
    """Regression: Engine(model, dtype="bf16") used to cast the caller's (trainer's) model in place
    and share its parameters, so trainer updates leaked into the engine without a version."""
    model = load_model(model_dir, "fp32")
    before = {n: p.clone() for n, p in model.named_parameters()}
    engine = Engine(model, dtype="bf16", num_kv_blocks=8)
    assert model.dtype == torch.float32 and engine.model.dtype == torch.bfloat16
    engine.update_weights(perturbed_state_dict(model, seed=4), version=1)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


# ---------------------------------------------------------------------------------------------
# 7. multi-turn continuation through the prefix cache
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_multi_turn_continuation_reuses_prefix_and_matches_plain_prefill(model_dir, dtype):
    rng = random.Random(10)
    prompt = random_prompt(rng, 29)
    engine = make_engine(model_dir, dtype)
    first = engine.generate(prompt, SamplingParams(temperature=1.0, max_tokens=20, seed=17))[0]
    tool_result = random_prompt(rng, 9)
    turn2 = first.prompt_token_ids + first.token_ids + tool_result  # 58 tokens
    params = SamplingParams(temperature=0.7, max_tokens=12, seed=18, prompt_logprobs=True)
    computed = []
    engine.model.register_forward_pre_hook(lambda module, args: computed.append(args[0].numel()))
    cont = engine.generate(turn2, params)[0]
    fresh = make_engine(model_dir, dtype).generate(turn2, params)[0]
    # The first turn computed 29 + 19 tokens (the last sampled one never enters the cache): its
    # three full blocks are reused, the continuation computes only the rest of its prompt.
    cached = 3 * ATTN_BLOCK
    assert computed[0] == len(turn2) - cached
    assert cont.prompt_logprobs[:cached] == [None] * cached
    assert None not in cont.prompt_logprobs[cached:]
    assert None not in fresh.prompt_logprobs
    assert cont.prompt_logprobs[cached:] == fresh.prompt_logprobs[cached:]
    assert cont.token_ids == fresh.token_ids
    assert cont.logprobs == fresh.logprobs
    assert cont.finish_reason == fresh.finish_reason == "length"


# ---------------------------------------------------------------------------------------------
# 8. bad input
# ---------------------------------------------------------------------------------------------


def test_bad_input_raises_and_other_requests_go_on(model_dir):
    rng = random.Random(11)
    prompts = [random_prompt(rng, n) for n in (14, 22)]
    params = SamplingParams(max_tokens=10, seed=19)
    engine = make_engine(model_dir, max_model_len=64)
    engine.add_request(prompts[0], params, request_id="a")
    engine.add_request(prompts[1], SamplingParams(max_tokens=10, seed=20, n=2), request_id="b")
    engine.step()
    engine.step()

    bad_params = [
        ("temperature", dict(temperature=-0.5)),
        ("top_p", dict(top_p=0.0)),
        ("top_p", dict(top_p=1.5)),
        ("top_k", dict(top_k=-1)),
        ("max_tokens", dict(max_tokens=0)),
        (r"\bn\b", dict(n=0)),
    ]
    for match, kwargs in bad_params:
        with pytest.raises(ValueError, match=match):
            SamplingParams(**kwargs)
    for field, value, match in [("top_p", 1.5, "top_p"), ("temperature", -1.0, "temperature"), ("top_k", -2, "top_k")]:
        mutated = SamplingParams(max_tokens=4)
        setattr(mutated, field, value)  # mutated after validation: the engine still refuses it
        with pytest.raises(ValueError, match=match):
            engine.add_request(prompts[0], mutated)

    waiting, sequences = len(engine.waiting), set(engine.sequences)
    bad_requests = [
        ([], None, "empty prompt"),
        (list(range(3, 3 + 64)), None, "max_model_len"),
        ([5, 1024, 6], None, "outside the vocabulary"),
        ([5, -1, 6], None, "outside the vocabulary"),
        ("some text", None, "tokenizer"),
        ([5, 6], SamplingParams(stop=["x"]), "tokenizer"),
    ]
    for prompt, p, match in bad_requests:
        with pytest.raises(ValueError, match=match):
            engine.add_request(prompt, p)
    with pytest.raises(ValueError, match="'a' is already in use"):
        engine.add_request(prompts[0], params, request_id="a")
    with pytest.raises(ValueError, match="'b' is already in use"):
        engine.add_request(prompts[0], SamplingParams(n=2), request_id="b")
    assert len(engine.waiting) == waiting and set(engine.sequences) == sequences  # nothing queued

    run_to_completion(engine)
    done = {rid: engine.pop_output(rid) for rid in ("a", "b/0", "b/1")}
    assert_all_free(engine)
    assert all(o.finish_reason == "length" and len(o.token_ids) == 10 for o in done.values())
    assert done["a"].token_ids == generate_alone(model_dir, "fp32", prompts[0], params)[0].token_ids
    for kwargs, match in [
        (dict(max_num_batched_tokens=0), "max_num_batched_tokens"),  # used to make step() a no-op forever
        (dict(max_num_seqs=0), "max_num_seqs"),
        (dict(num_kv_blocks=0), "at least one block"),
    ]:
        with pytest.raises(ValueError, match=match):
            make_engine(model_dir, **kwargs)
    with pytest.raises(ValueError, match="max_model_len"):  # the largest prompt that does not fit
        engine.add_request(list(range(3, 3 + 64)))
    assert engine.add_request(list(range(3, 3 + 63)), SamplingParams(max_tokens=5), request_id="fits") == ["fits"]
    run_to_completion(engine)
    assert len(engine.pop_output("fits").token_ids) == 1  # the context allows one more token


def test_top_logprobs_change_nothing_else(model_dir):
    """Asking for top_logprobs leaves every token and logprob as it was; the alternatives are the most
    likely tokens of the distribution sampled from, most likely first, without truncated-away ones."""
    requests = [  # two transforms in one batch: the per-group sampling path
        ([5, 6, 7], SamplingParams(max_tokens=12, seed=4, top_k=3), "top-k"),
        (list(range(10, 40)), SamplingParams(max_tokens=12, temperature=0), "greedy"),
    ]
    plain, _ = run_to_completion(make_engine(model_dir), [(0, p, params, rid) for p, params, rid in requests])
    with_top, streamed = run_to_completion(
        make_engine(model_dir),
        [(0, p, dataclasses.replace(params, top_logprobs=5), rid) for p, params, rid in requests],
    )
    for rid in ("top-k", "greedy"):
        assert plain[rid].top_logprobs is None
        out = with_top[rid]
        assert (out.token_ids, out.logprobs) == (plain[rid].token_ids, plain[rid].logprobs)
        assert out.top_logprobs == [s.top_logprobs for s in streamed[rid]]
        for token, logprob, top in zip(out.token_ids, out.logprobs, out.top_logprobs):
            values = [v for _, v in top]
            assert len(top) == (3 if rid == "top-k" else 5) and values == sorted(values, reverse=True)
            assert (token, logprob) in top
    assert all(top[0][0] == token for token, top in zip(with_top["greedy"].token_ids, with_top["greedy"].top_logprobs))



@pytest.mark.parametrize("gemm", ["bf16", "fp32", "fp32-panels", pytest.param("kernel", marks=needs_bf16_gemm)])
def test_wide_bf16_model_engine_matches_the_trainer_through_a_weight_update(gemm, monkeypatch):
    """At hidden size 1024 (a 0.6B model's K), on the bf16 GEMM the engine's decode linears run on
    prepacked weights (`invariant.prepack_proven`) and the trainer's on mm tiles; on the fp32 GEMM
    (Intel CPUs without AMX) the engine's on cached fp32 copies (or column panels, from PANEL_MIN
    elements) and the trainer's on fresh ones; on our own GEMM (small weights, avx512_bf16) the
    engine's on kept panels and the trainer's on panels packed per pass. Each behaviour logprob
    must still be the trainer's at its token's version, across an in-place weight update that
    repacks (or widens again) them."""
    from rzero.model.qwen3 import Qwen3Config, Qwen3ForCausalLM
    from rzero.ops import gemm_route, invariant, weight_copies

    monkeypatch.setattr(invariant, "bf16_gemm", lambda: "bf16" if gemm == "kernel" else gemm.split("-")[0])
    monkeypatch.setattr(gemm_route, "bf16_kernel", lambda: gemm == "kernel")
    if gemm == "fp32":
        monkeypatch.setattr(invariant, "PANEL_MIN", 1 << 62)  # every weight on the (N, K) fp32 route

    config = Qwen3Config(vocab_size=512, hidden_size=1024, intermediate_size=1024, num_hidden_layers=1,
                         num_attention_heads=8, num_key_value_heads=4, head_dim=128, tie_word_embeddings=True)
    v0 = Qwen3ForCausalLM(config)
    v0.init_weights(3)
    v0 = v0.to(torch.bfloat16)
    v1 = perturbed_model(v0, seed=4)
    engine = Engine(copy.deepcopy(v0), numerics="invariant", dtype="bf16", num_kv_blocks=32, eos_token_ids=[])
    params = SamplingParams(temperature=1.0, max_tokens=10, seed=7, ignore_eos=True)
    prompts = [[5, 6, 7, 8, 9], list(range(20, 50)), [3]]
    arrivals = [(i, prompt, params, f"r{i}") for i, prompt in enumerate(prompts)]
    outputs, _ = run_to_completion(engine, arrivals, updates=[(5, v1.state_dict(), 1)])
    if gemm == "bf16" and invariant.prepack_proven(1024, config.vocab_size, torch.get_num_threads()):  # the LM head's shape
        assert id(engine.model.lm_head.weight) in weight_copies.PREPACKED
    ordered = [outputs[f"r{i}"] for i in range(len(prompts))]
    assert all(len(set(o.versions)) == 2 for o in ordered[:2])  # both versions sampled in one request
    by_version = {v: teacher_forced(m, ordered, [params.transform] * len(ordered)) for v, m in ((0, v0), (1, v1))}
    for i, out in enumerate(ordered):
        assert out.logprobs == [by_version[v][i][t] for t, v in enumerate(out.versions)], out.request_id
