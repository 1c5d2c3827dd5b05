# minddp: the commands a newcomer needs. `make train` installs (once) and trains on the defaults.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
NPROC  ?= 1
ARGS   ?=
export WANDB_MODE ?= offline
STAMP  := $(VENV)/.installed

.PHONY: help install train sweep test test-fast bench bench-host bench-compile bench-memory bench-trainer bench-checkpoint bench-resume bench-debug bench-collectives calibrate report timeline scaling docs gpu-check wheelhouse soak-faults lint clean
# elastic restarts need a fresh rendezvous store per round in torch 2.13 (pytorch#135712)
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE ?= 1
# torchrun gives each worker OMP_NUM_THREADS=1 unless set, and warns about it on every launch: set it
TORCHRUN := OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(BIN)/torchrun

help:  ## this list: every target, one line each
	@grep -E '^[a-z][a-z-]*:.*## ' $(MAKEFILE_LIST) | sed -E 's/:[^#]*## /\t/' | awk -F'\t' '{printf "  make %-18s %s\n", $$1, $$2}'

install: $(STAMP)  ## create .venv and install minddp (once; again when pyproject.toml changes)
	@# one line if torch is a CPU build where nvidia-smi sees a GPU (a +cpu wheel is never replaced by the stamp)
	@! command -v nvidia-smi >/dev/null || $(BIN)/python scripts/gpu_check.py --torch-build

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade pip >/dev/null
	# torch is pinned in pyproject.toml (torch==2.13.0): the CPU wheel on these machines; on a GPU
	# machine it is a floor (torch >= 2.11): keep its CUDA build (make gpu-check PYTHON=python3)
	$(BIN)/python -m pip install -e '.[dev]'
	touch $(STAMP)

# make train                 one process
# make train NPROC=2         torchrun, 2 processes on this machine
# make train ARGS='train.max_steps=50 model=mlp'
train: install  ## train the small GPT on the defaults (NPROC=2: torchrun; ARGS='key=value ...')
ifeq ($(NPROC),1)
	$(BIN)/python train.py $(ARGS)
else
	@# torchrun through minddp.train.launch: after a stop signal the resume command is the last line, and
	@# the exit code is 0 (SIGTERM) or 130 (Ctrl-C), not torchrun's traceback and 1
	MINDDP_RUN_DIR=$${MINDDP_RUN_DIR:-outputs/$$(date +%Y-%m-%d/%H-%M-%S)} OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} \
	  $(BIN)/python -m minddp.train.launch --standalone --nproc_per_node=$(NPROC) train.py $(ARGS)
endif

# make sweep SWEEP='ddp.bucket_cap_mb=1,5,25,100'   one process per job, one W&B group, then the
# study's W&B report run (minddp report DIR --wandb) and one command that uploads every offline run.
# W&B follows wandb.mode=auto (online with an API key), not this Makefile's offline default;
# a WANDB_MODE you set yourself still wins.
SWEEP ?= ddp.bucket_cap_mb=1,5,25,100
SWEEP_ENV := $(if $(filter file,$(origin WANDB_MODE)),env -u WANDB_MODE,env)
sweep: install  ## a Hydra sweep, one W&B group, then its W&B report run (SWEEP='key=a,b,c')
	dir=$${MINDDP_RUN_DIR:-multirun/$$(date +%Y-%m-%d/%H-%M-%S)}; \
	  $(SWEEP_ENV) MINDDP_RUN_DIR=$$dir $(BIN)/python train.py -m $(SWEEP) \
	    wandb.group=sweep-$$(date +%m%d-%H%M%S) $(ARGS) && \
	  $(SWEEP_ENV) $(BIN)/minddp report $$dir --wandb

# two test files at a time (TEST_WORKERS=0: one): most tests wait on processes, timeouts or Slurm;
# a file's tests stay on one worker, so a module's fixture (the Slurm cluster) is made once.
# Tests marked serial assert on measured time: they run after, alone.
TEST_WORKERS ?= 2
PYTEST := $(BIN)/python -m pytest -q
PARALLEL := $(PYTEST) -n $(TEST_WORKERS) --dist loadfile

test: install  ## the whole suite but the soak (make soak-faults runs that)
	$(PARALLEL) -m "not soak and not serial"
	$(PYTEST) -m "serial and not soak"

# the inner loop (< 60 s): tests/unit, dist and meta but what is marked slow (whole training loops)
# or serial (measured time); nothing that starts a process (MINDDP_TEST_FAST=1 refuses it)
test-fast: install  ## the inner loop (< 60 s): tests/unit, dist, meta; no subprocess, torchrun or timing
	MINDDP_TEST_FAST=1 $(PARALLEL) -m "not slow and not serial" tests/unit tests/dist tests/meta

# Engine benchmark: minddp vs torch DDP at caps 1/5/25/100 MB (repeats, rotated rounds, ranks
# pinned), bucket counts, per-bucket CPU cost with communication stubbed; writes docs/bench_ddp.md;
# then whole-model compile over a modelled link (bench-compile) and peak memory (bench-memory)
bench: install  ## minddp vs torch DDP per bucket cap, then bench-compile and bench-memory: docs/bench_*.md
	$(TORCHRUN) --standalone --nproc_per_node=2 -m minddp bench-ddp --out docs/bench_ddp.md
	$(MAKE) bench-compile
	$(MAKE) bench-memory

# the host cost where the host paces the step (many small tensors, almost no compute): what minddp
# and torch DDP add to the step at 149, 581 and 1157 tensors, .grad set to None and kept, wall and
# CPU time, and the hook path alone with communication stubbed (CPU us per gradient)
bench-host: install  ## host-bound step and per-gradient hook cost, minddp vs torch DDP: docs/bench_host.md
	$(TORCHRUN) --standalone --nproc_per_node=2 -m minddp bench-host --out docs/bench_host.md

# whole-model torch.compile, minddp vs torch DDP, per-block and one graph, communication over a
# modelled 2 Gbit/s link (a comm hook on both engines, no CPU): the overlap that gloo's sums hide here
bench-compile: install  ## whole-model compile over a modelled link, minddp vs torch DDP: docs/bench_compile.md
	$(TORCHRUN) --standalone --nproc_per_node=2 -m minddp bench-ddp --compile only --link-gbps 2 \
	  --repeats 5 --rounds 6 --out docs/bench_compile.md

# peak memory per rank, each configuration its own torchrun job (torch DDP, minddp DDP, ZeRO-1,
# ZeroRedundancyOptimizer, ...; 10.8M and 50M GPT, dp 2 and 3): docs/bench_memory.{md,json}
bench-memory: install  ## peak memory per rank per configuration: docs/bench_memory.{md,json}
	$(BIN)/minddp bench-memory --out docs/bench_memory

# The trainer's step against a bare torch-DDP loop and a nanoGPT-style loop; docs/bench_trainer.md
bench-trainer: install  ## the trainer's step vs bare torch-DDP loops: docs/bench_trainer.md
	$(TORCHRUN) --standalone --nproc_per_node=2 -m minddp bench-trainer --out docs/bench_trainer.md

# a checkpoint step over a normal one and each rank's memory while it saves: minddp's save beside
# torch.distributed.checkpoint (save, async_save), rotated in one run; 50M GPT, dp 2, ZeRO-1
bench-checkpoint: install  ## what a checkpoint costs the step, rank 0's memory, whole runs: docs/bench_checkpoint*.md
	$(TORCHRUN) --standalone --nproc_per_node=2 scripts/bench_checkpoint.py --out docs/bench_checkpoint.md
	$(BIN)/python scripts/bench_checkpoint_runs.py --variants none,defaults,file --out docs/bench_checkpoint_runs.md

bench-resume: install  ## each rank's peak RSS and bytes read at resume against training's (dp 2/4, ZeRO-1/plain, tp 2): docs/bench_resume.md
	$(BIN)/python scripts/bench_resume.py --out docs/bench_resume.md

# per-collective cost of torch's flight recorder (off/on, alternately) and DETAIL fingerprints
bench-debug: install  ## what torch's flight recorder costs per collective
	for i in 1 2 3; do for fr in 0 2000; do \
	  TORCH_FR_BUFFER_SIZE=$$fr $(TORCHRUN) --standalone --nproc_per_node=2 -m minddp bench-debug 2>/dev/null; \
	done; done

# nccl-tests-style sweep of every collective, alpha-beta fit, memcpy reference
bench-collectives: install  ## nccl-tests-style sweep of every collective, alpha-beta fit
	$(TORCHRUN) --standalone --nproc_per_node=2 -m minddp bench --op all -e 64MiB $(ARGS)

# alpha-beta fit, contention, the engine's per-bucket cost and completion floor: docs/calibration.json
calibrate: install  ## alpha-beta fit and the engine's per-bucket cost: docs/calibration.json
	$(TORCHRUN) --standalone --nproc_per_node=2 -m minddp calibrate --repeats 3 --out docs/calibration.json

# every run under DIR (a multirun, a Slurm sweep, several train.py runs): DIR/report.{md,png}
DIR ?= outputs
report: install  ## every run under DIR (default outputs): DIR/report.{md,png}
	$(BIN)/minddp report $(DIR)

# one step with overlap on and off, per rank: timeline.{json,png}; a ZeRO-1 step and the
# forward after it (its all-gathers, the waits they cost): timeline_zero1.{json,png}; eager, whole-model
# and per-block compile (aot_eager): timeline_compile.{json,png}. In TIMELINE_OUT: a study of your
# own never rewrites the repository (make docs regenerates docs/)
TIMELINE_OUT ?= outputs/timeline
timeline: install  ## one step per rank, overlap on/off, ZeRO-1, compiled: outputs/timeline/*.{json,png}
	$(TORCHRUN) --standalone --nproc_per_node=2 -m minddp timeline --out $(TIMELINE_OUT)/timeline
	$(TORCHRUN) --standalone --nproc_per_node=2 -m minddp timeline --zero1 --out $(TIMELINE_OUT)/timeline_zero1
	$(TORCHRUN) --standalone --nproc_per_node=2 -m minddp timeline --compile all --bucket-mb 1 \
	  --out $(TIMELINE_OUT)/timeline_compile

# the trainer over world sizes and bucket caps, 3 rotated runs each, ZeRO-1 (and the optimizer
# overlap, where the trainer has it) beside DDP at world 2: scaling.{md,png} in the study's folder
scaling: install  ## world sizes x caps beside the cost model: outputs/scaling-<time>/scaling.{md,png}
	$(BIN)/minddp scaling --repeats 3 --variants auto $(ARGS)

# the pictures README links to, regenerated in place: the one target that rewrites them
# (the study's runs stay in outputs/docs/scaling-<time>/: its report is copied into docs/)
docs: install  ## regenerate docs/timeline*.{json,png} and docs/scaling.{md,png} (tracked files)
	$(MAKE) timeline TIMELINE_OUT=docs
	$(BIN)/minddp scaling --repeats 3 --variants auto --out outputs/docs/scaling $(ARGS) && \
	  cp outputs/docs/scaling.md outputs/docs/scaling.json outputs/docs/scaling.png docs/

# on a CUDA machine (< 10 min, 1 or more GPUs): the engine against torch DDP on nccl and on gloo with
# CUDA tensors, no host sync in a steady step, overlap in a profiler trace, flat memory, the flight
# recorder, the trainer in bf16 (MFU, resume, SIGTERM), folder checkpoints in the background, tp=2, the demos, the nccl collective table.
# One verdict per line, logs and summary.json under gpu_check/; no usable CUDA: one line, exit 1
# Any Python with a CUDA torch (PYTHON=python3: the node's own, never reinstalled); what it lacks comes
# from wheelhouse/ with no index, into .venv-gpu (a venv that sees that torch). Default: .venv's Python.
gpu-check:  ## on a CUDA machine (< 10 min): PASS/FAIL/SKIP per item, gpu_check/summary.json
	$(if $(filter command line environment,$(origin PYTHON)),$(PYTHON),$(if $(wildcard $(BIN)/python),$(BIN)/python,$(PYTHON))) \
	  scripts/gpu_check.py --out gpu_check

# on a connected machine: what gpu-check and training need besides torch, for a GPU node without
# internet (a few MB; WHEEL_PYTHONS: the node's Python versions; WHEEL_EXTRAS='numpy tokenizers wandb safetensors')
WHEEL_PYTHONS ?= 3.10 3.11 3.12 3.13
WHEEL_EXTRAS ?=
wheelhouse:  ## minddp's dependencies (never torch) in wheelhouse/, for make gpu-check on an offline node
	$(PYTHON) scripts/wheelhouse.py --out wheelhouse --pythons "$(WHEEL_PYTHONS)" --extras "$(WHEEL_EXTRAS)"

# faults that lose runs, on 2-rank jobs (minutes, longer under load; root for the tmpfs): a disk that fills up mid-run,
# kill -9 during saves, all checkpoints unreadable; each resume must equal an uninterrupted run
soak-faults: install  ## faults that lose runs on 2-rank jobs (minutes, root): each resume must be exact
	$(BIN)/python scripts/soak_faults.py
	$(BIN)/python -m pytest -q -m soak

lint: install  ## ruff
	$(BIN)/ruff check minddp tests scripts train.py

clean:  ## remove outputs, multirun, wandb, build (a wheel's), .pytest_cache
	rm -rf outputs multirun wandb build .pytest_cache
