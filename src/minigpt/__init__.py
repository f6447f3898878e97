"""minigpt: the GPT that the minigpt book builds, one component at a time.

Data flows one way through the modules: `tokenizer` -> `data` -> `nn` ->
`model` -> `decoding` / `train`; `viz` draws what the chapters show.
"""

from minigpt.config import GPTConfig, seed_all
from minigpt.decoding import beam_search, generate
from minigpt.model import GPT

__all__ = ["GPT", "GPTConfig", "beam_search", "generate", "seed_all"]
__version__ = "0.1.0"
