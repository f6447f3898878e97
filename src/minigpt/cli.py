"""The command line, `python -m minigpt COMMAND ...`: train, sample, sft, dpo, chat, eval,
assets and pretrained. Each command is a section below: its flags, written out with
argparse, then the function that runs it. A flag that is not given is left out, so the
settings model it sets (`GPTConfig`, `TrainConfig`, `SampleSettings`, or this module's
`TrainFlags`, `SftSettings`, ...) fills in its own default, which the flag's help shows;
the function builds those models from the flags given, and they check the values.

`train --nproc-per-node N` starts N processes with torch's own launcher; under torchrun
(`torchrun --nproc-per-node 2 -m minigpt sft ...`) train, sft and dpo train data-parallel:
every rank trains and scores its share of each evaluation, rank 0 alone prints, scores the
final exact match and writes. A bad input is one line on stderr: exit 2 for a usage error
(argparse's, or a settings model's: `explain`), 1 for any other, 130 when interrupted.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import Annotated, Any, Literal, TypeAlias

import torch
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, model_validator
from tqdm import tqdm

from minigpt import assets, assistant, catalogue, data, parallel, pretrained, rewards
from minigpt.assistant import ASSISTANT_RECIPE
from minigpt.bpe import DEFAULT_BPE_VOCAB_SIZE, get_tokenizer
from minigpt.chat import chat_loop
from minigpt.checkpoint import CHECKPOINT_NAME, load_checkpoint, save_checkpoint
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
#: The parser's commands, to which each section below adds its own.
Commands: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"
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
    """The command line's parser: each section below adds its command."""
    parser = argparse.ArgumentParser(
        prog="python -m minigpt", epilog="`python -m minigpt COMMAND --help` lists a command's "
        "options.", description="Train GPTs, sample, fine-tune, chat, evaluate, set up the book.")
    commands = parser.add_subparsers(title="commands", metavar="COMMAND", required=True)
    for add in (add_train, add_sample, add_sft, add_dpo, add_rl, add_chat, add_eval,
                add_assets, add_pretrained):
        add(commands)
    return parser


def add_command(commands: Commands, name: str, run: Command, what: str,
                ) -> argparse.ArgumentParser:
    """The parser of command ``name``, which ``run`` runs with the flags given (a flag not
    given is not passed on: its settings model's default applies)."""
    parser: argparse.ArgumentParser = commands.add_parser(
        name, help=what, description=what[0].upper() + what[1:] + ".",
        prog=f"python -m minigpt {name}", allow_abbrev=False, argument_default=argparse.SUPPRESS)
    parser.set_defaults(command=run)
    return parser


def default(settings: type[BaseModel], name: str) -> Any:
    """The default of a settings model's field, for a flag's help to show."""
    return settings.model_fields[name].default


# -------------------------------------------------------------------------------- train


def add_train(commands: Commands) -> None:
    p = add_command(commands, "train", train_command, "train a GPT on a text file (defaults: "
                    "nanoGPT's CPU recipe for character-level Shakespeare)")
    run = p.add_argument_group("run")
    run.add_argument("--out", type=Path, required=True,
                     help="folder of checkpoint.pt, metrics.json, history.json, the ids")
    run.add_argument("--text", type=Path, help="UTF-8 text (default: Shakespeare's plays)")
    run.add_argument("--tokenizer", choices=KINDS, help="bpe is trained on the train split "
                     f"(default: {default(TrainFlags, 'tokenizer')})")
    run.add_argument("--bpe-vocab-size", type=int,
                     help=f"V of --tokenizer bpe (default: {DEFAULT_BPE_VOCAB_SIZE})")
    run.add_argument("--recipe", choices=("gpt2", "modern"), help="modern: the modern GPT's "
                     "layout and training (minigpt.config.MODERN_LAYOUT, MODERN_TRAINING) "
                     f"under the flags given (default: {default(TrainFlags, 'recipe')})")
    run.add_argument("--resume", action="store_true", help="continue the run in --out with "
                     "its own settings (--max-steps and --device may change)")
    run.add_argument("--stop-at", type=int, help="stop (and checkpoint) at this step")
    run.add_argument("--threads", type=int, help="torch threads (default: PyTorch's)")
    run.add_argument("--compile", action="store_true",
                     help="torch.compile the steps (needs a C++ compiler)")
    run.add_argument("--progress", action=argparse.BooleanOptionalAction,
                     help=f"show a progress bar (default: {default(TrainFlags, 'progress')})")
    run.add_argument("--nproc-per-node", type=int, help="processes to start (torchrun)")
    run.add_argument("--master-port", type=int,
                     help="their port on 127.0.0.1 (default: a free one)")
    run.add_argument("--backend", choices=("gloo", "nccl"),
                     help="default: nccl on CUDA, gloo otherwise")
    run.add_argument("--global-batch-size", type=int, help="sequences a step sees over all "
                     "the processes; sets --grad-accum")

    cpu = GPTConfig.shakespeare_cpu(vocab_size=65)  # the defaults (V comes from the text)
    model = p.add_argument_group("model (default: GPTConfig.shakespeare_cpu; --recipe "
                                 "modern: GPTConfig.modern)")
    model.add_argument("--context-length", type=int, help="T_max, the longest sequence the "
                       f"model reads (default: {cpu.context_length})")
    model.add_argument("--d-model", type=int,
                       help=f"D, the width of the residual stream (default: {cpu.d_model})")
    model.add_argument("--n-heads", type=int,
                       help=f"H, attention heads a layer (default: {cpu.n_heads})")
    model.add_argument("--n-layers", type=int,
                       help=f"L, decoder blocks (default: {cpu.n_layers})")
    model.add_argument("--d-ff", type=int, help="the feed-forward layer's width (4 D, or "
                       "8D/3 rounded up to a multiple of 8 with --activation swiglu)")
    model.add_argument("--dropout", type=float,
                       help=f"dropout probability, in [0, 1) (default: {cpu.dropout})")
    model.add_argument("--bias", action=argparse.BooleanOptionalAction,
                       help=f"linear layers and norms carry a bias (default: {cpu.bias})")
    model.add_argument("--tie-weights", action=argparse.BooleanOptionalAction,
                       help="the output head shares the token embedding (default: "
                       f"{cpu.tie_weights})")
    model.add_argument("--positional", choices=("learned", "sinusoidal", "rope"),
                       help="positions added to the input (learned, sinusoidal), or rotary "
                       f"ones that turn queries and keys (default: {cpu.positional})")
    model.add_argument("--layer-norm-eps", type=float, help="epsilon inside every norm's "
                       f"square root (default: {cpu.layer_norm_eps})")
    model.add_argument("--activation", choices=("gelu_tanh", "gelu", "relu2", "swiglu"),
                       help="the feed-forward non-linearity: gelu_tanh is GPT-2's, gelu the "
                       f"exact one (default: {cpu.activation})")
    model.add_argument("--norm", choices=("layernorm", "rmsnorm"),
                       help=f"the normalisation (default: {cpu.norm})")
    model.add_argument("--norm-weight", action=argparse.BooleanOptionalAction,
                       help=f"each norm has a learned gain (default: {cpu.norm_weight})")
    model.add_argument("--qk-norm", action=argparse.BooleanOptionalAction, help="normalise "
                       f"each head's queries and keys (default: {cpu.qk_norm})")
    model.add_argument("--n-kv-heads", type=int, help="key-value heads (grouped-query "
                       "attention; 1 is multi-query); must divide --n-heads (default: "
                       "--n-heads)")
    model.add_argument("--rope-base", type=float, help="the base of the rotary frequencies "
                       f"(default: {cpu.rope_base})")
    model.add_argument("--zero-init", action=argparse.BooleanOptionalAction, help="each "
                       "block's output projections start at zero (and an untied head) "
                       f"(default: {cpu.zero_init})")

    t = TrainConfig()  # the defaults
    opt = p.add_argument_group("optimisation (default: TrainConfig's; --recipe modern: "
                               "TrainConfig.modern)")
    opt.add_argument("--batch-size", type=int,
                     help=f"B, sequences a micro-batch, per process (default: {t.batch_size})")
    opt.add_argument("--grad-accum", type=int,
                     help=f"micro-batches an optimiser step (default: {t.grad_accum})")
    opt.add_argument("--max-steps", type=int,
                     help=f"optimiser steps of the whole run (default: {t.max_steps})")
    opt.add_argument("--lr", type=float,
                     help=f"peak learning rate, reached after the warm-up (default: {t.lr})")
    opt.add_argument("--min-lr", type=float,
                     help=f"the learning rate the schedule decays to (default: {t.min_lr})")
    opt.add_argument("--warmup-steps", type=int, help="steps of linear warm-up (default: "
                     f"{default(TrainConfig, 'warmup_steps')}, or --decay-steps if fewer)")
    opt.add_argument("--decay-steps", type=int, help="the step at which the schedule reaches "
                     "--min-lr (default: --max-steps)")
    opt.add_argument("--weight-decay", type=float, help="AdamW's weight decay, on matrices "
                     f"only (default: {t.weight_decay})")
    opt.add_argument("--beta1", type=float,
                     help=f"AdamW's first-moment decay rate (default: {t.beta1})")
    opt.add_argument("--beta2", type=float,
                     help=f"AdamW's second-moment decay rate (default: {t.beta2})")
    opt.add_argument("--grad-clip", type=float, help="largest gradient norm, 0 for no "
                     f"clipping (default: {t.grad_clip})")
    opt.add_argument("--eval-interval", type=int, help="evaluate and checkpoint every this "
                     f"many steps (default: {t.eval_interval})")
    opt.add_argument("--eval-steps", type=int,
                     help=f"batches a split in each evaluation (default: {t.eval_steps})")
    opt.add_argument("--eval-full", action=argparse.BooleanOptionalAction, help="score each "
                     "evaluation's validation loss on the whole split: slower, no sampling "
                     f"noise (default: {t.eval_full})")
    opt.add_argument("--seed", type=int, help="seeds the initial weights, the batches and "
                     f"dropout (default: {t.seed})")
    opt.add_argument("--bf16", action=argparse.BooleanOptionalAction,
                     help=f"bf16 autocast for forward passes (default: {t.bf16})")
    opt.add_argument("--device", help=f"cpu, cuda, cuda:1, ... (default: {t.device})")
    opt.add_argument("--optimizer", choices=("adamw", "muon"), help="muon: Muon for the "
                     f"hidden matrices, AdamW for the rest (default: {t.optimizer})")
    opt.add_argument("--muon-lr", type=float,
                     help=f"Muon's peak learning rate (default: {t.muon_lr})")
    opt.add_argument("--muon-momentum", type=float,
                     help=f"Muon's (Nesterov) momentum (default: {t.muon_momentum})")
    opt.add_argument("--schedule", choices=("cosine", "trapezoid"), help="warm-up, then a "
                     "cosine decay, or a constant rate and a linear cool-down (default: "
                     f"{t.schedule})")
    opt.add_argument("--cooldown-fraction", type=float, help="the trapezoid's cool-down, a "
                     f"fraction of --decay-steps (default: {t.cooldown_fraction})")


class TrainFlags(BaseModel):
    """The run flags of `train` (its model flags are `GPTConfig`'s, the others
    `TrainConfig`'s)."""

    out: Path
    text: Path | None = None
    tokenizer: Literal[KINDS] = "char"  # type: ignore[valid-type]
    bpe_vocab_size: int | None = Field(None, ge=2)
    recipe: Literal["gpt2", "modern"] = "gpt2"
    resume: bool = False
    stop_at: int | None = Field(None, ge=0)
    threads: int | None = Field(None, ge=1)
    compile: bool = False
    progress: bool = True
    nproc_per_node: int | None = Field(None, ge=1)
    master_port: int | None = Field(None, ge=1, le=65535)
    backend: Literal["gloo", "nccl"] | None = None
    global_batch_size: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _bpe_size_needs_bpe(self) -> TrainFlags:
        if self.bpe_vocab_size is not None and self.tokenizer != "bpe":
            raise ValueError("--bpe-vocab-size applies only with --tokenizer bpe")
        return self


def _fields(given: dict[str, Any], settings: type[BaseModel]) -> dict[str, Any]:
    """The flags given that set a field of ``settings`` (`train`'s set three models)."""
    return {k: v for k, v in given.items() if k in settings.model_fields}


#: What `train --resume` accepts besides --out: the run's settings are the checkpoint's.
_RESUMABLE = {"max_steps", "device", "stop_at", "progress", "threads", "compile", "out",
              "resume", "backend", "nproc_per_node", "master_port"}


def train_command(given: dict[str, Any], argv: list[str]) -> int:
    """A new run from the flags, or (--resume) the run saved in --out with its settings;
    on this process, or on --nproc-per-node processes started by torchrun."""
    run = TrainFlags(**_fields(given, TrainFlags))
    with _threads(run.threads):
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


_LAUNCHER_FLAGS = ("--nproc-per-node", "--master-port")


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


# ------------------------------------------------------------------------------- sample

def add_sample(commands: Commands) -> None:
    p = add_command(commands, "sample", sample_command,
                    "continue a prompt with a trained checkpoint")
    s = SampleSettings
    p.add_argument("--checkpoint", type=Path, required=True,
                   help="the --out folder of `python -m minigpt train`")
    p.add_argument("--prompt", help=f"text to continue (default: {default(s, 'prompt')!r})")
    p.add_argument("--max-new-tokens", type=int,
                   help=f"tokens to add (default: {default(s, 'max_new_tokens')})")
    p.add_argument("--temperature", type=float, help="0 is greedy (default: 1)")
    p.add_argument("--top-k", type=int, help="sample among the k most likely tokens only")
    p.add_argument("--top-p", type=float, help="sample among the fewest most likely tokens "
                   "whose probabilities add up to p")
    p.add_argument("--greedy", action="store_true", help="always take the most likely token")
    p.add_argument("--seed", type=int, help=f"seeds the sampler (default: {default(s, 'seed')})")
    p.add_argument("--num-samples", type=int, help="independent continuations to print "
                   f"(default: {default(s, 'num_samples')})")
    p.add_argument("--cache", action=argparse.BooleanOptionalAction, help="keep a key-value "
                   f"cache (--no-cache: slower, the same tokens) (default: {default(s, 'cache')})")
    p.add_argument("--device", help=f"cpu, cuda, cuda:1, ... (default: {default(s, 'device')})")
    search = p.add_mutually_exclusive_group()
    search.add_argument("--beams", type=int, help="beam search with this many beams: the most "
                        "likely continuation found, no sampling")
    search.add_argument("--draft", type=Path, help="speculative sampling: a smaller model's "
                        "checkpoint (the same tokenizer) proposes, this one checks")
    p.add_argument("--speculate", type=int,
                   help="tokens the draft proposes a round (default: 4; needs --draft)")


def sample_command(given: dict[str, Any], argv: list[str]) -> int:
    print(("\n" + "-" * 40 + "\n").join(sample_texts(SampleSettings(**given))))
    return 0


# -------------------------------------------------------- the assistant's stages: shared

def model_flags(p: argparse.ArgumentParser, settings: type[ModelSettings]) -> None:
    """--checkpoint or --model (not both), and --device."""
    start = p.add_mutually_exclusive_group()
    start.add_argument("--checkpoint", type=Path, help="a run's folder (its checkpoint.pt)")
    start.add_argument("--model", help=f"a cached model: {catalogue.names()}"
                       f" (default: {default(settings, 'model')})")
    p.add_argument("--device", help="where the model runs: cpu, cuda, cuda:1, ... (default: "
                   f"{default(settings, 'device')})")


def task_flags(p: argparse.ArgumentParser) -> None:
    """The text the tasks are made from, how many, and their seed."""
    p.add_argument("--text", type=Path, help="UTF-8 plays to make the tasks from, their first"
                   f" {ASSISTANT_RECIPE.base.train_fraction:.0%}% (default: Shakespeare's)")
    p.add_argument("--n-train", type=int, help="training tasks a family (default: "
                   f"{default(TaskSettings, 'n_train')})")
    p.add_argument("--n-test", type=int, help="held-out tasks a family (default: "
                   f"{default(TaskSettings, 'n_test')})")
    p.add_argument("--task-seed", type=int,
                   help=f"the seed of the tasks (default: {default(TaskSettings, 'task_seed')})")


def tuning_flags(p: argparse.ArgumentParser, settings: type[TuningSettings]) -> None:
    """Where a tuning run writes, its steps, rate, seed and threads."""
    p.add_argument("--out", type=Path, required=True,
                   help="folder for checkpoint.pt and metrics.json")
    p.add_argument("--steps", type=int,
                   help=f"optimiser steps (default: {default(settings, 'steps')})")
    p.add_argument("--lr", type=float, help="peak learning rate, a tenth of it at the end "
                   f"(default: {default(settings, 'lr')})")
    p.add_argument("--seed", type=int, help=f"training seed (default: {default(settings, 'seed')})")
    p.add_argument("--threads", type=int, help="torch threads (default: PyTorch's)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def _cached_model(name: str) -> str:
    # Checked against the registry as it is when the command runs, not when this loads.
    name = catalogue.ALIASES.get(name, name)
    if name not in catalogue.MODELS:
        raise ValueError(f"invalid choice: {name!r} (choose from {catalogue.names()})")
    return name


#: The name of a model set-up caches (`minigpt.catalogue.MODELS`), or another name of one
#: (`minigpt.catalogue.ALIASES`), read as the model's own.
ModelName = Annotated[str, AfterValidator(_cached_model)]


class ModelSettings(BaseModel):
    """A model to start from or to talk to: a run's checkpoint, else a cached model."""

    model_config = ConfigDict(extra="forbid")

    checkpoint: Path | None = None
    model: ModelName = "sft-0"
    device: Device = "cpu"


class TaskSettings(ModelSettings):
    """The model and the tasks it learns from or is scored on (`minigpt.assistant.seen_tasks`:
    made from the part of the text a base model trains on, as set-up makes the assistants')."""

    text: Path | None = None
    n_train: int = Field(ASSISTANT_RECIPE.n_train, ge=1)
    n_test: int = Field(ASSISTANT_RECIPE.n_test, ge=1)
    task_seed: int = Field(ASSISTANT_RECIPE.task_seed, ge=0)


class TuningSettings(TaskSettings):
    """A tuning run: where it writes, its steps, rate and seed (fine-tuning's defaults,
    `minigpt.sft.SFT_TRAINING`), and its torch threads."""

    out: Path
    steps: int = Field(SFT_TRAINING["max_steps"], ge=1)
    lr: float = Field(SFT_TRAINING["lr"], gt=0)
    seed: int = Field(SFT_TRAINING["seed"], ge=0)
    threads: int | None = Field(None, ge=1)
    quiet: bool = False


def load_any(s: ModelSettings, device: torch.device | str | None = None,
             ) -> tuple[GPT, Tokenizer, str]:
    """The model of ``--checkpoint``, else of ``--model``, on ``device`` (default:
    ``--device``; a rank of a process group passes its own), its tokenizer and a name for
    it."""
    device = s.device if device is None else device
    if s.checkpoint is not None:
        model, tokenizer, _ = load_model(s.checkpoint, device=device)
        return model, tokenizer, s.checkpoint.name or str(s.checkpoint)
    model, tokenizer, _ = catalogue.MODELS[s.model]()
    return model.to(device), tokenizer, s.model


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
    after; with ``threads``, that many torch threads for the run."""
    with _threads(threads):
        ctx = parallel.init_distributed(device)
        try:
            yield ctx
        finally:
            parallel.shutdown(ctx)


def _threads(n: int | None) -> AbstractContextManager[None]:
    """With ``n``, that many torch threads for the block (the count before comes back
    after)."""
    # Only set-up pins the thread count (`pretrained.threads`), for cached weights that are
    # the same bits on every run; a user's run keeps PyTorch's default (every core; one a
    # rank under torchrun, which sets OMP_NUM_THREADS) unless --threads says otherwise.
    return nullcontext() if n is None else pretrained.threads(n)


def _write(out: Path, metrics: dict[str, Any]) -> None:
    atomic_write(out / METRICS_NAME, (json.dumps(metrics, indent=1) + "\n").encode())
    print(json.dumps(metrics["exact_match"]))
    print(f"wrote {out / CHECKPOINT_NAME} and {out / METRICS_NAME}")


# ---------------------------------------------------------------------------------- sft

def add_sft(commands: Commands) -> None:
    p = add_command(commands, "sft", sft_command,
                    "fine-tune a base model to answer the verifiable tasks")
    model_flags(p, SftSettings)
    task_flags(p)
    tuning_flags(p, SftSettings)
    p.add_argument("--max-turns", type=int, help="questions a training conversation holds, "
                   f"at most (default: {default(SftSettings, 'max_turns')})")
    p.add_argument("--context-length", type=int, help="the context the fine-tuned model "
                   "reads (with rotary or sinusoidal positions, it can be longer than the "
                   f"base model's) (default: {default(SftSettings, 'context_length')})")


class SftSettings(TuningSettings):
    """Fine-tuning: `minigpt.sft.SFT_TRAINING` with these steps, rate and seed, on
    conversations of up to ``max_turns`` questions, the fine-tuned model reading
    ``context_length`` tokens."""

    model: ModelName = "modern"
    max_turns: int = Field(ASSISTANT_RECIPE.max_turns, ge=1)
    context_length: int = Field(ASSISTANT_RECIPE.context_length, ge=2)


def sft_command(given: dict[str, Any], argv: list[str]) -> int:
    s = SftSettings(**given)
    # Joining the process group first gives each rank its GPU (cuda:LOCAL_RANK) to load onto.
    with _processes(s.device, s.threads) as ctx:
        base, tokenizer, name = load_any(s, ctx.device)
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


# ---------------------------------------------------------------------------------- dpo

def add_dpo(commands: Commands) -> None:
    p = add_command(commands, "dpo", dpo_command, "preference-tune a fine-tuned model with DPO")
    model_flags(p, DpoSettings)
    task_flags(p)
    tuning_flags(p, DpoSettings)
    p.add_argument("--beta", type=float,
                   help=f"DPO's KL weight (default: {default(DpoSettings, 'beta')})")


class DpoSettings(TuningSettings):
    """Preference tuning: `minigpt.dpo.DPO_TRAINING` with these steps, rate and seed."""

    steps: int = Field(DPO_TRAINING["max_steps"], ge=1)
    lr: float = Field(DPO_TRAINING["lr"], gt=0)
    seed: int = Field(DPO_TRAINING["seed"], ge=0)
    beta: float = Field(ASSISTANT_RECIPE.beta, gt=0, allow_inf_nan=False)


def dpo_command(given: dict[str, Any], argv: list[str]) -> int:
    s = DpoSettings(**given)
    # As sft: the policy, and the frozen reference copied from it, on this rank's GPU.
    with _processes(s.device, s.threads) as ctx:
        policy, tokenizer, name = load_any(s, ctx.device)
        require_chat(tokenizer, name)
        tasks = _tasks(s)
        result, _ = train_dpo(policy, tokenizer, make_pairs(tasks.train, seed=0),
                              make_pairs(tasks.test, seed=1), _config(DPO_TRAINING, s),
                              beta=s.beta, out_dir=s.out, progress=not s.quiet, ctx=ctx)
        if ctx.is_main:
            _write(s.out, result.metrics | {"beta": s.beta, "exact_match": exact_match(
                result.model, tokenizer, tasks.test)})
    return 0


# ----------------------------------------------------------------------------------- rl

def add_rl(commands: Commands) -> None:
    p = add_command(commands, "rl", rl_command, "continue a chat model on rhymes with GRPO "
                    "(or another method of the rewards chapter), on the CPU")
    start = p.add_mutually_exclusive_group()
    start.add_argument("--checkpoint", type=Path, help="a run's folder (its checkpoint.pt)")
    start.add_argument("--model", help=f"a cached model: {catalogue.names()} (default: "
                       f"{default(RlSettings, 'model')}, the cold start)")
    p.add_argument("--method", choices=rewards.METHODS,
                   help=f"how to continue (default: {default(RlSettings, 'method')})")
    p.add_argument("--steps", type=int, help="optimiser steps (default: the method's in "
                   "minigpt.rewards.STEPS)")
    p.add_argument("--lr", type=float, help="AdamW's constant rate (default: the method's "
                   "in minigpt.rewards.LR)")
    p.add_argument("--seed", type=int, help="questions drawn and answers sampled (default: "
                   f"{default(RlSettings, 'seed')})")
    p.add_argument("--out", type=Path, required=True,
                   help="folder for checkpoint.pt and metrics.json")
    p.add_argument("--threads", type=int, help="torch threads (default: PyTorch's)")


class RlSettings(BaseModel):
    """A rewards run (`minigpt.rewards.continue_training`) from a chat model: the cold start
    by default. The CPU only: its sampling generators live there."""

    model_config = ConfigDict(extra="forbid")

    checkpoint: Path | None = None
    model: ModelName = "rl-cold"
    method: rewards.Method = "grpo"
    steps: int | None = Field(None, ge=1)
    lr: float | None = Field(None, gt=0, allow_inf_nan=False)
    seed: int = Field(0, ge=0)
    out: Path
    threads: int | None = Field(None, ge=1)


def rl_command(given: dict[str, Any], argv: list[str]) -> int:
    s = RlSettings(**given)
    recipe = rewards.REWARDS_RECIPE
    steps = recipe.steps[s.method] if s.steps is None else s.steps
    lr = recipe.lr[s.method] if s.lr is None else s.lr
    with _threads(s.threads):
        model, tokenizer, name = load_any(ModelSettings(checkpoint=s.checkpoint, model=s.model))
        require_chat(tokenizer, name)
        data = rewards.rewards_data(recipe)
        start = copy.deepcopy(model)
        print(f"continuing {name} with {s.method} ({steps} steps)")
        history = rewards.continue_training(model, tokenizer, s.method, data, recipe,
                                            seed=s.seed, steps=steps, lr=lr)
        evaluation = rewards.evaluate_run(model, start, tokenizer, data, recipe, seed=s.seed)
    config = TrainConfig(max_steps=steps, lr=lr, seed=s.seed)
    s.out.mkdir(parents=True, exist_ok=True)
    # A rewards run is not resumed: its checkpoint holds the model, not the optimiser.
    save_checkpoint(s.out / CHECKPOINT_NAME, {
        "model": model.state_dict(), "optimizer": {}, "model_config": model.config.model_dump(),
        "train_config": config.model_dump(), "tokenizer": tokenizer.to_dict(), "step": steps,
        "rng": {}, "history": history, "world_size": 1})
    numbers = {k: v for k, v in evaluation.items()
               if k not in ("words", "answers", "greedy_answers")}
    atomic_write(s.out / METRICS_NAME, (json.dumps({"method": s.method, "start": name} | numbers
                                                   | {"history": history}, indent=1)
                                        + "\n").encode())
    print(f"held-out rhymes: pass@1 {numbers['pass@1']:.3f}, pass@8 {numbers['pass@8']:.3f}, "
          f"greedy {numbers['greedy']:.3f}; older families' exact match "
          f"{json.dumps({f: round(v, 3) for f, v in numbers['old_exact_match'].items()})}")
    print(f"wrote {s.out / CHECKPOINT_NAME} and {s.out / METRICS_NAME}")
    return 0


# --------------------------------------------------------------------------------- chat

def add_chat(commands: Commands) -> None:
    p = add_command(commands, "chat", chat_command, "talk with a fine-tuned model in the "
                    "terminal")
    model_flags(p, ChatSettings)
    p.add_argument("--max-new-tokens", type=int, help="the longest answer, in tokens "
                   f"(default: {default(ChatSettings, 'max_new_tokens')})")


class ChatSettings(ModelSettings):
    max_new_tokens: int = Field(32, ge=1)


def chat_command(given: dict[str, Any], argv: list[str]) -> int:
    s = ChatSettings(**given)
    model, tokenizer, name = load_any(s)
    require_chat(tokenizer, name)
    print(f"chatting with {s.checkpoint or name} (context {model.config.context_length} "
          "tokens; the oldest turns are dropped when the conversation outgrows it); end with "
          "Ctrl-D or Ctrl-C")
    chat_loop(model, tokenizer, sys.stdin, sys.stdout, max_new_tokens=s.max_new_tokens)
    return 0


# --------------------------------------------------------------------------------- eval

def add_eval(commands: Commands) -> None:
    p = add_command(commands, "eval", eval_command, "print the benchmark table of a model")
    model_flags(p, EvalSettings)
    task_flags(p)
    p.add_argument("--items", type=int,
                   help=f"multiple-choice items (default: {default(EvalSettings, 'items')})")


class EvalSettings(TaskSettings):
    items: int = Field(1000, ge=1)


def eval_command(given: dict[str, Any], argv: list[str]) -> int:
    s = EvalSettings(**given)
    model, tokenizer, name = load_any(s)
    text = _text(s)
    tasks = _tasks(s, text)
    print(format_table(benchmark_table({name: (model, tokenizer)}, text, n_items=s.items,
                                       tasks=tasks.test, shots=tasks.train)))
    return 0


# ------------------------------------------------------------------------------- assets

def add_assets(commands: Commands) -> None:
    p = add_command(commands, "assets", assets_command, "fetch (the archive files alone) and "
                    "verify the corpus and GPT-2's BPE ranks")
    p.add_argument("--check", action="store_true", help="only verify what is in the cache; "
                   "exit 1 if anything is missing")
    p.add_argument("--cache", type=Path,
                   help="cache folder (default: $MINIGPT_CACHE or ~/.cache/minigpt)")


class AssetsSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    check: bool = False
    cache: Path | None = None


def assets_command(given: dict[str, Any], argv: list[str]) -> int:
    s = AssetsSettings(**given)
    if not s.check:
        assets.ensure_assets(s.cache)
        return 0
    for name, path in assets.check_assets(s.cache).items():
        print(f"{name}: verified at {path}")
    return 0


# --------------------------------------------------------------------------- pretrained

def add_pretrained(commands: Commands) -> None:
    p = add_command(commands, "pretrained", pretrained_command,
                    "train (once) and verify the models the chapters share")
    # The cached models are trained on the CPU, the same bits on every machine: no --device.
    p.add_argument("--only", action="append", help="only this model: "
                   f"{catalogue.names()} (repeatable; default: all)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


class PretrainedSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    only: list[ModelName] | None = None
    quiet: bool = False


def pretrained_command(given: dict[str, Any], argv: list[str]) -> int:
    s = PretrainedSettings(**given)
    for name in s.only or list(catalogue.MODELS):
        model, _, info = catalogue.MODELS[name](progress=not s.quiet)
        what = (f"trained in {catalogue.train_seconds(info):.0f} s" if info.built
                else "fetched and verified" if info.fetched else "loaded and verified")
        print(f"{name} model ({model.num_parameters():,} parameters, "
              f"{catalogue.summary(info)}): {what}; {info.path}")
    return 0


# -------------------------------------------------------------- errors, under their flags

def flag(name: str) -> str:
    """The flag that sets field ``name``: ``max_steps`` -> ``--max-steps``."""
    return "--" + name.replace("_", "-")


def explain(err: ValidationError) -> str:
    """A settings model's errors as one line, each under the flag that set its field
    (``--lr: Input should be greater than 0``); a rule across fields is the model's own
    sentence, with the config fields it names as flags (`as_flags`)."""
    said = []
    for e in err.errors():
        # A ValueError raised by a validator is in the context as itself.
        message = str(e["ctx"]["error"]) if e["type"] == "value_error" else e["msg"]
        said.append(f"{flag(str(e['loc'][0]))}: {message}" if e["loc"] else as_flags(message))
    return "; ".join(said)


_CONFIG_FIELDS = {*GPTConfig.model_fields, *TrainConfig.model_fields}


def as_flags(sentence: str) -> str:
    """``sentence`` with each `GPTConfig` or `TrainConfig` field it names as its flag: a
    word that is a field's name with an underscore (``warmup_steps``, ``max_steps):``), or
    any field's name followed by its value (``lr (=0.1)``)."""
    words = sentence.split(" ")
    for i, word in enumerate(words):
        name = word.rstrip("):,;")
        after = words[i + 1] if i + 1 < len(words) else ""
        if name in _CONFIG_FIELDS and ("_" in name or after.startswith("(=")):
            words[i] = flag(name) + word[len(name):]
    return " ".join(words)

