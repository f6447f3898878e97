"""minigpt: the GPT that the minigpt book builds, one component at a time.

The top level is the core, and data flows one way through it: `config` -> `tokenizer` ->
`data` -> `attention` -> `nn` -> `model` -> `decoding` / `losses` -> `optim` -> `train`
(`checkpoint`, `parallel`), every matrix product summed in one order on every CPU by
`products`. Four subpackages are built on the core and import it, never the other way round
(the README's "Reading the code"):

* `minigpt.posttrain`: after pre-training (`chat`, `tasks`, `sft`, `dpo`, `rl`, `rhymes`,
  `evals`, `classify`);
* `minigpt.interp`: inside a trained model (`heads`, `stream`, `interventions`,
  `circuits`);
* `minigpt.recipes`: the book's trained models, each made once and cached (`pretrained`,
  `assistant`, `rewards`, `copiers`), by name (`catalogue`), published (`published`,
  `export`) and accounted for (`ledger`);
* `minigpt.figures`: the chapters' figures (`viz`, `plots`, `diagram`, `charts`).

Where an input is checked: a user's input (a config, a prompt, a file, a path, a tensor a
chapter hands in) is checked where it enters, by the function a chapter, a tool or the
command line calls, which raises ``ValueError`` or ``TypeError`` saying what was wrong and
what is allowed (nothing is silently clamped; integers through `minigpt.config.check_int`
and `check_positive`); past that entry the package's own invariants are ``assert``
statements, which ``python -O`` removes, so no test expects an ``AssertionError``; nothing
is checked twice, and nothing on a hot path waits for the device to check
(docs/contributing.md).
"""

import os

#: The CPU kernels every minigpt process runs, so that a seeded run trains bit-identical
#: weights on every x86-64 CPU, Intel and AMD. PyTorch picks its vectorised kernels (ATen's),
#: its matrix products (MKL's) and oneDNN's by the widest instructions the CPU has; AVX-512
#: kernels add up numbers in another order than AVX2 ones, and the trained weights then
#: differ in their last bits, then in their samples. Pinned to AVX2, the widest set that
#: nearly every x86-64 CPU of the last ten years has. MKL also chooses its code path by the
#: CPU's vendor: ",STRICT" (its strict conditional-reproducibility mode) makes every Intel CPU
#: take the same AVX2 path; an AMD CPU still takes another branch for some shapes, which the
#: package never hands MKL (`minigpt.products`, installed below; tests/test_same_bits.py
#: replays every product the book computes under emulated Intel and AMD CPUs). What the pins
#: and the products cost is measured in docs/reproducibility.md. Each pin is read
#: once, at the first operation torch runs, so they are set here, before minigpt imports
#: torch; a value already in the environment wins (set ATEN_CPU_CAPABILITY=avx512
#: MKL_CBWR=AUTO MINIGPT_PRODUCTS=native for speed over reproducibility). Other
#: architectures (arm64) ignore them.
PINNED_CPU_KERNELS = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2,STRICT",
                      "ONEDNN_MAX_CPU_ISA": "AVX2"}
for _name, _value in PINNED_CPU_KERNELS.items():
    os.environ.setdefault(_name, _value)

#: How glibc's malloc is set in every minigpt process on Linux (`keep_freed_memory`): blocks
#: of up to 32 MiB come from the heap, not from a mapping of their own, and the heap keeps up
#: to 1 GiB of freed memory at its top instead of handing it back to the system. A training
#: step frees and allocates the same few megabyte-sized tensors again and again (activations,
#: gradients); by default each time some of them are fresh mappings, whose pages the kernel
#: faults in and zeroes one by one as they are first written: 12,000 page faults a step of the
#: modern recipe, 5-10 % of its time (docs/reproducibility.md). Where the memory comes from
#: changes no bit. A value already in the environment (MALLOC_MMAP_THRESHOLD_,
#: MALLOC_TRIM_THRESHOLD_) wins, as glibc reads it.
MALLOC_SETTINGS = {"MALLOC_MMAP_THRESHOLD_": 32 << 20, "MALLOC_TRIM_THRESHOLD_": 1 << 30}


def keep_freed_memory() -> bool:
    """Set glibc's malloc as `MALLOC_SETTINGS` says, each value unless the environment already
    sets it; True if glibc took them, False where malloc is not glibc's (macOS, Windows, musl)."""
    import ctypes
    import platform
    import sys

    if sys.platform != "linux" or platform.libc_ver()[0] != "glibc":
        return False
    mallopt = ctypes.CDLL(None).mallopt  # glibc's malloc.h: int mallopt(int param, int value)
    # malloc.h's M_MMAP_THRESHOLD and M_TRIM_THRESHOLD
    parameter = {"MALLOC_MMAP_THRESHOLD_": -3, "MALLOC_TRIM_THRESHOLD_": -1}
    taken = [name in os.environ or mallopt(parameter[name], value) == 1
             for name, value in MALLOC_SETTINGS.items()]
    return all(taken)


keep_freed_memory()

from minigpt import products  # noqa: E402  (after the kernels are pinned)

products.install()  # every matrix product summed in one order on every CPU (minigpt.products)

from typing import TYPE_CHECKING, Any  # noqa: E402

from minigpt.config import GPTConfig, seed_all  # noqa: E402
from minigpt.model import GPT  # noqa: E402

if TYPE_CHECKING:
    from minigpt.decoding import beam_search, generate

__all__ = ["GPT", "PINNED_CPU_KERNELS", "GPTConfig", "beam_search", "generate", "seed_all"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    """`generate` and `beam_search`, from `minigpt.decoding` when first asked for: importing
    minigpt (as training does) does not load decoding, so decoding is not in the models' key
    (`minigpt.recipes.pretrained.TRAINING_MODULES`)."""
    if name in ("generate", "beam_search"):
        from minigpt import decoding

        return getattr(decoding, name)
    raise AttributeError(f"module 'minigpt' has no attribute {name!r}")
