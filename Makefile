# Two set-up commands on a fresh machine: `make book` and `make test`.
# Both create the virtual environment in .venv if it is missing.

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
ASSETS := _build/assets
ASSET_STAMP := $(ASSETS)/.fetched
# Versions of the JavaScript the static site serves itself (fetched at build time).
HTML_MANAGER := @jupyter-widgets/html-manager@1.0.15
REQUIREJS := requirejs@2.3.8
MATHJAX := mathjax@3.2.2
EXECUTE_TIMEOUT ?= 900
NOTEBOOKS = $(sort $(wildcard chapters/*.ipynb exercises/*.ipynb solutions/*.ipynb))

.PHONY: pdf student-pdf test-pdf book html test lab jupyterlab-test execute bench bench-figures reference-env test-reference student-book student-kit unit nbval nbval-kernel nbval-kernel-run build-check browser-test leak-test assets venv clean help

help:
	@echo "make book          build the HTML book into _build/html, with its PDF editions in downloads/ (about 8 min)"
	@echo "make html          the HTML book alone (about 20 s)"
	@echo "make test          run the whole test suite (unit tests, nbval, strict build, browser, student edition)"
	@echo "make test-quick    the inner loop: unit tests (a tenth of the hypothesis examples), nbval on notebooks changed since main"
	@echo "make lab           open JupyterLab on the book with the package importable (and jupyterlab-myst)"
	@echo "make kit-tests     the student kit installed per its README into a fresh venv, a chapter and an exercise run there, and make jupyterlab-test on it"
	@echo "make jupyterlab-test every notebook in JupyterLab from the student kit's environment, checked in headless Chromium"
	@echo "make execute       re-execute every notebook in place from a clean kernel"
	@echo "make bench         time the chunkwise delta rule against the recurrence and the GEMM limit, and chapter 9's training step against torch"
	@echo "make reference-env a separate venv with torch and transformers, which make bench then compares with"
	@echo "make test-reference the book's layers against transformers' (same weights in), and their init laws; leaves the tree as committed"
	@echo "make update-reference rerun that comparison into results/ and re-execute the appendix page that shows it"
	@echo "make bench-figures time one update of every interactive figure in live mode (median, 95th percentile)"
	@echo "make student-book  build the student edition (no solutions) into _build/student/html"
	@echo "make test-pythons  install the wheel on Python 3.11 to the newest here (newest and oldest declared dependencies), run the unit tests and a chapter"
	@echo "make pdf           the book as one PDF, _build/pdf/fixed-state-sequence-layers.pdf (also in the site's downloads/)"
	@echo "make student-pdf   the student edition as a PDF (no solutions, no instructor's guide)"
	@echo "make test-pdf      build both PDFs and check them (page count, titles, exercises, leaks, margins, formulas)"
	@echo "make student-kit   one zip for students: chapter and exercise notebooks, the package wheel, pinned requirements"
	@echo "make grade         grade a folder of exercise notebooks, each sealed in a sandbox: make grade SUBMISSIONS=<folder>"
	@echo "make grade-attack-test  grade the attack class next to honest students and check that nothing leaked"
	@echo "make experiment    chapter 9's recall-against-state sweep on every core (SWEEP_ARGS='--engine dask ...' for a cluster); writes results/mqar_recall.json"
	@echo "make experiment-quick  its quick subset (under 10 min on a 2-core machine); writes results/mqar_quick.json"
	@echo "make experiment-small  chapter 9's first, small sweep (about 8 min); writes results/mqar_sweep.json"
	@echo "make experiment-ssd  chapter 9's pre-registered follow-up: the SSD with its step initialised at 0.01 (a few min); writes results/mqar_ssd_followup.json"

venv: $(STAMP)

$(STAMP): pyproject.toml requirements-lock.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade "pip>=24"
	$(BIN)/python -m pip install --quiet -c requirements-lock.txt -e ".[book,test,sweep]"
	touch $(STAMP)

assets: $(ASSET_STAMP)

$(ASSET_STAMP): Makefile tools/fetch_assets.py
	bash tools/system_deps.sh npm
	$(BIN)/python tools/fetch_assets.py $(ASSETS) $(HTML_MANAGER) $(REQUIREJS) $(MATHJAX)
	touch $(ASSET_STAMP)

# The build also writes downloads/: the wheel of fixedstate and the book kit (tools/sphinx_ext/downloads.py).
# `make book` is the whole site as readers get it: the HTML, then the two PDF editions that its preface
# and instructor's guide link, written into its downloads/ (about 8 minutes; `make html` is the HTML alone).
book: pdf student-pdf
	@echo "The book: $(CURDIR)/_build/html/index.html (downloads, PDFs included: $(CURDIR)/_build/html/downloads)"

html: $(STAMP) $(ASSET_STAMP)
	$(BIN)/jupyter-book build . --builder html
	@echo "The HTML book: $(CURDIR)/_build/html/index.html (downloads: $(CURDIR)/_build/html/downloads; the PDFs come with make book)"

student-book: $(STAMP) $(ASSET_STAMP)
	$(BIN)/python tools/student_toc.py _toc.yml _build/student_toc.yml
	$(BIN)/jupyter-book build . --builder html --toc _build/student_toc.yml --path-output _build/student -W -n --keep-going
	@echo "The student edition: $(CURDIR)/_build/student/_build/html/index.html"

# The PDF editions (issue #33): the HTML edition printed by headless Chromium, with a table of
# contents, bookmarks, page numbers and running headers (tools/pdf.py); a copy goes to the site's
# downloads/, which the preface and the instructor's guide link. make test-pdf builds and checks both.
PDF_DIR := _build/pdf
pdf: html
	bash tools/system_deps.sh chromium
	$(BIN)/python tools/pdf.py _build/html _toc.yml $(PDF_DIR)/fixed-state-sequence-layers.pdf --edition book \
	  --serve _build/html

student-pdf: student-book
	bash tools/system_deps.sh chromium
	$(BIN)/python tools/pdf.py _build/student/_build/html _build/student_toc.yml \
	  $(PDF_DIR)/fixed-state-sequence-layers-student.pdf --edition student \
	  --serve _build/student/_build/html $(if $(wildcard _build/html/index.html),--serve _build/html)

# Both HTML editions built (strict), then tests/test_pdf.py prints both PDFs and reads them back;
# tools/system_deps.sh also installs pdftoppm (poppler-utils), to draw pages of them as pictures.
# The strict builds make test made are reused when they were built from the tree as it is now
# (tools/strict_builds.sh --reuse; .ci/run calls make test first); otherwise both are built here.
test-pdf: $(STAMP) $(ASSET_STAMP)
	bash tools/system_deps.sh chromium pdftoppm
	bash tools/strict_builds.sh --reuse
	$(BIN)/python -m pytest tests/test_pdf.py -m pdf -q -p no:cacheprovider -s

# The notebooks students run (chapters, exercises; no solutions), the wheel, requirements.txt
# and a README of two commands, in one zip (tools/kit.py); the student edition serves the same kit.
student-kit: $(STAMP)
	$(BIN)/python tools/kit.py student-kit _build

# The kit unpacked outside the repository, installed per its README into a fresh venv (PyPI for
# the pinned dependencies), a chapter and an exercise run from it; minutes, so .ci/run runs it
# after make test rather than make test itself (make kit-tests, with the JupyterLab test below).
.PHONY: kit-test
kit-test: $(STAMP)
	$(BIN)/python -m pytest tests/test_kit.py -q -m kit -p no:cacheprovider

# The two above in one run, on one installation of the kit per its README into a fresh venv (tests/conftest.py):
# what .ci/run calls.
.PHONY: kit-tests
kit-tests: $(STAMP)
	bash tools/system_deps.sh chromium
	$(BIN)/python -m pytest tests/test_kit.py tests/test_jupyterlab.py -q -m kit -p no:cacheprovider

# Every chapter, exercise, solution and appendix notebook opened in JupyterLab (jupyterlab-myst) from
# the student kit's environment, in headless Chromium: no MyST markup left, no math error, every
# exercise numbered with its points; screenshots in _build/jupyterlab/screenshots (tests/test_jupyterlab.py).
# Installs the kit (PyPI) on its first run, so .ci/run calls it after make test.
.PHONY: jupyterlab-test
jupyterlab-test: $(STAMP)
	bash tools/system_deps.sh chromium
	$(BIN)/python -m pytest tests/test_jupyterlab.py -q -m kit -p no:cacheprovider

# The wheel on every Python from 3.11 to the newest on this machine (3.11, 3.12, 3.13 at least; a missing
# one fails), each with the newest dependencies it can get and, on 3.11, once with the lowest versions the
# wheel declares: installed into fresh venvs, the unit tests and one chapter run there (tools/test_pythons.py).
# Minutes, so .ci/run runs it after make test; the table of versions and results is in _build/pythons/report.md.
.PHONY: test-pythons
test-pythons: $(STAMP)
	$(BIN)/python tools/test_pythons.py --out _build/pythons

test: $(STAMP) $(ASSET_STAMP)
	bash tools/system_deps.sh npm chromium
	bash tools/run_tests.sh

# The inner loop before a commit (about a minute): the unit tests with a tenth of the hypothesis
# examples, and nbval on the notebooks changed since main. make test stays the full suite.
.PHONY: test-quick
test-quick: $(STAMP)
	bash tools/test_quick.sh

WORKERS ?= $(or $(TEST_WORKERS),$(shell nproc 2>/dev/null || echo 2))

unit: $(STAMP)
	FIXEDSTATE_TEST_PROFILE=full FIXEDSTATE_TIMING= $(BIN)/python -m pytest tests -q \
	  -m "not browser and not site and not kit and not grade_attack and not pdf" -n $(WORKERS) --dist loadscope

# A notebook's cells run in order in one kernel: --dist loadfile keeps each notebook on one worker.
# FIXEDSTATE_TIMING=once: timing cells (outputs not compared) make one run each (fixedstate.timing).
nbval: $(STAMP)
	FIXEDSTATE_TIMING=once FIXEDSTATE_FIGURES=frames $(BIN)/python -m pytest --nbval --nbval-current-env \
	  --nbval-sanitize-with tests/nbval_sanitize.cfg --nbval-cell-timeout=600 -p no:cacheprovider \
	  -n $(WORKERS) --dist loadfile chapters exercises solutions appendix

# The notebooks under a second OpenBLAS kernel (not this processor's own): .ci/run calls it
# after make test, so outputs that show one kernel's last-bit rounding fail on any machine.
nbval-kernel: $(STAMP)
	OPENBLAS_CORETYPE=$$($(BIN)/python tools/blas_kernel.py --other) $(MAKE) --no-print-directory nbval-kernel-run

nbval-kernel-run:
	@echo "nbval under OpenBLAS kernel $$OPENBLAS_CORETYPE (this processor's own: $$(env -u OPENBLAS_CORETYPE $(BIN)/python tools/blas_kernel.py))"
	@test "$$($(BIN)/python tools/blas_kernel.py)" = "$$OPENBLAS_CORETYPE"
	$(MAKE) --no-print-directory nbval

# The venv's JupyterLab has jupyterlab-myst (the book extra), which renders the notebooks' MyST:
# formulas, cross-references, citations, exercises and the glued numbers (tools/sphinx_ext/portable_myst.py).
# As root (a container, a CI machine) Jupyter refuses to start without --allow-root.
lab: $(STAMP)
	$(BIN)/jupyter lab --notebook-dir=$(CURDIR) $(if $(filter 0,$(shell id -u)),--allow-root,)

execute: $(STAMP)
	@for nb in $(NOTEBOOKS); do \
	  echo "executing $$nb"; \
	  FIXEDSTATE_TIMING= FIXEDSTATE_FIGURES=frames timeout $(EXECUTE_TIMEOUT) $(BIN)/python tools/execute_notebook.py "$$nb" || exit 1; \
	done

bench: $(STAMP)
	FIXEDSTATE_TIMING= $(BIN)/python benchmarks/delta_rule_bench.py
	FIXEDSTATE_TIMING= $(BIN)/python benchmarks/ssd_bench.py
	FIXEDSTATE_TIMING= $(BIN)/python benchmarks/training_step_bench.py

# Grade a folder of submitted exercise notebooks (the "Grading" section of appendix/instructors.md):
#   make grade SUBMISSIONS=<folder> [CHAPTERS="03 04"] [ROSTER=roster.csv] [DEADLINE=2026-03-01T23:59]
#              [GRADE_OUT=<dir>] [GRADE_FLAGS="--late-penalty 10 --grace 15"]
# Without SUBMISSIONS, grade a fake class generated from the current exercises and solutions.
# Each notebook runs in a bubblewrap sandbox: tools/system_deps.sh installs bwrap if it is missing.
.PHONY: grade grade-attack-test
SUBMISSIONS ?=
CHAPTERS ?=
ROSTER ?=
DEADLINE ?=
GRADE_OUT ?= _build/grade
GRADE_FLAGS ?=
GRADE_FIXTURES := _build/grade/fixtures
GRADE_VARS := SUBMISSIONS CHAPTERS ROSTER DEADLINE GRADE_OUT GRADE_FLAGS PYTHON TEST_WORKERS WORKERS
ifneq ($(filter grade,$(MAKECMDGOALS)),)
GRADE_UNKNOWN := $(filter-out $(GRADE_VARS),$(foreach v,$(.VARIABLES),$(if $(filter command line,$(origin $(v))),$(v))))
ifneq ($(GRADE_UNKNOWN),)
$(error make grade: unknown variable $(GRADE_UNKNOWN); it takes SUBMISSIONS=<folder> CHAPTERS= ROSTER= DEADLINE= GRADE_OUT= GRADE_FLAGS= (a typo such as SUBMISSION= would otherwise grade the fake class))
endif
endif
grade: $(STAMP)
	bash tools/system_deps.sh bwrap
	$(if $(SUBMISSIONS),,rm -rf $(GRADE_FIXTURES) && $(BIN)/python tools/make_grade_fixtures.py $(GRADE_FIXTURES))
	$(BIN)/python tools/grade.py "$(or $(SUBMISSIONS),$(GRADE_FIXTURES))" --out "$(GRADE_OUT)" \
	  $(if $(CHAPTERS),--chapters $(CHAPTERS)) $(if $(ROSTER),--roster "$(ROSTER)") \
	  $(if $(DEADLINE),--deadline "$(DEADLINE)") $(if $(SUBMISSIONS),,--cell-timeout 5 --timeout 60) $(GRADE_FLAGS)

# The attack class of issue #28 graded next to honest students, then a 30 s wait for the attackers'
# detached processes (tests/test_grade_attack.py); about two minutes, so .ci/run calls it after make test.
grade-attack-test: $(STAMP)
	bash tools/system_deps.sh bwrap
	$(BIN)/python -m pytest tests/test_grade_attack.py -q -m grade_attack -p no:cacheprovider

# Optional, never part of make test: the reference implementations of transformers
# (pure-torch Gated DeltaNet and KDA) in an environment of their own. torch==2.13.0
# resolves to the CPU build; make bench times them on the same inputs when this exists.
REF_VENV := .venv-reference
REF_STAMP := $(REF_VENV)/.installed

reference-env: $(REF_STAMP)

$(REF_STAMP): Makefile
	test -x $(REF_VENV)/bin/python || $(PYTHON) -m venv $(REF_VENV)
	$(REF_VENV)/bin/python -m pip install --quiet --upgrade "pip>=24"
	$(REF_VENV)/bin/python -m pip install --quiet "torch==2.13.0" "transformers==5.24.0" "numpy==2.4.6" \
	  "scipy==1.17.1" "threadpoolctl==3.8.0"
	touch $(REF_STAMP)

# Optional, never part of make test: the book's layers and cores against transformers' own
# (Qwen3-Next, Kimi Linear, Mamba, Mamba-2), same weights in; writes the table that
# appendix/equivalence.ipynb shows. fixedstate is imported from code/ (no install).
# The fresh table goes to _build/; the tracked one is checked, never rewritten, so the work tree
# stays as committed and make test (whose nbval reads the tracked table) still passes after it.
# compare_init.py then checks fl.init_*(scheme="transformers") against transformers' _init_weights.
test-reference: $(REF_STAMP)
	$(REF_VENV)/bin/python tools/reference/compare_layers.py --out _build/reference/reference_equivalence.json \
	  --stored results/reference_equivalence.json
	$(REF_VENV)/bin/python tools/reference/compare_init.py

# The explicit step that rewrites the tracked table (only when every comparison passed) and re-executes
# appendix/equivalence.ipynb, which shows it; commit both.
.PHONY: update-reference
update-reference: $(REF_STAMP) $(STAMP)
	$(REF_VENV)/bin/python tools/reference/compare_layers.py --out _build/reference/reference_equivalence.json \
	  --command "make update-reference"
	cp _build/reference/reference_equivalence.json results/reference_equivalence.json
	$(BIN)/python tools/execute_notebook.py appendix/equivalence.ipynb

bench-figures: $(STAMP)
	$(BIN)/python benchmarks/figures_bench.py

clean:
	rm -rf _build

# Chapter 9's recall-against-state sweep (issue 30; fixedstate.training.RECALL_SWEEP): seven mixers x four
# widths x five seeds after a tuning stage, each run trained on a mixture of lengths (T = 32, 64, 128, one
# batch per step in turn, as Zoology trains) and tested at each; on every local core (tools/mqar_sweep.py; add
# SWEEP_ARGS="--engine dask --scheduler tcp://host:8786" for a dask.distributed cluster, or "--engine dask
# --workers N" for a local one). Resumes from its store (_build/sweeps/) if stopped. Writes
# results/mqar_recall.json. experiment-quick: the subset RECALL_QUICK (three mixers, two widths, T = 16 and
# 32), under 10 minutes on two cores; results/mqar_quick.json.
SWEEP_ARGS ?=
.PHONY: experiment experiment-quick experiment-small
experiment: $(STAMP)
	$(BIN)/python tools/mqar_sweep.py --settings full --out results/mqar_recall.json $(SWEEP_ARGS)

experiment-quick: $(STAMP)
	$(BIN)/python tools/mqar_sweep.py --settings quick --out results/mqar_quick.json $(SWEEP_ARGS)

# Chapter 9's first, small experiment (fixedstate.training.SWEEP: T = 32, vocabulary 32, widths 8 and 16,
# 4 or 8 pairs, 3 seeds; about 8 minutes on a two-core machine, as its stored provenance records).
# Writes results/mqar_sweep.json, which chapter 9 summarises at its end.
experiment-small: $(STAMP)
	$(BIN)/python tools/mqar_experiment.py --out results/mqar_sweep.json

# Chapter 9's pre-registered follow-up: the SSD alone, its step initialised at 0.01, the sweep's
# protocol otherwise. Writes results/mqar_ssd_followup.json.
.PHONY: experiment-ssd
experiment-ssd: $(STAMP)
	$(BIN)/python tools/mqar_experiment.py --ssd-followup --out results/mqar_ssd_followup.json
