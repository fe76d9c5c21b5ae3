"""The mixture-of-experts ops (model/moe_ops.cpp): moe_experts, the experts of a step grouped
by expert, against a plain loop over each token's slots; decoder_moe, the whole block (norm,
router, experts), against transformers' Qwen3-MoE block; a token's bits whatever shares its
step; and the errors that name the argument and the shape it should have."""

import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import (
    Qwen3MoeRMSNorm,
    Qwen3MoeSparseMoeBlock,
)

from tests.test_quant import quantized_activations
from tinyllm.model.cpu_library import library_error
from tinyllm.model.layer_ops import silu_and_mul_torch
from tinyllm.model.quant import int4_groups, int8_groups, pack

pytestmark = pytest.mark.skipif(
    library_error() is not None, reason=f"CPU library did not build: {library_error()}"
)
ops = torch.ops.tinyllm

# intermediate 48: down's inputs end in a partial block of 32 when quantized.
HIDDEN, INTERMEDIATE, EXPERTS = 64, 48, 8
QUANTIZE = {"int4": int4_groups, "int8": int8_groups}


class Experts:
    """Random experts in one weight format: what the op takes (dense, or packed records) and
    the dense weights the loop multiplies by (the packed ones dequantized)."""

    def __init__(self, fmt: str, seed: int, hidden: int = HIDDEN, experts: int = EXPERTS):
        gen = torch.Generator().manual_seed(seed)
        self.quantized = fmt in QUANTIZE
        dtype = torch.bfloat16 if fmt == "bf16" else torch.float32
        self.gate_up, self.down, self.dense_gate_up, self.dense_down = [], [], [], []
        for _ in range(experts):
            for shape, ours, dense in (
                ((2 * INTERMEDIATE, hidden), self.gate_up, self.dense_gate_up),
                ((hidden, INTERMEDIATE), self.down, self.dense_down),
            ):
                w = (torch.randn(shape, generator=gen) / shape[1] ** 0.5).to(dtype)
                if self.quantized:
                    groups = QUANTIZE[fmt](w)
                    ours.append(pack(groups))
                    dense.append(groups.dequantize())
                else:
                    ours.append(w)
                    dense.append(w)

    def project(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """x W^T in x's dtype, as the op's linear computes it: on the activations as the
        quantized kernel rounds them (zero-padded to whole blocks, as the dequantized W is)."""
        if self.quantized:
            return (quantized_activations(x).double() @ w.double().T).to(x.dtype)
        return F.linear(x, w)

    def loop(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Each token, each of its slots in order: the expert's MLP on the token alone, times
        the slot's weight, summed in fp32, rounded once."""
        out = torch.zeros(x.shape, dtype=torch.float32)
        for t in range(len(x)):
            for j in range(ids.shape[1]):
                e = int(ids[t, j])
                h = self.project(x[t : t + 1], self.dense_gate_up[e])
                y = self.project(silu_and_mul_torch(h), self.dense_down[e])
                out[t] += weights[t, j] * y[0].float()
        return out.to(x.dtype)

    def run(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return ops.moe_experts(x, ids, weights, self.gate_up, self.down, INTERMEDIATE)


def routing(tokens: int, k: int, gen: torch.Generator, experts: int = EXPERTS):
    """Each token's k distinct experts, in a random order, and positive weights."""
    ids = torch.rand(tokens, experts, generator=gen).argsort(dim=1)[:, :k].contiguous()
    return ids, torch.rand(tokens, k, generator=gen) + 0.1


# Format, activation dtype, and the loop's tolerance (rtol, atol): dense fp32 is torch's own
# arithmetic in another order; bf16 rounds each op's output to 8 bits, a step of 2 ** -7 that
# an output may take the other way; the quantized kernels' sums match the float64 products of
# the same numbers but for a fine activation code rounded the other way (tests/test_quant.py),
# which SiLU and the second projection carry on.
FORMATS = [
    ("fp32", torch.float32, (1e-5, 1e-5)),
    ("bf16", torch.bfloat16, (1.6e-2, 1e-2)),
    ("int4", torch.float32, (1e-4, 1e-4)),
    ("int8", torch.float32, (1e-4, 1e-4)),
    ("int4", torch.bfloat16, (1.6e-2, 1e-2)),
    ("int8", torch.bfloat16, (1.6e-2, 1e-2)),
]


@pytest.mark.parametrize("fmt,dtype,tol", FORMATS, ids=[f"{f}-{str(d)[6:]}" for f, d, _ in FORMATS])
def test_moe_experts_is_a_loop_over_each_tokens_slots(fmt, dtype, tol):
    """Tokens sharing experts (13 tokens x 3 of 8), one token alone, and a token that names an
    expert twice (each slot counts: the op takes ids it did not route)."""
    experts = Experts(fmt, seed=1)
    gen = torch.Generator().manual_seed(2)
    for tokens in (1, 13):
        ids, weights = routing(tokens, 3, gen)
        if tokens > 1:
            ids[4] = torch.tensor([5, 2, 5])
        x = torch.randn(tokens, HIDDEN, generator=gen).to(dtype)
        y = experts.run(x, ids, weights)
        assert y.shape == x.shape and y.dtype == dtype
        rtol, atol = tol
        torch.testing.assert_close(y, experts.loop(x, ids, weights), rtol=rtol, atol=atol)


@pytest.mark.parametrize("fmt", ["int4", "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_tokens_output_does_not_depend_on_its_step(fmt, dtype):
    """Each token of a 40-token step alone, and in steps of 2 to 17 tokens (experts of 1 to 17
    rows: groups of 4 rows, and on an AMX CPU tile products from 5 rows), on one thread and on
    the default threads: the same bits. With 4 of 8 experts a token, the threads share out
    whole experts; with 1, a token alone has one expert, whose linears split over the threads.
    (Dense experts run torch's GEMM, whose bits depend on the row count, as the dense MLP's.)"""
    experts = Experts(fmt, seed=3)
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(40, HIDDEN, generator=gen).to(dtype)
    steps = [[t] for t in range(40)]
    steps += [torch.randperm(40, generator=gen)[:size].tolist() for size in (2, 5, 8, 9, 17)]
    for k in (4, 1):
        ids, weights = routing(40, k, gen)
        whole = experts.run(x, ids, weights)
        threads = torch.get_num_threads()
        try:
            torch.set_num_threads(1)
            assert torch.equal(experts.run(x, ids, weights), whole)
        finally:
            torch.set_num_threads(threads)
        for step in steps:
            y = experts.run(x[step], ids[step], weights[step])
            assert torch.equal(y, whole[step]), (k, step)


def test_no_tokens_and_no_slots():
    experts = Experts("int4", seed=5)
    ids = torch.empty(0, 2, dtype=torch.long)
    assert experts.run(torch.empty(0, HIDDEN), ids, torch.empty(0, 2)).shape == (0, HIDDEN)
    none = torch.empty(3, 0, dtype=torch.long)
    y = experts.run(torch.randn(3, HIDDEN), none, torch.empty(3, 0))
    assert torch.equal(y, torch.zeros(3, HIDDEN))


def transformers_block(experts: Experts, gate: torch.Tensor, top_k: int, norm_topk_prob: bool):
    """transformers' Qwen3-MoE block holding `experts`' dense weights and the router `gate`."""
    config = Qwen3MoeConfig(
        hidden_size=gate.shape[1],
        moe_intermediate_size=INTERMEDIATE,
        num_experts=len(gate),
        num_experts_per_tok=top_k,
        norm_topk_prob=norm_topk_prob,
    )
    block = Qwen3MoeSparseMoeBlock(config)
    with torch.no_grad():
        block.gate.weight.copy_(gate)
        hidden = gate.shape[1]
        block.experts.gate_up_proj.copy_(
            torch.stack([w[:, :hidden] for w in experts.dense_gate_up])
        )
        block.experts.down_proj.copy_(
            torch.stack([w[:, :INTERMEDIATE] for w in experts.dense_down])
        )
    return block


@pytest.mark.parametrize("fmt,tol", [("fp32", 1e-5), ("int4", 2e-3)])
@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_decoder_moe_is_transformers_block_after_the_residual_add(fmt, tol, norm_topk_prob):
    """residual += o in place, then transformers' RMSNorm and Qwen3-MoE block (router softmax,
    top 3 of 8, renormalised or not, the experts): with int4 experts, the block holds the same
    weights dequantized."""
    experts = Experts(fmt, seed=6)
    gen = torch.Generator().manual_seed(7)
    gate = torch.randn(EXPERTS, HIDDEN, generator=gen)
    norm_weight = 1 + 0.1 * torch.randn(HIDDEN, generator=gen)
    residual, o = torch.randn(2, 11, HIDDEN, generator=gen)
    norm = Qwen3MoeRMSNorm(HIDDEN, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(norm_weight)
        summed = residual + o
        expected = transformers_block(experts, gate, 3, norm_topk_prob)(norm(summed)[None])[0]
    y = ops.decoder_moe(
        o, residual, [norm_weight, gate], experts.gate_up, experts.down, 3, norm_topk_prob,
        INTERMEDIATE, 1e-6,
    )  # fmt: skip
    assert torch.equal(residual, summed)
    torch.testing.assert_close(y, expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_tied_router_probabilities_choose_the_lower_expert_ids(norm_topk_prob):
    """A router whose rows are all the same gives every expert the same probability: the top 2
    are experts 0 and 1, as torch.topk on the CPU picks."""
    experts = Experts("fp32", seed=8)
    x = torch.randn(3, HIDDEN, generator=torch.Generator().manual_seed(9))
    gate = torch.randn(1, HIDDEN).expand(EXPERTS, HIDDEN).contiguous()
    ones = torch.ones(HIDDEN)
    y = ops.decoder_moe(
        torch.zeros_like(x), x.clone(), [ones, gate], experts.gate_up, experts.down, 2,
        norm_topk_prob, INTERMEDIATE, 1e-6,
    )  # fmt: skip
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    share = 0.5 if norm_topk_prob else 1 / EXPERTS
    ids, weights = torch.tensor([[0, 1]] * 3), torch.full((3, 2), share)
    torch.testing.assert_close(y, experts.loop(normed, ids, weights), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decoder_moe_gives_a_token_the_same_bits_alone(dtype):
    """The router's logits too: hidden 80, so rows of the step start off any vector boundary."""
    hidden = 80
    experts = Experts("int4", seed=10, hidden=hidden)
    gen = torch.Generator().manual_seed(11)
    gate = torch.randn(EXPERTS, hidden, generator=gen).to(dtype)
    weights = [torch.ones(hidden, dtype=dtype), gate]
    residual, o = torch.randn(2, 12, hidden, generator=gen).to(dtype)

    def run(rows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        res = residual[rows].clone()
        y = ops.decoder_moe(
            o[rows], res, weights, experts.gate_up, experts.down, 3, True, INTERMEDIATE, 1e-6
        )
        return y, res

    y, res = run(list(range(12)))
    for rows in ([0], [7], [11], [3, 9], [2, 5, 6, 10, 1]):
        alone, alone_res = run(rows)
        assert torch.equal(alone, y[rows]) and torch.equal(alone_res, res[rows]), rows


X = torch.randn(2, HIDDEN)
IDS, WEIGHTS = torch.tensor([[0, 1], [2, 3]]), torch.ones(2, 2)
GATE_UP = [torch.randn(2 * INTERMEDIATE, HIDDEN) for _ in range(4)]
DOWN = [torch.randn(HIDDEN, INTERMEDIATE) for _ in range(4)]
PACKED = pack(int4_groups(GATE_UP[0]))  # [6, 2, 320]


@pytest.mark.parametrize(
    "x,ids,weights,gate_up,down,message",
    [
        (X, torch.tensor([[0, 4], [2, 3]]), WEIGHTS, GATE_UP, DOWN,
         r"topk_ids\[0, 1\] = 4 is not an expert: there are 4 \(0 to 3\)"),
        (X, torch.tensor([[0, 1], [-1, 3]]), WEIGHTS, GATE_UP, DOWN,
         r"topk_ids\[1, 0\] = -1 is not an expert"),
        (X, IDS, WEIGHTS, GATE_UP, DOWN[:3],
         "gate_up and down must hold a weight for each expert alike, not 4 and 3"),
        (X, IDS, WEIGHTS, [], [], "gate_up and down must hold a weight for each expert"),
        (X, IDS, torch.ones(2, 3), GATE_UP, DOWN,
         r"topk_weights \[2, 3\] must be topk_ids' \[2, 2\]"),
        (X, IDS[:1], WEIGHTS[:1], GATE_UP, DOWN,
         r"topk_ids \[1, 2\] must be \[2, k\]: k experts for each of x's rows"),
        (X, IDS.int(), WEIGHTS, GATE_UP, DOWN, "topk_ids must be Long, not Int"),
        (X, IDS, WEIGHTS.double(), GATE_UP, DOWN, "topk_weights must be Float, not Double"),
        (X.double(), IDS, WEIGHTS, GATE_UP, DOWN, "x must be Float or BFloat16, not Double"),
        (X[0], IDS, WEIGHTS, GATE_UP, DOWN, r"x \[64\] must be a \(tokens, hidden\) matrix"),
        (X, IDS, WEIGHTS, [GATE_UP[0].T, *GATE_UP[1:]], DOWN,
         r"gate_up\[0\] \[64, 96\] of Float must be \[96, 64\] of Float \(x's dtype\), or "
         r"packed records \[6, 2\] x 320 or 576 bytes of Byte"),
        (X, IDS, WEIGHTS, GATE_UP, [*DOWN[:3], DOWN[3].bfloat16()],
         r"down\[3\] \[64, 48\] of BFloat16 must be \[64, 48\] of Float"),
        (X, IDS, WEIGHTS, [PACKED[:, :1], *GATE_UP[1:]], DOWN,
         r"gate_up\[0\] \[6, 1, 320\] of Byte must be .* packed records \[6, 2\]"),
    ],
    ids=["id-past", "id-negative", "lists", "no-experts", "weights-shape", "ids-rows",
         "ids-int32", "weights-fp64", "x-fp64", "x-1d", "gate_up-shape", "down-dtype",
         "packed-blocks"],
)  # fmt: skip
def test_moe_experts_refuses(x, ids, weights, gate_up, down, message):
    with pytest.raises(RuntimeError, match="moe_experts: " + message):
        ops.moe_experts(x, ids, weights, gate_up, down, INTERMEDIATE)


def test_moe_experts_checks_only_the_chosen_experts_weights_and_intermediate():
    """A wrong weight of an expert no token chose is never read: the check costs nothing per
    step for experts that sit out."""
    ids = torch.tensor([[0, 1], [2, 1]])
    ops.moe_experts(X, ids, WEIGHTS, [*GATE_UP[:3], GATE_UP[3].T], DOWN, INTERMEDIATE)
    with pytest.raises(RuntimeError, match="moe_experts: intermediate 0 must be >= 1"):
        ops.moe_experts(X, IDS, WEIGHTS, GATE_UP, DOWN, 0)


NORM, ROUTER = torch.ones(HIDDEN), torch.randn(4, HIDDEN)


@pytest.mark.parametrize(
    "o,weights,top_k,message",
    [
        (X, [NORM], 2, r"2 weights \(post_attention_layernorm, gate\), not 1"),
        (X[:1], [NORM, ROUTER], 2, r"o \[1, 64\] must be residual's \[2, 64\]"),
        (X, [NORM, ROUTER[:3]], 2,
         r"gate \[3, 64\] must be \[4, 64\]: a row for each of gate_up's experts"),
        (X, [NORM, ROUTER.bfloat16()], 2, "gate must be Float, not BFloat16"),
        (X, [NORM, ROUTER], 0, "top_k 0 must be 1 to 4, the number of experts"),
        (X, [NORM, ROUTER], 5, "top_k 5 must be 1 to 4"),
    ],
    ids=["weights", "o-shape", "gate-rows", "gate-dtype", "top_k-0", "top_k-past"],
)  # fmt: skip
def test_decoder_moe_refuses(o, weights, top_k, message):
    with pytest.raises(RuntimeError, match="decoder_moe: " + message):
        ops.decoder_moe(o, X.clone(), weights, GATE_UP, DOWN, top_k, True, INTERMEDIATE, 1e-6)
