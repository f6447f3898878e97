"""Speculative sampling: the tokens follow the target's distribution exactly."""

from __future__ import annotations

import itertools

import pytest
import torch

from minigpt import GPT, GPTConfig, generate
from minigpt.decoding import next_token_distribution
from minigpt.speculative import speculative_generate, verify

pytestmark = pytest.mark.usefixtures("one_thread")

V = 4
# Runs of the sampler each statistical test below draws: as few as still catch a sampler
# broken in any of the ways one could break it (a residual drawn from p, or from |p - q|; the
# ratio inverted or square-rooted; the bonus token drawn from the draft or from the last
# proposal's p; a later rejection drawing from p): each fails one of these tests by a wide
# margin. The five-token joint needs more draws, for enough cells expected 5 times or more.
DRAWS = 1000
FIVE_TOKEN_DRAWS = 1500


def tiny(seed: int, **overrides: object) -> GPT:
    torch.manual_seed(seed)
    values: dict[str, object] = dict(vocab_size=V, context_length=12, d_model=16, n_heads=2,
                                     n_layers=2)
    model = GPT(GPTConfig(**(values | overrides)))
    with torch.no_grad():  # larger weights than GPT-2's init: distributions far from uniform
        for p in model.parameters():
            p.mul_(2.0)
    return model.eval()


@pytest.fixture(scope="module")
def models() -> tuple[GPT, GPT]:
    return tiny(0), tiny(1, n_layers=1, d_model=8)  # the draft: one narrow layer


def exact_pairs(target: GPT, prompt: list[int], **shape: object) -> torch.Tensor:
    """P(x1, x2 | prompt) of the target, (V, V), from its reshaped next-token distributions."""
    with torch.no_grad():
        p1 = next_token_distribution(target(torch.tensor([prompt]))[0, -1], **shape)  # type: ignore[arg-type]
        rows = [next_token_distribution(target(torch.tensor([[*prompt, a]]))[0, -1],
                                        **shape) for a in range(V)]  # type: ignore[arg-type]
    return p1[:, None] * torch.stack(rows)


# Upper 0.001 quantiles of the chi-square distribution with 1..15 degrees of freedom. A
# correct sampler fails the test for one seed in a thousand; with the fixed seeds below the
# outcome is deterministic.
CHI2_999 = [10.83, 13.82, 16.27, 18.47, 20.52, 22.46, 24.32, 26.12, 27.88, 29.59, 31.26,
            32.91, 34.53, 36.12, 37.70]


@pytest.mark.slow
@pytest.mark.parametrize("k, shape", [
    (3, {}),  # two new tokens: every round here proposes one (see the tests below)
    (1, {"temperature": 0.7}),
    (4, {"temperature": 1.3, "top_k": 3}),
    (2, {"top_p": 0.8}),
])
def test_first_two_tokens_follow_the_target(models: tuple[GPT, GPT], k: int,
                                            shape: dict[str, object]) -> None:
    target, draft = models
    prompt = [1, 2, 0]
    exact = exact_pairs(target, prompt, **shape)
    gen = torch.Generator().manual_seed(1234)
    n = DRAWS
    counts = torch.zeros(V, V)
    accepted = proposed = 0
    for _ in range(n):
        out = speculative_generate(target, draft, prompt, 2, k=k, generator=gen, **shape)  # type: ignore[arg-type]
        a, b = out.ids[-2:].tolist()
        counts[a, b] += 1
        accepted, proposed = accepted + out.accepted, proposed + out.proposed
    expected = (exact * n).flatten()
    counts = counts.flatten()
    assert counts[expected == 0].sum() == 0  # nothing outside the (filtered) support
    # Cells expected fewer than 5 times are pooled into one, as the chi-square test needs.
    small = (expected > 0) & (expected < 5)
    observed = torch.cat([counts[expected >= 5], counts[small].sum().view(1)])
    wanted = torch.cat([expected[expected >= 5], expected[small].sum().view(1)])
    observed, wanted = observed[wanted > 0], wanted[wanted > 0]
    chi2 = float(((observed - wanted) ** 2 / wanted).sum())
    dof = len(wanted) - 1
    assert 3 <= dof <= 15 and chi2 < CHI2_999[dof - 1], (chi2, dof)
    assert 0 < accepted < proposed  # both branches, acceptance and residual, were taken


def exact_joint(target: GPT, prompt: list[int], n: int, **shape: object) -> torch.Tensor:
    """P(x_1..x_n | prompt) of the target for all V^n continuations, (V,) * n.

    One batched pass over every continuation gives each one's n conditionals, reshaped as
    the sampler reshapes them; their product is the continuation's exact probability.
    """
    seqs = torch.tensor(list(itertools.product(range(V), repeat=n)))  # (V^n, n)
    ids = torch.cat([torch.tensor(prompt).expand(len(seqs), -1), seqs], dim=1)
    with torch.no_grad():
        logits = target(ids[:, :-1])[:, len(prompt) - 1:]  # (V^n, n, V)
        dists = next_token_distribution(logits.double(), **shape)  # type: ignore[arg-type]
    probs = dists.gather(2, seqs[:, :, None]).squeeze(-1).prod(dim=1)
    return probs.view((V,) * n)


def chi2_limit(dof: int) -> float:
    """The upper 0.001 quantile of chi-square with ``dof`` degrees of freedom.

    Wilson and Hilferty's cube-root approximation (z = 3.0902 is the normal's 0.999
    quantile); it is within 2 % of the exact quantile from 5 degrees of freedom on.
    """
    a = 2 / (9 * dof)
    return dof * (1 - a + 3.0902 * a ** 0.5) ** 3


def chi2_statistic(counts: torch.Tensor, expected: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic over the cells, cells expected fewer than 5 times pooled."""
    counts, expected = counts.flatten().double(), expected.flatten().double()
    assert counts[expected == 0].sum() == 0  # nothing outside the (filtered) support
    small = (expected > 0) & (expected < 5)
    observed = torch.cat([counts[expected >= 5], counts[small].sum().view(1)])
    wanted = torch.cat([expected[expected >= 5], expected[small].sum().view(1)])
    observed, wanted = observed[wanted > 0], wanted[wanted > 0]
    return float(((observed - wanted) ** 2 / wanted).sum()), len(wanted) - 1


def test_chi2_limit_matches_the_table() -> None:
    for dof, exact in enumerate(CHI2_999, start=1):
        if dof >= 5:
            assert abs(chi2_limit(dof) - exact) < 0.02 * exact


@pytest.mark.slow
@pytest.mark.parametrize("shape", [{}, {"temperature": 1.3, "top_k": 3}])
def test_a_round_of_two_proposals_follows_the_target(models: tuple[GPT, GPT],
                                                     shape: dict[str, object]) -> None:
    """Three new tokens with k = 2: the first round proposes two tokens.

    Each run ends one of three ways, told apart by its counts: both proposals accepted and
    the bonus token drawn (proposed 2, accepted 2); the first accepted and the second
    rejected, then one token from the target (proposed 2, accepted 1); the first rejected,
    then a round of one proposal (proposed 3). The joint distribution of the three tokens
    must be the target's in every case, so all three must occur and the joint must match.
    """
    target, draft = models
    prompt = [1, 2, 0]
    exact = exact_joint(target, prompt, 3, **shape)
    gen = torch.Generator().manual_seed(2024)
    n = DRAWS
    counts = torch.zeros(V, V, V)
    endings = {"all accepted, bonus": 0, "second rejected": 0, "first rejected": 0}
    for _ in range(n):
        out = speculative_generate(target, draft, prompt, 3, k=2, generator=gen, **shape)  # type: ignore[arg-type]
        counts[tuple(out.ids[-3:].tolist())] += 1
        if out.proposed == 3:
            endings["first rejected"] += 1
        else:
            assert out.proposed == 2 and out.accepted in (1, 2)
            endings["all accepted, bonus" if out.accepted == 2 else "second rejected"] += 1
    assert all(count > 50 for count in endings.values()), endings
    chi2, dof = chi2_statistic(counts, exact * n)
    assert dof >= 10 and chi2 < chi2_limit(dof), (chi2, dof)


@pytest.mark.slow
@pytest.mark.parametrize("shape", [{}, {"top_p": 0.9}])
def test_rounds_of_three_proposals_follow_the_target(models: tuple[GPT, GPT],
                                                     shape: dict[str, object]) -> None:
    """Five new tokens with k = 3: the joint of all five, and each position's marginal."""
    target, draft = models
    prompt = [3, 1]
    exact = exact_joint(target, prompt, 5, **shape)
    gen = torch.Generator().manual_seed(77)
    n = FIVE_TOKEN_DRAWS
    counts = torch.zeros((V,) * 5)
    proposed = accepted = rejected = 0
    for _ in range(n):
        out = speculative_generate(target, draft, prompt, 5, k=3, generator=gen, **shape)  # type: ignore[arg-type]
        counts[tuple(out.ids[-5:].tolist())] += 1
        proposed, accepted = proposed + out.proposed, accepted + out.accepted
        rejected += out.rejected
        assert out.proposed >= 3  # the first round always proposes three
    assert 0 < rejected and 0 < accepted < proposed
    chi2, dof = chi2_statistic(counts, exact * n)
    assert dof >= 40 and chi2 < chi2_limit(dof), ("joint", chi2, dof)
    for position in range(5):
        others = tuple(d for d in range(5) if d != position)
        chi2, dof = chi2_statistic(counts.sum(others), exact.sum(others) * n)
        assert chi2 < CHI2_999[dof - 1], (position, chi2, dof)


def test_acceptance_rate_counts_checked_proposals(models: tuple[GPT, GPT]) -> None:
    target, draft = models
    out = speculative_generate(target, draft, [1, 2], 10, k=4,
                               generator=torch.Generator().manual_seed(3))
    assert out.rejected > 0 and out.accepted + out.rejected <= out.proposed
    assert out.acceptance_rate == out.accepted / (out.accepted + out.rejected)
    rounds = out.target_passes
    assert out.ids.shape[0] - 2 == out.accepted + rounds  # each round: accepted + 1


def test_a_draft_that_is_the_target_is_always_accepted() -> None:
    target = tiny(0)
    out = speculative_generate(target, target, [1], 9, k=4,
                               generator=torch.Generator().manual_seed(0))
    # Rounds of 4 and 3 proposals (9 tokens needed), each accepted with a bonus token.
    assert out.accepted == out.proposed == 7 and out.rejected == 0
    assert out.target_passes == 2 and out.tokens_per_pass == 4.5
    assert out.acceptance_rate == 1.0


@pytest.mark.parametrize("k", [1, 2, 5])
@pytest.mark.parametrize("prompt, n", [([3], 8), ([0, 1, 2, 3, 0], 6), ([2, 1], 20)])
def test_greedy_is_the_targets_greedy(models: tuple[GPT, GPT], k: int, prompt: list[int],
                                      n: int) -> None:
    target, draft = models
    out = speculative_generate(target, draft, prompt, n, k=k, greedy=True)
    assert torch.equal(out.ids, generate(target, prompt, n, greedy=True))  # 20 > T: slides


def test_cache_and_no_cache_give_the_same_tokens(models: tuple[GPT, GPT]) -> None:
    target, draft = models
    runs = [speculative_generate(target, draft, [1, 2], 16, k=3, use_cache=c, top_k=3,
                                 generator=torch.Generator().manual_seed(5))
            for c in (True, False)]
    assert torch.equal(runs[0].ids, runs[1].ids)
    assert runs[0].accepted == runs[1].accepted


def test_verify_accepts_with_probability_min_1_p_over_q() -> None:
    p, q = torch.tensor([0.5, 0.3, 0.2, 0.0]), torch.tensor([0.25, 0.25, 0.25, 0.25])
    gen = torch.Generator().manual_seed(0)
    results = [verify(p, q, 2, gen) for _ in range(20000)]
    rate = sum(ok for ok, _ in results) / len(results)
    assert abs(rate - 0.8) < 0.015  # p/q = 0.2/0.25; 5 standard errors
    rejected = [t for ok, t in results if not ok]
    # The residual max(0, p - q) = (0.25, 0.05, 0, 0), normalised: 5/6 and 1/6.
    assert set(rejected) <= {0, 1}
    assert abs(rejected.count(0) / len(rejected) - 5 / 6) < 0.03


def test_verify_when_p_and_q_differ_only_by_rounding() -> None:
    """A rejection that only rounding made possible finds an empty residual (every p - q
    <= 0): the token is drawn from p, never from 0 / 0."""
    p = torch.softmax(torch.tensor([2.0, 1.0, 0.5, -1.0]), dim=-1)
    q = p.clone()
    q[3] = torch.nextafter(p[3], torch.tensor(1.0))  # one ulp more likely under the draft
    p[3] = 0.0  # and, rounded, impossible under the target: this proposal is rejected
    gen = torch.Generator().manual_seed(0)
    results = [verify(p, q, 3, gen) for _ in range(2000)]
    assert all(not ok for ok, _ in results)
    drawn = torch.bincount(torch.tensor([t for _, t in results]), minlength=4).double() / 2000
    assert drawn[3] == 0 and torch.allclose(drawn[:3], p[:3].double(), atol=0.05)


def test_nothing_is_mutated(models: tuple[GPT, GPT]) -> None:
    target, draft = models
    target.train()
    prompt = torch.tensor([1, 2])
    before = [p.clone() for p in itertools.chain(target.parameters(), draft.parameters())]
    speculative_generate(target, draft, prompt, 5, generator=torch.Generator().manual_seed(0))
    assert target.training and not draft.training
    assert prompt.tolist() == [1, 2]
    after = list(itertools.chain(target.parameters(), draft.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    target.eval()


@pytest.mark.parametrize("kwargs, error, message", [
    ({"draft": tiny(2, vocab_size=5)}, ValueError, "the draft's vocabulary .5 tokens. differs"),
    ({"k": 0}, ValueError, r"k \(proposals per round\) must be >= 1, got 0"),
    ({"temperature": -1.0}, ValueError, "temperature must be >= 0"),
    ({"top_k": 9}, ValueError, r"top_k must lie in \[1, V\] = \[1, 4\]"),
    ({"top_p": 0.0}, ValueError, r"top_p must lie in \(0, 1\]"),
    ({"prompt_ids": [[1, 2], [2, 3]]}, ValueError, "takes one prompt of shape"),
    ({"prompt_ids": [7]}, ValueError, r"token id 7 in prompt_ids is out of range \[0, 4\)"),
    ({"max_new_tokens": -1}, ValueError, "max_new_tokens must be >= 0"),
])
def test_errors(models: tuple[GPT, GPT], kwargs: dict[str, object], error: type[Exception],
                message: str) -> None:
    target, draft = models
    call: dict[str, object] = dict(target=target, draft=draft, prompt_ids=[1], max_new_tokens=3)
    with pytest.raises(error, match=message):
        speculative_generate(**(call | kwargs))  # type: ignore[arg-type]
