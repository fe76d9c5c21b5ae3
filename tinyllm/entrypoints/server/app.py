"""The OpenAI-compatible HTTP server: `create_app(llm)` for tests and embedding, `serve(args)`
for `tinyllm serve`."""

import argparse
import asyncio
import contextlib
import hmac
import logging
import time
from collections.abc import AsyncIterator, Callable

import uvicorn
from fastapi import Depends, FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.concurrency import run_in_threadpool

from tinyllm import __version__
from tinyllm.entrypoints.llm import LLM
from tinyllm.entrypoints.server.anthropic import install_anthropic_routes
from tinyllm.entrypoints.server.chat_run import ChatServing
from tinyllm.entrypoints.server.embeddings import install_embedding_routes
from tinyllm.entrypoints.server.engine_loop import EngineLoop
from tinyllm.entrypoints.server.engine_requests import chat_prompt, encode
from tinyllm.entrypoints.server.errors import APIError, BodyLimitMiddleware, install_error_handlers
from tinyllm.entrypoints.server.metrics import ServerMetrics
from tinyllm.entrypoints.server.ollama import install_ollama_routes
from tinyllm.entrypoints.server.options import ServerOptions
from tinyllm.entrypoints.server.pooling_serving import PoolingServing
from tinyllm.entrypoints.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
)
from tinyllm.entrypoints.server.rerank import install_rerank_routes
from tinyllm.entrypoints.server.responses import install_responses_routes
from tinyllm.entrypoints.server.serving import OpenAIServing
from tinyllm.entrypoints.server.ui import ChatPage
from tinyllm.host.memory import resident_bytes

log = logging.getLogger("tinyllm.server")

MAX_BODY_BYTES = 4 << 20
# Reachable without the API key: a load balancer's probe should not need a secret.
_OPEN_PATHS = {"/health", "/version"}


def create_app(
    llm: LLM,
    api_key: str | None = None,
    max_body_bytes: int = MAX_BODY_BYTES,
    ui: bool = ServerOptions.ui,
) -> FastAPI:
    """An app serving `llm` (an `LLM`: its engine, tokenizer and model name), with the chat
    page for browsers at / if `ui`. Its engine loop thread runs while the app's lifespan does;
    nothing else may drive `llm.engine` meanwhile."""
    engine, tokenizer = llm.engine, llm.tokenizer
    metrics = ServerMetrics(engine.stats())
    engine_loop = EngineLoop(engine, metrics)
    chat = ChatServing(llm, engine_loop)
    serving = OpenAIServing(chat)
    # Read now: once the loop runs, only its thread touches the engine.
    max_model_len, vocab = engine.max_model_len, engine.vocab_size
    started = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine_loop.start()
        try:
            yield
        finally:
            engine_loop.stop()

    async def check_api_key(request: Request) -> None:
        if api_key is None or request.url.path in _OPEN_PATHS:
            return
        # Anthropic's clients send the key as x-api-key, OpenAI's as a bearer token.
        token = request.headers.get("x-api-key")
        if token is None:
            scheme, _, token = request.headers.get("authorization", "").partition(" ")
            token = token if scheme.lower() == "bearer" else ""
        # compare_digest: how long the comparison takes says nothing about the key.
        if not token or not hmac.compare_digest(token.encode(), api_key.encode()):
            raise APIError(
                401,
                "missing or wrong API key (Authorization: Bearer ... or x-api-key: ...)",
                code="invalid_api_key",
            )

    app = FastAPI(
        title="tinyllm",
        version=__version__,
        lifespan=lifespan,
        dependencies=[Depends(check_api_key)],
    )
    app.state.engine_loop = engine_loop  # Server stops it first, to end the live streams
    app.add_middleware(BodyLimitMiddleware, limit=max_body_bytes)
    if ui:
        app.add_middleware(ChatPage)
    install_error_handlers(app)
    install_ollama_routes(app, chat, llm)

    @app.get("/health")
    async def health() -> Response:
        if not engine_loop.alive:
            raise APIError(503, f"unhealthy: {engine_loop.error}", code="engine_dead")
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict:
        return {"version": __version__}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> dict:
        """Forget every cached prompt block (behind the API key, as vLLM's route)."""
        return {"num_blocks_forgotten": await engine_loop.reset_prefix_cache()}

    def model_card() -> ModelCard:
        return ModelCard(id=llm.model_name, created=started, max_model_len=max_model_len)

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[model_card()])

    # :path: a model's name may hold slashes ("HuggingFaceTB/SmolLM2-135M-Instruct").
    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> ModelCard:
        chat.check_model(model_id)
        return model_card()

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request) -> Response:
        return await serving.completions(req, raw)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, raw: Request) -> Response:
        return await serving.chat(req, raw)

    install_anthropic_routes(app, chat)

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> dict:
        chat.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give either prompt or messages", param="prompt")
        if req.prompt is not None:
            tokens = await run_in_threadpool(
                encode, tokenizer, req.prompt, req.add_special_tokens, "prompt"
            )
        else:
            tools = [t.model_dump(exclude_none=True) for t in req.tools or []]
            prompt = await run_in_threadpool(
                chat_prompt, tokenizer, req.messages, req.add_generation_prompt, tools or None
            )
            tokens = prompt.token_ids
        return {"tokens": tokens, "count": len(tokens), "max_model_len": max_model_len}

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> dict:
        chat.check_model(req.model)
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"token id {bad[0]} is outside [0, {vocab})", param="tokens")
        return {"prompt": await run_in_threadpool(tokenizer.decode, req.tokens)}

    install_responses_routes(app, chat)
    # Embeddings, rerank and score (a pooling model's; a generation model answers them 400).
    pooling = PoolingServing(llm, engine_loop)
    install_embedding_routes(app, chat, pooling)
    install_rerank_routes(app, chat, pooling)
    return app


class Server(uvicorn.Server):
    """uvicorn's server for an app from create_app. On shutdown (Ctrl-C, SIGTERM) uvicorn waits
    for open responses, then cancels them: a stream would be cut with no end. The engine loop
    stops first instead, so every request still running ends with an error in OpenAI's shape
    (a stream: an error event, then [DONE]) and the wait is short. `close` (the LLM's, when
    the server owns it) runs once the app is down: uvicorn then raises a SIGTERM it caught
    again, which ends the process at once, before any `finally` or atexit could stop the
    tensor-parallel workers."""

    def __init__(self, config: uvicorn.Config, close: Callable[[], None] | None = None) -> None:
        super().__init__(config)
        self._close = close

    async def shutdown(self, sockets: list | None = None) -> None:
        app = self.config.app
        await asyncio.to_thread(app.state.engine_loop.stop)
        await super().shutdown(sockets)
        if self._close is not None:
            await asyncio.to_thread(self._close)


def serve(args: argparse.Namespace) -> None:
    """`tinyllm serve`: load the model, then serve until interrupted."""
    from tinyllm.entrypoints.args import build_llm

    logging.getLogger("tinyllm.server").setLevel(logging.INFO)
    llm = build_llm(args)
    app = create_app(llm, api_key=args.api_key, ui=args.ui)
    host = f"[{args.host}]" if ":" in args.host else args.host
    where = f"http://{host}:{args.port}" if args.port else f"a free port on {args.host}"
    page = f"the chat page at {where if args.port else ''}/" if args.ui else "no chat page"
    resident = resident_bytes()
    log.info(
        "serving %s (context %d tokens) on %s: OpenAI API under /v1 (chat, completions, "
        "responses), Anthropic's /v1/messages, Ollama's /api, also /health and /metrics; "
        "%s; %s; %s resident",
        llm.model_name,
        llm.engine.max_model_len,
        where,
        page,
        "API key required" if args.api_key else "no API key",
        "? MB" if resident is None else f"{resident / 1e6:.0f} MB",
    )
    if llm.engine.pooling is not None:
        log.info(
            "a pooling model: /v1/embeddings, /v1/rerank, /rerank, /score and /api/embed serve "
            "it; the generation routes answer 400"
        )
    if args.host not in ("127.0.0.1", "localhost", "::1") and args.api_key is None:
        log.warning("serving on %s without an API key: whoever reaches it can use it", args.host)
    # Our handlers log one line per request; uvicorn's access log would be a second. On Ctrl-C,
    # running requests end with an error (Server); a response still open after a few seconds
    # more is cancelled.
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level="info",
        access_log=False,
        timeout_graceful_shutdown=5,
    )
    try:
        Server(config, llm.close).run()
    finally:
        llm.close()
