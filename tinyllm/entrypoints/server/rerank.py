"""The relevance routes: POST /v1/rerank and /rerank (the Jina/Cohere shape that vLLM and
llama.cpp serve: results sorted by relevance_score, top_n, return_documents) and vLLM's
POST /score and /v1/score (one text against others, or two lists pairwise)."""

import time
import uuid

from fastapi import FastAPI

from tinyllm.entrypoints.server.chat_run import ChatServing
from tinyllm.entrypoints.server.pooling_protocol import RerankRequest, ScoreRequest
from tinyllm.entrypoints.server.pooling_serving import PoolingServing


def _name(field: str, texts: str | list[str], pair: int) -> str:
    """Where pair `pair`'s text of a side is in the request (a single text serves every pair)."""
    return field if isinstance(texts, str) else f"{field}[{min(pair, len(texts) - 1)}]"


def install_rerank_routes(app: FastAPI, chat: ChatServing, pooling: PoolingServing) -> None:
    async def scores(
        first: tuple[str, str | list[str]],
        second: tuple[str, str | list[str]],
        req: RerankRequest | ScoreRequest,
    ) -> tuple[list[float], int]:
        """The pairs' scores and the tokens run for them; `first` and `second` are the two
        sides' (field name, texts)."""
        param = second[0]
        plan = pooling.score_plan(
            first[1], second[1], param, req.instruction, req.truncate_prompt_tokens
        )
        names = [_name(*(first, second)[side], pair) for pair, side in plan.sources]
        results = await pooling.run(plan.prompts, plan.params, param, names)
        return plan.scores([v for _, v in results]), sum(len(ids) for ids, _ in results)

    async def rerank(req: RerankRequest) -> dict:
        chat.check_model(req.model)
        texts = [d if isinstance(d, str) else d.text for d in req.documents]
        found, tokens = await scores(("query", req.query), ("documents", texts), req)
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
        found, tokens = await scores(("text_1", req.text_1), ("text_2", req.text_2), req)
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
