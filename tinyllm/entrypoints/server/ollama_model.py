"""What Ollama's /api/tags, /api/show and /api/ps say about the one served model, in Ollama's
names (its architecture's shapes, its weights file, its chat template)."""

import functools
import hashlib
import json
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from tinyllm.engine.sampling_params import SamplingParams
from tinyllm.entrypoints.llm import LLM
from tinyllm.entrypoints.server.errors import APIError
from tinyllm.model.quant import QuantLinear
from tinyllm.text.harmony import is_harmony

_FAR_FUTURE = "2318-01-01T00:00:00Z"  # expires_at: the one model is never unloaded


def rfc3339(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, UTC).isoformat().replace("+00:00", "Z")


class OllamaModel:
    """The served model as Ollama lists it: `NAME:latest`, also answering to plain `NAME`."""

    def __init__(self, llm: LLM, defaults: SamplingParams) -> None:
        self.llm, self.name, self.defaults = llm, llm.model_name, defaults
        self.max_model_len = llm.engine.max_model_len
        tokenizer = llm.tokenizer  # None with dummy weights
        self.template = (tokenizer.chat_template if tokenizer is not None else None) or ""
        # A thinking model's template writes (or prefills) the <think> tag, or is gpt-oss's.
        self.thinks = "<think>" in self.template or is_harmony(self.template)

    @functools.cached_property
    def info(self) -> dict[str, Any]:
        # On first use: apps built around a stand-in LLM (tests) need not describe a model.
        return model_info(self.llm)

    def check(self, model: str | None) -> str:
        if model not in (self.name, f"{self.name}:latest"):
            raise APIError(404, f"model '{model}' not found")
        return model

    def tags(self) -> dict:
        entry = {"name": f"{self.name}:latest", "model": f"{self.name}:latest"}
        info = self.info
        entry |= {k: info[k] for k in ("modified_at", "size", "digest", "details")}
        return {"models": [entry]}

    def show(self, model: str | None) -> dict:
        self.check(model)
        info, defaults = self.info, self.defaults
        params = [f"num_ctx {self.max_model_len}"]
        params += [f"temperature {defaults.temperature}", f"top_p {defaults.top_p}"]
        params += [f"stop {json.dumps(s)}" for s in defaults.stop or []]
        capabilities = ["completion", "tools"] + (["thinking"] if self.thinks else [])
        return {
            "license": "",
            "modelfile": f"FROM {self.name}\n",
            "parameters": "\n".join(params),
            "template": self.template,
            "details": info["details"],
            "model_info": info["model_info"],
            "capabilities": capabilities,
            "modified_at": info["modified_at"],
        }

    def ps(self) -> dict:
        entry = self.tags()["models"][0]
        entry |= {"expires_at": _FAR_FUTURE, "size_vram": 0, "context_length": self.max_model_len}
        return {"models": [entry]}


def model_info(llm: LLM) -> dict[str, Any]:
    """What /api/tags and /api/show say about the served model, in Ollama's names."""
    model = llm.engine.model
    c, tp = model.config, model.config.tensor_parallel_size
    heads, kv_heads, ffn = c.num_heads * tp, c.num_kv_heads * tp, c.intermediate_size * tp
    h, hd = c.hidden_size, c.head_dim
    layer = h * hd * (2 * heads + 2 * kv_heads) + 3 * h * ffn + 2 * h
    params = c.vocab_size * h * (1 if c.tie_word_embeddings else 2) + c.num_layers * layer + h
    bits = {m.bits for m in model.modules() if isinstance(m, QuantLinear)}
    dtype = str(model.dtype).removeprefix("torch.")
    quant = f"Q{min(bits)}" if bits else {"float32": "F32", "float16": "F16"}.get(dtype, "BF16")
    path = Path(llm.model_path)
    files = [path] if path.is_file() else sorted(path.glob("*.safetensors"))
    stats = [f.stat() for f in files]
    size = sum(s.st_size for s in stats)
    mtime = max((s.st_mtime for s in stats), default=time.time())
    # Identifies the served file(s) (path, size, time), not a hash of their bytes.
    digest = hashlib.sha256(f"{path}:{size}:{mtime}".encode()).hexdigest()
    family = c.architecture
    details = {
        "parent_model": "",
        "format": "gguf" if path.suffix == ".gguf" else "safetensors",
        "family": family,
        "families": [family],
        "parameter_size": f"{params / 1e9:.1f}B" if params >= 1e9 else f"{params / 1e6:.0f}M",
        "quantization_level": quant,
    }
    a = family
    model_info = {
        "general.architecture": a,
        "general.parameter_count": params,
        f"{a}.context_length": c.max_position_embeddings,
        f"{a}.embedding_length": h,
        f"{a}.block_count": c.num_layers,
        f"{a}.feed_forward_length": ffn,
        f"{a}.attention.head_count": heads,
        f"{a}.attention.head_count_kv": kv_heads,
        f"{a}.attention.key_length": hd,
        f"{a}.attention.value_length": hd,
        f"{a}.attention.layer_norm_rms_epsilon": c.rms_norm_eps,
        f"{a}.rope.freq_base": c.rope_theta,
        f"{a}.vocab_size": c.vocab_size,
    }
    return {
        "modified_at": rfc3339(mtime),
        "size": size,
        "digest": digest,
        "details": details,
        "model_info": model_info,
    }
