"""minigpt.posttrain.classify: GPT-1's classification head on a pretrained GPT, and the
word task."""

from __future__ import annotations

import re
from collections import Counter

import pytest
import torch
import torch.nn.functional as F

from minigpt import GPT, GPTConfig
from minigpt.posttrain.classify import (
    GPTClassifier,
    classification_loss,
    pad_batch,
    scrambled_words,
)

TEXT = ("the quick brown foxes jumped over lazy dogs while seven sleepy otters "
        "watched quietly from riverbanks beneath willows and bright morning clouds "
        "drifting slowly across summer meadows filled with golden flowers")


def _model(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig.debug())


def test_reads_the_last_real_position_of_each_sequence() -> None:
    clf = GPTClassifier(_model(), 3).eval()
    ids, lengths = pad_batch([[1, 2, 3], [4, 5, 6, 7, 8], [9]], pad_id=0)
    class_logits, token_logits = clf(ids, lengths)
    assert class_logits.shape == (3, 3) and token_logits.shape == (3, 5, 16)
    for row in range(3):
        n = int(lengths[row])
        alone_cls, alone_tok = clf(ids[row:row + 1, :n], lengths[row:row + 1])
        # the padding after a sequence changes nothing (causal mask), and the class logits
        # are those of the last real token
        assert torch.allclose(class_logits[row], alone_cls[0], atol=1e-5)
        assert torch.allclose(token_logits[row, :n], alone_tok[0], atol=1e-5)
        # the next-token logits are the GPT's own
        assert torch.allclose(alone_tok[0], clf.gpt(ids[row:row + 1, :n])[0], atol=1e-5)


def test_padding_content_is_ignored_and_the_last_token_matters() -> None:
    clf = GPTClassifier(_model(), 2).eval()
    ids, lengths = pad_batch([[1, 2, 3], [4, 5, 6, 7]], pad_id=0)
    other_pad, _ = pad_batch([[1, 2, 3], [4, 5, 6, 7]], pad_id=11)
    assert torch.allclose(clf(ids, lengths)[0], clf(other_pad, lengths)[0], atol=1e-6)
    changed = ids.clone()
    changed[0, 2] = 12  # the last real token of sequence 0
    assert not torch.allclose(clf(changed, lengths)[0][0], clf(ids, lengths)[0][0])


def test_loss_is_cross_entropy_plus_weighted_language_model_loss() -> None:
    clf = GPTClassifier(_model(), 2).eval()
    seqs = [[1, 2, 3], [4, 5, 6, 7, 8]]
    ids, lengths = pad_batch(seqs, pad_id=0)
    labels = torch.tensor([1, 0])
    class_logits, _ = clf(ids, lengths)
    plain = classification_loss(clf, ids, lengths, labels)
    assert torch.allclose(plain, F.cross_entropy(class_logits, labels))
    # the auxiliary term: every real next-token prediction once, padding never
    logits = [clf.gpt(torch.tensor([s]))[0, :-1] for s in seqs]
    targets = torch.tensor([t for s in seqs for t in s[1:]])
    lm = F.cross_entropy(torch.cat(logits), targets)
    with_lm = classification_loss(clf, ids, lengths, labels, lm_weight=0.5)
    assert torch.allclose(with_lm, plain + 0.5 * lm, atol=1e-6)


def test_fine_tuning_learns_a_separable_task() -> None:
    # sequences ending in token 3 are class 1, those ending in 5 class 0
    clf = GPTClassifier(_model(), 2)
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 16, (4,), generator=gen).tolist() + [3 if i % 2 else 5]
            for i in range(32)]
    ids, lengths = pad_batch(seqs)
    labels = torch.tensor([i % 2 for i in range(32)])
    opt = torch.optim.AdamW(clf.parameters(), lr=1e-2)
    for _ in range(60):
        loss = classification_loss(clf, ids, lengths, labels, lm_weight=0.5)
        opt.zero_grad()
        loss.backward()
        opt.step()
    clf.eval()
    assert (clf(ids, lengths)[0].argmax(-1) == labels).all()


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: GPTClassifier(_model(), 1), "num_classes must be >= 2, got 1"),
        (lambda: GPTClassifier(_model(), 0), "num_classes must be >= 2, got 0"),
    ],
)
def test_bad_classifier_arguments(make: object, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        make()  # type: ignore[operator]


def test_bad_batches_are_refused() -> None:
    clf = GPTClassifier(_model(), 2)
    ids, lengths = pad_batch([[1, 2], [3]])
    # ids come from a tokenizer; their length is checked where they enter the GPT
    with pytest.raises(ValueError, match="sequence length T=9 exceeds context_length=8"):
        clf(torch.zeros(1, 9, dtype=torch.long), torch.tensor([9]))
    # labels are checked by the cross-entropy itself
    with pytest.raises(IndexError, match="Target 2 is out of bounds"):
        classification_loss(clf, ids, lengths, torch.tensor([0, 2]))
    with pytest.raises(ValueError, match="lm_weight must be >= 0"):
        classification_loss(clf, ids, lengths, torch.tensor([0, 1]), lm_weight=-1.0)
    with pytest.raises(ValueError, match="no empty one"):
        pad_batch([[1], []])


def test_scrambled_words_are_balanced_disjoint_and_seeded() -> None:
    vocabulary = set(re.findall(r"[a-z]+", TEXT))
    train, test = scrambled_words(TEXT, 12, 6, seed=3)
    assert (train, test) == scrambled_words(TEXT, 12, 6, seed=3)
    assert (train, test) != scrambled_words(TEXT, 12, 6, seed=4)
    assert len(train) == 12 and len(test) == 6
    letters = Counter()
    for text, label in train + test:
        word = text.strip()
        assert text == f" {word} " and 5 <= len(word) <= 9
        if label == 1:
            assert word in vocabulary
        else:
            assert word not in vocabulary  # a scramble that is not itself a word
            assert any(sorted(word) == sorted(w) for w in vocabulary)
        letters[label] += 1
    assert letters[0] > 0 and letters[1] > 0
    sources = [{"".join(sorted(t.strip())) for t, _ in part} for part in (train, test)]
    assert not sources[0] & sources[1]  # no word on both sides (up to its letters)


def test_scrambled_words_refuses_impossible_requests() -> None:
    with pytest.raises(ValueError, match=r"n_train \+ n_test <= \d+"):
        scrambled_words(TEXT, 100, 100, seed=0)
    with pytest.raises(ValueError, match="need 1 <= min_length <= max_length"):
        scrambled_words(TEXT, 1, 1, seed=0, min_length=6, max_length=5)
