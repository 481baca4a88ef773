"""Tiny random embedding, reranking and classification checkpoints, with tokenizers and sentence-transformers files,
for tests and benchmarks of the pooling runner (issue 43); and the reference outputs of transformers /
sentence-transformers on them.

Every maker writes a real folder, shaped like the checkpoints users serve:
- `make_tiny_encoder`: `BertModel` / `XLMRobertaModel` (all-MiniLM, bge, e5) or their `ForSequenceClassification`
  cross-encoders (bge-reranker), with a WordPiece tokenizer (`[CLS] A [SEP]`, pairs `[CLS] A [SEP] B [SEP]` with
  token types 0 then 1) or an XLM-R-like unigram one (`<s> A </s>`, pairs `<s> A </s></s> B </s>`, pad id 1).
- `make_tiny_decoder_embedder`: Qwen3-Embedding-like (architectures `Qwen3ForCausalLM`, base-model tensors without
  the `model.` prefix and no lm_head, a byte-level BPE tokenizer that appends `<|endoftext|>`, left padding) or
  gte-Qwen2-like (`Qwen2Model`).
- `make_tiny_decoder_classifier`: `Qwen2ForSequenceClassification` / `Qwen3ForSequenceClassification`.
The sentence-transformers files (modules.json, 1_Pooling, 2_Normalize, sentence_bert_config.json,
config_sentence_transformers.json) are in the format the Hub's checkpoints carry, which sentence-transformers loads.
Weights are random with a fixed seed; LayerNorm / RMSNorm weights and biases are perturbed away from their constant
initial values so that a model ignoring one would not match the reference. Tokenizers are deterministic too.

transformers, sentence-transformers and tokenizers are imported inside the functions (dev dependencies).
"""

from __future__ import annotations

import collections
import json
import logging
import math
import re
import string
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch

if TYPE_CHECKING:
    import numpy as np
    import tokenizers
    from transformers import PreTrainedModel

logger = logging.getLogger(__name__)

__all__ = [
    "ENCODER_KINDS",
    "corpus_words",
    "hf_classifier_logits",
    "make_tiny_decoder_classifier",
    "make_tiny_decoder_embedder",
    "make_tiny_encoder",
    "st_encode",
]

# English text the tokenizers are trained on, so that common words are one or two tokens.
_CORPUS = """
The quick brown fox jumps over the lazy dog. A man is eating food. A man is eating a piece of bread.
The girl is carrying a baby. A man is riding a horse. A woman is playing violin. Two men pushed carts through
the woods. A man is riding a white horse on an enclosed ground. A monkey is playing drums. Someone in a gorilla
costume is playing a set of drums. What is the capital of France? Paris is the capital and most populous city of
France. Berlin is the capital of Germany. The weather today is sunny with a light breeze from the west.
Machine learning models turn text into vectors, and similar sentences have similar vectors. Search engines rank
documents by how well they answer a query. A reranker reads the query and the document together and returns a
score. Embeddings are used for retrieval, clustering, classification and semantic search. The cat sat on the mat
while the children played in the garden. She walked into the room and opened the window to let in fresh air.
Once upon a time there was a small village near a river, where people grew rice and caught fish. The train
leaves the station at seven in the morning and arrives in the city before noon. Please send me the report by
Friday so that we can review it together next week. How many people live in Tokyo? More than thirty million
people live in the greater Tokyo area. Water boils at one hundred degrees Celsius at sea level. The sun rises in
the east and sets in the west. Computers store numbers in binary, as ones and zeros. Music, art and literature
tell us about the history of a people. The doctor said that exercise and good sleep are important for health.
I would like a cup of coffee with milk, please. They built a new bridge across the river last year. He reads
books about science, space and the stars every night. The market opens early and sells fresh fruit, vegetables,
cheese and bread. A good question often matters more than a quick answer. Where is the nearest train station?
"""

ENCODER_KINDS: dict[str, tuple[str, str]] = {
    "bert": ("BertConfig", "BertModel"),
    "xlmr": ("XLMRobertaConfig", "XLMRobertaModel"),
    "bert_cls": ("BertConfig", "BertForSequenceClassification"),
    "xlmr_cls": ("XLMRobertaConfig", "XLMRobertaForSequenceClassification"),
}
_ENCODER_SHAPE: dict[str, Any] = {
    "vocab_size": 384,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "max_position_embeddings": 128,
    "initializer_range": 0.2,
}
_DECODER_SHAPE: dict[str, Any] = {
    "vocab_size": 384,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "initializer_range": 0.2,
}
# Per decoder family: the transformers config class and the settings that make it that family.
_DECODER_FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", {"head_dim": 32}),
}
# The architectures config.json names for a decoder embedder of each family (Qwen3-Embedding: Qwen3ForCausalLM;
# gte-Qwen2 style: the base model).
_EMBEDDER_ARCHITECTURES = {"qwen2": "Qwen2Model", "qwen3": "Qwen3ForCausalLM"}
_PERTURBED_SCALE = 0.2
_ST_POOLING_MODES = ("mean", "cls", "lasttoken")

# WordPiece specials at ids 0-4 (pad 0, as in the config); XLM-R's at 0-3 (<s>, <pad> = 1, </s>, <unk>) and <mask>
# last; the byte-level BPE's after the merges, as in Qwen's vocabulary.
_BERT_SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
_XLMR_SPECIALS = ("<s>", "<pad>", "</s>", "<unk>")
_XLMR_MASK = "<mask>"
_QWEN_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
_QWEN_EOS = "<|endoftext|>"


def make_tiny_encoder(
    path: str | Path,
    kind: str,
    *,
    seed: int = 0,
    sentence_transformers: dict[str, Any] | None = None,
    **config_overrides: Any,
) -> Path:
    """Write a random encoder checkpoint of `kind` ("bert", "xlmr", "bert_cls", "xlmr_cls") with its tokenizer.

    `config_overrides` go to the transformers config (e.g. `hidden_size=384, num_labels=3`); the classifiers default
    to `num_labels=1` (a reranker's one score). The tokenizer's vocabulary has exactly the config's `vocab_size`
    entries (trained on built-in English text, then filled up with unused tokens). `sentence_transformers`, e.g.
    `{"pooling": "mean", "normalize": True, "max_seq_length": 128}`, adds the sentence-transformers files (an
    embedding model only). Returns the folder.
    """
    import transformers

    if kind not in ENCODER_KINDS:
        raise ValueError(f"unknown encoder kind {kind!r}; known: {', '.join(ENCODER_KINDS)}")
    if sentence_transformers is not None and kind.endswith("_cls"):
        raise ValueError("sentence-transformers files are for embedding models, not classifiers")
    config_class, model_class = ENCODER_KINDS[kind]
    is_xlmr = kind.startswith("xlmr")
    settings: dict[str, Any] = (
        {"type_vocab_size": 1, "pad_token_id": 1, "bos_token_id": 0, "eos_token_id": 2}
        if is_xlmr
        else {"type_vocab_size": 2, "pad_token_id": 0}
    )
    if kind.endswith("_cls"):
        settings["num_labels"] = 1
    config = getattr(transformers, config_class)(
        **{**_ENCODER_SHAPE, **settings, **config_overrides}
    )
    config.architectures = [model_class]
    model = _seeded_model(lambda: getattr(transformers, model_class)(config), seed)
    folder = _save_model(model, path)
    max_length = int(config.max_position_embeddings) - (2 if is_xlmr else 0)
    if is_xlmr:
        _write_tokenizer(
            folder, _xlmr_tokenizer(config.vocab_size), _xlmr_tokenizer_config(max_length)
        )
    else:
        _write_tokenizer(
            folder, _bert_tokenizer(config.vocab_size), _bert_tokenizer_config(max_length)
        )
    if sentence_transformers is not None:
        _add_sentence_transformers(folder, config.hidden_size, max_length, sentence_transformers)
    return folder


def make_tiny_decoder_embedder(
    path: str | Path,
    family: str = "qwen3",
    *,
    seed: int = 0,
    sentence_transformers: dict[str, Any] | Literal[False] | None = None,
    **config_overrides: Any,
) -> Path:
    """Write a random decoder embedding checkpoint shaped like Qwen3-Embedding (`family="qwen3"`) or gte-Qwen2
    (`"qwen2"`): the base model's tensors (no `model.` prefix, no lm_head), config.json naming `Qwen3ForCausalLM` /
    `Qwen2Model`, a byte-level BPE tokenizer whose post-processor appends `<|endoftext|>` (the EOS and pad token),
    padding side left.

    `sentence_transformers` (None: `{"pooling": "lasttoken", "normalize": True}`, as Qwen3-Embedding has) sets the
    sentence-transformers files; `False` writes none. The tokenizer has at most `vocab_size` entries (the
    config's vocabulary may be larger, as Qwen's is). Returns the folder.
    """
    import transformers

    config = _decoder_config(transformers, family, config_overrides)
    base_class = getattr(transformers, _DECODER_FAMILIES[family][0].replace("Config", "Model"))
    model = _seeded_model(lambda: base_class(config), seed)
    folder = _save_model(model, path)
    tokenizer = _qwen_tokenizer(config.vocab_size, append_eos=True)
    max_length = int(config.max_position_embeddings)
    _write_tokenizer(folder, tokenizer, _qwen_tokenizer_config(max_length, padding_side="left"))
    if sentence_transformers is None:
        sentence_transformers = {"pooling": "lasttoken", "normalize": True}
    if sentence_transformers is not False:
        _add_sentence_transformers(folder, config.hidden_size, max_length, sentence_transformers)
    # Saved as the base model; config.json names the architecture the real checkpoints declare.
    _set_architectures(folder, [_EMBEDDER_ARCHITECTURES[family]])
    return folder


def make_tiny_decoder_classifier(
    path: str | Path,
    family: str = "qwen2",
    *,
    num_labels: int = 2,
    seed: int = 0,
    **config_overrides: Any,
) -> Path:
    """Write a random `Qwen2ForSequenceClassification` / `Qwen3ForSequenceClassification` checkpoint
    (`model.*` tensors plus `score.weight`, `pad_token_id` set to `<|endoftext|>`) with a byte-level BPE tokenizer
    that adds no special tokens. Returns the folder."""
    import transformers

    config = _decoder_config(transformers, family, {"num_labels": num_labels, **config_overrides})
    model_class = getattr(
        transformers, _DECODER_FAMILIES[family][0].replace("Config", "ForSequenceClassification")
    )
    tokenizer = _qwen_tokenizer(config.vocab_size, append_eos=False)
    config.pad_token_id = tokenizer.token_to_id(_QWEN_EOS)
    config.architectures = [model_class.__name__]
    model = _seeded_model(lambda: model_class(config), seed)
    folder = _save_model(model, path)
    _write_tokenizer(
        folder,
        tokenizer,
        _qwen_tokenizer_config(int(config.max_position_embeddings), padding_side="left"),
    )
    return folder


def st_encode(path: str | Path, texts: list[str], **encode_kwargs: Any) -> np.ndarray:
    """sentence-transformers' embeddings of `texts` (float32, `[len(texts), dim]`) from the checkpoint's own
    modules (pooling, normalization); `encode_kwargs` go to `SentenceTransformer.encode`."""
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(path), device="cpu")
    embeddings = model.encode(texts, convert_to_numpy=True, **encode_kwargs)
    return embeddings.astype("float32")


def hf_classifier_logits(
    path: str | Path,
    token_ids_list: list[list[int]],
    token_type_ids_list: list[list[int]] | None = None,
) -> torch.Tensor:
    """transformers' sequence-classification logits `[len(token_ids_list), num_labels]` (float32), each sequence in
    a forward of its own (no padding), with its token types when given."""
    import transformers

    model = transformers.AutoModelForSequenceClassification.from_pretrained(
        str(path), dtype=torch.float32
    ).eval()
    rows = []
    with torch.no_grad():
        for index, token_ids in enumerate(token_ids_list):
            kwargs = {}
            if token_type_ids_list is not None:
                kwargs["token_type_ids"] = torch.tensor([token_type_ids_list[index]])
            rows.append(model(input_ids=torch.tensor([token_ids]), **kwargs).logits[0].float())
    return torch.stack(rows)


# --- models --------------------------------------------------------------------------------------------------


def _decoder_config(transformers: Any, family: str, overrides: dict[str, Any]) -> Any:
    if family not in _DECODER_FAMILIES:
        raise ValueError(
            f"unknown decoder family {family!r}; known: {', '.join(_DECODER_FAMILIES)}"
        )
    config_class, settings = _DECODER_FAMILIES[family]
    vocab_size = int(overrides.get("vocab_size", _DECODER_SHAPE["vocab_size"]))
    eos_id = _qwen_special_ids(vocab_size)[_QWEN_EOS]
    ids = {"bos_token_id": eos_id, "eos_token_id": eos_id, "tie_word_embeddings": False}
    return getattr(transformers, config_class)(**{**_DECODER_SHAPE, **settings, **ids, **overrides})


def _seeded_model(build: Any, seed: int) -> PreTrainedModel:
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = build()
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "norm" in name.lower():
                    param.add_(torch.randn_like(param) * _PERTURBED_SCALE)
                elif name.endswith(".bias"):
                    param.copy_(torch.randn_like(param) * _PERTURBED_SCALE)
    finally:
        torch.random.set_rng_state(state)
    return model.eval()


def _save_model(model: PreTrainedModel, path: str | Path) -> Path:
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    logger.info(
        "wrote a %s checkpoint (%d parameters) to %s",
        type(model).__name__,
        sum(param.numel() for param in model.parameters()),
        folder,
    )
    return folder


def _set_architectures(folder: Path, architectures: list[str]) -> None:
    config_file = folder / "config.json"
    config = json.loads(config_file.read_text())
    config["architectures"] = architectures
    _write_json(config_file, config)


def _add_sentence_transformers(
    folder: Path, hidden_size: int, max_length: int, settings: dict[str, Any]
) -> None:
    """Write the sentence-transformers files of a Transformer -> Pooling (-> Normalize) model in the format the
    Hub's checkpoints carry (all-MiniLM-L6-v2, bge, Qwen3-Embedding: sentence-transformers 2-5's `models.*`
    modules, `1_Pooling/config.json` with one `pooling_mode_*` flag per mode). sentence-transformers 6 writes a
    newer format of its own but still loads this one (the tests check it does)."""
    unknown = set(settings) - {"pooling", "normalize", "max_seq_length"}
    if unknown:
        raise ValueError(f"unknown sentence_transformers settings: {sorted(unknown)}")
    pooling = settings.get("pooling", "mean")
    if pooling not in _ST_POOLING_MODES:
        raise ValueError(f"pooling must be one of {', '.join(_ST_POOLING_MODES)}, got {pooling!r}")
    modules = [("", "Transformer"), ("1_Pooling", "Pooling")]
    if settings.get("normalize", False):
        modules.append(("2_Normalize", "Normalize"))
        (folder / "2_Normalize").mkdir(exist_ok=True)
    _write_json(
        folder / "modules.json",
        [
            {
                "idx": index,
                "name": str(index),
                "path": path,
                "type": f"sentence_transformers.models.{name}",
            }
            for index, (path, name) in enumerate(modules)
        ],
    )
    (folder / "1_Pooling").mkdir(exist_ok=True)
    _write_json(
        folder / "1_Pooling" / "config.json",
        {
            "word_embedding_dimension": hidden_size,
            "pooling_mode_cls_token": pooling == "cls",
            "pooling_mode_mean_tokens": pooling == "mean",
            "pooling_mode_max_tokens": False,
            "pooling_mode_mean_sqrt_len_tokens": False,
            "pooling_mode_weightedmean_tokens": False,
            "pooling_mode_lasttoken": pooling == "lasttoken",
            "include_prompt": True,
        },
    )
    max_seq_length = int(settings.get("max_seq_length", max_length))
    _write_json(
        folder / "sentence_bert_config.json",
        {"max_seq_length": max_seq_length, "do_lower_case": False},
    )
    _write_json(
        folder / "config_sentence_transformers.json",
        {
            "__version__": {
                "sentence_transformers": "3.3.1",
                "transformers": "4.46.2",
                "pytorch": "2.5.1",
            },
            "prompts": {},
            "default_prompt_name": None,
            "similarity_fn_name": "cosine",
        },
    )


def _write_json(file: Path, content: Any) -> None:
    file.write_text(json.dumps(content, indent=2) + "\n")


# --- tokenizers ----------------------------------------------------------------------------------------------


def _corpus_lines() -> list[str]:
    return [line.strip() for line in _CORPUS.strip().splitlines() if line.strip()]


def corpus_words() -> list[str]:
    """The corpus's lowercased words and punctuation marks, most frequent first (ties alphabetically)."""
    counts = collections.Counter(re.findall(r"\w+|[^\w\s]", _CORPUS.lower()))
    return sorted(counts, key=lambda word: (-counts[word], word))


def _corpus_characters() -> list[str]:
    return sorted(set(_CORPUS.lower()) - set(string.whitespace))


def _bert_tokenizer(vocab_size: int) -> tokenizers.Tokenizer:
    """Lowercasing WordPiece like bert-base-uncased's, exactly `vocab_size` entries: the specials (ids 0-4), every
    character alone and as a `##` continuation, the corpus's words by frequency, then unused tokens. The vocabulary
    is built, not trained, so that it is the same on every run."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers

    characters = _corpus_characters()
    pieces = [*_BERT_SPECIALS, *characters, *(f"##{char}" for char in characters)]
    words = [word for word in corpus_words() if word not in pieces]
    pieces += words[: max(0, vocab_size - len(pieces))]
    vocab = _filled_vocab(
        {piece: index for index, piece in enumerate(pieces)}, vocab_size, "[unused{}]"
    )
    tokenizer = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece()
    _set_template(tokenizer, "[CLS]:0 $A:0 [SEP]:0", "[CLS]:0 $A:0 [SEP]:0 $B:1 [SEP]:1")
    return tokenizer


def _xlmr_tokenizer(vocab_size: int) -> tokenizers.Tokenizer:
    """A SentencePiece-style unigram tokenizer like xlm-roberta-base's, exactly `vocab_size` entries: `<s>`,
    `<pad>` (1), `</s>`, `<unk>` first, `<mask>` last; between them `▁`, every character, the corpus's words as
    `▁word` pieces (scored by frequency, so whole words win), then unused pieces. Built, not trained."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    counts = collections.Counter(re.findall(r"\w+|[^\w\s]", _CORPUS))
    total = sum(counts.values())
    rare = math.log(1 / total) - 10.0
    pieces: list[tuple[str, float]] = [(token, 0.0) for token in _XLMR_SPECIALS]
    pieces += [("\u2581", rare)] + [
        (char, rare) for char in sorted(set(_CORPUS) - set(string.whitespace))
    ]
    budget = vocab_size - 1 - len(pieces)
    words = sorted(counts, key=lambda word: (-counts[word], word))[: max(0, budget)]
    pieces += [(f"\u2581{word}", math.log(counts[word] / total)) for word in words]
    pieces += [
        (f"\u2581<unused{index}>", rare - 10.0) for index in range(vocab_size - 1 - len(pieces))
    ]
    tokenizer = Tokenizer(models.Unigram(pieces, unk_id=_XLMR_SPECIALS.index("<unk>")))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    tokenizer.add_special_tokens([AddedToken(token, special=True) for token in _XLMR_SPECIALS])
    tokenizer.add_special_tokens([AddedToken(_XLMR_MASK, special=True, lstrip=True)])
    _set_template(tokenizer, "<s>:0 $A:0 </s>:0", "<s>:0 $A:0 </s>:0 </s>:0 $B:0 </s>:0")
    if tokenizer.get_vocab_size() != vocab_size:
        raise RuntimeError(
            f"the XLM-R tokenizer has {tokenizer.get_vocab_size()} entries, not {vocab_size}"
        )
    return tokenizer


def _qwen_special_ids(vocab_size: int) -> dict[str, int]:
    """Where the byte-level BPE puts its special tokens for a `vocab_size` vocabulary: after the merges."""
    num_bpe = _qwen_bpe_size(vocab_size)
    return {token: num_bpe + index for index, token in enumerate(_QWEN_SPECIALS)}


def _qwen_bpe_size(vocab_size: int) -> int:
    return vocab_size - len(_QWEN_SPECIALS)


def _qwen_tokenizer(vocab_size: int, *, append_eos: bool) -> tokenizers.Tokenizer:
    """Byte-level BPE like Qwen's (256 bytes, merges, then `<|endoftext|>`, `<|im_start|>`, `<|im_end|>`); its
    post-processor appends `<|endoftext|>` when `append_eos` (Qwen3-Embedding's does). A corpus with fewer merges
    than the vocabulary asks for leaves unused ids between the merges and the specials, which sit where
    `_qwen_special_ids` says."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    num_bpe = _qwen_bpe_size(vocab_size)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=num_bpe,
        min_frequency=1,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(_corpus_lines(), trainer=trainer)
    model = json.loads(tokenizer.to_str())["model"]
    vocab: dict[str, int] = model["vocab"]
    for index in range(num_bpe - len(vocab)):  # unreachable by any merge: never produced
        vocab[f"<|unused_{index}|>"] = len(vocab)
    merges = [
        tuple(merge) if isinstance(merge, list) else tuple(merge.split(" "))
        for merge in model["merges"]
    ]
    tokenizer.model = models.BPE(vocab, merges)
    tokenizer.add_special_tokens(
        [AddedToken(token, special=True, normalized=False) for token in _QWEN_SPECIALS]
    )
    if append_eos:
        _set_template(tokenizer, f"$A:0 {_QWEN_EOS}:0", f"$A:0 {_QWEN_EOS}:0 $B:1 {_QWEN_EOS}:1")
    return tokenizer


def _filled_vocab(vocab: dict[str, int], vocab_size: int, filler: str) -> dict[str, int]:
    if len(vocab) > vocab_size:
        raise RuntimeError(f"the tokenizer has {len(vocab)} entries, more than {vocab_size}")
    filled = dict(vocab)
    for index in range(vocab_size - len(vocab)):
        filled[filler.format(index)] = len(filled)
    return filled


def _set_template(tokenizer: tokenizers.Tokenizer, single: str, pair: str) -> None:
    from tokenizers import processors

    names = {part.split(":")[0] for part in f"{single} {pair}".split() if not part.startswith("$")}
    tokenizer.post_processor = processors.TemplateProcessing(
        single=single,
        pair=pair,
        special_tokens=[(name, tokenizer.token_to_id(name)) for name in sorted(names)],
    )


def _write_tokenizer(
    folder: Path, tokenizer: tokenizers.Tokenizer, tokenizer_config: dict[str, Any]
) -> None:
    tokenizer.save(str(folder / "tokenizer.json"))
    _write_json(folder / "tokenizer_config.json", tokenizer_config)


def _bert_tokenizer_config(max_length: int) -> dict[str, Any]:
    return {
        "tokenizer_class": "BertTokenizer",
        "do_lower_case": True,
        "unk_token": "[UNK]",
        "sep_token": "[SEP]",
        "pad_token": "[PAD]",
        "cls_token": "[CLS]",
        "mask_token": "[MASK]",
        "model_max_length": max_length,
        "clean_up_tokenization_spaces": True,
    }


def _xlmr_tokenizer_config(max_length: int) -> dict[str, Any]:
    return {
        "tokenizer_class": "XLMRobertaTokenizer",
        "bos_token": "<s>",
        "cls_token": "<s>",
        "eos_token": "</s>",
        "sep_token": "</s>",
        "pad_token": "<pad>",
        "unk_token": "<unk>",
        "mask_token": _XLMR_MASK,
        "model_max_length": max_length,
        "clean_up_tokenization_spaces": True,
    }


def _qwen_tokenizer_config(max_length: int, *, padding_side: str) -> dict[str, Any]:
    return {
        "tokenizer_class": "Qwen2Tokenizer",
        "eos_token": _QWEN_EOS,
        "pad_token": _QWEN_EOS,
        "bos_token": None,
        "unk_token": None,
        "padding_side": padding_side,
        "model_max_length": max_length,
        "clean_up_tokenization_spaces": False,
        "errors": "replace",
    }
