"""The command line, `python -m minigpt COMMAND ...`: train a GPT on a text (train), continue
a prompt (sample), make an assistant of a base model (sft, dpo), continue it on rhymes with
rewards (rl), talk to it (chat), benchmark it (eval), and set up the book (assets,
pretrained). `train --nproc-per-node N` starts N processes with torchrun; under torchrun,
train, sft and dpo train data-parallel and rank 0 alone writes.

Each command is a section below: its flags, then the function that runs it, which makes the
package's settings from the flags. A settings field has one flag, made from the field
(`add_fields`: its name, its rules, its text in the settings' docstring as its help).

Errors: every value is checked as argparse reads it, by its flag's type (a path too: a file
to read exists, a folder to write in is not a file), and a bad one is refused under the
flag, saying what the flag takes and what it was given. Flags valid one by one that do not
go together, or that the settings refuse together (heads that do not divide the width: said
in the settings' words, each field named by its flag), are usage errors too. A usage error
is one line on stderr and exit status 2; any other failure (a file's contents, the machine)
is one line and 1; Ctrl-C is 130.
"""

from __future__ import annotations

import argparse
import copy
import inspect
import json
import os
import random
import re
import statistics
import sys
import time
from collections.abc import Callable, Collection, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Any, Literal, NoReturn, TypeVar, get_args, get_origin

import torch
from pydantic import BaseModel, Field, TypeAdapter, ValidationError
from tqdm import tqdm

from minigpt import assets, data, parallel
from minigpt.bpe import DEFAULT_BPE_VOCAB_SIZE, get_tokenizer
from minigpt.checkpoint import CHECKPOINT_NAME, load_checkpoint, save_checkpoint
from minigpt.config import Device, GPTConfig, TrainConfig
from minigpt.files import atomic_write
from minigpt.model import GPT
from minigpt.posttrain import evals
from minigpt.posttrain.chat import chat_loop
from minigpt.posttrain.dpo import DPO_TRAINING, make_pairs, train_dpo
from minigpt.posttrain.evals import benchmark_table, format_table
from minigpt.posttrain.sft import SFT_TRAINING, finetune
from minigpt.posttrain.tasks import TaskSplit, exact_match
from minigpt.recipes import assistant, catalogue, pretrained, rewards
from minigpt.recipes.assistant import ASSISTANT_RECIPE
from minigpt.recipes.ledger import CPULedger
from minigpt.recipes.pretrained import ModelInfo
from minigpt.sample import SampleSettings, load_model, sample_texts
from minigpt.tokenizer import CHAT_TOKENS, KINDS, Tokenizer
from minigpt.train import METRICS_NAME, saved_settings, train, with_global_batch, write_metrics

T = TypeVar("T")


def main(argv: list[str] | None = None) -> int:
    """`python -m minigpt COMMAND ...`: returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args: argparse.Namespace | None = None
    try:
        args = build_parser().parse_args(argv)
        return int(args.run(args, argv[1:]))
    except SystemExit as exit_:  # --help, or a usage error that `Parser.error` has said
        return exit_.code if isinstance(exit_.code, int) else 2
    except (OSError, ValueError, parallel.DistributedError, assets.AssetError) as err:
        # A ValidationError here is of settings read from a file (a checkpoint's), not flags.
        print(heading(f"minigpt {argv[0]}"), said(err) if isinstance(err, ValidationError)
              else err, file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        resume = f"; resume from the last checkpoint with --out {args.out} --resume" if (
            args is not None and argv[0] == "train") else ""
        print(f"minigpt {argv[0]}: interrupted{resume}", file=sys.stderr)
        return 130


def heading(prog: str) -> str:
    """What starts an error line: ``minigpt train: error:``, with the rank of a process of
    several (torchrun's)."""
    world = os.environ.get("WORLD_SIZE", "1")  # a bad value is the command's error to report
    rank = os.environ.get("RANK") if world.isdecimal() and int(world) > 1 else None
    return f"{prog}: error{f' (rank {rank})' if rank else ''}:"


class Parser(argparse.ArgumentParser):
    """argparse's parser, whose usage errors are one line (``minigpt train: error: argument
    --lr: ...``) and exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{heading(self.prog.removeprefix('python -m '))} {message}\n")


def build_parser() -> Parser:
    """The command line's parser: each section below adds its command."""
    parser = Parser(prog="python -m minigpt", description="Train GPTs, sample, fine-tune, "
                    "learn from rewards, chat, evaluate, set up the book.",
                    epilog="`python -m minigpt COMMAND --help` lists a command's flags; "
                    "`python -m minigpt pretrained --help` names the cached models.")
    commands = parser.add_subparsers(title="commands", metavar="COMMAND", required=True)
    for add in (add_train, add_sample, add_sft, add_dpo, add_rl, add_chat, add_eval,
                add_assets, add_pretrained):
        add(commands)
    return parser


def command(commands: argparse._SubParsersAction[Parser], name: str,
            run: Callable[[argparse.Namespace, list[str]], int], what: str,
            epilog: str | None = None) -> Parser:
    """The parser of command ``name``; ``run(args, argv)`` runs it (``argv``: the command's
    own arguments) and returns the exit status."""
    p = commands.add_parser(name, help=what, description=what[0].upper() + what[1:] + ".",
                            epilog=epilog, allow_abbrev=False)
    p.set_defaults(run=run, parser=p)
    return p


# ---------------------------------------------------- the flags' types: each value's check

def value(kind: Any, *rules: Any) -> Callable[[str], Any]:
    """An argparse type: the text as a ``kind`` that pydantic's ``rules`` allow, else an
    error saying what the flag takes and what it was given (``Input should be greater than
    0, got '-1'``), or a validator's own words (``'tpu9' is not a torch device; ...``)."""
    def read(text: str) -> Any:
        try:
            return TypeAdapter(Annotated[(kind, *rules)] if rules else kind).validate_python(text)
        except ValidationError as err:
            raise argparse.ArgumentTypeError(in_words(err.errors()[0])) from None
    return read


count = value(int, Field(ge=1))  # 1, 2, ...
natural = value(int, Field(ge=0))  # 0, 1, ...
positive = value(float, Field(gt=0, allow_inf_nan=False))
port = value(int, Field(ge=1, le=65535))
device = value(Device)  # a device a model can run on here (`minigpt.config.check_device`)


def field(model: type[BaseModel], name: str) -> Callable[[str], Any]:
    """A value of ``model``'s field ``name`` under the field's own rules, and finite: the flag
    that sets `TrainConfig.lr` takes what ``lr`` takes, not ``inf``."""
    info = model.model_fields[name]
    kinds = (info.annotation, *get_args(info.annotation))  # float, or float | None
    finite = Field(allow_inf_nan=False) if float in kinds else Field()
    return value(info.annotation, info, finite)


def in_words(error: Mapping[str, Any]) -> str:
    """One of pydantic's errors: a validator's own words, else pydantic's with the value."""
    if error["type"] == "value_error":
        return str(error["ctx"]["error"])
    return f"{error['msg']}, got {error['input']!r}"


def said(err: ValidationError, options: Collection[str] = ()) -> str:
    """What settings refused, on one line; a field that is set by one of the ``options``
    (``--min-lr`` for min_lr) named by its flag: a field the error is about, and one its
    words name with a value (``lr (=0.1)``) or by a name with an underscore."""
    def flag(name: str) -> str:
        return option if (option := "--" + name.replace("_", "-")) in options else name

    def named(text: str) -> str:
        return re.sub(r"(?<![\w-])[a-z]\w*(_\w+|(?= ?\(?=))", lambda m: flag(m[0]), text)

    def where(error: Mapping[str, Any]) -> str:  # the field an error is about, if any
        name = flag(str(error["loc"][0])) if error["loc"] else ""
        return f"{'argument ' * name.startswith('--')}{name}: " if name else ""

    return "; ".join(where(e) + named(in_words(e)) for e in err.errors())


def settings(args: argparse.Namespace, make: Callable[..., T], *pos: Any, **flags: Any) -> T:
    """``make(*pos, **flags)``: settings made of the flags given. What they refuse is a usage
    error, each field named by its flag (`said`)."""
    try:
        return make(*pos, **flags)
    except ValidationError as err:
        parser: Parser = args.parser  # a field the command has a flag for is in ``args``
        parser.error(said(err, {"--" + name.replace("_", "-") for name in vars(args)}))


def text_file(text: str) -> Path:
    """A file to read: one that exists and is a regular file (not a folder, device or pipe)."""
    if not (path := Path(text)).is_file():
        raise argparse.ArgumentTypeError(f"{path}: no such file" if not path.exists() else
                                         f"{path} is not a regular file (a folder, device or "
                                         "pipe); give a UTF-8 text file")
    return path


def folder(text: str) -> Path:
    """A folder to write in: one that exists, or none yet (it is made)."""
    if (path := Path(text)).exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{path} exists and is not a directory")
    return path


def appendable(text: str) -> Path:
    """A file to add lines to (made if missing): not a folder, in a folder that exists."""
    if (path := Path(text)).is_dir() or not path.parent.is_dir():
        raise argparse.ArgumentTypeError(f"{path} is a directory" if path.is_dir() else
                                         f"{path.parent}: no such directory")
    return path


def checkpoint(text: str) -> Path:
    """A saved run: a folder holding checkpoint.pt (a run's --out), or the file itself."""
    path = Path(text)
    if not (file := path / CHECKPOINT_NAME if path.is_dir() else path).is_file():
        raise argparse.ArgumentTypeError(f"no checkpoint at {file}")
    return path


def cached_model(text: str) -> str:
    """A model set-up caches (`minigpt.recipes.catalogue.MODELS`), or another name of one
    (`minigpt.recipes.catalogue.ALIASES`), read as the model's own."""
    name = catalogue.ALIASES.get(text, text)
    if name not in catalogue.MODELS:  # the registry as it is when the command runs
        raise argparse.ArgumentTypeError(
            f"invalid choice: {text!r} (choose from {catalogue.names()})")
    return name


# ------------------------------------------------- the settings' flags: one a field

def field_docs(model: type[BaseModel]) -> dict[str, str]:
    """Each field's text in the Attributes section of ``model``'s docstring, on one line and
    without reST's backquotes. An entry starts a line or a sentence (``name: ...``; ``beta1,
    beta2: ...`` gives both the text)."""
    names = "|".join(model.model_fields)
    text = inspect.cleandoc(model.__doc__ or "").partition("Attributes:")[2].replace("`", "")
    parts = re.split(rf"(?:^ +|(?<=\. ))((?:{names})(?:, (?:{names}))*): ", text, flags=re.M)
    entries = zip(parts[1::2], parts[2::2], strict=True)
    return {name: " ".join(doc.split()) for fields, doc in entries for name in fields.split(", ")}


def add_fields(group: argparse._ActionsContainer, model: type[BaseModel], preset: Any, *,
               skip: Collection[str] = (), follows: Collection[str] = (),
               own: dict[str, dict[str, Any]] | None = None) -> list[argparse.Action]:
    """A flag for each of ``model``'s fields but ``skip`` (--d-model sets d_model): it takes
    what the field takes (on/off for a bool, a Literal's choices), its help is the field's
    text in the docstring (`field_docs`), and it is None unless given, which leaves the
    field to the settings. The help shows ``preset``'s value as the default, but for
    ``follows``, whose default follows from other fields. ``own``: a flag's own
    `add_argument` keywords (``into``: the group it joins). Returns the flags made."""
    docs, made = field_docs(model), []
    for name, info in model.model_fields.items():
        if name in skip:
            continue
        kind = info.annotation
        how = ({"action": argparse.BooleanOptionalAction} if kind is bool else
               {"choices": get_args(kind)} if get_origin(kind) is Literal else
               {"type": field(model, name)}) | (own or {}).get(name, {})
        shown = getattr(preset, name, None)  # a field required and not in the preset: none
        default = "" if shown is None or name in follows or how.get("action") == "store_true" \
            else f" (default: {shown if str(shown).isprintable() else repr(shown)})"
        made.append(how.pop("into", group).add_argument(
            "--" + name.replace("_", "-"), **how, help=(docs[name] + default).replace("%", "%%")))
    return made


def given(args: argparse.Namespace, model: type[BaseModel]) -> dict[str, Any]:
    """The flags of ``model``'s fields that were given, by field."""
    return {name: v for name in model.model_fields if (v := getattr(args, name, None)) is not None}


def keyword_default(function: Callable[..., Any], name: str) -> Any:
    """The default of ``function``'s keyword ``name``: a flag that passes it on keeps it."""
    return inspect.signature(function).parameters[name].default


@contextmanager
def processes(n_threads: int | None, device: str, backend: str | None = None,
              ) -> Iterator[parallel.DistContext]:
    """This process's place in the run (torchrun's group, if any, joined on ``device``), left
    after; ``n_threads`` torch threads for it (`threads`)."""
    with threads(n_threads):
        ctx = parallel.init_distributed(device, backend)
        try:
            yield ctx
        finally:
            parallel.shutdown(ctx)


def threads(n: int | None) -> AbstractContextManager[None]:
    """With ``n``, that many torch threads for the block, the count before back after."""
    # Only set-up pins the thread count (`pretrained.threads`), for cached weights that are
    # the same bits on every run; a user's run keeps PyTorch's default (every core; one a
    # rank under torchrun, which sets OMP_NUM_THREADS) unless --threads says otherwise.
    return nullcontext() if n is None else pretrained.threads(n)


# -------------------------------------------------------------------------------- train

#: The settings a resumed run may change (--max-steps, --device); the others are its own.
RESUMED = ("max_steps", "device")


def add_train(commands: argparse._SubParsersAction[Parser]) -> None:
    p = command(commands, "train", train_command, "train a GPT on a text file (defaults: "
                "nanoGPT's CPU recipe for character-level Shakespeare)")
    r = p.add_argument_group("run")
    r.add_argument("--out", type=folder, required=True, help="folder of the run: "
                   "checkpoint.pt, metrics.json, history.json, the ids")
    r.add_argument("--resume", action="store_true", help="continue the run in --out with its "
                   "own settings (--max-steps and --device may change)")
    r.add_argument("--stop-at", type=natural, help="stop (and checkpoint) at this step")
    r.add_argument("--threads", type=count, help="torch threads (default: PyTorch's)")
    r.add_argument("--compile", action="store_true", help="torch.compile (needs a C++ compiler)")
    r.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True,
                   help="show a progress bar (default: %(default)s)")
    r.add_argument("--nproc-per-node", type=count, help="processes to start (torchrun)")
    r.add_argument("--master-port", type=port, help="their port on 127.0.0.1 (default: free)")
    r.add_argument("--backend", choices=("gloo", "nccl"), help="default: nccl on CUDA, gloo")
    # A new run's flags are None unless given, so that --resume can refuse each one given.
    n = p.add_argument_group("a new run (not with --resume)")
    fresh = [n.add_argument("--text", type=text_file, help="UTF-8 text (default: Shakespeare's "
                            "plays)"),
             n.add_argument("--tokenizer", choices=KINDS, help="bpe is trained on the train "
                            "split (default: char)"),
             n.add_argument("--bpe-vocab-size", type=value(int, Field(ge=2)),
                            help=f"V of --tokenizer bpe (default: {DEFAULT_BPE_VOCAB_SIZE})"),
             n.add_argument("--recipe", choices=("gpt2", "modern"), help="modern: the modern "
                            "layout and training under the flags given (default: gpt2)"),
             n.add_argument("--global-batch-size", type=count, help="sets --grad-accum: "
                            "sequences a step sees over all the processes")]
    m = p.add_argument_group("model: GPTConfig's fields (default: GPTConfig.shakespeare_cpu; "
                             "--recipe modern: .modern)")
    fresh += add_fields(m, GPTConfig, GPTConfig.shakespeare_cpu(vocab_size=65),
                        skip=("vocab_size",), follows=("d_ff",))  # V is the text's; d_ff follows D
    o = p.add_argument_group("optimisation: TrainConfig's fields (default: TrainConfig(); "
                             "--recipe modern: .modern)")
    fresh += add_fields(o, TrainConfig, TrainConfig(), follows=("decay_steps",))
    p.set_defaults(fresh=[a for a in fresh if a.dest not in RESUMED])


def train_command(args: argparse.Namespace, argv: list[str]) -> int:
    """A new run from the flags, or (--resume) the run saved in --out, with its settings."""
    if args.bpe_vocab_size is not None and args.tokenizer != "bpe":
        args.parser.error("--bpe-vocab-size applies only with --tokenizer bpe")
    if args.resume:
        if new := [a.option_strings[-1 if getattr(args, a.dest) is False else 0]
                   for a in args.fresh if getattr(args, a.dest) is not None]:
            args.parser.error(f"--resume continues the run saved in --out with its own "
                              f"settings; drop {', '.join(new)} (only --max-steps and --device "
                              "may change)")
        try:
            checkpoint(str(args.out))
        except argparse.ArgumentTypeError as err:
            args.parser.error(f"--resume continues the run saved in --out: {err}")
        shape, config, tokenizer = saved_settings(args.out, **{
            name: v for name in RESUMED if (v := getattr(args, name)) is not None})
    else:
        if args.global_batch_size is not None and args.grad_accum is not None:
            args.parser.error("give --global-batch-size or --grad-accum, not both: the global "
                              "batch size sets the accumulation steps")
        config = settings(args, TrainConfig.modern if args.recipe == "modern" else TrainConfig,
                          **given(args, TrainConfig))
    if args.nproc_per_node is not None and "RANK" not in os.environ:
        return launch(args, config, argv)
    source: str | None = None  # a new run's text, named
    with processes(args.threads, config.device, args.backend) as ctx:
        config = global_batch(args, config, ctx.world_size)
        if not args.resume:
            shape, tokenizer, text, source = new_model(args)
            if ctx.is_main:
                data.prepare_dataset(text, tokenizer, args.out)
        parallel.barrier(ctx)  # the id files exist before any rank reads them
        train_ids, val_ids = (data.load_ids(args.out / f"{s}.bin") for s in ("train", "val"))
        result = train(shape, config, train_ids, val_ids, tokenizer=tokenizer, out_dir=args.out,
                       resume=args.resume, stop_at=args.stop_at, ctx=ctx, compile=args.compile,
                       progress=args.progress, log=tqdm.write if ctx.is_main else None)
        if not ctx.is_main:
            return 0
        m = write_metrics(args.out, result, config, val_ids, text=source, train_tokens=len(
            train_ids), tokenizer=tokenizer and tokenizer.name)
    loss = (f"step {m['steps']}: val loss {m['final_val_loss']:.4f} (whole split: "
            f"{m['final_val_loss_full']:.4f}); ") if m["final_val_loss"] is not None else ""
    pace = (f"median {m['median_step_ms']:.1f} ms/step, {m['tokens_per_second']:,.0f} tokens/s"
            if m["median_step_ms"] is not None else "no steps run")
    print(f"{loss}{pace}; wrote {args.out / CHECKPOINT_NAME} and {args.out / METRICS_NAME}")
    return 0


def global_batch(args: argparse.Namespace, config: TrainConfig, world_size: int) -> TrainConfig:
    """``config`` with the accumulation that --global-batch-size sets over ``world_size``
    processes; one that does not split into their micro-batches is a usage error."""
    try:
        return with_global_batch(config, args.global_batch_size, world_size)
    except ValueError as err:
        parser: Parser = args.parser
        parser.error(str(err))


def new_model(args: argparse.Namespace) -> tuple[GPTConfig, Tokenizer, str, str]:
    """A new run's model settings, tokenizer, text and the text's source."""
    text, source = (data.read_text(args.text), str(args.text)) if args.text is not None else (
        data.shakespeare_text(), "minigpt.data.shakespeare_text()")
    # BPE is trained on the training split only: validation text stays unseen.
    kind = args.tokenizer or "char"
    tokenizer = get_tokenizer("bpe", data.split_text(text)[0], vocab_size=args.bpe_vocab_size
                              ) if kind == "bpe" else get_tokenizer(kind, text)
    make = GPTConfig.modern if args.recipe == "modern" else GPTConfig.shakespeare_cpu
    return settings(args, make, tokenizer.vocab_size, **given(args, GPTConfig)), tokenizer, \
        text, source


def launch(args: argparse.Namespace, config: TrainConfig, argv: list[str]) -> int:
    """Start --nproc-per-node copies of this command with torchrun, after refusing what
    cannot work: a backend the run's device cannot use, a resumed run's other number of
    processes, a global batch that does not split, a port in use."""
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args
    from torch.distributed.run import run as torchrun

    n, run_on = args.nproc_per_node, torch.device(config.device)
    try:
        parallel.choose_backend(run_on, args.backend)
    except parallel.DistributedError as err:  # nccl for a run off CUDA: the flags' fault
        if run_on.type == "cuda":  # a machine without NCCL: not the command line's
            raise
        args.parser.error(str(err))
    if args.resume and (saved := load_checkpoint(args.out)["world_size"]) != n:
        raise ValueError(f"the run in {args.out} was trained by {saved} process(es); "
                         f"resume it with --nproc-per-node {saved}")
    if not args.resume:  # a global batch that does not split, before anything starts
        global_batch(args, config, n)
    where = ["--standalone"]  # torchrun picks a free port
    if args.master_port is not None:
        parallel.check_port(args.master_port)
        where = ["--master-addr=127.0.0.1", f"--master-port={args.master_port}"]
    own = ("--nproc-per-node", "--master-port")  # the launcher's: not the processes'
    rest = [a for i, a in enumerate(argv) if not a.startswith(own)
            and not (i and argv[i - 1] in own)]
    try:
        torchrun(parse_args([*where, f"--nproc-per-node={n}", "-m", "minigpt", "train",  # type: ignore[no-untyped-call]
                             *rest]))
    except ChildFailedError as err:  # each rank has said what went wrong on its stderr
        return max(1, err.get_first_failure()[1].exitcode)
    except SignalException:  # Ctrl-C: torchrun has stopped the ranks
        raise KeyboardInterrupt from None
    return 0


# ------------------------------------------------------------------------------- sample

def add_sample(commands: argparse._SubParsersAction[Parser]) -> None:
    p = command(commands, "sample", sample_command, "continue a prompt with a trained "
                "checkpoint")
    search = p.add_mutually_exclusive_group()  # beam search, or a draft's proposals
    add_fields(p, SampleSettings, SampleSettings.model_construct(), own={
        "checkpoint": dict(type=checkpoint, required=True), "greedy": dict(action="store_true"),
        "beams": dict(into=search), "draft": dict(type=checkpoint, into=search)})


def sample_command(args: argparse.Namespace, argv: list[str]) -> int:
    s = settings(args, SampleSettings, **given(args, SampleSettings))
    print(("\n" + "-" * 40 + "\n").join(sample_texts(s)))
    return 0


# ------------------------------------------- the assistant's commands: what they share

def add_start(p: argparse.ArgumentParser, model: str, on_device: bool = True) -> None:
    """--checkpoint or --model (not both), the model a command starts from, and --device."""
    start = p.add_mutually_exclusive_group()
    start.add_argument("--checkpoint", type=checkpoint, help="a run's folder (its checkpoint.pt)")
    start.add_argument("--model", type=cached_model, default=model, help="a cached model, "
                       "by name (default: %(default)s; `python -m minigpt pretrained --help` "
                       "names them)")
    if on_device:
        p.add_argument("--device", type=device, default="cpu", help="where the model runs: "
                       "cpu, cuda, cuda:1, ... (default: %(default)s)")


def add_task_flags(p: argparse.ArgumentParser) -> None:
    """The text the tasks are made from, how many, and their seed (set-up's by default)."""
    p.add_argument("--text", type=text_file, help="UTF-8 plays to make the tasks from, their first"
                   f" {ASSISTANT_RECIPE.base.train_fraction:.0%}% (default: Shakespeare's)")
    p.add_argument("--n-train", type=count, default=ASSISTANT_RECIPE.n_train,
                   help="training tasks a family (default: %(default)s)")
    p.add_argument("--n-test", type=count, default=ASSISTANT_RECIPE.n_test,
                   help="held-out tasks a family (default: %(default)s)")
    p.add_argument("--task-seed", type=natural, default=ASSISTANT_RECIPE.task_seed,
                   help="the seed of the tasks (default: %(default)s)")


def add_tuning_flags(p: argparse.ArgumentParser, recipe: dict[str, Any]) -> None:
    """Where a tuning run writes, its steps, rate, seed (``recipe``'s by default), threads."""
    p.add_argument("--out", type=folder, required=True,
                   help="folder for checkpoint.pt and metrics.json")
    p.add_argument("--steps", type=count, default=recipe["max_steps"],
                   help="optimiser steps (default: %(default)s)")
    p.add_argument("--lr", type=positive, default=recipe["lr"], help="peak learning rate, a "
                   "tenth of it at the end (default: %(default)s)")
    p.add_argument("--seed", type=natural, default=recipe["seed"],
                   help="training seed (default: %(default)s)")
    p.add_argument("--threads", type=count, help="torch threads (default: PyTorch's)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def load_any(args: argparse.Namespace, device: torch.device | str | None = None,
             ) -> tuple[GPT, Tokenizer, str, ModelInfo | None]:
    """The model of ``--checkpoint``, else of ``--model``, on ``device`` (default:
    ``--device``; a rank of a process group passes its own), its tokenizer, a name for it,
    and a cached model's `ModelInfo`."""
    device = args.device if device is None else device
    if args.checkpoint is not None:
        model, tokenizer, _ = load_model(args.checkpoint, device=device)
        return model, tokenizer, args.checkpoint.name or str(args.checkpoint), None
    model, tokenizer, info = catalogue.MODELS[args.model]()
    return model.to(device), tokenizer, args.model, info


def require_chat(tokenizer: Tokenizer, where: str) -> None:
    """Refuse a model whose tokenizer lacks the chat tokens."""
    if missing := [t for t in CHAT_TOKENS if t not in tokenizer.special_tokens]:
        raise ValueError(f"{where} has no chat tokens ({', '.join(missing)} missing): it is a "
                         "base model; fine-tune it first with `python -m minigpt sft`")


def text_and_tasks(args: argparse.Namespace) -> tuple[str, TaskSplit]:
    """The text of ``--text`` and its tasks, made as the assistants' are: from the part of
    the text a base model trained on (`minigpt.recipes.assistant.seen_tasks`)."""
    text = data.shakespeare_text() if args.text is None else data.read_text(args.text)
    return text, assistant.seen_tasks(text, args.n_train, args.n_test, seed=args.task_seed)


def tuning_config(recipe: dict[str, Any], args: argparse.Namespace) -> TrainConfig:
    """The recipe with the command's steps, rate (a tenth of it the floor), seed and
    device; a run shorter than the warm-up warms up over the whole run."""
    return TrainConfig(**(recipe | dict(
        max_steps=args.steps, lr=args.lr, min_lr=args.lr / 10, seed=args.seed,
        device=args.device, warmup_steps=min(recipe["warmup_steps"], args.steps))))


def write_run(out: Path, metrics: dict[str, Any]) -> None:
    atomic_write(out / METRICS_NAME, (json.dumps(metrics, indent=1) + "\n").encode())
    print(json.dumps(metrics["exact_match"]))
    print(f"wrote {out / CHECKPOINT_NAME} and {out / METRICS_NAME}")


# ---------------------------------------------------------------------------------- sft

def add_sft(commands: argparse._SubParsersAction[Parser]) -> None:
    p = command(commands, "sft", sft_command,
                "fine-tune a base model to answer the verifiable tasks")
    add_start(p, "modern")
    add_task_flags(p)
    add_tuning_flags(p, SFT_TRAINING)
    p.add_argument("--max-turns", type=count, default=ASSISTANT_RECIPE.max_turns,
                   help="questions a training conversation holds, at most (default: "
                   "%(default)s)")
    p.add_argument("--context-length", type=value(int, Field(ge=2)),
                   default=ASSISTANT_RECIPE.context_length, help="the context the fine-tuned "
                   "model reads (with rotary or sinusoidal positions, it can be longer than "
                   "the base model's) (default: %(default)s)")


def sft_command(args: argparse.Namespace, argv: list[str]) -> int:
    # Joining the process group first gives each rank its GPU (cuda:LOCAL_RANK) to load onto.
    with processes(args.threads, args.device) as ctx:
        base, tokenizer, name, _ = load_any(args, ctx.device)
        if CHAT_TOKENS[0] in tokenizer.special_tokens:
            raise ValueError(f"{name} already has the chat tokens; sft starts from a base model")
        T = base.config.context_length
        if args.context_length != T and base.config.positional == "learned":
            raise ValueError(f"{name} has learned positions, weights for exactly {T} of them: "
                             f"pass --context-length {T}, or start from a model with rotary "
                             "positions (--model modern) to read a longer context")
        _, tasks = text_and_tasks(args)
        result, chat = finetune(base, tokenizer, tasks.train, tasks.test,  # type: ignore[arg-type]
                                tuning_config(SFT_TRAINING, args), max_turns=args.max_turns,
                                context_length=args.context_length, out_dir=args.out,
                                progress=not args.quiet, ctx=ctx)
        if ctx.is_main:
            write_run(args.out, result.metrics | {"exact_match": exact_match(
                result.model, chat, tasks.test)})
    return 0


# ---------------------------------------------------------------------------------- dpo

def add_dpo(commands: argparse._SubParsersAction[Parser]) -> None:
    p = command(commands, "dpo", dpo_command, "preference-tune a fine-tuned model with DPO")
    add_start(p, "sft-0")
    add_task_flags(p)
    add_tuning_flags(p, DPO_TRAINING)
    p.add_argument("--beta", type=positive, default=ASSISTANT_RECIPE.beta,
                   help="DPO's KL weight (default: %(default)s)")


def dpo_command(args: argparse.Namespace, argv: list[str]) -> int:
    # As sft: the policy, and the frozen reference copied from it, on this rank's GPU.
    with processes(args.threads, args.device) as ctx:
        policy, tokenizer, name, _ = load_any(args, ctx.device)
        require_chat(tokenizer, name)
        _, tasks = text_and_tasks(args)
        result, _ = train_dpo(policy, tokenizer, make_pairs(tasks.train, seed=0),
                              make_pairs(tasks.test, seed=1), tuning_config(DPO_TRAINING, args),
                              beta=args.beta, out_dir=args.out, progress=not args.quiet,
                              ctx=ctx)
        if ctx.is_main:
            write_run(args.out, result.metrics | {"beta": args.beta, "exact_match": exact_match(
                result.model, tokenizer, tasks.test)})
    return 0


# ----------------------------------------------------------------------------------- rl

def add_rl(commands: argparse._SubParsersAction[Parser]) -> None:
    p = command(commands, "rl", rl_command, "continue a chat model on rhymes with a method of "
                "the rewards chapter (GRPO by default) and evaluate it, on the CPU; the "
                "chapter's rates were chosen with --validation --json")
    add_start(p, "rl-cold", on_device=False)  # its sampling generators live on the CPU
    p.add_argument("--method", choices=("cold", *rewards.METHODS), default="grpo",
                   metavar="METHOD", help=f"how to continue: {', '.join(rewards.METHODS)}; "
                   "or cold: not at all, the start evaluated as it is (default: %(default)s)")
    p.add_argument("--steps", type=count, help="optimiser steps (default: the method's in "
                   "minigpt.recipes.rewards.STEPS)")
    p.add_argument("--lr", type=positive, help="AdamW's constant rate (default: the method's "
                   "in minigpt.recipes.rewards.LR)")
    p.add_argument("--seed", type=natural, default=0,
                   help="questions drawn and answers sampled (default: %(default)s)")
    p.add_argument("--validation", action="store_true", help="evaluate on as many other "
                   "held-out words, none of those the chapter evaluates")
    p.add_argument("--out", type=folder, help="write checkpoint.pt and metrics.json here")
    p.add_argument("--json", type=appendable, help="append the run's numbers here, one line")
    p.add_argument("--threads", type=count, help="torch threads (default: PyTorch's)")


def rl_command(args: argparse.Namespace, argv: list[str]) -> int:
    cold = args.method == "cold"
    if cold and (args.steps is not None or args.lr is not None):
        args.parser.error("--method cold evaluates the start as it is: --steps and --lr "
                          "continue it with a method")
    if args.out is None and args.json is None:
        args.parser.error("give --out, --json or both: where the run's numbers go")
    recipe = rewards.REWARDS_RECIPE
    steps = 0 if cold else recipe.steps[args.method] if args.steps is None else args.steps
    lr = None if cold else recipe.lr[args.method] if args.lr is None else args.lr
    history: dict[str, list[float]] = {}
    with threads(args.threads):
        model, tokenizer, name, info = load_any(args, "cpu")
        require_chat(tokenizer, name)
        tasks = rewards.rewards_data(recipe)
        if args.validation:  # as many held-out words again, none of the chapter's
            chapter = set(tasks.eval_rhymes)
            rest = [t for t in tasks.rhymes.test if t not in chapter]
            tasks = replace(tasks, eval_rhymes=random.Random(4321).sample(
                rest, len(tasks.eval_rhymes)))
        start = copy.deepcopy(model)
        t0, c0 = time.perf_counter(), time.process_time()
        if not cold:
            print(f"continuing {name} with {args.method} ({steps} steps)")
            history = rewards.continue_training(model, tokenizer, args.method, tasks, recipe,
                                                seed=args.seed, steps=steps, lr=lr)
        seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
        ev = rewards.evaluate_run(model, start, tokenizer, tasks, recipe, seed=args.seed)
    row = {"method": args.method, "start": name, "seed": args.seed,
           "validation": args.validation, "cold_start_key": None if info is None else info.key,
           # the key moves with any change to the code that trains; the weights only if
           # the start itself changed
           "cold_start_weights_sha256": None if info is None else info.manifest["weights_sha256"],
           "steps": steps, "lr": lr, "seconds": round(seconds, 1), "cpu_seconds": round(cpu, 1),
           **{k: v for k, v in ev.items() if k not in ("words", "answers", "greedy_answers")},
           **{f"{k}_last10": statistics.fmean(v[-10:]) for k, v in history.items() if v}}
    print(f"held-out rhymes: pass@1 {row['pass@1']:.3f}, pass@8 {row['pass@8']:.3f}, "
          f"greedy {row['greedy']:.3f}; older families' exact match "
          f"{json.dumps({f: round(v, 3) for f, v in row['old_exact_match'].items()})}")
    shown = ("terror", "metaphor", "night")  # their answers, when they are evaluated
    for word in [w for w in shown if w in ev["words"]] or ev["words"][:3]:
        i = ev["words"].index(word)
        print(f"{word}: greedy {ev['greedy_answers'][i]!r}; sampled {ev['answers'][i][:8]}")
    if args.json is not None:
        with args.json.open("a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
    if args.out is not None:
        config = TrainConfig(max_steps=steps, seed=args.seed, lr=lr or TrainConfig().lr)
        args.out.mkdir(parents=True, exist_ok=True)
        # A rewards run is not resumed: its checkpoint holds the model, not the optimiser.
        save_checkpoint(args.out / CHECKPOINT_NAME, {
            "model": model.state_dict(), "optimizer": {}, "model_config":
            model.config.model_dump(), "train_config": config.model_dump(), "tokenizer":
            tokenizer.to_dict(), "step": steps, "rng": {}, "history": history, "world_size": 1})
        atomic_write(args.out / METRICS_NAME, (json.dumps(row | {"history": history}, indent=1)
                                               + "\n").encode())
        print(f"wrote {args.out / CHECKPOINT_NAME} and {args.out / METRICS_NAME}")
    return 0


# --------------------------------------------------------------------------------- chat

def add_chat(commands: argparse._SubParsersAction[Parser]) -> None:
    p = command(commands, "chat", chat_command, "talk with a fine-tuned model in the terminal")
    add_start(p, "sft-0")
    p.add_argument("--max-new-tokens", type=count,
                   default=keyword_default(chat_loop, "max_new_tokens"),
                   help="the longest answer, in tokens (default: %(default)s)")


def chat_command(args: argparse.Namespace, argv: list[str]) -> int:
    model, tokenizer, name, _ = load_any(args)
    require_chat(tokenizer, name)
    print(f"chatting with {args.checkpoint or name} (context {model.config.context_length} "
          "tokens; the oldest turns are dropped when the conversation outgrows it); end with "
          "Ctrl-D or Ctrl-C")
    chat_loop(model, tokenizer, sys.stdin, sys.stdout, max_new_tokens=args.max_new_tokens)
    return 0


# --------------------------------------------------------------------------------- eval

def add_eval(commands: argparse._SubParsersAction[Parser]) -> None:
    p = command(commands, "eval", eval_command, "print the benchmark table of a model")
    add_start(p, "sft-0")
    add_task_flags(p)
    p.add_argument("--items", type=count, default=keyword_default(evals.benchmark_table, "n_items"),
                   help="multiple-choice items (default: %(default)s)")


def eval_command(args: argparse.Namespace, argv: list[str]) -> int:
    model, tokenizer, name, _ = load_any(args)
    text, tasks = text_and_tasks(args)
    print(format_table(benchmark_table({name: (model, tokenizer)}, text, n_items=args.items,
                                       tasks=tasks.test, shots=tasks.train)))
    return 0


# ------------------------------------------------------------------------------- assets

def add_assets(commands: argparse._SubParsersAction[Parser]) -> None:
    p = command(commands, "assets", assets_command, "fetch (the archive files alone) and "
                "verify the corpus and GPT-2's BPE ranks")
    p.add_argument("--check", action="store_true", help="only verify what is in the cache; "
                   "exit 1 if anything is missing")
    p.add_argument("--cache", type=folder,
                   help="cache folder (default: $MINIGPT_CACHE or ~/.cache/minigpt)")


def assets_command(args: argparse.Namespace, argv: list[str]) -> int:
    if not args.check:
        assets.ensure_assets(args.cache)
        return 0
    for name, path in assets.check_assets(args.cache).items():
        print(f"{name}: verified at {path}")
    return 0


# --------------------------------------------------------------------------- pretrained

def add_pretrained(commands: argparse._SubParsersAction[Parser]) -> None:
    # The one place the cached models are named: --model of the other commands points here.
    p = command(commands, "pretrained", pretrained_command,
                "train (once) and verify the models the chapters share",
                epilog=f"The cached models, by name: {catalogue.names()}.")
    # The cached models are trained on the CPU, the same bits on every machine: no --device.
    p.add_argument("--only", action="append", type=cached_model,
                   help="only this model (repeatable; default: all)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def pretrained_command(args: argparse.Namespace, argv: list[str]) -> int:
    for name in args.only or list(catalogue.MODELS):
        # A model trained here (with any model it starts from that no other process has):
        # its CPU time split into training, sampling and evaluation.
        with CPULedger() as ledger:
            model, _, info = catalogue.MODELS[name](progress=not args.quiet)
        what = (f"trained in {catalogue.train_seconds(info):.0f} s (CPU time: "
                f"{ledger.summary()})" if info.built
                else "fetched and verified" if info.fetched else "loaded and verified")
        print(f"{name} model ({model.num_parameters():,} parameters, "
              f"{catalogue.summary(info)}): {what}; {info.path}")
    return 0
