"""The tokenizer inside GGUF files (kvflow.models.quantization.gguf_tokenizer): the converter writes llama.cpp's
`tokenizer.ggml.*` keys (read back with gguf's own reader) and kvflow's `tokenizer.huggingface.json`; a file with
only llama.cpp's keys (as llama.cpp's converter makes them) still tokenizes as the Hugging Face tokenizer did, for
GPT-2's, Llama 3's and Qwen 2's pre-tokenizers; a file with no tokenizer kvflow can rebuild is an error naming
`--tokenizer`. Tokenizers are trained on the spot with the `tokenizers` library."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import gguf
import pytest
from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    trainers,
)

from kvflow.default_model import ensure_default_model
from kvflow.models.quantization.gguf_file import GGUFCheckpoint
from kvflow.models.quantization.gguf_tokenizer import HF_TOKENIZER_KEY, PRE_TOKENIZER_PATTERNS
from kvflow.models.quantization.gguf_writer import write_gguf
from kvflow.testing.hf_checkpoints import make_tiny_checkpoint
from kvflow.testing.pooling_checkpoints import corpus_words
from kvflow.tokenizer.loading import load_tokenizer

TEXTS = [
    "Once upon a time",
    "Hello,  world!\n\n  12345 67 it's   done\t\tok",
    "café naïve 日本語 🙂 e\u0301",
    "<|im_start|>user\nHi there<|im_end|>\n<think>\nhmm\n</think>",
]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
VOCAB_SIZE = 384


def fields_of(path: Path) -> dict[str, object]:
    reader = gguf.GGUFReader(str(path))
    return {name: field.contents() for name, field in reader.fields.items()}


def byte_level_tokenizer(pre: str) -> Tokenizer:
    """A byte-level BPE like GPT-2's ('gpt-2'), Llama 3's ('llama-bpe') or Qwen 2's ('qwen2'), with ChatML
    specials and `<think>` / `</think>` as plain added tokens."""
    tokenizer = Tokenizer(models.BPE(ignore_merges=pre == "llama-bpe"))
    if pre == "gpt-2":
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(PRE_TOKENIZER_PATTERNS[pre]), "isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    if pre == "qwen2":
        tokenizer.normalizer = normalizers.NFC()
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - 5,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator([" ".join(corpus_words())] * 4 + TEXTS[:3], trainer=trainer)
    tokenizer.add_special_tokens(
        [AddedToken(text, special=True, normalized=False) for text in SPECIALS]
    )
    tokenizer.add_tokens([AddedToken(text, normalized=False) for text in ("<think>", "</think>")])
    return tokenizer


def checkpoint_with(folder: Path, tokenizer: Tokenizer) -> Path:
    checkpoint = make_tiny_checkpoint(folder, "qwen2", vocab_size=VOCAB_SIZE)
    tokenizer.save(str(checkpoint / "tokenizer.json"))
    config = {
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "chat_template": "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}",
    }
    (checkpoint / "tokenizer_config.json").write_text(json.dumps(config))
    return checkpoint


def test_the_converter_writes_llama_cpp_keys_and_the_hugging_face_tokenizer(
    tmp_path: Path,
) -> None:
    default_dir = ensure_default_model()
    path = write_gguf(default_dir, tmp_path / "default.gguf", "Q8_0")
    fields = fields_of(path)
    tokenizer = json.loads((default_dir / "tokenizer.json").read_text())
    config = json.loads((default_dir / "tokenizer_config.json").read_text())
    assert fields["tokenizer.ggml.model"] == "gpt2" and fields["tokenizer.ggml.pre"] == "gpt-2"
    tokens = fields["tokenizer.ggml.tokens"]
    assert all(tokens[index] == text for text, index in tokenizer["model"]["vocab"].items())
    assert fields["tokenizer.ggml.token_type"][4094] == gguf.TokenType.CONTROL
    assert len(fields["tokenizer.ggml.merges"]) == len(tokenizer["model"]["merges"])
    # Special tokens as tokenizer_config.json names them (llama.cpp's converter's rule).
    assert tokens[fields["tokenizer.ggml.bos_token_id"]] == config["bos_token"]
    assert tokens[fields["tokenizer.ggml.eos_token_id"]] == config["eos_token"]
    assert tokens[fields["tokenizer.ggml.padding_token_id"]] == config["pad_token"]
    assert fields["tokenizer.ggml.add_bos_token"] is True
    assert fields["tokenizer.chat_template"] == config["chat_template"]
    assert fields[HF_TOKENIZER_KEY] == (default_dir / "tokenizer.json").read_text()
    alone = write_gguf(default_dir, tmp_path / "ggml_only.gguf", "Q8_0", embed_hf_tokenizer=False)
    assert HF_TOKENIZER_KEY not in fields_of(alone)


@pytest.mark.parametrize("pre", ["gpt-2", "llama-bpe", "qwen2"])
def test_a_file_with_only_llama_cpp_keys_tokenizes_as_the_hugging_face_tokenizer(
    tmp_path: Path, pre: str
) -> None:
    checkpoint = checkpoint_with(tmp_path / "checkpoint", byte_level_tokenizer(pre))
    path = write_gguf(checkpoint, tmp_path / "model.gguf", "F32", embed_hf_tokenizer=False)
    fields = fields_of(path)
    assert fields["tokenizer.ggml.pre"] == pre and HF_TOKENIZER_KEY not in fields
    assert fields["tokenizer.ggml.eos_token_id"] == fields["tokenizer.ggml.tokens"].index(
        "<|im_end|>"
    )
    folder = GGUFCheckpoint(path).tokenizer_folder(tmp_path / "cache")
    original, rebuilt = load_tokenizer(checkpoint), load_tokenizer(folder)
    for text in TEXTS:
        assert rebuilt.encode(text) == original.encode(text), text
        assert rebuilt.decode(rebuilt.encode(text)) == original.decode(original.encode(text))
    assert rebuilt.eos_token == "<|im_end|>" and rebuilt.pad_token == "<|endoftext|>"
    messages = [{"role": "user", "content": "Hi"}]
    assert rebuilt.apply_chat_template(messages) == original.apply_chat_template(messages)


def test_sentencepiece_style_vocabularies_are_llama_cpp_llama_model(tmp_path: Path) -> None:
    byte_tokens = [f"<0x{value:02X}>" for value in range(256)]
    tokenizer = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tokenizer.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        show_progress=False,
        special_tokens=["<unk>", "<s>", "</s>", *byte_tokens],
    )
    tokenizer.train_from_iterator([" ".join(corpus_words())], trainer=trainer)
    checkpoint = make_tiny_checkpoint(tmp_path / "checkpoint", "llama", vocab_size=VOCAB_SIZE)
    tokenizer.save(str(checkpoint / "tokenizer.json"))
    (checkpoint / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True})
    )
    fields = fields_of(write_gguf(checkpoint, tmp_path / "spm.gguf", "F32"))
    assert fields["tokenizer.ggml.model"] == "llama" and "tokenizer.ggml.pre" not in fields
    tokens, types = fields["tokenizer.ggml.tokens"], fields["tokenizer.ggml.token_type"]
    assert types[tokens.index("<0x41>")] == gguf.TokenType.BYTE
    assert types[tokens.index("<s>")] == gguf.TokenType.CONTROL
    assert tokens[fields["tokenizer.ggml.bos_token_id"]] == "<s>"
    # Scores: a token made by an earlier merge scores higher (llama.cpp merges the best-scoring pair first).
    merges = json.loads(tokenizer.to_str())["model"]["merges"]
    first, later = ("".join(merges[0]), "".join(merges[-1]))
    scores = fields["tokenizer.ggml.scores"]
    assert scores[tokens.index(first)] > scores[tokens.index(later)]


def test_a_file_without_a_rebuildable_tokenizer_names_the_option(tmp_path: Path) -> None:
    checkpoint = make_tiny_checkpoint(tmp_path / "checkpoint", "llama")  # no tokenizer.json
    path = write_gguf(checkpoint, tmp_path / "model.gguf", "F32")
    with pytest.raises(ValueError, match=r"no tokenizer kvflow can rebuild.*--tokenizer FOLDER"):
        GGUFCheckpoint(path).tokenizer_folder(tmp_path / "cache")
    # A tokenizer.json beside the file is the one used.
    shutil.copy(ensure_default_model() / "tokenizer.json", tmp_path / "tokenizer.json")
    assert GGUFCheckpoint(path).tokenizer_source() == str(tmp_path)
