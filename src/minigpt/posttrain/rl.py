"""Learning from rewards: reinforcement learning with verifiable rewards (GRPO).

A task's answer can be checked by a program (`minigpt.posttrain.tasks`), so a model can learn
from its own attempts rather than from answers to imitate. For each question it samples a group of
G answers (`rollouts`); each is scored 1 if exactly right and 0 if not (`score`); an
answer's *advantage* is how much better it did than its group's mean (`group_advantages`);
and the loss raises the log-probability of the answers that beat their group and lowers
that of the others (`grpo_loss`). The reward is the checker's verdict: no reward model is
learned, so there is none to fool.

This is GRPO (Shao et al., 2024, DeepSeekMath): PPO's clipped objective (Schulman et al.,
2017) with the group's mean reward as the baseline in place of a learned value function,
and a penalty on the KL divergence to the starting model, estimated from the sampled tokens
(`kl_estimate`, after Schulman's 2020 note on approximating KL divergence). Dr. GRPO (Liu et
al., 2025, "Understanding R1-Zero-like training") drops GRPO's two normalisations, by the
group's standard deviation and by each answer's length, which bias what is learned
(``scale="none"``, ``length_norm="constant"``).

`grpo_batch` makes a batch of scored rollouts and `grpo_step` one optimiser step on it,
with `minigpt.train.train_step` and `rollout_loss` as its loss; under DDP each rank samples
answers to its own questions and the gradients are averaged. `rft_step`, rejection-sampling
fine-tuning, samples as GRPO does and takes a supervised step on the right answers alone.
`pass_at_k` measures what sampling can reach: the chance that at least one of k answers is
right; `evaluate_sampled` measures it on a model, with its greedy answers, how many distinct
right answers it samples, and how many groups of answers give GRPO no signal.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch import Tensor, nn

from minigpt.config import check_int, check_positive
from minigpt.data import Batch
from minigpt.decoding import generate_by_length
from minigpt.losses import SINGLE, token_logprobs
from minigpt.model import GPT, eval_mode
from minigpt.optim import Optimizer
from minigpt.parallel import DistContext, mean_over_ranks
from minigpt.posttrain.chat import prompt_ids
from minigpt.posttrain.tasks import Task
from minigpt.tokenizer import END_OF_TURN, Tokenizer
from minigpt.train import train_step

Scale = Literal["std", "none"]
Baseline = Literal["group", "none"]
KLKind = Literal["k1", "k3"]
LengthNorm = Literal["sequence", "constant"]


# ---------------------------------------------------------------------------- pass@k

def pass_at_k(n: int, c: int, k: int) -> float:
    """pass@k from n sampled answers of which c are right: the probability that k of them,
    drawn without replacement, hold at least one right answer.

    The unbiased estimator of Chen et al. (2021), 1 - C(n - c, k) / C(n, k), computed as
    1 - prod_{i = n - c + 1}^{n} (1 - k / i): no binomial coefficient is formed, so n may be
    large. Exactly 0 when c = 0, and exactly 1 when n - c < k (every k of the n then hold a
    right one).
    """
    for name, value in (("n", n), ("c", c), ("k", k)):
        check_int(name, value, 0)
    if c > n:
        raise ValueError(f"c, the right answers, cannot exceed n = {n} answers; got c = {c}")
    if not 1 <= k <= n:
        raise ValueError(f"k answers are drawn from the n = {n}: k must lie in [1, {n}], "
                         f"got k = {k}")
    if c == 0:
        return 0.0
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


# ------------------------------------------------------------------------ advantages

def zero_signal_groups(rewards: Tensor) -> Tensor:
    """(P,) bool, True for the groups whose G rewards (P, G) are all equal (with 1/0
    rewards: all right or all wrong). Their advantages are 0, so they teach nothing;
    ``.sum()`` counts them."""
    return (rewards == rewards[:, :1]).all(dim=1)


def group_advantages(rewards: Tensor, *, scale: Scale = "std", baseline: Baseline = "group",
                     eps: float = 1e-6) -> Tensor:
    """Each answer's advantage over its group: rewards (P, G) -> advantages (P, G).

    A_ij = r_ij - mean_j r_ij, the reward minus its group's mean (the baseline), divided by
    the group's standard deviation (population, over the G answers) plus ``eps`` when
    ``scale="std"`` (GRPO's), or not (``"none"``, Dr. GRPO's: dividing by the std weights
    the groups whose answers nearly all agree, the too-easy and too-hard questions, most).
    A group whose rewards are all equal gets advantage exactly 0 (`zero_signal_groups`).
    The mean includes the answer's own reward, so it is not quite independent of the
    answer: with ``"none"`` the expected policy gradient is (G - 1)/G of the true one, a
    smaller step in the same direction. ``baseline="none"`` (with ``scale="none"``) is
    REINFORCE without a baseline: the advantage is the reward itself.

    Args:
        rewards: (P, G), G answers to each of P prompts.
        scale: "std" or "none". baseline: "group" or "none".
        eps: > 0, keeps the division finite.
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards (P, G): P prompts x G answers, got {tuple(rewards.shape)}")
    if not rewards.is_floating_point():
        rewards = rewards.to(torch.get_default_dtype())
    if baseline == "none":
        if scale != "none":
            raise ValueError("baseline='none' takes the reward itself as the advantage: there "
                             "is no group spread to divide by, so scale must be 'none'")
        return rewards.clone()
    advantages = rewards - rewards.mean(dim=1, keepdim=True)
    if scale == "std":
        advantages = advantages / (rewards.std(dim=1, keepdim=True, correction=0) + eps)
    # Float rounding can leave r - mean a hair off zero in an all-equal group: make it 0.
    return advantages.masked_fill(zero_signal_groups(rewards)[:, None], 0.0)


# ------------------------------------------------------------------------------ the loss

def kl_estimate(logp: Tensor, ref_logp: Tensor, kind: KLKind = "k3") -> Tensor:
    """A per-token estimate of KL(pi || pi_ref) from tokens sampled from pi.

    With d = log pi_ref(y) - log pi(y) of a sampled token y (Schulman, 2020):
    k1 = -d, unbiased but negative on every token pi_ref likes more than pi does;
    k3 = e^d - 1 - d, also unbiased (E_pi[e^d] = sum_y pi_ref(y) = 1) and never negative,
    with less variance when the two are close. Shapes are kept.

    Unbiased for the KL's value, not for its gradient: differentiated as a loss, with the
    sampled tokens held fixed, k1's expected gradient is 0 and k3's is the gradient of the
    other divergence, KL(pi_ref || pi) (Tang and Munos, 2025). The gradient of
    KL(pi || pi_ref) itself is E_pi[k1 grad log pi]: k1 as a penalty on the reward. The
    rewards chapter computes all of them exactly on a small policy.
    """
    d = ref_logp - logp
    return -d if kind == "k1" else torch.expm1(d) - d


def grpo_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, *,
              clip: float = 0.2, ref_logp: Tensor | None = None, kl_coef: float = 0.0,
              length_norm: LengthNorm = "sequence", max_tokens: int | None = None) -> Tensor:
    """GRPO's loss, to minimise: minus the clipped objective, with a KL penalty.

    For each answer token, with its answer's advantage A:
        ratio = exp(logp - old_logp), the policy's probability over the sampler's;
        objective = min(ratio A, clip(ratio, 1 - clip, 1 + clip) A) - kl_coef * k3,
    with k3 the KL estimate of `kl_estimate`. Differentiated here, with the sampled tokens
    held fixed, k3 pulls the policy along the gradient of KL(pi_ref || pi) (Tang and Munos,
    2025); k1 would not pull at all (its expected gradient is 0), so the loss has no k1.
    Once the ratio is past 1 + clip where A > 0 (below 1 - clip where A < 0), the min
    takes the constant clipped term and the token gives no gradient: several steps on one
    batch of rollouts cannot carry the policy far from the one that sampled it (PPO's clip,
    Schulman et al., 2017). Each answer's objective is the mean over its tokens
    (``"sequence"``, GRPO's; a long answer's tokens then count less each, which Dr. GRPO
    finds lengthens wrong answers) or their sum over the constant ``max_tokens``
    (``"constant"``, Dr. GRPO's); the loss is minus their mean over the N answers.

    On-policy, old_logp = logp.detach(): the ratio is exactly 1, the clip is inactive and,
    without the KL term, the loss's gradient is minus REINFORCE's policy-gradient estimate
    with the group's baseline, -mean_i A_i (1/|o_i|) sum_t grad log pi(o_it) (1/max_tokens
    in place of 1/|o_i| for ``"constant"``).
    A mean over answers: under DDP, ranks holding equally many answers average their
    gradients to the gradient of all answers together.

    Args:
        logp: (N, L) log-probs of the sampled tokens under the policy trained (with grad).
        old_logp: (N, L) the same under the policy that sampled them.
        advantages: (N,) each answer's advantage (`group_advantages`, flattened).
        mask: (N, L) bool, True on the answers' tokens (their end token included).
        clip: epsilon > 0. ref_logp: (N, L) under the reference, needed if kl_coef > 0.
        kl_coef: beta >= 0.
        length_norm: "sequence" or "constant". max_tokens: the constant (>= 1).
    Returns: a scalar.

    The settings are trusted here, on every step: `GRPOSettings` checks them once, where
    they are given.
    """
    assert logp.shape == old_logp.shape == mask.shape, "logp, old_logp, mask: (N, L)"
    assert advantages.shape == logp.shape[:1], "one advantage per answer: (N,)"
    ratio = torch.exp(logp - old_logp)
    a = advantages[:, None].to(logp.dtype)
    objective = torch.minimum(ratio * a, ratio.clamp(1 - clip, 1 + clip) * a)
    if kl_coef > 0:
        assert ref_logp is not None, "a KL penalty needs the reference's log-probabilities"
        objective = objective - kl_coef * kl_estimate(logp, ref_logp, "k3")
    total = torch.where(mask, objective, 0.0).sum(dim=1)  # (N,)
    if length_norm == "sequence":
        per_answer = total / mask.sum(dim=1).clamp(min=1)
    else:
        assert max_tokens is not None, "length_norm='constant' divides by max_tokens"
        per_answer = total / max_tokens
    return -per_answer.mean()


# ------------------------------------------------------------------------------ rollouts

class Rollouts(NamedTuple):
    """G answers to each of P prompts, N = P G rows, prompt p's answers in rows
    pG .. pG + G - 1.

    Attributes:
        ids: (N, L) each prompt then its answer, then the end token repeated up to the
            longest row (whatever was drawn after an answer's end is dropped).
        mask: (N, L) bool, True on the answer's tokens, its end token included (not on the
            prompt, nor on anything after the end token).
        texts: the N answers decoded, cut before their end token.
    """

    ids: Tensor
    mask: Tensor
    texts: list[str]


@torch.no_grad()
def rollouts(model: GPT, tokenizer: Tokenizer, prompts: Sequence[Sequence[int]], *,
             group_size: int, max_new_tokens: int, generator: torch.Generator | None,
             temperature: float = 1.0, end_id: int | None = None) -> Rollouts:
    """Sample ``group_size`` answers to each prompt from ``model`` (`minigpt.generate`, with
    its key-value cache; ``temperature`` 0 is greedy, and checked there).

    The answers to prompts of one length are decoded together in one batch
    (`minigpt.decoding.generate_by_length`). Each answer
    ends at its first ``end_id`` (default: the end-of-turn token), after
    ``max_new_tokens`` tokens, or where the context is full. ``generator`` must live on the
    model's device (the draws happen there); seeded, it makes the rollouts reproducible.
    The model is in eval mode for the call. Returns `Rollouts` on the model's device.
    The arguments are trusted (`grpo_batch` checks what a person gives).
    """
    end = tokenizer.special_tokens[END_OF_TURN] if end_id is None else end_id
    assert prompts and group_size >= 1 and 0 <= end < model.config.vocab_size
    G = group_size
    seqs: list[list[int]] = [[] for _ in range(len(prompts) * G)]
    for ks, new in generate_by_length(model, prompts, max_new_tokens, repeats=G, stop_id=end,
                                      temperature=temperature, generator=generator):
        for i, seq in enumerate(new.tolist()):  # row i is answer i % G to prompt ks[i // G]
            seqs[ks[i // G] * G + i % G] = seq
    L = max(map(len, seqs))
    ids, mask, texts = [], [], []
    for r, seq in enumerate(seqs):
        n = len(prompts[r // G])
        answer = seq[n:]
        said = answer.index(end) + 1 if end in answer else len(answer)  # the end token too
        ids.append(seq[:n + said] + [end] * (L - n - said))  # drawn after the end: dropped
        mask.append([False] * n + [True] * said + [False] * (L - n - said))
        texts.append(tokenizer.decode(answer[:said - 1] if end in answer else answer))
    device = next(model.parameters()).device
    return Rollouts(torch.tensor(ids, device=device), torch.tensor(mask, device=device), texts)


def score(answers: Sequence[str], tasks: Sequence[Task]) -> Tensor:
    """The rewards (N,) float32: 1 where answer i is task i's answer exactly, else 0.

    Exact match, the comparison by which `minigpt.posttrain.tasks.exact_match` scores a model: a
    verifiable reward, a program's verdict on the answer (as cut before its end token).
    """
    if len(answers) != len(tasks):
        raise ValueError(f"{len(answers)} answers for {len(tasks)} tasks: give one answer per "
                         "task")
    return torch.tensor([float(a == t.answer) for a, t in zip(answers, tasks, strict=True)])


# --------------------------------------------------------------------------- one step

class GRPOSettings(BaseModel):
    """How a GRPO step samples and learns (validated here, where they are given).

    Attributes:
        group_size: G >= 2 answers to each question (a lone answer has no group to beat).
        max_new_tokens: the longest answer, >= 1 (and the constant of
            ``length_norm="constant"``).
        temperature: the sampling temperature, >= 0; 1 samples from the policy itself,
            which the policy gradient assumes.
        clip: PPO's epsilon > 0. kl_coef: beta >= 0, the KL penalty's weight (on k3).
        scale: "std" (GRPO) or "none" (Dr. GRPO).
        baseline: "group" (the group's mean) or "none" (REINFORCE without a baseline: the
            advantage is the reward; needs ``scale="none"``).
        length_norm: "sequence" (GRPO) or "constant" (Dr. GRPO).
        grad_clip: the gradient's largest norm (0: not clipped).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    group_size: int = Field(default=8, ge=2)
    max_new_tokens: int = Field(default=16, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, allow_inf_nan=False)
    clip: float = Field(default=0.2, gt=0.0, allow_inf_nan=False)
    kl_coef: float = Field(default=0.0, ge=0.0, allow_inf_nan=False)
    scale: Scale = "std"
    baseline: Baseline = "group"
    length_norm: LengthNorm = "sequence"
    grad_clip: float = Field(default=1.0, ge=0.0, allow_inf_nan=False)

    @model_validator(mode="after")
    def _no_spread_without_a_baseline(self) -> GRPOSettings:
        if self.baseline == "none" and self.scale != "none":
            raise ValueError("baseline='none' takes the reward itself as the advantage: there "
                             "is no group spread to divide by, so scale must be 'none'")
        return self


class RolloutBatch(NamedTuple):
    """N scored answers, as `rollout_loss` reads them: inputs ``x``, targets ``y`` and the
    answers' ``mask`` (N, L), ``advantages`` (N,), the log-probabilities of the targets
    under the policy that sampled them, ``old_logp`` (N, L), and under the reference,
    ``ref_logp`` (N, L) (None without a reference).

    Without ``old_logp`` the loss reads the policy's own log-probabilities, detached, as
    the sampler's: right for one optimiser step a batch, where the policy that is trained
    is the one that sampled (the ratio is exactly 1), and one forward pass cheaper.
    `grpo_batch` leaves it None: its steps are on-policy."""

    x: Tensor
    y: Tensor
    mask: Tensor
    advantages: Tensor
    old_logp: Tensor | None
    ref_logp: Tensor | None


#: Answers and the tasks they answer -> their rewards (N,) float32: `score` (exact match), or
#: a checker's verdicts (`minigpt.posttrain.rhymes.scorer`).
Reward = Callable[[Sequence[str], Sequence[Task]], Tensor]


def grpo_batch(policy: GPT, tokenizer: Tokenizer, tasks: Sequence[Task],
               settings: GRPOSettings, *, generator: torch.Generator | None,
               reference: GPT | None = None, reward: Reward = score,
               ) -> tuple[RolloutBatch, Tensor]:
    """Sample G answers to each task's question (`rollouts`, in the chat format), score
    them (``reward``: by default `score`, exact match) and weigh them
    (`group_advantages`); returns the `RolloutBatch` and the rewards (P, G), on the
    policy's device."""
    if not tasks:
        raise ValueError("grpo_batch needs at least one task")
    device, T = next(policy.parameters()).device, policy.config.context_length
    if generator is not None and generator.device.type != device.type:
        raise ValueError(f"the generator is on {generator.device} and the model on {device}: "
                         f"make it with torch.Generator({str(device)!r})")
    G = settings.group_size
    prompts = _question_prompts(tasks, tokenizer, T)
    out = rollouts(policy, tokenizer, prompts, group_size=G, generator=generator,
                   max_new_tokens=settings.max_new_tokens, temperature=settings.temperature)
    rewards = reward(out.texts, [t for t in tasks for _ in range(G)]).view(len(tasks), G)
    rewards = rewards.to(out.ids.device)
    advantages = group_advantages(rewards, scale=settings.scale,
                                  baseline=settings.baseline).flatten()
    x, y, mask = out.ids[:, :-1], out.ids[:, 1:], out.mask[:, 1:]
    ref_logp = None
    if reference is not None:  # the KL to it; the sampler's are the loss's own (on-policy)
        with torch.no_grad(), eval_mode(reference):
            ref_logp = token_logprobs(reference(x), y, mask)
    return RolloutBatch(x, y, mask, advantages, None, ref_logp), rewards


def _question_prompts(tasks: Sequence[Task], tokenizer: Tokenizer, T: int) -> list[list[int]]:
    """Each task's question in the chat format, refused if a model of context ``T`` has no
    room left for its answer."""
    prompts = [prompt_ids(t.conversation()[:1], tokenizer) for t in tasks]
    for task, p in zip(tasks, prompts, strict=True):
        if len(p) >= T:
            raise ValueError(f"the question {task.question!r} is {len(p)} tokens in the chat "
                             f"format; a model of context {T} reads at most {T - 1}, leaving "
                             "room for an answer")
    return prompts


def rollout_loss(model: nn.Module, batch: RolloutBatch, *, settings: GRPOSettings,
                 entropies: list[Tensor] | None = None,
                 kls: list[Tensor] | None = None) -> Tensor:
    """`grpo_loss` of a `RolloutBatch` under ``model`` (a `minigpt.losses.LossFn`). Given a
    list ``entropies``, it appends the `answer_entropy` of the same forward pass, and given
    a list ``kls`` (and a batch with ``ref_logp``), the KL estimate k3 to the reference of
    the policy that sampled, summed over each answer's tokens and averaged over the answers:
    a step measures the policy without a pass of its own."""
    logits = model(batch.x)
    if entropies is not None:
        entropies.append(answer_entropy(logits, batch.mask))
    logp = token_logprobs(logits, batch.y, batch.mask)
    old_logp = logp.detach() if batch.old_logp is None else batch.old_logp
    if kls is not None and batch.ref_logp is not None:
        per_token = kl_estimate(old_logp, batch.ref_logp, "k3")
        kls.append(torch.where(batch.mask, per_token, 0.0).sum(dim=1).mean())
    return grpo_loss(logp, old_logp, batch.advantages, batch.mask, clip=settings.clip,
                     ref_logp=batch.ref_logp, kl_coef=settings.kl_coef,
                     length_norm=settings.length_norm, max_tokens=settings.max_new_tokens)


@torch.no_grad()
def answer_entropy(logits: Tensor, mask: Tensor) -> Tensor:
    """The mean entropy, in nats, of a model's next-token distributions where ``mask``:
    a scalar, the mean over the masked positions (the answers' tokens) of
    -sum_v pi(v) log pi(v), without a gradient. A run whose entropy falls towards 0
    samples one answer.

    Args:
        logits: (N, L, V) the model's next-token scores. mask: (N, L) bool.
    """
    logp = F.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(dim=-1)[mask].mean()


def sampled_positions(mask: Tensor, *, max_new_tokens: int, context_length: int) -> int:
    """How many positions `rollouts`' forward passes read to sample a batch whose answers'
    ``mask`` (N, L) is `RolloutBatch`'s (True on the targets of the answers' tokens): for
    each row, its prompt and every drawn token but the last, n + min(max_new_tokens, T - n)
    - 1 for a prompt of n tokens (`minigpt.generate` draws that many for every row)."""
    n = mask.int().argmax(dim=1) + 1  # the first answer target sits at the prompt's end
    return int((n + (context_length - n).clamp(max=max_new_tokens) - 1).sum())


@dataclass(frozen=True)
class GRPOStats:
    """What one GRPO step measured (averaged over the ranks, but the counts: this rank's).

    Attributes:
        reward: the mean reward of the sampled answers.
        zero_signal: the fraction of groups whose answers all scored the same.
        loss: `grpo_loss` of the batch, before the step.
        kl: the KL estimate k3 of the policy that sampled to the reference, summed over
            each answer's tokens, in nats per answer; None without a reference.
        length: the mean number of tokens an answer has (its end token included).
        entropy: `answer_entropy` of the policy that sampled, over the answers' tokens
            (read off the loss's forward pass, before the step).
        grad_norm: the gradient's norm before clipping.
        answers: answers sampled. tokens_sampled: positions the sampler's forward passes
            read (`sampled_positions`). tokens_trained: positions the loss's forward and
            backward passes read. tokens_scored: positions read by forward passes without
            a gradient (the reference's log-probabilities of the KL).
    """

    reward: float
    zero_signal: float
    loss: float
    kl: float | None
    length: float
    entropy: float
    grad_norm: float
    answers: int
    tokens_sampled: int
    tokens_trained: int
    tokens_scored: int


def grpo_step(policy: GPT, optimizer: Optimizer, tokenizer: Tokenizer, tasks: Sequence[Task],
              settings: GRPOSettings, *, generator: torch.Generator | None,
              reference: GPT | None = None, trainee: nn.Module | None = None,
              ctx: DistContext = SINGLE, reward: Reward = score) -> GRPOStats:
    """One GRPO step on ``tasks``: rollouts, rewards and advantages (`grpo_batch`), then one
    optimiser step on `rollout_loss` with `minigpt.train.train_step`.

    The policy runs without dropout throughout, so that the log-probabilities the loss
    reads are those of the policy that sampled the answers (the ratio starts at 1).

    Several processes: each rank passes its own tasks (every rank as many) and its own
    generator, and ``trainee``, the policy wrapped in DDP (`minigpt.train.trainee_of`);
    the gradients are averaged over the ranks, which is the gradient of all their answers
    together (`grpo_loss` is a mean over answers), and the measurements are averaged too.

    Args:
        policy: the model trained (a chat model), sampled from.
        optimizer: its optimiser. tokenizer: its chat tokenizer.
        tasks: this rank's questions. settings: `GRPOSettings`.
        generator: on the policy's device, for the draws. reference: the frozen model of
            the KL penalty (needed if ``settings.kl_coef`` > 0; it also gives ``kl``).
        trainee: the module the loss runs through (default: the policy). ctx: this rank.
        reward: what an answer earns (default: `score`, exact match).
    """
    if settings.kl_coef > 0 and reference is None:
        raise ValueError("settings.kl_coef > 0 penalises the KL to a reference: give the "
                         "reference model")
    entropies: list[Tensor] = []
    kls: list[Tensor] = []
    with eval_mode(policy):
        batch, rewards = grpo_batch(policy, tokenizer, tasks, settings, generator=generator,
                                    reference=reference, reward=reward)
        result = train_step(policy if trainee is None else trainee, optimizer, [batch],
                            grad_clip=settings.grad_clip,
                            loss_fn=partial(rollout_loss, settings=settings,
                                            entropies=entropies, kls=kls))
    (entropy,) = entropies
    (kl,) = kls or [torch.zeros((), device=rewards.device)]
    measured = torch.stack([rewards.mean(), zero_signal_groups(rewards).float().mean(),
                            result.loss, kl, batch.mask.sum(dim=1).float().mean(), entropy])
    mean_reward, zero_signal, loss, kl_value, length, mean_entropy = mean_over_ranks(
        measured, ctx).tolist()
    positions = batch.x.numel()
    return GRPOStats(mean_reward, zero_signal, loss, kl_value if reference is not None else None,
                     length, mean_entropy, result.grad_norm.item(), answers=len(batch.x),
                     tokens_sampled=sampled_positions(
                         batch.mask, max_new_tokens=settings.max_new_tokens,
                         context_length=policy.config.context_length),
                     tokens_trained=positions,
                     tokens_scored=0 if batch.ref_logp is None else positions)


# ------------------------------------------------------------ rejection sampling (RFT)

@dataclass(frozen=True)
class RFTStats:
    """What one rejection-sampling step measured.

    Attributes:
        reward: the mean reward of the sampled answers.
        zero_signal: the fraction of groups whose answers all scored the same (as GRPO
            would count them; RFT still learns from a group that is all right).
        kept: how many answers were right (reward > 0) and trained on.
        loss: the masked cross-entropy of the kept answers before the step, in nats per
            token; nan when none was kept (and no step was taken).
        length: the mean number of tokens an answer has (its end token included).
        entropy: `answer_entropy` of the policy that sampled, over all the answers' tokens
            (a forward pass of its own, which no count holds: the step trains on the kept
            rows alone).
        grad_norm: the gradient's norm before clipping (0 without a step).
        answers, tokens_sampled, tokens_trained, tokens_scored: as `GRPOStats`' (the kept
            answers' rows are trained; nothing is scored without a gradient).
    """

    reward: float
    zero_signal: float
    kept: int
    loss: float
    length: float
    entropy: float
    grad_norm: float
    answers: int
    tokens_sampled: int
    tokens_trained: int
    tokens_scored: int = 0


def rft_step(policy: GPT, optimizer: Optimizer, tokenizer: Tokenizer, tasks: Sequence[Task],
             settings: GRPOSettings, *, generator: torch.Generator | None,
             reward: Reward = score) -> RFTStats:
    """One step of rejection-sampling fine-tuning (RFT; Yuan et al., 2023; STaR's loop,
    Zelikman et al., 2022): sample G answers to each task exactly as GRPO does
    (`grpo_batch`: the same rollouts from the same generator), keep the right ones (reward
    > 0), and take one supervised step on them: `minigpt.train.train_step`'s masked
    cross-entropy over the kept answers' tokens, their end token included, as fine-tuning
    trains on a teacher's answers. No step when no answer is right.

    The settings GRPO reads for its loss (clip, KL, scale, length_norm) play no part: RFT
    weighs every kept token alike. One process (a rank keeping no answer would skip the
    step that DDP's other ranks wait in). The step runs in the policy's own mode.

    Args:
        policy: the chat model trained, sampled from. optimizer: its optimiser.
        tokenizer: its chat tokenizer. tasks: the questions. settings: `GRPOSettings`
            (group size, answer length, temperature, grad_clip).
        generator: on the policy's device, for the draws. reward: what an answer earns
            (default: `score`, exact match).
    """
    batch, rewards = grpo_batch(policy, tokenizer, tasks, settings, generator=generator,
                                reward=reward)
    with torch.no_grad(), eval_mode(policy):  # only the kept answers are trained on
        entropy = answer_entropy(policy(batch.x), batch.mask).item()
    keep = rewards.flatten() > 0
    kept = int(keep.sum())
    loss, grad_norm = math.nan, 0.0
    if kept:
        right = Batch(batch.x[keep], batch.y[keep], batch.mask[keep])
        result = train_step(policy, optimizer, [right], grad_clip=settings.grad_clip)
        loss, grad_norm = result.loss.item(), result.grad_norm.item()
    return RFTStats(rewards.mean().item(), zero_signal_groups(rewards).float().mean().item(),
                    kept, loss, batch.mask.sum(dim=1).float().mean().item(), entropy,
                    grad_norm, answers=len(batch.x),
                    tokens_sampled=sampled_positions(
                        batch.mask, max_new_tokens=settings.max_new_tokens,
                        context_length=policy.config.context_length),
                    tokens_trained=kept * batch.x.shape[1])


# ---------------------------------------------------------------------------- evaluation

#: Questions sampled together by `evaluate_sampled` (a batch of this many times n rows).
EVAL_CHUNK = 50


@dataclass(frozen=True)
class SampledEval:
    """What `evaluate_sampled` measured on a model, each a mean over the tasks.

    Attributes:
        greedy: the fraction of tasks whose greedy answer is right.
        pass_at_1, pass_at_k: `pass_at_k` from the n answers sampled to each task at
            temperature 1, for k = 1 and k = ``k``.
        distinct_right: how many distinct right answers are among a task's n samples.
        all_equal: the fraction of groups of k answers (a task's n samples cut into n / k
            consecutive groups) whose rewards are all equal: GRPO's zero-signal groups.
        all_equal_predicted: p^k + (1 - p)^k, with p the chance that a task's sampled answer
            is right, each power estimated without bias from its n samples (c right):
            C(c, k) / C(n, k) + C(n - c, k) / C(n, k). (The plug-in, (c/n)^k + (1 - c/n)^k,
            is biased upwards: its mean is 0.719 for the true 0.663 at p = 0.05, n = 16.)
        n: answers sampled to each task. k: the group size. tasks: how many tasks.
        answers: the n sampled answers to each task, in the tasks' order.
        greedy_answers: the greedy answer to each task.
    """

    greedy: float
    pass_at_1: float
    pass_at_k: float
    distinct_right: float
    all_equal: float
    all_equal_predicted: float
    n: int
    k: int
    tasks: int
    answers: tuple[tuple[str, ...], ...] = field(repr=False)
    greedy_answers: tuple[str, ...] = field(repr=False)


@torch.no_grad()
def evaluate_sampled(model: GPT, tokenizer: Tokenizer, tasks: Sequence[Task], *,
                     generator: torch.Generator | None, reward: Reward = score,
                     samples: int = 16, k: int = 8, max_new_tokens: int = 12) -> SampledEval:
    """Score a chat model's greedy and sampled answers to ``tasks`` by ``reward``.

    Each question (in the chat format) is answered greedily once and sampled ``samples``
    times at temperature 1 (`rollouts`, `EVAL_CHUNK` questions at a time); ``reward``
    (0 or 1 an answer: exact match by default, or a checker's `minigpt.posttrain.rhymes.scorer`)
    judges every answer. Seeded, ``generator`` (on the model's device) makes the result
    reproducible. Returns a `SampledEval`.

    Args:
        model: a chat model. tokenizer: its chat tokenizer. tasks: at least one.
        generator: for the draws. reward: answers and tasks -> (N,) rewards, each 0 or 1.
        samples: n >= k answers sampled to each task, a multiple of k.
        k: the k of pass@k and the size of the groups counted in ``all_equal``, >= 1.
        max_new_tokens: the longest answer, >= 1.
    """
    if not tasks:
        raise ValueError("evaluate_sampled needs at least one task")
    for name, value in (("k", k), ("samples", samples), ("max_new_tokens", max_new_tokens)):
        check_positive(name, value)
    if samples % k:
        raise ValueError(f"samples must be a multiple of k = {k} (they are cut into groups "
                         f"of k), got {samples}")
    device = next(model.parameters()).device
    if generator is not None and generator.device.type != device.type:
        raise ValueError(f"the generator is on {generator.device} and the model on {device}: "
                         f"make it with torch.Generator({str(device)!r})")
    prompts = _question_prompts(tasks, tokenizer, model.config.context_length)
    greedy_texts: list[str] = []
    sampled: list[str] = []
    for start in range(0, len(tasks), EVAL_CHUNK):
        chunk = prompts[start:start + EVAL_CHUNK]
        greedy_texts += rollouts(model, tokenizer, chunk, group_size=1, generator=None,
                                 max_new_tokens=max_new_tokens, temperature=0.0).texts
        sampled += rollouts(model, tokenizer, chunk, group_size=samples, generator=generator,
                            max_new_tokens=max_new_tokens, temperature=1.0).texts
    right_greedy = reward(greedy_texts, tasks)
    right = reward(sampled, [t for t in tasks for _ in range(samples)])
    if not bool(((right == 0) | (right == 1)).all() & ((right_greedy == 0) |
                                                        (right_greedy == 1)).all()):
        raise ValueError("evaluate_sampled counts right answers: the reward must give 0 or 1 "
                         "to each answer")
    right = right.view(len(tasks), samples)
    counts = right.sum(dim=1).long().tolist()
    distinct = [len({a for a, r in zip(sampled[i * samples:(i + 1) * samples], right[i].tolist(),
                                       strict=True) if r})
                for i in range(len(tasks))]
    groups = right.view(len(tasks) * (samples // k), k)
    n = samples
    return SampledEval(
        greedy=right_greedy.mean().item(),
        pass_at_1=math.fsum(pass_at_k(n, c, 1) for c in counts) / len(tasks),
        pass_at_k=math.fsum(pass_at_k(n, c, k) for c in counts) / len(tasks),
        distinct_right=sum(distinct) / len(tasks),
        all_equal=zero_signal_groups(groups).float().mean().item(),
        # C(n - c, k)/C(n, k) is the chance that k of the n miss: 1 - pass@k; and
        # C(c, k)/C(n, k), that all k are right, is 1 - pass@k with the roles swapped.
        all_equal_predicted=math.fsum(2.0 - pass_at_k(n, c, k) - pass_at_k(n, n - c, k)
                                      for c in counts) / len(tasks),
        n=n, k=k, tasks=len(tasks),
        answers=tuple(tuple(sampled[i * n:(i + 1) * n]) for i in range(len(tasks))),
        greedy_answers=tuple(greedy_texts))
