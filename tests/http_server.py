"""Running an app under uvicorn on 127.0.0.1 in the test process, and a client for it."""

import contextlib
import threading
import time
from collections.abc import Iterator

import openai
import uvicorn

from tinyllm.entrypoints.server.app import Server, create_app


@contextlib.contextmanager
def serving(app) -> Iterator[str]:
    """Run `app` under uvicorn on 127.0.0.1 in a thread; yields its base URL."""
    server = Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)


@contextlib.contextmanager
def openai_client(llm) -> Iterator[openai.OpenAI]:
    """`llm` behind tinyllm's server, and the official client pointed at it (`.model` set)."""
    with serving(create_app(llm)) as url:
        with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as c:
            c.model = llm.model_name
            yield c
