"""The default model's linear layers in each weight format, by batch rows: what decides the
engine's `quantization` and `dtype` defaults.

One decode step of SmolLM2-135M runs 211 linear layers (30 x q, k, v, o, gate, up, down, and
the LM head). This builds all of them in each format, random weights of the real shapes, and
runs them one after another as a step does, so their weights come from memory, not from the
last layer's cache. Formats:

    fp32, bf16       dense nn.Linear
    int8/fp32, ...   QuantLinear (model/quant.py): 8-bit blocks of 32, fp32 or bf16 activations
    int4/fp32, ...   QuantLinear, 4-bit blocks of 32; LM head 8-bit
    torch-int4/bf16  the baseline: torch's own int4 kernel (_weight_int4pack_mm_for_cpu), groups
                     of 32, bf16 activations (it is 10-60x slower with fp32); LM head dense bf16

Printed per row count: milliseconds for the 211 layers (best of `--reps`, formats taking
turns), and at one row the weight bytes read over the time, against the read bandwidth measured
in the same run.

Run: python benchmarks/linear_kernels.py [--rows 1 4 16 64 256] [--threads 2]
"""

import argparse

import torch
from torch import nn

from tinyllm.entrypoints.bench.machine import best_seconds, read_bandwidth
from tinyllm.model.quant import GROUP, QuantLinear, int4_groups, int8_groups

HIDDEN, FFN, KV, VOCAB, LAYERS = 576, 1536, 192, 49152, 30
SHAPES = [(HIDDEN, HIDDEN), (KV, HIDDEN), (KV, HIDDEN), (HIDDEN, HIDDEN)]
SHAPES += [(FFN, HIDDEN), (FFN, HIDDEN), (HIDDEN, FFN)]


class TorchInt4(nn.Module):
    def __init__(self, w: torch.Tensor):
        super().__init__()
        g = int4_groups(w)
        self.in_features = w.shape[1]
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(g.q.to(torch.int32), 1)
        table = torch.stack([g.scale, g.zero + 8 * g.scale], dim=-1).transpose(0, 1)
        self.register_buffer("packed", packed)
        self.register_buffer("scales_and_zeros", table.contiguous().bfloat16())

    def forward(self, x):
        return torch.ops.aten._weight_int4pack_mm_for_cpu(
            x, self.packed, GROUP, self.scales_and_zeros
        )


def build(fmt: str, gen: torch.Generator) -> list[nn.Module]:
    kind, _, act = fmt.partition("/")
    dtype = torch.bfloat16 if "bf16" in fmt else torch.float32
    layers = []
    for i, (n, k) in enumerate(SHAPES * LAYERS + [(VOCAB, HIDDEN)]):
        w = torch.randn(n, k, generator=gen) * 0.02
        head = i == len(SHAPES) * LAYERS
        if kind == "torch-int4" and not head:
            layers.append(TorchInt4(w))
        elif kind == "int4" and not head:
            layers.append(QuantLinear(int4_groups(w), None, dtype, in_features=k))
        elif kind in ("int4", "int8"):
            layers.append(QuantLinear(int8_groups(w), None, dtype, in_features=k))
        else:
            dense = nn.Linear(k, n, bias=False, dtype=dtype)
            dense.weight.data.copy_(w)
            layers.append(dense)
    return layers


def weight_bytes(layers: list[nn.Module]) -> int:
    tensors = [t for m in layers for t in (*m.parameters(), *m.buffers())]
    return sum(t.numel() * t.element_size() for t in tensors)


@torch.inference_mode()
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    formats = ["fp32", "bf16", "int8/fp32", "int4/fp32", "int4/bf16", "torch-int4/bf16"]
    gen = torch.Generator().manual_seed(0)
    models = {f: build(f, gen) for f in formats}
    bandwidth = read_bandwidth(torch.device("cpu"))
    print(f"threads {torch.get_num_threads()}, read bandwidth {bandwidth / 1e9:.1f} GB/s")
    print("weights MB: " + ", ".join(f"{f} {weight_bytes(m) / 1e6:.0f}" for f, m in models.items()))
    print("rows  " + "".join(f"{f:>16}" for f in formats) + "   (ms for the 211 layers)")
    for rows in args.rows:
        best = dict.fromkeys(formats, float("inf"))
        for _ in range(args.reps):  # formats take turns, so a disturbance hits them alike
            for f, layers in models.items():
                dtype = torch.bfloat16 if "bf16" in f else torch.float32
                xs = {k: torch.randn(rows, k, dtype=dtype) for k in (HIDDEN, FFN)}
                best[f] = min(
                    best[f],
                    best_seconds(lambda: [m(xs[m.in_features]) for m in layers], reps=1),  # noqa: B023
                )
        print(f"{rows:>4}  " + "".join(f"{best[f] * 1e3:>16.1f}" for f in formats))
        if rows == 1:
            share = [weight_bytes(models[f]) / best[f] / bandwidth for f in formats]
            print("      " + "".join(f"{s:>15.0%} " for s in share) + "  of read bandwidth")


if __name__ == "__main__":
    main()
