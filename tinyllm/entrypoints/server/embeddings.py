"""The embedding routes: OpenAI's POST /v1/embeddings, Ollama's POST /api/embed and its legacy
POST /api/embeddings (their errors in Ollama's shape, as /api's other routes)."""

import base64
import struct
import time
import uuid

import torch
from fastapi import FastAPI

from tinyllm.engine.pooling_params import PoolingParams
from tinyllm.entrypoints.server.chat_run import ChatServing
from tinyllm.entrypoints.server.errors import APIError
from tinyllm.entrypoints.server.pooling_protocol import (
    EmbeddingRequest,
    OllamaEmbeddingsRequest,
    OllamaEmbedRequest,
)
from tinyllm.entrypoints.server.pooling_serving import PoolingServing


def _encoded(vector: torch.Tensor, encoding_format: str) -> list[float] | str:
    """float: a list; base64: the float32 values' little-endian bytes, as OpenAI sends them."""
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector.tolist())).decode()
    return vector.tolist()


def _ollama_fit(
    prompts: list[tuple[str | None, list[int]]], fits: int, truncate: bool
) -> list[tuple[str | None, list[int]]]:
    """Ollama's rule for an input over the context of `fits` tokens: `truncate` keeps its
    first tokens (vLLM's truncate_prompt_tokens keeps the last), else a 400 in Ollama's words."""
    kept = []
    for i, (text, ids) in enumerate(prompts):
        if len(ids) > fits:
            if not truncate:
                raise APIError(
                    400,
                    f"input length exceeds maximum context length: input[{i}] is {len(ids)} "
                    f"tokens, the context is {fits} (truncate: true keeps the first {fits})",
                    param="input",
                )
            ids = ids[:fits]
        kept.append((text, ids))
    return kept


def install_embedding_routes(app: FastAPI, chat: ChatServing, pooling: PoolingServing) -> None:
    def check_ollama_model(model: str | None) -> None:
        name = pooling.model_name
        if model not in (name, f"{name}:latest"):
            raise APIError(404, f"model '{model}' not found")

    @app.post("/v1/embeddings")
    async def embeddings(req: EmbeddingRequest) -> dict:
        chat.check_model(req.model)
        pooling.check("input")
        params = PoolingParams(
            dimensions=req.dimensions, truncate_prompt_tokens=req.truncate_prompt_tokens
        )
        prompts = pooling.token_ids(req.input, "input", req.prompt_name)
        results = await pooling.run(prompts, params, "input")
        tokens = sum(len(ids) for ids, _ in results)
        data = [
            {"object": "embedding", "index": i, "embedding": _encoded(v, req.encoding_format)}
            for i, (_, v) in enumerate(results)
        ]
        return {
            "id": f"embd-{uuid.uuid4().hex}",
            "object": "list",
            "created": int(time.time()),
            "model": pooling.model_name,
            "data": data,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }

    @app.post("/api/embed")
    async def ollama_embed(req: OllamaEmbedRequest) -> dict:
        start = time.perf_counter_ns()
        check_ollama_model(req.model)
        spec = pooling.check("input")
        fits = min(spec.max_model_len, spec.whole_prompt_tokens or spec.max_model_len)
        prompts = pooling.token_ids(req.input, "input", req.prompt_name)
        prompts = _ollama_fit(prompts, fits, req.truncate)
        # Ollama's embeddings are normalized.
        params = PoolingParams(dimensions=req.dimensions, normalize=True)
        results = await pooling.run(prompts, params, "input")
        return {
            "model": req.model,
            "embeddings": [v.tolist() for _, v in results],
            "total_duration": time.perf_counter_ns() - start,
            "load_duration": 0,
            "prompt_eval_count": sum(len(ids) for ids, _ in results),
        }

    @app.post("/api/embeddings")
    async def ollama_embeddings(req: OllamaEmbeddingsRequest) -> dict:
        check_ollama_model(req.model)
        pooling.check("prompt")
        prompts = pooling.token_ids(req.prompt, "prompt")
        results = await pooling.run(prompts, PoolingParams(normalize=False), "prompt")
        return {"embedding": results[0][1].tolist()}
