"""The fused decoder ops' arguments against the C++ side: AttentionArgs and MLPArgs (model/
llama.py), which the model passes positionally after the step's arguments, must name the last
arguments of decoder_attention's and decoder_mlp's registered schemas (model/decoder_layer.cpp),
in the same order; the step's arguments before them must be the ones DecoderLayer.forward passes.
A drift on either side fails here, not as wrong bits or a type error at the first step."""

import pytest
import torch

from tinyllm.model.cpu_library import library_error
from tinyllm.model.llama import AttentionArgs, MLPArgs

pytestmark = pytest.mark.skipif(
    library_error() is not None, reason=f"CPU library did not build: {library_error()}"
)

# What DecoderLayer.forward passes before each op's named arguments, in order.
STEP_ARGS = {
    "decoder_attention": [
        "hidden", "residual", "positions", "cos", "sin", "k_cache", "v_cache", "slot_mapping",
        "block_tables", "seq_lens", "query_start_loc", "num_rows",
    ],
    "decoder_mlp": ["o", "residual"],
}  # fmt: skip


@pytest.mark.parametrize(
    "op,args", [("decoder_attention", AttentionArgs), ("decoder_mlp", MLPArgs)]
)
def test_the_named_args_are_the_ops_schema(op, args):
    schema = getattr(torch.ops.tinyllm, op).default._schema
    names = [a.name for a in schema.arguments]
    assert names == STEP_ARGS[op] + list(args._fields)
