"""Which sequences run in the next step, how many of their tokens, and their KV-cache blocks.

Running sequences go first (a decode token, or the next chunk of a prompt), then waiting ones in
arrival order, all under a token budget per step (chunked prefill). A waiting sequence first takes
the full cached blocks of its longest cached prefix. When the cache is full the newest running
sequence is preempted: its blocks are freed and it is recomputed when scheduled again.
"""

from __future__ import annotations

from collections import deque

from rzero.engine.block_manager import BlockManager, block_hash
from rzero.engine.sequence import Sequence, Status
from rzero.ops import ATTN_BLOCK


class Scheduler:
    def __init__(self, num_blocks: int, max_num_batched_tokens: int, max_num_seqs: int):
        # Zero would schedule nothing, ever: every step would be empty and generate() never end.
        if max_num_batched_tokens < 1 or max_num_seqs < 1:
            raise ValueError(
                f"max_num_batched_tokens ({max_num_batched_tokens}) and max_num_seqs ({max_num_seqs}) must be >= 1"
            )
        self.blocks = BlockManager(num_blocks, ATTN_BLOCK)
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def schedule(self) -> list[tuple[Sequence, int]]:
        """The next step's batch: (sequence, number of its tokens to compute)."""
        budget = self.max_num_batched_tokens
        batch: list[tuple[Sequence, int]] = []
        for seq in list(self.running):
            if seq.status != Status.RUNNING or budget == 0:
                continue
            n = min(len(seq) - seq.num_computed, budget)
            while not self._reserve(seq, seq.num_computed + n):
                victim = self.running[-1]
                self.preempt(victim)
                if victim is seq:
                    break
            if seq.status == Status.RUNNING:
                batch.append((seq, n))
                budget -= n
        skipped = []
        # Tokens of each sequence in this step whose K/V the step's attention will see: a layer
        # writes the whole batch's K/V into the cache before any query reads it.
        cached_by_step = {id(s): s.num_computed + n for s, n in batch}
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting.popleft()
            leader = seq.wait_for
            if leader is not None and leader.status != Status.FINISHED and not seq.block_table:
                if len(seq) == seq.num_prompt_tokens:  # a fresh sample: share the leader's prompt blocks
                    if not self._share_prompt_blocks(seq, leader, cached_by_step.get(id(leader), leader.num_computed)):
                        skipped.append(seq)
                        continue
                elif leader.num_computed < leader.num_prompt_tokens:
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
            cached_by_step[id(seq)] = seq.num_computed + n
            budget -= n
        self.waiting.extendleft(reversed(skipped))
        return batch

    def _share_prompt_blocks(self, seq: Sequence, leader: Sequence, leader_cached: int) -> bool:
        """Give a group's fresh sample the full blocks of its prompt from the group's leader, once
        the leader has their K/V or computes them in this step (then the sample joins the same
        step instead of waiting for the next). The last prompt token is always left to compute (it
        gives the logits). False: the leader's blocks are not there yet; the sample waits."""
        shared = (seq.num_prompt_tokens - 1) // ATTN_BLOCK
        if leader_cached < shared * ATTN_BLOCK or len(leader.block_table) < shared:
            return False
        previous = None
        for i, block in enumerate(leader.block_table[:shared]):
            previous = block_hash(previous, seq.token_ids[i * ATTN_BLOCK : (i + 1) * ATTN_BLOCK])
            self.blocks.retain(block)
            seq.block_table.append(block)
            seq.block_hashes.append(previous)
        seq.num_computed = shared * ATTN_BLOCK
        return True

    def computed(self, seq: Sequence, n: int) -> None:
        """n more of seq's tokens are in the cache: register its newly full blocks for reuse."""
        seq.num_computed += n
        for i in range(len(seq.block_hashes), seq.num_computed // ATTN_BLOCK):
            previous = seq.block_hashes[-1] if seq.block_hashes else None
            h = block_hash(previous, seq.token_ids[i * ATTN_BLOCK : (i + 1) * ATTN_BLOCK])
            self.blocks.register(seq.block_table[i], h)
            seq.block_hashes.append(h)

    def recompute_all(self) -> None:
        """Forget every cached K/V (new weights): running sequences are recomputed when rescheduled."""
        self.blocks.reset_prefix_cache()
        for seq in reversed(list(self.running)):
            self.preempt(seq)

    def preempt(self, seq: Sequence) -> None:
        """Free a running sequence's cache; it is recomputed (prompt and outputs) when rescheduled."""
        self._release(seq)
        self.running.remove(seq)
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def finish(self, seq: Sequence) -> None:
        """Take a sequence out of the queues for good and free its blocks."""
        if seq.status == Status.RUNNING:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._release(seq)
        seq.status = Status.FINISHED

    def _reserve(self, seq: Sequence, num_tokens: int) -> bool:
        needed = self.blocks.blocks_for(num_tokens) - len(seq.block_table)
        if needed > self.blocks.num_free:
            return False
        seq.block_table.extend(self.blocks.allocate() for _ in range(needed))
        return True

    def _release(self, seq: Sequence) -> None:
        self.blocks.release(seq.block_table)
        seq.block_table, seq.block_hashes, seq.num_computed = [], [], 0
