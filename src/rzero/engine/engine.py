"""A continuous-batching inference engine over the same model code the trainer runs.

Each `step()` runs one forward pass over a flat batch that mixes decode tokens of running requests
with prompt chunks of new ones (chunked prefill, under a token budget), then samples one token for
every sequence whose tokens are all in the cache. Requests join and leave at any step. K/V live in
a paged cache with a fixed number of blocks; when it is full the newest running sequence is
preempted and later recomputed, which under invariant numerics gives back the same bits.

Weight updates (`update_weights`) land between steps. In-flight requests are kept; by default
their cached K/V are recomputed with the new weights, so that every token's behaviour logprob is
exactly what the trainer computes at that token's version (`recompute_on_update=False` keeps the
stale cache, as most stacks do, at the cost of a nonzero kernel-mismatch term).
"""

from __future__ import annotations

import copy
import itertools
import threading
from collections import deque
from collections.abc import Iterable
from pathlib import Path

import torch

from rzero.engine.block_manager import BlockManager, block_hash
from rzero.engine.sequence import RequestOutput, SamplingParams, Sequence, Status, StepOutput
from rzero.model.io import load_model, parse_dtype
from rzero.model.qwen3 import Qwen3ForCausalLM
from rzero.ops import ATTN_BLOCK, AttentionMeta, Numerics, numerics as numerics_of

Prompt = str | list[int]


class Engine:
    def __init__(
        self,
        model: str | Path | Qwen3ForCausalLM,
        *,
        numerics: str | Numerics = "invariant",
        dtype: str | torch.dtype = "fp32",
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
    ):
        self.numerics = numerics_of(numerics)
        if isinstance(model, (str, Path)):
            from rzero.model.tokenizer import load_tokenizer

            tokenizer = tokenizer if tokenizer is not None else load_tokenizer(model)
            model = load_model(model, dtype)
        else:
            # Copy: nn.Module.to() works in place, so casting the caller's model would turn the
            # trainer's fp32 weights into bf16, and sharing parameters would let the trainer's
            # optimizer change the engine's weights mid-generation without a new version.
            model = copy.deepcopy(model).to(parse_dtype(dtype))
        model.numerics = self.numerics  # this engine's own copy: other engines keep their mode
        self.model = model.eval()
        self.tokenizer = tokenizer
        config = model.config
        self.max_model_len = min(max_model_len or config.max_position_embeddings, config.max_position_embeddings)
        if num_kv_blocks is None:
            per_block = 2 * config.num_hidden_layers * ATTN_BLOCK * config.num_key_value_heads * config.head_dim
            num_kv_blocks = kv_cache_bytes // (per_block * torch.finfo(model.dtype).bits // 8)
        self.blocks = BlockManager(num_kv_blocks, ATTN_BLOCK)
        self.kv_caches = model.new_kv_caches(num_kv_blocks)
        # Zero would schedule nothing, ever: every step() returns [] and generate() never ends.
        if max_num_batched_tokens < 1 or max_num_seqs < 1:
            raise ValueError(
                f"max_num_batched_tokens ({max_num_batched_tokens}) and max_num_seqs ({max_num_seqs}) must be >= 1"
            )
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.eos_token_ids = set(eos_token_ids if eos_token_ids is not None else self._tokenizer_eos())
        self.recompute_on_update = recompute_on_update
        self.seed = seed
        self.version = version
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.sequences: dict[str, Sequence] = {}
        self._arrivals = itertools.count()
        self._request_ids = itertools.count()
        self._lock = threading.RLock()
        self.num_preemptions = 0

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
                gen = torch.Generator().manual_seed(seed * 1009 + i)
                seq = Sequence(rid, tokens, params, gen, next(self._arrivals))
                # Group members wait until the first has computed the prompt, then reuse its blocks.
                seq.wait_for = first
                first = first or seq
                self.sequences[rid] = seq
                self.waiting.append(seq)
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
            if seq in self.waiting:
                self.waiting.remove(seq)
            self._finish(seq, "abort")

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def num_unfinished(self) -> int:
        """Sequences queued or running (each of a request's n samples counts)."""
        return len(self.waiting) + len(self.running)

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
                self.blocks.reset_prefix_cache()
                for seq in reversed(list(self.running)):
                    self._preempt(seq)

    # --------------------------------------------------------------- scheduling

    def _schedule(self) -> list[tuple[Sequence, int]]:
        budget = self.max_num_batched_tokens
        batch: list[tuple[Sequence, int]] = []
        for seq in list(self.running):
            if seq.status != Status.RUNNING or budget == 0:
                continue
            n = min(len(seq) - seq.num_computed, budget)
            while not self._reserve(seq, seq.num_computed + n):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            if seq.status == Status.RUNNING:
                batch.append((seq, n))
                budget -= n
        skipped = []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting.popleft()
            leader = seq.wait_for
            if leader is not None and leader.status != Status.FINISHED and leader.num_computed < leader.num_prompt_tokens:
                skipped.append(seq)
                continue
            if not seq.block_table:
                # Reuse cached full blocks, always leaving the last token to compute (it gives the logits).
                for block in self.blocks.match_prefix(seq.token_ids, len(seq) - 1):
                    self.blocks.retain(block)
                    seq.block_table.append(block)
                seq.num_computed = len(seq.block_table) * ATTN_BLOCK
                seq.block_hashes = [self.blocks.hash_of[b] for b in seq.block_table]
            n = min(len(seq) - seq.num_computed, budget)
            if not self._reserve(seq, seq.num_computed + n):
                self._release(seq)
                self.waiting.appendleft(seq)
                break
            seq.status = Status.RUNNING
            self.running.append(seq)
            batch.append((seq, n))
            budget -= n
        self.waiting.extendleft(reversed(skipped))
        return batch

    def _reserve(self, seq: Sequence, num_tokens: int) -> bool:
        needed = self.blocks.blocks_for(num_tokens) - len(seq.block_table)
        if needed > self.blocks.num_free:
            return False
        seq.block_table.extend(self.blocks.allocate() for _ in range(needed))
        return True

    def _release(self, seq: Sequence) -> None:
        self.blocks.release(seq.block_table)
        seq.block_table, seq.block_hashes, seq.num_computed = [], [], 0

    def _preempt(self, seq: Sequence) -> None:
        """Free a running sequence's cache; it is recomputed (prompt and outputs) when rescheduled."""
        self._release(seq)
        self.running.remove(seq)
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    # --------------------------------------------------------------------- step

    @torch.inference_mode()
    def step(self) -> list[StepOutput]:
        """Run one forward pass and sample; returns the tokens sampled in this step."""
        with self._lock:
            batch = self._schedule()
            if not batch:
                return []
            ids, logit_rows, samplers, prompt_rows = [], [], [], []
            for seq, n in batch:
                start = len(ids)
                ids.extend(seq.token_ids[seq.num_computed : seq.num_computed + n])
                if seq.prompt_logprobs is not None:
                    last = min(seq.num_computed + n, seq.num_prompt_tokens - 1)
                    prompt_rows.extend((seq, p, start + p - seq.num_computed) for p in range(seq.num_computed, last))
                if seq.num_computed + n == len(seq):
                    logit_rows.append(len(ids) - 1)
                    samplers.append(seq)
            meta = AttentionMeta.build(
                [n for _, n in batch],
                [s.num_computed for s, _ in batch],
                [s.block_table for s, _ in batch],
                row_tile=self.numerics.row_tile,
            )
            hidden = self.model(torch.tensor(ids, dtype=torch.long), meta, self.kv_caches)
            for seq, n in batch:
                seq.num_computed += n
                self._register_full_blocks(seq)
            if prompt_rows:
                self._score_prompt(prompt_rows, hidden)
            if not samplers:
                return []
            logits = self.model.logits(hidden[logit_rows])
            return [self._append(seq, *sampled) for seq, *sampled in self._sample(samplers, logits)]

    def _register_full_blocks(self, seq: Sequence) -> None:
        for i in range(len(seq.block_hashes), seq.num_computed // ATTN_BLOCK):
            previous = seq.block_hashes[-1] if seq.block_hashes else None
            h = block_hash(previous, seq.token_ids[i * ATTN_BLOCK : (i + 1) * ATTN_BLOCK])
            self.blocks.register(seq.block_table[i], h)
            seq.block_hashes.append(h)

    def _score_prompt(self, rows: list[tuple[Sequence, int, int]], hidden: torch.Tensor) -> None:
        """Record logprobs of prompt tokens computed in this step (SamplingParams.prompt_logprobs)."""
        logits = self.model.logits(hidden[[r for _, _, r in rows]])
        by_sequence: dict[int, list[int]] = {}
        for i, (seq, _, _) in enumerate(rows):
            by_sequence.setdefault(id(seq), []).append(i)
        for idx in by_sequence.values():  # one transform per sequence: score its rows together
            seq = rows[idx[0]][0]
            positions = [rows[i][1] for i in idx]
            targets = torch.tensor([seq.token_ids[p + 1] for p in positions])
            lp = self.numerics.transformed_logprobs(logits[idx], seq.transform).gather(1, targets[:, None])[:, 0]
            for p, value in zip(positions, lp.tolist()):
                seq.prompt_logprobs[p] = value

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor):
        tokens = torch.empty(len(seqs), dtype=torch.long)
        logprobs = torch.empty(len(seqs))
        groups: dict = {}
        for row, seq in enumerate(seqs):
            groups.setdefault(seq.transform, []).append(row)
        if len(groups) == 1:
            # The usual case (one transform for the whole batch): no row gathers or scatters.
            (transform,) = groups
            lp = self.numerics.transformed_logprobs(logits, transform)
            chosen = self.numerics.sample_tokens(lp, [transform.temperature == 0] * len(seqs), [s.generator for s in seqs])
            return zip(seqs, chosen.tolist(), lp.gather(1, chosen[:, None])[:, 0].tolist(), _top_logprobs(seqs, lp))
        top: list[list[tuple[int, float]] | None] = [None] * len(seqs)
        for transform, rows in groups.items():
            lp = self.numerics.transformed_logprobs(logits[rows], transform)
            greedy = [transform.temperature == 0] * len(rows)
            chosen = self.numerics.sample_tokens(lp, greedy, [seqs[r].generator for r in rows])
            tokens[rows] = chosen
            logprobs[rows] = lp.gather(1, chosen[:, None])[:, 0]
            for r, alternatives in zip(rows, _top_logprobs([seqs[r] for r in rows], lp)):
                top[r] = alternatives
        return zip(seqs, tokens.tolist(), logprobs.tolist(), top)

    def _append(
        self, seq: Sequence, token: int, logprob: float, top_logprobs: list[tuple[int, float]] | None
    ) -> StepOutput:
        seq.token_ids.append(token)
        seq.logprobs.append(logprob)
        if seq.top_logprobs is not None:
            seq.top_logprobs.append(top_logprobs)
        seq.versions.append(self.version)
        params, reason = seq.params, None
        if token in params.stop_token_ids or (token in self.eos_token_ids and not params.ignore_eos):
            reason = "stop"
        elif params.stop and self._hit_stop_string(seq):
            reason = "stop"
        elif (
            len(seq.output_ids) >= params.max_tokens
            or len(seq) >= self.max_model_len
            # The next step would need K/V for len(seq) tokens: more than the whole cache holds, so
            # the sequence could never be scheduled again (step() would return [] forever).
            or self.blocks.blocks_for(len(seq)) > self.blocks.num_blocks
        ):
            reason = "length"
        if reason is not None:
            self._finish(seq, reason)
        return StepOutput(seq.request_id, token, logprob, self.version, reason is not None, reason, top_logprobs)

    def _hit_stop_string(self, seq: Sequence) -> bool:
        text = self.tokenizer.decode(seq.output_ids, skip_special_tokens=False)
        hits = [text.find(s) for s in seq.params.stop if s in text]
        if not hits:
            return False
        seq.text = text[: min(hits)]
        return True

    def _finish(self, seq: Sequence, reason: str) -> None:
        if seq.status == Status.RUNNING:
            self.running.remove(seq)
        self._release(seq)
        seq.status = Status.FINISHED
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


def _top_logprobs(seqs: list[Sequence], logprobs: torch.Tensor) -> list[list[tuple[int, float]] | None]:
    """Each row's `params.top_logprobs` most likely tokens (None for rows that ask for none).

    They are read off the sampled distribution's logprobs, so they change nothing else. A stable sort
    of the row alone gives ties to the lower id, whatever the batch; tokens the sampling transform
    truncated away (logprob -inf) are not among the alternatives.
    """
    top: list[list[tuple[int, float]] | None] = []
    for row, seq in enumerate(seqs):
        k = seq.params.top_logprobs
        if not k:
            top.append(None)
            continue
        values, ids = torch.sort(logprobs[row], descending=True, stable=True)
        top.append([(i, v) for i, v in zip(ids[:k].tolist(), values[:k].tolist()) if v > float("-inf")])
    return top
