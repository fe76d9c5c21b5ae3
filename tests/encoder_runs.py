"""Tiny random encoder checkpoints (BERT, XLM-RoBERTa, their cross-encoders, NomicBert) written
as sentence-transformers directories, and a forward pass of whole prompts through a loaded
encoder, as the model runner lays out one step."""

from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from torch import Tensor
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    BertModel,
    NomicBertConfig,
    NomicBertModel,
    PreTrainedTokenizerFast,
    XLMRobertaConfig,
    XLMRobertaForSequenceClassification,
    XLMRobertaModel,
)

from tinyllm.model.attention import AttentionMetadata, ForwardContext, get_backend

VOCAB = 100
SIZES = dict(
    vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
    intermediate_size=128,
    # Weights 10x transformers' default scale, so that tokens and layers differ visibly.
    initializer_range=0.2,
)  # fmt: skip
# Each family's special tokens and pair template, as its real tokenizers lay them out.
SPECIALS = {
    "bert": (["[PAD]", "[UNK]", "[CLS]", "[SEP]"], "[CLS] $A [SEP]", "[CLS] $A [SEP] $B:1 [SEP]:1"),
    "xlm-roberta": (["<s>", "<pad>", "</s>", "<unk>"], "<s> $A </s>", "<s> $A </s> </s> $B </s>"),
}
SPECIALS["nomic_bert"] = SPECIALS["bert"]  # nomic-embed-text's tokenizer is BERT's
CLASSES = {
    ("bert", False): (BertConfig, BertModel),
    ("bert", True): (BertConfig, BertForSequenceClassification),
    ("xlm-roberta", False): (XLMRobertaConfig, XLMRobertaModel),
    ("xlm-roberta", True): (XLMRobertaConfig, XLMRobertaForSequenceClassification),
    ("nomic_bert", False): (NomicBertConfig, NomicBertModel),
}


def _tokenizer(family: str) -> PreTrainedTokenizerFast:
    specials, single, pair = SPECIALS[family]
    vocab = {t: i for i, t in enumerate(specials)} | {f"w{i}": i for i in range(4, VOCAB)}
    xlmr = family == "xlm-roberta"
    pad, unk, cls, sep = (specials[1], specials[3], specials[0], specials[2]) if xlmr else specials
    tok = Tokenizer(models.WordLevel(vocab, unk_token=unk))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(
        single=single, pair=pair, special_tokens=[(cls, vocab[cls]), (sep, vocab[sep])]
    )
    # BERT's tokenizers give token types (a pair's second text 1); XLM-R's do not.
    types = [] if xlmr else ["token_type_ids"]
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=pad,
        unk_token=unk,
        cls_token=cls,
        sep_token=sep,
        model_input_names=["input_ids", *types, "attention_mask"],
    )


def write_encoder(
    path: Path, family: str, pooling: str | None = "mean", normalize: bool = True, labels: int = 0
) -> torch.nn.Module:
    """A random `family` ("bert", "xlm-roberta" or "nomic_bert") model at `path` with its
    tokenizer, in sentence-transformers' layout: a Transformer module, and with `pooling` a
    Pooling module (and a Normalize one with `normalize`); with `labels`, a cross-encoder with
    that many outputs. Returns the transformers model, in eval mode."""
    # Imported here: sentence-transformers imports slowly, and only the writers need it.
    from sentence_transformers import CrossEncoder, SentenceTransformer
    from sentence_transformers.sentence_transformer import modules as st_modules

    torch.manual_seed(0)
    config_class, model_class = CLASSES[family, labels > 0]
    extra = {"num_labels": labels} if labels else {}
    # XLM-R's configs: pad id 1, positions from 2 (64 usable), one token type.
    xlmr = dict(pad_token_id=1, max_position_embeddings=66, type_vocab_size=1)
    own = xlmr if family == "xlm-roberta" else {}
    model = model_class(config_class(**SIZES, **own, **extra)).eval()
    with torch.no_grad():  # LayerNorms off their initial 1 and 0, to tell them apart
        for name, p in model.named_parameters():
            if "layernorm" in name.lower():
                p.copy_(torch.randn_like(p) * 0.2 + (1 if name.endswith("weight") else 0))
    source = path.with_name(path.name + "-hf")
    model.save_pretrained(source)
    _tokenizer(family).save_pretrained(source)
    if labels:
        CrossEncoder(str(source)).save(str(path))
        return model
    modules = [st_modules.Transformer(str(source))]
    if pooling is not None:
        modules.append(st_modules.Pooling(SIZES["hidden_size"], pooling))
    if normalize:
        modules.append(st_modules.Normalize())
    SentenceTransformer(modules=modules).save(str(path))
    return model


def encoder_context(lens: list[int]) -> ForwardContext:
    """One step of whole prompts of `lens` tokens, laid out flat as the model runner lays them:
    prompt r's tokens at [start[r], start[r] + lens[r]); an encoder reads no K/V cache."""
    starts = torch.tensor([0, *lens]).cumsum(0)
    meta = AttentionMetadata(
        slot_mapping=torch.arange(sum(lens)),
        block_tables=torch.zeros(len(lens), 1, dtype=torch.long),
        seq_lens=torch.tensor(lens),
        query_start_loc=starts,
        num_decodes=0,
        seq_lens_cpu=list(lens),
        query_lens_cpu=list(lens),
    )
    return ForwardContext(meta, get_backend("reference", torch.device("cpu")), [])


def hidden_states(model: torch.nn.Module, prompts: list[list[int]]) -> list[Tensor]:
    """Each prompt's final hidden states (len, hidden), all prompts in one flat batch."""
    lens = [len(p) for p in prompts]
    ids = torch.tensor([t for p in prompts for t in p])
    positions = torch.cat([torch.arange(n) for n in lens])
    hidden = model(ids, positions, encoder_context(lens))
    return list(hidden.float().split(lens))
