"""Time minigpt's training step against nanoGPT's on nanoGPT's CPU recipe, interleaved.

    .venv/bin/python tools/bench_nanogpt.py NANOGPT_DIR DATA_TXT [--rounds 5] [--steps 600]
        [--threads N] [--seed 1337] [--vary-seed] [--minigpt-args="--bf16"]

NANOGPT_DIR is a checkout of nanoGPT whose `data/shakespeare_char/` holds `train.bin`,
`val.bin` and `meta.pkl` made by its `prepare.py` from DATA_TXT (the Tiny Shakespeare
text); nothing of nanoGPT is part of this project, it is run as an external command.
Both programs train a model of the same shape (character level, 4 layers, 4 heads,
D = 128, T = 64, batch 12, no dropout; nanoGPT's train.py leaves out the biases, minigpt
keeps GPT-2's) with the same schedule, in alternation (A B, B A, ...) so
that a change in the machine's load hits both. Each round reports each program's median
step time (nanoGPT's logged per-iteration times from iteration 1 on; minigpt's
`median_step_ms`) and their ratio; the summary gives the median ratio over the rounds.
Each round also scores both trained models on the whole validation split (every token
predicted once, from non-overlapping windows of 64): run with --steps 2000 for the
recipe's length, and --vary-seed to train round r with seed + r (nanoGPT seeds torch with
1337 and has no option for it: its train.py is then started with `torch.manual_seed`
shifted by seed - 1337). --threads N sets OMP_NUM_THREADS=N for both programs; without
it both use PyTorch's default (one thread per core). --minigpt-args adds options to
minigpt's command only (e.g. --bf16, which nanoGPT's CPU recipe does not use: a different
recipe, so not a like-for-like comparison).

--time-to-loss compares recipes instead of steps: nanoGPT's CPU recipe as above (2,000
steps; its checkpoint every --eval-every steps is kept and scored afterwards on the whole
validation split) against minigpt's modern recipe (`--recipe modern`, whole-split
evaluation every --eval-every steps, `--eval-full`), each round in alternation. Training
time excludes evaluation for both: minigpt's is the sum of its step times; nanoGPT's is the
sum of its logged iteration times, where an iteration that evaluated and saved is counted
at the median iteration time. Each round reports the time minigpt's run takes to reach
nanoGPT's final whole-split loss, as a fraction of nanoGPT's training time, and minigpt's
loss by nanoGPT's full training time: that of its last evaluation made within it. The
default runs are a short one of 110 steps (for the time to the loss) and a "fit" one, sized
in each round from the short run's pace to end within 95 % of nanoGPT's training time, so
that its schedule's cool-down is over by then.

    .venv/bin/python tools/bench_nanogpt.py NANOGPT_DIR DATA_TXT --time-to-loss \
        --rounds 3 --threads 1 [--clock cpu] [--minigpt-steps 110,fit] \
        [--minigpt-args="--batch-size 32"]

--clock cpu times both programs' training by their process's CPU time (both programs' own
step timers are pointed at `time.process_time`): with one thread each, that is the wall
time a quiet machine would show, and the load of other programs on a shared machine
(which lengthens wall time by whatever share of a core they take) barely moves it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from minigpt.train import METRICS_NAME

ROOT = Path(__file__).resolve().parents[1]
SHAPE = {"n_layer": 4, "n_head": 4, "n_embd": 128, "block_size": 64, "batch_size": 12}


def nanogpt(folder: Path, steps: int, seed: int, out: Path) -> tuple[float, list[float]]:
    """Median ms per iteration of nanoGPT's train.py, and its logged losses."""
    start = ["train.py"]
    if seed != 1337:  # its train.py calls torch.manual_seed(1337): shift that seed
        start = ["-c", "import runpy, torch; seed = torch.manual_seed; "
                 f"torch.manual_seed = lambda s: seed(s + {seed - 1337}); "
                 "runpy.run_path('train.py', run_name='__main__')"]
    cmd = [sys.executable, *start, "config/train_shakespeare_char.py", "--device=cpu",
           "--compile=False", "--eval_iters=20", "--log_interval=1", f"--max_iters={steps}",
           "--lr_decay_iters=2000", "--dropout=0.0", f"--eval_interval={steps}",
           f"--out_dir={out}", "--always_save_checkpoint=True",
           *(f"--{k}={v}" for k, v in SHAPE.items())]
    log = subprocess.run(cmd, cwd=folder, capture_output=True, text=True, check=True,
                         env=_env({})).stdout
    times = [float(t) for t in re.findall(r"^iter (?:[1-9]\d*): .*time ([\d.]+)ms", log,
                                          flags=re.M)]
    losses = [float(x) for x in re.findall(r"val loss ([\d.]+)", log)]
    return statistics.median(times), losses


def minigpt(text: Path, steps: int, seed: int, out: Path,
            extra: list[str]) -> tuple[float, dict[str, float]]:
    """Median ms per step of `python -m minigpt train`, and its metrics."""
    cmd = [sys.executable, "-m", "minigpt", "train", "--text", str(text), "--tokenizer",
           "char", "--n-layers", "4", "--n-heads", "4", "--d-model", "128",
           "--context-length", "64", "--batch-size", "12", f"--max-steps={steps}",
           "--lr", "1e-3", "--min-lr", "1e-4", "--warmup-steps", "100",
           "--decay-steps", "2000", "--weight-decay", "0.1", "--beta2", "0.99",
           "--grad-clip", "1.0", "--dropout", "0.0", f"--eval-interval={steps}",
           "--eval-steps", "20", "--seed", str(seed), "--out", str(out), "--no-progress",
           *extra]
    subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True, env=_env({}))
    metrics = json.loads((out / METRICS_NAME).read_text())
    return float(metrics["median_step_ms"]), metrics


def nanogpt_full_loss(folder: Path, out: Path, name: str = "ckpt.pt") -> float:
    """nanoGPT's checkpoint scored like `minigpt.losses.full_loss`: mean loss over
    consecutive 64-token windows of its val.bin. nanoGPT's own model code is imported from
    its checkout, in a child process."""
    script = f"""
import sys, numpy as np, torch, torch.nn.functional as F
sys.path.insert(0, {str(folder)!r})
from model import GPT, GPTConfig
ck = torch.load({str(out / name)!r}, map_location="cpu", weights_only=False)
model = GPT(GPTConfig(**ck["model_args"]))
model.load_state_dict({{k.removeprefix("_orig_mod."): v for k, v in ck["model"].items()}})
model.eval()
data = np.fromfile({str(folder / "data/shakespeare_char/val.bin")!r}, dtype=np.uint16)
T = 64
n = (len(data) - 1) // T
ids = torch.from_numpy(data[: n * T + 1].astype(np.int64))
x, y = ids[:-1].view(n, T), ids[1:].view(n, T)
total = 0.0
with torch.no_grad():
    for k in range(0, n, 32):
        logits, _ = model(x[k:k + 32], y[k:k + 32])
        total += F.cross_entropy(logits.view(-1, logits.shape[-1]), y[k:k + 32].reshape(-1),
                                 reduction="sum").item()
print(total / (n * T))
"""
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         check=True, env=_env({}))
    return float(run.stdout.strip().splitlines()[-1])


def nanogpt_curve(folder: Path, seed: int, out: Path, every: int,
                  steps: int = 2000) -> list[tuple[int, float, float]]:
    """Run nanoGPT's recipe keeping a checkpoint every ``every`` steps; return (step,
    training seconds, whole-split validation loss) at each of them."""
    keep = (CLOCK["nanogpt"] + "import runpy, torch; save = torch.save; "
            "torch.save = lambda obj, f, *a, **k: save(obj, str(f).replace("
            "'ckpt.pt', 'ckpt-%d.pt' % obj['iter_num']), *a, **k); "
            f"seed = torch.manual_seed; torch.manual_seed = lambda s: seed(s + {seed - 1337}); "
            "runpy.run_path('train.py', run_name='__main__')")
    cmd = [sys.executable, "-c", keep, "config/train_shakespeare_char.py", "--device=cpu",
           "--compile=False", "--eval_iters=20", "--log_interval=1", f"--max_iters={steps}",
           "--lr_decay_iters=2000", "--dropout=0.0", f"--eval_interval={every}",
           f"--out_dir={out}", "--always_save_checkpoint=True",
           *(f"--{k}={v}" for k, v in SHAPE.items())]
    log = subprocess.run(cmd, cwd=folder, capture_output=True, text=True, check=True,
                         env=_env({})).stdout
    ms = {int(i): float(t) for i, t in re.findall(r"^iter (\d+): .*time ([\d.]+)ms", log,
                                                   flags=re.M)}
    typical = statistics.median(ms.values())
    # iteration i's time includes the evaluation and the save made before its step
    step_ms = [typical if i % every == 0 else ms[i] for i in range(steps)]
    curve = []
    for k in range(every, steps + 1, every):
        curve.append((k, sum(step_ms[:k]) / 1000,
                      nanogpt_full_loss(folder, out, f"ckpt-{k}.pt")))
    return curve


def minigpt_curve(text: Path, steps: int, seed: int, out: Path, every: int,
                  extra: list[str]) -> list[tuple[int, float, float]]:
    """Run `python -m minigpt train --recipe modern`; return (step, training seconds,
    whole-split validation loss) at each evaluation."""
    start = ["-c", CLOCK["minigpt"] + "import runpy; runpy.run_module('minigpt', "
             "run_name='__main__', alter_sys=True)"]
    cmd = [sys.executable, *start, "train", "--text", str(text), "--tokenizer",
           "char", "--recipe", "modern", f"--max-steps={steps}", "--eval-full",
           f"--eval-interval={every}", "--eval-steps", "1", "--seed", str(seed),
           "--out", str(out), "--no-progress", *extra]
    subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True, env=_env({}))
    history = json.loads((out / "history.json").read_text())
    seconds = [0.0]
    for ms in history["step_ms"]:
        seconds.append(seconds[-1] + ms / 1000)
    return [(k, seconds[k], loss) for k, loss in zip(history["eval_step"],
                                                     history["val_loss"], strict=True)]


def time_to(curve: list[tuple[int, float, float]], target: float) -> float | None:
    """Training seconds at the first evaluation whose loss is at or below ``target``."""
    return next((t for _, t, loss in curve if loss <= target), None)


def loss_at(curve: list[tuple[int, float, float]], seconds: float) -> float | None:
    """The loss of the last evaluation made within ``seconds`` of training (None if none
    was). A run that stopped earlier counts with its final loss: it had less time, so
    the comparison can only be unfair to it."""
    made = [loss for _, t, loss in curve if t <= seconds]
    return made[-1] if made else None


def fit_steps(curve: list[tuple[int, float, float]], seconds: float, margin: float = 0.95,
              every: int = 1) -> int:
    """Steps for a run that ends within ``margin`` of ``seconds``, from the pace of the run
    whose ``curve`` is given (its training seconds per step), rounded down to ``every``."""
    steps, spent = curve[-1][0], curve[-1][1]
    if steps <= 0 or spent <= 0:
        raise ValueError(f"cannot read a pace from a curve ending at step {steps}, "
                         f"{spent} s")
    fitted = int(margin * seconds / (spent / steps)) // every * every
    if fitted < every:
        raise ValueError(f"{seconds:.1f} s fit fewer than {every} steps at "
                         f"{spent / steps * 1000:.0f} ms per step")
    return fitted


def time_to_loss(args: argparse.Namespace) -> int:
    """Each round: nanoGPT's run and minigpt's runs of each --minigpt-steps, in alternation,
    then (with ``fit`` in --minigpt-steps) a minigpt run sized from the first one's pace to
    end within nanoGPT's training time of that round. A run's time to nanoGPT's final loss
    counts if it reaches it; its loss at nanoGPT's full training time is that of its last
    evaluation made by then."""
    fixed = [int(n) for n in args.minigpt_steps.split(",") if n != "fit"]
    fit = "fit" in args.minigpt_steps.split(",")
    if not fixed:
        raise SystemExit("--minigpt-steps needs at least one number of steps (a 'fit' run "
                         "takes its pace from the first)")
    ratios: list[float] = []
    gaps: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            seed = args.seed + r if args.vary_seed else args.seed
            names = ["nanogpt", *(f"minigpt-{n}" for n in fixed)]
            curves = {}

            for name in names if r % 2 == 0 else names[::-1]:
                curves[name] = _curve(args, name, seed, Path(tmp, f"{name}-{r}"))
            _, nano_s, target = curves["nanogpt"][-1]
            if fit:
                names.append(f"minigpt-{fit_steps(curves[names[1]], nano_s)}")
                curves[names[-1]] = _curve(args, names[-1], seed, Path(tmp, f"{names[-1]}-{r}"))
            print(f"round {r + 1} (seed {seed}): nanoGPT trains {nano_s:.1f} s to "
                  f"{target:.4f}", flush=True)
            print("  nanoGPT      " + _curve_text(curves["nanogpt"]), flush=True)
            reached, below = [], []
            for name in names[1:]:
                curve, n = curves[name], int(name.split("-")[1])
                when, later = time_to(curve, target), loss_at(curve, nano_s)
                if when is not None:
                    reached.append(when / nano_s)
                if later is not None:
                    below.append(target - later)
                print(f"  minigpt {n:4d} " + _curve_text(curve) + "; reaches it "
                      + (f"at {when:.1f} s, {when / nano_s:.3f}x" if when is not None
                         else "never")
                      + (f"; {target - later:.3f} lower by {nano_s:.0f} s"
                         if later is not None else ""), flush=True)
            if reached:
                ratios.append(min(reached))
            if below:
                gaps.append(max(below))
    if ratios:
        print(f"median time to nanoGPT's final loss over {len(ratios)} rounds: "
              f"{statistics.median(ratios):.3f}x of its training time (min {min(ratios):.3f}, "
              f"max {max(ratios):.3f})")
    if gaps:
        print(f"median loss below nanoGPT's by its full training time: "
              f"{statistics.median(gaps):.3f} nats over {len(gaps)} rounds (min "
              f"{min(gaps):.3f}, max {max(gaps):.3f})")
    return 0


def _curve(args: argparse.Namespace, name: str, seed: int,
           out: Path) -> list[tuple[int, float, float]]:
    """The curve of run ``name``: "nanogpt", or "minigpt-<steps>"."""
    if name == "nanogpt":
        return nanogpt_curve(args.nanogpt, seed, out, args.eval_every)
    return minigpt_curve(args.text, int(name.split("-")[1]), seed, out, args.eval_every,
                         args.minigpt_args.split())


def _curve_text(curve: list[tuple[int, float, float]]) -> str:
    return " ".join(f"{k}:{t:.0f}s:{loss:.3f}" for k, t, loss in curve)


THREADS: dict[str, str] = {}  # OMP_NUM_THREADS for both programs, when --threads is given
# With --clock cpu, each program's own step timer reads its process's CPU time instead of
# the wall clock (nanoGPT times iterations with time.time, minigpt with time.perf_counter).
CLOCK: dict[str, str] = {"nanogpt": "", "minigpt": ""}
CPU_CLOCK = {"nanogpt": "import time; time.time = time.process_time; ",
             "minigpt": "import time; time.perf_counter = time.process_time; "}


def _env(extra: dict[str, str]) -> dict[str, str]:
    return dict(os.environ) | THREADS | extra


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("nanogpt", type=Path, help="a nanoGPT checkout with prepared data")
    p.add_argument("text", type=Path, help="the Tiny Shakespeare text (input.txt)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--vary-seed", action="store_true", help="round r trains with seed + r")
    p.add_argument("--threads", type=int, help="OMP_NUM_THREADS for both (default: torch's)")
    p.add_argument("--minigpt-args", default="",
                   help="more options for minigpt's train, e.g. --minigpt-args=--bf16")
    p.add_argument("--time-to-loss", action="store_true",
                   help="compare the modern recipe's time to nanoGPT's final loss")
    p.add_argument("--minigpt-steps", default="110,fit",
                   help="with --time-to-loss: steps of minigpt's runs, comma-separated "
                   "(a short run sized for the time to the loss; 'fit': a run sized from "
                   "the first one's pace to end within nanoGPT's training time)")
    p.add_argument("--eval-every", type=int, default=100,
                   help="with --time-to-loss: steps between whole-split evaluations")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="with --time-to-loss: time training by the wall clock, or by each "
                   "process's CPU time (with --threads 1, what a quiet machine's wall clock "
                   "would show; another program's load on a shared machine barely moves it)")
    args = p.parse_args()
    if args.clock == "cpu":
        CLOCK.update(CPU_CLOCK)
    if args.threads is not None:
        THREADS["OMP_NUM_THREADS"] = str(args.threads)
    if not (args.nanogpt / "data" / "shakespeare_char" / "train.bin").is_file():
        p.error(f"{args.nanogpt}/data/shakespeare_char/train.bin is missing: run its "
                "prepare.py with input.txt copied beside it")
    if args.time_to_loss:
        return time_to_loss(args)
    ratios: list[float] = []
    times: dict[str, list[float]] = {"minigpt": [], "nanogpt": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            order = ("minigpt", "nanogpt") if r % 2 == 0 else ("nanogpt", "minigpt")
            ms: dict[str, float] = {}
            seed = args.seed + r if args.vary_seed else args.seed
            for name in order:
                out = Path(tmp, f"{name}-{r}")
                if name == "minigpt":
                    ms[name], m = minigpt(args.text, args.steps, seed, out,
                                          args.minigpt_args.split())
                    full, threads = m["final_val_loss_full"], m["torch_threads"]
                else:
                    ms[name], _ = nanogpt(args.nanogpt, args.steps, seed, out)
                    nano_full = nanogpt_full_loss(args.nanogpt, out)
                times[name].append(ms[name])
            ratios.append(ms["minigpt"] / ms["nanogpt"])
            print(f"round {r + 1} (seed {seed}, {threads} threads): minigpt "
                  f"{ms['minigpt']:.1f} ms/step, nanoGPT "
                  f"{ms['nanogpt']:.1f} ms/step, ratio {ratios[-1]:.3f}; whole-split "
                  f"validation loss minigpt {full:.4f}, nanoGPT {nano_full:.4f}",
                  flush=True)
    print(f"median ms/step over {args.rounds} rounds: minigpt "
          f"{statistics.median(times['minigpt']):.1f}, nanoGPT "
          f"{statistics.median(times['nanogpt']):.1f}")
    print(f"median ratio minigpt / nanoGPT over {args.rounds} rounds: "
          f"{statistics.median(ratios):.3f} (min {min(ratios):.3f}, max {max(ratios):.3f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
