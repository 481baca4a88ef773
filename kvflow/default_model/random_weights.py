"""A small random-weight Llama checkpoint with a byte-level BPE tokenizer, built deterministically on the spot.

kvflow's default model used to be this; it stays for tests that need a checkpoint of a fixed, known shape (its
tokenizer has 1024 entries, BOS 1020 ... `<|im_end|>` 1023) without caring what it writes. `build_random_model(out)`
writes the folder in Hugging Face format; `transformers` loads the same folder for reference comparisons.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvflow.default_model.tokenizer import (
    BOS_TOKEN,
    END_OF_TEXT_TOKEN,
    EOS_TOKEN,
    SPECIAL_TOKENS,
    tokenizer_config,
    train_tokenizer,
)

if TYPE_CHECKING:
    import tokenizers

NUM_BPE_TOKENS = (
    1020  # 256 bytes + 764 merges; with the 4 special tokens the vocabulary has 1024 entries
)
WEIGHT_SEED = 0
WEIGHT_STD = 0.02

MODEL_ARCHITECTURE: dict[str, Any] = {
    "hidden_size": 256,
    "intermediate_size": 688,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 32,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 2048,
}

# The tokenizer's training text. Changing it changes the random model's tokenizer (and its vocabulary ids).
_CORPUS = """\
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step.
Once upon a time, in a small village at the edge of a great forest, there lived an old clockmaker and his
daughter. Every morning the clockmaker opened the shutters of his shop, wound the tall clock by the door, and
listened to the town wake up: the baker pulling bread from the oven, children running to school, carts rolling
over the stones of the market square. His daughter, who was called Mira, loved numbers more than anything. She
counted the steps from the shop to the river (four hundred and twelve), the bells of the church at noon (twelve),
and the stars she could name on a clear winter night (more than thirty).
One evening a traveller knocked at the door. He carried a broken pocket watch and a map that nobody in the village
could read. "Can you mend it?" he asked. The clockmaker turned the watch over in his hands, opened the case, and
smiled. "Everything that was made can be understood," he said, "and everything that is understood can be mended."
The history of science is a history of questions. Why does the sun rise in the east? What are the stars made of?
How do plants turn light into food? Early astronomers measured the positions of the planets with simple
instruments, and from careful observation they built models of the sky. Later, physicists described motion with
equations: a body at rest stays at rest, and a body in motion keeps moving unless a force acts on it. Chemists
learned that water is made of hydrogen and oxygen, that air is a mixture of gases, and that fire is a reaction
which releases energy. Biologists discovered cells, genes, and the slow process of evolution by natural selection.
Today researchers study everything from the smallest particles to the largest galaxies, and computers help them
simulate systems that are far too complex to solve by hand.
A computer program is a list of instructions. The processor reads each instruction from memory, decodes it, and
executes it. Programs store their data in variables, repeat work with loops, and make decisions with conditions.
For example, a function that adds two numbers might look like this:
def add(first, second):
    return first + second
for index in range(10):
    if index % 2 == 0:
        print(index, "is even")
    else:
        print(index, "is odd")
Modern software is built from many layers: an operating system manages the hardware, a runtime manages memory,
libraries provide common tools, and applications solve problems for people. Good engineers write code that is
simple, tested, and easy to read. They measure performance before they optimize it, and they keep a clear record
of every change. When a system fails, they look for the root cause instead of hiding the symptom.
Language models predict the next word in a sequence. Given the text "The capital of France is", a trained model
assigns a high probability to "Paris". During generation the model produces one token at a time: it reads the
prompt, computes a distribution over its vocabulary, samples a token, appends it, and repeats until it reaches a
stop condition or the maximum number of tokens. An inference engine keeps the attention keys and values of earlier
tokens in a cache, so that each new step only computes the newest position. Requests that share a prefix can
share cached blocks, and a scheduler batches many requests together so the hardware stays busy.
Cooking is chemistry you can eat. To bake a simple loaf of bread, mix five hundred grams of flour, ten grams of
salt, seven grams of yeast, and three hundred and fifty millilitres of warm water. Knead the dough for ten
minutes, until it is smooth and elastic, then let it rise in a warm place for an hour. Shape the loaf, let it rise
again, and bake it at two hundred and twenty degrees for about thirty five minutes. The crust should be golden
brown, and the bottom should sound hollow when you tap it. Soup is even easier: soften an onion in olive oil, add
carrots, potatoes, beans, and stock, and simmer everything until the vegetables are tender.
The weather changed quickly that spring. On Monday it was warm and sunny; on Tuesday a cold wind blew from the
north; on Wednesday it rained all day, and the streets shone like mirrors. By Thursday the clouds had cleared,
and on Friday the first swallows returned to nest under the roof of the old station. Farmers watched the sky
with care, because a late frost could ruin the blossoms on the apple trees and cost them the whole harvest.
Dear Sam, thank you for your letter. I am writing to let you know that the meeting has moved to next Thursday at
half past nine in the morning. Please bring the report, the budget for the new year, and any questions you would
like to discuss. If you cannot attend, send me a short note and I will share the minutes afterwards.
Best regards, Alex.
Questions and answers. Q: What is the largest ocean on Earth? A: The Pacific Ocean. Q: How many days are there
in a leap year? A: Three hundred and sixty six. Q: Which planet is known as the red planet? A: Mars.
Q: Who wrote the play about a prince of Denmark? A: William Shakespeare. Q: What do bees make? A: Honey.
Numbers and dates: 0 1 2 3 4 5 6 7 8 9 10 11 12 20 25 42 50 64 99 100 128 256 512 1000 1024 2048 4096 65536.
The year 1969, the year 2000, the year 2024; 3.14159, 2.71828, 1.41421; 50% off, $19.99, 7 x 8 = 56, 12 / 4 = 3.
January, February, March, April, May, June, July, August, September, October, November, December.
Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday. Spring, summer, autumn, winter.
Red, orange, yellow, green, blue, indigo, violet, black, white, grey, brown, pink, purple, silver, gold.
User: Can you help me plan a trip? Assistant: Of course! Where would you like to go, and for how long?
User: Three days in the mountains. Assistant: Great choice. On the first day, hike to the lake and have a picnic.
On the second day, visit the village museum and the old bridge. On the third day, take the cable car to the
summit early in the morning, before the clouds arrive, and enjoy the view. Pack warm clothes, water, and a map.
User: Explain recursion in one sentence. Assistant: Recursion is when a function solves a problem by calling
itself on a smaller version of the same problem until it reaches a case simple enough to answer directly.
Health and habits: sleep seven to nine hours, drink enough water, walk every day, eat fruit and vegetables, and
take breaks from the screen. Small changes, repeated for months, make a larger difference than heroic efforts
that last a week. Learning works the same way: practise a little every day, review what you forgot, and teach
someone else what you learned, because explaining an idea is the best test of understanding it.
The library was quiet except for the turning of pages. Tall shelves held books about history, geography,
mathematics, music, art, medicine, law, philosophy, and poetry. A student in the corner was reading about the
ancient roads that connected distant cities; another was solving problems in geometry, drawing triangles and
circles with great care. The librarian, who knew where every book belonged, walked slowly between the rows and
returned each volume to its place.
Punctuation marks: commas, periods, colons: semicolons; question marks? exclamation marks! quotes "like this" and
'like that', parentheses (round), brackets [square], braces {curly}, hyphens - and dashes, slashes / and
backslashes \\, the at sign @, the hash #, the ampersand &, the asterisk *, the plus + and equals = signs.
Some words from other languages appear in English text: café, naïve, résumé, façade, piñata, über, déjà vu,
fiancée, jalapeño, smörgåsbord, crème brûlée.
"""


def build_random_model(out_dir: Path) -> None:
    """Write the complete checkpoint into `out_dir` (created; must not exist), marker last. Deterministic."""
    out_dir.mkdir(parents=True)
    tokenizer = build_tokenizer()
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    special_ids = {token: tokenizer.token_to_id(token) for token in SPECIAL_TOKENS}
    (out_dir / "tokenizer.json").write_text(tokenizer.to_str(pretty=True) + "\n", encoding="utf-8")
    _write_json(
        out_dir / "tokenizer_config.json",
        tokenizer_config(special_ids, MODEL_ARCHITECTURE["max_position_embeddings"]),
    )
    _write_json(out_dir / "config.json", _model_config(vocab_size, special_ids))
    _write_json(
        out_dir / "generation_config.json",
        {
            "bos_token_id": special_ids[BOS_TOKEN],
            "eos_token_id": [special_ids[EOS_TOKEN], special_ids[END_OF_TEXT_TOKEN]],
        },
    )
    _write_weights(out_dir / "model.safetensors", vocab_size)


def build_tokenizer() -> tokenizers.Tokenizer:
    """The random-weight model's tokenizer: byte-level BPE trained on the embedded corpus (1024 tokens)."""
    return train_tokenizer(_CORPUS.splitlines(keepends=True), NUM_BPE_TOKENS + len(SPECIAL_TOKENS))


def _model_config(vocab_size: int, special_ids: dict[str, int]) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **MODEL_ARCHITECTURE,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": WEIGHT_STD,
        "rope_scaling": None,
        "tie_word_embeddings": False,
        "vocab_size": vocab_size,
        "bos_token_id": special_ids[BOS_TOKEN],
        "eos_token_id": special_ids[EOS_TOKEN],
        "pad_token_id": special_ids[END_OF_TEXT_TOKEN],
        "torch_dtype": "float32",
        "use_cache": True,
    }


def _parameter_shapes(vocab_size: int) -> list[tuple[str, tuple[int, ...]]]:
    """Hugging Face Llama parameter names and shapes, in the fixed order the generator fills them."""
    hidden = MODEL_ARCHITECTURE["hidden_size"]
    head_dim = MODEL_ARCHITECTURE["head_dim"]
    q_size = MODEL_ARCHITECTURE["num_attention_heads"] * head_dim
    kv_size = MODEL_ARCHITECTURE["num_key_value_heads"] * head_dim
    intermediate = MODEL_ARCHITECTURE["intermediate_size"]
    shapes: list[tuple[str, tuple[int, ...]]] = [
        ("model.embed_tokens.weight", (vocab_size, hidden))
    ]
    for layer in range(MODEL_ARCHITECTURE["num_hidden_layers"]):
        prefix = f"model.layers.{layer}"
        shapes += [
            (f"{prefix}.input_layernorm.weight", (hidden,)),
            (f"{prefix}.self_attn.q_proj.weight", (q_size, hidden)),
            (f"{prefix}.self_attn.k_proj.weight", (kv_size, hidden)),
            (f"{prefix}.self_attn.v_proj.weight", (kv_size, hidden)),
            (f"{prefix}.self_attn.o_proj.weight", (hidden, q_size)),
            (f"{prefix}.post_attention_layernorm.weight", (hidden,)),
            (f"{prefix}.mlp.gate_proj.weight", (intermediate, hidden)),
            (f"{prefix}.mlp.up_proj.weight", (intermediate, hidden)),
            (f"{prefix}.mlp.down_proj.weight", (hidden, intermediate)),
        ]
    shapes += [("model.norm.weight", (hidden,)), ("lm_head.weight", (vocab_size, hidden))]
    return shapes


def _write_weights(path: Path, vocab_size: int) -> None:
    import torch
    from safetensors.torch import save_file

    generator = torch.Generator(device="cpu").manual_seed(WEIGHT_SEED)
    tensors: dict[str, torch.Tensor] = {}
    for name, shape in _parameter_shapes(vocab_size):
        if name.endswith("norm.weight"):
            tensors[name] = torch.ones(shape, dtype=torch.float32)
        else:
            tensors[name] = (
                torch.randn(shape, generator=generator, dtype=torch.float32) * WEIGHT_STD
            )
    save_file(tensors, str(path), metadata={"format": "pt"})
    path.chmod(0o644)  # safetensors creates the file owner-only; the cache may be shared


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
