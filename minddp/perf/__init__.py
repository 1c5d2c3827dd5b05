"""Performance: what communication and memory cost, predicted and measured. One of each.

    costmodel    alpha-beta formulas, fabric presets, `Calibration`, a DDP step's predicted busy
                 and exposed communication, bucket advice; buckets from minddp.engine.buckets' own plan
    explain      the cost model in words: each case `minddp costmodel` explains, with its numbers
    memory       memory per rank (the one model), the bench-memory configurations, optimizer-state
                 bytes, `PeakMeter` and one rank's peak run, the figures and criteria of a run
    sweep        the nccl-tests-style collective sweep (every result checked) and the alpha-beta fit
    calibration  what calibrate measures (contention, completion floor, the engine under backward)
                 and fits (per-op alpha-beta, the under-backward grid), repeats combined, written
    engine_cost  the engine's CPU cost per bucket, communication stubbed out
    engine_bench minddp against torch DDP: step time per bucket cap, the optimizer setups' phases
    loops        whole training loops against each other: the hand-written torch DDP loops
    fingerprints what torch's collective fingerprints (DETAIL debug) cost per collective
    study        the scaling study: its train.py runs, repeats, prediction, efficiency, reading
    runs         trainer runs read back from their folders: swept keys, efficiency, plot series
    flight       flight-recorder dumps read back: who is stuck where
    jobs         measurements run as jobs of their own: launch, first error, the commit measured
    clock        the one clock: CUDA events on GPU, the host clock on CPU; warm-up and rotated rounds
    plot         the one headless matplotlib
    workload     the GPT presets, the loss every measurement runs (the models come from the caller)

perf reads the engine (its bucket plan, the wrapper itself) and the optimizers; it never
imports minddp.train or minddp.tools (tests/meta/test_suite_rules.py); it reads what a trainer
run wrote and starts train.py as a process. The command lines over it are minddp/tools
(`minddp costmodel`, `bench`, `calibrate`, `bench-ddp`, `bench-memory`, `scaling`, `report`, ...).
"""
