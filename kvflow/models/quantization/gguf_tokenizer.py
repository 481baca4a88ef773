"""The tokenizer inside a GGUF file, both ways: what llama.cpp's keys say about a Hugging Face tokenizer.json, and
the Hugging Face tokenizer folder a file's keys make again.

Writing (`ggml_vocabulary`): a byte-level BPE tokenizer.json is llama.cpp's model "gpt2" (tokens, token types,
merges, and the pre-tokenizer's name, `tokenizer.ggml.pre`, recognised from its split regex); a sentencepiece-style
one (Unigram, or BPE with byte fallback) is model "llama" (tokens, scores, token types, `<0xNN>` tokens typed BYTE).
Special tokens follow tokenizer_config.json's `bos_token` / `eos_token` / `pad_token` / `unk_token` (looked up in
the vocabulary), then config.json's ids, as llama.cpp's converter does.

Reading (`tokenizer_folder`): kvflow's own `tokenizer.huggingface.json` key (tokenizer.json whole) is the exact
tokenizer; without it a "gpt2" file's tokens, merges and pre-tokenizer name make a byte-level BPE `tokenizers`
tokenizer (the pre-tokenizers named in `PRE_TOKENIZER_PATTERNS`). Either way tokenizer_config.json carries the
file's BOS / EOS / padding tokens, `add_bos_token` and chat template. A file that holds neither is a ValueError
naming `--tokenizer`. Folders are cached under `$KVFLOW_CACHE_DIR/gguf_tokenizers/<digest of the keys>`.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

HF_TOKENIZER_KEY = "tokenizer.huggingface.json"
CHAT_TEMPLATE_KEY = "tokenizer.chat_template"
_GGML = "tokenizer.ggml."
# ggml's token types (gguf.TokenType), as plain numbers so that reading needs no gguf import here.
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
# Split regexes of byte-level BPE pre-tokenizers, by llama.cpp's pre-tokenizer name (src/llama-vocab.cpp).
GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
    r"\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_PATTERN = LLAMA3_PATTERN.replace(r"\p{N}{1,3}", r"\p{N}")
PRE_TOKENIZER_PATTERNS = {
    "gpt-2": GPT2_PATTERN,
    "llama-bpe": LLAMA3_PATTERN,
    "llama3": LLAMA3_PATTERN,
    "llama-v3": LLAMA3_PATTERN,
    "smaug-bpe": LLAMA3_PATTERN,
    "qwen2": QWEN2_PATTERN,
    "deepseek-r1-qwen": QWEN2_PATTERN,
}
# llama.cpp takes a whole pre-token found in the vocabulary before merging for these (tokenizer.json's
# `ignore_merges`, as Llama 3's has).
_IGNORE_MERGES = frozenset({"llama-bpe", "llama3", "llama-v3", "smaug-bpe"})
# tokenizer_config.json's special token name -> llama.cpp's key (`tokenizer.ggml.<key>_token_id`).
_SPECIAL_KEYS = {"bos": "bos", "eos": "eos", "pad": "padding", "unk": "unknown"}
_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")


# ---------------------------------------------------------------------------------------------------- writing
def detect_tokenizer_pre(tokenizer: dict[str, Any]) -> str:
    """llama.cpp's pre-tokenizer name for a byte-level BPE tokenizer.json: GPT-2's ByteLevel regex ('gpt-2'), or a
    Split regex followed by a regex-free ByteLevel: Llama 3's ('llama-bpe') or Qwen 2's ('qwen2'); ValueError
    otherwise (pass `tokenizer_pre`; see llama.cpp's src/llama-vocab.cpp for the names)."""
    pre = tokenizer.get("pre_tokenizer") or {}
    if pre.get("type") == "ByteLevel" and pre.get("use_regex", True):
        return "gpt-2"
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else []
    if len(steps) == 2 and steps[0].get("type") == "Split" and steps[1].get("type") == "ByteLevel":
        pattern = (steps[0].get("pattern") or {}).get("Regex")
        for name in ("llama-bpe", "qwen2"):
            if pattern == PRE_TOKENIZER_PATTERNS[name] and not steps[1].get("use_regex", True):
                return name
    raise ValueError(
        f"unrecognised pre_tokenizer {json.dumps(pre)[:200]}; pass --tokenizer-pre (e.g. qwen2, llama-bpe)"
    )


def is_sentencepiece_style(tokenizer: dict[str, Any]) -> bool:
    """Whether tokenizer.json is a sentencepiece model's (llama.cpp's "llama" vocabulary): Unigram, or BPE over
    characters with byte fallback."""
    model = tokenizer["model"]
    return model.get("type") == "Unigram" or (
        model.get("type") == "BPE" and bool(model.get("byte_fallback"))
    )


def ggml_vocabulary(
    tokenizer: dict[str, Any],
    tokenizer_config: dict[str, Any],
    config: dict[str, Any],
    vocab_size: int,
    tokenizer_pre: str | None = None,
) -> dict[str, Any]:
    """llama.cpp's `tokenizer.ggml.*` keys (without the prefix) for a tokenizer.json: `model`, `tokens`,
    `token_type`, `merges` or `scores`, `pre`, the special token ids and `add_bos_token` / `add_eos_token` where
    known. `vocab_size` is the model's (embedding rows); ids past the tokenizer's are placeholder tokens."""
    model = tokenizer["model"]
    if model.get("type") not in ("BPE", "Unigram"):
        raise ValueError(
            f"tokenizer.json model.type is {model.get('type')!r}; only BPE and Unigram are supported"
        )
    sentencepiece = is_sentencepiece_style(tokenizer)
    pieces = _model_pieces(model)
    added = {int(token["id"]): token for token in tokenizer.get("added_tokens", [])}
    largest = max([*pieces.values(), *added], default=-1)
    if largest >= vocab_size:
        raise ValueError(
            f"tokenizer.json has token id {largest}, past the model's {vocab_size} rows"
        )
    tokens = [f"[PAD{index}]" for index in range(vocab_size)]
    types = [UNUSED] * vocab_size
    for text, index in pieces.items():
        tokens[index] = text
        types[index] = BYTE if sentencepiece and _BYTE_TOKEN.fullmatch(text) else NORMAL
    if sentencepiece and model.get("unk_id") is not None:
        types[int(model["unk_id"])] = UNKNOWN
    for index, token in added.items():
        tokens[index] = token["content"]
        types[index] = CONTROL if token.get("special") else USER_DEFINED
        if sentencepiece and _BYTE_TOKEN.fullmatch(token["content"]):
            types[index] = BYTE  # llama.cpp's rule: the byte pattern first
    keys: dict[str, Any] = {"tokens": tokens, "token_type": types}
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    if sentencepiece:
        keys["model"] = "llama"
        keys["scores"] = _sentencepiece_scores(model, merges, vocab_size)
    else:
        keys["model"] = "gpt2"
        keys["pre"] = tokenizer_pre or detect_tokenizer_pre(tokenizer)
        keys["merges"] = merges
    ids = {text: index for index, text in reversed(list(enumerate(tokens)))}
    for name, key in _SPECIAL_KEYS.items():
        token_id = _special_id(
            tokenizer_config.get(f"{name}_token"), ids, config.get(f"{name}_token_id")
        )
        if token_id is not None:
            keys[f"{key}_token_id"] = token_id
    for name in ("bos", "eos"):
        add = tokenizer_config.get(f"add_{name}_token")
        if add is None:
            add = _post_processor_adds(tokenizer, tokens, keys.get(f"{name}_token_id"), name)
        if add is not None:
            keys[f"add_{name}_token"] = bool(add)
    return keys


def _model_pieces(model: dict[str, Any]) -> dict[str, int]:
    """The model's own vocabulary, text -> id."""
    if model["type"] == "Unigram":
        return {piece: index for index, (piece, _) in enumerate(model["vocab"])}
    return dict(model["vocab"])


def _sentencepiece_scores(model: dict[str, Any], merges: list[str], vocab_size: int) -> list[float]:
    """Per-token scores as llama.cpp's sentencepiece tokenizer reads them (the higher merges first): a Unigram's
    log probabilities; for BPE, minus the rank of the first merge that makes the token (0 for the unmerged)."""
    scores = [0.0] * vocab_size
    if model["type"] == "Unigram":
        for index, (_, score) in enumerate(model["vocab"]):
            scores[index] = float(score)
        return scores
    vocab = model["vocab"]
    for rank in reversed(range(len(merges))):
        merged = merges[rank].replace(" ", "", 1)
        if merged in vocab:
            scores[vocab[merged]] = -float(rank)
    return scores


def _special_id(token: Any, ids: dict[str, int], config_id: Any) -> int | None:
    """A special token's id: tokenizer_config.json's token (a string or an AddedToken dict), else config.json's."""
    if isinstance(token, dict):
        token = token.get("content")
    if isinstance(token, str) and token in ids:
        return ids[token]
    if isinstance(config_id, list):
        config_id = config_id[0] if config_id else None
    return int(config_id) if config_id is not None else None


def _post_processor_adds(
    tokenizer: dict[str, Any], tokens: list[str], token_id: int | None, name: str
) -> bool | None:
    """Whether a TemplateProcessing post-processor puts the token first (bos) or last (eos) of a single text;
    None without such a post-processor."""
    processor = tokenizer.get("post_processor") or {}
    if processor.get("type") != "TemplateProcessing" or token_id is None:
        return None
    single = processor.get("single") or []
    piece = (single[0] if name == "bos" else single[-1]) if single else {}
    return (piece.get("SpecialToken") or {}).get("id") == tokens[token_id]


# ---------------------------------------------------------------------------------------------------- reading
def tokenizer_folder(
    field: Callable[[str], Any], source: str | os.PathLike[str], cache_root: Path | None = None
) -> Path:
    """A Hugging Face tokenizer folder (tokenizer.json, tokenizer_config.json) made from a GGUF file's keys
    (`field(key)` -> value or None; `source` names the file in errors); cached by content (see the module
    docstring). ValueError, naming `--tokenizer`, when the file holds no tokenizer kvflow can rebuild."""
    tokens = field(_GGML + "tokens") or []
    tokenizer_json = field(HF_TOKENIZER_KEY) or _ggml_tokenizer_json(field, tokens, source)
    config = _tokenizer_config(field, tokens)
    digest = hashlib.sha256(
        (tokenizer_json + json.dumps(config, sort_keys=True)).encode()
    ).hexdigest()[:16]
    root = cache_root or Path(os.environ.get("KVFLOW_CACHE_DIR", Path.home() / ".cache" / "kvflow"))
    folder = root / "gguf_tokenizers" / digest
    if not (folder / "tokenizer_config.json").is_file():
        folder.mkdir(parents=True, exist_ok=True)
        for name, text in (
            ("tokenizer.json", tokenizer_json),
            ("tokenizer_config.json", json.dumps(config)),
        ):
            staging = folder / f".{name}.{os.getpid()}"
            staging.write_text(text, encoding="utf-8")
            staging.replace(
                folder / name
            )  # tokenizer_config.json last: its presence means complete
    return folder


def _tokenizer_config(field: Callable[[str], Any], tokens: list[str]) -> dict[str, Any]:
    """tokenizer_config.json from the file's special token ids, add_bos/eos flags and chat template."""
    config: dict[str, Any] = {}
    for name, key in _SPECIAL_KEYS.items():
        token_id = field(f"{_GGML}{key}_token_id")
        if token_id is not None and 0 <= int(token_id) < len(tokens):
            config[f"{name}_token"] = tokens[int(token_id)]
    for name in ("add_bos_token", "add_eos_token"):
        value = field(_GGML + name)
        if value is not None:
            config[name] = bool(value)
    chat_template = field(CHAT_TEMPLATE_KEY)
    if chat_template:
        config["chat_template"] = chat_template
    return config


def _ggml_tokenizer_json(
    field: Callable[[str], Any], tokens: list[str], source: str | os.PathLike[str]
) -> str:
    """tokenizer.json text for a "gpt2" (byte-level BPE) file's keys; ValueError for any other."""
    model = field(_GGML + "model")
    pre = field(_GGML + "pre") or "gpt-2"
    hint = "pass the original checkpoint's folder as tokenizer= (--tokenizer FOLDER)"
    if model != "gpt2" or not tokens:
        raise ValueError(
            f"{source}: the GGUF file holds no tokenizer kvflow can rebuild (no {HF_TOKENIZER_KEY}; "
            f"tokenizer.ggml.model is {model!r}, kvflow rebuilds 'gpt2' byte-level BPE); {hint}"
        )
    if pre not in PRE_TOKENIZER_PATTERNS:
        raise ValueError(
            f"{source}: tokenizer.ggml.pre {pre!r} is not one kvflow rebuilds "
            f"({', '.join(sorted(PRE_TOKENIZER_PATTERNS))}) and the file holds no {HF_TOKENIZER_KEY}; {hint}"
        )
    return _byte_level_bpe(field, tokens, pre).to_str()


def _byte_level_bpe(field: Callable[[str], Any], tokens: list[str], pre: str) -> Any:
    """The `tokenizers.Tokenizer` of a "gpt2" file: BPE over every token (ids as in the file), its merges,
    `pre`'s split, byte-level decoding; control tokens special, user-defined ones plain added tokens."""
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
    )

    vocab: dict[str, int] = {}
    for index, text in enumerate(tokens):
        vocab.setdefault(text, index)
    merges = [tuple(merge.split(" ", 1)) for merge in field(_GGML + "merges") or []]
    tokenizer = Tokenizer(models.BPE(vocab, merges, ignore_merges=pre in _IGNORE_MERGES))
    if pre == "gpt-2":
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(PRE_TOKENIZER_PATTERNS[pre]), "isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    if PRE_TOKENIZER_PATTERNS[pre] == QWEN2_PATTERN:
        tokenizer.normalizer = normalizers.NFC()
    tokenizer.decoder = decoders.ByteLevel()
    types = field(_GGML + "token_type") or []
    added = [
        AddedToken(tokens[index], special=kind == CONTROL, normalized=False)
        for index, kind in enumerate(types)
        if kind in (CONTROL, USER_DEFINED)
    ]
    tokenizer.add_special_tokens([token for token in added if token.special])
    tokenizer.add_tokens([token for token in added if not token.special])
    return tokenizer
