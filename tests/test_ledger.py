"""minigpt.recipes.ledger: a process's CPU time split by what its thread is doing."""

from __future__ import annotations

import importlib
import sys
import time
from types import FrameType
from typing import Any

import pytest

from minigpt.recipes.ledger import KINDS, CPULedger, kind_of


def _module(name: str, source: str) -> dict[str, Any]:
    """The globals of ``source`` run as if it were the module ``name``."""
    space: dict[str, Any] = {"__name__": name, "sys": sys, "time": time}
    exec(source, space)
    return space


def test_every_named_function_is_one_of_the_package() -> None:
    for (module, name), kind in KINDS.items():
        assert callable(getattr(importlib.import_module(module), name)), (module, name)
        assert kind in ("sampling", "evaluation")


def test_the_outermost_named_function_on_the_stack_says_the_kind() -> None:
    decoding = _module("minigpt.decoding", "def generate(inner=None):\n"
                                           "    return inner() if inner else sys._getframe()\n")
    rl = _module("minigpt.posttrain.rl", "def evaluate_sampled(inner):\n    return inner()\n")
    alone: FrameType = decoding["generate"]()
    assert kind_of(alone) == "sampling"
    inside: FrameType = rl["evaluate_sampled"](decoding["generate"])  # sampling to evaluate
    assert kind_of(inside) == "evaluation"
    assert kind_of(sys._getframe()) == "training"  # nothing named on this stack
    assert kind_of(None) == "training"
    other = _module("elsewhere", "def generate():\n    return sys._getframe()\n")
    assert kind_of(other["generate"]()) == "training"  # a name of another module


def test_the_ledger_splits_the_cpu_time_by_what_the_thread_does(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(KINDS, ("a.sampler", "draw"), "sampling")
    busy = _module("a.sampler", "def draw(seconds):\n"
                                "    end = time.process_time() + seconds\n"
                                "    while time.process_time() < end:\n"
                                "        pass\n")
    started = time.process_time()
    with CPULedger(interval=0.002) as ledger:
        busy["draw"](0.3)
        end = time.process_time() + 0.6
        while time.process_time() < end:  # training: no named function on the stack
            pass
    spent = time.process_time() - started
    seconds = ledger.seconds
    assert abs(sum(seconds.values()) - spent) < 0.05  # every CPU second is charged once
    assert seconds["evaluation"] == 0
    assert abs(seconds["sampling"] - 0.3) < 0.1 and abs(seconds["training"] - 0.6) < 0.1
    assert ledger.summary().startswith("training ") and ", sampling " in ledger.summary()
