"""Learning from rewards: pass@k against enumeration, advantages and the GRPO loss on hand
values (clipping included), the policy-gradient theorem and the KL estimators on
enumerable distributions, rollouts, rewards, one step, and one step on two ranks against
one process on their prompts together."""

from __future__ import annotations

import ast
import copy
import dataclasses
import itertools
import math
import textwrap
from collections.abc import Sequence
from fractions import Fraction
from unittest import mock

import pytest
import torch
from test_dpo import chat_model
from test_dpo import tasks as all_tasks

from minigpt import GPT
from minigpt.data import Batch
from minigpt.losses import token_logprobs
from minigpt.optim import configure_optimizer
from minigpt.posttrain.chat import greedy_replies, prompt_ids
from minigpt.posttrain.rl import (
    EVAL_CHUNK,
    GRPOSettings,
    RolloutBatch,
    answer_entropy,
    evaluate_sampled,
    group_advantages,
    grpo_batch,
    grpo_loss,
    grpo_step,
    kl_estimate,
    pass_at_k,
    rft_step,
    rollout_loss,
    rollouts,
    sampled_positions,
    score,
    zero_signal_groups,
)
from minigpt.posttrain.tasks import Task, exact_match
from minigpt.tokenizer import END_OF_TURN, CharTokenizer
from minigpt.train import train_step

pytestmark = pytest.mark.usefixtures("one_thread")


# ----- pass@k ----------------------------------------------------------------------------

def test_pass_at_k_is_the_fraction_of_k_subsets_holding_a_right_answer() -> None:
    for n in range(1, 8):
        for c in range(n + 1):
            for k in range(1, n + 1):
                subsets = list(itertools.combinations(range(n), k))  # samples 0..c-1 right
                hit = Fraction(sum(min(s) < c for s in subsets), len(subsets))
                assert pass_at_k(n, c, k) == pytest.approx(float(hit), abs=1e-12), (n, c, k)


def test_pass_at_k_edge_cases_are_exact_and_large_n_is_stable() -> None:
    assert pass_at_k(10, 0, 3) == 0.0 and pass_at_k(1000, 0, 1000) == 0.0
    assert pass_at_k(10, 8, 3) == 1.0 and pass_at_k(5, 5, 1) == 1.0  # n - c < k
    assert pass_at_k(10, 7, 3) < 1.0  # n - c = k: one subset of k misses
    assert pass_at_k(20, 7, 1) == pytest.approx(7 / 20, rel=1e-15)
    # C(10^6, 1000) has thousands of digits; the product needs none of them.
    n, c, k = 10**6, 10, 1000
    exact = 1 - Fraction(math.comb(n - c, k), math.comb(n, k))
    assert pass_at_k(n, c, k) == pytest.approx(float(exact), rel=1e-12)


@pytest.mark.parametrize("args, needle", [
    ((3, 1, 4), r"k must lie in \[1, 3\], got k = 4"),
    ((3, 1, 0), r"k must lie in \[1, 3\], got k = 0"),
    ((3, 4, 1), "c, the right answers, cannot exceed n = 3"),
    ((-1, 0, 1), "n must be an int >= 0, got -1"),
    ((3, -1, 1), "c must be an int >= 0, got -1"),
    ((3, 1, -2), "k must be an int >= 0, got -2"),
    ((3.0, 1, 1), "n must be an int >= 0, got 3.0"),
    ((3, True, 1), "c must be an int >= 0, got True"),
])
def test_bad_pass_at_k_arguments_are_refused(args: tuple[int, int, int], needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        pass_at_k(*args)


# ----- advantages ------------------------------------------------------------------------

REWARDS = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0],
                        [1.0, 0.0, 0.0, 0.0]])


def test_advantages_on_hand_values() -> None:
    none = group_advantages(REWARDS, scale="none")
    expected = torch.tensor([[0.5, -0.5, -0.5, 0.5], [0.0] * 4, [0.0] * 4,
                             [0.75, -0.25, -0.25, -0.25]])
    torch.testing.assert_close(none, expected, rtol=0, atol=1e-7)
    # Divided by the population std: 0.5 in group 0, sqrt(3)/4 in group 3, so that an
    # answer right with probability p among G gets sqrt((1 - p) / p), a wrong one -sqrt(p/(1-p)).
    std = group_advantages(REWARDS, scale="std", eps=0.0 + 1e-12)
    r3 = 1 / math.sqrt(3)
    expected = torch.tensor([[1.0, -1.0, -1.0, 1.0], [0.0] * 4, [0.0] * 4,
                             [math.sqrt(3), -r3, -r3, -r3]])
    torch.testing.assert_close(std, expected, rtol=0, atol=1e-6)
    assert zero_signal_groups(REWARDS).tolist() == [False, True, True, False]
    assert int(zero_signal_groups(REWARDS).sum()) == 2


def test_a_group_whose_rewards_are_all_equal_gets_exactly_zero() -> None:
    # 0.1 three times: its float mean is not exactly 0.1; its advantages are still 0.
    rewards = torch.tensor([[0.1, 0.1, 0.1], [0.3, 0.3, 0.3], [0.2, 0.7, 0.1]])
    for scale in ("std", "none"):
        a = group_advantages(rewards, scale=scale)  # type: ignore[arg-type]
        assert torch.equal(a[:2], torch.zeros(2, 3)) and not torch.isnan(a).any()
        assert a[2].abs().min() > 0
    ints = group_advantages(torch.tensor([[1, 0], [1, 1]]), scale="none")
    assert ints.tolist() == [[0.5, -0.5], [0.0, 0.0]]


def test_without_a_baseline_the_advantage_is_the_reward() -> None:
    # REINFORCE without a baseline: every right answer pushes up, an all-right group too.
    plain = group_advantages(REWARDS, scale="none", baseline="none")
    torch.testing.assert_close(plain, REWARDS, rtol=0, atol=0)
    assert plain.data_ptr() != REWARDS.data_ptr()  # a new tensor, the rewards untouched
    with pytest.raises(ValueError, match="no group spread to divide by, so scale must be"):
        group_advantages(REWARDS, scale="std", baseline="none")


def test_advantages_refuse_rewards_not_in_groups() -> None:
    with pytest.raises(ValueError, match=r"rewards \(P, G\): P prompts x G answers, got \(4,\)"):
        group_advantages(torch.zeros(4))


# ----- the loss --------------------------------------------------------------------------

MASK = torch.tensor([[True, True, False], [True, False, False]])


def _logp(values: list[list[float]]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64, requires_grad=True)


def test_on_policy_the_ratio_is_one_and_the_gradient_the_policy_gradient() -> None:
    logp = _logp([[-1.0, -2.0, 0.0], [-0.5, 0.0, 0.0]])
    adv = torch.tensor([2.0, -1.0], dtype=torch.float64)
    # "sequence": each answer's mean over its tokens of ratio * A = A; minus their mean.
    loss = grpo_loss(logp, logp.detach(), adv, MASK)
    assert loss.item() == pytest.approx(-(2.0 - 1.0) / 2)
    (grad,) = torch.autograd.grad(loss, logp)
    # -(1/N) A_i / |o_i| on answer tokens: the score function weighted by the advantage
    expected = torch.tensor([[-0.5, -0.5, 0.0], [0.5, 0.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(grad, expected, rtol=0, atol=1e-15)
    # "constant": the sum over tokens over max_tokens = 4
    loss = grpo_loss(logp, logp.detach(), adv, MASK, length_norm="constant", max_tokens=4)
    assert loss.item() == pytest.approx(-(2.0 * 2 / 4 - 1.0 / 4) / 2)
    (grad,) = torch.autograd.grad(loss, logp)
    expected = torch.tensor([[-0.25, -0.25, 0.0], [0.125, 0.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(grad, expected, rtol=0, atol=1e-15)


def test_zero_advantages_give_zero_loss_and_zero_gradient() -> None:
    logp = _logp([[-1.0, -2.0, 0.0], [-0.5, 0.0, 0.0]])
    old = logp.detach() + torch.tensor([[0.3, -0.1, 0.0], [0.05, 0.0, 0.0]])  # off-policy
    adv = group_advantages(torch.tensor([[1.0, 1.0]])).flatten()
    loss = grpo_loss(logp, old, adv, MASK)
    loss.backward()
    assert loss.item() == 0.0 and logp.grad is not None and torch.equal(
        logp.grad, torch.zeros_like(logp))


def test_the_clip_stops_the_gradient_only_past_the_trust_region_in_as_direction() -> None:
    # One token per answer; ratios 1.5, 1.5, 0.5, 0.5 with A = +1, -1, +1, -1, clip 0.2.
    ratio = torch.tensor([1.5, 1.5, 0.5, 0.5], dtype=torch.float64)
    logp = ratio.log().view(4, 1).requires_grad_()
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0], dtype=torch.float64)
    loss = grpo_loss(logp, torch.zeros(4, 1, dtype=torch.float64), adv,
                     torch.ones(4, 1, dtype=torch.bool), clip=0.2)
    # objectives: min(1.5, 1.2) = 1.2 (clipped), min(-1.5, -1.2) = -1.5, min(0.5, 0.8) = 0.5,
    # min(-0.5, -0.8) = -0.8 (clipped)
    assert loss.item() == pytest.approx(-(1.2 - 1.5 + 0.5 - 0.8) / 4)
    (grad,) = torch.autograd.grad(loss, logp)
    # d(ratio A)/d logp = ratio A where unclipped, 0 where clipped; the loss is minus the mean
    expected = -torch.tensor([0.0, -1.5, 0.5, 0.0], dtype=torch.float64).view(4, 1) / 4
    torch.testing.assert_close(grad, expected, rtol=0, atol=1e-15)


def test_the_kl_penalty_on_hand_values() -> None:
    logp = torch.tensor([[math.log(0.5)]], dtype=torch.float64)
    ref = torch.tensor([[math.log(0.25)]], dtype=torch.float64)
    zero, mask = torch.zeros(1, dtype=torch.float64), torch.ones(1, 1, dtype=torch.bool)
    k3 = grpo_loss(logp, logp, zero, mask, ref_logp=ref, kl_coef=0.1)
    assert k3.item() == pytest.approx(0.1 * (0.5 - 1 + math.log(2)))  # r - 1 - log r, r = 1/2
    assert grpo_loss(logp, logp, zero, mask, ref_logp=ref).item() == 0.0  # kl_coef 0


def test_the_loss_penalises_k3_whose_expected_gradient_is_that_of_the_reverse_kl() -> None:
    """The loss's penalty, averaged exactly over tokens drawn from pi (each token's loss
    weighted by pi, the samples held fixed), has the gradient of beta KL(pi_ref || pi):
    k3's (Tang and Munos, 2025). k1 in its place would have an expected gradient of 0,
    which is why the loss offers no k1."""
    gen = torch.Generator().manual_seed(0)
    theta = torch.randn(6, generator=gen, dtype=torch.float64, requires_grad=True)
    ref = torch.log_softmax(torch.randn(6, generator=gen, dtype=torch.float64), 0)
    logp = torch.log_softmax(theta, 0)
    pi = logp.exp().detach()
    mask = torch.ones(6, 1, dtype=torch.bool)
    zero = torch.zeros(6, dtype=torch.float64)
    per_token = [grpo_loss(logp[i:i + 1, None], logp[i:i + 1, None].detach(), zero[:1],
                           mask[:1], ref_logp=ref[i:i + 1, None], kl_coef=0.5)
                 for i in range(6)]
    expected_loss = sum(w * loss for w, loss in zip(pi, per_token, strict=True))
    (grad,) = torch.autograd.grad(expected_loss, theta, retain_graph=True)
    (reverse,) = torch.autograd.grad(0.5 * (ref.exp() * (ref - logp)).sum(), theta,
                                     retain_graph=True)
    torch.testing.assert_close(grad, reverse, rtol=0, atol=1e-12)
    (k1,) = torch.autograd.grad((pi * kl_estimate(logp, ref, "k1")).sum(), theta)
    assert k1.abs().max() < 1e-12




@pytest.mark.parametrize("length_norm", ["sequence", "constant"])
def test_the_loss_of_two_equal_shares_is_the_mean_of_their_losses(length_norm: str) -> None:
    # What DDP's gradient average relies on: ranks with equally many answers, of any lengths.
    g = torch.Generator().manual_seed(0)
    logp = (-torch.rand(8, 5, generator=g, dtype=torch.float64)).requires_grad_()
    old = logp.detach() + 0.3 * torch.randn(8, 5, generator=g, dtype=torch.float64)
    ref = logp.detach() + 0.3 * torch.randn(8, 5, generator=g, dtype=torch.float64)
    adv = torch.randn(8, generator=g, dtype=torch.float64)
    mask = torch.arange(5) < torch.tensor([5, 1, 3, 2, 4, 5, 1, 2])[:, None]
    args = dict(kl_coef=0.05, length_norm=length_norm, max_tokens=5)

    def loss(rows: slice) -> torch.Tensor:
        return grpo_loss(logp[rows], old[rows], adv[rows], mask[rows], ref_logp=ref[rows],
                         **args)  # type: ignore[arg-type]

    whole, halves = loss(slice(0, 8)), (loss(slice(0, 4)) + loss(slice(4, 8))) / 2
    torch.testing.assert_close(whole, halves, rtol=0, atol=1e-15)
    torch.testing.assert_close(torch.autograd.grad(whole, logp)[0],
                               torch.autograd.grad(halves, logp)[0], rtol=0, atol=1e-15)


# ----- the policy-gradient theorem on an enumerable policy --------------------------------

SAMPLES = 20_000


def test_the_score_function_estimate_is_the_gradient_and_a_baseline_cuts_its_variance(
        ) -> None:
    # A policy over 2-token answers from a 3-token vocabulary (9 answers): pi(a, b) =
    # softmax(theta1)[a] softmax(theta2[a])[b]. Its expected reward J and the exact gradient
    # come from enumerating the 9 answers; the estimate from grpo_loss on sampled answers.
    torch.manual_seed(0)
    theta1 = torch.randn(3, dtype=torch.float64, requires_grad=True)
    theta2 = torch.randn(3, 3, dtype=torch.float64, requires_grad=True)
    reward = 2.0 + torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 1.0], [0.0, 0.0, 1.0]],
                                dtype=torch.float64)
    logp1, logp2 = theta1.log_softmax(0), theta2.log_softmax(1)
    prob = (logp1[:, None] + logp2).exp()  # (3, 3), sums to 1
    J = (prob * reward).sum()
    exact = torch.cat([g.flatten() for g in torch.autograd.grad(J, [theta1, theta2],
                                                                 retain_graph=True)])
    # The score's expectation is 0: a baseline b adds b E[grad log pi] = 0 to the estimate.
    mean_score = torch.autograd.grad((prob.detach() * (logp1[:, None] + logp2)).sum(),
                                     [theta1, theta2], retain_graph=True)
    assert all(g.abs().max() < 1e-15 for g in mean_score)

    gen = torch.Generator().manual_seed(1)
    a = torch.multinomial(logp1.exp().detach(), SAMPLES, replacement=True, generator=gen)
    b = torch.multinomial(logp2.exp().detach()[a], 1, generator=gen)[:, 0]
    logp = torch.stack([logp1[a], logp2[a, b]], dim=1)  # (N, 2) per-token log-probs
    mask = torch.ones(SAMPLES, 2, dtype=torch.bool)
    # each sample's own estimate, A (grad log pi(a) + grad log pi(b | a)), written out
    score1 = torch.eye(3, dtype=torch.float64)[a] - logp1.exp().detach()
    score2 = torch.zeros(SAMPLES, 3, 3, dtype=torch.float64)
    score2[torch.arange(SAMPLES), a] = torch.eye(3, dtype=torch.float64)[b] - logp2.exp()[a]
    scores = torch.cat([score1, score2.flatten(1)], dim=1).detach()  # (N, 12)
    measured = {}
    for name, baseline in (("none", 0.0), ("baseline", J.item())):
        adv = reward[a, b] - baseline  # the baseline does not depend on the answer
        loss = grpo_loss(logp, logp.detach(), adv, mask)
        # "sequence" averages the 2 tokens: minus the gradient is half the estimate
        estimate = -2 * torch.cat([g.flatten() for g in torch.autograd.grad(
            loss, [theta1, theta2], retain_graph=True)])
        per_sample = adv[:, None] * scores
        torch.testing.assert_close(estimate, per_sample.mean(0), rtol=0, atol=1e-12)
        error = (estimate - exact).abs()
        stderr = per_sample.std(0) / math.sqrt(SAMPLES)
        assert (error <= 4 * stderr + 1e-12).all(), (name, error, stderr)
        measured[name] = (error.max().item(), per_sample.var(0).sum().item())
    (err_none, var_none), (err_base, var_base) = measured["none"], measured["baseline"]
    # Measured (seeded, 20,000 samples; the largest gradient entry is 0.158): largest
    # errors 0.0046 without and 0.0012 with the baseline (1.5 and 1.4 standard errors;
    # the tolerance, 4 of them, is at most 0.027 and 0.0058); total variance (the trace of
    # the covariance of one sample's estimate) 4.14 without, 0.206 with the baseline.
    assert max(err_none, err_base) < 0.01
    assert var_base < var_none / 10


def test_the_group_mean_baseline_scales_the_expected_gradient_by_g_minus_1_over_g() -> None:
    # One-token answers from softmax(theta) over 3 tokens, groups of G = 2, scale "none":
    # the expected gradient over all 9 groups, exactly, is (G - 1)/G = 1/2 of grad J.
    theta = torch.tensor([0.3, -1.2, 0.8], dtype=torch.float64, requires_grad=True)
    reward = torch.tensor([1.0, 0.0, 3.0], dtype=torch.float64)
    logp = theta.log_softmax(0)
    (exact,) = torch.autograd.grad((logp.exp() * reward).sum(), theta, retain_graph=True)
    expected = torch.zeros(3, dtype=torch.float64)
    for pair in itertools.product(range(3), repeat=2):
        answers = torch.tensor(pair)
        adv = group_advantages(reward[answers][None], scale="none").flatten()
        chosen = logp[answers][:, None]  # (2 answers, 1 token)
        loss = grpo_loss(chosen, chosen.detach(), adv, torch.ones(2, 1, dtype=torch.bool))
        (grad,) = torch.autograd.grad(loss, theta, retain_graph=True)
        expected -= logp.exp()[answers].prod().detach() * grad
    torch.testing.assert_close(expected, exact / 2, rtol=0, atol=1e-15)


# ----- the KL estimators ------------------------------------------------------------------

def test_k1_and_k3_are_unbiased_and_k3_is_never_negative() -> None:
    g = torch.Generator().manual_seed(0)
    for spread in (0.1, 1.0, 3.0):
        logp = (spread * torch.randn(7, generator=g, dtype=torch.float64)).log_softmax(0)
        ref = (spread * torch.randn(7, generator=g, dtype=torch.float64)).log_softmax(0)
        kl = (logp.exp() * (logp - ref)).sum()  # exact KL(pi || ref)
        for kind in ("k1", "k3"):
            # the expectation under pi, by enumeration of the 7 tokens
            mean = (logp.exp() * kl_estimate(logp, ref, kind)).sum()  # type: ignore[arg-type]
            assert mean.item() == pytest.approx(kl.item(), rel=1e-12, abs=1e-15)
        assert (kl_estimate(logp, ref, "k1") < 0).any()  # single tokens: k1 goes negative
        assert (kl_estimate(logp, ref, "k3") >= 0).all()
        if spread == 0.1:  # close distributions: k3 varies less than k1
            var = {k: (logp.exp() * (kl_estimate(logp, ref, k) - kl) ** 2).sum()
                   for k in ("k1", "k3")}  # type: ignore[arg-type]
            assert var["k3"] < var["k1"] / 10
    d = torch.linspace(-30, 30, 10_001, dtype=torch.float64)
    assert (kl_estimate(torch.zeros_like(d), d, "k3") >= 0).all()
    assert kl_estimate(torch.zeros(1), torch.zeros(1), "k3").item() == 0.0
    tiny = torch.tensor([1e-9], dtype=torch.float64)  # d^2/2, not lost to cancellation
    assert kl_estimate(torch.zeros(1, dtype=torch.float64), tiny, "k3").item() == \
        pytest.approx(0.5e-18, rel=1e-6)


# ----- rollouts and rewards ----------------------------------------------------------------

def test_token_logprobs_are_each_masked_targets_log_probability() -> None:
    model, _ = chat_model()
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, model.config.vocab_size, (3, 10), generator=g)
    y = torch.randint(0, model.config.vocab_size, (3, 10), generator=g)
    mask = torch.rand(3, 10, generator=g) < 0.5
    logp = token_logprobs(model(x), y, mask)
    assert logp.shape == (3, 10) and torch.equal(logp[~mask], torch.zeros(int((~mask).sum())))
    with torch.no_grad():
        probs = torch.softmax(model(x).double(), dim=-1)
    for n, t in mask.nonzero().tolist():
        assert logp[n, t].item() == pytest.approx(math.log(probs[n, t, y[n, t]].item()),
                                                  abs=1e-5)


def _prompts(tok: CharTokenizer, n: int = 6) -> list[list[int]]:
    return [prompt_ids(t.conversation()[:1], tok) for t in all_tasks()[:n]]


def test_rollouts_are_groups_of_answers_masked_up_to_their_end() -> None:
    model, tok = chat_model()
    end, T, G, new = tok.special_tokens[END_OF_TURN], model.config.context_length, 5, 8
    prompts = _prompts(tok)
    assert len({len(p) for p in prompts}) > 1  # several lengths, decoded separately
    out = rollouts(model, tok, prompts, group_size=G, max_new_tokens=new,
                   generator=torch.Generator().manual_seed(0))
    N = len(prompts) * G
    assert out.ids.shape == out.mask.shape and out.ids.shape[0] == N == len(out.texts)
    assert out.mask.dtype == torch.bool
    ended = 0
    for r in range(N):
        prompt, ids, mask = prompts[r // G], out.ids[r].tolist(), out.mask[r].tolist()
        n = len(prompt)
        assert ids[:n] == prompt and not any(mask[:n])
        said = [i for i, m in zip(ids, mask, strict=True) if m]
        first = mask.index(True)
        assert first == n and all(mask[n:n + len(said)])  # one run, right after the prompt
        assert set(ids[n + len(said):]) <= {end}  # then padding
        if end in said:
            ended += 1
            assert said.index(end) == len(said) - 1  # the end token is the last one said
            assert out.texts[r] == tok.decode(said[:-1])
        else:
            assert len(said) == min(new, T - n) and out.texts[r] == tok.decode(said)
    assert 0 < ended < N  # some answers ended early, some ran out of tokens
    again = rollouts(model, tok, prompts, group_size=G, max_new_tokens=new,
                     generator=torch.Generator().manual_seed(0))
    assert torch.equal(again.ids, out.ids) and again.texts == out.texts
    other = rollouts(model, tok, prompts, group_size=G, max_new_tokens=new,
                     generator=torch.Generator().manual_seed(1))
    assert not torch.equal(other.ids[:, :out.ids.shape[1]], out.ids)


def test_greedy_rollouts_are_the_greedy_replies() -> None:
    model, tok = chat_model()
    prompts = _prompts(tok)
    out = rollouts(model, tok, prompts, group_size=3, max_new_tokens=6, generator=None,
                   temperature=0.0)
    replies = greedy_replies(model, tok, prompts, max_new_tokens=6)
    assert out.texts == [r for r in replies for _ in range(3)]


def test_bad_batch_arguments_are_refused_where_they_enter() -> None:
    model, tok = chat_model()
    with pytest.raises(ValueError, match="at least one task"):
        grpo_batch(model, tok, [], SETTINGS, generator=None)
    long = dataclasses.replace(all_tasks()[0], question="upper: " + "a" * 80)
    with pytest.raises(ValueError, match=r"is \d+ tokens in the chat format; a model of "
                                         "context 64 reads at most 63"):
        grpo_batch(model, tok, [long], SETTINGS, generator=None)
    on_a_gpu = mock.Mock(spec=torch.Generator, device=torch.device("cuda"))  # no GPU here
    with pytest.raises(ValueError, match=r"generator is on cuda and the model on cpu: make it "
                                         r"with torch.Generator\('cpu'\)"):
        grpo_batch(model, tok, all_tasks()[:1], SETTINGS, generator=on_a_gpu)


def test_rollouts_refuse_a_prompt_the_context_cannot_hold() -> None:
    model, tok = chat_model()
    args = dict(group_size=2, max_new_tokens=4, generator=None)
    with pytest.raises(ValueError, match="prompt 1 has 64 tokens; a prompt needs 1 to 63"):
        rollouts(model, tok, [[1], [1] * 64], **args)  # type: ignore[arg-type]


def reachable(model: GPT, tok: CharTokenizer, n: int, max_new_tokens: int) -> list[Task]:
    """n tasks whose right answers are the model's own greedy answers: a random model then
    earns rewards, sometimes."""
    ts = all_tasks()[:n]
    answers = greedy_replies(model, tok, _prompts(tok, n), max_new_tokens=max_new_tokens)
    return [dataclasses.replace(t, answer=a) for t, a in zip(ts, answers, strict=True)]


def peaked_model() -> tuple[GPT, CharTokenizer]:
    """The random chat model with its logits scaled up: its greedy answer is likely, but
    not certain (rewards of sampled answers are mixed)."""
    model, tok = chat_model()
    with torch.no_grad():
        model.ln_f.weight.mul_(50.0)
    return model, tok


def test_rewards_are_exact_match_as_tasks_scores_it() -> None:
    model, tok = chat_model()
    ts = all_tasks()[:12]
    ts[::2] = reachable(model, tok, 12, 6)[::2]  # half answered as the model answers
    out = rollouts(model, tok, _prompts(tok, 12), group_size=1, max_new_tokens=6,
                   generator=None, temperature=0.0)
    rewards = score(out.texts, ts)
    assert rewards.dtype == torch.float32 and rewards[::2].tolist() == [1.0] * 6
    by_family: dict[str, list[float]] = {}
    for t, r in zip(ts, rewards.tolist(), strict=True):
        by_family.setdefault(t.family, []).append(r)
    expected = exact_match(model, tok, ts, max_new_tokens=6)
    assert {f: sum(r) / len(r) for f, r in sorted(by_family.items())} == expected
    with pytest.raises(ValueError, match="2 answers for 1 tasks: give one answer per task"):
        score(["a", "b"], ts[:1])


# ----- a step ------------------------------------------------------------------------------

SETTINGS = GRPOSettings(group_size=4, max_new_tokens=3, kl_coef=0.05)


def test_a_step_measures_and_moves_the_policy() -> None:
    model, tok = peaked_model()
    reference = copy.deepcopy(model).requires_grad_(False)
    ts = reachable(model, tok, 8, SETTINGS.max_new_tokens)
    model.train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    opt = configure_optimizer(model, lr=1e-2, weight_decay=0.0)
    stats = grpo_step(model, opt, tok, ts, SETTINGS, generator=torch.Generator().manual_seed(0),
                      reference=reference)
    # seeded: 16 of 32 answers right, 2 of the 8 groups all right or all wrong
    assert stats.reward == 0.5 and stats.zero_signal == 0.25
    assert stats.kl == 0.0  # the policy that sampled is the reference
    assert stats.length == 3.0 and stats.grad_norm > 0 and math.isfinite(stats.loss)
    assert model.training  # given back in the mode it was in
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())
    # the batch it stepped on, rebuilt: the loss it reported
    model.load_state_dict(before)
    batch, rewards = grpo_batch(model, tok, ts, SETTINGS,
                                generator=torch.Generator().manual_seed(0), reference=reference)
    assert rewards.shape == (8, 4) and rewards.mean().item() == stats.reward
    with torch.no_grad():
        loss = rollout_loss(model.eval(), batch, settings=SETTINGS)
    assert loss.item() == pytest.approx(stats.loss, abs=1e-6)
    # what it logged of the sampler, and the work it did
    assert stats.entropy == pytest.approx(answer_entropy(model(batch.x), batch.mask).item(),
                                          abs=1e-6)
    prompts = batch.mask.int().argmax(dim=1) + 1  # the first answer target ends the prompt
    assert stats.answers == 32 and stats.tokens_trained == batch.x.numel()
    assert stats.tokens_sampled == int((prompts + SETTINGS.max_new_tokens - 1).sum())
    assert stats.tokens_scored == batch.x.numel()  # the reference's pass alone


def test_the_entropy_is_the_mean_over_the_answers_tokens() -> None:
    model, tok = peaked_model()
    x = torch.tensor([[1, 2, 3, 4], [4, 3, 2, 1]])
    mask = torch.tensor([[False, True, True, False], [True, True, True, True]])
    with torch.no_grad():
        every = torch.distributions.Categorical(logits=model.eval()(x).float()).entropy()
    assert answer_entropy(model(x), mask).item() == pytest.approx(every[mask].mean().item(),
                                                                  abs=1e-6)


def test_the_sampler_reads_each_prompt_and_every_drawn_token_but_the_last() -> None:
    # prompts of 2 and 4 tokens (the first answer target sits at 1 and 3), T = 5: the first
    # row draws 3 tokens and reads 2 + 2, the second draws the 1 that fits and reads 4
    mask = torch.tensor([[False, True, True, True], [False, False, False, True]])
    assert sampled_positions(mask, max_new_tokens=3, context_length=5) == 4 + 4


def test_a_step_is_rewarded_by_the_reward_it_is_given() -> None:
    """``reward`` replaces exact match: it reads each answer beside its task (G copies of each
    task, in order) and its verdicts are the rewards; a reward that every answer earns leaves
    every group without signal, where exact match left 2 of 8 (the test above)."""
    model, tok = peaked_model()
    ts = reachable(model, tok, 8, SETTINGS.max_new_tokens)
    seen: list[tuple[list[str], list[Task]]] = []

    def everyone_wins(answers: Sequence[str], tasks: Sequence[Task]) -> torch.Tensor:
        seen.append((list(answers), list(tasks)))
        return torch.ones(len(answers))

    opt = configure_optimizer(model, lr=1e-2, weight_decay=0.0)
    stats = grpo_step(model, opt, tok, ts, SETTINGS, generator=torch.Generator().manual_seed(0),
                      reference=copy.deepcopy(model).requires_grad_(False), reward=everyone_wins)
    assert stats.reward == 1.0 and stats.zero_signal == 1.0
    (answers, tasks), = seen
    assert tasks == [t for t in ts for _ in range(SETTINGS.group_size)]
    assert len(answers) == len(tasks) and all(isinstance(a, str) for a in answers)


def test_without_a_reference_the_loss_reads_its_own_logprobs_as_the_samplers() -> None:
    """One step a batch: the sampler is the policy being trained, so the batch carries no
    log-probabilities of its own (a forward pass saved) and the loss and its gradient are
    those computed with the sampler's log-probabilities written out."""
    model, tok = peaked_model()
    ts = reachable(model, tok, 8, SETTINGS.max_new_tokens)
    on_policy = GRPOSettings(group_size=4, max_new_tokens=3)
    batch, _ = grpo_batch(model, tok, ts, on_policy, generator=torch.Generator().manual_seed(0))
    assert batch.old_logp is None and batch.ref_logp is None
    model.eval()
    with torch.no_grad():
        written = batch._replace(old_logp=token_logprobs(model(batch.x), batch.y, batch.mask))
    grads = []
    for b in (batch, written):
        model.zero_grad()
        loss = rollout_loss(model, b, settings=on_policy)
        loss.backward()
        grads.append((loss.item(), [p.grad.clone() for p in model.parameters()]))
    assert grads[0][0] == grads[1][0]
    assert all(torch.equal(a, b) for a, b in zip(grads[0][1], grads[1][1], strict=True))
    assert any(g.abs().sum() > 0 for g in grads[0][1])


def expected_reward(model: GPT, tok: CharTokenizer, ts: list[Task]) -> float:
    """The exact mean reward of sampled answers to `reachable` tasks: their right answers
    are 3 tokens with no end token, so an answer is right with probability pi(those 3)."""
    chances = []
    for t in ts:
        prompt, answer = prompt_ids(t.conversation()[:1], tok), tok.encode_ordinary(t.answer)
        ids = torch.tensor([prompt + answer])
        mask = torch.tensor([[False] * len(prompt) + [True] * len(answer)])
        with torch.no_grad():
            logp = token_logprobs(model.eval()(ids[:, :-1]), ids[:, 1:], mask[:, 1:])
        chances.append(logp.sum().exp().item())
    return sum(chances) / len(chances)


@pytest.mark.parametrize("scale, length_norm", [("std", "sequence"), ("none", "constant")])
def test_steps_raise_the_expected_reward(scale: str, length_norm: str) -> None:
    # GRPO's and Dr. GRPO's normalisations; AdamW at a fine-tuning rate. (At 1e-2 this
    # sharp model overshoots and its reward falls: a step size too large, not a wrong sign.)
    model, tok = peaked_model()
    ts = reachable(model, tok, 8, SETTINGS.max_new_tokens)
    assert all(len(tok.encode_ordinary(t.answer)) == 3 for t in ts)
    settings = SETTINGS.model_copy(update=dict(kl_coef=0.0, scale=scale, length_norm=length_norm))
    start = expected_reward(model, tok, ts)
    opt = configure_optimizer(model, lr=1e-3, weight_decay=0.0)
    gen = torch.Generator().manual_seed(0)
    for _ in range(4):
        grpo_step(model, opt, tok, ts, settings, generator=gen)
    # measured: 0.50 -> 0.83 (GRPO), 0.50 -> 0.91 (Dr. GRPO)
    assert start == pytest.approx(0.496, abs=1e-3) and expected_reward(model, tok, ts) > 0.8


@pytest.mark.parametrize("field, value, needle", [
    ("group_size", 1, "group_size\n  Input should be greater than or equal to 2"),
    ("group_size", 2.5, "group_size\n  Input should be a valid integer"),
    ("max_new_tokens", 0, "max_new_tokens\n  Input should be greater than or equal to 1"),
    ("temperature", -1.0, "temperature\n  Input should be greater than or equal to 0"),
    ("clip", 0.0, "clip\n  Input should be greater than 0"),
    ("clip", float("inf"), "clip\n  Input should be a finite number"),
    ("kl_coef", -0.1, "kl_coef\n  Input should be greater than or equal to 0"),
    ("grad_clip", float("nan"), "grad_clip\n  Input should be a finite number"),
    ("kl", "k3", "kl\n  Extra inputs are not permitted"),  # the loss's penalty is k3 alone
    ("baseline", "mean", "baseline\n  Input should be 'group' or 'none'"),
    ("scale", "mad", "scale\n  Input should be 'std' or 'none'"),
    ("length_norm", "token", "length_norm\n  Input should be 'sequence' or 'constant'"),
    ("clipping", 0.1, "clipping\n  Extra inputs are not permitted"),
])
def test_bad_settings_are_refused(field: str, value: object, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        GRPOSettings(**{field: value})  # type: ignore[arg-type]


def test_no_baseline_needs_no_spread() -> None:
    with pytest.raises(ValueError, match="scale must be 'none'"):
        GRPOSettings(baseline="none")
    assert GRPOSettings(baseline="none", scale="none").baseline == "none"


def test_a_kl_penalty_needs_a_reference() -> None:
    model, tok = chat_model()
    opt = configure_optimizer(model, lr=1e-2, weight_decay=0.0)
    with pytest.raises(ValueError, match="give the reference model"):
        grpo_step(model, opt, tok, all_tasks()[:2], SETTINGS, generator=None)


# ----- rejection sampling --------------------------------------------------------------------

def test_rejection_sampling_is_one_supervised_step_on_the_right_samples() -> None:
    """RFT samples what GRPO samples (the same generator, the same rows), keeps the rows
    whose reward is 1 and takes `train_step` on them: the weights match that step exactly."""
    model, tok = peaked_model()
    ts = reachable(model, tok, 8, SETTINGS.max_new_tokens)
    twin = copy.deepcopy(model)
    opt = configure_optimizer(model, lr=1e-3, weight_decay=0.0)
    stats = rft_step(model, opt, tok, ts, SETTINGS, generator=torch.Generator().manual_seed(0))
    batch, rewards = grpo_batch(twin, tok, ts, SETTINGS,
                                generator=torch.Generator().manual_seed(0))
    keep = rewards.flatten() == 1
    assert stats.kept == int(keep.sum()) and 0 < stats.kept < rewards.numel()
    assert stats.reward == rewards.mean().item() and stats.zero_signal == 0.25  # as GRPO's
    assert stats.length == 3.0 and stats.grad_norm > 0
    assert stats.answers == 32 and stats.tokens_scored == 0
    assert stats.tokens_trained == stats.kept * batch.x.shape[1]  # the kept rows alone
    assert stats.entropy == pytest.approx(answer_entropy(twin.eval()(batch.x),
                                                         batch.mask).item(), abs=1e-6)
    twin_opt = configure_optimizer(twin, lr=1e-3, weight_decay=0.0)
    result = train_step(twin, twin_opt, [Batch(batch.x[keep], batch.y[keep], batch.mask[keep])],
                        grad_clip=SETTINGS.grad_clip)
    assert stats.loss == result.loss.item()
    for (name, a), b in zip(model.state_dict().items(), twin.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_rejection_sampling_without_a_right_answer_takes_no_step() -> None:
    model, tok = peaked_model()
    ts = [dataclasses.replace(t, answer="no such answer") for t in all_tasks()[:8]]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    opt = configure_optimizer(model, lr=1e-3, weight_decay=0.0)
    stats = rft_step(model, opt, tok, ts, SETTINGS, generator=torch.Generator().manual_seed(0))
    assert stats.reward == 0.0 and stats.kept == 0 and stats.zero_signal == 1.0
    assert math.isnan(stats.loss) and stats.grad_norm == 0.0
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_rejection_sampling_is_rewarded_by_the_reward_it_is_given() -> None:
    model, tok = peaked_model()
    ts = all_tasks()[:8]  # their answers are out of reach; a reward every answer earns
    opt = configure_optimizer(model, lr=1e-3, weight_decay=0.0)
    stats = rft_step(model, opt, tok, ts, SETTINGS, generator=torch.Generator().manual_seed(0),
                     reward=lambda answers, tasks: torch.ones(len(answers)))
    assert stats.reward == 1.0 and stats.kept == 8 * SETTINGS.group_size


def test_rejection_sampling_steps_raise_the_expected_reward() -> None:
    model, tok = peaked_model()
    ts = reachable(model, tok, 8, SETTINGS.max_new_tokens)
    start = expected_reward(model, tok, ts)
    opt = configure_optimizer(model, lr=1e-3, weight_decay=0.0)
    gen = torch.Generator().manual_seed(0)
    for _ in range(4):
        rft_step(model, opt, tok, ts, SETTINGS, generator=gen)
    # measured: 0.50 -> 0.87
    assert start == pytest.approx(0.496, abs=1e-3) and expected_reward(model, tok, ts) > 0.8


# ----- evaluation ------------------------------------------------------------------------------

def test_evaluation_counts_what_its_samples_earn() -> None:
    """Every number is recomputed here from the answers it returns, which are the rollouts of
    the same generator; greedy answers are right by construction of the tasks."""
    model, tok = peaked_model()
    ts = reachable(model, tok, 8, 3)
    ev = evaluate_sampled(model, tok, ts, generator=torch.Generator().manual_seed(0),
                          samples=16, k=8, max_new_tokens=3)
    again = rollouts(model, tok, _prompts(tok, 8), group_size=16, max_new_tokens=3,
                     generator=torch.Generator().manual_seed(0))
    assert [a for answers in ev.answers for a in answers] == again.texts
    assert ev.greedy == 1.0 and list(ev.greedy_answers) == [t.answer for t in ts]
    right = [[a == t.answer for a in answers] for t, answers in zip(ts, ev.answers, strict=True)]
    counts = [sum(r) for r in right]
    # mixed (seeded: 4 to 16 of 16 right), so that the numbers below are not trivial
    assert sum(1 < c < 15 for c in counts) >= 4 and 16 in counts
    assert ev.pass_at_1 == pytest.approx(sum(counts) / 16 / 8, abs=1e-12)
    assert ev.pass_at_k == pytest.approx(sum(
        1 - math.comb(16 - c, 8) / math.comb(16, 8) for c in counts) / 8, abs=1e-12)
    groups = [r[g:g + 8] for r in right for g in (0, 8)]
    assert ev.all_equal == sum(len(set(g)) == 1 for g in groups) / len(groups)
    assert ev.all_equal_predicted == pytest.approx(sum(
        (math.comb(c, 8) + math.comb(16 - c, 8)) / math.comb(16, 8) for c in counts) / 8,
        abs=1e-12)
    # one right answer per task here, so distinct right answers are 1 where any is right
    assert ev.distinct_right == 1.0
    assert (ev.n, ev.k, ev.tasks) == (16, 8, 8)
    same = evaluate_sampled(model, tok, ts, generator=torch.Generator().manual_seed(0),
                            samples=16, k=8, max_new_tokens=3)
    assert same == ev
    other = evaluate_sampled(model, tok, ts, generator=torch.Generator().manual_seed(1),
                             samples=16, k=8, max_new_tokens=3)
    assert other.answers != ev.answers


def test_evaluation_counts_distinct_right_answers_by_the_reward() -> None:
    model, tok = peaked_model()
    ts = all_tasks()[:6]

    def starts_upper_case(answers: Sequence[str], tasks: Sequence[Task]) -> torch.Tensor:
        return torch.tensor([float(a[:1].isupper()) for a in answers])

    ev = evaluate_sampled(model.eval(), tok, ts, generator=torch.Generator().manual_seed(0),
                          reward=starts_upper_case, samples=8, k=4, max_new_tokens=4)
    distinct = [len({a for a in answers if a[:1].isupper()}) for answers in ev.answers]
    assert sum(distinct) / 6 == ev.distinct_right and ev.distinct_right > 1


def test_the_predicted_share_of_all_equal_groups_is_unbiased() -> None:
    """With a reward that is a coin of known p, whatever the answer, the prediction averages
    to p^k + (1 - p)^k, and so does the measured share."""
    model, tok = chat_model()
    ts = all_tasks()[:4] * 100
    coin = torch.Generator().manual_seed(1)
    p, k, n = 0.3, 4, 8

    def coin_reward(answers: Sequence[str], tasks: Sequence[Task]) -> torch.Tensor:
        return (torch.rand(len(answers), generator=coin) < p).float()

    ev = evaluate_sampled(model, tok, ts, generator=torch.Generator().manual_seed(0),
                          reward=coin_reward, samples=n, k=k, max_new_tokens=1)
    truth = p**k + (1 - p) ** k  # 0.2482
    assert len(ts) > EVAL_CHUNK  # several chunks
    # measured: 0.231 and 0.231, over 400 tasks; pass@1 0.310
    assert ev.all_equal_predicted == pytest.approx(truth, abs=0.03)
    assert ev.all_equal == pytest.approx(truth, abs=0.03)
    assert ev.pass_at_1 == pytest.approx(p, abs=0.02)


def test_bad_evaluation_arguments_are_refused() -> None:
    model, tok = chat_model()
    ts, gen = all_tasks()[:2], torch.Generator().manual_seed(0)
    with pytest.raises(ValueError, match="at least one task"):
        evaluate_sampled(model, tok, [], generator=gen)
    with pytest.raises(ValueError, match="samples must be a multiple of k = 8"):
        evaluate_sampled(model, tok, ts, generator=gen, samples=12)
    with pytest.raises(ValueError, match="k must be an int >= 1, got 0"):
        evaluate_sampled(model, tok, ts, generator=gen, k=0)
    with pytest.raises(ValueError, match="max_new_tokens must be an int >= 1, got 0"):
        evaluate_sampled(model, tok, ts, generator=gen, max_new_tokens=0)
    with pytest.raises(ValueError, match="the reward must give 0 or 1"):
        evaluate_sampled(model, tok, ts, generator=gen, samples=2, k=1, max_new_tokens=2,
                         reward=lambda answers, tasks: torch.full((len(answers),), 0.5))
    on_a_gpu = mock.Mock(spec=torch.Generator, device=torch.device("cuda"))
    with pytest.raises(ValueError, match="generator is on cuda and the model on cpu"):
        evaluate_sampled(model, tok, ts, generator=on_a_gpu)
    long = dataclasses.replace(ts[0], question="upper: " + "a" * 80)
    with pytest.raises(ValueError, match="a model of context 64 reads at most 63"):
        evaluate_sampled(model, tok, [long], generator=gen)


# ----- several processes ------------------------------------------------------------------

DDP_SCRIPT = textwrap.dedent("""
    import copy, sys, torch
    sys.path.insert(0, sys.argv[2])
    from test_rl import DDP_LR, DDP_SETTINGS, ddp_tasks, peaked_model
    from minigpt.parallel import init_distributed, shutdown
    from minigpt.posttrain.rl import grpo_step
    from minigpt.train import trainee_of
    torch.set_num_threads(1)
    ctx = init_distributed("cpu")
    model, tok = peaked_model()
    reference = copy.deepcopy(model).requires_grad_(False)
    mine = ddp_tasks(model, tok)[4 * ctx.rank:4 * ctx.rank + 4]
    opt = torch.optim.SGD(model.parameters(), lr=DDP_LR)
    stats = grpo_step(model, opt, tok, mine, DDP_SETTINGS, reference=reference,
                      trainee=trainee_of(model, ctx), ctx=ctx,
                      generator=torch.Generator().manual_seed(100 + ctx.rank))
    torch.save(model.state_dict(), sys.argv[1] + f"/rank{ctx.rank}.pt")
    if ctx.rank == 0:
        print(repr((stats.reward, stats.zero_signal, stats.loss, stats.length,
                    stats.grad_norm)))
    shutdown(ctx)
""")


# Plain SGD, unclipped: the step is the gradient itself, so a gradient off by any factor
# (a sum where a mean belongs) shows in the weights; AdamW's first step and clipping would
# normalise it away.
DDP_SETTINGS = SETTINGS.model_copy(update={"grad_clip": 0.0})
DDP_LR = 0.1


def ddp_tasks(model: GPT, tok: CharTokenizer) -> list[Task]:
    return reachable(model, tok, 8, SETTINGS.max_new_tokens)


def _cat(batches: list[RolloutBatch]) -> RolloutBatch:
    """The rows of several batches in one, right-padded to the longest (padding is masked)."""
    L = max(b.x.shape[1] for b in batches)

    def pad(t: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.pad(t, (0, L - t.shape[1]))

    def cat(parts: list[torch.Tensor | None]) -> torch.Tensor | None:
        if parts[0] is None:  # old_logp: left to the loss's own pass (on-policy)
            assert all(t is None for t in parts)
            return None
        return torch.cat([pad(t) if t.dim() == 2 else t for t in parts])

    return RolloutBatch(*(cat([b[i] for b in batches]) for i in range(6)))


@pytest.mark.slow
def test_two_ranks_take_the_step_of_one_process_on_their_prompts_together(tmp_path) -> None:
    # Each rank samples answers to its 4 questions with its own generator. One process
    # samples the same answers (the same generators, question by question), puts all 8
    # questions' answers in one batch and takes one step on it: the same weights.
    from test_parallel import run_script_on_ranks

    results = run_script_on_ranks(2, DDP_SCRIPT, tmp_path)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (0, 1)]
    model, tok = peaked_model()
    reference = copy.deepcopy(model).requires_grad_(False)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ts = ddp_tasks(model, tok)
    shares = [grpo_batch(model, tok, ts[4 * r:4 * r + 4], DDP_SETTINGS, reference=reference,
                         generator=torch.Generator().manual_seed(100 + r)) for r in (0, 1)]
    together = _cat([batch for batch, _ in shares])
    rewards = torch.cat([r for _, r in shares])
    assert 0 < rewards.mean() < 1 and not zero_signal_groups(rewards).all()
    opt = torch.optim.SGD(model.parameters(), lr=DDP_LR)
    result = train_step(model.eval(), opt, [together], grad_clip=DDP_SETTINGS.grad_clip,
                        loss_fn=lambda m, b: rollout_loss(m, b, settings=DDP_SETTINGS))
    reward, zero_signal, loss, length, grad_norm = ast.literal_eval(results[0].stdout)
    assert reward == rewards.mean().item()
    assert zero_signal == zero_signal_groups(rewards).float().mean().item()
    assert loss == pytest.approx(result.loss.item(), abs=1e-6) and length == 3.0
    assert grad_norm == pytest.approx(result.grad_norm.item(), rel=1e-5)
    # The step moves weights by up to 1.0; the two runs' weights differ by 6e-8 at most.
    for name, value in model.state_dict().items():
        assert torch.equal(ranks[0][name], ranks[1][name]), name  # the ranks agree
        torch.testing.assert_close(ranks[0][name], value, rtol=0, atol=1e-6)
    assert sum(not torch.equal(before[k], v) for k, v in model.state_dict().items()) > 10


# ------------------------------------------------------------------ the same bits on every CPU

def _batch(B: int, L: int) -> Batch:
    gen = torch.Generator().manual_seed(B * 1000 + L)
    x = torch.randint(0, 20, (B, L), generator=gen)
    mask = torch.rand(B, L, generator=gen) < 0.5
    mask[:, -1] = True  # every row counts somewhere
    return Batch(x, torch.roll(x, -1, 1), mask)


def test_a_step_on_the_micro_batches_is_the_step_on_the_batch() -> None:
    # train_step weighs every counted target alike across micro-batches: the same loss and
    # weights, up to the order of a sum.
    batch = _batch(8, 30)
    thirds = [Batch(batch.x[i:i + 3], batch.y[i:i + 3], batch.mask[i:i + 3])
              for i in (0, 3, 6)]
    results = []
    for parts in ([batch], thirds):
        model, _ = chat_model()
        model.train()
        # plain SGD: the weights move by the gradient itself (Adam's first step moves a
        # weight by +-lr whatever its gradient's size, so a rounding of a gradient near zero
        # could flip it)
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
        loss = train_step(model, optimizer, parts, grad_clip=1.0).loss.item()
        results.append((loss, model.state_dict()))
    (loss, state), (loss_split, state_split) = results
    assert loss_split == pytest.approx(loss, rel=1e-6)
    assert all(torch.allclose(state[k], state_split[k], atol=1e-6) for k in state)
