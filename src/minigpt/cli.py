"""The command line, `python -m minigpt COMMAND ...`: train a GPT on a text (train), continue
a prompt (sample), make an assistant of a base model (sft, dpo), continue it on rhymes with
rewards (rl), talk to it (chat), benchmark it (eval), and set up the book (assets,
pretrained). `train --nproc-per-node N` starts N processes with torchrun; under torchrun,
train, sft and dpo train data-parallel and rank 0 alone writes.

Each command is a section below: its flags, then the function that runs it, which makes the
package's settings from the flags, each passed by name.

Errors: every value is checked as argparse reads it, by its flag's type, and a bad one is
refused under the flag, saying what the flag takes and what it was given. What the settings
refuse of flags valid one by one (heads that do not divide the width) is said in the
settings' own words. A usage error is one line on stderr and exit status 2; any other
failure is one line and 1; Ctrl-C is 130.
"""

from __future__ import annotations

import argparse
import copy
import inspect
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Annotated, Any, NoReturn, get_args

import torch
from pydantic import BaseModel, Field, TypeAdapter, ValidationError
from tqdm import tqdm

from minigpt import assets, data, parallel
from minigpt.bpe import DEFAULT_BPE_VOCAB_SIZE, get_tokenizer
from minigpt.checkpoint import CHECKPOINT_NAME, load_checkpoint, save_checkpoint
from minigpt.config import GPTConfig, TrainConfig, check_device
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


def main(argv: list[str] | None = None) -> int:
    """`python -m minigpt COMMAND ...`: returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args: argparse.Namespace | None = None
    try:
        args = build_parser().parse_args(argv)
        return int(args.run(args, argv[1:]))
    except SystemExit as exit_:  # --help, or a usage error that `Parser.error` has said
        return exit_.code if isinstance(exit_.code, int) else 2
    except ValidationError as err:  # settings refusing flags that are each valid: usage
        print(heading(f"minigpt {argv[0]}"), "; ".join(str(e.get("ctx", {}).get(
            "error", e["msg"])) for e in err.errors()), file=sys.stderr)
        return 2
    except (OSError, ValueError, parallel.DistributedError, assets.AssetError) as err:
        print(heading(f"minigpt {argv[0]}"), err, file=sys.stderr)
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
    0, got '-1'``)."""
    def read(text: str) -> Any:
        try:
            return TypeAdapter(Annotated[(kind, *rules)]).validate_python(text)
        except ValidationError as err:
            raise argparse.ArgumentTypeError(f"{err.errors()[0]['msg']}, got {text!r}"
                                             ) from None
    return read


count = value(int, Field(ge=1))  # 1, 2, ...
natural = value(int, Field(ge=0))  # 0, 1, ...
positive = value(float, Field(gt=0, allow_inf_nan=False))
port = value(int, Field(ge=1, le=65535))


def field(model: type[BaseModel], name: str) -> Callable[[str], Any]:
    """A value of ``model``'s field ``name`` under the field's own rules, and finite: the flag
    that sets `TrainConfig.lr` takes what ``lr`` takes, not ``inf``."""
    info = model.model_fields[name]
    kinds = (info.annotation, *get_args(info.annotation))  # float, or float | None
    finite = Field(allow_inf_nan=False) if float in kinds else Field()
    return value(info.annotation, info, finite)


def literal(model: type[BaseModel], name: str) -> tuple[str, ...]:
    """The values ``model``'s field ``name`` allows: its flag's choices."""
    return get_args(model.model_fields[name].annotation)


def device(text: str) -> str:
    """A device a model can run on here (`minigpt.config.check_device`)."""
    try:
        return check_device(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def cached_model(text: str) -> str:
    """A model set-up caches (`minigpt.recipes.catalogue.MODELS`), or another name of one
    (`minigpt.recipes.catalogue.ALIASES`), read as the model's own."""
    name = catalogue.ALIASES.get(text, text)
    if name not in catalogue.MODELS:  # the registry as it is when the command runs
        raise argparse.ArgumentTypeError(
            f"invalid choice: {text!r} (choose from {catalogue.names()})")
    return name


def given(**values: Any) -> dict[str, Any]:
    """The flags given (one not given is None): a setting left out keeps its default."""
    return {name: v for name, v in values.items() if v is not None}


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

def add_train(commands: argparse._SubParsersAction[Parser]) -> None:
    p = command(commands, "train", train_command, "train a GPT on a text file (defaults: "
                "nanoGPT's CPU recipe for character-level Shakespeare)")
    on_off = argparse.BooleanOptionalAction
    r = p.add_argument_group("run")
    r.add_argument("--out", type=Path, required=True, help="folder of the run: checkpoint.pt, "
                   "metrics.json, history.json, the ids")
    r.add_argument("--resume", action="store_true", help="continue the run in --out with its "
                   "own settings (--max-steps and --device may change)")
    r.add_argument("--stop-at", type=natural, help="stop (and checkpoint) at this step")
    r.add_argument("--threads", type=count, help="torch threads (default: PyTorch's)")
    r.add_argument("--compile", action="store_true", help="torch.compile (needs a C++ compiler)")
    r.add_argument("--progress", action=on_off, default=True,
                   help="show a progress bar (default: %(default)s)")
    r.add_argument("--nproc-per-node", type=count, help="processes to start (torchrun)")
    r.add_argument("--master-port", type=port, help="their port on 127.0.0.1 (default: free)")
    r.add_argument("--backend", choices=("gloo", "nccl"), help="default: nccl on CUDA, gloo")
    n = p.add_argument_group("a new run (not with --resume)")
    n.add_argument("--text", type=Path, help="UTF-8 text (default: Shakespeare's plays)")
    n.add_argument("--tokenizer", choices=KINDS, default="char",
                   help="bpe is trained on the train split (default: %(default)s)")
    n.add_argument("--bpe-vocab-size", type=value(int, Field(ge=2)),
                   help=f"V of --tokenizer bpe (default: {DEFAULT_BPE_VOCAB_SIZE})")
    n.add_argument("--recipe", choices=("gpt2", "modern"), default="gpt2", help="modern: the "
                   "modern layout and training under the flags given (default: %(default)s)")
    n.add_argument("--global-batch-size", type=count, help="sets --grad-accum: sequences a "
                   "step sees over all the processes")
    # A model or optimisation flag not given is None: the recipe's preset fills in its field.
    c, g = GPTConfig.shakespeare_cpu(vocab_size=65), partial(field, GPTConfig)
    m = p.add_argument_group("model: GPTConfig's fields (default: GPTConfig.shakespeare_cpu; "
                             "--recipe modern: .modern)")
    m.add_argument("--context-length", type=g("context_length"),
                   help=f"T_max (default: {c.context_length})")
    m.add_argument("--d-model", type=g("d_model"), help=f"D, the width (default: {c.d_model})")
    m.add_argument("--n-heads", type=g("n_heads"), help=f"H, heads a layer (default: {c.n_heads})")
    m.add_argument("--n-layers", type=g("n_layers"), help=f"L, blocks (default: {c.n_layers})")
    m.add_argument("--d-ff", type=g("d_ff"), help="feed-forward width (4 D; 8D/3 with swiglu)")
    m.add_argument("--dropout", type=g("dropout"), help=f"in [0, 1) (default: {c.dropout})")
    m.add_argument("--bias", action=on_off, help=f"biases (default: {c.bias})")
    m.add_argument("--tie-weights", action=on_off,
                   help=f"the head is the token embedding (default: {c.tie_weights})")
    m.add_argument("--positional", choices=literal(GPTConfig, "positional"),
                   help=f"positions (default: {c.positional})")
    m.add_argument("--layer-norm-eps", type=g("layer_norm_eps"),
                   help=f"(default: {c.layer_norm_eps})")
    m.add_argument("--activation", choices=literal(GPTConfig, "activation"),
                   help=f"the feed-forward non-linearity (default: {c.activation})")
    m.add_argument("--norm", choices=literal(GPTConfig, "norm"), help=f"(default: {c.norm})")
    m.add_argument("--norm-weight", action=on_off,
                   help=f"norms have a learned gain (default: {c.norm_weight})")
    m.add_argument("--qk-norm", action=on_off,
                   help=f"normalise queries and keys (default: {c.qk_norm})")
    m.add_argument("--n-kv-heads", type=g("n_kv_heads"),
                   help="key-value heads (grouped-query attention; default: --n-heads)")
    m.add_argument("--rope-base", type=g("rope_base"),
                   help=f"(default: {c.rope_base})")
    m.add_argument("--zero-init", action=on_off,
                   help=f"output projections start at zero (default: {c.zero_init})")
    t, f = TrainConfig(), partial(field, TrainConfig)
    o = p.add_argument_group("optimisation: TrainConfig's fields (default: TrainConfig(); "
                             "--recipe modern: .modern)")
    o.add_argument("--batch-size", type=f("batch_size"),
                   help=f"B, sequences a micro-batch, per process (default: {t.batch_size})")
    o.add_argument("--grad-accum", type=f("grad_accum"),
                   help=f"micro-batches a step (default: {t.grad_accum})")
    o.add_argument("--max-steps", type=f("max_steps"),
                   help=f"optimiser steps (default: {t.max_steps})")
    o.add_argument("--lr", type=f("lr"), help=f"peak learning rate (default: {t.lr})")
    o.add_argument("--min-lr", type=f("min_lr"), help=f"the rate decayed to (default: {t.min_lr})")
    o.add_argument("--warmup-steps", type=f("warmup_steps"),
                   help=f"linear warm-up (default: {t.warmup_steps}, or --decay-steps if fewer)")
    o.add_argument("--decay-steps", type=f("decay_steps"),
                   help="where the schedule reaches --min-lr (default: --max-steps)")
    o.add_argument("--weight-decay", type=f("weight_decay"),
                   help=f"on matrices only (default: {t.weight_decay})")
    o.add_argument("--beta1", type=f("beta1"), help=f"AdamW's (default: {t.beta1})")
    o.add_argument("--beta2", type=f("beta2"), help=f"AdamW's (default: {t.beta2})")
    o.add_argument("--grad-clip", type=f("grad_clip"), help=f"0: none (default: {t.grad_clip})")
    o.add_argument("--eval-interval", type=f("eval_interval"), help="evaluate and checkpoint "
                   f"every this many steps (default: {t.eval_interval})")
    o.add_argument("--eval-steps", type=f("eval_steps"),
                   help=f"batches a split an evaluation (default: {t.eval_steps})")
    o.add_argument("--eval-full", action=on_off,
                   help=f"validate on the whole split (default: {t.eval_full})")
    o.add_argument("--seed", type=f("seed"), help=f"weights, batches, dropout (default: {t.seed})")
    o.add_argument("--bf16", action=on_off, help=f"bf16 autocast (default: {t.bf16})")
    o.add_argument("--device", type=device, help=f"cpu, cuda, cuda:1, ... (default: {t.device})")
    o.add_argument("--optimizer", choices=literal(TrainConfig, "optimizer"),
                   help=f"muon: Muon on the hidden matrices (default: {t.optimizer})")
    o.add_argument("--muon-lr", type=f("muon_lr"), help=f"Muon's peak rate (default: {t.muon_lr})")
    o.add_argument("--muon-momentum", type=f("muon_momentum"), help=f"(default: {t.muon_momentum})")
    o.add_argument("--schedule", choices=literal(TrainConfig, "schedule"),
                   help=f"after the warm-up (default: {t.schedule})")
    o.add_argument("--cooldown-fraction", type=f("cooldown_fraction"),
                   help=f"the trapezoid's, of --decay-steps (default: {t.cooldown_fraction})")

#: The flags `train --resume` takes: the run's other settings are its checkpoint's.
RESUMABLE = {"--out", "--resume", "--stop-at", "--threads", "--compile", "--progress",
             "--no-progress", "--nproc-per-node", "--master-port", "--backend", "--max-steps",
             "--device"}


def train_command(args: argparse.Namespace, argv: list[str]) -> int:
    """A new run from the flags, or (--resume) the run saved in --out, with its settings."""
    if args.bpe_vocab_size is not None and args.tokenizer != "bpe":
        args.parser.error("--bpe-vocab-size applies only with --tokenizer bpe")
    if args.out.exists() and not args.out.is_dir():
        raise ValueError(f"--out {args.out} exists and is not a directory")
    if args.resume:
        if extra := sorted({a.split("=")[0] for a in argv if a.startswith("--")} - RESUMABLE):
            raise ValueError(f"--resume continues the run saved in --out with its own settings;"
                             f" drop {', '.join(extra)} (only --max-steps and --device may change)")
        shape, config, tokenizer = saved_settings(args.out, **given(
            max_steps=args.max_steps, device=args.device))
    else:
        if args.global_batch_size is not None and args.grad_accum is not None:
            raise ValueError("give --global-batch-size or --grad-accum, not both: the global "
                             "batch size sets the accumulation steps")
        make = TrainConfig.modern if args.recipe == "modern" else TrainConfig
        config = make(**given(
            batch_size=args.batch_size, grad_accum=args.grad_accum, max_steps=args.max_steps,
            lr=args.lr, min_lr=args.min_lr, warmup_steps=args.warmup_steps,
            decay_steps=args.decay_steps, weight_decay=args.weight_decay, beta1=args.beta1,
            beta2=args.beta2, grad_clip=args.grad_clip, eval_interval=args.eval_interval,
            eval_steps=args.eval_steps, eval_full=args.eval_full, seed=args.seed,
            bf16=args.bf16, device=args.device, optimizer=args.optimizer,
            muon_lr=args.muon_lr, muon_momentum=args.muon_momentum, schedule=args.schedule,
            cooldown_fraction=args.cooldown_fraction))
    if args.nproc_per_node is not None and "RANK" not in os.environ:
        return launch(args, config, argv)
    source: str | None = None  # a new run's text, named
    with processes(args.threads, config.device, args.backend) as ctx:
        config = with_global_batch(config, args.global_batch_size, ctx.world_size)
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


def new_model(args: argparse.Namespace) -> tuple[GPTConfig, Tokenizer, str, str]:
    """A new run's model settings, tokenizer, text and the text's source."""
    text, source = (data.read_text(args.text), str(args.text)) if args.text is not None else (
        data.shakespeare_text(), "minigpt.data.shakespeare_text()")
    # BPE is trained on the training split only: validation text stays unseen.
    tokenizer = get_tokenizer("bpe", data.split_text(text)[0], vocab_size=args.bpe_vocab_size
                              ) if args.tokenizer == "bpe" else get_tokenizer(args.tokenizer, text)
    make = GPTConfig.modern if args.recipe == "modern" else GPTConfig.shakespeare_cpu
    shape = make(tokenizer.vocab_size, **given(
        context_length=args.context_length, d_model=args.d_model, n_heads=args.n_heads,
        n_layers=args.n_layers, d_ff=args.d_ff, dropout=args.dropout, bias=args.bias,
        tie_weights=args.tie_weights, positional=args.positional,
        layer_norm_eps=args.layer_norm_eps, activation=args.activation, norm=args.norm,
        norm_weight=args.norm_weight, qk_norm=args.qk_norm, n_kv_heads=args.n_kv_heads,
        rope_base=args.rope_base, zero_init=args.zero_init))
    return shape, tokenizer, text, source


def launch(args: argparse.Namespace, config: TrainConfig, argv: list[str]) -> int:
    """Start --nproc-per-node copies of this command with torchrun, after refusing what
    cannot work: a backend the run's device cannot use, a resumed run's other number of
    processes, a global batch that does not split, a port in use."""
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args
    from torch.distributed.run import run as torchrun

    n = args.nproc_per_node
    parallel.choose_backend(torch.device(config.device), args.backend)
    if args.resume and (saved := load_checkpoint(args.out)["world_size"]) != n:
        raise ValueError(f"the run in {args.out} was trained by {saved} process(es); "
                         f"resume it with --nproc-per-node {saved}")
    if not args.resume:  # a global batch that does not split, before anything starts
        with_global_batch(config, args.global_batch_size, n)
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
    s, f = SampleSettings.model_construct(), partial(field, SampleSettings)  # defaults
    p.add_argument("--checkpoint", type=Path, required=True,
                   help="the --out folder of `python -m minigpt train`")
    p.add_argument("--prompt", type=f("prompt"),
                   help=f"text to continue (default: {s.prompt!r})")
    p.add_argument("--max-new-tokens", type=f("max_new_tokens"),
                   help=f"tokens to add (default: {s.max_new_tokens})")
    p.add_argument("--temperature", type=f("temperature"), help="0 is greedy (default: 1)")
    p.add_argument("--top-k", type=f("top_k"), help="sample among the k most likely tokens only")
    p.add_argument("--top-p", type=f("top_p"), help="sample among the "
                   "fewest most likely tokens whose probabilities add up to p")
    p.add_argument("--greedy", action="store_true", help="always take the most likely token")
    p.add_argument("--seed", type=f("seed"), help=f"seeds the sampler (default: {s.seed})")
    p.add_argument("--num-samples", type=f("num_samples"),
                   help=f"independent continuations to print (default: {s.num_samples})")
    p.add_argument("--cache", action=argparse.BooleanOptionalAction, help="keep a key-value "
                   f"cache (--no-cache: slower, the same tokens) (default: {s.cache})")
    p.add_argument("--device", type=device, help=f"cpu, cuda, cuda:1, ... (default: {s.device})")
    search = p.add_mutually_exclusive_group()
    search.add_argument("--beams", type=f("beams"), help="beam search with this many beams: the "
                        "most likely continuation found, no sampling")
    search.add_argument("--draft", type=Path, help="speculative sampling: a smaller model's "
                        "checkpoint (the same tokenizer) proposes, this one checks")
    p.add_argument("--speculate", type=f("speculate"),
                   help="tokens the draft proposes a round (default: 4; needs --draft)")


def sample_command(args: argparse.Namespace, argv: list[str]) -> int:
    s = SampleSettings(**given(
        checkpoint=args.checkpoint, prompt=args.prompt, max_new_tokens=args.max_new_tokens,
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, greedy=args.greedy,
        seed=args.seed, num_samples=args.num_samples, cache=args.cache, device=args.device,
        beams=args.beams, draft=args.draft, speculate=args.speculate))
    print(("\n" + "-" * 40 + "\n").join(sample_texts(s)))
    return 0


# ------------------------------------------- the assistant's commands: what they share

def add_start(p: argparse.ArgumentParser, model: str, on_device: bool = True) -> None:
    """--checkpoint or --model (not both), the model a command starts from, and --device."""
    start = p.add_mutually_exclusive_group()
    start.add_argument("--checkpoint", type=Path, help="a run's folder (its checkpoint.pt)")
    start.add_argument("--model", type=cached_model, default=model, help="a cached model, "
                       "by name (default: %(default)s; `python -m minigpt pretrained --help` "
                       "names them)")
    if on_device:
        p.add_argument("--device", type=device, default="cpu", help="where the model runs: "
                       "cpu, cuda, cuda:1, ... (default: %(default)s)")


def add_task_flags(p: argparse.ArgumentParser) -> None:
    """The text the tasks are made from, how many, and their seed (set-up's by default)."""
    p.add_argument("--text", type=Path, help="UTF-8 plays to make the tasks from, their first"
                   f" {ASSISTANT_RECIPE.base.train_fraction:.0%}% (default: Shakespeare's)")
    p.add_argument("--n-train", type=count, default=ASSISTANT_RECIPE.n_train,
                   help="training tasks a family (default: %(default)s)")
    p.add_argument("--n-test", type=count, default=ASSISTANT_RECIPE.n_test,
                   help="held-out tasks a family (default: %(default)s)")
    p.add_argument("--task-seed", type=natural, default=ASSISTANT_RECIPE.task_seed,
                   help="the seed of the tasks (default: %(default)s)")


def add_tuning_flags(p: argparse.ArgumentParser, recipe: dict[str, Any]) -> None:
    """Where a tuning run writes, its steps, rate, seed (``recipe``'s by default), threads."""
    p.add_argument("--out", type=Path, required=True,
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
    p.add_argument("--out", type=Path, help="write checkpoint.pt and metrics.json here")
    p.add_argument("--json", type=Path, help="append the run's numbers here, one line")
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
        config = TrainConfig(max_steps=steps, seed=args.seed, **given(lr=lr))
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
    p.add_argument("--cache", type=Path,
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
