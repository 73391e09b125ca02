# promptfcl: everything installs from this file and pyproject.toml.
#   make run    create/update .venv, then run the default experiment offline
#   make test   same environment, run the test suite
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

export FLWR_TELEMETRY_ENABLED = 0
export HF_HUB_OFFLINE ?= 0

.PHONY: run test lint typecheck install clean-venv flwr-run

install: $(STAMP)

# Re-install whenever pyproject.toml changes; a broken venv is rebuilt from scratch.
$(STAMP): pyproject.toml
	@if [ ! -x $(PY) ] || ! $(PY) -c "import sys" >/dev/null 2>&1; then rm -rf $(VENV); $(PYTHON) -m venv $(VENV); fi
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	@touch $(STAMP)

# The default experiment: digits, 5 tasks x 2 classes, 10 clients, FedAvg-Prompt, on a small
# ViT pretrained once on Fashion-MNIST (a different source: no class overlap) and cached.
run: $(STAMP)
	bash scripts/offline-data.sh
	$(VENV)/bin/promptfcl pretrain --source fashion-mnist
	$(VENV)/bin/promptfcl simulate --out runs/default

# Flower's own launcher (local simulation through a managed SuperLink); the app is pre-installed,
# so the SuperLink must not try to install dependencies from the network.
flwr-run: $(STAMP)
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1 \
	  $(VENV)/bin/flwr run . --stream --federation-config "num-supernodes=5"

# Two pytest workers, one test file at a time each (--dist loadfile: a file's module fixtures,
# such as the deployment tests' federation, are set up once). The deployment tests spend much
# of their time waiting on fresh ClientApp processes and polls, so the other worker runs the
# rest meanwhile. (loadgroup would be finer, but pytest-xdist 3.8 ignores xdist_group marks
# under pytest 9.2: pytest-dev/pytest-xdist#1386.) --no-loadscope-reorder keeps the order of
# tests/conftest.py (the longest files first; xdist would order files by their number of tests).
# PYTEST_WORKERS=0 runs it all in one process.
PYTEST_WORKERS ?= 2
test: lint typecheck
	$(PY) -m pytest -q -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)

# ruff and mypy, configured in pyproject.toml
lint: $(STAMP)
	$(PY) -m ruff check common client server strategies deploy scripts tests

# mypy reads the layers from the checkout (their imports of each other are relative); the root's
# __init__.py makes the checkout's folder their package, so a folder name that is no Python
# identifier (a clone into promptfcl-main/) is checked from a copy of the layers named promptfcl
# (a link would not do: the working directory is the link's target)
typecheck: $(STAMP)
	@if basename "$(CURDIR)" | grep -Eq '^[A-Za-z_][A-Za-z0-9_]*$$'; then $(PY) -m mypy; else \
	  tmp=$$(mktemp -d) && mkdir $$tmp/promptfcl && \
	  cp -r __init__.py pyproject.toml common client server strategies $$tmp/promptfcl/ && \
	  echo "typecheck: $(notdir $(CURDIR)) is not a Python identifier: checking a copy named promptfcl/" && \
	  cd $$tmp/promptfcl && "$(abspath $(PY))" -m mypy; status=$$?; rm -rf $$tmp; exit $$status; fi

clean-venv:
	rm -rf $(VENV)
