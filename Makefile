# Two commands on a fresh machine (see README.md):
#   make train   install what training needs, then run scripts/train.py's default job
#   make test    install everything the tests need, then make lint and the tests (what CI runs: .ci/run)
#   make test-fast  ruff, mypy, then the tests that start no process (no dist, slow or gpu mark) on two workers
#   make test-floor the oldest versions we support (cp_attention/versions.py) in a venv of their own, tested
PYTHON ?= python3
# A bare torch requirement pulls a multi-GB CUDA build: pin the CPU wheel first. On a GPU machine,
# install your torch first and run `make ... TORCH=` to keep it.
TORCH ?= torch==2.13.0
PIP = $(PYTHON) -m pip install --quiet
# test-floor's venv: torch at its floor comes from PyPI as a CUDA build (about 5 GB in the venv with its libraries).
FLOOR_VENV ?= .venv-floor

.PHONY: train test test-fast test-floor lint install-train install-test

install-train:
	$(if $(TORCH),$(PIP) $(TORCH))
	$(PIP) -e ".[train,hf,plots]"

install-test:
	$(if $(TORCH),$(PIP) $(TORCH))
	$(PIP) -e ".[all]"

train: install-train
	$(PYTHON) scripts/train.py

# ruff.toml and mypy.ini say what is checked.
lint:
	$(PYTHON) -m ruff check .
	$(PYTHON) -m mypy

test: install-test lint
	$(PYTHON) -m pytest

# Two workers: the fast tier is CPU-bound and its tests share nothing (no process group, no files).
test-fast: lint
	$(PYTHON) -m pytest -m "not dist and not slow and not gpu" -n 2

# Every floor of cp_attention/versions.py at once (the rest at the newest that fits them): the fast tier,
# then every HuggingFace adapter test (Trainer and generate included, processes too).
test-floor:
	rm -rf $(FLOOR_VENV)
	$(PYTHON) -m venv $(FLOOR_VENV)
	$(PYTHON) cp_attention/versions.py > $(FLOOR_VENV)/floors.txt
	$(FLOOR_VENV)/bin/python -m pip install --quiet -c $(FLOOR_VENV)/floors.txt -e ".[all]"
	$(FLOOR_VENV)/bin/python -m pip list 2>/dev/null | grep -iE '^(torch|transformers|accelerate|trl|megatron-core) '
	$(FLOOR_VENV)/bin/python -m pytest -m "not dist and not slow and not gpu" --ignore=tests/adapters/hf
	$(FLOOR_VENV)/bin/python -m pytest tests/adapters/hf -m "not gpu"
