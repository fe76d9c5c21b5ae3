"""The HTTP side of `tinyllm bench serve`: one streamed /v1/completions request at a time,
timed chunk by chunk on one clock, for the `serve` workload (serve.py) and the chat replay
(serve_chat.py) alike."""

import asyncio
import json
import time

import httpx

from tinyllm.entrypoints.bench.serve_report import Outcome


def _message(payload: object) -> str:
    """The message of an OpenAI-shaped error, {"error": {"message": ...}}, else the payload."""
    error = payload.get("error") if isinstance(payload, dict) else None
    if isinstance(error, dict) and "message" in error:
        return str(error["message"])
    return str(error or payload)[:200]


def error_message(status: int, body: bytes) -> str:
    try:
        message = _message(json.loads(body))
    except ValueError:  # not JSON: a proxy's error page, say
        message = body[:200].decode(errors="replace")
    return f"HTTP {status}: {message}"


class Client:
    """Streams completions from one server, timing every chunk on one clock."""

    def __init__(self, http: httpx.AsyncClient, model: str, t0: float) -> None:
        self.http, self.model, self.t0 = http, model, t0

    def now(self) -> float:
        return time.perf_counter() - self.t0

    async def send(
        self, prompt: list[int] | str, max_tokens: int, streaming: asyncio.Event
    ) -> Outcome:
        """One request (a prompt of token ids or text); sets `streaming` at its first chunk or
        its end. Failures are recorded in the outcome, never raised: a benchmark reports them
        and goes on."""
        out = Outcome(len(prompt) if isinstance(prompt, list) else 0, max_tokens)
        body = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        out.sent = self.now()
        try:
            out.error = await self._stream(body, out, streaming)
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:
            out.error = f"{type(e).__name__}: {e}"
        finally:
            out.done = self.now()
            streaming.set()
        return out

    async def _stream(self, body: dict, out: Outcome, streaming: asyncio.Event) -> str | None:
        """Reads the server-sent events into `out`; returns what went wrong, if anything."""
        async with self.http.stream("POST", "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                return error_message(resp.status_code, await resp.aread())
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line.removeprefix("data:").strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    return f"error event: {_message(event)}"
                if event.get("choices"):
                    out.chunks.append(self.now())
                    out.text += event["choices"][0].get("text") or ""
                    streaming.set()
                if usage := event.get("usage"):
                    out.prompt_tokens = usage["prompt_tokens"]
                    out.output_tokens = usage["completion_tokens"]
                    # The server's own prefix-cache hits; not every server reports them.
                    details = usage.get("prompt_tokens_details") or {}
                    out.cached_tokens = details.get("cached_tokens")
            else:
                return "the stream ended without [DONE]"
        if not out.chunks:
            return "no chunk was streamed"
        if not out.output_tokens:
            return "no usage chunk: the server ignored stream_options.include_usage"
        return None
