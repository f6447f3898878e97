"""Preference tuning with direct preference optimisation (DPO).

A preference pair is a question with two answers, one better than the other. Here the
better one is *verifiably* better: the task's right answer (`minigpt.posttrain.tasks`), against a
near miss that a program can tell is wrong (the line's second word for its first, the word
unreversed, a letter count off by one, ...; `near_miss`).

DPO trains a policy pi from a frozen reference pi_ref (the fine-tuned model) on the
sequence log-probabilities of the two answers' tokens (only the answer's tokens count: the
chat mask of `minigpt.posttrain.chat.encode_conversation`):

    loss = -log sigmoid(beta * ((log pi(y_w|x) - log pi_ref(y_w|x))
                                - (log pi(y_l|x) - log pi_ref(y_l|x))))

(`dpo_loss`). The reference is frozen, so its log-probabilities of a pair are computed
once, the first time the pair is drawn (`PreferenceSet.reference_logprobs`), and ride along
in every batch: the reference gets no gradient and costs no forward pass for a pair seen
before. A run of S steps of B pairs reads at most S * B of the pairs, often far fewer than
the set holds, so none is scored before it is needed. Training is `minigpt.train.train`'s loop
(its optimiser groups, schedule, clipping, checkpoints, torchrun) with `preference_loss` as
its loss (`train_dpo`). `preference_metrics` measures preference accuracy and the implied
reward margin on held-out pairs, `sampled_kl` the KL of the policy to the reference on
held-out prompts, and `beta_sweep` all three for several beta.
"""

from __future__ import annotations

import copy
import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from minigpt.config import TrainConfig
from minigpt.data import ExampleSet
from minigpt.decoding import generate_by_length
from minigpt.losses import token_logprobs
from minigpt.model import GPT, eval_mode
from minigpt.posttrain.chat import Turn, encode_conversation, greedy_replies, prompt_ids
from minigpt.posttrain.tasks import NUMBERS, Task, line_words
from minigpt.tokenizer import CHAT_TOKENS, END_OF_TURN, Tokenizer
from minigpt.train import TrainResult, train

#: The DPO recipe of the book's assistants (set-up's and the command line's), from a
#: fine-tuned book model: 100 steps at a small rate (the policy starts at the reference and
#: should stay near it), a short warm-up, no weight decay.
DPO_TRAINING: dict[str, Any] = dict(
    batch_size=16, max_steps=100, lr=3e-5, min_lr=3e-6, warmup_steps=10, weight_decay=0.0,
    eval_interval=50, eval_steps=5, seed=1337)


# ------------------------------------------------------------------------------ the pairs

@dataclass(frozen=True)
class PreferencePair:
    """A task with a preferred (``chosen``: the right answer) and a dispreferred answer
    (``rejected``: a wrong one)."""

    task: Task
    chosen: str
    rejected: str

    def __post_init__(self) -> None:
        if self.chosen == self.rejected:
            raise ValueError(f"a preference pair needs two different answers, got "
                             f"{self.chosen!r} twice for {self.task.question!r}")

    def conversations(self) -> tuple[list[Turn], list[Turn]]:
        """The question answered with the chosen, then with the rejected answer."""
        ask = Turn("user", self.task.question)
        return [ask, Turn("assistant", self.chosen)], [ask, Turn("assistant", self.rejected)]


def near_miss(task: Task, rng: random.Random) -> str:
    """A wrong answer close to the right one, drawn with ``rng`` among the family's near
    misses: the second word (first_word), the second-to-last word (last_word), the word
    itself or with two letters swapped (reverse), the word as it is or capitalised (upper),
    one more or one fewer (length). If none differs from the answer (a line "no, no, no"),
    the answer with its last letter doubled, which is also wrong."""
    words = line_words(task.source) or []
    w = task.word
    candidates = {
        "first_word": words[1:2],
        "last_word": words[-2:-1],
        "reverse": [w, w[::-1][1] + w[::-1][0] + w[::-1][2:]] if len(w) > 1 else [],
        "upper": [w, w.capitalize()],
        "length": [NUMBERS[n] for n in (len(w) - 1, len(w) + 1) if 0 <= n < len(NUMBERS)],
    }.get(task.family, [])
    wrong = sorted({c for c in candidates if c != task.answer})
    return rng.choice(wrong) if wrong else task.answer + task.answer[-1:]


def make_pairs(tasks: Sequence[Task], *, seed: int = 0) -> list[PreferencePair]:
    """One pair per task: its answer chosen, a `near_miss` rejected (deterministic given
    ``seed``)."""
    if not tasks:
        raise ValueError("make_pairs needs at least one task")
    rng = random.Random(seed)
    return [PreferencePair(t, t.answer, near_miss(t, rng)) for t in tasks]


def model_pairs(model: GPT, tokenizer: Tokenizer, tasks: Sequence[Task], *, seed: int = 0,
                max_new_tokens: int = 12) -> list[PreferencePair]:
    """One pair per task, the rejected answer the model's own greedy answer where that is
    wrong (on-policy: the mistakes it makes), else a `near_miss`."""
    if not tasks:
        raise ValueError("model_pairs needs at least one task")
    prompts = [prompt_ids(t.conversation()[:1], tokenizer) for t in tasks]
    answers = greedy_replies(model, tokenizer, prompts, max_new_tokens=max_new_tokens)
    rng = random.Random(seed)
    return [PreferencePair(t, t.answer, a if a != t.answer and _plain(a) else near_miss(t, rng))
            for t, a in zip(tasks, answers, strict=True)]


def _plain(answer: str) -> bool:
    """An answer that can be a turn's text: not empty, no chat token."""
    return bool(answer) and not any(token in answer for token in CHAT_TOKENS)


class PreferenceBatch(NamedTuple):
    """B preference pairs: inputs ``x``, targets ``y`` and the answers' ``mask`` (B, 2, L)
    (chosen at [:, 0], rejected at [:, 1]) and the reference's log-probabilities (B, 2)."""

    x: Tensor
    y: Tensor
    mask: Tensor
    reference: Tensor


class PreferenceSet(ExampleSet):
    """Encoded preference pairs and the reference's log-probabilities of their answers.

    Sequences 2k and 2k + 1 are pair k's chosen and rejected conversations, masked to the
    answers. `get_batch` draws B pairs: x, y, mask (B, 2, L) (chosen at [:, 0], rejected
    at [:, 1]) and the reference's sequence log-probabilities (B, 2); rows are pairs, so
    `minigpt.parallel.rank_batch` gives each process whole pairs.

    The reference's log-probabilities are either given, ``reference`` (N, 2), or computed
    by the frozen ``reference_model`` the first time each pair is read and then kept
    (`encode_pairs` does this): exactly one of the two. ``bf16``: compute them under bf16
    autocast, as the policy's are when training runs under it (at the start, where the
    policy is the reference, their log-ratios are then exactly zero).
    """

    def __init__(self, sequences: Sequence[Sequence[int]], masks: Sequence[Sequence[bool]],
                 reference: Tensor | None = None, *, reference_model: GPT | None = None,
                 bf16: bool = False, pad_id: int = 0) -> None:
        super().__init__(sequences, masks, pad_id=pad_id)
        n = len(sequences) // 2
        if (reference is None) == (reference_model is None):
            raise ValueError("give either the reference's log-probabilities or the "
                             "reference model, not both or neither")
        if len(sequences) % 2 or (reference is not None and reference.shape != (n, 2)):
            shape = "none" if reference is None else tuple(reference.shape)
            raise ValueError(f"need an even number of sequences (chosen, rejected, ...) and "
                             f"reference log-probabilities (N, 2); got {len(sequences)} "
                             f"sequences and {shape}")
        self.reference_model = reference_model
        self.bf16 = bf16
        self._reference = (torch.full((n, 2), math.nan) if reference is None
                           else reference.detach().float().cpu())

    @property
    def num_pairs(self) -> int:
        return len(self) // 2

    def tensors(self, rows: Sequence[int]) -> tuple[Tensor, Tensor, Tensor]:
        """Pairs ``rows`` as x, y, mask (B, 2, L), padded to the longest of them."""
        x, y, mask = self.batch([2 * r + s for r in rows for s in (0, 1)])
        assert mask is not None  # an ExampleSet's batches are masked
        shape = (len(rows), 2, -1)
        return x.view(shape), y.view(shape), mask.view(shape)

    def reference_logprobs(self, rows: Sequence[int] | None = None) -> Tensor:
        """(B, 2) the reference's log-probabilities of pairs ``rows`` (default: all); those
        not computed yet are computed now, by the reference model, and kept."""
        rows = range(self.num_pairs) if rows is None else rows
        missing = [r for r in dict.fromkeys(rows) if math.isnan(self._reference[r, 0])]
        if missing:
            assert self.reference_model is not None  # a given reference has no NaN
            self._reference[missing] = pair_logprobs(self.reference_model, self, missing,
                                                     bf16=self.bf16)
        return self._reference[list(rows)]

    def pairs(self, rows: Sequence[int]) -> PreferenceBatch:
        """Pairs ``rows``: x, y, mask (B, 2, L) and the reference's log-probs (B, 2)."""
        return PreferenceBatch(*self.tensors(rows), self.reference_logprobs(rows))

    def get_batch(self, batch_size: int, context_length: int, *,  # type: ignore[override]
                  generator: torch.Generator | None = None, device: str | torch.device = "cpu",
                  ) -> PreferenceBatch:
        """B pairs drawn uniformly with replacement (`pairs`), on ``device``."""
        self.check_context_length(context_length)
        rows = torch.randint(0, self.num_pairs, (batch_size,), generator=generator).tolist()
        return PreferenceBatch(*(t.to(device) for t in self.pairs(rows)))


def encode_pairs(pairs: Sequence[PreferencePair], tokenizer: Tokenizer,
                 reference: GPT, *, bf16: bool = False) -> PreferenceSet:
    """The pairs in the chat format (`encode_conversation`'s assistant mask), scored by the
    frozen ``reference`` (`sequence_logprobs`, under bf16 autocast if ``bf16``) as they are
    read."""
    if not pairs:
        raise ValueError("encode_pairs needs at least one preference pair")
    encoded = [encode_conversation(c, tokenizer) for p in pairs for c in p.conversations()]
    data = PreferenceSet([ids for ids, _ in encoded], [m for _, m in encoded],
                         reference_model=reference, bf16=bf16,
                         pad_id=tokenizer.special_tokens[END_OF_TURN])
    data.check_context_length(reference.config.context_length)
    return data


# ------------------------------------------------------------------------------- the loss

def sequence_logprobs(model: nn.Module, x: Tensor, y: Tensor, mask: Tensor) -> Tensor:
    """log p(answer | prompt): the sum of log-probabilities of the targets where ``mask``
    (`minigpt.losses.token_logprobs`).

    Args:
        x, y: (N, L) inputs and targets. mask: (N, L) bool, True on the answer's targets.
    Returns: (N,) float32.
    """
    return token_logprobs(model(x), y, mask).sum(-1)


def dpo_loss(policy_chosen: Tensor, policy_rejected: Tensor, reference_chosen: Tensor,
             reference_rejected: Tensor, beta: float) -> Tensor:
    """DPO's loss, the mean over pairs of -log sigmoid(beta * (r_w - r_l)), where
    r = log pi(y|x) - log pi_ref(y|x) is an answer's log-ratio and beta * r its implied
    reward. Every argument (B,) is a sequence log-probability; returns a scalar."""
    margin = (policy_chosen - reference_chosen) - (policy_rejected - reference_rejected)
    return -F.logsigmoid(beta * margin).mean()


def preference_loss(model: nn.Module, batch: PreferenceBatch, *, beta: float) -> Tensor:
    """`dpo_loss` of a `PreferenceSet` batch under ``model`` (a `minigpt.losses.LossFn`)."""
    x, y, mask, reference = batch
    logps = sequence_logprobs(model, x.flatten(0, 1), y.flatten(0, 1),
                              mask.flatten(0, 1)).view(-1, 2)
    return dpo_loss(logps[:, 0], logps[:, 1], reference[:, 0], reference[:, 1], beta)


@torch.no_grad()
def pair_logprobs(model: GPT, data: PreferenceSet, rows: Sequence[int] | None = None,
                  batch_size: int = 64, *, bf16: bool = False) -> Tensor:
    """(B, 2) ``model``'s sequence log-probabilities of the answers of pairs ``rows``
    (default: all), ``batch_size`` pairs a forward pass, in eval mode (under bf16 autocast
    if ``bf16``)."""
    rows = list(range(data.num_pairs) if rows is None else rows)
    device = next(model.parameters()).device
    out = []
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16)
    with eval_mode(model), autocast:
        for start in range(0, len(rows), batch_size):
            x, y, mask = data.tensors(rows[start:start + batch_size])
            out.append(sequence_logprobs(model, x.flatten(0, 1).to(device),
                                         y.flatten(0, 1).to(device),
                                         mask.flatten(0, 1).to(device)).view(-1, 2).cpu())
    return torch.cat(out)


# --------------------------------------------------------------------------- training

def check_beta(beta: float) -> float:
    """Refuse a beta that is not a positive finite number."""
    if isinstance(beta, bool) or not isinstance(beta, int | float) or not 0 < beta < float("inf"):
        raise ValueError(f"beta must be a positive number (the KL penalty's weight), "
                         f"got {beta!r}")
    return float(beta)


def train_dpo(policy: GPT, tokenizer: Tokenizer, train_pairs: Sequence[PreferencePair],
              val_pairs: Sequence[PreferencePair], config: TrainConfig, *, beta: float,
              **train_args: Any) -> tuple[TrainResult, GPT]:
    """Train a copy of ``policy`` (a chat model) with DPO on ``train_pairs``, with
    `minigpt.train.train` (``train_args`` go to it) and `preference_loss` as its loss; the
    validation loss is the DPO loss on ``val_pairs``. The reference is a frozen copy of
    ``policy``, which is not changed, on the run's device (where the policy trains, so that
    both score under the same precision: `train` sets it before the first batch, whose
    reading scores the reference). Returns the run's result and the reference."""
    beta = check_beta(beta)
    ctx = train_args.get("ctx")
    device = torch.device(config.device) if ctx is None else ctx.device
    reference = copy.deepcopy(policy).to(device).eval().requires_grad_(False)
    train_set = encode_pairs(train_pairs, tokenizer, reference, bf16=config.bf16)
    val_set = encode_pairs(val_pairs, tokenizer, reference, bf16=config.bf16)
    result = train(copy.deepcopy(policy), config, train_set, val_set, tokenizer=tokenizer,
                   loss_fn=partial(preference_loss, beta=beta), **train_args)
    return result, reference


# ------------------------------------------------------------------------------ metrics

def preference_metrics(policy: GPT, data: PreferenceSet, beta: float) -> dict[str, float]:
    """On held-out pairs (encoded with the reference's log-probabilities): ``accuracy``,
    the fraction of pairs whose chosen answer gains more log-ratio than the rejected one
    (implied reward of the chosen > the rejected's; a tie, as at the start, counts as
    wrong; beta does not change it), ``margin``, the mean implied reward margin
    beta * (r_w - r_l), ``loss``, the mean DPO loss, ``chosen_shift`` and
    ``rejected_shift``, the mean log-ratios r_w and r_l (how far the policy moved each
    answer's log-probability), and ``ranking``, the fraction of pairs where the policy
    itself gives the chosen answer the higher log-probability."""
    beta = check_beta(beta)
    pi, ref = pair_logprobs(policy, data), data.reference_logprobs()
    pi, ref = pi.to("cpu", torch.float64), ref.to("cpu", torch.float64)  # MPS has no float64
    ratio = pi - ref
    margin = beta * (ratio[:, 0] - ratio[:, 1])
    return {"accuracy": (margin > 0).double().mean().item(),
            "margin": margin.mean().item(),
            "loss": (-F.logsigmoid(margin)).mean().item(),
            "chosen_shift": ratio[:, 0].mean().item(),
            "rejected_shift": ratio[:, 1].mean().item(),
            "ranking": (pi[:, 0] > pi[:, 1]).double().mean().item()}


@torch.no_grad()
def sampled_kl(policy: GPT, reference: GPT, prompts: Sequence[Sequence[int]], end_id: int, *,
               samples: int = 4, max_new_tokens: int = 16, seed: int = 0) -> float:
    """KL(policy || reference) of the answers to ``prompts``, in nats per answer.

    Estimator: for each prompt x, ``samples`` answers y are drawn from the policy
    (temperature 1, until the end-of-turn token ``end_id``, at most ``max_new_tokens``
    tokens or the context's end); for each, the exact KL of the two next-token
    distributions, sum over v of pi(v) (log pi(v) - log pi_ref(v)), is summed over the
    answer's positions (its end token's included). Its expectation is the sequence-level
    KL E_y[log pi(y|x) - log pi_ref(y|x)] (of the answers as cut), and it never goes
    negative, unlike the sampled log-ratio alone. The mean over prompts and samples.
    """
    if not prompts:
        raise ValueError("sampled_kl needs at least one prompt")
    gen = torch.Generator(next(policy.parameters()).device).manual_seed(seed)  # draws there
    total = 0.0
    with eval_mode(policy), eval_mode(reference):
        for rows, seqs in generate_by_length(policy, prompts, max_new_tokens, repeats=samples,
                                             generator=gen):
            n = len(prompts[rows[0]])
            logp = F.log_softmax(policy(seqs[:, :-1]).float(), -1)[:, n - 1:]
            logq = F.log_softmax(reference(seqs[:, :-1]).float(), -1)[:, n - 1:]
            kl = (logp.exp() * (logp - logq)).sum(-1)  # (rows, answer positions)
            answer = seqs[:, n:]
            ended = (answer == end_id).long().cumsum(1)
            counted = (ended == 0) | ((ended == 1) & (answer == end_id))  # up to the end
            total += (kl * counted[:, :kl.shape[1]]).sum().item()
    return total / (len(prompts) * samples)


def evaluate_dpo(policy: GPT, reference: GPT, tokenizer: Tokenizer,
                 val_pairs: Sequence[PreferencePair], beta: float, *,
                 kl_samples: int = 4, kl_prompts: int = 200, seed: int = 0,
                 ) -> dict[str, float]:
    """`preference_metrics` on ``val_pairs`` and ``kl``, `sampled_kl` on the questions of
    every k-th pair, ``kl_prompts`` of them at most."""
    data = encode_pairs(val_pairs, tokenizer, reference)
    every = max(1, -(-len(val_pairs) // kl_prompts))
    prompts = [prompt_ids(p.conversations()[0][:1], tokenizer) for p in val_pairs[::every]]
    kl = sampled_kl(policy, reference, prompts, tokenizer.special_tokens[END_OF_TURN],
                    samples=kl_samples, seed=seed)
    return preference_metrics(policy, data, beta) | {"kl": kl}


def beta_sweep(policy: GPT, tokenizer: Tokenizer, train_pairs: Sequence[PreferencePair],
               val_pairs: Sequence[PreferencePair], betas: Sequence[float],
               config: TrainConfig, **eval_args: Any) -> list[dict[str, float]]:
    """Train one DPO model per beta from the same ``policy`` with the same ``config``, and
    measure each on ``val_pairs`` (`evaluate_dpo`): one row per beta, with the reference's
    own row first (beta = the first beta, no training: accuracy before DPO, KL 0)."""
    if not betas:
        raise ValueError("beta_sweep needs at least one beta")
    betas = [check_beta(b) for b in betas]
    start = evaluate_dpo(policy, policy, tokenizer, val_pairs, betas[0], **eval_args)
    rows = [{"beta": betas[0], "steps": 0} | start]
    for beta in betas:
        t0 = time.perf_counter()
        result, reference = train_dpo(policy, tokenizer, train_pairs, val_pairs, config,
                                      beta=beta, progress=False)
        seconds = time.perf_counter() - t0
        rows.append({"beta": beta, "steps": config.max_steps, "seconds": round(seconds, 1)}
                    | evaluate_dpo(result.model, reference, tokenizer, val_pairs, beta,
                                   **eval_args))
    return rows
