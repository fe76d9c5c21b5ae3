"""`tinyllm serve`'s own options (host/options.py fields), beside the engine's."""

from dataclasses import dataclass

from tinyllm.host.options import option


@dataclass(frozen=True)
class ServerOptions:
    ui: bool = option(
        True,
        "serve the chat page to a browser that opens the server's address (--no-ui: the API "
        "only; an API client's GET / gets Ollama's answer either way)",
    )
