"""How the package's matrix products are compiled and loaded (minigpt.products.build and
install): one process compiles at a time, a compile that dies leaves nothing to wait on, a
compile that takes too long is given up on with a clear error, and a library that will not
load is compiled again once. The compiler itself is stood in for (copying a library, or
writing junk) where a real compile would only cost time; `import minigpt` everywhere else in
the tests compiles for real."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from minigpt import products


@pytest.fixture
def folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty extensions folder for the test's builds."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))
    return tmp_path / "extensions" / "minigpt"


def holder(library: Path, *, die: bool) -> subprocess.Popen[str]:
    """A process that starts compiling ``library`` (under the build's lock, through
    `products.build`) and never finishes: it hangs, or (``die``) is killed as it writes."""
    code = textwrap.dedent(f"""
        import os, signal, sys, time
        from pathlib import Path
        from minigpt import products
        def compile_library(out: Path) -> None:
            out.write_bytes(b"half a library")
            print("compiling", flush=True)
            if {die}:
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(600)
        products.compile_library = compile_library
        products.build(say=lambda line: None)
    """)
    process = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                               env=os.environ | {"MINIGPT_PRODUCTS": "native"})
    assert process.stdout is not None and process.stdout.readline() == "compiling\n"
    return process


def fake_compile(out: Path) -> None:
    out.write_bytes(b"a library")


def test_a_killed_compile_leaves_nothing_to_wait_on(folder: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    killed = holder(products.library_path(), die=True)
    assert killed.wait(timeout=60) == -signal.SIGKILL
    assert list(folder.glob("*.part")), "the killed compile left its part-written file"
    monkeypatch.setattr(products, "compile_library", fake_compile)
    monkeypatch.setattr(products, "LOCK_WAIT", 5.0)
    said: list[str] = []
    began = time.perf_counter()
    library = products.build(say=said.append)
    assert time.perf_counter() - began < 5, "waited on the dead process's lock"
    assert library.read_bytes() == b"a library"
    assert not any("waiting" in line for line in said)
    assert said[0].startswith("minigpt: compiling its matrix products")
    assert said[1].startswith("minigpt: compiled its matrix products in ")


def test_a_compile_that_does_not_end_is_given_up_on(folder: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    hung = holder(products.library_path(), die=False)
    try:
        monkeypatch.setattr(products, "compile_library", fake_compile)
        monkeypatch.setattr(products, "LOCK_WAIT", 1.0)
        said: list[str] = []
        with pytest.raises(RuntimeError, match=rf"process {hung.pid} has been compiling .* "
                           r"for 1 s and has not finished \(.*\.lock is held\)"):
            products.build(say=said.append)
        assert said == [f"minigpt: waiting for process {hung.pid} to compile its matrix "
                        f"products ({products.library_path()})"]
        assert not products.library_path().exists(), "the hung process's half is not used"
    finally:
        hung.kill()
        hung.wait()
    assert products.build(say=lambda line: None).read_bytes() == b"a library"


def test_a_library_no_compiler_can_make_is_a_clear_error(folder: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CXX", str(folder / "no-such-compiler"))
    with pytest.raises(RuntimeError, match=r"could not compile its matrix products .* needs a "
                       r"C\+\+ compiler.* MINIGPT_PRODUCTS=native.*/no-such-compiler could "
                       "not be run"):
        products.build(say=lambda line: None)
    assert not list(folder.glob("*.so*")), "nothing half-made is left to load"


def test_a_library_that_will_not_load_is_compiled_again_once(
        folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Junk every time: loading fails before anything is registered, so this runs here.
    monkeypatch.setattr(products, "compile_library", fake_compile)
    monkeypatch.setattr(products, "_loaded", [])
    monkeypatch.setattr(products, "applies", lambda: True)
    said: list[str] = []
    with pytest.raises(RuntimeError, match="compiled again into .*, still will not load"):
        products.install(say=said.append)
    assert sum("would not load" in line for line in said) == 1
    assert sum(line.startswith("minigpt: compiling") for line in said) == 2


@pytest.mark.skipif(not products.applies(), reason="the package's products are compiled on "
                    "Linux x86-64 only (elsewhere PyTorch's own run)")
def test_a_damaged_library_is_replaced_and_the_products_run(folder: Path) -> None:
    """A library cut to 100 bytes (a copy cut short): the next import says so, compiles it
    again (here: copies this process's library) and runs the package's products."""
    folder.mkdir(parents=True)
    damaged = products.library_path()
    shutil.copyfile(products._loaded[0], damaged)
    with damaged.open("r+b") as file:
        file.truncate(100)
    code = textwrap.dedent(f"""
        import os, shutil
        from minigpt import products  # with MINIGPT_PRODUCTS=native: nothing loaded yet
        products.compile_library = lambda out: shutil.copyfile({str(products._loaded[0])!r}, out)
        os.environ["MINIGPT_PRODUCTS"] = "chains"
        products.install()
        import torch
        a = torch.ones(5, 300)
        print(products.mode(), (a @ a.T)[0, 0].item())
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=os.environ | {"MINIGPT_PRODUCTS": "native"}, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "fma chains 300.0\n"
    lines = done.stderr.splitlines()
    assert lines[0].startswith(f"minigpt: {damaged} would not load (")
    assert lines[1].startswith("minigpt: compiling its matrix products")
    assert damaged.stat().st_size == products._loaded[0].stat().st_size
