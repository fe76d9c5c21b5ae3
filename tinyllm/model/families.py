"""Which model class runs each supported architecture: a new family adds its file of layers and
its line here (and its name to model/config.py's SUPPORTED_ARCHITECTURES)."""

from torch import nn

from tinyllm.model.bert import BertEncoder
from tinyllm.model.config import ModelConfig
from tinyllm.model.encoder import Encoder
from tinyllm.model.gemma import Gemma
from tinyllm.model.llama import Transformer
from tinyllm.model.nomic_bert import NomicBert

MODEL_CLASSES: dict[str, type[nn.Module]] = {
    "llama": Transformer,
    "mistral": Transformer,
    "qwen2": Transformer,
    "qwen3": Transformer,
    "phi3": Transformer,
    "gemma2": Gemma,
    "gemma3": Gemma,
    # Llama-family attention with model/moe.py's experts on the layers the config marks.
    "qwen3_moe": Transformer,
    "mixtral": Transformer,
    "olmoe": Transformer,
    # and with attention sinks, biases and a clamped SwiGLU in its experts (ModelConfig's fields).
    "gpt_oss": Transformer,
    # Encoders (embeddings, cross-encoders): bidirectional, no K/V, no generation.
    "bert": BertEncoder,
    "xlm-roberta": BertEncoder,
    "nomic_bert": NomicBert,
}
# What load_model gives: a decoder, or an encoder (ModelConfig.is_causal False).
Model = Transformer | Encoder


def build_model(config: ModelConfig) -> Model:
    """The model for `config`'s architecture, its weights not yet loaded."""
    return MODEL_CLASSES[config.architecture](config)
