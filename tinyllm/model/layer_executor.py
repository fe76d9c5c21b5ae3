"""How the decoder layers run, chosen once for the model (the model runner sets the choice with
Transformer.set_layer_executor when it is built); DecoderLayer.forward follows it.

- "fused": each layer as two C++ ops (model/decoder_layer.cpp), its attention and its MLP, split
  where tensor parallelism all-reduces. At one decode row a step's time is mostly calls, not
  arithmetic, and this path makes two per layer instead of about twenty. The ops call the CPU
  attention backend's kernel themselves, so they run only with that backend: on the CPU, with
  fp32 or bf16 activations, where tinyllm's C++ library built (the backend exists only there).
- "modules": the layer's modules, a call each per step: any device, backend and dtype. The same
  kernels where the library built, so the tests use it as the fused ops' oracle.
- "auto": "fused" where it can run, else "modules"; the log says which and why.

vLLM has no such option (its layers are always modules, with custom ops inside): it is tinyllm's
own, the way its CPU path runs a layer without going back to Python between the steps.
"""

import logging

from tinyllm.model.attention import AttentionBackend
from tinyllm.model.attention.cpu import CPUBackend
from tinyllm.model.choices import LAYER_EXECUTORS
from tinyllm.model.families import Model
from tinyllm.model.layer_ops import NATIVE_DTYPES, has_op

log = logging.getLogger("tinyllm")


def why_not_fused(model: Model, backend: AttentionBackend) -> str | None:
    """Why the fused ops cannot run this model with this backend, or None if they can."""
    if model.device.type != "cpu":
        return f"the model is on {model.device.type}, and the fused ops are CPU code"
    if not isinstance(backend, CPUBackend):
        return f"the {backend.name} attention backend (the fused ops run the cpu backend's kernel)"
    c = model.config
    if not c.is_causal:
        return f"{c.architecture} is an encoder (the fused ops run a decoder's layers)"
    if c.qk_norm_all_heads:
        return f"{c.architecture}'s q/k norms over all heads' width (the fused op norms each head)"
    if c.num_experts and not has_op("decoder_moe"):
        return "mixture-of-experts layers (this build of the C++ library has no decoder_moe op)"
    if model.dtype not in NATIVE_DTYPES:
        dtype = str(model.dtype).removeprefix("torch.")
        return f"{dtype} activations (the fused ops take float32 and bfloat16)"
    return None


def choose_layer_executor(requested: str, model: Model, backend: AttentionBackend) -> str:
    """ "fused" or "modules" for `requested` (one of LAYER_EXECUTORS), logged with why. Asking
    for "fused" where it cannot run is a ValueError that says why."""
    if requested not in LAYER_EXECUTORS:
        raise ValueError(
            f"layer_executor={requested!r}: choose one of {', '.join(LAYER_EXECUTORS)}"
        )
    why_not = why_not_fused(model, backend)
    if requested == "fused" and why_not is not None:
        raise ValueError(
            f"layer_executor='fused' cannot run here: {why_not}; use 'auto' or 'modules'"
        )
    if requested != "auto":
        chosen, why = requested, "as asked"
    elif why_not is None:
        chosen, why = "fused", "each layer as two C++ ops with the cpu attention backend's kernel"
    else:
        chosen, why = "modules", why_not
    log.info("layer executor: %s (%s)", chosen, why)
    return chosen
