"""n completions of one prompt: n engine requests reported as one output (vLLM's ParentRequest).

The engine core schedules and samples the n children like any other requests, each with its
own generator; only their outputs are gathered here, numbered 0..n-1, as the request's
`output_kind` asks: DELTA reports the completions that changed this step, CUMULATIVE all of
them every step one changed, FINAL_ONLY all of them once, when the last one finishes.
"""

import dataclasses

from tinyllm.engine.outputs import CompletionOutput, RequestOutput
from tinyllm.engine.sampling_params import RequestOutputKind, SamplingParams

_SEED_SPAN = 2**64  # seeds are signed 64-bit: child i's seed wraps instead of overflowing


def child_params(params: SamplingParams) -> list[SamplingParams]:
    """One SamplingParams per completion. With a seed, completion i gets seed + i (wrapped into
    64 bits), so a seeded n > 1 is reproducible without being n copies."""
    seeds = [None] * params.n
    if params.seed is not None:
        seeds = [(params.seed + i + 2**63) % _SEED_SPAN - 2**63 for i in range(params.n)]
    return [dataclasses.replace(params, n=1, seed=seed) for seed in seeds]


class ParentRequest:
    def __init__(self, request_id: str, child_ids: list[str], kind: RequestOutputKind):
        self.request_id, self.child_ids, self.kind = request_id, child_ids, kind
        self._index = {child: i for i, child in enumerate(child_ids)}
        self._latest: dict[int, RequestOutput] = {}
        self._unfinished = set(child_ids)

    @property
    def finished(self) -> bool:
        return not self._unfinished

    def merge(self, outputs: list[RequestOutput]) -> RequestOutput | None:
        """This step's outputs of some children -> the parent's output, or None for none."""
        changed = []
        for out in outputs:
            i = self._index[out.request_id]
            self._latest[i] = out
            changed.append(i)
            if out.finished:
                self._unfinished.discard(out.request_id)
        if self.kind is RequestOutputKind.FINAL_ONLY and not self.finished:
            return None
        shown = sorted(changed) if self.kind is RequestOutputKind.DELTA else range(len(self._index))
        completions = [self._completion(i) for i in shown]
        errors = [o.error for o in self._latest.values() if o.error]
        first = next(iter(self._latest.values()))
        return dataclasses.replace(
            first,
            request_id=self.request_id,
            outputs=completions,
            finished=self.finished,
            error=errors[0] if errors else None,
        )

    def _completion(self, i: int) -> CompletionOutput:
        out = self._latest.get(i)
        if out is None:  # not reported yet (CUMULATIVE): nothing generated so far
            return CompletionOutput(index=i, text="", token_ids=[])
        return dataclasses.replace(out.outputs[0], index=i)
