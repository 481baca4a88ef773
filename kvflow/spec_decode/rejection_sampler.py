"""Lossless verification of drafted tokens (speculative sampling, Leviathan et al. 2023 / Chen et al. 2023).

A request's step verifies k drafts d_0..d_{k-1} in one forward pass of the target model, which gives its
distribution p_i at each draft position (conditioned on the drafts before it) and p_k after the last one. The
emitted tokens are then distributed exactly as if the target had decoded them one by one, whatever proposed the
drafts; only the number of tokens a step yields (1..k+1) depends on the proposer.

Two forms of the one rule:

- `rejection_sample`: drafts with a proposal distribution q_i (a draft model). Draft i is accepted with
  probability min(1, p_i(d_i) / q_i(d_i)); at the first rejection the token is drawn from max(0, p_i - q_i),
  normalised, and the step ends; if every draft is accepted a bonus token is drawn from p_k.
- `accept_point_mass_drafts`: drafts with no distribution (n-gram lookup), i.e. q_i is a point mass on d_i,
  where the runner has already sampled one token x_i ~ p_i per verification row.
"""

from __future__ import annotations

import torch


def rejection_sample(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    draft_token_ids: torch.Tensor,
    generator: torch.Generator | None,
) -> list[int]:
    """The tokens one request emits from its k verified drafts: the accepted drafts, then one token drawn from the
    residual distribution at the first rejection or, if none was rejected, the bonus token from p_k (1..k+1 ids).

    `target_probs` [k+1, V]: the target's processed distribution (temperature, top-k/p, penalties applied) at
    each draft position and at the bonus position; `draft_probs` [k, V]: the distribution each draft was drawn
    from; `draft_token_ids` [k]. Randomness comes from `generator` only (on the tensors' device; None: torch's
    default), k+1 uniforms drawn at once (k acceptance tests, then the inverse-CDF draw of the last token), so a
    seeded request is reproducible. A draft with q_i(d_i) = 0 and p_i(d_i) > 0 is accepted (the ratio is
    infinite); one with p_i(d_i) = 0 never is.
    """
    num_drafts = draft_token_ids.numel()
    if target_probs.shape[0] != num_drafts + 1 or draft_probs.shape[0] != num_drafts:
        raise ValueError(
            f"rejection_sample needs target_probs [k+1, V] and draft_probs [k, V] for k={num_drafts} drafts, "
            f"got {tuple(target_probs.shape)} and {tuple(draft_probs.shape)}"
        )
    drafts = draft_token_ids.long().reshape(-1, 1)
    uniforms = torch.rand(
        num_drafts + 1, generator=generator, device=target_probs.device, dtype=torch.float64
    )
    target_at_draft = target_probs[:num_drafts].gather(1, drafts).reshape(-1)
    draft_at_draft = draft_probs.gather(1, drafts).reshape(-1)
    # u < p/q, written without the division: P(accept) = min(1, p/q); strict, so p = 0 never accepts.
    accepted = (uniforms[:num_drafts] * draft_at_draft < target_at_draft).tolist()
    num_accepted = 0
    while num_accepted < num_drafts and accepted[num_accepted]:
        num_accepted += 1
    if num_accepted < num_drafts:
        target_row = target_probs[num_accepted]
        weights = torch.clamp(target_row - draft_probs[num_accepted], min=0)
        last_token = _inverse_cdf(weights, uniforms[num_drafts], fallback=target_row)
    else:
        last_token = _inverse_cdf(target_probs[num_drafts], uniforms[num_drafts])
    return [*drafts[:num_accepted, 0].tolist(), last_token]


def _inverse_cdf(
    weights: torch.Tensor, uniform: torch.Tensor, fallback: torch.Tensor | None = None
) -> int:
    """The token whose share of the cumulative `weights` (unnormalised, >= 0) holds `uniform` in [0, 1): token x
    with probability weights[x] / sum(weights); a zero-weight token is never drawn.

    All-zero weights happen only for a residual max(0, p - q) with p = q, where a rejection has probability 0
    and occurs only through rounding: then `fallback` (p itself) is the right distribution.
    """
    cdf = torch.cumsum(weights.double(), dim=0)
    total = cdf[-1]
    if fallback is not None and not bool(total > 0):
        return _inverse_cdf(fallback, uniform)
    # uniform < 1, so uniform * total < cdf[-1] (up to rounding, hence the cap): the first entry above it has
    # weight > 0.
    token = int(torch.searchsorted(cdf, (uniform * total).reshape(1), right=True))
    return min(token, weights.shape[0] - 1)


def accept_point_mass_drafts(sampled: list[int], drafts: list[int]) -> list[int]:
    """The tokens one request emits when its drafts are point masses (n-gram) and `sampled[i]` was drawn from the
    target's distribution p_i at verification row i (len(drafts) + 1 rows): the longest prefix on which
    `sampled[i] == drafts[i]`, plus the next sampled token (the correction at the first mismatch, or the bonus).

    Why this is exact rejection sampling: with q_i the point mass on d_i, the general rule accepts d_i with
    probability min(1, p_i(d_i) / 1) = p_i(d_i), and on rejection draws from max(0, p_i - q_i) normalised, which
    is p_i(x) / (1 - p_i(d_i)) for x != d_i and 0 at d_i: p_i conditioned on x != d_i. Drawing x_i ~ p_i and
    accepting when x_i == d_i does both at once: acceptance has probability p_i(d_i), and given x_i != d_i,
    x_i is distributed as p_i conditioned on x != d_i; emitting x_i in either case is the same law. Row i's
    distribution is conditioned on drafts[:i], which is the emitted prefix exactly when every earlier draft was
    accepted, the only case in which row i is used. The rows must be sampled independently of each other and of
    the drafts (a request's seeded generator, one draw per row, keeps that and reproducibility). With greedy
    sampling (p_i one-hot on the argmax), this is "keep drafts while they equal the argmax".
    """
    if len(sampled) != len(drafts) + 1:
        raise ValueError(
            f"accept_point_mass_drafts needs one sampled token per draft plus the bonus: {len(drafts)} drafts, "
            f"{len(sampled)} sampled"
        )
    num_accepted = 0
    while num_accepted < len(drafts) and sampled[num_accepted] == drafts[num_accepted]:
        num_accepted += 1
    return list(sampled[: num_accepted + 1])
