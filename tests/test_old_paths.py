"""0.4.0 moved the root modules into layer folders; the old import paths answer for one release."""

import importlib
import warnings

import pytest

import minddp
from minddp import _moved


@pytest.mark.parametrize("old,new", sorted(_moved.MOVED.items()))
def test_an_old_path_is_the_module_at_its_new_home_with_a_warning(old, new):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(f"minddp.{old}")
    assert any(issubclass(w.category, DeprecationWarning) and f"minddp.{new}" in str(w.message)
               for w in caught), [str(w.message) for w in caught]
    if old == "costmodel":  # the model and its old command-line helpers, under one name
        from minddp.perf import costmodel
        from minddp.tools.costmodel import parse_size

        assert module.ring_all_reduce_time is costmodel.ring_all_reduce_time
        assert module.parse_size is parse_size
    else:
        assert module is importlib.import_module(f"minddp.{new}")
        assert module.__spec__.name == f"minddp.{new}"  # its own spec kept


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
