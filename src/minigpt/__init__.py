"""minigpt: the GPT that the minigpt book builds, one component at a time.

Data flows one way through the modules: `tokenizer` -> `data` -> `nn` ->
`model` -> `generate` / `train`; `viz` draws what the chapters show.
"""

from minigpt.config import GPTConfig, seed_all
from minigpt.model import GPT

__all__ = ["GPT", "GPTConfig", "generate", "seed_all"]
__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    # `generate` is imported on first use so that `import minigpt` stays light.
    if name == "generate":
        from minigpt.generate import generate

        return generate
    raise AttributeError(f"module 'minigpt' has no attribute {name!r}")
