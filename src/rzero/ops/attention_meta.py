"""Where each query token sits: which sequence, which position, which KV-cache blocks.

Built once per forward pass and shared by every layer. The trainer (whole sequences, no cache)
and the engine (prefill, decode and chunked prefill against a paged cache) describe their batches
with the same structure, so both reach the same attention kernel.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass, fields, replace

import numpy as np
import torch

# Keys are reduced in blocks of ATTN_BLOCK positions aligned at position 0; the paged KV cache
# uses the same block size, so a cache block is exactly one attention block.
ATTN_BLOCK = 16
# Query slots per sequence are padded to a multiple of this. The CPU attention pads further where
# its score GEMM needs more rows for fixed bits (`invariant_attention.score_rows`: 8 at head_dim 128).
Q_TILE = 4


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _padded_tables(block_tables: list[list[int]], lengths: np.ndarray) -> np.ndarray:
    """Each table left-aligned in its row of an int64 array, zero after it: one fill from the
    flattened tables (`lengths`: each table's length)."""
    tables = np.zeros((len(block_tables), int(lengths.max())), dtype=np.int64)
    tables[np.arange(tables.shape[1]) < lengths[:, None]] = np.fromiter(
        itertools.chain.from_iterable(block_tables), dtype=np.int64, count=int(lengths.sum()))
    return tables


@dataclass
class AttentionMeta:
    num_tokens: int  # T: real query tokens in the flat batch
    padded_tokens: int  # rows the model runs (T rounded up to the numerics' row tile)
    q_lens: list[int]  # query tokens per sequence, in flat order
    ctx_lens: list[int]  # tokens already cached before each sequence's queries
    block_tables: torch.Tensor  # (B, n_blocks) cache block ids per sequence (padded with 0)
    slot_mapping: torch.Tensor  # (T,) cache slot (block * ATTN_BLOCK + offset) of each query token
    q_index: torch.Tensor  # (B, Mq) flat row of each padded query (padding repeats row 0)
    q_positions: torch.Tensor  # (B, Mq) absolute position of each padded query (0 for padding)
    kv_lens: torch.Tensor  # (B,) keys visible to the sequence: ctx_len + q_len
    out_index: torch.Tensor  # (padded_tokens,) row of each token in the (B * Mq) attention output
    num_blocks: int  # cache blocks referenced (the trainer allocates this many)
    token_seq: torch.Tensor  # (T,) sequence of each real token
    # (padded_tokens,) absolute position of every token in flat order (padding rows repeat the first's)
    positions: torch.Tensor
    max_position: int  # the largest of positions (the model checks it against its rotary table)
    # Trainer caches built from a shared prompt (`for_shared_prompts`): more cache slots that hold a
    # copy of some token's K/V (slot copy_slots[i] gets row copy_rows[i]). None: none.
    copy_slots: torch.Tensor | None = None
    copy_rows: torch.Tensor | None = None

    @property
    def device(self) -> torch.device:
        return self.block_tables.device

    def to(self, device: torch.device | str) -> AttentionMeta:
        """The same meta with its index tensors on `device` (itself if they are already there).
        Built on the CPU from Python lists; the model moves it to its own device once per pass."""
        if self.device == torch.device(device):
            return self
        moved = {f.name: getattr(self, f.name).to(device) for f in fields(self) if isinstance(getattr(self, f.name), torch.Tensor)}
        return replace(self, **moved)

    @property
    def is_decode(self) -> bool:
        return all(n == 1 for n in self.q_lens)

    @classmethod
    def build(cls, q_lens: list[int], ctx_lens: list[int], block_tables: list[list[int]], *, row_tile: int) -> AttentionMeta:
        """`row_tile`: the model's rows are padded to a multiple of it (`Numerics.row_tile`)."""
        num_seqs = len(q_lens)
        if not (num_seqs == len(ctx_lens) == len(block_tables)):
            raise ValueError("q_lens, ctx_lens and block_tables must describe the same sequences")
        # The engine builds this every step: the per-token indices in a handful of whole-batch
        # numpy ops (~1 us each, where a small torch op's dispatch costs ~5 us and torch.tensor
        # on a Python list ~55 ns per element), handed to torch without a copy.
        q = np.array(q_lens, dtype=np.int64)
        ctx = np.array(ctx_lens, dtype=np.int64)
        lengths = np.fromiter(map(len, block_tables), dtype=np.int64, count=num_seqs)
        bad = np.flatnonzero((q <= 0) | (lengths * ATTN_BLOCK < ctx + q))
        if bad.size:
            i = int(bad[0])
            if q_lens[i] <= 0:
                raise ValueError(f"sequence {i} has no query tokens")
            raise ValueError(f"sequence {i}: {len(block_tables[i])} blocks cannot hold {ctx_lens[i] + q_lens[i]} tokens")
        total = int(q.sum())
        max_q = _round_up(int(q.max()), Q_TILE)
        tables = _padded_tables(block_tables, lengths)
        if total == num_seqs:  # one query token per sequence (a decode step): the indices are ranges
            seq, offset, pos = np.arange(num_seqs), np.zeros(num_seqs, dtype=np.int64), ctx
        else:
            seq = np.repeat(np.arange(num_seqs), q)  # (T,) sequence of each token
            offset = np.arange(total) - (np.cumsum(q) - q)[seq]  # (T,) index of each token within its sequence
            pos = ctx[seq] + offset  # (T,) absolute position of each token
        q_index = np.zeros((num_seqs, max_q), dtype=np.int64)
        q_positions = np.zeros((num_seqs, max_q), dtype=np.int64)
        q_index[seq, offset] = np.arange(total)
        q_positions[seq, offset] = pos
        padded = _round_up(total, row_tile)
        # Padding rows read the output of sequence 0's first query and its position: finite, never used.
        out_index = np.concatenate((seq * max_q + offset, np.zeros(padded - total, dtype=np.int64)))
        positions = np.concatenate((pos, np.full(padded - total, pos[0], dtype=np.int64)))
        slots = tables[seq, pos // ATTN_BLOCK] * ATTN_BLOCK + pos % ATTN_BLOCK
        return cls(
            num_tokens=total,
            padded_tokens=padded,
            q_lens=list(q_lens),
            ctx_lens=list(ctx_lens),
            block_tables=torch.from_numpy(tables),
            slot_mapping=torch.from_numpy(slots),
            q_index=torch.from_numpy(q_index),
            q_positions=torch.from_numpy(q_positions),
            kv_lens=torch.from_numpy(ctx + q),
            out_index=torch.from_numpy(out_index),
            num_blocks=int(tables.max()) + 1,
            token_seq=torch.from_numpy(seq),
            positions=torch.from_numpy(positions),
            max_position=int(pos.max()),
        )

    @classmethod
    def for_sequences(cls, lengths: list[int], *, row_tile: int) -> tuple[AttentionMeta, int]:
        """Whole sequences with no prior cache (the trainer): consecutive private blocks.

        Returns the meta and the number of cache blocks the forward pass must allocate.
        """
        tables, next_block = [], 0
        for n in lengths:
            count = _round_up(n, ATTN_BLOCK) // ATTN_BLOCK
            tables.append(list(range(next_block, next_block + count)))
            next_block += count
        return cls.build(list(lengths), [0] * len(lengths), tables, row_tile=row_tile), next_block

    @classmethod
    def for_shared_prompts(cls, groups: list[tuple[int, list[int]]], *, row_tile: int) -> AttentionMeta:
        """Whole sequences that share prompts (the trainer scoring a GRPO group): each group is
        (prompt length P, completion lengths), and its tokens come in flat order as the prompt once,
        then every completion. The prompt runs once; each completion is a sequence of its own
        whose first P keys are the prompt's, as in the engine's prefix cache: full prompt blocks
        are shared, and the partial last one is copied into each completion's first private block
        (`copy_slots`). Every query sees the same keys at the same positions as when its sequence
        runs whole, so invariant numerics give the same bits, for about 1/n of the prompt's work.
        A completion of length 0 adds no sequence."""
        q_lens, ctx_lens, tables, copy_slots, copy_rows = [], [], [], [], []
        next_block = next_row = 0
        for prompt_len, completions in groups:
            if prompt_len <= 0 or not completions:
                raise ValueError("a shared prompt needs at least one token and one completion")
            shared = prompt_len // ATTN_BLOCK  # whole prompt blocks, shared by every completion
            partial = range(next_row + shared * ATTN_BLOCK, next_row + prompt_len)  # rows of the rest
            first = None
            for i, n in enumerate(completions):
                if i > 0 and n == 0:
                    continue
                own = _round_up(prompt_len + n, ATTN_BLOCK) // ATTN_BLOCK - (shared if first else 0)
                table = (first[:shared] if first else []) + list(range(next_block, next_block + own))
                if first is None:  # the prompt's own sequence: prompt + first completion
                    first = table
                    q_lens.append(prompt_len + n)
                    ctx_lens.append(0)
                else:
                    q_lens.append(n)
                    ctx_lens.append(prompt_len)
                    copy_slots.extend(next_block * ATTN_BLOCK + j for j in range(len(partial)))
                    copy_rows.extend(partial)
                tables.append(table)
                next_block += own
            next_row += prompt_len + sum(completions)
        meta = cls.build(q_lens, ctx_lens, tables, row_tile=row_tile)
        if copy_slots:
            meta.copy_slots = torch.tensor(copy_slots, dtype=torch.long)
            meta.copy_rows = torch.tensor(copy_rows, dtype=torch.long)
        return meta


@dataclass
class DecodeBatch:
    """Several decode steps of B sequences in one call (`Numerics.decode_steps`). Row b: its last
    token ids[b] at position context[b] (the first step's input), its cache blocks in row b of
    block_tables (enough for limit[b] more tokens), at most limit[b] tokens drawn, the last of them
    one of its stop ids (stop_ids[stop_start[b]:stop_start[b + 1]]) if one is drawn; sampled at
    temperature[b], with uniform[k, b] at step k. Built on the CPU."""

    ids: torch.Tensor  # (B,) int64
    context: torch.Tensor  # (B,) int64
    limit: torch.Tensor  # (B,) int64
    stop_ids: torch.Tensor  # (sum of the rows' stop id counts,) int64
    stop_start: torch.Tensor  # (B + 1,) int64
    block_tables: torch.Tensor  # (B, n_blocks) int64, padded with 0
    temperature: torch.Tensor  # (B,) fp32
    uniform: torch.Tensor  # (steps, B) fp32

    @classmethod
    def build(cls, ids: list[int], context: list[int], limit: list[int], stop_ids: list[Iterable[int]],
              block_tables: list[list[int]], temperature: list[float], uniform: list[list[float]]) -> DecodeBatch:
        """`uniform`: each row's draws, one per step (B lists of steps)."""
        rows = len(ids)
        stops = [list(s) for s in stop_ids]
        tables = _padded_tables(block_tables, np.fromiter(map(len, block_tables), dtype=np.int64, count=rows))
        return cls(
            ids=torch.tensor(ids, dtype=torch.int64),
            context=torch.tensor(context, dtype=torch.int64),
            limit=torch.tensor(limit, dtype=torch.int64),
            stop_ids=torch.tensor(list(itertools.chain.from_iterable(stops)), dtype=torch.int64),
            stop_start=torch.from_numpy(np.concatenate(([0], np.cumsum([len(s) for s in stops], dtype=np.int64)))),
            block_tables=torch.from_numpy(tables),
            temperature=torch.tensor(temperature, dtype=torch.float32),
            uniform=torch.tensor(uniform, dtype=torch.float32).t().contiguous(),
        )


def private_cache(x: torch.Tensor, meta: AttentionMeta) -> torch.Tensor:
    """Whole sequences' keys (or values) x (rows, Hkv, D) in a paged cache of their own, as the
    attention kernels read them: zeros, each token's row at its slot, and a shared prompt's partial
    block's rows again in each other completion's first block (`for_shared_prompts`). In place on
    a fresh tensor, so autograd records it as two index copies where x wants a gradient."""
    cache = x.new_zeros((meta.num_blocks * ATTN_BLOCK, *x.shape[1:]))
    cache.index_copy_(0, meta.slot_mapping, x[: meta.num_tokens])
    if meta.copy_slots is not None:
        cache.index_copy_(0, meta.copy_slots, x[meta.copy_rows])
    return cache.view(meta.num_blocks, ATTN_BLOCK, *x.shape[1:])
