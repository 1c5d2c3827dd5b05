"""0.4.0 moved the root modules into layer folders and grouped the trainer's; the old import paths
answer for one release."""


import importlib
import sys
import warnings

import pytest

import minddp
from minddp import _moved


@pytest.mark.parametrize("old", sorted(_moved.MOVED))
def test_an_old_path_is_the_module_at_its_new_home_with_a_warning(old):
    homes = _moved.new_homes(old)
    sys.modules.pop(f"minddp.{old}", None)  # imported earlier in this process (a tool not yet moved over)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(f"minddp.{old}")
    assert any(issubclass(w.category, DeprecationWarning) and all(h in str(w.message) for h in homes)
               for w in caught), [str(w.message) for w in caught]
    if len(homes) > 1:  # one module holding each home's public names
        for home in map(importlib.import_module, reversed(homes)):
            public = [k for k in vars(home) if not k.startswith("_")]
            assert public and all(hasattr(module, k) for k in public), (home, public)
        first = importlib.import_module(homes[0])
        assert all(getattr(module, k) is v for k, v in vars(first).items() if not k.startswith("__"))
    else:
        assert module is importlib.import_module(homes[0])
        assert module.__spec__.name == homes[0]  # its own spec kept


def test_the_old_costmodel_holds_the_model_and_its_command_line_helpers():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        module = importlib.import_module("minddp.costmodel")
    from minddp.perf import costmodel
    from minddp.tools.costmodel import parse_size

    assert module.ring_all_reduce_time is costmodel.ring_all_reduce_time
    assert module.parse_size is parse_size


# the trainer's modules that became packages of the same name, and what each held
TRAIN_PACKAGES = {
    "checkpoint": ["CheckpointError", "CheckpointReadError", "CheckpointWriteError", "all_checkpoints",
                   "checkpoint_dir", "is_transient", "latest", "load", "remove_crash_leftovers", "resolve",
                   "resolve_agreed", "resume_run_dir"],
    "data": ["ArithmeticSequences", "DataInfo", "ShardedBatches", "TokenWindows", "collate", "corpus_files",
             "corpus_key", "load_corpus", "load_data", "load_data_agreed", "load_tokens", "record_in_config",
             "stdlib_root"],
    "resume": ["resume_command", "shape_check"],
}


@pytest.mark.parametrize("name", sorted(TRAIN_PACKAGES))
def test_a_train_module_that_became_a_package_still_has_its_names(name):
    package = importlib.import_module(f"minddp.train.{name}")
    assert hasattr(package, "__path__")
    missing = [k for k in TRAIN_PACKAGES[name] if not callable(getattr(package, k, None))]
    assert not missing, missing


def test_old_train_paths_still_import_their_names():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from minddp.train.agree import together
        from minddp.train.guard import DivergedError, SkipGuard
        from minddp.train.integrity import checksums, fingerprint
        from minddp.train.tokens import open_folder

    from minddp.train.checkpoint.integrity import checksums as new_checksums
    from minddp.train.data.fingerprint import fingerprint as new_fingerprint
    from minddp.train.data.tokens import open_folder as new_open_folder
    from minddp.train.safety.guard import DivergedError as NewDiverged
    from minddp.train.safety.together import together as new_together

    assert (together, DivergedError, open_folder) == (new_together, NewDiverged, new_open_folder)
    assert (checksums, fingerprint) == (new_checksums, new_fingerprint) and callable(SkipGuard)


def test_old_names_of_public_classes_still_import():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from minddp.ddp import DistributedDataParallel
        from minddp.zero import ShardedOptimizer as Old

        from minddp.optim import OverlappedOptimizer, ReplicatedOptimizer, ShardedOptimizer

    assert DistributedDataParallel is minddp.DDP and Old is ShardedOptimizer
    assert ReplicatedOptimizer is minddp.ReplicatedOptimizer
    assert OverlappedOptimizer is minddp.OverlappedOptimizer


def test_a_name_that_never_existed_is_still_an_import_error():
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("minddp.no_such_module")
