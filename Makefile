# minddp: the commands a newcomer needs. `make train` installs (once) and trains on the defaults.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
NPROC  ?= 1
ARGS   ?=
export WANDB_MODE ?= offline
STAMP  := $(VENV)/.installed

.PHONY: install train sweep test test-fast bench bench-memory bench-trainer bench-debug bench-collectives calibrate report timeline scaling gpu-check soak-faults lint clean
# elastic restarts need a fresh rendezvous store per round in torch 2.13 (pytorch#135712)
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE ?= 1

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade pip >/dev/null
	# torch is pinned in pyproject.toml (torch==2.13.0): the CPU wheel on these machines
	$(BIN)/python -m pip install -e '.[dev]'
	touch $(STAMP)

# make train                 one process
# make train NPROC=2         torchrun, 2 processes on this machine
# make train ARGS='train.max_steps=50 model=mlp'
train: install
ifeq ($(NPROC),1)
	$(BIN)/python train.py $(ARGS)
else
	MINDDP_RUN_DIR=$${MINDDP_RUN_DIR:-outputs/$$(date +%Y-%m-%d/%H-%M-%S)} \
	  $(BIN)/torchrun --standalone --nproc_per_node=$(NPROC) train.py $(ARGS)
endif

# make sweep SWEEP='ddp.bucket_cap_mb=1,5,25,100'   one process per job, one W&B group
SWEEP ?= ddp.bucket_cap_mb=1,5,25,100
sweep: install
	MINDDP_RUN_DIR=$${MINDDP_RUN_DIR:-multirun/$$(date +%Y-%m-%d/%H-%M-%S)} \
	  $(BIN)/python train.py -m $(SWEEP) wandb.group=sweep-$$(date +%m%d-%H%M%S) $(ARGS)

test: install
	$(BIN)/python -m pytest -q

# the inner loop (< 2 min): no subprocess, torchrun or build (MINDDP_TEST_FAST=1 refuses them)
test-fast: install
	MINDDP_TEST_FAST=1 $(BIN)/python -m pytest -q -m "not slow"

# Engine benchmark: minddp vs torch DDP at caps 1/5/25/100 MB (repeats, rotated rounds, ranks
# pinned), bucket counts, per-bucket CPU cost with communication stubbed; writes docs/bench_ddp.md
bench: install
	$(BIN)/torchrun --standalone --nproc_per_node=2 -m minddp bench-ddp --out docs/bench_ddp.md
	$(MAKE) bench-memory

# peak memory per rank, each configuration its own torchrun job (torch DDP, minddp DDP, ZeRO-1,
# ZeroRedundancyOptimizer, ...; 10.8M and 50M GPT, dp 2 and 3): docs/bench_memory.{md,json}
bench-memory: install
	$(BIN)/minddp bench-memory --out docs/bench_memory

# The trainer's step against a bare torch-DDP loop and a nanoGPT-style loop; docs/bench_trainer.md
bench-trainer: install
	$(BIN)/torchrun --standalone --nproc_per_node=2 -m minddp bench-trainer --out docs/bench_trainer.md

# per-collective cost of torch's flight recorder (off/on, alternately) and DETAIL fingerprints
bench-debug: install
	for i in 1 2 3; do for fr in 0 2000; do \
	  TORCH_FR_BUFFER_SIZE=$$fr $(BIN)/torchrun --standalone --nproc_per_node=2 -m minddp bench-debug 2>/dev/null; \
	done; done

# nccl-tests-style sweep of every collective, alpha-beta fit, memcpy reference
bench-collectives: install
	$(BIN)/torchrun --standalone --nproc_per_node=2 -m minddp bench --op all -e 64MiB $(ARGS)

# alpha-beta fit, contention, the engine's per-bucket cost and completion floor: docs/calibration.json
calibrate: install
	$(BIN)/torchrun --standalone --nproc_per_node=2 -m minddp bench --op all_reduce,zero1_reduce_scatter,zero1_all_gather -e 64MiB -n 30 -w 5 --repeats 3 \
	  --calibrate docs/calibration.json

# every run under DIR (a multirun, a Slurm sweep, several train.py runs): DIR/report.{md,png}
DIR ?= outputs
report: install
	$(BIN)/minddp report $(DIR)

# one step with overlap on and off, per rank: docs/timeline.{json,png}; a ZeRO-1 step and the
# forward after it (its all-gathers, the waits they cost): docs/timeline_zero1.{json,png}
timeline: install
	$(BIN)/torchrun --standalone --nproc_per_node=2 -m minddp timeline --out docs/timeline
	$(BIN)/torchrun --standalone --nproc_per_node=2 -m minddp timeline --zero1 --out docs/timeline_zero1

# the trainer over world sizes and bucket caps, 3 rotated runs each, ZeRO-1 (and the optimizer
# overlap, where the trainer has it) beside DDP at world 2: docs/scaling.{md,png}
scaling: install
	$(BIN)/minddp scaling --repeats 3 --variants auto $(ARGS)

# on a CUDA machine (< 5 min): demos, minddp == torch DDP on CUDA, 50 bf16 trainer steps with MFU,
# the nccl collective table; one verdict per line, logs under gpu_check/ (no CUDA: says so, exits 0)
gpu-check: install
	$(BIN)/python scripts/gpu_check.py --out gpu_check

# faults that lose runs, on 2-rank jobs (~3 min, root for the tmpfs): a disk that fills up mid-run,
# kill -9 during saves, all checkpoints unreadable; each resume must equal an uninterrupted run
soak-faults: install
	$(BIN)/python scripts/soak_faults.py

lint: install
	$(BIN)/ruff check minddp tests scripts train.py

clean:
	rm -rf outputs multirun wandb .pytest_cache
