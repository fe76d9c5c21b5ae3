"""Perplexity of tinyllm against transformers on the same GGUF files: the default model's
weights (its Q4_1 file, dequantized) written as Q8_0 and as llama.cpp's Q4_K_M mix, each run
by transformers (which dequantizes the file to fp32 itself: the file's own weights) and by
tinyllm through its prompt logprobs; then greedy continuations on the Q4_K_M file.

    python -m benchmarks.gguf_perplexity [--windows 4 --window 512 --tokens 32]
    (from the repository root)

The text: docstrings of a few standard-library modules, in source order (deterministic for a
Python version), cut into windows scored from their first token. tinyllm runs (CONFIGS) `auto`
as `LLM(path)` does (int4, the file's 5-8-bit tensors at 8 bits; bf16 activations on a CPU
with AMX), the same with fp32 activations, a forced `int4` (every decoder tensor at 4 bits),
and `none` (dense fp32 weights, the file dequantized as transformers does it). On the Q4_K_M
file also the weights tinyllm packs, decoded back and run dense in fp32: what the packing
alone changes, without the kernel.

The Q4_K_M mix is llama.cpp's (llama-quant.cpp, llama_tensor_get_type): Q4_K by default;
Q6_K for attn_v and ffn_down in the layers use_more_bits picks and for the output (the tied
embedding here); a tensor whose rows are not whole super-blocks of 256 falls back, Q4_K to
Q5_0 and Q6_K to Q8_0. This model's rows hold 576 weights except ffn_down's 1536: only
ffn_down is a K-quant (Q4_K or Q6_K), as in the file llama-quantize makes of it. K-quant
blocks come from tests/gguf_encoders.py (llama.cpp's reference quantizers), the others from
the gguf package's quantize.

A second table: what tinyllm's packing changes in each of the Q4_K_M file's tensors (its
groups decoded back, against the gguf package's dequantize), per type, as the RMS change over
the RMS weight and over the RMS error the file's own rounding left (against the source).
"""

import argparse
import ast
import importlib
import math
import re
import sys
import tempfile
import time
from pathlib import Path

import gguf
import numpy as np
import torch

from tests.gguf_encoders import quantize
from tinyllm import LLM, SamplingParams
from tinyllm.loaders.gguf import open_gguf
from tinyllm.loaders.gguf_blocks import KERNEL_BITS, groups
from tinyllm.loaders.source import default_model_path
from tinyllm.model.precision import resolve_dtype
from tinyllm.model.quant import pack, unpack

Q = gguf.GGMLQuantizationType
PROMPTS = [
    "The capital of Japan is",
    "The three primary colours are",
    "def fibonacci(n):",
    "Water boils at a temperature of",
    "The largest planet in the solar system is",
]
TEXT_MODULES = ["textwrap", "json", "argparse", "functools", "fractions", "shlex"]
# tinyllm's configurations: label -> (quantization, dtype). "auto" is `LLM(path)`'s default,
# whose activations are bf16 on a CPU with AMX and fp32 elsewhere; "none" is dense fp32 weights,
# the file dequantized as transformers does it.
CONFIGS = {
    "auto": ("auto", None),
    "auto, fp32 act.": ("auto", "float32"),
    "int4, fp32 act.": ("int4", "float32"),
    "none": ("none", "float32"),
}
# A forced int4 only where the file has 5-8-bit tensors beside 4-bit ones: on the Q8_0 file
# it is only a coarser model.
RUNS = {"Q8_0": ("auto", "auto, fp32 act.", "none"), "Q4_K_M": tuple(CONFIGS)}
PACKED = "packed weights, dense fp32"  # the Q4_K_M file's row without the kernel
GREEDY = ("auto", "auto, fp32 act.", "int4, fp32 act.", PACKED)


def use_more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's choice of the layers whose attn_v and ffn_down get Q6_K in Q4_K_M: the
    first and last eighth, and every third layer between."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def q4_k_m_type(name: str, layers: int, k: int) -> Q:
    """A weight's type under llama.cpp's Q4_K_M (see the module docstring); k: its row length.
    token_embd takes the output's type as llama.cpp gives it to a tied embedding (this model's);
    an untied one would keep the default."""
    found = re.fullmatch(r"blk\.(\d+)\.(\w+)\.weight", name)
    more = found is not None and found[2] in ("attn_v", "ffn_down")
    if name in ("output.weight", "token_embd.weight") or (
        more and use_more_bits(int(found[1]), layers)
    ):
        return Q.Q6_K if k % 256 == 0 else Q.Q8_0
    return Q.Q4_K if k % 256 == 0 else Q.Q5_0


MIXES = {
    "Q8_0": (lambda name, layers, k: Q.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0),
    "Q4_K_M": (q4_k_m_type, gguf.LlamaFileType.MOSTLY_Q4_K_M),
}


def write_like(reader: gguf.GGUFReader, path: Path, file_type: int, tensors) -> None:
    """A file with `reader`'s metadata (but `file_type`) and `tensors`: (name, array, raw type
    or None for a dense one)."""
    writer = gguf.GGUFWriter(path, reader.get_field("general.architecture").contents())
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name in (
            "general.architecture",
            "general.file_type",
        ):
            continue  # the header's own, and what the writer adds itself
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), field.types[0], sub)
    writer.add_file_type(file_type)
    for name, values, qtype in tensors:
        writer.add_tensor(name, values, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_mix(source: Path, path: Path, mix: str) -> dict[str, np.ndarray]:
    """The source file's model with its weights in `mix`; returns the source weights, dense."""
    type_of, file_type = MIXES[mix]
    reader = open_gguf(source)
    layers = reader.get_field(
        f"{reader.get_field('general.architecture').contents()}.block_count"
    ).contents()
    dense = {
        t.name: np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float32)
        for t in reader.tensors
    }
    tensors = (
        (name, w, None)
        if w.ndim == 1  # norms stay F32, as llama.cpp keeps them
        else (name, quantize(w, qtype := type_of(name, layers, w.shape[1])), qtype)
        for name, w in dense.items()
    )
    write_like(reader, path, file_type, tensors)
    return dense


def write_packed(path: Path, packed_path: Path, source: dict[str, np.ndarray]) -> list[str]:
    """`path`'s model with each tensor tinyllm packs (KERNEL_BITS types) as the dense weights
    its groups decode to, written to `packed_path`; returns the second table's lines (see the
    module docstring)."""
    reader = open_gguf(path)
    sums: dict[str, list[float]] = {}  # per type: change^2, weight^2, own error^2, tensors

    def tensors():
        for t in reader.tensors:
            if t.tensor_type not in KERNEL_BITS:
                yield t.name, np.asarray(t.data), None
                continue
            n, k = (int(d) for d in reversed(t.shape))
            oracle = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float64)
            g = groups(t.data, t.tensor_type, (n, k))
            decoded = unpack(pack(g), g.bits)[:n].double().numpy()
            add = sums.setdefault(t.tensor_type.name, [0.0, 0.0, 0.0, 0])
            add[0] += np.square(decoded - oracle).sum()
            add[1] += np.square(oracle).sum()
            add[2] += np.square(oracle - source[t.name]).sum()
            add[3] += 1
            yield t.name, decoded.astype(np.float32), None

    write_like(reader, packed_path, gguf.LlamaFileType.ALL_F32, tensors())
    lines = ["| type | tensors | RMS change / RMS weight | RMS change / file's own RMS error |"]
    lines.append("|---|---|---|---|")
    for name, (change, weight, own, count) in sums.items():
        of_weight, of_own = math.sqrt(change / weight), math.sqrt(change / own)
        lines.append(f"| {name} | {count} | {of_weight:.2e} | {of_own:.3f} |")
    return lines


def stdlib_text() -> str:
    """The docstrings of TEXT_MODULES (module, classes, functions) in source order."""
    docs = []
    for name in TEXT_MODULES:
        tree = ast.parse(Path(importlib.import_module(name).__file__).read_text())
        nodes = [tree] + sorted(
            (
                n
                for n in ast.walk(tree)
                if isinstance(n, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
            ),
            key=lambda n: n.lineno,
        )
        docs += [doc for n in nodes if (doc := ast.get_docstring(n))]
    return "\n\n".join(docs)


def perplexity(logprobs: list[float]) -> float:
    return math.exp(-sum(logprobs) / len(logprobs))


def transformers_logprobs(model, windows: list[list[int]]) -> list[float]:
    out = []
    with torch.inference_mode():
        for ids in windows:
            logits = model(torch.tensor([ids])).logits[0, :-1].float()
            picked = logits.log_softmax(-1).gather(1, torch.tensor(ids[1:])[:, None])
            out += picked[:, 0].tolist()
    return out


def tinyllm_logprobs(llm: LLM, windows: list[list[int]]) -> list[float]:
    params = SamplingParams(prompt_logprobs=0, max_tokens=1)
    outputs = llm.generate(windows, params, use_tqdm=False)
    return [lp.logprob for o in outputs for lp in o.prompt_logprobs[1:]]


def tinyllm_llm(path: Path, config: str) -> LLM:
    quantization, dtype = CONFIGS[config]
    return LLM(str(path), quantization=quantization, dtype=dtype, generation_config="vllm")


def equal_prefix(a: list[int], b: list[int]) -> int:
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--windows", type=int, default=4)
    parser.add_argument("--window", type=int, default=512, help="tokens per window")
    parser.add_argument("--tokens", type=int, default=32, help="greedy tokens per prompt")
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.perf_counter()

    def progress(what: str) -> None:
        print(f"[{time.perf_counter() - start:4.0f} s] {what}", file=sys.stderr, flush=True)

    default_dtype, _ = resolve_dtype(None, torch.device("cpu"))
    skip = {"auto, fp32 act."} if default_dtype == torch.float32 else set()  # the same as auto
    with tempfile.TemporaryDirectory() as tmp:
        paths = {mix: Path(tmp) / f"{mix}.gguf" for mix in MIXES}
        for mix, path in paths.items():
            source = write_mix(default_model_path(), path, mix)
            progress(f"wrote {mix}")
        tokenizer = AutoTokenizer.from_pretrained(tmp, gguf_file=paths["Q8_0"].name)
        ids = tokenizer(stdlib_text()).input_ids
        need = args.windows * args.window
        assert len(ids) >= need, f"the text has {len(ids)} tokens, fewer than {need}"
        windows = [ids[i * args.window : (i + 1) * args.window] for i in range(args.windows)]
        prompts = [tokenizer(p).input_ids for p in PROMPTS]
        print(f"{need} tokens of docstrings ({', '.join(TEXT_MODULES)}), {args.windows} windows")
        print(f"auto's activations here: {str(default_dtype).removeprefix('torch.')}")
        print("\n| file | tinyllm | transformers ppl | tinyllm ppl | ratio |")
        print("|---|---|---|---|---|", flush=True)
        greedy = {}  # "transformers" and each tinyllm configuration: each prompt's tokens
        for mix, path in paths.items():
            reference = AutoModelForCausalLM.from_pretrained(
                tmp, gguf_file=path.name, dtype=torch.float32
            ).eval()
            expected = perplexity(transformers_logprobs(reference, windows))
            if mix == "Q4_K_M":
                greedy["transformers"] = [
                    reference.generate(
                        torch.tensor([p]), max_new_tokens=args.tokens, do_sample=False
                    )[0, len(p) :].tolist()
                    for p in prompts
                ]
            del reference
            progress(f"transformers on {mix}")
            runs = [(c, path) for c in RUNS[mix] if c not in skip]
            if mix == "Q4_K_M":  # the weights tinyllm packs, decoded, run dense: no kernel
                packed = Path(tmp) / "packed.gguf"
                table = write_packed(path, packed, source)
                runs.append(("none", packed))
            for config, file in runs:
                llm = tinyllm_llm(file, config)
                got = perplexity(tinyllm_logprobs(llm, windows))
                label = PACKED if file != path else config
                print(f"| {mix} | {label} | {expected:.4f} | {got:.4f} ", end="")
                print(f"| {got / expected - 1:+.2%} |", flush=True)
                if mix == "Q4_K_M" and label in GREEDY:
                    params = SamplingParams(temperature=0, max_tokens=args.tokens)
                    outs = llm.generate(prompts, params, use_tqdm=False)
                    greedy[label] = [o.outputs[0].token_ids for o in outs]
                del llm
                progress(f"tinyllm {label} on {mix}")
    print("\nWhat packing changes in the Q4_K_M file's weights, per type:")
    print("\n".join(table))
    print(f"\nGreedy on the Q4_K_M file, {args.tokens} tokens: tokens equal to transformers'")
    for config in (c for c in GREEDY if c in greedy):
        print(config)
        pairs = zip(PROMPTS, greedy["transformers"], greedy[config], strict=True)
        for prompt, want, got in pairs:
            print(f"  {equal_prefix(got, want):2d} / {args.tokens}  {prompt!r}")
            print(f"      tinyllm:      {tokenizer.decode(got)!r}")
            print(f"      transformers: {tokenizer.decode(want)!r}")
    progress("done")


if __name__ == "__main__":
    main()
