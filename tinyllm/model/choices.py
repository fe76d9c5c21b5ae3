"""The names of the model side's choices, without torch: the command line lists them in its help
and checks them before anything loads; the modules that act on them import them from here."""

# Attention backends (model/attention/select.py); "auto": the device's in-place kernel.
ATTENTION_BACKENDS = ("auto", "reference", "cpu", "cuda")
# How the decoder layers run (model/layer_executor.py).
LAYER_EXECUTORS = ("auto", "fused", "modules")
# Activation dtypes, by their torch names (model/precision.py).
DTYPE_NAMES = ("float32", "bfloat16", "float16")
# Linear layers' weight formats (model/precision.py).
QUANTIZATIONS = ("none", "int8", "int4")
# K/V cache storage (model/attention/int8_cache.py): auto, the model's dtype; int8, codes.
KV_CACHE_DTYPES = ("auto", "int8")
# How a pooling model pools a prompt's hidden states (engine/worker/pooler.py).
POOLING_TYPES = ("last", "mean", "cls")
