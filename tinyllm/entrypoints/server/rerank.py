"""The relevance routes: POST /v1/rerank and /rerank (the Jina/Cohere shape that vLLM and
llama.cpp serve: results sorted by relevance_score, top_n, return_documents) and vLLM's
POST /score and /v1/score (one text against others, or two lists pairwise)."""

import time
import uuid

from fastapi import FastAPI

from tinyllm.entrypoints.server.chat_run import ChatServing
from tinyllm.entrypoints.server.pooling_protocol import RerankRequest, ScoreRequest
from tinyllm.entrypoints.server.pooling_serving import PoolingServing


def install_rerank_routes(app: FastAPI, chat: ChatServing, pooling: PoolingServing) -> None:
    async def scores(
        first: str | list[str],
        second: str | list[str],
        param: str,
        req: RerankRequest | ScoreRequest,
    ) -> tuple[list[float], int]:
        """The pairs' scores and the tokens run for them."""
        plan = pooling.score_plan(first, second, param, req.instruction, req.truncate_prompt_tokens)
        results = await pooling.run(plan.prompts, plan.params, param)
        return plan.scores([v for _, v in results]), sum(len(ids) for ids, _ in results)

    async def rerank(req: RerankRequest) -> dict:
        chat.check_model(req.model)
        texts = [d if isinstance(d, str) else d.text for d in req.documents]
        found, tokens = await scores(req.query, texts, "documents", req)
        order = sorted(range(len(texts)), key=lambda i: -found[i])[: req.top_n]
        results = []
        for i in order:
            result = {"index": i, "relevance_score": found[i]}
            if req.return_documents:
                result["document"] = {"text": texts[i]}
            results.append(result)
        return {
            "id": f"rerank-{uuid.uuid4().hex}",
            "model": pooling.model_name,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            "results": results,
        }

    async def score(req: ScoreRequest) -> dict:
        chat.check_model(req.model)
        found, tokens = await scores(req.text_1, req.text_2, "text_2", req)
        return {
            "id": f"score-{uuid.uuid4().hex}",
            "object": "list",
            "created": int(time.time()),
            "model": pooling.model_name,
            "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(found)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }

    app.add_api_route("/v1/rerank", rerank, methods=["POST"])
    app.add_api_route("/rerank", rerank, methods=["POST"])
    app.add_api_route("/score", score, methods=["POST"])
    app.add_api_route("/v1/score", score, methods=["POST"])
