"""Pooling requests from the HTTP side: inputs checked (a 400 naming the problem), run on the
engine loop together, their vectors back in input order. Shared by the embeddings, rerank and
score routes of every dialect."""

import asyncio
import uuid

import torch

from tinyllm.engine.pooling_params import PoolingParams, PoolingSpec
from tinyllm.entrypoints.llm import LLM
from tinyllm.entrypoints.pooling import ScorePlan, pairs, plan_scores
from tinyllm.entrypoints.server.engine_loop import EngineLoop
from tinyllm.entrypoints.server.engine_requests import encode
from tinyllm.entrypoints.server.errors import APIError

MAX_INPUTS = 2048  # inputs one request may embed or score (OpenAI's limit for embeddings)
_NOT_POOLING = (
    "this model generates text; it does not embed or score: serve an embedding or reranker "
    "model, or start the server with --pooling last|mean|cls"
)


class PoolingServing:
    def __init__(self, llm: LLM, loop: EngineLoop) -> None:
        self.loop, self.tokenizer, self.model_name = loop, llm.tokenizer, llm.model_name
        self.validator = llm.engine.request_validator()
        self.spec: PoolingSpec | None = llm.engine.pooling

    def check(self, param: str) -> PoolingSpec:
        """The model's pooling spec; a 400 on a generation model."""
        if self.spec is None:
            raise APIError(400, _NOT_POOLING, param=param)
        return self.spec

    def token_ids(
        self, inputs: str | list, param: str, prompt_name: str | None = None
    ) -> list[tuple[str | None, list[int]]]:
        """OpenAI's `input`: a text, token ids, or a list of either, as (text, token ids); each
        text after the model's prompt named `prompt_name` (or its default prompt)."""
        try:
            prefix = self.check(param).prompt(prompt_name)
        except ValueError as e:
            raise APIError(400, str(e), param="prompt_name") from e
        if isinstance(inputs, str) or (inputs and isinstance(inputs[0], int)):
            inputs = [inputs]
        if not inputs:
            raise APIError(400, f"{param}: give at least one input", param=param)
        if len(inputs) > MAX_INPUTS:
            raise APIError(400, f"{param}: {len(inputs)} inputs, over {MAX_INPUTS}", param=param)
        return [
            (x, encode(self.tokenizer, prefix + x, True, param))
            if isinstance(x, str)
            else (None, x)
            for x in inputs
        ]

    def score_plan(
        self,
        first: str | list[str],
        second: str | list[str],
        param: str,
        instruction: str | None = None,
        truncate: int | None = None,
    ) -> ScorePlan:
        spec = self.check(param)
        try:
            texts = pairs(first, second)
            if len(texts) > MAX_INPUTS:
                raise ValueError(f"{len(texts)} pairs to score, over {MAX_INPUTS}")
            return plan_scores(self.tokenizer, spec, texts, instruction, truncate)
        except ValueError as e:
            raise APIError(400, str(e), param=param) from e

    async def run(
        self,
        prompts: list[tuple[str | None, list[int]]],
        params: PoolingParams,
        param: str,
        names: list[str] | None = None,
    ) -> list[tuple[list[int], torch.Tensor]]:
        """Each input's token ids as run (truncated) and its pooled vector, in input order.
        An input refused is named by `names` (its place in the request), else as `param`'s."""
        self.check(param)
        checked = []
        for i, (_, ids) in enumerate(prompts):
            try:
                checked.append(self.validator.validate_pooling(ids, params))
            except ValueError as e:
                where = names[i] if names else param if len(prompts) == 1 else f"{param}[{i}]"
                raise APIError(400, f"{where}: {e}", param=where.partition("[")[0]) from e
        base = f"pool-{uuid.uuid4().hex}"
        requests = [(f"{base}-{i}", ids, params) for i, ids in enumerate(checked)]
        stream = self.loop.submit(requests)
        done = {}
        try:
            while len(done) < len(requests):
                for out in await stream.get():
                    if out.finished:
                        done[out.request_id] = out
        except asyncio.CancelledError:  # the client went away: free the engine's work
            self.loop.abort([r for r, *_ in requests if r not in done])
            raise
        results = []
        for request_id, ids, _ in requests:
            out = done[request_id]
            if out.pooled is None:
                raise APIError(500, out.error or "the engine failed on this input")
            results.append((ids, out.pooled))
        return results
