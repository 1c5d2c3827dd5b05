"""One training step, read as nanoGPT's loop: outside the engine, a default `train_step` runs
through at most six of minddp's files (the user's model and data set, and the engine's
_compat, aside). A new file on that path is a hop a reader has to follow: put it behind the
probe, or say here why the step needs it."""

import sys
from pathlib import Path

import minddp

PKG = Path(minddp.__file__).parent


def files_of_one_step(trainer, step: int) -> set[str]:
    """The package's files (relative to minddp/) whose Python code runs during train_step(step)."""
    seen = set()

    def profile(frame, event, arg):
        if event == "call":
            seen.add(frame.f_code.co_filename)

    sys.setprofile(profile)
    try:
        trainer.train_step(step)
    finally:
        sys.setprofile(None)
    return {str(Path(f).relative_to(PKG)) for f in seen if Path(f).is_relative_to(PKG)}


def test_a_default_step_runs_through_at_most_six_files_outside_the_engine(tmp_path, in_process_trainer):
    trainer = in_process_trainer("model.n_layer=1", "model.n_embd=32", "model.n_head=2",
                                 "model.block_size=16", "data=synthetic", "train.global_batch_size=8",
                                 "train.micro_batch_size=4", "train.eval_every=0", run_dir=tmp_path)
    trainer.setup()
    trainer.train_step(1)  # the first step builds what later steps reuse
    users = {sys.modules[type(o).__module__].__file__ for o in (trainer.model, trainer.train_set)}
    aside = {str(Path(f).relative_to(PKG)) for f in users} | {"_compat.py"}
    path = sorted(f for f in files_of_one_step(trainer, 2) - aside if not f.startswith("engine/"))
    # today: trainer.py, metrics/probe.py, data/batches.py, optim/replicated.py, parallel/gradnorm.py
    assert len(path) <= 6, path
