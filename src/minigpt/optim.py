"""The optimisers and learning-rate schedules that `minigpt.train` runs.

AdamW with decay on the matrices only (`configure_optimizer`, nanoGPT's groups); the cosine
schedule with a linear warm-up (`lr_at`) and the warm-up-stable-decay trapezoid
(`trapezoid_lr_at`); and Muon, written out (`Muon`, `newton_schulz`), for the hidden
matrices that `muon_and_adamw_parameters` picks. Which of them a run uses is its
`minigpt.config.TrainConfig`'s choice (`build_optimizer`, `schedule_lr`, `set_lr`).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from minigpt.config import TrainConfig
from minigpt.model import GPT


def configure_optimizer(
    model: nn.Module | list[nn.Parameter], *, lr: float, weight_decay: float,
    betas: tuple[float, float] = (0.9, 0.99),
) -> torch.optim.AdamW:
    """AdamW with two parameter groups: decay for tensors of dim >= 2, none
    for the rest.

    Matrices (linear weights, embeddings) are decayed; biases and layer-norm
    gains are not, since shrinking a gain or an offset towards 0 is no
    regulariser of the function's complexity. Tied weights appear once
    (``model.parameters()`` de-duplicates them). The fused kernel (one pass
    over all tensors) is used; PyTorch has it on CPU and CUDA. A list of parameters
    may stand for the model.
    """
    params = model if isinstance(model, list) else list(model.parameters())
    params = [p for p in params if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2],
         "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=lr, betas=betas, fused=True)


def lr_at(step: int, *, lr: float, min_lr: float, warmup_steps: int,
          decay_steps: int) -> float:
    """The learning rate of optimiser step ``step`` (counted from 0).

    * warm-up, step < warmup_steps: linear, lr * (step + 1) / warmup_steps,
      so the first step already moves and step warmup_steps - 1 uses lr;
    * decay, warmup_steps <= step <= decay_steps: cosine from lr to min_lr,
      min_lr + (lr - min_lr) * (1 + cos(pi * r)) / 2 with
      r = (step - warmup_steps) / (decay_steps - warmup_steps);
    * after decay_steps: min_lr.
    """
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if step >= decay_steps:
        return min_lr
    ratio = (step - warmup_steps) / (decay_steps - warmup_steps)
    return min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * ratio))


def trapezoid_lr_at(step: int, *, lr: float, min_lr: float, warmup_steps: int,
                    decay_steps: int, cooldown_fraction: float) -> float:
    """Warm-up, stable, decay: the learning rate of step ``step`` (counted from 0).

    * warm-up, step < warmup_steps: linear, as in `lr_at`;
    * stable: lr until the cool-down starts at
      c = max(warmup_steps, decay_steps - round(cooldown_fraction * decay_steps));
    * cool-down, c <= step <= decay_steps: linear from lr to min_lr; then min_lr.
    """
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    start = max(warmup_steps, decay_steps - round(cooldown_fraction * decay_steps))
    if step < start:
        return lr
    if step >= decay_steps:
        return min_lr
    return lr + (min_lr - lr) * (step - start) / (decay_steps - start)


def muon_and_adamw_parameters(model: GPT) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """Split a GPT's trainable parameters: the hidden matrices (2-D weights inside the
    blocks: attention's and the feed-forward's maps), which Muon updates, and the rest
    (embeddings, the head, gains and biases), which stay with AdamW."""
    hidden: list[nn.Parameter] = []
    rest: list[nn.Parameter] = []
    for name, p in model.named_parameters():  # a tied matrix is listed once
        if p.requires_grad:
            (hidden if p.dim() == 2 and name.startswith("h.") else rest).append(p)
    return hidden, rest


def newton_schulz(g: Tensor, coefficients: tuple[float, float, float] = (3.4445, -4.775,
                  2.0315), steps: int = 5, eps: float = 1e-7) -> Tensor:
    """Push every singular value of ``g`` towards 1, keeping its singular vectors: about
    U V^T for g = U S V^T, computed with matrix products only, in float32.

    X is g scaled to spectral norm <= 1 (its Frobenius norm is at least that); each step
    maps X to a X + b (X X^T) X + c (X X^T)^2 X, which applies the odd polynomial
    p(s) = a s + b s^3 + c s^5 to every singular value s. Muon's coefficients make p steep
    at 0 (a = 3.4, so small values grow fast) and keep p(s) in about [0.7, 1.2] once s has
    grown: five steps give roughly orthogonal, not exactly orthogonal, matrices.

    Args:
        g: (m, n) a gradient or momentum matrix.
    Returns: (m, n), float32.
    """
    a, b, c = coefficients
    wide = g.shape[0] <= g.shape[1]
    x = g.float() if wide else g.float().T  # (small, large): X X^T is the small Gram matrix
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    out: Tensor = x if wide else x.T
    return out


class Muon(torch.optim.Optimizer):
    """Muon for 2-D weights, written out: momentum, a Nesterov look-ahead, `newton_schulz`.

    For each matrix W (m x n) with gradient G, a step with rate lr and momentum mu does
        M <- mu M + (1 - mu) G                   the momentum, a running average of G
        U <- (1 - mu) G + mu M                   Nesterov: the look-ahead, not M itself
        W <- W - lr sqrt(max(1, m / n)) newton_schulz(U)
    The factor sqrt(max(1, m / n)) is Keller Jordan's: a tall matrix gets a larger step, so
    that the update's entries have about the same size whatever the shape. The same ops,
    in the same order, as PyTorch's `torch.optim.Muon` (which iterates in bfloat16: slow on a
    CPU without bfloat16 matrix units, and not the fp32 recipe) with this iteration.
    """

    def __init__(self, params: Any, lr: float, momentum: float = 0.95,
                 nesterov: bool = True) -> None:
        super().__init__(params, {"lr": lr, "momentum": momentum, "nesterov": nesterov})
        assert all(p.dim() == 2 for g in self.param_groups for p in g["params"])

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        assert closure is None
        for group in self.param_groups:
            lr, mu = group["lr"], group["momentum"]
            for w in group["params"]:
                if w.grad is None:
                    continue
                state = self.state[w]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(w.grad)
                momentum = state["momentum_buffer"]
                momentum.lerp_(w.grad, 1 - mu)
                update = w.grad.lerp(momentum, mu) if group["nesterov"] else momentum
                rows, cols = w.shape
                w.add_(newton_schulz(update), alpha=-lr * math.sqrt(max(1, rows / cols)))
        return None


# ------------------------------------------------------ the run's choice among them

def schedule_lr(step: int, config: TrainConfig) -> float:
    """The learning rate of step ``step`` under ``config``'s schedule."""
    c = config
    if c.schedule == "trapezoid":
        return trapezoid_lr_at(step, lr=c.lr, min_lr=c.min_lr, warmup_steps=c.warmup_steps,
                               decay_steps=c.schedule_end,
                               cooldown_fraction=c.cooldown_fraction)
    return lr_at(step, lr=c.lr, min_lr=c.min_lr, warmup_steps=c.warmup_steps,
                 decay_steps=c.schedule_end)


class MuonAdamW:
    """Muon on the hidden matrices and AdamW on the rest, stepped as one optimiser.

    ``param_groups`` lists both optimisers' groups; each group keeps its peak rate in
    ``"peak_lr"``, so a schedule scales them all by the same factor.
    """

    def __init__(self, model: GPT, config: TrainConfig) -> None:
        hidden, rest = muon_and_adamw_parameters(model)
        self.muon = Muon(hidden, lr=config.muon_lr, momentum=config.muon_momentum)
        self.adamw = configure_optimizer(rest, lr=config.lr,
                                         weight_decay=config.weight_decay,
                                         betas=(config.beta1, config.beta2))
        for group in self.param_groups:
            group["peak_lr"] = group["lr"]

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.muon.param_groups + self.adamw.param_groups

    def step(self) -> None:
        self.muon.step()
        self.adamw.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.muon.zero_grad(set_to_none)
        self.adamw.zero_grad(set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return {"muon": self.muon.state_dict(), "adamw": self.adamw.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.muon.load_state_dict(state["muon"])
        self.adamw.load_state_dict(state["adamw"])


Optimizer = torch.optim.AdamW | MuonAdamW


def build_optimizer(model: GPT, config: TrainConfig) -> Optimizer:
    """The run's optimiser: `configure_optimizer`'s AdamW, or `MuonAdamW`."""
    if config.optimizer == "muon":
        return MuonAdamW(model, config)
    return configure_optimizer(model, lr=config.lr, weight_decay=config.weight_decay,
                               betas=(config.beta1, config.beta2))


def set_lr(optimizer: Optimizer, lr: float, config: TrainConfig) -> None:
    """Give every group the schedule's rate: ``lr`` itself for AdamW alone, else each
    group's peak rate scaled by lr / config.lr."""
    for group in optimizer.param_groups:
        group["lr"] = group["peak_lr"] * lr / config.lr if "peak_lr" in group else lr
