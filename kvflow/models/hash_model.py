"""A deterministic stand-in model whose output is computable without the engine: the test oracle.

The model writes every scheduled token into a paged "KV cache" (one int64 per slot: the token itself) and samples
`next = H(tokens)` where the tokens are READ BACK from the cache through the request's block table. `H` is a
position-sensitive polynomial rolling hash, so a wrong block, slot, prefix-cache hit, or a dropped, duplicated or
reordered token changes the output; `reference_tokens` computes the expected output in plain Python.

    h(t_0..t_{L-1}) = sum_i (t_i mod P) * B**(L-1-i)  mod P
    next            = (h * MULTIPLIER + L) mod P mod vocab_size
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kvflow.batch import BatchInputs
    from kvflow.config import ModelConfig
    from kvflow.distributed import TensorParallelGroup
    from kvflow.model_info import ModelInfo

MODULUS = 2**31 - 1
BASE = 1_000_003
MULTIPLIER = 2654435761
DEFAULT_VOCAB_SIZE = 50256
# The hash model's EOS id: equal to the vocabulary size, so the model never emits it and never stops early.
DEFAULT_EOS_TOKEN_ID = 50256


def hash_tokens(token_ids: Sequence[int]) -> int:
    """`h(token_ids)`: the polynomial hash, computed by Horner's rule (each step reduced mod P)."""
    value = 0
    for token_id in token_ids:
        value = (value * BASE + token_id % MODULUS) % MODULUS
    return value


def next_token_from_hash(value: int, num_tokens: int, vocab_size: int = DEFAULT_VOCAB_SIZE) -> int:
    """The token sampled after `num_tokens` tokens whose hash is `value`."""
    return (value * MULTIPLIER + num_tokens) % MODULUS % vocab_size


def next_token(token_ids: Sequence[int], vocab_size: int = DEFAULT_VOCAB_SIZE) -> int:
    """The token the hash model samples after `token_ids`."""
    return next_token_from_hash(hash_tokens(token_ids), len(token_ids), vocab_size)


def reference_tokens(
    prompt_token_ids: Sequence[int], max_tokens: int, vocab_size: int = DEFAULT_VOCAB_SIZE
) -> list[int]:
    """The `max_tokens` tokens the hash model generates for a prompt, without the engine.

    Generation never stops early: the model never emits an id >= vocab_size, so `DEFAULT_EOS_TOKEN_ID` never
    appears. The hash is extended one token at a time (Horner), which equals rehashing the whole sequence.
    """
    value = hash_tokens(prompt_token_ids)
    num_tokens = len(prompt_token_ids)
    generated: list[int] = []
    for _ in range(max_tokens):
        token_id = next_token_from_hash(value, num_tokens, vocab_size)
        generated.append(token_id)
        value = (value * BASE + token_id) % MODULUS
        num_tokens += 1
    return generated


class HashModel:
    """The hash model, run by the real `ModelRunner`.

    Invariants: `forward` writes exactly the scheduled tokens into the cache (at `batch.slot_mapping`) before reading
    anything, and computes every sampled token only from values read back from the cache; it never emits an id
    outside [0, vocab_size). Its only state is a cache of powers of BASE mod P (grown on demand, never shrunk).
    It samples its own tokens (`samples_own_tokens`) and has no weights.
    """

    samples_own_tokens = True

    def __init__(self, vocab_size: int = DEFAULT_VOCAB_SIZE) -> None:
        self.vocab_size = vocab_size
        self._powers = torch.ones(1, dtype=torch.int64)

    @classmethod
    def build(
        cls,
        model_config: ModelConfig,
        model_info: ModelInfo,
        device: torch.device,
        tp: TensorParallelGroup | None = None,
    ) -> HashModel:
        """The hash model over `model_info`'s vocabulary (it has no weights; the runner moves its cache to `device`).
        Replicated under tensor parallelism: it needs no collective, and every rank samples the same tokens."""
        return cls(model_info.vocab_size)

    def make_kv_cache(self, num_blocks: int, block_size: int) -> torch.Tensor:
        """One int64 per KV slot, -1 for never written."""
        return torch.full((num_blocks * block_size,), -1, dtype=torch.int64)

    def kv_cache_bytes_per_block(self, block_size: int) -> int:
        """One int64 per token slot."""
        return block_size * 8

    def forward(self, batch: BatchInputs, kv_cache: torch.Tensor) -> torch.Tensor:
        """Write the scheduled tokens, then sample one token per `logits_indices` entry from the read-back KV of the
        positions up to it."""
        kv_cache[batch.slot_mapping] = batch.input_ids
        rows = batch.sampled_req_indices
        # Each sampled row's context: the tokens up to its logits position (a request's last scheduled token,
        # or with drafts each of its last `drafts + 1` tokens).
        seq_lens = batch.positions[batch.logits_indices[: rows.shape[0]]].to(torch.int64) + 1
        block_tables = batch.block_tables[rows].to(torch.int64)
        token_ids, segment_ids, exponents = self._read_back(
            kv_cache, block_tables, seq_lens, batch.block_size
        )
        terms = token_ids.remainder(MODULUS) * self._powers_of_base(exponents) % MODULUS
        # Sum each row's terms into its hash: h = sum_i t_i * B**(L-1-i) (each term is already reduced mod P).
        hashes = torch.zeros(rows.shape[0], dtype=torch.int64, device=kv_cache.device)
        hashes.index_add_(0, segment_ids, terms)
        return (hashes % MODULUS * MULTIPLIER + seq_lens) % MODULUS % self.vocab_size

    def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], strict: bool = True
    ) -> None:
        """Always refuses: the hash model has no parameters, so any weight update is a caller's mistake."""
        raise ValueError("the hash test model has no weights to update")

    @staticmethod
    def _read_back(
        kv_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Gather positions 0..seq_len-1 of every row through its block table, as one flat tensor.

        Returns the tokens, the row of each, and each token's exponent `seq_len - 1 - position` in the hash. Every
        token is read back through the block table (never taken from the batch), so a wrong block or slot shows.

        E.g., seq_lens [3, 2], block_size 2, block_tables [[4, 1], [7, 0]]: the tokens sit in KV slots
        [8, 9, 2, 14, 15], rows [0, 0, 0, 1, 1], exponents [2, 1, 0, 1, 0].
        """
        device = kv_cache.device
        # The row (segment) of each flat token. E.g., [3, 2] -> [0, 0, 0, 1, 1]
        segment_ids = torch.repeat_interleave(
            torch.arange(seq_lens.shape[0], device=device), seq_lens
        )
        # Where each row starts in the flat list. E.g., [3, 5] - [3, 2] -> [0, 3]
        segment_starts = torch.cumsum(seq_lens, 0) - seq_lens
        # Position within its row. E.g., [0, 1, 2, 3, 4] - [0, 0, 0, 3, 3] -> [0, 1, 2, 0, 1]
        positions = torch.arange(segment_ids.shape[0], device=device) - segment_starts[segment_ids]
        # E.g., table columns [0, 0, 1, 0, 0] -> blocks [4, 4, 1, 7, 7]
        blocks = block_tables[segment_ids, positions // block_size]
        # E.g., [4, 4, 1, 7, 7] * 2 + [0, 1, 0, 0, 1] -> KV slots [8, 9, 2, 14, 15]
        token_ids = kv_cache[blocks * block_size + positions % block_size]
        # Horner order: the last token has exponent 0. E.g., [2, 2, 2, 1, 1] - [0, 1, 2, 0, 1] -> [2, 1, 0, 1, 0]
        return token_ids, segment_ids, seq_lens[segment_ids] - 1 - positions

    def _powers_of_base(self, exponents: torch.Tensor) -> torch.Tensor:
        """BASE**exponents mod P, from a cached table grown by doubling."""
        needed = int(exponents.max()) + 1 if exponents.numel() else 1
        while self._powers.shape[0] < needed:
            step = int(self._powers[-1]) * BASE % MODULUS  # BASE ** len(powers)
            self._powers = torch.cat([self._powers, self._powers * step % MODULUS])
        if self._powers.device != exponents.device:
            self._powers = self._powers.to(exponents.device)
        return self._powers[exponents]


# ---------------------------------------------------------------------------------------------- with logits
# The synthetic vocabulary grammars see on the hash-logits model: token i is "a<i>" for even i and "b<i>" for odd
# i, except `HASH_GRAMMAR_STOP_TOKEN_ID` (the last id), its end-of-output token, which no pattern matches.
def hash_grammar_stop_token_id(vocab_size: int = DEFAULT_VOCAB_SIZE) -> int:
    return vocab_size - 1


def hash_grammar_token_bytes(vocab_size: int = DEFAULT_VOCAB_SIZE) -> list[bytes]:
    """Token i's text in the synthetic vocabulary (see above)."""
    tokens = [(b"a%d" if i % 2 == 0 else b"b%d") % i for i in range(vocab_size)]
    tokens[hash_grammar_stop_token_id(vocab_size)] = b"</s>"
    return tokens


class HashLogitsModel(HashModel):
    """The hash model with logits, so the runner's sampler, logits controls and grammar masks apply to it.

    Row r's logits rank every token by how far after the hash's token `next_r` it comes, cyclically:
    `logits[r, v] = -((v - next_r) mod vocab_size)`. Greedy sampling without a mask takes `next_r` (the hash
    model's token, so `reference_tokens` still holds); under a mask it takes the first allowed token at or after
    `next_r`, which a test computes without the engine. It has no prompt logprobs.
    """

    samples_own_tokens = False

    def forward(self, batch: BatchInputs, kv_cache: torch.Tensor) -> torch.Tensor:
        if batch.logits_indices.shape[0] != batch.sampled_req_indices.shape[0]:
            raise ValueError("the hash-logits model has no prompt logprobs")
        next_tokens = super().forward(batch, kv_cache)
        vocab = torch.arange(self.vocab_size, device=next_tokens.device)
        distance = (vocab[None, :] - next_tokens[:, None]).remainder(self.vocab_size)
        return -distance.to(torch.float32)
