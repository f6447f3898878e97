"""Sampling text from a GPT, one token at a time, and beam search.

Each step crops the sequence to the model's context, reads the logits of the
last position (B, V), reshapes that distribution (temperature, top-k, top-p)
and draws the next token, which is appended. The three filters are public
functions of their own so that the sampling chapter can show and plot each
one; none of them modifies its input. The prompt and the settings are checked
once, where they enter (`generate`, `beam_search`); the filters, which run at
every token, take them as given. `generate_by_length` continues prompts of
several lengths, one batch a length.

Both `generate` and `beam_search` keep a key-value cache by default: the
model reads the prompt once and then only the one new token per step,
instead of the whole sequence again. While the sequence fits the context the
tokens are the same with and without the cache (up to float rounding in the
logits). Once it is longer than ``context_length`` the window slides, every
kept token moves to a new position, and the cache is rebuilt from the cropped
window at each step, exactly as the uncached loop does it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from minigpt.attention import KVCache
from minigpt.config import check_int
from minigpt.model import GPT, eval_mode

_INTEGER_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def apply_temperature(logits: Tensor, temperature: float) -> Tensor:
    """Divide the logits by the temperature tau > 0: softmax(z / tau).

    tau = 1 leaves the distribution as it is, tau < 1 sharpens it (tau -> 0
    tends to greedy), tau > 1 flattens it (tau -> infinity tends to uniform).
    tau = 0 itself has no distribution: `generate` treats it as greedy.

    Args:
        logits: (..., V).
        temperature: tau > 0.

    Returns:
        A new tensor (..., V).
    """
    return logits / temperature


def top_k_filter(logits: Tensor, k: int) -> Tensor:
    """Keep the k largest logits of each row and set the others to -inf.

    Ties with the k-th largest value are all kept, so a row may keep more than
    k tokens when several share that value.

    Args:
        logits: (..., V).
        k: how many tokens to keep, 1 <= k <= V.

    Returns:
        A new tensor (..., V), -inf outside the top k.
    """
    kth_largest = torch.topk(logits, k, dim=-1).values[..., -1:]  # (..., 1)
    return logits.masked_fill(logits < kth_largest, float("-inf"))


def top_p_filter(logits: Tensor, p: float) -> Tensor:
    """Nucleus filter: keep the smallest set of most likely tokens whose
    mass reaches p.

    Tokens are sorted by probability; a token is kept if the mass of the
    tokens before it is still below p. The most likely token is therefore
    always kept, and p = 1 keeps every token.

    Args:
        logits: (..., V).
        p: the probability mass to keep, 0 < p <= 1.

    Returns:
        A new tensor (..., V), -inf outside the nucleus.
    """
    if p == 1.0:
        # Rounding in the cumulative sum could drop the least likely tokens.
        return logits.clone()
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    # the mass of the strictly more likely tokens
    mass_before = torch.cumsum(probs, dim=-1) - probs
    drop_sorted = mass_before >= p
    # back to vocabulary order
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def next_token_distribution(logits: Tensor, *, temperature: float = 1.0,
                            top_k: int | None = None, top_p: float | None = None,
                            greedy: bool = False) -> Tensor:
    """The distribution a sampler draws from: logits (..., V) -> probabilities (..., V).

    Greedy decoding (or temperature 0) is the one-hot distribution of the argmax.
    """
    if greedy or temperature == 0.0:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).to(logits.dtype)
    logits = apply_temperature(logits, temperature)
    if top_k is not None:
        logits = top_k_filter(logits, top_k)
    if top_p is not None:
        logits = top_p_filter(logits, top_p)
    return torch.softmax(logits, dim=-1)


def inverse_cdf(probs: Tensor, u: float) -> int:
    """The token a uniform draw ``u`` in [0, 1) picks from ``probs`` (V,) by inverting its
    cumulative distribution: the first token whose cumulative probability exceeds ``u``.

    If rounding leaves the total at or below ``u``, the last token of non-zero probability.
    (`generate` draws with `torch.multinomial`; the site's playground draws this way from
    its own seeded generator.)
    """
    assert probs.dim() == 1, f"probs must have shape (V,), got {tuple(probs.shape)}"
    if not 0.0 <= u < 1.0:  # NaN fails too
        raise ValueError(f"u must lie in [0, 1), got {u}")
    cumulative = torch.cumsum(probs.to("cpu", torch.float64), dim=0)  # MPS: no float64
    above = torch.nonzero(cumulative > u)
    if len(above) > 0:
        return int(above[0])
    return int(torch.nonzero(probs > 0)[-1])


def _check_sampling(vocab_size: int, max_new_tokens: int, temperature: float,
                    top_k: int | None, top_p: float | None) -> None:
    """Check the length and the sampling settings once, where they enter (`generate`,
    `minigpt.speculative.speculative_generate`); the filters take them as given."""
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if not temperature >= 0.0:  # NaN fails too
        raise ValueError(f"temperature must be >= 0 (0 means greedy), got {temperature}")
    if top_k is not None and not 1 <= top_k <= vocab_size:
        raise ValueError(f"top_k must lie in [1, V] = [1, {vocab_size}], got {top_k}")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must lie in (0, 1], got {top_p}")


def _next_logits(model: nn.Module, seq: Tensor, context_length: int,
                 cache: KVCache | None) -> Tensor:
    """Logits (B, V) of the token after ``seq`` (B, T), reading at most ``context_length``."""
    if cache is None:
        window = seq[:, -context_length:]  # the whole cropped window
        # A GPT can skip the head for every position but the last.
        logits: Tensor = model(window, last_only=True) if isinstance(model, GPT) else model(window)
    else:
        if seq.shape[1] > context_length:
            # The window slid: every kept token moved to a new position, so nothing
            # stored can be reused; read the cropped window afresh.
            cache.reset()
        new = seq[:, cache.length:][:, -context_length:]  # the tokens the cache lacks
        logits = model(new, cache=cache, last_only=True)
    return logits[:, -1, :].float()


def _prompt_tensor(prompt_ids: Tensor | Sequence[int] | Sequence[Sequence[int]],
                   vocab_size: int) -> Tensor:
    """The prompt as a tensor (T,) or (B, T), checked where it enters: once per call, so
    reading its ids on the host costs nothing per token."""
    ids = prompt_ids if isinstance(prompt_ids, Tensor) else torch.tensor(prompt_ids)
    if ids.numel() == 0:
        raise ValueError(f"prompt_ids is empty (shape {tuple(ids.shape)}): give at least one token")
    if ids.dtype not in _INTEGER_DTYPES:  # floats would be truncated to ids, bools are not ids
        raise TypeError(f"prompt_ids must hold integer token ids, got dtype {ids.dtype}")
    if ids.dim() not in (1, 2):
        raise ValueError(f"prompt_ids must have shape (T,) or (B, T), got {tuple(ids.shape)}")
    low, high = torch.aminmax(ids)
    if low < 0 or high >= vocab_size:
        bad = int(low) if low < 0 else int(high)
        raise ValueError(f"token id {bad} in prompt_ids is out of range [0, {vocab_size})")
    return ids


@torch.no_grad()
def generate(
    model: nn.Module,
    prompt_ids: Tensor | Sequence[int] | Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    greedy: bool = False,
    generator: torch.Generator | None = None,
    use_cache: bool = True,
    repeats: int = 1,
    stop_id: int | None = None,
) -> Tensor:
    """Extend each prompt by ``max_new_tokens`` tokens drawn from the model.

    Args:
        model: a GPT (anything with ``.config.context_length``,
            ``.config.vocab_size`` and ``model(ids (B, T)) -> logits (B, T, V)``;
            with ``use_cache`` also ``new_cache()`` and ``model(ids, cache=,
            last_only=)`` as `minigpt.GPT` has them).
        prompt_ids: (T,) or (B, T) integer ids, or a list of ints (of lists).
        max_new_tokens: N >= 0, how many tokens to append.
        temperature: tau >= 0; 0 means greedy (exactly the argmax).
        top_k: keep only the k most likely tokens, 1 <= k <= V (None: all).
        top_p: keep the smallest nucleus of mass >= p, 0 < p <= 1 (None: all).
        greedy: always take the most likely token (ignores the three above).
        generator: the torch.Generator that ``torch.multinomial`` draws from,
            for reproducible samples.
        use_cache: keep a key-value cache (``model.new_cache()``), so that
            each step reads one new token instead of the whole context.
        repeats: r >= 1 rows continue each prompt, prompt b in rows b r to
            b r + r - 1. Each prompt is read once and its logits (and stored
            keys and values) copied to its rows: with the package's products,
            whose rows do not depend on each other, the bits of reading it r
            times, in a fraction of the time.
        stop_id: a token (0 <= id < V) that ends a row: after it, the row
            holds ``stop_id`` alone, and once every row has ended the model is
            not run again. The draws the remaining steps would have taken are
            taken all the same, so ``generator`` ends where it would have.

    Returns:
        A new tensor, (T + N,) for a prompt of shape (T,) with r = 1, else
        (B r, T + N), on the model's device. The prompt is not modified; the
        model is put in eval mode for the call and given back in the mode it
        was in.
    """
    config: Any = model.config
    ids = _prompt_tensor(prompt_ids, config.vocab_size)
    _check_sampling(config.vocab_size, max_new_tokens, temperature, top_k, top_p)
    check_int("repeats", repeats, 1)
    if stop_id is not None:
        check_int("stop_id", stop_id, 0, config.vocab_size - 1)
    squeeze = ids.dim() == 1 and repeats == 1
    device = next(model.parameters()).device
    # A copy (copy=True) on the model's device: the caller's tensor is never written to.
    prompts = ids.to(device=device, dtype=torch.long, copy=True).view(-1, ids.shape[-1])
    seq = prompts.repeat_interleave(repeats, dim=0)  # (B r, T)
    draw = not (greedy or temperature == 0.0)
    ended = torch.zeros(len(seq), dtype=torch.bool, device=device)
    cache: KVCache | None = model.new_cache() if use_cache else None  # type: ignore[operator]
    with eval_mode(model):
        for step in range(max_new_tokens):
            if step == 0 and repeats > 1:  # each prompt read once, for all of its rows
                logits = _next_logits(model, prompts, config.context_length, cache)
                logits = logits.repeat_interleave(repeats, dim=0)
                if cache is not None:
                    cache.reorder(torch.arange(len(seq), device=device) // repeats)
            else:
                logits = _next_logits(model, seq, config.context_length, cache)  # (B, V)
            probs = next_token_distribution(logits, temperature=temperature, top_k=top_k,
                                            top_p=top_p, greedy=greedy)
            if draw:
                next_id = torch.multinomial(probs, num_samples=1, generator=generator)
            else:  # one-hot: no need to draw
                next_id = probs.argmax(dim=-1, keepdim=True)  # (B, 1)
            if stop_id is not None:  # a row that has ended stays ended
                next_id = next_id.masked_fill(ended.unsqueeze(1), stop_id)
                ended |= next_id[:, 0] == stop_id
            seq = torch.cat([seq, next_id], dim=1)
            if stop_id is not None and bool(ended.all()):
                break
        left = ids.shape[-1] + max_new_tokens - seq.shape[1]
        if left:  # every row ended early: the skipped steps' draws, and their stop tokens
            assert stop_id is not None
            for _ in range(left if draw else 0):
                torch.multinomial(probs, num_samples=1, generator=generator)
            seq = torch.cat([seq, seq.new_full((len(seq), left), stop_id)], dim=1)
    return seq[0] if squeeze else seq


def generate_by_length(model: GPT, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
                       repeats: int = 1, **sampling: Any) -> list[tuple[list[int], Tensor]]:
    """Continue prompts of several lengths, those of one length together in one batch.

    Each prompt is extended ``repeats`` times by `generate` (``sampling`` goes to it, and
    the prompt is read once for all its rows) with ``max_new_tokens`` tokens, or as many as
    the context leaves: min(N, T - n) for a prompt of n tokens. Returns one pair a length,
    in the order the lengths first appear (so a seeded generator draws the same tokens on
    every call): the indices of the prompts of that length, in order, and their rows
    (repeats k, n + new) on the model's device, row i continuing prompt indices[i // repeats].

    Args:
        prompts: lists of ids, each of 1 to T - 1 tokens (T the model's context).
        max_new_tokens: N >= 0. repeats: rows a prompt, >= 1.
    """
    T = model.config.context_length
    by_length: dict[int, list[int]] = {}
    for k, p in enumerate(prompts):
        if not 0 < len(p) < T:
            raise ValueError(f"prompt {k} has {len(p)} tokens; a prompt needs 1 to {T - 1}, "
                             f"leaving room for an answer in the context of {T}")
        by_length.setdefault(len(p), []).append(k)
    return [(ks, generate(model, [list(prompts[k]) for k in ks], min(max_new_tokens, T - n),
                          repeats=repeats, **sampling))
            for n, ks in by_length.items()]


class BeamSearchResult(NamedTuple):
    """The hypotheses `beam_search` ends with, best first.

    Attributes:
        sequences: (K, T + N) ids, the prompt followed by the new tokens; a
            hypothesis that produced ``eos_id`` early is padded with it.
        scores: (K,) the ranking score, ``log_probs / lengths ** length_penalty``.
        log_probs: (K,) log-probability of the new tokens given the prompt,
            up to and including the first ``eos_id``.
        lengths: (K,) how many new tokens that log-probability covers.
    """

    sequences: Tensor
    scores: Tensor
    log_probs: Tensor
    lengths: Tensor


@torch.no_grad()
def beam_search(model: nn.Module, prompt_ids: Tensor | Sequence[int], max_new_tokens: int, *,
                num_beams: int, length_penalty: float = 0.0, eos_id: int | None = None,
                use_cache: bool = True) -> BeamSearchResult:
    """Search for a likely continuation by keeping the ``num_beams`` best prefixes.

    Each step extends every kept prefix (a beam) by every token of the
    vocabulary, scores each of the K x V candidates by its total
    log-probability log p(y_1..y_t | prompt), and keeps the K best. With
    K = 1 this is greedy decoding; with K >= V^(N-1) nothing is ever pruned
    before the last step and the result is the most likely continuation of
    all V^N. A beam that emits ``eos_id`` is finished: it keeps its
    log-probability and competes with the others unchanged. At the end the
    beams are ranked by ``log_probs / lengths ** length_penalty`` (0: by total
    log-probability, which favours short hypotheses when ``eos_id`` is given;
    1: by mean log-probability per token).

    Args:
        model: a GPT.
        prompt_ids: one prompt, (T,) ids or a list of ints.
        max_new_tokens, num_beams: N >= 0 new tokens, K >= 1 beams.
        length_penalty: alpha.
        eos_id: a token id that ends a hypothesis, or None.
        use_cache: keep one key-value cache for all beams, reordered as chosen.

    Returns a `BeamSearchResult`: min(K, distinct hypotheses) rows, best first.
    """
    config, ids = _check_beam_args(model, prompt_ids, max_new_tokens, num_beams, eos_id)
    device = next(model.parameters()).device
    seq = ids.to(device=device, dtype=torch.long, copy=True).unsqueeze(0)  # (1, T): one beam
    log_probs = torch.zeros(1, device=device)  # (K,), and (K,) lengths and finished flags:
    lengths, done = torch.zeros(1, dtype=torch.long, device=device), log_probs.bool()
    cache: KVCache | None = model.new_cache() if use_cache else None  # type: ignore[operator]
    with eval_mode(model):
        for _ in range(max_new_tokens):
            # The one read of the device a step, and none without eos_id: how many beams
            # are finished decides whether to go on and how many candidates there are.
            finished = int(done.sum()) if eos_id is not None else 0
            if finished == len(seq):
                break
            step = torch.log_softmax(_next_logits(model, seq, config.context_length, cache), -1)
            if finished:
                # A finished beam can only repeat eos, at no cost: its score stays as it is.
                step[done] = float("-inf")
                step[done, eos_id] = 0.0
            candidates = (log_probs[:, None] + step).flatten()  # (K * V,)
            # V candidates of each unfinished beam, one (eos) of each finished one
            width = min(num_beams, (len(seq) - finished) * config.vocab_size + finished)
            best = torch.topk(candidates, width)  # sorted, best first
            beam = best.indices // config.vocab_size  # (K,): which prefix each extends
            token = best.indices % config.vocab_size  # (K,): by which token
            seq = torch.cat([seq[beam], token[:, None]], dim=1)
            lengths = lengths[beam] + (~done[beam]).long()
            done = done[beam] | (token == eos_id) if eos_id is not None else done[beam]
            log_probs = best.values
            if cache is not None:
                cache.reorder(beam)
    missing = ids.shape[0] + max_new_tokens - seq.shape[1]
    if missing > 0:  # every beam finished early: pad with eos
        seq = torch.cat([seq, seq.new_full((seq.shape[0], missing), int(eos_id or 0))], dim=1)
    scores = log_probs / lengths.clamp(min=1).float() ** length_penalty
    order = torch.argsort(scores, descending=True, stable=True)
    return BeamSearchResult(seq[order], scores[order], log_probs[order], lengths[order])


def _check_beam_args(model: nn.Module, prompt_ids: Tensor | Sequence[int],
                     max_new_tokens: int, num_beams: int, eos_id: int | None,
                     ) -> tuple[Any, Tensor]:
    """Check beam_search's arguments where they enter; returns (config, ids)."""
    config: Any = model.config
    ids = _prompt_tensor(prompt_ids, config.vocab_size)
    if ids.dim() != 1:
        raise ValueError(f"beam_search takes one prompt of shape (T,), got {tuple(ids.shape)}; "
                         "search each prompt of a batch on its own")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if num_beams < 1:
        raise ValueError(f"num_beams must be >= 1, got {num_beams}")
    if eos_id is not None and not 0 <= eos_id < config.vocab_size:
        raise ValueError(f"eos_id must lie in [0, {config.vocab_size}), got {eos_id}")
    return config, ids
