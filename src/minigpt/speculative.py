"""Speculative sampling: a small draft model proposes tokens, the target model checks them.

Each round the draft model proposes k tokens, one cheap forward pass each, and the target
model scores all of them in a single forward pass. Proposal x_i, drawn from the draft's
q_i, is accepted with probability min(1, p_i(x_i) / q_i(x_i)), p_i being the target's
distribution at that position; at the first rejection a token is drawn from the residual
max(0, p_i - q_i), normalised, and the round ends. If all k are accepted, the target's
pass has already computed p_{k+1}, and one more token is drawn from it. The tokens that
come out are distributed exactly as if drawn from the target alone, one at a time
(Leviathan et al., 2023; Chen et al., 2023): the draft changes the speed, never the text's
distribution (the same distribution, not the same text: the random draws differ).
Exactness needs only that the q in the ratio is the distribution the proposal was drawn
from; temperature, top-k and top-p define the p the tokens follow. Reshaping q like p,
as done here, is for speed (a q closer to p is accepted more often), not for exactness.
With greedy decoding both are one-hot and the result is exactly the target's greedy
continuation, the same text.

Both models keep a key-value cache; the positions of rejected proposals are cropped off.
Learned absolute positions cannot slide a cached window, so once the sequence fills the
context, the remaining tokens are drawn from the target one pass at a time, as `generate`
does.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import NamedTuple

import torch
from torch import Tensor

from minigpt.decoding import (
    _check_sampling,
    _next_logits,
    _prompt_tensor,
    next_token_distribution,
)
from minigpt.model import GPT, eval_mode


class SpeculativeResult(NamedTuple):
    """What `speculative_generate` returns.

    Attributes:
        ids: (T + N,) the prompt followed by the N new tokens.
        prompt_length: T.
        target_passes: forward passes of the target model (the prompt's included).
        draft_passes: forward passes of the draft model.
        proposed: draft tokens proposed in all rounds.
        accepted: of those, how many the target accepted.
        rejected: how many it rejected (at most one a round; the proposals after a
            rejection are never checked).
    """

    ids: Tensor
    prompt_length: int
    target_passes: int
    draft_passes: int
    proposed: int
    accepted: int
    rejected: int

    @property
    def acceptance_rate(self) -> float:
        """The share of checked proposals that were accepted, accepted / (accepted +
        rejected): the alpha of tokens per pass (1 - alpha^(k+1)) / (1 - alpha)."""
        checked = self.accepted + self.rejected
        return self.accepted / checked if checked else float("nan")

    @property
    def tokens_per_pass(self) -> float:
        """New tokens per forward pass of the target (plain sampling: 1)."""
        new = int(self.ids.shape[0]) - self.prompt_length
        return new / self.target_passes if self.target_passes else float("nan")


def verify(p: Tensor, q: Tensor, token: int,
           generator: torch.Generator | None = None) -> tuple[bool, int]:
    """Check one proposal ``token`` drawn from q (V,) against the target's p (V,).

    Returns (True, token) with probability min(1, p[token] / q[token]); otherwise
    (False, y) with y drawn from max(0, p - q) / sum(max(0, p - q)).
    """
    u = torch.rand((), generator=generator, device=p.device)
    # u < p/q, without dividing (q[token] > 0: it was drawn from q)
    if u * q[token] < p[token]:
        return True, token
    residual = (p - q).clamp(min=0.0)
    mass = residual.sum()
    # p and q equal to rounding: so is this rejection, and the residual is empty (0 / 0)
    dist = residual / mass if mass > torch.finfo(p.dtype).eps else p
    y = torch.multinomial(dist, 1, generator=generator)
    return False, int(y)


@torch.no_grad()
def speculative_generate(target: GPT, draft: GPT, prompt_ids: Tensor | Sequence[int],
                         max_new_tokens: int, *, k: int = 4, temperature: float = 1.0,
                         top_k: int | None = None, top_p: float | None = None,
                         greedy: bool = False, generator: torch.Generator | None = None,
                         use_cache: bool = True) -> SpeculativeResult:
    """Extend one prompt by ``max_new_tokens`` tokens of the target, k proposed at a time.

    Args:
        target, draft: the model the tokens follow, and a smaller one of its vocabulary.
        prompt_ids: one prompt, (T,) ids or a list of ints.
        max_new_tokens, k: N >= 0 new tokens; k >= 1 proposals per round.
        temperature, top_k, top_p, greedy: as in `minigpt.decoding.generate`; they define
            the target's distribution the tokens follow, and the draft's is reshaped alike
            (for a higher acceptance rate; exactness does not depend on it).
        generator: the torch.Generator every random draw uses.
        use_cache: keep a key-value cache in both models (False: slower, same tokens).

    Returns a `SpeculativeResult`. The prompt and both models are left as they were.
    """
    ids = _check_args(target, draft, prompt_ids, max_new_tokens, k, temperature, top_k, top_p)
    shape = partial(next_token_distribution, temperature=temperature, top_k=top_k, top_p=top_p,
                    greedy=greedy)  # the same reshaping for p and q
    device = next(target.parameters()).device
    seq = ids.to(device=device, dtype=torch.long, copy=True).unsqueeze(0)  # (1, n)
    end = seq.shape[1] + max_new_tokens
    context = min(target.config.context_length, draft.config.context_length)
    t_cache = target.new_cache() if use_cache else None
    d_cache = draft.new_cache() if use_cache else None
    passes, draft_passes, proposed, accepted, rejected = 0, 0, 0, 0, 0
    with eval_mode(target, draft):
        while seq.shape[1] < end:
            n = seq.shape[1]
            kk = min(k, context - n, end - n - 1)  # proposals that fit the context and N
            if kk < 1:  # no room to speculate: one token from the target alone
                p = shape(_next_logits(target, seq, target.config.context_length, t_cache))
                passes += 1
                seq = torch.cat([seq, torch.multinomial(p, 1, generator=generator)], dim=1)
                continue
            proposals, qs = seq, []
            for _ in range(kk):  # the draft proposes x_1..x_kk, reading one token per pass
                q = shape(_next_logits(draft, proposals, context, d_cache))[0]
                qs.append(q)
                proposals = torch.cat([proposals, torch.multinomial(q, 1, generator=generator)
                                       .view(1, 1)], dim=1)
            draft_passes += kk
            # One pass of the target over everything it has not read: p_1..p_{kk+1}.
            new = proposals[:, t_cache.length:] if t_cache is not None else proposals
            ps = shape(target(new, cache=t_cache)[0, -(kk + 1):].float())
            passes += 1
            m, extra = _accepted(ps, qs, proposals[0, n:], generator)
            proposed, accepted = proposed + kk, accepted + m
            rejected += m < kk
            seq = torch.cat([proposals[:, :n + m], seq.new_tensor([[extra]])], dim=1)
            for cache in (t_cache, d_cache):  # forget the rejected proposals
                if cache is not None:
                    cache.crop(min(cache.length, seq.shape[1] - 1))
    return SpeculativeResult(seq[0, :end], ids.shape[0], passes, draft_passes, proposed,
                             accepted, rejected)


def _accepted(ps: Tensor, qs: list[Tensor], proposals: Tensor,
              generator: torch.Generator | None) -> tuple[int, int]:
    """Check the kk proposals in order: how many are accepted, and the token that follows
    them (drawn from a residual at the first rejection, else from p_{kk+1})."""
    for i, q in enumerate(qs):
        ok, token = verify(ps[i], q, int(proposals[i]), generator)
        if not ok:
            return i, token
    return len(qs), int(torch.multinomial(ps[len(qs)], 1, generator=generator))


def _check_args(target: GPT, draft: GPT, prompt_ids: Tensor | Sequence[int],
                max_new_tokens: int, k: int, temperature: float, top_k: int | None,
                top_p: float | None) -> Tensor:
    """Check the arguments where they enter; returns the prompt (T,)."""
    if target.config.vocab_size != draft.config.vocab_size:
        raise ValueError(f"the draft's vocabulary ({draft.config.vocab_size} tokens) differs "
                         f"from the target's ({target.config.vocab_size}); both models must "
                         "share one tokenizer")
    if next(target.parameters()).device != next(draft.parameters()).device:
        raise ValueError("the draft and the target must be on the same device")
    ids = _prompt_tensor(prompt_ids, target.config.vocab_size)
    if ids.dim() != 1:
        raise ValueError(f"speculative_generate takes one prompt of shape (T,), got "
                         f"{tuple(ids.shape)}")
    if k < 1:
        raise ValueError(f"k (proposals per round) must be >= 1, got {k}")
    _check_sampling(target.config.vocab_size, max_new_tokens, temperature, top_k, top_p)
    return ids
