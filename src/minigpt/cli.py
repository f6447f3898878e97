"""The command line, `python -m minigpt COMMAND ...` (train, sample, sft, dpo, chat, eval,
assets, pretrained): the parser is made from each command's settings model (pydantic), one
flag a field (`add_model_flags`; `train`'s are also `GPTConfig`'s and `TrainConfig`'s), and
each command is one small function that validates its settings and calls its stage's recipe.

`train --nproc-per-node N` starts N processes with torch's own launcher; under torchrun
(`torchrun --nproc-per-node 2 -m minigpt sft ...`) train, sft and dpo train data-parallel:
every rank trains and scores its share of each evaluation, rank 0 alone prints, scores the
final exact match and writes. A bad input is one line on stderr: exit 2 for a usage error
(argparse's, or a settings model's), 1 for any other, 130 when interrupted.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import re
import sys
import types
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import torch
from pydantic import AfterValidator, BaseModel, Field, ValidationError, model_validator
from pydantic_core import PydanticUndefined
from tqdm import tqdm

from minigpt import assets, assistant, data, parallel, pretrained
from minigpt.assistant import ASSISTANT_RECIPE
from minigpt.bpe import get_tokenizer
from minigpt.chat import chat_loop
from minigpt.checkpoint import CHECKPOINT_NAME, load_checkpoint
from minigpt.config import GPTConfig, TrainConfig
from minigpt.dpo import DPO_TRAINING, make_pairs, train_dpo
from minigpt.evals import benchmark_table, format_table
from minigpt.files import atomic_write
from minigpt.model import GPT
from minigpt.sample import Device, SampleSettings, load_model, sample_texts
from minigpt.sft import SFT_TRAINING, finetune
from minigpt.tasks import TaskSplit, exact_match
from minigpt.tokenizer import CHAT_TOKENS, KINDS, Tokenizer
from minigpt.train import METRICS_NAME, saved_settings, train, with_global_batch, write_metrics

#: A command: the flags given (only those: each settings model fills in its defaults) and
#: the command's own arguments (which `train` hands to torchrun) -> the exit status.
Command = Callable[[dict[str, Any], list[str]], int]
# What `train --resume` accepts besides --out: the run's settings are the checkpoint's.
_RESUMABLE = {"max_steps", "device", "stop_at", "progress", "threads", "compile", "out",
              "resume", "backend", "nproc_per_node", "master_port"}
_LAUNCHER_FLAGS = ("--nproc-per-node", "--master-port")
_FAILURES = (OSError, ValueError, parallel.DistributedError, assets.AssetError)


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m minigpt COMMAND ...`: returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = vars(build_parser().parse_args(argv))
    except SystemExit as exit_:  # argparse has printed the usage and the error (or --help)
        return exit_.code if isinstance(exit_.code, int) else 2
    command: Command = args.pop("command")
    world = os.environ.get("WORLD_SIZE", "1")  # a bad value is the command's error to report
    rank = os.environ.get("RANK") if world.isdecimal() and int(world) > 1 else None
    error = f"minigpt {argv[0]}: error{f' (rank {rank})' if rank else ''}:"
    try:
        return command(args, argv[1:])
    except ValidationError as err:
        print(error, explain(err), file=sys.stderr)
        return 2
    except _FAILURES as err:
        print(error, err, file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"minigpt {argv[0]}: interrupted", *[f"; resume from the last checkpoint with "
              f"--out {args['out']} --resume"] * (argv[0] == "train"), sep="", file=sys.stderr)
        return 130


def build_parser() -> argparse.ArgumentParser:
    """One sub-command a row: its function, its help, and the settings models whose fields
    are its flags (``train``'s in three groups)."""
    parser = argparse.ArgumentParser(
        prog="python -m minigpt", epilog="`python -m minigpt COMMAND --help` lists a command's "
        "options.", description="Train GPTs, sample, fine-tune, chat, evaluate, set up the book.")
    commands = parser.add_subparsers(title="commands", metavar="COMMAND", required=True)
    for name, command, help_, settings in (
            ("train", train_command, "train a GPT on a text file (defaults: nanoGPT's CPU "
             "recipe for character-level Shakespeare)", TrainFlags),
            ("sample", sample_command, "continue a prompt with a trained checkpoint",
             SampleSettings),
            ("sft", sft_command, "fine-tune a base model to answer the verifiable tasks",
             SftSettings),
            ("dpo", dpo_command, "preference-tune a fine-tuned model with DPO", DpoSettings),
            ("chat", chat_command, "talk with a fine-tuned model in the terminal",
             ChatSettings),
            ("eval", eval_command, "print the benchmark table of a model", EvalSettings),
            ("assets", assets_command, "fetch (the archive files alone) and verify the corpus "
             "and GPT-2's BPE ranks", AssetsSettings),
            ("pretrained", pretrained_command, "train (once) and verify the models the "
             "chapters share", PretrainedSettings)):
        p = commands.add_parser(name, help=help_, description=help_[0].upper() + help_[1:] + ".",
                                prog=f"python -m minigpt {name}", allow_abbrev=False,
                                argument_default=argparse.SUPPRESS)  # only the flags given
        p.set_defaults(command=command)
        if name != "train":
            add_model_flags(p, settings, exclusive=("beams", "draft") if name == "sample"
                            else ("checkpoint", "model"))
            continue
        add_model_flags(p.add_argument_group("run"), settings)
        add_model_flags(p.add_argument_group("model (default: GPTConfig.shakespeare_cpu)"),
                        GPTConfig, GPTConfig.shakespeare_cpu(65), skip=("vocab_size",))
        add_model_flags(p.add_argument_group("optimisation"), TrainConfig)
    return parser


# ------------------------------------------------------------ flags from settings models

def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_model_flags(parser: Any, model: type[BaseModel], defaults: BaseModel | None = None,
                    skip: Sequence[str] = (), exclusive: Sequence[str] = ()) -> None:
    """One flag per field of a pydantic model, `--field-name`: Literal -> choices, bool ->
    --flag/--no-flag, list[X] -> a repeatable flag, int/float/str/Path (and X | None as X);
    help from the field's description, else the class docstring's Attributes: line; the
    default shown from ``defaults`` or the field (none for a field marked
    ``derived_default``, whose default follows from other fields). The model's fields named
    in ``exclusive`` form a mutually exclusive group."""
    docs = _attribute_docs(model)
    group = parser.add_mutually_exclusive_group() if set(exclusive) & set(
        model.model_fields) else parser
    for name, field in model.model_fields.items():
        if name in skip:
            continue
        kind: Any = field.annotation
        if get_origin(kind) in (Union, types.UnionType):
            kind = next(a for a in get_args(kind) if a is not type(None))
        many = get_origin(kind) is list
        kind = get_args(kind)[0] if many else kind
        choices = get_args(kind) if get_origin(kind) is Literal else None
        default = getattr(defaults, name, field.default)
        text = field.description or docs.get(name) or name.replace("_", " ")
        derived = isinstance(field.json_schema_extra, dict) and bool(
            field.json_schema_extra.get("derived_default"))  # e.g. d_ff = 4 D: no one value
        if (default is not None and default is not PydanticUndefined and kind is not bool
                and not derived):
            text += f" (default: {default!r})"
        options: dict[str, Any] = {"help": text.replace("%", "%%")}
        if kind is bool:
            options["action"] = argparse.BooleanOptionalAction
        else:
            options |= {"type": type(choices[0]) if choices else kind, "choices": choices,
                        "metavar": None if choices else name.upper(),
                        "required": field.is_required() and defaults is None}
            options |= {"action": "append"} if many else {}
        (group if name in exclusive else parser).add_argument(flag(name), **options)


def _attribute_docs(model: type[BaseModel]) -> dict[str, str]:
    """A class docstring's "Attributes:" section: field name -> its text."""
    docs: dict[str, str] = {}
    names: list[str] = []
    for line in inspect.cleandoc(model.__doc__ or "").partition("Attributes:")[2].splitlines():
        if match := re.match(r" {4}(\w[\w, ]*):\s*(.*)", line):
            names = [n.strip() for n in match[1].split(",")]
            docs |= dict.fromkeys(names, match[2])
        elif line.startswith(" " * 8):
            docs |= {n: f"{docs[n]} {line.strip()}" for n in names}
        elif line.strip():
            break
    return docs


def explain(err: ValidationError) -> str:
    """Pydantic's errors, each field named as the flag that sets it (`name (=value)`, and
    any name with an underscore, in the messages too)."""
    fields = sorted({*GPTConfig.model_fields, *TrainConfig.model_fields}, key=len)[::-1]
    pattern = rf"\b({'|'.join(fields)})\b(?= \(=)|\b\w+_\w+\b"
    return "; ".join((f"{flag(str(e['loc'][0]))}: " if e["loc"] else "") + re.sub(
        pattern, lambda m: flag(m[0]) if m[0] in fields else m[0],
        str(e["msg"]).removeprefix("Value error, ")) for e in err.errors())


def _fields(given: dict[str, Any], model: type[BaseModel]) -> dict[str, Any]:
    return {k: v for k, v in given.items() if k in model.model_fields}


# -------------------------------------------------------------------- settings models

class TrainFlags(BaseModel):
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

    @model_validator(mode="after")
    def _bpe_size_needs_bpe(self) -> TrainFlags:
        if self.bpe_vocab_size is not None and self.tokenizer != "bpe":
            raise ValueError("--bpe-vocab-size applies only with --tokenizer bpe")
        return self


class AssetsSettings(BaseModel):
    check: bool = Field(False, description="only verify what is in the cache; exit 1 if "
                        "anything is missing")
    cache: Path | None = Field(None, description="cache folder (default: $MINIGPT_CACHE or "
                               "~/.cache/minigpt)")


def _cached_model(name: str) -> str:
    # Checked against the registry as it is when the command runs, not when this loads.
    if name not in assistant.MODELS:
        raise ValueError(f"invalid choice: {name!r} (choose from "
                         f"{', '.join(sorted(assistant.MODELS))})")
    return name


#: The name of a model set-up caches (`minigpt.assistant.MODELS`).
ModelName = Annotated[str, AfterValidator(_cached_model)]
_NAMES = ", ".join(sorted(assistant.MODELS))


class PretrainedSettings(BaseModel):
    # The cached models are trained on the CPU, the same bits on every machine: no --device.
    only: list[ModelName] | None = Field(None, description=f"only this model ({_NAMES}; "
                                         "repeatable; default: all)")
    quiet: bool = Field(False, description="no progress bar")


class ModelSettings(BaseModel):
    """A model to start from or to talk to: a run's checkpoint, or a cached model."""

    checkpoint: Path | None = Field(None, description="a run's folder (its checkpoint.pt)")
    model: ModelName | None = Field(None, description=f"a cached model ({_NAMES}; default: "
                                    "modern for sft, sft-0 otherwise)")
    device: Device = Field("cpu", description="where the model runs: cpu, cuda, cuda:1, ...")


class ChatSettings(ModelSettings):
    max_new_tokens: int = Field(32, ge=1, description="the longest answer, in tokens")


class TaskSettings(ModelSettings):
    """The model and the tasks it learns from or is scored on (`minigpt.assistant.seen_tasks`:
    made from the part of the text a base model trains on, as set-up makes the assistants')."""

    text: Path | None = Field(None, description="UTF-8 plays to make tasks from, their first "
                              f"{ASSISTANT_RECIPE.base.train_fraction:.0%} (default: "
                              "Shakespeare's)")
    n_train: int = Field(ASSISTANT_RECIPE.n_train, ge=1, description="training tasks a family")
    n_test: int = Field(ASSISTANT_RECIPE.n_test, ge=1, description="held-out tasks a family")
    task_seed: int = Field(ASSISTANT_RECIPE.task_seed, ge=0, description="seed of the tasks")


class EvalSettings(TaskSettings):
    items: int = Field(1000, ge=1, description="multiple-choice items")


class TuningSettings(TaskSettings):
    """A tuning run: where it writes, its steps, rate and seed (the defaults: fine-tuning's,
    `minigpt.sft.SFT_TRAINING`)."""

    out: Path = Field(description="folder for checkpoint.pt and metrics.json")
    steps: int = Field(SFT_TRAINING["max_steps"], ge=1, description="optimiser steps")
    lr: float = Field(SFT_TRAINING["lr"], gt=0, description="peak learning rate (a tenth "
                      "of it at the end)")
    seed: int = Field(SFT_TRAINING["seed"], ge=0, description="training seed")
    threads: int | None = Field(None, ge=1, description="torch.set_num_threads (default: "
                                "PyTorch's)")
    quiet: bool = Field(False, description="no progress bar")


class SftSettings(TuningSettings):
    """Fine-tuning: `minigpt.sft.SFT_TRAINING` with these steps, rate and seed, on
    conversations of up to ``max_turns`` questions, the fine-tuned model reading
    ``context_length`` tokens."""

    max_turns: int = Field(ASSISTANT_RECIPE.max_turns, ge=1, description="questions a "
                           "training conversation holds, at most")
    context_length: int = Field(ASSISTANT_RECIPE.context_length, ge=2, description=(
        "the context the fine-tuned model reads (a model with rotary or sinusoidal "
        "positions can read more than it was trained on)"))


class DpoSettings(TuningSettings):
    """Preference tuning: `minigpt.dpo.DPO_TRAINING` with these steps, rate and seed."""

    steps: int = Field(DPO_TRAINING["max_steps"], ge=1, description="optimiser steps")
    lr: float = Field(DPO_TRAINING["lr"], gt=0, description="peak learning rate (a tenth "
                      "of it at the end)")
    seed: int = Field(DPO_TRAINING["seed"], ge=0, description="training seed")
    beta: float = Field(ASSISTANT_RECIPE.beta, gt=0, allow_inf_nan=False,
                        description="DPO's KL weight")


# --------------------------------------------------------------------------- train

def train_command(given: dict[str, Any], argv: list[str]) -> int:
    """A new run from the flags, or (--resume) the run saved in --out with its settings;
    on this process, or on --nproc-per-node processes started by torchrun."""
    run = TrainFlags(**_fields(given, TrainFlags))
    with _threads(run.threads):  # the count before comes back after (main() from Python)
        return _train(run, given, argv)


def _train(run: TrainFlags, given: dict[str, Any], argv: list[str]) -> int:
    if run.out.exists() and not run.out.is_dir():
        raise ValueError(f"--out {run.out} exists and is not a directory")
    shape: GPTConfig | None = None  # a new run's: made with its tokenizer, from the text
    tokenizer: Tokenizer | None = None
    if run.resume:
        if extra := sorted(flag(k) for k in given if k not in _RESUMABLE):
            raise ValueError(f"--resume continues the run saved in --out with its own settings;"
                             f" drop {', '.join(extra)} (only --max-steps and --device may change)")
        shape, config, tokenizer = saved_settings(run.out, **{k: given[k] for k in (
            "max_steps", "device") if k in given})
    else:
        if run.global_batch_size is not None and "grad_accum" in given:
            raise ValueError("give --global-batch-size or --grad-accum, not both: the global "
                             "batch size sets the accumulation steps")
        make = TrainConfig.modern if run.recipe == "modern" else TrainConfig
        config = make(**_fields(given, TrainConfig))
    if run.nproc_per_node is not None and "RANK" not in os.environ:
        return launch(run, config, argv)
    text, source = None, None
    if shape is None:
        shape, tokenizer, text, source = _new_model(run, given)
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


def _new_model(run: TrainFlags, given: dict[str, Any],
               ) -> tuple[GPTConfig, Tokenizer, str, str]:
    """A new run's model settings, tokenizer, text and the text's source."""
    text, source = (data.read_text(run.text), str(run.text)) if run.text is not None else (
        data.shakespeare_text(), "minigpt.data.shakespeare_text()")
    # BPE is trained on the training split only: validation text stays unseen.
    tokenizer = get_tokenizer("bpe", data.split_text(text)[0], vocab_size=run.bpe_vocab_size
                              ) if run.tokenizer == "bpe" else get_tokenizer(run.tokenizer, text)
    make = GPTConfig.modern if run.recipe == "modern" else GPTConfig.shakespeare_cpu
    return make(tokenizer.vocab_size, **_fields(given, GPTConfig)), tokenizer, text, source


def launch(run: TrainFlags, config: TrainConfig, argv: Sequence[str]) -> int:
    """Start --nproc-per-node copies of this command with torchrun, after refusing what
    cannot work: a backend the run's device (``config.device``: a resumed run's is the
    checkpoint's unless --device is given) cannot use, a resumed run's other number of
    processes, a global batch that does not split, a port in use."""
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args
    from torch.distributed.run import run as torchrun

    n = run.nproc_per_node
    assert n is not None, "launch starts --nproc-per-node processes"
    parallel.choose_backend(torch.device(config.device), run.backend)
    if run.resume and (saved := load_checkpoint(run.out)["world_size"]) != n:
        raise ValueError(f"the run in {run.out} was trained by {saved} process(es); "
                         f"resume it with --nproc-per-node {saved}")
    if not run.resume:  # a global batch that does not split, before anything starts
        with_global_batch(config, run.global_batch_size, n)
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


# -------------------------------------------------------------- sample, assets, pretrained

def sample_command(given: dict[str, Any], argv: list[str]) -> int:
    print(("\n" + "-" * 40 + "\n").join(sample_texts(SampleSettings(**given))))
    return 0


def assets_command(given: dict[str, Any], argv: list[str]) -> int:
    s = AssetsSettings(**given)
    if not s.check:
        assets.ensure_assets(s.cache)
        return 0
    for name, path in assets.check_assets(s.cache).items():
        print(f"{name}: verified at {path}")
    return 0


def pretrained_command(given: dict[str, Any], argv: list[str]) -> int:
    s = PretrainedSettings(**given)
    for name in s.only or list(assistant.MODELS):
        model, _, info = assistant.MODELS[name](progress=not s.quiet)
        what = (f"trained in {info.metrics['total_seconds']:.0f} s" if info.built
                else "loaded and verified")
        print(f"{name} model ({model.num_parameters():,} parameters, validation loss "
              f"{info.metrics['final_val_loss']:.3f}): {what}; {info.path}")
    return 0


# ---------------------------------------------------------------- the assistant's stages

def sft_command(given: dict[str, Any], argv: list[str]) -> int:
    s = SftSettings(**given)
    # Joining the process group first gives each rank its GPU (cuda:LOCAL_RANK) to load onto.
    with _processes(s.device, s.threads) as ctx:
        base, tokenizer, name = load_any(s, "modern", ctx.device)
        if CHAT_TOKENS[0] in tokenizer.special_tokens:
            raise ValueError(f"{name} already has the chat tokens; sft starts from a base model")
        T = base.config.context_length
        if s.context_length != T and base.config.positional == "learned":
            raise ValueError(f"{name} has learned positions, weights for exactly {T} of them: "
                             f"pass --context-length {T}, or start from a model with rotary "
                             "positions (--model modern) to read a longer context")
        tasks = _tasks(s)
        result, chat = finetune(base, tokenizer, tasks.train, tasks.test,  # type: ignore[arg-type]
                                _config(SFT_TRAINING, s), max_turns=s.max_turns,
                                context_length=s.context_length, out_dir=s.out,
                                progress=not s.quiet, ctx=ctx)
        if ctx.is_main:
            _write(s.out, result.metrics | {"exact_match": exact_match(
                result.model, chat, tasks.test)})
    return 0


def dpo_command(given: dict[str, Any], argv: list[str]) -> int:
    s = DpoSettings(**given)
    # As sft: the policy, and the frozen reference copied from it, on this rank's GPU.
    with _processes(s.device, s.threads) as ctx:
        policy, tokenizer, name = load_any(s, "sft-0", ctx.device)
        require_chat(tokenizer, name)
        tasks = _tasks(s)
        result, _ = train_dpo(policy, tokenizer, make_pairs(tasks.train, seed=0),
                              make_pairs(tasks.test, seed=1), _config(DPO_TRAINING, s),
                              beta=s.beta, out_dir=s.out, progress=not s.quiet, ctx=ctx)
        if ctx.is_main:
            _write(s.out, result.metrics | {"beta": s.beta, "exact_match": exact_match(
                result.model, tokenizer, tasks.test)})
    return 0


def eval_command(given: dict[str, Any], argv: list[str]) -> int:
    s = EvalSettings(**given)
    model, tokenizer, name = load_any(s, "sft-0")
    text = _text(s)
    tasks = _tasks(s, text)
    print(format_table(benchmark_table({name: (model, tokenizer)}, text, n_items=s.items,
                                       tasks=tasks.test, shots=tasks.train)))
    return 0


def chat_command(given: dict[str, Any], argv: list[str]) -> int:
    s = ChatSettings(**given)
    model, tokenizer, name = load_any(s, "sft-0")
    require_chat(tokenizer, name)
    print(f"chatting with {s.checkpoint or name} (context {model.config.context_length} "
          "tokens; the oldest turns are dropped when the conversation outgrows it); end with "
          "Ctrl-D or Ctrl-C")
    chat_loop(model, tokenizer, sys.stdin, sys.stdout, max_new_tokens=s.max_new_tokens)
    return 0


def load_any(s: ModelSettings, default: str, device: torch.device | str | None = None,
             ) -> tuple[GPT, Tokenizer, str]:
    """The model of ``--checkpoint`` or ``--model`` (``default`` if neither) on ``device``
    (default: ``--device``; a rank of a process group passes its own), its tokenizer and a
    name for it."""
    device = s.device if device is None else device
    if s.checkpoint is not None:
        model, tokenizer, _ = load_model(s.checkpoint, device=device)
        return model, tokenizer, s.checkpoint.name or str(s.checkpoint)
    name = s.model or default
    model, tokenizer, _ = assistant.MODELS[name]()
    return model.to(device), tokenizer, name


def require_chat(tokenizer: Tokenizer, where: str) -> None:
    """Refuse a model whose tokenizer lacks the chat tokens."""
    if missing := [t for t in CHAT_TOKENS if t not in tokenizer.special_tokens]:
        raise ValueError(f"{where} has no chat tokens ({', '.join(missing)} missing): it is a "
                         "base model; fine-tune it first with `python -m minigpt sft`")


def _text(s: TaskSettings) -> str:
    return data.shakespeare_text() if s.text is None else data.read_text(s.text)


def _tasks(s: TaskSettings, text: str | None = None) -> TaskSplit:
    """The tasks of ``--text`` (or ``text``, read from it already), made as the assistants'
    are (`minigpt.assistant.seen_tasks`): from the part of the text a base model trained on."""
    return assistant.seen_tasks(_text(s) if text is None else text, s.n_train, s.n_test,
                                seed=s.task_seed)


def _config(recipe: dict[str, Any], s: TuningSettings) -> TrainConfig:
    """The recipe with the command's steps, rate (a tenth of it the floor), seed and
    device; a run shorter than the warm-up warms up over the whole run."""
    return TrainConfig(**(recipe | dict(
        max_steps=s.steps, lr=s.lr, min_lr=s.lr / 10, seed=s.seed, device=s.device,
        warmup_steps=min(recipe["warmup_steps"], s.steps))))


@contextmanager
def _processes(device: str, threads: int | None = None) -> Iterator[parallel.DistContext]:
    """This process's place in the run (a process group if torchrun started it), shut down
    after; with ``threads``, that many torch threads for the run (the count before comes
    back after)."""
    # Only set-up pins the thread count (`pretrained.threads`), for cached weights that are
    # the same bits on every run; a user's run keeps PyTorch's default (every core; one a
    # rank under torchrun, which sets OMP_NUM_THREADS) unless --threads says otherwise.
    with _threads(threads):
        ctx = parallel.init_distributed(device)
        try:
            yield ctx
        finally:
            parallel.shutdown(ctx)


def _threads(n: int | None) -> AbstractContextManager[None]:
    """With ``n``, that many torch threads for the block (the count before comes back
    after)."""
    return nullcontext() if n is None else pretrained.threads(n)


def _write(out: Path, metrics: dict[str, Any]) -> None:
    atomic_write(out / METRICS_NAME, (json.dumps(metrics, indent=1) + "\n").encode())
    print(json.dumps(metrics["exact_match"]))
    print(f"wrote {out / CHECKPOINT_NAME} and {out / METRICS_NAME}")
