"""minddp.as_torch_ddp(): minddp's class under torch's public DDP name for a block, torch's after it
(also when the block raises), while minddp's own code keeps finding torch's class
(tests/dist/test_library_ddp.py trains with it inside the HF Trainer)."""

import ast
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.nn.parallel.distributed
from torch import nn

import minddp
from minddp import _compat
from minddp.engine import checks

TORCHS = torch.nn.parallel.distributed.DistributedDataParallel


def test_the_block_swaps_the_public_name_and_restores_it():
    with minddp.as_torch_ddp() as cls:
        assert cls is minddp.DistributedDataParallel
        assert torch.nn.parallel.DistributedDataParallel is minddp.DistributedDataParallel
        assert torch.nn.parallel.distributed.DistributedDataParallel is TORCHS  # torch DDP's own module
    assert torch.nn.parallel.DistributedDataParallel is TORCHS


def test_the_name_is_restored_when_the_block_raises():
    with pytest.raises(ValueError, match="inside"):
        with minddp.as_torch_ddp():
            raise ValueError("inside the block")
    assert torch.nn.parallel.DistributedDataParallel is TORCHS


def test_nested_blocks_restore_in_order():
    with minddp.as_torch_ddp():
        with minddp.as_torch_ddp():
            pass
        assert torch.nn.parallel.DistributedDataParallel is minddp.DistributedDataParallel
    assert torch.nn.parallel.DistributedDataParallel is TORCHS


def test_minddps_internals_find_torchs_class_while_swapped():
    with minddp.as_torch_ddp():
        assert _compat.TORCH_DDP is TORCHS
        wrapped = TORCHS.__new__(TORCHS)  # a torch DDP instance, for isinstance (no process group here)
        with pytest.raises(TypeError, match="already a DistributedDataParallel"):
            checks.check_not_wrapped(wrapped, minddp.DistributedDataParallel)
        # dynamo's handshake goes to torch's class, which dynamo reads (the parent: AttributeError)
        wrapper = types.SimpleNamespace(bucket_bytes_cap=25 * 1024 * 1024, module=nn.Linear(2, 2))
        before = TORCHS._active_ddp_module
        with _compat.dynamo_sees_ddp(wrapper):
            assert TORCHS._active_ddp_module.bucket_bytes_cap == wrapper.bucket_bytes_cap
        assert TORCHS._active_ddp_module is before
        assert "_active_ddp_module" not in vars(minddp.DistributedDataParallel)


def test_torchs_modules_that_bind_the_name_at_import_keep_torchs_class():
    with minddp.as_torch_ddp():
        pass
    for name in _compat._BIND_TORCH_DDP_AT_IMPORT:
        module = sys.modules[name]
        bound = [v for v in vars(module).values() if v is TORCHS or v is minddp.DistributedDataParallel]
        assert bound == [TORCHS], f"{name} binds {bound}"


def _binds_public_name(source: str) -> bool:
    """A module-level `from torch.nn.parallel import DistributedDataParallel` (perhaps as another name)."""
    return any(isinstance(node, ast.ImportFrom) and node.module == "torch.nn.parallel"
               and any(a.name == "DistributedDataParallel" for a in node.names)
               for node in ast.parse(source).body)


def test_the_list_of_torchs_modules_that_bind_the_name_is_complete():
    """A torch release that adds one: as_torch_ddp must import it before the swap."""
    root = Path(torch.__file__).parent
    found = set()
    for path in root.rglob("*.py"):
        if "testing" in path.parts:
            continue
        text = path.read_text(errors="replace")
        if "from torch.nn.parallel import" in text and _binds_public_name(text):
            found.add(".".join(path.relative_to(root.parent).with_suffix("").parts))
    assert found == set(_compat._BIND_TORCH_DDP_AT_IMPORT), found


def test_the_check_sees_a_binding():
    assert _binds_public_name("from torch.nn.parallel import DistributedDataParallel as DDP")
    assert _binds_public_name("from torch.nn.parallel import (\n DataParallel,\n DistributedDataParallel)")
    assert not _binds_public_name("def f():\n    from torch.nn.parallel import DistributedDataParallel")
    assert not _binds_public_name("from torch.nn.parallel.distributed import DistributedDataParallel")
