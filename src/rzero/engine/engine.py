"""A continuous-batching inference engine over the same model code the trainer runs.

Each `step()` runs one forward pass over a flat batch that mixes decode tokens of running requests
with prompt chunks of new ones (chunked prefill, under a token budget; scheduler.py chooses), then
samples one token for every sequence whose tokens are all in the cache (sampler.py). Requests join
and leave at any step. Once every running sequence only decodes, a step may run up to
`decode_steps_per_call` decode steps in one model call, with the same results as one at a time
(`_decode_steps`; docs/design.md, "Several decode steps per call"). A request's n samples run its
prompt once: the others fork from the first when its prompt is computed (Scheduler.fork) and draw
their first tokens from its logits. K/V live in a paged cache with a fixed number of blocks; when
it is full the newest running sequence is preempted and later recomputed, which under invariant
numerics gives back the same bits.

Weight updates (`update_weights`) land between steps. In-flight requests are kept; by default
their cached K/V are recomputed with the new weights, so that every token's behaviour logprob is
exactly what the trainer computes at that token's version (`recompute_on_update=False` keeps the
stale cache, as most stacks do, at the cost of a nonzero kernel-mismatch term).
"""

from __future__ import annotations

import copy
import itertools
import threading
from collections.abc import Iterable
from pathlib import Path

import torch

from rzero.engine import sampler
from rzero.engine.scheduler import Scheduler
from rzero.engine.sequence import RequestOutput, SamplingParams, Sequence, Status, StepOutput, cut_at_stop
from rzero.model.io import load_model, parse_dtype
from rzero.model.qwen3 import Qwen3ForCausalLM
from rzero.ops import ATTN_BLOCK, AttentionMeta, DecodeBatch, Numerics, numerics as numerics_of, resolve_device

Prompt = str | list[int]


class Engine:
    """`model`: a model directory, or a model object (the engine takes its own copy). `numerics`:
    the ops its forward passes and sampler run ("invariant" or "standard"), held by its own model
    copy, so engines of different modes can share a process. `device`: where the model, its paged
    KV cache and the sampler run ("cpu", "cuda", "auto"; default: the given model's device).
    `decode_steps_per_call`: the most decode steps one model call may run (1: one per call)."""

    def __init__(
        self,
        model: str | Path | Qwen3ForCausalLM,
        *,
        numerics: str | Numerics = "invariant",
        dtype: str | torch.dtype = "fp32",
        device: str | torch.device | None = None,
        tokenizer=None,
        kv_cache_bytes: int = 256 * 1024**2,
        num_kv_blocks: int | None = None,
        max_num_batched_tokens: int = 2048,
        max_num_seqs: int = 256,
        max_model_len: int | None = None,
        eos_token_ids: Iterable[int] | None = None,
        recompute_on_update: bool = True,
        seed: int = 0,
        version: int = 0,
        decode_steps_per_call: int = 16,
    ):
        self.numerics = numerics_of(numerics)
        requested = None if device is None else resolve_device(device)  # fails before any loading
        if isinstance(model, (str, Path)):
            from rzero.model.tokenizer import load_tokenizer

            tokenizer = tokenizer if tokenizer is not None else load_tokenizer(model)
            model = load_model(model, dtype)
        else:
            # Copy: nn.Module.to() works in place, so casting the caller's model would turn the
            # trainer's fp32 weights into bf16, and sharing parameters would let the trainer's
            # optimizer change the engine's weights mid-generation without a new version.
            model = copy.deepcopy(model).to(parse_dtype(dtype))
        # None: where the given model is (the CPU for a model directory); never a silent move.
        self.device = model.device if requested is None else requested
        model = model.to(self.device)  # a copy already (loaded or deep-copied above)
        model.numerics = self.numerics  # this engine's own copy: other engines keep their mode
        model.pack_weights()  # fused q/k/v and gate/up GEMMs, same bits (after the cast: it keeps the layout)
        self.model = model.eval()
        self.tokenizer = tokenizer
        config = model.config
        self.max_model_len = min(max_model_len or config.max_position_embeddings, config.max_position_embeddings)
        if num_kv_blocks is None:
            per_block = 2 * config.num_hidden_layers * ATTN_BLOCK * config.num_key_value_heads * config.head_dim
            num_kv_blocks = kv_cache_bytes // (per_block * torch.finfo(model.dtype).bits // 8)
        self.scheduler = Scheduler(num_kv_blocks, max_num_batched_tokens, max_num_seqs)
        self.blocks = self.scheduler.blocks
        self._cache_tokens = self.blocks.num_blocks * self.blocks.block_size  # the whole cache's K/V rows
        self.kv_caches = model.new_kv_caches(num_kv_blocks)
        self.max_num_seqs = max_num_seqs
        # Read when a request is added (each sequence keeps its own stop ids).
        self.eos_token_ids = set(eos_token_ids if eos_token_ids is not None else self._tokenizer_eos())
        self.recompute_on_update = recompute_on_update
        if decode_steps_per_call < 1:
            raise ValueError(f"decode_steps_per_call must be >= 1, got {decode_steps_per_call}")
        # Several decode steps in one model call: where the model has it (invariant numerics on the
        # CPU, dense layers); turned off for good the first time the model says it has not.
        self.decode_steps_per_call = decode_steps_per_call
        self._several_steps = decode_steps_per_call > 1 and self.device.type == "cpu"
        self.seed = seed
        self.version = version
        self.sequences: dict[str, Sequence] = {}
        self._request_ids = itertools.count()
        self._lock = threading.RLock()

    # The scheduler's queues, read by callers that watch the engine (tests, the HTTP server).
    @property
    def waiting(self):
        return self.scheduler.waiting

    @property
    def running(self) -> list[Sequence]:
        return self.scheduler.running

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions

    # ----------------------------------------------------------------- requests

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None) -> list[str]:
        """Queue a prompt; returns the ids of its params.n samples (`id` alone when n == 1).

        Bad input raises ValueError here, before anything is queued; other requests go on.
        """
        params = params or SamplingParams()
        tokens = self.validate_prompt(prompt)
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need an engine with a tokenizer")
        with self._lock:
            number = next(self._request_ids)
            base = request_id if request_id is not None else f"req-{number}"
            ids = [base] if params.n == 1 else [f"{base}/{i}" for i in range(params.n)]
            if any(i in self.sequences for i in ids):
                raise ValueError(f"request id {base!r} is already in use")
            first = None
            for i, rid in enumerate(ids):
                seed = params.seed if params.seed is not None else self.seed * 1_000_003 + number
                seq = Sequence(rid, tokens, params, sampler.sample_generator(seed, i))
                seq.stop_ids = self._stop_ids(params)
                seq.length_limit = self._length_limit(len(tokens), params)
                # Group members wait until the first has computed the prompt, then fork from it.
                seq.wait_for = first
                if first is None:
                    first = seq
                else:
                    first.followers.append(seq)
                self.sequences[rid] = seq
                self.scheduler.add(seq)
        return ids

    def validate_prompt(self, prompt: Prompt) -> list[int]:
        """The prompt's token ids; ValueError if it cannot be served (empty, unknown ids, too long)."""
        tokens = self._tokenize(prompt)
        if not tokens:
            raise ValueError("empty prompt: a request needs at least one token")
        vocab = self.model.config.vocab_size
        bad = [t for t in tokens if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary (size {vocab})")
        if len(tokens) >= self.max_model_len:
            raise ValueError(
                f"prompt of {len(tokens)} tokens does not fit the context: max_model_len is {self.max_model_len} "
                "and at least one token must be generated"
            )
        if self.blocks.blocks_for(len(tokens) + 1) > self.blocks.num_blocks:
            raise ValueError(f"prompt of {len(tokens)} tokens needs more KV-cache blocks than the engine has")
        return tokens

    def abort(self, request_id: str) -> None:
        with self._lock:
            seq = self.sequences.get(request_id)
            if seq is None or seq.status == Status.FINISHED:
                return
            self._finish(seq, "abort")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def num_unfinished(self) -> int:
        """Sequences queued or running (each of a request's n samples counts)."""
        return self.scheduler.num_unfinished()

    def get_output(self, request_id: str) -> RequestOutput:
        return self.sequences[request_id].output()

    def pop_output(self, request_id: str) -> RequestOutput:
        """Return a finished request's output and forget it."""
        with self._lock:
            seq = self.sequences[request_id]
            if seq.status != Status.FINISHED:
                raise ValueError(f"request {request_id!r} has not finished")
            del self.sequences[request_id]
            return seq.output()

    def generate(self, prompts: Prompt | list[Prompt], params: SamplingParams | None = None) -> list[RequestOutput]:
        """Run prompts to completion; outputs in prompt order (n per prompt, consecutive)."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        ids = [rid for p in prompts for rid in self.add_request(p, params)]
        while any(self.sequences[i].status != Status.FINISHED for i in ids):
            self.step()
        return [self.pop_output(i) for i in ids]

    # ------------------------------------------------------------------ weights

    def update_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Load new weights (cast to the engine dtype) between steps and stamp them `version`."""
        params = dict(self.model.named_parameters())
        tied = self.model.config.tie_word_embeddings
        updates = {}
        for name, tensor in state_dict.items():
            if tied and name == "lm_head.weight":
                continue
            if name not in params:
                raise ValueError(f"update_weights: unknown parameter {name!r}")
            if tuple(tensor.shape) != tuple(params[name].shape):
                raise ValueError(
                    f"update_weights: {name} has shape {tuple(tensor.shape)}, expected {tuple(params[name].shape)}"
                )
            updates[name] = tensor
        with self._lock, torch.no_grad():
            for name, tensor in updates.items():
                params[name].copy_(tensor.to(self.model.dtype))
            self.version = version
            if self.recompute_on_update:
                self.scheduler.recompute_all()

    # --------------------------------------------------------------------- step

    @torch.inference_mode()
    def step(self) -> list[StepOutput]:
        """Run one forward pass and sample, or several decode steps in one call (`_decode_steps`);
        returns the tokens sampled, in step order (a sequence's tokens in its order)."""
        with self._lock:
            batch = self.scheduler.schedule()
            if not batch:
                return []
            outputs = self._decode_steps(batch) if self._several_steps else None
            if outputs is not None:
                return outputs
            ids, logit_rows, samplers, prompt_rows, prompt_positions = [], [], [], [], []
            for seq, n in batch:
                start, done = len(ids), seq.num_computed
                ids.extend(seq.token_ids[done : done + n])
                if seq.prompt_logprobs is not None:
                    last = min(done + n, seq.num_prompt_tokens - 1)
                    prompt_positions.extend((seq, p) for p in range(done, last))
                    prompt_rows.extend(start + p - done for p in range(done, last))
                if done + n == len(seq.token_ids):
                    logit_rows.append(start + n - 1)
                    samplers.append(seq)
            meta = AttentionMeta.build(
                [n for _, n in batch],
                [s.num_computed for s, _ in batch],
                [s.block_table for s, _ in batch],
                row_tile=self.numerics.row_tile,
            )
            hidden = self.model(torch.tensor(ids, dtype=torch.long), meta, self.kv_caches)
            for seq, n in batch:
                self.scheduler.computed(seq, n)
            if prompt_rows:
                sampler.score_prompt(self.numerics, prompt_positions, self.model.logits(hidden[prompt_rows]))
            every_row = len(logit_rows) == len(ids)  # each row is a sequence's last token (rows ascend)
            copies: list[tuple[int, int]] = []  # (leader's block, follower's private block)
            for row, seq in zip(list(logit_rows), list(samplers)):
                if seq.followers and len(seq) == seq.num_prompt_tokens:  # a group's prompt, just computed
                    for follower in self._fork(seq, copies):
                        logit_rows.append(row)
                        samplers.append(follower)
            if copies:
                self._copy_partial_blocks(copies)
            if not samplers:
                return []
            # A plain decode step samples from every row, in order: no gather.
            logits = self.model.logits(hidden if every_row and len(logit_rows) == len(ids) else hidden[logit_rows])
            return [self._append(*sampled) for sampled in sampler.sample(self.numerics, samplers, logits)]

    def _decode_steps(self, batch: list[tuple[Sequence, int]]) -> list[StepOutput] | None:
        """Up to decode_steps_per_call decode steps of the batch in one model call (Model.decode_steps),
        where they give what the steps one by one give: every sequence decodes (one token, its last)
        and samples plainly (a temperature; no greedy, top-k, top-p, stop strings or top logprobs),
        and no request waits to be admitted, so each step's batch is the running sequences that have
        not ended. None: the caller runs one step."""
        if self.scheduler.waiting:
            return None
        steps = self.decode_steps_per_call
        for seq, n in batch:
            transform = seq.transform
            if (n != 1 or seq.num_computed + 1 != len(seq) or transform.temperature <= 0 or transform.top_k
                    or transform.top_p < 1 or seq.params.stop or seq.top_logprobs is not None):
                return None
        seqs = [seq for seq, _ in batch]
        limits = [min(steps, seq.length_limit - len(seq)) for seq in seqs]
        if max(limits) < 2 or not all(self.scheduler.reserve(seq, seq.num_computed + k) for seq, k in zip(seqs, limits)):
            return None
        uniforms = [[seq.uniforms.next() for _ in range(steps)] for seq in seqs]  # each sequence's own draws
        result = self.model.decode_steps(DecodeBatch.build(
            [seq.token_ids[-1] for seq in seqs], [seq.num_computed for seq in seqs], limits,
            [seq.stop_ids for seq in seqs], [seq.block_table for seq in seqs],
            [seq.transform.temperature for seq in seqs], uniforms,
        ), self.kv_caches)
        if result is None:
            for seq, drawn in zip(seqs, uniforms):
                seq.uniforms.give_back(drawn)  # the steps one by one draw them
            self._several_steps = False
            return None
        tokens, logprobs, counts = result[0].t().tolist(), result[1].t().tolist(), result[2].tolist()
        by_step: list[list[StepOutput]] = [[] for _ in range(steps)]
        for seq, row, row_logprobs, count, drawn in zip(seqs, tokens, logprobs, counts, uniforms):
            for k in range(count):  # as the steps one by one: the input's K/V in the cache, then the token
                self.scheduler.computed(seq, 1)
                by_step[k].append(self._append(seq, row[k], row_logprobs[k], None))
            seq.uniforms.give_back(drawn[count:])  # drawn for steps it did not run
        return [out for outputs in by_step for out in outputs]

    def _fork(self, leader: Sequence, copies: list[tuple[int, int]]) -> list[Sequence]:
        """The leader's samples that start now from its computed prompt (Scheduler.fork). The K/V
        rows of its partial last prompt block go to each one's private block: appended to
        `copies` as (leader's block, private block), copied for all the step's groups at once."""
        forked = self.scheduler.fork(leader)
        leader.followers = []
        if leader.num_prompt_tokens % ATTN_BLOCK:
            last = leader.block_table[leader.num_prompt_tokens // ATTN_BLOCK]
            copies.extend((last, private) for _, private in forked if private is not None)
        return [seq for seq, _ in forked]

    def _copy_partial_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy whole cache blocks (source, destination) in every layer's K and V: a private block's
        rows past the prompt are written by the follower's own tokens before anything reads them."""
        source = torch.tensor([s for s, _ in copies], device=self.device)
        dest = torch.tensor([d for _, d in copies], device=self.device)
        for cache in self.kv_caches:
            for part in cache:
                part.index_copy_(0, dest, part.index_select(0, source))

    def _append(
        self, seq: Sequence, token: int, logprob: float, top_logprobs: list[tuple[int, float]] | None
    ) -> StepOutput:
        seq.token_ids.append(token)
        seq.logprobs.append(logprob)
        if seq.top_logprobs is not None:
            seq.top_logprobs.append(top_logprobs)
        seq.versions.append(self.version)
        reason = None
        if token in seq.stop_ids:
            reason = "stop"
        elif seq.params.stop and self._hit_stop_string(seq):
            reason = "stop"
        elif len(seq.token_ids) >= seq.length_limit:
            reason = "length"
        if reason is not None:
            self._finish(seq, reason)
        return StepOutput(seq.request_id, token, logprob, self.version, reason is not None, reason, top_logprobs)

    def _stop_ids(self, params: SamplingParams) -> frozenset[int]:
        """The token ids that end a sample of these params (its stop ids, and EOS unless ignored)."""
        return frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else frozenset(self.eos_token_ids))

    def _length_limit(self, prompt_tokens: int, params: SamplingParams) -> int:
        """The sequence length at which a sample ends for "length": max_tokens outputs, the context
        (max_model_len), or one token more than the whole cache holds (the next step would need K/V
        for all of them, so it could never be scheduled again and step() would return [] forever)."""
        return min(prompt_tokens + params.max_tokens, self.max_model_len, self._cache_tokens + 1)

    def _hit_stop_string(self, seq: Sequence) -> bool:
        text = self.tokenizer.decode(seq.output_ids, skip_special_tokens=False)
        cut = cut_at_stop(text, seq.params.stop)
        if len(cut) == len(text):
            return False
        seq.text = cut
        return True

    def _finish(self, seq: Sequence, reason: str) -> None:
        self.scheduler.finish(seq)
        seq.finish_reason = reason
        if seq.text is None and self.tokenizer is not None:
            seq.text = self.tokenizer.decode(seq.output_ids, skip_special_tokens=True)

    # ------------------------------------------------------------------ helpers

    def _tokenize(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("text prompts need an engine with a tokenizer; pass token ids instead")
            return self.tokenizer.encode(prompt, add_special_tokens=False).ids
        return [int(t) for t in prompt]

    def _tokenizer_eos(self) -> list[int]:
        if self.tokenizer is None:
            return []
        ids = [self.tokenizer.token_to_id(t) for t in ("<|im_end|>", "<|endoftext|>")]
        return [i for i in ids if i is not None]

