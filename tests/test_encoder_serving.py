"""Encoder embedding models and cross-encoders as users run them: a sentence-transformers
directory given to `LLM` and to the real server, against sentence-transformers on the same
directory (SentenceTransformer.encode, CrossEncoder.predict), texts in and vectors or scores out
(the pieces apart are tests/test_encoders.py's and tests/test_pooling.py's)."""

import httpx
import openai
import pytest
import torch
from sentence_transformers import CrossEncoder, SentenceTransformer

from tests.encoder_runs import write_encoder
from tests.http_server import serving
from tinyllm import LLM
from tinyllm.entrypoints.server.app import create_app

TEXTS = ["w4 w5 w6", "w10 w11 w12 w13 w14 w15 w16", "w40", "w7 w8 w9 w20 w21"]


def _cosines(got: list[list[float]], want) -> list[float]:
    got, want = torch.tensor(got), torch.as_tensor(want).float()
    return torch.cosine_similarity(got, want, dim=1).tolist()


@pytest.mark.parametrize("family,pooling", [("bert", "mean"), ("xlm-roberta", "cls"),
                                            ("nomic_bert", "mean")])  # fmt: skip
def test_llm_and_server_embed_as_sentence_transformers(family, pooling, tmp_path):
    path = tmp_path / "st"
    write_encoder(path, family, pooling)
    want = SentenceTransformer(str(path), device="cpu").encode(TEXTS)
    llm = LLM(str(path), dtype="float32", quantization="none", threads=1)
    got = [o.outputs.embedding for o in llm.embed(TEXTS, use_tqdm=False)]
    assert min(_cosines(got, want)) >= 0.9999
    with serving(create_app(llm)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
        served = client.embeddings.create(model=llm.model_name, input=TEXTS)
        assert min(_cosines([d.embedding for d in served.data], want)) >= 0.9999
        # An encoder generates nothing: the generation routes say so and the server goes on.
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "w4", "max_tokens": 2})
        assert r.status_code == 400
        assert httpx.post(f"{url}/v1/embeddings", json={"input": "w4"}).status_code == 200
    assert llm.engine.kv.pool.num_used == 0


@pytest.mark.parametrize("family", ["bert", "xlm-roberta"])
def test_cross_encoder_scores_and_rerank_as_sentence_transformers(family, tmp_path):
    path = tmp_path / "ce"
    write_encoder(path, family, labels=1)
    query, documents = "w4 w5 w6", ["w4 w5", "w30 w31 w32", "w6", "w50 w4 w51 w52"]
    want = CrossEncoder(str(path), device="cpu").predict([(query, d) for d in documents])
    want = torch.as_tensor(want).float().tolist()  # sigmoid of the one logit, as ours
    llm = LLM(str(path), dtype="float32", quantization="none", threads=1)
    got = [o.outputs.score for o in llm.score(query, documents, use_tqdm=False)]
    assert got == pytest.approx(want, abs=1e-5)
    order = sorted(range(len(documents)), key=lambda i: -want[i])
    with serving(create_app(llm)) as url:
        body = {"query": query, "documents": documents, "top_n": 2}
        r = httpx.post(f"{url}/v1/rerank", json=body).json()
        assert [x["index"] for x in r["results"]] == order[:2]
        for x in r["results"]:
            assert x["relevance_score"] == pytest.approx(want[x["index"]], abs=1e-5)
    assert llm.engine.kv.pool.num_used == 0
