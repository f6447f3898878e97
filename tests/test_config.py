"""GPTConfig validation, defaults and presets."""

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from minigpt import GPTConfig, seed_all
from minigpt.config import GPT2_SIZES, check_int, check_positive, read_seed_shift, stream_seed

BASE = dict(vocab_size=11, context_length=8, d_model=12, n_heads=3, n_layers=2)


def test_defaults_follow_gpt2():
    config = GPTConfig(**BASE)
    assert config.d_ff == 4 * 12
    assert config.tie_weights and config.bias and config.positional == "learned"
    assert config.d_head == 4


def test_explicit_d_ff_is_kept():
    assert GPTConfig(**BASE, d_ff=7).d_ff == 7


@pytest.mark.parametrize(
    ("override", "field", "rule"),
    [
        (dict(d_model=10, n_heads=3), "d_model", "divisible by n_heads"),
        (dict(vocab_size=0), "vocab_size", "greater than 0"),
        (dict(context_length=-1), "context_length", "greater than 0"),
        (dict(n_layers=0), "n_layers", "greater than 0"),
        (dict(n_heads=0), "n_heads", "greater than 0"),
        (dict(d_ff=0), "d_ff", "greater than 0"),
        (dict(dropout=1.0), "dropout", "less than 1"),
        (dict(dropout=-0.1), "dropout", "greater than or equal to 0"),
        (dict(positional="rotary"), "positional", "'learned', 'sinusoidal' or 'rope'"),
        (dict(layer_norm_eps=0.0), "layer_norm_eps", "greater than 0"),
        (dict(n_experts=4), "n_experts", "Extra inputs are not permitted"),
    ],
)
def test_invalid_values_name_field_and_rule(override, field, rule):
    with pytest.raises(ValueError) as info:
        GPTConfig(**(BASE | override))
    message = str(info.value)
    assert field in message and rule in message


def test_config_is_immutable():
    config = GPTConfig(**BASE)
    with pytest.raises(ValueError):
        config.d_model = 16


def test_round_trip_through_dict():
    config = GPTConfig.gpt2("medium")
    assert GPTConfig(**config.model_dump()) == config


@pytest.mark.parametrize("size, shape", [("small", (12, 768, 12)), ("medium", (24, 1024, 16)),
                                         ("large", (36, 1280, 20)), ("xl", (48, 1600, 25))])
def test_gpt2_presets(size, shape):
    # The published sizes (Radford et al., 2019), written out rather than read from the
    # table under test.
    config = GPTConfig.gpt2(size)
    assert (config.n_layers, config.d_model, config.n_heads) == shape
    assert config.d_ff == 4 * shape[1]
    assert (config.vocab_size, config.context_length) == (50257, 1024)


def test_gpt2_family_table():
    # The book's table: (L, D, H, d_ff) of the four published sizes.
    table = {name: (c.n_layers, c.d_model, c.n_heads, c.d_ff)
             for name in GPT2_SIZES for c in [GPTConfig.gpt2(name)]}
    assert table == {"small": (12, 768, 12, 3072), "medium": (24, 1024, 16, 4096),
                     "large": (36, 1280, 20, 5120), "xl": (48, 1600, 25, 6400)}


def test_unknown_gpt2_size():
    with pytest.raises(ValueError, match="unknown GPT-2 size 'huge'"):
        GPTConfig.gpt2("huge")


def test_debug_and_cpu_presets():
    debug = GPTConfig.debug()
    assert (debug.context_length, debug.d_model, debug.n_heads) == (8, 4, 2)
    cpu = GPTConfig.shakespeare_cpu(vocab_size=65)
    assert (cpu.n_layers, cpu.n_heads, cpu.d_model, cpu.context_length) == (4, 4, 128, 64)
    assert GPTConfig.debug(n_layers=1).n_layers == 1


def test_seed_all_repeats_draws():
    seed_all(7)
    first = torch.rand(3)
    seed_all(7)
    assert torch.equal(first, torch.rand(3))


def test_activation_defaults_and_validation():
    assert GPTConfig.gpt2("small").activation == "gelu_tanh"  # GPT-2's own
    assert GPTConfig.shakespeare_cpu(65).activation == "gelu"  # cheaper on a CPU
    with pytest.raises(ValueError, match="activation"):
        GPTConfig.debug(activation="relu")


@pytest.mark.parametrize(("value", "high", "message"), [
    (-1, None, "n must be an int >= 0, got -1"),
    (6, 5, "n must be an int from 0 to 5, got 6"),
    (2.0, 5, "n must be an int from 0 to 5, got 2.0"),
    (True, None, "n must be an int >= 0, got True"),
    ("3", None, "n must be an int >= 0, got '3'"),
])
def test_an_integer_is_checked_with_its_name_range_and_value(
        value: object, high: int | None, message: str) -> None:
    with pytest.raises(ValueError) as err:
        check_int("n", value, 0, high)
    assert str(err.value) == message
    check_int("n", np.int64(5), 0, 5)  # NumPy's integers are integers
    with pytest.raises(ValueError, match="steps must be an int >= 1, got 0"):
        check_positive("steps", 0)


def test_stream_seeds_differ_by_seed_name_and_index_and_fit_a_generator() -> None:
    keys = [(seed, name, *index) for seed in (0, 1, 2**40) for name in ("a", "b", "ab", "")
            for index in ((), (0,), (1,), (0, 1))]
    seeds = [stream_seed(*key) for key in keys]
    assert len(set(seeds)) == len(keys)
    assert seeds == [stream_seed(*key) for key in keys]  # a function of its arguments
    assert all(0 <= s < 2**64 for s in seeds)
    torch.Generator().manual_seed(max(seeds))  # a generator takes any of them


# ------------------------------------------------------------------------- the redraw

def test_a_seed_shift_redraws_every_stream_and_no_shift_moves_nothing() -> None:
    keys = [(seed, name, *index) for seed in (0, 1, 1337, 2**40) for name in ("init", "batches")
            for index in ((), (0,), (3,))]
    book = [stream_seed(*key, shift=0) for key in keys]
    # the book's own draw: the stream seeds as they were before the shift existed
    assert stream_seed(1337, "init", shift=0) == int(np.random.SeedSequence(
        1337, spawn_key=(4, *b"init")).generate_state(1, np.uint64)[0])
    for shift in (1, 2, 2**32 - 1):
        redrawn = [stream_seed(*key, shift=shift) for key in keys]
        assert len(set(redrawn)) == len(keys)  # still independent streams
        assert not set(redrawn) & set(book)  # and none of them the book's
    # seed s under shift 1 is not seed s + 1 of the book (three seeds stay three draws)
    assert stream_seed(0, "init", shift=1) not in {stream_seed(s, "init", shift=0)
                                                   for s in range(4)}


@pytest.mark.parametrize("text", ["x", "-1", "1.5", "4294967296", "0x10", " 2 3"])
def test_a_seed_shift_that_is_not_a_whole_number_is_refused_where_it_is_read(text: str) -> None:
    with pytest.raises(ValueError, match="MINIGPT_SEED_SHIFT=.*whole number from 0 to"):
        read_seed_shift({"MINIGPT_SEED_SHIFT": text})


def test_an_unset_or_empty_seed_shift_is_the_books_own_draw() -> None:
    assert read_seed_shift({}) == 0 and read_seed_shift({"MINIGPT_SEED_SHIFT": ""}) == 0
    assert read_seed_shift({"MINIGPT_SEED_SHIFT": " 7 "}) == 7


def test_importing_the_package_under_a_bad_seed_shift_fails_with_the_reason() -> None:
    env = {**os.environ, "MINIGPT_SEED_SHIFT": "two"}
    done = subprocess.run([sys.executable, "-c", "import minigpt"], env=env,
                          capture_output=True, text=True, check=False)
    assert done.returncode != 0
    assert "MINIGPT_SEED_SHIFT='two': use a whole number" in done.stderr
