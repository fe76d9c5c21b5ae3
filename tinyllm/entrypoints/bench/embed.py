"""`tinyllm bench embed`: texts per second embedding N texts of 16-256 tokens, against
sentence-transformers on the same checkpoint in the same run, and how close the two agree.

The texts are random token ids decoded by the model's tokenizer, so both sides embed the same
strings. The baseline is a HF model directory read by sentence-transformers: its own
modules.json where the checkpoint has one, else the pooling tinyllm runs (Transformer,
Pooling, Normalize when tinyllm normalizes).
"""

import argparse
import importlib.util
import random
import time
from pathlib import Path

import torch

from tinyllm.entrypoints.args import build_llm
from tinyllm.entrypoints.bench.baseline import INSTALL_BASELINE
from tinyllm.loaders.source import resolve_model

# sentence-transformers' names for tinyllm's pooling.
_ST_POOLING = {"last": "lasttoken", "mean": "mean", "cls": "cls"}
ST_BATCH = 32


def make_texts(tokenizer, vocab_size: int, n: int, seed: int) -> list[str]:
    """`n` texts of U[16, 256] random tokens (ids away from the vocabulary's ends, where the
    special tokens sit), decoded."""
    rng = random.Random(seed)
    low, high = min(100, vocab_size // 4), max(vocab_size - 100, vocab_size * 3 // 4)
    return [
        tokenizer.decode([rng.randrange(low, high) for _ in range(rng.randint(16, 256))])
        for _ in range(n)
    ]


def load_sentence_transformer(path: Path, pooling: str, normalize: bool):
    if importlib.util.find_spec("sentence_transformers") is None:
        raise ValueError(
            f"the baseline needs sentence-transformers: install it with `{INSTALL_BASELINE}`, "
            "or pass --baseline none"
        )
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer

    if (path / "modules.json").exists():
        return SentenceTransformer(str(path), device="cpu")
    body = Transformer(str(path))
    modules = [body, Pooling(body.get_embedding_dimension(), _ST_POOLING[pooling])]
    return SentenceTransformer(modules=modules + ([Normalize()] if normalize else []), device="cpu")


def run_embed(args: argparse.Namespace) -> None:
    llm = build_llm(args)
    spec = llm.engine.pooling
    if spec is None or spec.scorer is not None:
        raise ValueError("bench embed needs an embedding model (or --pooling last|mean|cls)")
    texts = make_texts(llm.tokenizer, llm.engine.vocab_size, args.num_texts, args.seed)
    start = time.perf_counter()
    ours = torch.tensor([o.outputs.embedding for o in llm.embed(texts, use_tqdm=False)])
    seconds = time.perf_counter() - start
    print(f"tinyllm: {len(texts) / seconds:.1f} texts/s ({len(texts)} texts in {seconds:.2f} s)")
    if args.baseline == "none":
        return
    path = resolve_model(args.model)
    if path.suffix == ".gguf":
        raise ValueError("the sentence-transformers baseline reads a HF model directory")
    normalize = llm.engine.model_config.normalize
    st = load_sentence_transformer(path, spec.pooling, normalize)
    start = time.perf_counter()
    theirs = st.encode(texts, batch_size=ST_BATCH, convert_to_tensor=True).float().cpu()
    st_seconds = time.perf_counter() - start
    cosine = torch.nn.functional.cosine_similarity(ours, theirs, dim=-1)
    print(
        f"sentence-transformers: {len(texts) / st_seconds:.1f} texts/s (batches of {ST_BATCH})"
        f"\nratio: {st_seconds / seconds:.2f}x; cosine to sentence-transformers: min "
        f"{cosine.min().item():.6f}, mean {cosine.mean().item():.6f}"
    )
