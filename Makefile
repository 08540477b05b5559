# The two commands of the README: `make demo` and `make test`.  Both create .venv and install
# everything they need on first use (torch/torchvision with CUDA libraries: ~6 GB, ~2-3 min).

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
INSTALLED := $(VENV)/.installed

.PHONY: install prometheus test test-all demo drill bench-classifier clean

$(INSTALLED): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $(INSTALLED)

install: $(INSTALLED)

# Debian's Prometheus server, for the end-to-end scrape test (installed when missing and root).
prometheus:
	@command -v prometheus >/dev/null || { \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
			apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus; \
		else echo "install Debian's prometheus package (apt-get install prometheus) for the scrape test"; fi; }

# The default suite (what CI runs): every capability, multi-rank (gloo) cases included; the cases
# marked slow repeat a capability at a heavier size and run only in `make test-all`.
test: $(INSTALLED) prometheus
	$(BIN)/python -m pytest -m "not slow"

# Every test, the slow repeats included.
test-all: $(INSTALLED) prometheus
	$(BIN)/python -m pytest

# The main job on the embedded default: the scikit-learn digits as WebDataset shards (80% to
# train on, 20% held out), 15 epochs on 2 CPU ranks (~2 minutes), then kNN accuracy of the
# trained network next to the same network at its random initialisation.
DEMO := out/demo
demo: $(INSTALLED)
	@echo "instcls demo: shards of the scikit-learn digits, then DHP training on 2 CPU ranks (torchrun, gloo)"
	test -f $(DEMO)/shards/train/manifest.json || $(BIN)/instcls make-shards --source digits --split train \
		--out $(DEMO)/shards/train --prefix digits-train --samples-per-shard 256
	test -f $(DEMO)/shards/val/manifest.json || $(BIN)/instcls make-shards --source digits --split val \
		--out $(DEMO)/shards/val --prefix digits-val --samples-per-shard 256
	rm -rf $(DEMO)/checkpoints $(DEMO)/logs
	OMP_NUM_THREADS=1 $(BIN)/instcls launch --nproc-per-node 2 -m trainer.cli train \
		--config configs/demo_cpu.yaml --resume none

# Every fault drill on 2 CPU ranks (4-6 minutes): the table of what survived (README, Reliability).
drill: $(INSTALLED)
	OMP_NUM_THREADS=1 $(BIN)/instcls drill --work-dir out/drills

bench-classifier: $(INSTALLED)
	$(BIN)/instcls bench classifier

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache out
