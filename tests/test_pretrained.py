"""The cached book model: built once, reloaded without training, rebuilt when damaged.

Every test uses a tiny recipe (one layer, ten steps: well under a second) on a small text,
and a temporary cache root (MINIGPT_CACHE), so the real cache is never touched.
"""

import json
import os
import re
import subprocess
import sys
import warnings

import pytest
import torch

from minigpt import products
from minigpt.assets import MissingAssetError
from minigpt.cli import main
from minigpt.config import TrainConfig
from minigpt.recipes import assistant, catalogue, copiers, pretrained, rewards, runs
from minigpt.recipes.pretrained import MANIFEST_NAME, WEIGHTS_NAME, Recipe, load_or_build

TEXT = (
    "ROMEO:\nBut, soft! what light through yonder window breaks?\n\n"
    "JULIET:\nO Romeo, Romeo! wherefore art thou Romeo?\n\n"
) * 20

TINY = Recipe(
    n_layers=1, n_heads=2, d_model=16, context_length=16,
    training=TrainConfig(batch_size=4, max_steps=10, warmup_steps=2, eval_interval=5,
                         eval_steps=2, seed=0),
    threads=1,
)


@pytest.fixture(autouse=True)
def tmp_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MINIGPT_CACHE", str(tmp_path))
    return tmp_path


def _state(model):
    return {name: t.clone() for name, t in model.state_dict().items()}


def _assert_same_weights(a, b):
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_build_writes_weights_and_a_manifest_with_their_hash(tmp_cache):
    model, tokenizer, info = load_or_build(TINY, TEXT, progress=False)
    assert info.built
    assert info.path.parent == tmp_cache / "models"
    assert tokenizer.decode(tokenizer.encode("Romeo")) == "Romeo"
    assert model.config.vocab_size == tokenizer.vocab_size == len(set(TEXT))
    assert (model.config.n_layers, model.config.d_model) == (1, 16)
    assert not model.training
    manifest = json.loads((info.path / MANIFEST_NAME).read_text())
    assert manifest["key"] == info.key
    assert manifest["weights_sha256"] == pretrained.sha256_file(info.path / WEIGHTS_NAME)
    assert manifest["metrics"]["steps"] == 10
    assert manifest["key_material"]["train_config"]["seed"] == 0
    # The census of the products training computed (minigpt.products), on the recipe's one
    # thread: the linear layers' and their gradients' (mm), attention's (bmm).
    if products.mode() != "native":
        assert {entry[0] for entry in manifest["products"]} == {"mm", "bmm"}
        assert {entry[8] for entry in manifest["products"]} == {1}
    # Nothing half-written is left behind.
    assert sorted(p.name for p in info.path.iterdir()) == [MANIFEST_NAME, WEIGHTS_NAME]


def test_second_call_loads_without_training(monkeypatch):
    first, _, info1 = load_or_build(TINY, TEXT, progress=False)
    monkeypatch.setattr(pretrained, "train", _refuse_training)
    second, _, info2 = load_or_build(TINY, TEXT, progress=False)
    assert not info2.built and info2.key == info1.key
    _assert_same_weights(_state(first), _state(second))
    assert info2.metrics == info1.metrics


def _refuse_training(*args, **kwargs):
    raise AssertionError("train() was called, but the cache should have been used")


def test_builds_are_deterministic(tmp_path):
    first, _, info1 = load_or_build(TINY, TEXT, progress=False, cache=tmp_path / "a")
    second, _, info2 = load_or_build(TINY, TEXT, progress=False, cache=tmp_path / "b")
    assert info1.built and info2.built and info1.key == info2.key
    _assert_same_weights(_state(first), _state(second))
    assert info1.manifest["weights_sha256"] == info2.manifest["weights_sha256"]


def test_key_changes_with_everything_that_shapes_the_weights():
    base = pretrained.cache_key(pretrained.key_material(TINY, TEXT))
    variants = [
        (Recipe(**{**dict(TINY), "d_model": 32}), TEXT),
        (Recipe(**{**dict(TINY), "training": TINY.training.model_copy(update={"seed": 1})}),
         TEXT),
        (Recipe(**{**dict(TINY), "threads": 2}), TEXT),
        (TINY, TEXT + "x"),
    ]
    keys = {pretrained.cache_key(pretrained.key_material(r, t)) for r, t in variants}
    assert base not in keys and len(keys) == len(variants)


_SHIFTED = """
import json, sys
from minigpt.config import TrainConfig
from minigpt.recipes import pretrained
from minigpt.recipes.pretrained import Recipe, load_or_build
recipe = Recipe(**json.loads(sys.argv[1]))
model, _, info = load_or_build(recipe, sys.argv[2], progress=False)
print(json.dumps([info.key, info.built, pretrained.environment()["seed_shift"],
                  pretrained.weights_bytes(model).hex()]))
"""


def test_a_seed_shift_trains_other_weights_under_another_key(tmp_cache) -> None:
    """Under a redraw (MINIGPT_SEED_SHIFT) the same recipe trains other weights, kept under
    another key: a redrawn model never stands in for the book's, nor the other way round."""
    model, _, info = load_or_build(TINY, TEXT, progress=False)

    def shifted(shift: str) -> list:
        env = {**os.environ, "MINIGPT_CACHE": str(tmp_cache), "MINIGPT_SEED_SHIFT": shift}
        done = subprocess.run([sys.executable, "-c", _SHIFTED, TINY.model_dump_json(), TEXT],
                              env=env, capture_output=True, text=True, check=True)
        return json.loads(done.stdout)

    key, built, shift, weights = shifted("1")
    assert (built, shift) == (True, 1) and key != info.key
    assert weights != pretrained.weights_bytes(model).hex()
    assert shifted("0") == [info.key, False, 0, pretrained.weights_bytes(model).hex()]


def _corrupt_one_byte(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_corrupted_weights_are_detected_and_rebuilt(caplog):
    reference, _, info = load_or_build(TINY, TEXT, progress=False)
    _corrupt_one_byte(info.path / WEIGHTS_NAME)
    with pytest.warns(RuntimeWarning, match="corrupted"):
        rebuilt, _, info2 = load_or_build(TINY, TEXT, progress=False)
    assert info2.built
    assert "rebuilding" in caplog.text
    _assert_same_weights(_state(reference), _state(rebuilt))
    # The rebuilt cache is sound again: the next call loads it quietly.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _, _, info3 = load_or_build(TINY, TEXT, progress=False)
    assert not info3.built


def _replace_weights(folder, data: bytes) -> None:
    """Overwrite a cached model's weights with `data` and record its hash, as if it were valid."""
    (folder / WEIGHTS_NAME).write_bytes(data)
    manifest_path = folder / MANIFEST_NAME
    manifest = json.loads(manifest_path.read_text())
    manifest["weights_sha256"] = pretrained.hashlib.sha256(data).hexdigest()
    manifest_path.write_text(json.dumps(manifest))


def test_unreadable_weights_with_a_matching_hash_are_rebuilt():
    _, _, info = load_or_build(TINY, TEXT, progress=False)
    _replace_weights(info.path, b"this is not a torch file")
    with pytest.warns(RuntimeWarning, match="unreadable"):
        _, _, info2 = load_or_build(TINY, TEXT, progress=False)
    assert info2.built


def test_unreadable_manifest_is_rebuilt():
    _, _, info = load_or_build(TINY, TEXT, progress=False)
    (info.path / MANIFEST_NAME).write_text("{ not json")
    with pytest.warns(RuntimeWarning, match="manifest is unreadable"):
        _, _, info2 = load_or_build(TINY, TEXT, progress=False)
    assert info2.built


def test_mismatched_manifest_is_rebuilt():
    _, _, info = load_or_build(TINY, TEXT, progress=False)
    manifest_path = info.path / MANIFEST_NAME
    manifest = json.loads(manifest_path.read_text())
    manifest["key_material"]["model_config"]["d_model"] = 32  # another configuration
    manifest_path.write_text(json.dumps(manifest))
    with pytest.warns(RuntimeWarning, match="different recipe"):
        model, _, info2 = load_or_build(TINY, TEXT, progress=False)
    assert info2.built and model.config.d_model == 16


def test_weights_of_another_shape_are_rebuilt():
    _, _, info = load_or_build(TINY, TEXT, progress=False)
    other, _, other_info = load_or_build(Recipe(**{**dict(TINY), "d_model": 32}), TEXT,
                                         progress=False)
    # Put the wider model's weights into the narrow model's cache, with a consistent hash.
    _replace_weights(info.path, (other_info.path / WEIGHTS_NAME).read_bytes())
    with pytest.warns(RuntimeWarning, match="does not fit"):
        model, _, info2 = load_or_build(TINY, TEXT, progress=False)
    assert info2.built and model.config.d_model == 16
    assert other.config.d_model == 32


def test_book_model_uses_the_corpus_and_keeps_the_callers_random_state(monkeypatch):
    monkeypatch.setattr(pretrained, "corpus", lambda: TEXT)
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    model, tokenizer, info = pretrained.book_model(progress=False, recipe=TINY)
    assert torch.equal(torch.rand(3), expected)  # built: random state untouched
    torch.manual_seed(123)
    _, _, info2 = pretrained.book_model(progress=False, recipe=TINY)
    assert torch.equal(torch.rand(3), expected)  # loaded: untouched as well
    assert info.built and not info2.built
    assert info.key == pretrained.cache_key(pretrained.key_material(TINY, TEXT))


def test_bad_arguments():
    with pytest.raises(ValueError, match="threads\n  Input should be greater than or equal to 1"):
        Recipe(threads=0)
    with pytest.raises(ValueError, match="train_fraction\n  Input should be less than 1"):
        Recipe(train_fraction=1.0)
    with pytest.raises(ValueError, match=r"\['nrom'\] are not GPTConfig fields"):
        Recipe(layout={"nrom": "rmsnorm"})
    with pytest.raises(ValueError, match="divisible"):
        Recipe(d_model=30, n_heads=4)
    with pytest.raises(ValueError, match="at least two"):
        load_or_build(TINY, "")


def test_book_model_prints_nothing_whether_it_trains_or_loads(monkeypatch, capsys):
    # A chapter shows what a cell prints: the same on a fresh machine and a warm one.
    monkeypatch.setattr(pretrained, "corpus", lambda: TEXT)
    _, _, built = pretrained.book_model(recipe=TINY)
    _, _, loaded = pretrained.book_model(recipe=TINY)
    assert built.built and not loaded.built
    assert capsys.readouterr() == ("", "")


def test_the_command_trains_once_then_verifies(monkeypatch, capsys):
    monkeypatch.setattr(pretrained, "corpus", lambda: TEXT)
    monkeypatch.setattr(catalogue, "MODELS", {
        "tiny": lambda progress: pretrained.book_model(progress=progress, recipe=TINY)})
    assert main(["pretrained", "--quiet"]) == 0
    first = capsys.readouterr()
    assert "tiny model (" in first.out and "trained in" in first.out and first.err == ""
    # its CPU time split: training, then evaluation (the validation losses); no sampling
    split = re.search(r"CPU time: training (\d+) s, sampling 0 s, evaluation (\d+) s",
                      first.out)
    assert split, first.out
    assert main(["pretrained"]) == 0
    assert "loaded and verified" in capsys.readouterr().out
    assert main(["pretrained", "--only", "tiny"]) == 0


def test_the_command_reports_errors(monkeypatch, capsys):
    def missing():
        raise MissingAssetError("Shakespeare's plays are not in /nowhere; run `make setup`")

    monkeypatch.setattr(pretrained, "corpus", missing)
    assert main(["pretrained", "--quiet", "--only", "book"]) == 1
    err = capsys.readouterr().err
    assert "minigpt pretrained: error: Shakespeare's plays are not in" in err
    assert "Traceback" not in err
    assert main(["pretrained", "--only", "huge"]) == 2
    assert "--only: invalid choice: 'huge' (choose from " in capsys.readouterr().err


def test_the_command_logs_evaluations_but_no_bar_when_stderr_is_not_a_terminal(
        monkeypatch, capsys):
    # A CI runner's log gets a few lines, not a thousand redraws of a progress bar.
    monkeypatch.setattr(pretrained, "corpus", lambda: TEXT)
    monkeypatch.setattr(catalogue, "MODELS", {
        "tiny": lambda progress: pretrained.book_model(progress=progress, recipe=TINY)})
    assert main(["pretrained"]) == 0
    captured = capsys.readouterr()
    assert "training a model once (1 layer, 2 heads, D=16, 10 steps)" in captured.err
    assert "step 5: train loss" in captured.err
    assert "\r" not in captured.err and "%|" not in captured.err
    assert len(captured.err.splitlines()) < 10
    assert captured.out.count("\n") == 1 and "tiny model (" in captured.out


def test_the_command_has_help(capsys):
    assert main(["pretrained", "--help"]) == 0
    out = capsys.readouterr().out
    assert "usage: python -m minigpt pretrained" in out and "--only" in out


@pytest.mark.parametrize(("module", "listed"), [
    ("minigpt.recipes.pretrained", pretrained.TRAINING_MODULES),
    ("minigpt.recipes.assistant", assistant.ASSISTANT_MODULES),
    ("minigpt.recipes.rewards", rewards.REWARDS_MODULES),
    ("minigpt.recipes.copiers", copiers.COPIER_MODULES),
    ("minigpt.recipes.runs", runs.RUN_MODULES),
])
def test_the_cache_key_hashes_every_module_that_trains(module: str,
                                                       listed: tuple[str, ...]) -> None:
    # The package's modules that importing `module` loads, in a fresh interpreter: the code
    # its models are trained by, whose source must be in their cache key.
    loaded = subprocess.run(
        [sys.executable, "-c", f"import sys, {module}; print(*sorted(sys.modules))"],
        capture_output=True, text=True, check=True).stdout.split()
    names = {"__init__" if m == "minigpt" else m.removeprefix("minigpt.")
             for m in loaded if m == "minigpt" or m.startswith("minigpt.")}
    assert names == set(listed)


def test_the_cache_key_holds_the_training_source() -> None:
    material = pretrained.key_material(pretrained.DRAFT_RECIPE, "to be or not to be")
    assert material["source_sha256"] == pretrained.source_sha256(pretrained.TRAINING_MODULES)
    # the products' Python, their C++ and the kernels' core it includes
    assert [p.name for p in pretrained.module_files("products")] == [
        "products.py", "products.cpp", "gemm.h"]
    # a module more, or another order, is another hash
    assert pretrained.source_sha256(("nn", "model")) != pretrained.source_sha256(("nn",))
    assert pretrained.source_sha256(("nn", "model")) != pretrained.source_sha256(
        ("model", "nn"))


def test_comments_docstrings_and_blank_lines_are_not_part_of_the_key(tmp_path) -> None:
    # Every module that trains, with prose added (a comment, a docstring line, blank lines,
    # trailing spaces), keeps its code text; a change to what it computes does not.
    names = sorted({*rewards.REWARDS_MODULES, *copiers.COPIER_MODULES})
    for path in [path for name in names for path in pretrained.module_files(name)]:
        source = path.read_text(encoding="utf-8")
        code = pretrained.code_text(path)
        copy = tmp_path / path.name
        cpp = path.suffix in (".cpp", ".h")
        comment = "  // a note" if cpp else "  # a note"
        lines = source.splitlines()
        # A comment after the first line of code, blank lines and spaces at the end.
        first = next(i for i, line in enumerate(lines) if line and not line.startswith(
            ("#", "/", " ", '"')))
        lines[first] += comment
        copy.write_text("\n".join(lines) + "\n\n   \n", encoding="utf-8")
        assert pretrained.code_text(copy) == code, path.name
        # A line of code more: another code text.
        copy.write_text(source + ("int x = 0;\n" if cpp else "x = 0\n"),
                        encoding="utf-8")
        assert pretrained.code_text(copy) != code, path.name


def test_a_docstring_is_prose_and_a_string_in_code_is_not(tmp_path) -> None:
    module = tmp_path / "m.py"
    module.write_text('"""Module."""\n\n\ndef f(x):\n    """Twice x.\n\n    More."""\n'
                      '    s = "# not a comment"  # a comment\n    return 2 * x, s\n',
                      encoding="utf-8")
    code = pretrained.code_text(module)
    assert code == 'def f(x):\n    s = "# not a comment"\n    return 2 * x, s\n'
    module.write_text(module.read_text().replace("Twice x.", "Double x."), encoding="utf-8")
    assert pretrained.code_text(module) == code
    module.write_text(module.read_text().replace("# not a comment", "#"), encoding="utf-8")
    assert pretrained.code_text(module) != code
    source = tmp_path / "k.cpp"
    source.write_text('/* a\n block */ int f() { // line\n  return 2; /* x */ }\n'
                      'const char* s = "// not a comment";\n', encoding="utf-8")
    assert [line.strip() for line in pretrained.code_text(source).splitlines()] == [
        "int f() {", "return 2;         }", 'const char* s = "// not a comment";']
