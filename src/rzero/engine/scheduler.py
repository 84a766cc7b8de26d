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
            if seq.num_computed + n <= len(seq.block_table) * ATTN_BLOCK:  # its blocks hold it already (most steps)
                batch.append((seq, n))
                budget -= n
                continue
            while not self._reserve(seq, seq.num_computed + n):
                victim = self.running[-1]
                self.preempt(victim)
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

    def fork(self, leader: Sequence) -> list[tuple[Sequence, int | None]]:
        """Start the leader's waiting samples from its prompt, which has just been computed: each
        shares the prompt's full blocks and gets a private block for the partial last one, whose
        rows the engine copies from the leader's (the private block, or None when the prompt ends
        on a block edge). They sample their first token from the leader's logits: with the same
        tokens at the same positions, invariant numerics give them the same bits, so their prompt
        runs once per group. Samples the cache or max_num_seqs has no room for stay waiting and
        start later from the cached prefix."""
        prompt = leader.num_prompt_tokens
        shared, rest = divmod(prompt, ATTN_BLOCK)
        forked = []
        for seq in leader.followers:
            if seq.status != Status.WAITING or seq.block_table or len(seq) != prompt:
                continue  # aborted, or already started on its own
            if len(self.running) >= self.max_num_seqs or (rest and self.blocks.num_free == 0):
                break
            for block in leader.block_table[:shared]:
                self.blocks.retain(block)
            seq.block_table = leader.block_table[:shared]
            seq.block_hashes = leader.block_hashes[:shared]
            private = self.blocks.allocate() if rest else None
            if private is not None:
                seq.block_table.append(private)
            seq.num_computed = prompt
            seq.status = Status.RUNNING
            self.waiting.remove(seq)
            self.running.append(seq)
            forked.append((seq, private))
        return forked

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

    def reserve(self, seq: Sequence, num_tokens: int) -> bool:
        """Give a running sequence the blocks for num_tokens tokens; False (nothing taken) where the
        cache has too few free blocks."""
        return self._reserve(seq, num_tokens)

    def _reserve(self, seq: Sequence, num_tokens: int) -> bool:
        needed = self.blocks.blocks_for(num_tokens) - len(seq.block_table)
        if needed > self.blocks.num_free:
            return False
        seq.block_table.extend(self.blocks.allocate() for _ in range(needed))
        return True

    def _release(self, seq: Sequence) -> None:
        self.blocks.release(seq.block_table)
        seq.block_table, seq.block_hashes, seq.num_computed = [], [], 0
