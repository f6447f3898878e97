"""Where a process's CPU time goes: `CPULedger` splits the CPU time of a block of code
(set-up training a model, say) into training, sampling and evaluation, by sampling what the
thread that runs it is doing. Every few milliseconds it reads that thread's stack, and the CPU
time the process spent since the last look goes to the kind of the outermost function on the
stack that `KINDS` names (evaluation that samples is evaluation); time in no named function
is training (the steps, their data, saving). A statistical profile, not a count: its shares
are good to a look's interval times the number of switches between kinds.

No training code calls it (`python -m minigpt pretrained` wraps each model it makes), so it
is in no model's cache key.
"""

from __future__ import annotations

import sys
import threading
import time
from types import FrameType, TracebackType
from typing import Literal

Kind = Literal["training", "sampling", "evaluation"]
#: The package's functions whose time is not training, by module and name: what evaluates a
#: model, and what samples from one outside an evaluation (the rollouts of learning from
#: rewards, the model's own answers that preference pairs are made of).
KINDS: dict[tuple[str, str], Kind] = {
    ("minigpt.losses", "estimate_loss"): "evaluation",
    ("minigpt.losses", "full_loss"): "evaluation",
    ("minigpt.posttrain.rl", "evaluate_sampled"): "evaluation",
    ("minigpt.recipes.rewards", "evaluate_run"): "evaluation",
    ("minigpt.recipes.rewards", "room"): "evaluation",
    ("minigpt.posttrain.dpo", "evaluate_dpo"): "evaluation",
    ("minigpt.posttrain.dpo", "preference_metrics"): "evaluation",
    ("minigpt.posttrain.evals", "exact_match_by_turn"): "evaluation",
    ("minigpt.posttrain.evals", "multiple_choice"): "evaluation",
    ("minigpt.posttrain.evals", "benchmark_table"): "evaluation",
    ("minigpt.interp.heads", "head_scores"): "evaluation",
    ("minigpt.interp.heads", "copy_losses"): "evaluation",
    ("minigpt.decoding", "generate"): "sampling",
    ("minigpt.posttrain.rl", "rollouts"): "sampling",
    ("minigpt.posttrain.chat", "greedy_replies"): "sampling",
    ("minigpt.posttrain.dpo", "model_pairs"): "sampling",
}


def kind_of(frame: FrameType | None) -> Kind:
    """The kind of work the stack ending in ``frame`` does: that of its outermost function
    in `KINDS`, training if none is."""
    found: Kind = "training"
    while frame is not None:
        named = KINDS.get((frame.f_globals.get("__name__", ""), frame.f_code.co_name))
        if named is not None:
            found = named  # going outwards: the last one found is the outermost
        frame = frame.f_back
    return found


class CPULedger:
    """A context manager that splits the process's CPU time while it is entered into
    `Kind`s, by what the entering thread is doing (`kind_of`) every ``interval`` seconds.

    ``seconds`` holds the split (each kind's CPU seconds; they add up to the process's CPU
    time over the block, the ledger's own looks included).
    """

    def __init__(self, interval: float = 0.005) -> None:
        assert interval > 0
        self.interval = interval
        self.seconds: dict[Kind, float] = {"training": 0.0, "sampling": 0.0, "evaluation": 0.0}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._watched = 0
        self._last = 0.0

    def _charge(self) -> None:
        frame = sys._current_frames().get(self._watched)
        now = time.process_time()
        self.seconds[kind_of(frame)] += now - self._last
        self._last = now

    def _watch(self) -> None:
        while not self._stop.wait(self.interval):
            self._charge()

    def __enter__(self) -> CPULedger:
        self._watched = threading.get_ident()
        self._last = time.process_time()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        assert self._thread is not None
        self._stop.set()
        self._thread.join()
        self.seconds["training"] += time.process_time() - self._last  # since the last look

    def summary(self) -> str:
        """The split in a few words: "training 52 s, sampling 25 s, evaluation 6 s"."""
        return ", ".join(f"{kind} {seconds:.0f} s" for kind, seconds in self.seconds.items())
