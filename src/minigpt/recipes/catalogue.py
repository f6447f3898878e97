"""Every model set-up trains and caches, by name (`python -m minigpt pretrained --only NAME`).

The pre-trained models (`minigpt.recipes.pretrained.MODELS`: the book model, its draft, the
modern model), the assistants made from the modern model (`minigpt.recipes.assistant.MODELS`),
the rewards chapter's runs (`minigpt.recipes.rewards.MODELS`: the cold start on rhymes and
``rl-METHOD-SEED``) and the small models trained where copying pays
(`minigpt.recipes.copiers.MODELS`). ``rl`` names the run that ``chat --model rl`` talks to:
GRPO, seed 0.
"""

from __future__ import annotations

from minigpt.recipes import assistant, copiers, pretrained, rewards

MODELS: dict[str, pretrained.Loader] = {**assistant.MODELS, **rewards.MODELS,
                                        **copiers.MODELS}
#: Other names of cached models: ``rl`` is the GRPO run of seed 0.
ALIASES = {"rl": "rl-grpo-0"}


def names() -> str:
    """The names of `MODELS` and `ALIASES`, for a command's help and errors: the rewards
    runs as one pattern, not a name each."""
    runs = [n for n in MODELS if n.startswith("rl-") and n != "rl-cold"]
    others = sorted(n for n in MODELS if n not in runs)
    methods = ", ".join(rewards.METHODS)
    return (f"{', '.join(others)}, rl-METHOD-SEED (METHOD one of {methods}; SEED one of "
            f"{', '.join(map(str, rewards.SEEDS))}), rl (= {ALIASES['rl']})"
            ) if runs else ", ".join(others)


def train_seconds(info: pretrained.ModelInfo) -> float:
    """The seconds a cached model took to make, as its manifest records them."""
    metrics = info.metrics
    return float(metrics["total_seconds"] if "total_seconds" in metrics
                 else metrics["train_seconds"])


def summary(info: pretrained.ModelInfo) -> str:
    """What a cached model's manifest says of its quality, in a few words: a pre-trained or
    tuned model's validation loss, a copier's best induction score, a rewards run's held-out pass@1
    on rhymes."""
    metrics = info.metrics
    if "final_val_loss" in metrics:
        return f"validation loss {metrics['final_val_loss']:.3f}"
    if "induction" in metrics:
        return f"best induction score {metrics['induction']:.2f}"
    return f"held-out rhymes pass@1 {metrics['evaluation']['pass@1']:.3f}"
