# The two commands of the README: `make demo` and `make test`.  Both create .venv and install
# everything they need on first use (torch/torchvision with CUDA libraries: ~6 GB, ~2-3 min).

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
INSTALLED := $(VENV)/.installed

.PHONY: install test test-fast demo bench-classifier clean

$(INSTALLED): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $(INSTALLED)

install: $(INSTALLED)

# Every test, the multi-rank (gloo) ones included.
test: $(INSTALLED)
	$(BIN)/python -m pytest

# Skips the cases marked slow (heavier multi-rank runs).
test-fast: $(INSTALLED)
	$(BIN)/python -m pytest -m "not slow"

# Until the trainer lands (issue 4), the demo runs the heart of the system: one DHP training
# step of a sharded 100k-way instance classifier on 2 CPU ranks, next to the replicated (DDP)
# baseline, and prints their time, memory and the ratios.
demo: $(INSTALLED)
	@echo "instcls demo: the end-to-end trainer is not built yet; running the DHP-vs-replicated"
	@echo "classifier benchmark on 2 local CPU ranks (N=100,000 classes, B=256, D=128) instead."
	$(BIN)/instcls bench classifier --num-classes 100000 --batch 256 --dim 128 --ranks 2 --chunk-size 16384

bench-classifier: $(INSTALLED)
	$(BIN)/instcls bench classifier

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
