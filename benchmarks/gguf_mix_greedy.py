"""The default model rewritten with the bit mix of llama.cpp's Q4_K_M, run greedy by transformers
and by tinyllm on the same file: how many tokens tinyllm keeps equal, with quantization="auto"
(each tensor at its own bits) and "int4" (every decoder tensor rounded to 4 bits, which is how
auto ran a file's 5-8-bit tensors before they were kept at 8).

    python -m benchmarks.gguf_mix_greedy [--tokens 32]   (from the repository root)

llama.cpp's Q4_K_M gives this model's attn_v and ffn_down Q6_K in the layers its
use_more_bits picks and Q4_K elsewhere, as the other matrices; rows of 576 weights are not whole
K-quant super-blocks, so it falls back to Q5_0 for Q4_K and Q8_0 for Q6_K there (all but
ffn_down, whose rows hold 1536). The gguf package cannot write K-quants, so ffn_down is Q4_1
where Q4_K would be and Q8_0 where Q6_K would be: the same bits per weight, both packed as
stored. The source weights are the default file's, dequantized.
"""

import argparse
import re
import tempfile
from pathlib import Path

import gguf
import numpy as np
import torch

from tinyllm import LLM, SamplingParams
from tinyllm.loaders.gguf import open_gguf
from tinyllm.loaders.source import default_model_path

Q = gguf.GGMLQuantizationType
PROMPTS = [
    "The capital of Japan is",
    "The three primary colours are",
    "def fibonacci(n):",
    "Water boils at a temperature of",
    "The largest planet in the solar system is",
]


def use_more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's choice of the layers whose attn_v and ffn_down get Q6_K in Q4_K_M."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def q4_k_m_type(name: str, layers: int) -> Q | None:
    """This model's tensor types under Q4_K_M (see the module docstring); None: as it is."""
    if name == "token_embd.weight":
        return Q.Q8_0  # Q6_K, 576-weight rows
    found = re.fullmatch(r"blk\.(\d+)\.(\w+)\.weight", name)
    if found is None or found[2].endswith("norm"):
        return None
    more = use_more_bits(int(found[1]), layers) and found[2] in ("attn_v", "ffn_down")
    if found[2] == "ffn_down":
        return Q.Q8_0 if more else Q.Q4_1
    return Q.Q8_0 if more else Q.Q5_0


def write_mix(source: Path, path: Path) -> None:
    reader = open_gguf(source)
    arch = reader.get_field("general.architecture").contents()
    layers = reader.get_field(f"{arch}.block_count").contents()
    writer = gguf.GGUFWriter(path, arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue  # the header's own, and what the writer adds itself
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), field.types[0], sub)
    for tensor in reader.tensors:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        qtype = q4_k_m_type(tensor.name, layers)
        if qtype is None:
            writer.add_tensor(tensor.name, np.asarray(values, np.float32))
        else:
            writer.add_tensor(tensor.name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def equal_prefix(a: list[int], b: list[int]) -> int:
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "q4_k_m-like.gguf"
        write_mix(default_model_path(), path)
        tokenizer = AutoTokenizer.from_pretrained(tmp, gguf_file=path.name)
        reference = AutoModelForCausalLM.from_pretrained(
            tmp, gguf_file=path.name, dtype=torch.float32
        )
        prompts = [tokenizer(p).input_ids for p in PROMPTS]
        expected = []
        for ids in prompts:
            out = reference.generate(
                torch.tensor([ids]), max_new_tokens=args.tokens, do_sample=False
            )
            expected.append(out[0, len(ids) :].tolist())
        params = SamplingParams(temperature=0, max_tokens=args.tokens)
        for quantization in ("auto", "int4"):
            llm = LLM(str(path), quantization=quantization, dtype="float32")
            outputs = llm.generate(prompts, params, use_tqdm=False)
            print(f"quantization={quantization}: tokens equal to transformers' before the first")
            for prompt, want, got in zip(PROMPTS, expected, outputs, strict=True):
                ids = got.outputs[0].token_ids
                print(f"  {equal_prefix(ids, want):2d} / {args.tokens}  {prompt!r} ->")
                print(f"      tinyllm:      {tokenizer.decode(ids)!r}")
                print(f"      transformers: {tokenizer.decode(want)!r}")


if __name__ == "__main__":
    main()
