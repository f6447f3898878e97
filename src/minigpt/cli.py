"""Command line: `python -m minigpt COMMAND ...` (chat, sft, dpo, eval: `minigpt.assistant_cli`).

`train` has a flag per field of `GPTConfig` and `TrainConfig` (`minigpt.flags`); `--recipe
modern` starts from the modern layout and training; `--nproc-per-node N` starts N processes
with `torch.distributed.run`. A bad input is one line on stderr: exit 2 for a usage error,
1 for any other, 130 when interrupted."""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import BaseModel, Field, ValidationError
from tqdm import tqdm

from minigpt import assets, assistant, assistant_cli, data, parallel
from minigpt.checkpoint import CHECKPOINT_NAME, load_checkpoint
from minigpt.config import GPTConfig, TrainConfig
from minigpt.flags import add_model_flags, flag
from minigpt.sample import SampleSettings, sample_texts
from minigpt.tokenizer import KINDS, get_tokenizer
from minigpt.train import METRICS_NAME, saved_settings, train, with_global_batch, write_metrics

# What `--resume` accepts besides --out: the run's settings are the checkpoint's.
_RESUMABLE = {"max_steps", "device", "stop_at", "progress", "threads", "compile", "out",
              "resume", "backend", "nproc_per_node", "master_port"}
_LAUNCHER_FLAGS = ("--nproc-per-node", "--master-port")
_FAILURES = (OSError, ValueError, parallel.DistributedError, assets.AssetError)


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m minigpt COMMAND ...`: returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exit_:  # argparse has printed the usage and the error (or --help)
        return exit_.code if isinstance(exit_.code, int) else 2
    world = os.environ.get("WORLD_SIZE", "1")  # a bad value is the command's error to report
    rank = os.environ.get("RANK") if world.isdecimal() and int(world) > 1 else None
    error = f"minigpt {argv[0]}: error{f' (rank {rank})' if rank else ''}:"
    try:
        return int(args.handler(args, argv[1:]))  # its own flags, for torchrun
    except ValidationError as err:
        print(error, _explain(err), file=sys.stderr)
        return 2
    except _FAILURES as err:
        print(error, err, file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"minigpt {argv[0]}: interrupted", *[f"; resume from the last checkpoint with "
              f"--out {args.out} --resume"] * (argv[0] == "train"), sep="", file=sys.stderr)
        return 130


class RunFlags(BaseModel):
    """How `train` runs, besides the model (`GPTConfig`) and the optimisation (`TrainConfig`)."""

    out: Path = Field(description="folder of checkpoint.pt, metrics.json, history.json, ids")
    text: Path | None = Field(None, description="UTF-8 text (default: Shakespeare's plays)")
    tokenizer: Literal[KINDS] = Field("char", description="bpe: trained on the train split")  # type: ignore[valid-type]
    bpe_vocab_size: int | None = Field(None, ge=2, description="V of --tokenizer bpe (512)")
    resume: bool = Field(False, description="continue the run in --out, with its settings")
    stop_at: int | None = Field(None, ge=0, description="stop (and checkpoint) at this step")
    threads: int | None = Field(None, ge=1, description="torch.set_num_threads")
    compile: bool = Field(False, description="torch.compile the steps (needs a C++ compiler)")
    progress: bool = Field(True, description="show a progress bar")
    nproc_per_node: int | None = Field(None, ge=1, description="processes to start (torchrun)")
    master_port: int | None = Field(None, ge=1, le=65535, description="their port on 127.0.0.1")
    backend: Literal["gloo", "nccl"] | None = Field(None, description="default: nccl on CUDA")
    global_batch_size: int | None = Field(None, ge=1, description="sets --grad-accum")
    recipe: Literal["gpt2", "modern"] = Field("gpt2", description="modern: the modern GPT's "
                                              "layout and training (minigpt.config.MODERN_LAYOUT, "
                                              "minigpt.config.MODERN_TRAINING) under the flags")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m minigpt", epilog="`python -m minigpt COMMAND --help` lists a command's "
        "options.", description="Train GPTs, sample, fine-tune, chat, evaluate, set up the book.")
    commands = parser.add_subparsers(title="commands", metavar="COMMAND", required=True)
    for name, handler, help_ in (
            ("train", _train, "train a GPT on a text file (defaults: nanoGPT's CPU recipe "
             "for character-level Shakespeare)"),
            ("sample", _sample, "continue a prompt with a trained checkpoint"),
            ("assets", _assets, "fetch (the archive files alone) and verify the corpus and "
             "GPT-2's BPE ranks"),
            ("pretrained", _pretrained, "train (once) and verify the models the chapters share")):
        p = commands.add_parser(name, help=help_, description=help_[0].upper() + help_[1:] + ".",
                                prog=f"python -m minigpt {name}", allow_abbrev=False,
                                argument_default=argparse.SUPPRESS)  # only the flags given
        p.set_defaults(handler=handler)
        if name == "train":
            add_model_flags(p.add_argument_group("run"), RunFlags)
            add_model_flags(p.add_argument_group("model (default: GPTConfig.shakespeare_cpu)"),
                            GPTConfig, GPTConfig.shakespeare_cpu(65), skip=("vocab_size",))
            add_model_flags(p.add_argument_group("optimisation"), TrainConfig)
        elif name == "sample":
            add_model_flags(p, SampleSettings, exclusive=("beams", "draft"))
        elif name == "assets":
            p.add_argument("--check", action="store_true", help="only verify what is in the "
                           "cache; exit 1 if anything is missing")
            p.add_argument("--cache", type=Path, help="cache folder (default: $MINIGPT_CACHE "
                           "or ~/.cache/minigpt)")
        else:
            p.add_argument("--only", choices=sorted(assistant.MODELS), action="append",
                           help="only this model (repeatable; default: all)")
            p.add_argument("--quiet", action="store_true", help="no progress bar")
    assistant_cli.add_commands(commands)
    return parser


def _explain(err: ValidationError) -> str:
    """Pydantic's errors, each field named as the flag that sets it (`name (=value)`, and
    any name with an underscore, in the messages too)."""
    fields = sorted({*GPTConfig.model_fields, *TrainConfig.model_fields}, key=len)[::-1]
    pattern = rf"\b({'|'.join(fields)})\b(?= \(=)|\b\w+_\w+\b"
    return "; ".join((f"{flag(str(e['loc'][0]))}: " if e["loc"] else "") + re.sub(
        pattern, lambda m: flag(m[0]) if m[0] in fields else m[0],
        str(e["msg"]).removeprefix("Value error, ")) for e in err.errors())


def _train(ns: argparse.Namespace, argv: list[str]) -> int:
    given = {k: v for k, v in vars(ns).items() if k != "handler"}
    run = RunFlags(**{k: v for k, v in given.items() if k in RunFlags.model_fields})
    if run.threads is not None:
        torch.set_num_threads(run.threads)
    if run.out.exists() and not run.out.is_dir():
        raise ValueError(f"--out {run.out} exists and is not a directory")
    if run.nproc_per_node is not None and "RANK" not in os.environ:
        return _launch(run, given, argv)
    if run.resume:
        if extra := sorted(flag(k) for k in given if k not in _RESUMABLE):
            raise ValueError(f"--resume continues the run saved in --out with its own settings;"
                             f" drop {', '.join(extra)} (only --max-steps and --device may change)")
        text = source = None
        shape, config, tokenizer = saved_settings(run.out, **{k: given[k] for k in (
            "max_steps", "device") if k in given})
    else:
        shape, config, tokenizer, text, source = _new_settings(run, given)
    ctx = parallel.init_distributed(config.device, run.backend)
    try:
        config = with_global_batch(config, run.global_batch_size, ctx.world_size)
        if text is not None and tokenizer is not None and ctx.is_main:
            data.prepare_dataset(text, tokenizer, run.out)
        parallel.barrier(ctx)  # the id files exist before any rank reads them
        train_ids, val_ids = (data.load_ids(run.out / f"{s}.bin") for s in ("train", "val"))
        result = train(shape, config, train_ids, val_ids, tokenizer=tokenizer, out_dir=run.out,
                       resume=run.resume, stop_at=run.stop_at, ctx=ctx, compile=run.compile,
                       progress=run.progress, log=tqdm.write if ctx.is_main else None)
        if ctx.is_main:
            m = write_metrics(run.out, result, config, val_ids, text=source, train_tokens=len(
                train_ids), tokenizer=tokenizer and tokenizer.name)
            print(f"step {m['steps']}: val loss {m['final_val_loss']:.4f} (whole split: "
                  f"{m['final_val_loss_full']:.4f}); " if m["final_val_loss"] is not None else "",
                  f"median {m['median_step_ms']:.1f} ms/step, {m['tokens_per_second']:,.0f} "
                  "tokens/s" if m["median_step_ms"] is not None else "no steps run",
                  f"; wrote {run.out / CHECKPOINT_NAME} and {run.out / METRICS_NAME}", sep="")
    finally:
        parallel.shutdown(ctx)
    return 0


def _new_settings(run: RunFlags, given: dict[str, Any]) -> tuple[Any, ...]:
    if run.bpe_vocab_size is not None and run.tokenizer != "bpe":
        raise ValueError("--bpe-vocab-size applies only with --tokenizer bpe")
    if run.global_batch_size is not None and "grad_accum" in given:
        raise ValueError("give --global-batch-size or --grad-accum, not both: the global "
                         "batch size sets the accumulation steps")
    config = _train_config(run, given)
    text, source = (data.read_text(run.text), str(run.text)) if run.text is not None else (
        data.shakespeare_text(), "minigpt.data.shakespeare_text()")
    # BPE is trained on the training split only: validation text stays unseen.
    tokenizer = get_tokenizer("bpe", data.split_text(text)[0], vocab_size=run.bpe_vocab_size
                              ) if run.tokenizer == "bpe" else get_tokenizer(run.tokenizer, text)
    shape = {k: v for k, v in given.items() if k in GPTConfig.model_fields}
    make = GPTConfig.modern if run.recipe == "modern" else GPTConfig.shakespeare_cpu
    return make(tokenizer.vocab_size, **shape), config, tokenizer, text, source


def _train_config(run: RunFlags, given: dict[str, Any]) -> TrainConfig:
    make = TrainConfig.modern if run.recipe == "modern" else TrainConfig
    return make(**{k: v for k, v in given.items() if k in TrainConfig.model_fields})


def _launch(run: RunFlags, given: dict[str, Any], argv: Sequence[str]) -> int:
    """Start --nproc-per-node copies of this command with torchrun, after refusing bad settings."""
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args
    from torch.distributed.run import run as torchrun

    n = run.nproc_per_node
    parallel.choose_backend(torch.device(given.get("device", "cpu")), run.backend)
    if run.resume and (saved := load_checkpoint(run.out)["world_size"]) != n:
        raise ValueError(f"the run in {run.out} was trained by {saved} process(es); "
                         f"resume it with --nproc-per-node {saved}")
    if not run.resume:  # a global batch that does not split, before anything starts
        with_global_batch(_train_config(run, given), run.global_batch_size, n or 1)
    where = ["--standalone"]  # torchrun picks a free port
    if run.master_port is not None:
        parallel.check_port(run.master_port)
        where = ["--master-addr=127.0.0.1", f"--master-port={run.master_port}"]
    rest = [a for i, a in enumerate(argv) if not a.startswith(_LAUNCHER_FLAGS)
            and not (i and argv[i - 1] in _LAUNCHER_FLAGS)]
    try:
        torchrun(parse_args([*where, f"--nproc-per-node={n}", "-m", "minigpt", "train",  # type: ignore[no-untyped-call]
                             *rest]))
    except ChildFailedError as err:  # each rank has said what went wrong on its stderr
        return max(1, err.get_first_failure()[1].exitcode)
    except SignalException:  # Ctrl-C: torchrun has stopped the ranks
        raise KeyboardInterrupt from None
    return 0


def _sample(ns: argparse.Namespace, argv: list[str]) -> int:
    texts = sample_texts(SampleSettings(**{k: v for k, v in vars(ns).items() if k != "handler"}))
    print(("\n" + "-" * 40 + "\n").join(texts))
    return 0


def _assets(args: argparse.Namespace, argv: list[str]) -> int:
    if not getattr(args, "check", False):
        assets.ensure_assets(getattr(args, "cache", None))
        return 0
    for name, path in assets.check_assets(getattr(args, "cache", None)).items():
        print(f"{name}: verified at {path}")
    return 0


def _pretrained(args: argparse.Namespace, argv: list[str]) -> int:
    for name in getattr(args, "only", None) or list(assistant.MODELS):
        model, _, info = assistant.MODELS[name](progress=not getattr(args, "quiet", False))
        what = (f"trained in {info.metrics['total_seconds']:.0f} s" if info.built
                else "loaded and verified")
        print(f"{name} model ({model.num_parameters():,} parameters, validation loss "
              f"{info.metrics['final_val_loss']:.3f}): {what}; {info.path}")
    return 0
