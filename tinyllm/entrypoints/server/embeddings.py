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
        results = await pooling.run(pooling.token_ids(req.input, "input"), params, "input")
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
        # Ollama's embeddings are normalized; truncate keeps what fits (here the last tokens).
        fits = min(spec.max_model_len, spec.whole_prompt_tokens or spec.max_model_len)
        params = PoolingParams(
            dimensions=req.dimensions,
            normalize=True,
            truncate_prompt_tokens=fits if req.truncate else None,
        )
        results = await pooling.run(pooling.token_ids(req.input, "input"), params, "input")
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
