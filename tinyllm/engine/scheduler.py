"""Who runs next: a FIFO waiting queue, running slots, and the KV cache's block budget."""

from collections import deque

from tinyllm.engine.sequence import Sequence, Status


class Scheduler:
    def __init__(self, cache, max_num_batched_tokens: int):
        self.cache = cache
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: dict[int, Sequence] = {}  # slot -> sequence
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule_prefill(self) -> tuple[list[Sequence], list[Sequence]]:
        """Admit waiting sequences, oldest first, while slots, blocks and the prefill budget
        allow. Returns (admitted, rejected): a rejected sequence can never fit the cache."""
        admitted: list[Sequence] = []
        rejected: list[Sequence] = []
        while self.waiting:
            seq = self.waiting[0]
            n = seq.num_tokens
            if not self.cache.fits_ever(n):
                self.waiting.popleft()
                rejected.append(seq)
                continue
            lengths = [s.num_tokens for s in admitted] + [n]
            if admitted and sum(lengths) > self.max_num_batched_tokens:
                break
            if not self.cache.can_admit(lengths):
                break
            admitted.append(self.waiting.popleft())
        return admitted, rejected

    def start(self, seqs: list[Sequence], slots: list[int]) -> None:
        for seq, slot in zip(seqs, slots, strict=True):
            seq.slot, seq.status = slot, Status.RUNNING
            self.running[slot] = seq

    def preempt_for_decode(self) -> list[Sequence]:
        """Free blocks for the next decode step; victims go back to the front of the queue,
        the oldest admission first, to be recomputed from prompt + tokens so far."""
        victims = [self.running.pop(slot) for slot in self.cache.reserve_step()]
        for seq in victims:  # newest first, so appendleft leaves the oldest in front
            seq.slot, seq.status = None, Status.WAITING
            seq.num_preemptions += 1
            self.waiting.appendleft(seq)
        self.num_preemptions += len(victims)
        return victims

    def decode_batch(self) -> list[Sequence]:
        """Running sequences in the cache's row order for the next decode step."""
        return [self.running[s] for s in self.cache.active_slots()]

    def release(self, seq: Sequence) -> None:
        """Give back a finished or aborted sequence's slot and blocks."""
        if seq.slot is not None:
            self.cache.release(seq.slot)
            del self.running[seq.slot]
            seq.slot = None

    def abort(self, request_id: str) -> Sequence | None:
        for seq in self.waiting:
            if seq.request_id == request_id:
                self.waiting.remove(seq)
                return seq
        for seq in self.running.values():
            if seq.request_id == request_id:
                self.release(seq)
                return seq
        return None
