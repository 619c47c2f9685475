# Two commands on a fresh machine (see README.md):
#   make train   install what training needs, then run scripts/train.py's default job
#   make test    install everything the tests need, then run them (what CI runs: .ci/run)
#   make test-fast  the tests that start no process (no dist, slow or gpu mark), once installed: about a minute
PYTHON ?= python3
# A bare torch requirement pulls a multi-GB CUDA build: pin the CPU wheel first. On a GPU machine,
# install your torch first and run `make ... TORCH=` to keep it.
TORCH ?= torch==2.13.0
PIP = $(PYTHON) -m pip install --quiet

.PHONY: train test test-fast install-train install-test

install-train:
	$(if $(TORCH),$(PIP) $(TORCH))
	$(PIP) -e ".[train,hf]"

install-test:
	$(if $(TORCH),$(PIP) $(TORCH))
	$(PIP) -e ".[all]"

train: install-train
	$(PYTHON) scripts/train.py

test: install-test
	$(PYTHON) -m pytest

test-fast:
	$(PYTHON) -m pytest -m "not dist and not slow and not gpu"
