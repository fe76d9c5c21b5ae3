"""The pooling routes on the real server, through the official clients (openai, ollama,
LangChain's OpenAIEmbeddings) and raw HTTP for bad input: embeddings against transformers'
pooled hidden states, rerank order against transformers' yes/no scores, and each kind of
model refusing the other's routes with a 400 while the server keeps serving."""

import base64
import struct
from pathlib import Path

import httpx
import ollama
import openai
import pytest
import torch

from tests.http_server import serving
from tinyllm import LLM
from tinyllm.entrypoints.cli import main
from tinyllm.entrypoints.pooling import qwen3_reranker_prompt
from tinyllm.entrypoints.server.app import create_app

from .pooling_models import hf_pool, hf_yes_score, text, write_qwen3, write_qwen3_embedding

IDS = [[10, 11, 12, 13], [40, 41], [90, 10, 70, 20, 30]]
LONG = " ".join(["w10"] * 1100)  # over the context of 1024 tokens


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    path = tmp_path_factory.mktemp("qwen3")
    return path, write_qwen3(path)


@pytest.fixture(scope="module")
def embed_server(qwen3):
    path, ref = qwen3
    llm = LLM(str(path), dtype="float32", quantization="none", pooling="last", threads=1)
    with serving(create_app(llm)) as url:
        yield url, llm, ref


def _close(got: list[float], want: torch.Tensor, dims: int | None = None) -> bool:
    if dims is not None:
        want = torch.nn.functional.normalize(want[:dims], dim=0)
    return torch.cosine_similarity(torch.tensor(got), want, dim=0).item() >= 0.9999


def test_openai_embeddings_float_base64_dimensions(embed_server) -> None:
    url, llm, ref = embed_server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    texts = [text(ids) for ids in IDS]
    out = client.embeddings.create(model=llm.model_name, input=texts, encoding_format="float")
    assert [d.index for d in out.data] == [0, 1, 2]
    for d, ids in zip(out.data, IDS, strict=True):
        assert _close(d.embedding, hf_pool(ref, ids, "last"))
    assert out.usage.prompt_tokens == out.usage.total_tokens == sum(map(len, IDS))
    # The client asks for base64 unless told otherwise, and decodes it.
    plain = client.embeddings.create(model=llm.model_name, input=IDS, dimensions=16)
    for d, ids in zip(plain.data, IDS, strict=True):
        assert len(d.embedding) == 16 and _close(d.embedding, hf_pool(ref, ids, "last"), 16)
    raw = httpx.post(
        f"{url}/v1/embeddings", json={"input": IDS[0], "encoding_format": "base64"}
    ).json()
    packed = base64.b64decode(raw["data"][0]["embedding"])
    assert _close(
        list(struct.unpack(f"<{len(packed) // 4}f", packed)), hf_pool(ref, IDS[0], "last")
    )


def test_ollama_embed_and_legacy_embeddings(embed_server) -> None:
    url, llm, ref = embed_server
    client = ollama.Client(host=url)
    out = client.embed(model=llm.model_name, input=[text(ids) for ids in IDS])
    for got, ids in zip(out.embeddings, IDS, strict=True):
        assert _close(got, hf_pool(ref, ids, "last"))
    assert out.prompt_eval_count == sum(map(len, IDS))
    legacy = client.embeddings(model=llm.model_name, prompt=text(IDS[0]))
    unnormalized = ref.model(torch.tensor([IDS[0]]))[0][0, -1]
    assert torch.allclose(torch.tensor(legacy.embedding), unnormalized, atol=1e-4)
    with pytest.raises(ollama.ResponseError, match="not found"):
        client.embed(model="other", input="w10")


def test_over_long_inputs_keep_ollamas_first_tokens_and_vllms_last(embed_server) -> None:
    """The context is 1024 tokens. Ollama's /api/embed truncates an input to its first tokens
    (and with truncate false refuses it, in Ollama's words); vLLM's truncate_prompt_tokens on
    /v1/embeddings keeps the last."""
    url, llm, ref = embed_server
    long = [7 + (i * 37) % 89 for i in range(1030)]
    client = ollama.Client(host=url)
    out = client.embed(model=llm.model_name, input=["w10", text(long)])
    assert _close(out.embeddings[1], hf_pool(ref, long[:1024], "last"))
    assert not _close(out.embeddings[1], hf_pool(ref, long[-1024:], "last"))
    assert out.prompt_eval_count == 1 + 1024
    with pytest.raises(ollama.ResponseError) as refused:
        client.embed(model=llm.model_name, input=["w10", text(long)], truncate=False)
    assert refused.value.status_code == 400
    assert "input length exceeds maximum context length" in refused.value.error
    assert "input[1] is 1030 tokens, the context is 1024" in refused.value.error
    body = {"input": long, "truncate_prompt_tokens": 1024}
    r = httpx.post(f"{url}/v1/embeddings", json=body).json()
    assert _close(r["data"][0]["embedding"], hf_pool(ref, long[-1024:], "last"))
    assert r["usage"]["prompt_tokens"] == 1024


def test_langchain_openai_embeddings(embed_server) -> None:
    from langchain_openai import OpenAIEmbeddings

    url, llm, ref = embed_server
    # check_embedding_ctx_length=False: texts, not tiktoken's token ids (another vocabulary).
    emb = OpenAIEmbeddings(model=llm.model_name, base_url=f"{url}/v1", api_key="unused",
                           check_embedding_ctx_length=False)  # fmt: skip
    docs = emb.embed_documents([text(ids) for ids in IDS])
    assert all(_close(d, hf_pool(ref, ids, "last")) for d, ids in zip(docs, IDS, strict=True))
    assert _close(emb.embed_query(text(IDS[1])), hf_pool(ref, IDS[1], "last"))


def test_bad_embedding_requests_get_400_naming_it(embed_server) -> None:
    url, llm, _ = embed_server
    cases = [
        ({"input": []}, "at least one input"),
        ({"input": [5] * 1025}, "context is 1024 tokens"),
        ({"input": "w10", "dimensions": 65}, "embeddings have 64"),
        ({"input": [[7, 500]]}, "outside the vocabulary"),
        ({"input": "w10", "encoding_format": "int8"}, "encoding_format"),
    ]
    for body, message in cases:
        r = httpx.post(f"{url}/v1/embeddings", json=body)
        assert r.status_code == 400 and message in r.json()["error"]["message"], (body, r.text)
    r = httpx.post(f"{url}/v1/embeddings", json={"input": "w10", "model": "other"})
    assert r.status_code == 404 and "other" in r.json()["error"]["message"]
    r = httpx.post(f"{url}/api/embed", json={"model": llm.model_name, "input": []})
    assert r.status_code == 400 and "at least one input" in r.json()["error"]
    # A pooling model refuses generation, in each dialect.
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "w10", "max_tokens": 2})
    assert r.status_code == 400 and "does not generate" in r.json()["error"]["message"]
    r = httpx.post(
        f"{url}/api/generate", json={"model": llm.model_name, "prompt": "w10", "raw": True}
    )
    assert r.status_code == 400 and "does not generate" in r.json()["error"]
    # Still serving, and every block given back.
    r = httpx.post(f"{url}/v1/embeddings", json={"input": "w10 w11"})
    assert r.status_code == 200 and len(r.json()["data"][0]["embedding"]) == 64
    assert llm.engine.kv.pool.num_used == 0


def test_embedding_model_reranks_by_cosine(embed_server) -> None:
    url, _, ref = embed_server
    query, documents = IDS[0], IDS[1:]
    want = [
        torch.dot(hf_pool(ref, query, "last"), hf_pool(ref, d, "last")).item() for d in documents
    ]
    body = {"query": text(query), "documents": [text(d) for d in documents]}
    r = httpx.post(f"{url}/v1/rerank", json=body).json()
    assert [x["index"] for x in r["results"]] == sorted(range(2), key=lambda i: -want[i])
    for x in r["results"]:
        assert x["relevance_score"] == pytest.approx(want[x["index"]], abs=1e-5)


def test_rerank_and_score_order_matches_transformers(qwen3) -> None:
    path, ref = qwen3
    llm = LLM(str(path), dtype="float32", quantization="none", classifier_from_token="no,yes",
              threads=1)  # fmt: skip
    query, documents = "w10 w11 w12", ["w10 w11", "w40 w41 w42 w43", "w12", "w90 w10 w70"]
    expected = [
        hf_yes_score(ref, llm.tokenizer.encode(qwen3_reranker_prompt(query, d))) for d in documents
    ]
    order = sorted(range(4), key=lambda i: -expected[i])
    with serving(create_app(llm)) as url:
        for route in ("/v1/rerank", "/rerank"):
            body = {"query": query, "documents": documents, "top_n": 3}
            r = httpx.post(f"{url}{route}", json=body).json()
            assert [x["index"] for x in r["results"]] == order[:3]
            for x in r["results"]:
                assert x["relevance_score"] == pytest.approx(expected[x["index"]], abs=1e-5)
                assert x["document"]["text"] == documents[x["index"]]
        r = httpx.post(f"{url}/rerank", json={"query": query, "documents": [{"text": "w12"}],
                                              "return_documents": False}).json()  # fmt: skip
        assert "document" not in r["results"][0]
        assert r["results"][0]["relevance_score"] == pytest.approx(expected[2], abs=1e-5)
        for route in ("/score", "/v1/score"):
            r = httpx.post(f"{url}{route}", json={"text_1": query, "text_2": documents}).json()
            assert [d["score"] for d in r["data"]] == pytest.approx(expected, abs=1e-5)
        r = httpx.post(f"{url}/rerank", json={"query": query, "documents": []})
        assert r.status_code == 400 and "at least one text" in r.json()["error"]["message"]
        r = httpx.post(f"{url}/rerank", json={"query": query, "documents": ["w12", LONG]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "documents"
        assert r.json()["error"]["message"].startswith("documents[1]: input is 11")
        r = httpx.post(f"{url}/v1/embeddings", json={"input": "w10"})
        assert r.status_code == 400 and "reranker" in r.json()["error"]["message"]
    assert llm.engine.kv.pool.num_used == 0


def test_generation_model_refuses_pooling_routes(qwen3) -> None:
    path, _ = qwen3
    llm = LLM(str(path), dtype="float32", quantization="none", threads=1)
    with serving(create_app(llm)) as url:
        for route, body in [
            ("/v1/embeddings", {"input": "w10"}),
            ("/rerank", {"query": "w10", "documents": ["w11"]}),
            ("/score", {"text_1": "w10", "text_2": "w11"}),
        ]:
            r = httpx.post(f"{url}{route}", json=body)
            assert r.status_code == 400 and "--pooling" in r.json()["error"]["message"], route
        r = httpx.post(f"{url}/api/embed", json={"model": llm.model_name, "input": "w10"})
        assert r.status_code == 400 and "--pooling" in r.json()["error"]
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "w10", "max_tokens": 2})
        assert r.status_code == 200


def test_sentence_transformers_prompts_as_its_encode(tmp_path, capsys) -> None:
    """A Qwen3-Embedding-like directory's prompts (config_sentence_transformers.json): the
    default prompt before every text, `prompt_name` or `prompt` instead, on LLM.embed and the
    embedding routes and `tinyllm embed`, against sentence-transformers' encode of the same
    directory."""
    from sentence_transformers import SentenceTransformer

    prompts = {"query": "w30 w31 w32 ", "document": "w40 "}
    write_qwen3_embedding(tmp_path, prompts, default_prompt_name="document")
    st = SentenceTransformer(str(tmp_path), device="cpu")
    llm = LLM(str(tmp_path), dtype="float32", quantization="none", threads=1)
    texts = ["w10 w11 w12", "w50 w51"]
    cases = [{}, {"prompt_name": "query"}, {"prompt": "w60 w61 "}, {"prompt": ""}]
    found = []
    for kwargs in cases:
        want = torch.tensor(st.encode(texts, **kwargs))
        got = torch.tensor(
            [o.outputs.embedding for o in llm.embed(texts, use_tqdm=False, **kwargs)]
        )
        assert torch.cosine_similarity(got, want, dim=1).min().item() >= 0.9999, kwargs
        found.append(got)
    # Each prompt changes the vectors: none of them is lost on the way.
    assert all(not torch.allclose(found[0], other, atol=1e-3) for other in found[1:])
    with pytest.raises(ValueError, match="prompt_name='passage' is not one of this model's"):
        llm.embed("w10", prompt_name="passage", use_tqdm=False)
    want = torch.tensor(st.encode(texts, prompt_name="query"))
    with serving(create_app(llm)) as url:
        r = httpx.post(f"{url}/v1/embeddings", json={"input": texts, "prompt_name": "query"})
        got = torch.tensor([d["embedding"] for d in r.json()["data"]])
        assert torch.cosine_similarity(got, want, dim=1).min().item() >= 0.9999
        body = {"model": llm.model_name, "input": texts, "prompt_name": "query"}
        got = torch.tensor(httpx.post(f"{url}/api/embed", json=body).json()["embeddings"])
        assert torch.cosine_similarity(got, want, dim=1).min().item() >= 0.9999
        r = httpx.post(f"{url}/v1/embeddings", json={"input": texts[0]})  # the default prompt
        assert _close(r.json()["data"][0]["embedding"], found[0][0])
        r = httpx.post(f"{url}/v1/embeddings", json={"input": "w10", "prompt_name": "passage"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_name"
        assert "query, document" in r.json()["error"]["message"]
    flags = ["--model", str(tmp_path), "--dtype", "float32", "--quantization", "none"]
    assert main(["embed", *flags, "--threads", "1", "--show", "2", "--prompt-name", "query",
                 texts[0]]) == 0  # fmt: skip
    first = ", ".join(f"{x:.4f}" for x in want[0][:2].tolist())
    assert capsys.readouterr().out.strip() == f"[0] 6 tokens, 64 dims, norm 1.0000: [{first}, ...]"


@pytest.mark.parametrize(
    "route,body,where",
    [
        ("/v1/embeddings", {"input": ["w10", ""]}, "input[1]: the input is empty"),
        ("/v1/embeddings", {"input": ["w10"] * 2049}, "input: 2049 inputs, over 2048"),
        ("/v1/rerank", {"query": "w10", "documents": ["w11", LONG]}, "documents[1]: input is 1100"),
        ("/rerank", {"query": "", "documents": ["w11"]}, "query: the input is empty"),
        ("/rerank", {"query": "w10", "documents": []}, "at least one text on each side"),
        ("/score", {"text_1": LONG, "text_2": ["w11", "w12"]}, "text_1: input is 1100 tokens"),
        ("/v1/score", {"text_1": ["w1", "w2"], "text_2": ["w1", ""]}, "text_2[1]: the input is"),
        ("/v1/score", {"text_1": [], "text_2": "w11"}, "at least one text on each side"),
        ("/api/embed", {"input": []}, "input: give at least one input"),
        ("/api/embed", {"input": "w10 " * 1100, "truncate": False}, "the context is 1024"),
        ("/api/embeddings", {"prompt": ""}, "prompt: the input is empty"),
    ],
)
def test_bad_pooling_input_gets_400_naming_it(embed_server, route, body, where) -> None:
    """Every pooling route refuses bad input (empty, too many, too long) with a 400 that names
    the input and the limit, in its dialect's shape, and goes on serving."""
    url, llm, ref = embed_server
    ollama_route = route.startswith("/api/")
    if ollama_route:
        body = body | {"model": llm.model_name}
    r = httpx.post(f"{url}{route}", json=body)
    message = r.json()["error"] if ollama_route else r.json()["error"]["message"]
    assert r.status_code == 400 and where in message, r.text
    if not ollama_route:
        assert message.startswith(r.json()["error"]["param"]) or "each side" in message
    r = httpx.post(f"{url}/v1/embeddings", json={"input": "w10 w11"})
    assert _close(r.json()["data"][0]["embedding"], hf_pool(ref, [10, 11], "last"))
    assert llm.engine.kv.pool.num_used == 0


@pytest.mark.parametrize(
    "route,body",
    [
        ("/v1/embeddings", {"input": "w10"}),
        ("/v1/rerank", {"query": "w10", "documents": ["w11"]}),
        ("/rerank", {"query": "w10", "documents": ["w11"]}),
        ("/score", {"text_1": "w10", "text_2": "w11"}),
        ("/v1/score", {"text_1": "w10", "text_2": "w11"}),
        ("/api/embed", {"input": "w10"}),
        ("/api/embeddings", {"prompt": "w10"}),
    ],
)
def test_an_unknown_model_is_404_on_every_pooling_route(embed_server, route, body) -> None:
    """As /v1/chat/completions answers (and OpenAI, vLLM and Ollama): 404, in each dialect's
    shape, OpenAI's with code model_not_found."""
    url, llm, _ = embed_server
    messages = [{"role": "user", "content": "w10"}]
    chat = httpx.post(f"{url}/v1/chat/completions", json={"model": "other", "messages": messages})
    r = httpx.post(f"{url}{route}", json=body | {"model": "other"})
    assert r.status_code == chat.status_code == 404
    if route.startswith("/api/"):
        assert r.json() == {"error": "model 'other' not found"}
    else:
        assert r.json()["error"] | {"message": ""} == chat.json()["error"] | {"message": ""}
        assert "`other` does not exist" in r.json()["error"]["message"]
        assert r.json()["error"]["code"] == "model_not_found"
    name = f"{llm.model_name}:latest" if route.startswith("/api/") else llm.model_name
    assert httpx.post(f"{url}{route}", json=body | {"model": name}).status_code == 200
