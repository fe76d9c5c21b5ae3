"""The request bodies of the pooling routes: OpenAI's embeddings, the Jina/Cohere rerank shape
(vLLM's and llama.cpp's /rerank), vLLM's /score and Ollama's /api/embed and /api/embeddings."""

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from tinyllm.entrypoints.server.protocol import TokenIds

Count = Annotated[int, Field(ge=1)]


class _Request(BaseModel):
    # strict: "16" is not a count; unknown fields (clients send many) are ignored.
    model_config = ConfigDict(strict=True, allow_inf_nan=False)


class EmbeddingRequest(_Request):
    model: str | None = None
    input: str | TokenIds | list[str] | list[TokenIds]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Count | None = None
    user: str | None = None
    truncate_prompt_tokens: Count | None = None  # vLLM's: keep each input's last k tokens
    # Text-embeddings-inference's: the model's sentence-transformers prompt put before each text
    # input (Qwen3-Embedding's "query"); None: its default prompt, if any.
    prompt_name: str | None = None


class Document(_Request):
    text: str


class RerankRequest(_Request):
    model: str | None = None
    query: str
    documents: list[str | Document]
    top_n: Count | None = None
    return_documents: bool = True
    instruction: str | None = None  # Qwen3-Reranker's task instruction (its default if None)
    truncate_prompt_tokens: Count | None = None


class ScoreRequest(_Request):
    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]
    instruction: str | None = None
    truncate_prompt_tokens: Count | None = None


class OllamaEmbedRequest(_Request):
    model: str | None = None
    input: str | list[str]
    truncate: bool = True  # keep an input's first tokens that fit (Ollama's), else an error
    dimensions: Count | None = None
    prompt_name: str | None = None  # as EmbeddingRequest's
    options: dict | None = None
    keep_alive: str | int | float | None = None


class OllamaEmbeddingsRequest(_Request):
    """The legacy /api/embeddings: one prompt, its embedding unnormalized."""

    model: str | None = None
    prompt: str
    options: dict | None = None
    keep_alive: str | int | float | None = None
