"""Time loading a GGUF file: process start to first token, several runs, min and median, and
the peak resident memory.

`--write CONFIG` first writes a GGUF file with a named real config's shapes (tinyllm's
loaders/configs, e.g. llama-3.2-1b) and random blocks of one type (Q4_0, Q4_1 or Q8_0) to a
temporary directory, with a small byte-level tokenizer (and no rope scaling): real shapes
without a download. Without
it the default model is timed. Each run is a fresh `python -c` that loads with LLM() and
generates one token from token ids, so imports, the file's open and the packing are all counted
(the kernels are compiled once, before the first timed run). Meant for A/B runs of two
checkouts, each with its own TORCH_EXTENSIONS_DIR:

    python benchmarks/gguf_load_time.py                            # the default model
    python benchmarks/gguf_load_time.py --write llama-3.2-1b --type Q4_0 --runs 3
"""

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import gguf
import numpy as np

from tinyllm.loaders.dummy import dummy_config
from tinyllm.loaders.source import default_model_path
from tinyllm.model.config import ModelConfig

Q = gguf.GGMLQuantizationType
BLOCK_TYPES = {"Q4_0": Q.Q4_0, "Q4_1": Q.Q4_1, "Q8_0": Q.Q8_0}
# Each type's fp16 fields at the start of a block: d, and Q4_1's m.
_F16_FIELDS = {Q.Q4_0: (0.01,), Q.Q4_1: (0.01, -0.08), Q.Q8_0: (0.001,)}

_RUN = """
import resource, sys, time
start = float(sys.argv[2])
from tinyllm import LLM, SamplingParams
llm = LLM(sys.argv[1], threads=int(sys.argv[3]) or None)
llm.generate([1, 2, 3], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
print(time.time() - start, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20)
"""


def random_blocks(shape: tuple[int, int], qtype: Q, rng: np.random.Generator) -> np.ndarray:
    """Random codes with a fixed, plausible scale (and offset): the bytes of `shape`'s blocks."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    n_bytes = shape[0] * shape[1] // block_size * type_size
    blocks = np.frombuffer(bytearray(rng.bytes(n_bytes)), np.uint8).reshape(-1, type_size)
    for i, value in enumerate(_F16_FIELDS[qtype]):
        blocks[:, 2 * i : 2 * i + 2] = np.array([value], np.float16).view(np.uint8)
    return blocks.reshape(shape[0], -1)


def add_byte_tokenizer(writer: gguf.GGUFWriter, vocab_size: int) -> None:
    """A byte-level BPE vocabulary of `vocab_size` tokens that tinyllm and llama.cpp both load:
    GPT-2's 256 byte symbols (so any text encodes), one merge (llama.cpp requires the list),
    then filler tokens; the last token is end-of-sequence."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    shifted = 256 - len(printable)  # the other bytes are spelled chr(256), chr(257), ...
    symbols = [chr(b) for b in printable] + [chr(256 + i) for i in range(shifted)]
    space = chr(256 + 32)  # GPT-2 spells the byte 32 (space) as "Ġ"
    tokens = symbols + [space + "t"]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")  # GPT-2's split, a name tinyllm and llama.cpp both know
    writer.add_token_list(tokens + [f"<t{i}>" for i in range(vocab_size - len(tokens))])
    writer.add_token_merges([f"{space} t"])
    writer.add_eos_token_id(vocab_size - 1)


def _tensors(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    """GGUF tensor name -> HF shape (rows first), for a Llama-like config."""
    h, ffn = c.hidden_size, c.intermediate_size
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    shapes = {"token_embd.weight": (c.vocab_size, h), "output_norm.weight": (h,)}
    if not c.tie_word_embeddings:
        shapes["output.weight"] = (c.vocab_size, h)
    layer = {
        "attn_norm.weight": (h,), "ffn_norm.weight": (h,),
        "attn_q.weight": (q, h), "attn_k.weight": (kv, h), "attn_v.weight": (kv, h),
        "attn_output.weight": (h, q),
        "ffn_gate.weight": (ffn, h), "ffn_up.weight": (ffn, h), "ffn_down.weight": (h, ffn),
    }  # fmt: skip
    if c.attention_bias:
        layer |= {"attn_q.bias": (q,), "attn_k.bias": (kv,), "attn_v.bias": (kv,)}
    if c.qk_norm:
        layer |= {"attn_q_norm.weight": (c.head_dim,), "attn_k_norm.weight": (c.head_dim,)}
    for i in range(c.num_layers):
        shapes |= {f"blk.{i}.{name}": shape for name, shape in layer.items()}
    return shapes


def write_gguf(path: Path, model: str, qtype: Q, seed: int = 0) -> Path:
    """A GGUF file with `model`'s config (a named config or a config.json), random `qtype`
    blocks for every matrix, F32 ones for norms and biases, and a byte-level tokenizer."""
    _, _, c = dummy_config(model)
    arch = c.architecture
    writer = gguf.GGUFWriter(path, arch)
    writer.add_uint32(f"{arch}.block_count", c.num_layers)
    writer.add_uint32(f"{arch}.context_length", c.max_position_embeddings)
    writer.add_uint32(f"{arch}.embedding_length", c.hidden_size)
    writer.add_uint32(f"{arch}.feed_forward_length", c.intermediate_size)
    writer.add_uint32(f"{arch}.attention.head_count", c.num_heads)
    writer.add_uint32(f"{arch}.attention.head_count_kv", c.num_kv_heads)
    writer.add_uint32(f"{arch}.attention.key_length", c.head_dim)
    writer.add_uint32(f"{arch}.attention.value_length", c.head_dim)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", c.rms_norm_eps)
    writer.add_float32(f"{arch}.rope.freq_base", c.rope_theta)
    writer.add_uint32(f"{arch}.vocab_size", c.vocab_size)
    add_byte_tokenizer(writer, c.vocab_size)
    rng = np.random.default_rng(seed)
    for name, shape in _tensors(c).items():
        if len(shape) == 1:
            writer.add_tensor(name, np.ones(shape, np.float32))
        else:
            writer.add_tensor(name, random_blocks(shape, qtype, rng), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def time_load(path: Path, runs: int, threads: int) -> list[tuple[float, float]]:
    """(seconds from process start to the first token, peak resident GiB), one fresh process
    per run."""
    results = []
    for _ in range(runs + 1):  # the first run compiles the kernels if needed: not counted
        start = f"{time.time():.6f}"
        out = subprocess.run(
            [sys.executable, "-c", _RUN, str(path), start, str(threads)],
            check=True, capture_output=True, text=True,
        )  # fmt: skip
        seconds, peak = out.stdout.split()[-2:]
        results.append((float(seconds), float(peak)))
    return results[1:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--write", metavar="CONFIG", help="write a file of this config first")
    parser.add_argument("--type", choices=BLOCK_TYPES, default="Q4_0")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="0: tinyllm's default")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        if args.write:
            path = Path(tmp) / f"{args.write}.{args.type}.gguf"
            start = time.perf_counter()
            write_gguf(path, args.write, BLOCK_TYPES[args.type])
            size = path.stat().st_size / 2**30
            print(f"wrote {path.name}: {size:.2f} GiB in {time.perf_counter() - start:.1f} s")
        else:
            path = default_model_path()
        results = time_load(path, args.runs, args.threads)
    times = [seconds for seconds, _ in results]
    print(
        f"{path.name}: process start to first token, {args.runs} runs: "
        f"min {min(times):.2f} s, median {statistics.median(times):.2f} s; "
        f"peak resident {max(peak for _, peak in results):.2f} GiB"
    )


if __name__ == "__main__":
    main()
