"""The Hydra trainer, by what a reader looks for (each folder's __init__ maps its files):

    trainer.py      the loop, read top to bottom: setup, fit, run_step (a step and what follows
                    it), train_step (one optimizer step), log; the LR schedule (lr_factor)
    config.py       the schema (typed dataclasses) and the checks before any process group
    build.py        the model (minddp.model's), compiled as configured, and the optimizer
    init_from.py    model.init_from: a fresh run from a Hugging Face GPT-2 folder
    evaluate.py     the exact validation loss over any number of data-parallel ranks
    data/           what a run trains on: token files, text, synthetic; the batches; the data's
                    fingerprint
    checkpoint/     checkpoint files, their integrity, which one a run resumes from
    resume/         what a checkpoint holds of a run and how it comes back; what may change on
                    resume; the command that continues a run
    safety/         fail together on every rank, stop signals, the skipped-steps guard, replica
                    consistency, fault injection
    metrics/        metrics.jsonl and W&B, the run's identity, throughput and MFU, the slowest
                    rank, a traced step, torch's flight recorder
    io/             atomic file writes; pickles read without running code

The model itself (GPT, MLP, Hugging Face conversion, sampling) is minddp/model/; text -> token
files and text from a run are the tools' (`minddp prepare`, `minddp sample`).

Helpers take what they touch (a model, an optimizer, a step), never the Trainer. Importing
this package imports nothing: `from minddp.train.trainer import Trainer` starts the trainer.
"""
