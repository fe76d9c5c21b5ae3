"""n completions of one prompt: n engine requests reported as one output (vLLM's ParentRequest).

The engine core schedules and samples the n children like any other requests, each with its
own generator; only their outputs are gathered here, numbered 0..n-1, as the request's
`output_kind` asks: DELTA reports the completions that changed this step, CUMULATIVE all of
them every step one changed, FINAL_ONLY all of them once, when the last one finishes.
`ParentRequests` is the engine's registry of them: it fans a request out into its children
and gathers each step's outputs back.
"""

import dataclasses

from tinyllm.engine.outputs import CompletionOutput, RequestOutput
from tinyllm.engine.sampling_params import RequestOutputKind, SamplingParams

_SEED_SPAN = 2**64  # seeds are signed 64-bit: child i's seed wraps instead of overflowing


def child_ids(request_id: str, n: int) -> list[str]:
    """The ids of a request's n completions, as the engine core knows them."""
    return [f"{request_id}[{i}]" for i in range(n)]


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


class ParentRequests:
    """The n > 1 requests in flight, by their id (`by_id`) and by each of their children's."""

    def __init__(self) -> None:
        self.by_id: dict[str, ParentRequest] = {}
        self._of_child: dict[str, ParentRequest] = {}

    def expand(self, request_id: str, params: SamplingParams) -> list[tuple[str, SamplingParams]]:
        """The engine requests that run a request, each with its own params: itself, or for
        n > 1 its n children, the parent registered to gather their outputs."""
        if params.n == 1:
            return [(request_id, params)]
        parent = ParentRequest(request_id, child_ids(request_id, params.n), params.output_kind)
        self.by_id[request_id] = parent
        self._of_child.update(dict.fromkeys(parent.child_ids, parent))
        return list(zip(parent.child_ids, child_params(params), strict=True))

    def engine_ids(self, request_id: str) -> list[str]:
        """The engine requests a request runs as: its children, or itself."""
        parent = self.by_id.get(request_id)
        return parent.child_ids if parent is not None else [request_id]

    def gather(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """Children's outputs become their parent's: one output per parent, where its first
        child's was. A parent whose children have all finished is forgotten."""
        by_parent: dict[ParentRequest, list[RequestOutput]] = {}
        order: list[RequestOutput | ParentRequest] = []
        for out in outputs:
            parent = self._of_child.get(out.request_id)
            if parent is None:
                order.append(out)
                continue
            if parent not in by_parent:
                order.append(parent)
            by_parent.setdefault(parent, []).append(out)
        result = []
        for item in order:
            if isinstance(item, RequestOutput):
                result.append(item)
                continue
            merged = item.merge(by_parent[item])
            if item.finished:
                del self.by_id[item.request_id]
                for child in item.child_ids:
                    del self._of_child[child]
            if merged is not None:
                result.append(merged)
        return result
