"""torch's own DDP tests, run with minddp.DistributedDataParallel in torch's place.

torch ships them in the wheel: torch/testing/_internal/distributed/distributed_test.py, class
DistributedTest._DistTestBase (PyTorch runs them with test/distributed/test_distributed_spawn.py,
BACKEND=gloo WORLD_SIZE=...). tests/torch_ddp_port.py loads that file's source with the DDP
name made minddp's and executes it as a new module; torch itself is not patched.

Which tests: every _DistTestBase test that constructs DDP (directly or through a helper) and that
torch runs on a CPU-only machine with gloo (CPU below), plus those whose only GPU dependence is
placement (GPU below: `skip_if_lt_x_gpu`/`skip_if_no_gpu`, `.cuda(rank)`, `device_ids=[rank]`,
`torch.cuda.set_device`, `init_multigpu_helper`), ported to the CPU by text substitution
(tests/torch_ddp_port.py: the skip decorators dropped, `.cuda(...)` -> `.cpu()`, `device_ids=`/
`output_device=` -> None, the current device -> "cpu"). Not selected, each for its reason in
NOT_SELECTED: tests that need a GPU for more than placement (AMP, CUDA streams, fp16, SyncBatchNorm
which is GPU-only, ...) and tests torch itself skips on Linux.

Ranks: world 2 on gloo. One driver process per module (forked from pytest) executes the ported
module and runs torch's harness as is (TestDistBackend: file init, barrier, return codes, every
rank's traceback); it forks the two ranks of each test. torch's test utilities change
process-wide state when imported, so only the driver and its ranks import them, never pytest's
process.

Expected failures (EXPECTED_FAIL, strict: one that starts passing fails the suite, so the list
only shrinks; NOT_STRICT: the timing-dependent ones) each say why: the test checks a
torch-internal detail minddp does not have (the C++ reducer and logger, private methods), or a
behaviour minddp does not have and why. Those that failed on the parity gaps (no_sync usage
counting, reassigned buffers, undefined gradients, pickling, torch 2.13's constructor arguments,
join's arguments, re-wrapping, parameters to ignore, torch's errors) pass now and left the list.
docs/torch_ddp_tests.md mirrors the lists (a test below checks that it names the same tests).
Time: ~30 s on 2 idle cores (test_ddp_compile_static_graph, torch.compile: ~17 s of it); the torch
tests are marked slow (make test runs them; make test-fast the two checks of the lists).
"""


from __future__ import annotations

import multiprocessing as mp
import os

import pytest
import torch

from tests import launch, torch_ddp_port

TIMEOUT_S = int(torch_ddp_port.TIMEOUT_S)  # per test, all ranks (torch's harness enforces it)


# torch runs these on a CPU-only machine with gloo
CPU = [
    "test_DistributedDataParallelCPU",
    "test_DistributedDataParallelCPU_grad_is_view",
    "test_DistributedDataParallel_requires_grad",
    "test_ddp_create_graph",
    "test_accumulate_gradients_no_sync",
    "test_accumulate_gradients_no_sync_grad_is_view",
    "test_accumulate_gradients_no_sync_allreduce_hook",
    "test_accumulate_gradients_no_sync_allreduce_with_then_hook",
    "test_grads_same_across_ranks_with_no_sync",
    "test_static_graph_api_cpu",
    "test_ddp_logging_data_cpu",
]


# torch runs these on GPUs only; their only GPU dependence is placement (ported to the CPU)
GPU = [
    "test_ddp_zero_output_features",
    "test_ddp_comm_hook_logging",
    "test_get_data_parallel_params",
    "test_ddp_apply_optim_in_backward",
    "test_ddp_apply_optim_in_backward_grad_as_bucket_view_false",
    "test_ddp_apply_optim_in_backward_ignored_params",
    "test_ddp_native_mixed_precision_ignored_params",
    "test_ddp_native_mixed_precision_no_grad_as_bucket_view_no_set_grad_none",
    "test_ddp_native_mixed_precision_grad_as_bucket_view_no_set_grad_none",
    "test_ddp_native_mixed_precision_grad_as_bucket_view_set_grad_to_none",
    "test_ddp_native_mixed_precision_no_grad_as_bucket_view_set_grad_to_none",
    "test_ddp_hook_parity_allreduce",
    "test_ddp_hook_parity_allreduce_process_group",
    "test_ddp_hook_parity_powerSGD",
    "test_ddp_hook_parity_post_localSGD",
    "test_post_localSGD_optimizer_parity",
    "test_post_localSGD_optimizer_parity_grad_is_view",
    "test_post_localSGD_optimizer_step_reload",
    "test_post_localSGD_optimizer_parity_with_hierarchical_sgd",
    "test_post_localSGD_optimizer_parity_with_hierarchical_sgd_grad_is_view",
    "test_ddp_profiling_torch_profiler",
    "test_ddp_bucket_cap_mb_list",
    "test_ddp_sync_module_states",
    "test_ddp_grad_div_uneven_inputs",
    "test_ddp_join_model_equivalence",
    "test_ddp_uneven_inputs",
    "test_ddp_uneven_input_join_disable",
    "test_ddp_uneven_input_exception",
    "test_ddp_ignore_params_arg",
    "test_ddp_unused_params_rebuild_buckets_exception",
    "test_ddp_shared_grad_acc_unused_params",
    "test_ddp_namedtuple",
    "test_ddp_control_flow_same_across_ranks",
    "test_invalid_static_graph",
    "test_ddp_control_flow_different_across_ranks",
    "test_compute_bucket_assignment_by_size_sparse_error_without_logger",
    "test_verify_model_across_rank_with_logger",
    "test_verify_model_across_rank_without_logger",
    "test_ddp_model_diff_num_params_across_ranks",
    "test_output_unused_in_loss_tuple_module",
    "test_output_unused_in_loss_dict_module",
    "test_undefined_grad_parity_unused_parameters",
    "test_different_graph_across_ranks",
    "test_ddp_build_debug_param_to_name_mapping",
    "test_ddp_build_debug_param_to_name_mapping_requires_grad",
    "test_ddp_multiple_nested_unused_params_error",
    "test_ddp_multiple_nested_unused_params_err_ignore_params",
    "test_ddp_inference",
    "test_ddp_python_error_logged",
    "test_ddp_static_graph_nested_types",
    "test_ddp_returns_tensor_with_no_grad",
    "test_detect_ddp_is_actually_static",
    "test_ddp_new_tensor_in_fwd",
    "test_ddp_new_tensor_in_fwd_static_graph",
    "test_ddp_buffer_hook_allreduce_return_future",
    "test_ddp_buffer_hook_allreduce",
    "test_ddp_broadcast_buffer_via_hook",
    "test_ddp_remove_autograd_hooks",
    "test_ddp_broadcast_buffer",
    "test_ddp_join_respects_forward_sync_buffers_false",
    "test_ddp_init_sync_buffers_with_forward_sync_buffers_false",
    "test_ddp_broadcast_buffers_deprecation_warning",
    "test_static_graph_multi_forward",
    "test_sync_bn_logged",
    "test_stateless_api_with_ddp",
    "test_ddp_forward_backward_hook",
    "test_ddp_device_mesh_initialization",
    "test_ddp_compile_static_graph",
    "test_ddp_sink_noclone",
    "test_skip_all_reduce_unused_parameters",
]


# the _DistTestBase tests that construct DDP but are not selected, and why
_LINUX_SKIP = "torch skips it on Linux (its own decorator: "


_SYNC_BN = "SyncBatchNorm's forward needs a GPU"


NOT_SELECTED = {
    "test_DistributedDataParallel": _LINUX_SKIP + "pytorch#77317)",
    "test_DistributedDataParallel_non_default_stream": _LINUX_SKIP + "pytorch#76428); needs CUDA streams",
    "test_ddp_profiling_autograd_profiler": _LINUX_SKIP + "pytorch#77342)",
    "test_compute_bucket_assignment_by_size_sparse_error_with_logger": _LINUX_SKIP + "pytorch#85012)",
    "test_ddp_model_diff_shape_across_ranks": _LINUX_SKIP + "pytorch#162676)",
    "test_ddp_has_finalized": "torch skips it everywhere (pytorch#102751)",
    "test_ddp_sync_bn_training_vs_eval": "torch skips it everywhere (pytorch#113620)",
    "test_ddp_profiling_execution_trace": "torch skips it everywhere (pytorch#137765); nccl metadata",
    "test_ddp_hook_pickling_powerSGD": "torch skips it everywhere (flaky)",
    "test_DistributedDataParallel_with_amp_and_grad_is_view": "needs CUDA AMP (torch.cuda.amp GradScaler)",
    "test_ddp_logging_data_gpu": "checks the CUDA device ids torch's logger records",
    "test_ddp_device": "checks that DDP moves inputs onto device_ids[0], a GPU (nothing to move on CPU)",
    "test_ddp_uneven_inputs_stop_iteration_sync_bn": _SYNC_BN + " (throw_on_early_termination with a model's "
                                                     "own collective: tests/dist/test_join.py)",
    **{f"test_DistributedDataParallel_SyncBatchNorm{case}": _SYNC_BN for case in (
        "", "_Channels_Last", "_No_Affine", "_2D_Input", "_Single_Input_Per_Process",
        "_Diff_Input_Sizes_Running_Value", "_Diff_Input_Sizes_gradient", "_half")},
}


# name -> why it fails with minddp (strict xfail). Most check a torch-internal detail: the C++
# reducer (`reducer`, its error texts, its timings in `_get_ddp_logging_data`), private methods.


_MIXED = ("torch's experimental mixed_precision=_MixedPrecision(...): minddp implements it "
          "(tests/dist/test_mixed_precision.py), but the test reads torch's private p._mp_param/p._fp_param "
          "(and on the CPU torch's own records a stream event and fails)")


_IN_BACKWARD = ("torch's private _apply_optimizer_in_backward: torch DDP finds param._in_backward_optimizers "
                "and steps them in its comm hook after the all-reduce; minddp does not read that private "
                "attribute (its overlapped step is optimizer_overlap=True), so they step on the local "
                "gradient, or on the reduced one when the asynchronous all-reduce lands first: timing, "
                "so not strict")


_DEBUG_MAP = "_build_params_for_reducer / _build_debug_param_to_name_mapping (private)"


_REDUCER_TEXT = ("the exact text of torch's C++ reducer error (parameter indices, TORCH_DISTRIBUTED_DEBUG "
                 "wording); minddp raises at the same step on every rank, naming the parameters")


EXPECTED_FAIL: dict[str, str] = {
    "test_ddp_logging_data_cpu": "_set_ddp_runtime_logging_sample_rate (private), then the C++ reducer's "
                                 "timings in _get_ddp_logging_data() (minddp gives the fields with a "
                                 "meaning here: docs/torch_ddp_tests.md)",
    "test_ddp_comm_hook_logging": "_register_builtin_comm_hook (private; the Python hooks' comm_hook "
                                  "field it reads first is logged)",
    "test_get_data_parallel_params": "DistributedDataParallel._get_data_parallel_params (private, static)",
    "test_ddp_apply_optim_in_backward": _IN_BACKWARD,
    "test_ddp_apply_optim_in_backward_grad_as_bucket_view_false": _IN_BACKWARD,
    "test_ddp_apply_optim_in_backward_ignored_params": _IN_BACKWARD,
    "test_ddp_native_mixed_precision_ignored_params": _MIXED,
    "test_ddp_native_mixed_precision_no_grad_as_bucket_view_no_set_grad_none": _MIXED,
    "test_ddp_native_mixed_precision_grad_as_bucket_view_no_set_grad_none": _MIXED,
    "test_ddp_native_mixed_precision_grad_as_bucket_view_set_grad_to_none": _MIXED,
    "test_ddp_native_mixed_precision_no_grad_as_bucket_view_set_grad_to_none": _MIXED,
    "test_ddp_profiling_torch_profiler": "the reducer's search_unused_parameters profiler range (the "
                                         "collectives' profiler events it checks first are there)",
    "test_ddp_uneven_inputs": "net._authoritative_rank (private) (its first case's uneven-input "
                              "training runs up to it; throw_on_early_termination: tests/dist/test_join.py)",
    "test_ddp_uneven_input_join_disable": "net._join_config, torch's Joinable internals (the training "
                                          "under join(enable=False) before it passes)",
    "test_ddp_unused_params_rebuild_buckets_exception": _REDUCER_TEXT + "; and the logger's record of it",
    "test_ddp_control_flow_same_across_ranks": "model.reducer._get_local_used_map() (the C++ reducer)",
    "test_ddp_control_flow_different_across_ranks": "model.reducer (the C++ reducer) and its error text",
    "test_invalid_static_graph": "the text of static_graph's graph-changed error (torch's reducer); minddp "
                                 "takes static_graph as a hint and raises its unused-parameter error at "
                                 "the same step",
    "test_different_graph_across_ranks": "has_rebuilt_buckets: torch rebuilds no buckets under "
                                         "find_unused_parameters, minddp does (once, rank 0's order)",
    "test_ddp_build_debug_param_to_name_mapping": _DEBUG_MAP,
    "test_ddp_build_debug_param_to_name_mapping_requires_grad": _DEBUG_MAP,
    "test_ddp_multiple_nested_unused_params_error": _REDUCER_TEXT,
    "test_ddp_multiple_nested_unused_params_err_ignore_params": _REDUCER_TEXT,
    "test_ddp_static_graph_nested_types": "wraps a DDP in a DDP; minddp refuses the nesting (TypeError "
                                          "naming the fix: both wrappers would reduce every gradient); "
                                          "a refusal minddp keeps",
    "test_detect_ddp_is_actually_static": "model.reducer._ddp_graph_static() (the C++ reducer)",
    "test_ddp_buffer_hook_allreduce_return_future": "_register_buffer_comm_hook (private)",
    "test_ddp_buffer_hook_allreduce": "_register_buffer_comm_hook (private)",
    "test_ddp_broadcast_buffer_via_hook": "_register_buffer_comm_hook (private)",
    "test_ddp_remove_autograd_hooks": "_remove_autograd_hooks (private; minddp's is remove_hooks())",
    "test_ddp_sink_noclone": "_set_ddp_sink_clone (private)",
    "test_skip_all_reduce_unused_parameters": "_get_ddp_logging_data()'s num_buckets_reduced, a count of "
                                              "the C++ reducer's that minddp does not give",
}


NOT_STRICT = {n for n, why in EXPECTED_FAIL.items() if why == _IN_BACKWARD}  # the race above


def _suite_class():
    """torch's test case class over the ported module, its ranks forked from this process."""
    suite = torch_ddp_port.load()

    class MinddpDDPSuite(suite.TestDistBackend, suite.DistributedTest._DistTestBase):
        @property
        def world_size(self):
            return torch_ddp_port.ENV["WORLD_SIZE"]

        def _start_ranks(self):
            ctx, env = mp.get_context("fork"), {**os.environ, **torch_ddp_port.ENV}
            for rank in range(int(self.world_size)):
                parent, child = ctx.Pipe()
                p = ctx.Process(target=type(self)._run_rank, name=f"process {rank}",
                                args=(rank, self._current_test_name(), self.file_name, child, env))
                p.start()
                self.pid_to_pipe[p.pid] = parent
                self.processes.append(p)

        @classmethod
        def _run_rank(cls, rank, test_name, file_name, pipe, env):
            os.environ.clear()
            os.environ.update(env)
            torch.set_num_threads(1)
            cls._run(rank, test_name, file_name, pipe)

    return MinddpDDPSuite


def _serve(conn):
    """The driver: one process for the module that alone imports torch's test utilities (they
    change process-wide state at import: torch.backends.disable_global_flags(), TorchScript's
    __call__) and runs torch's harness for each test it is sent, its ranks forked from it."""
    import traceback
    import unittest

    cls = _suite_class()
    while (name := conn.recv()) is not None:
        case = cls(name)
        try:
            case.setUp()
            try:
                case._start_ranks()
                getattr(case, name)()  # torch's harness waits for the ranks, raises their errors
            finally:
                case.tearDown()
            conn.send(("passed", ""))
        except unittest.SkipTest as e:
            conn.send(("skipped", str(e)))
        except BaseException:  # noqa: BLE001 - every failure goes back to the test
            conn.send(("failed", traceback.format_exc()))


@pytest.fixture(scope="module")
def driver():
    # fork unless this process runs a process group's threads (tests/launch.py's rule)
    ctx = mp.get_context("fork") if not launch._comm_threads() else launch.forkserver()
    here, there = ctx.Pipe()
    proc = ctx.Process(target=_serve, args=(there,), name="torch DDP suite driver")
    proc.start()
    yield here, proc
    if proc.is_alive():
        here.send(None)
        proc.join(timeout=10)
    if proc.is_alive():
        proc.kill()


def _case(name):
    marks = []
    if name in EXPECTED_FAIL:
        marks.append(pytest.mark.xfail(strict=name not in NOT_STRICT, reason=EXPECTED_FAIL[name]))
    return pytest.param(name, marks=marks, id=name)


@pytest.mark.slow  # a conformance run (~30 s idle, 2 cores), make test's; test-fast runs the two below
@pytest.mark.parametrize("name", [_case(n) for n in CPU + GPU])
def test_torch_ddp(name, driver):
    status, text = launch.ask_driver(driver, name, TIMEOUT_S + 60)  # torch's harness times ranks out first
    if status == "skipped":
        pytest.skip(text)
    assert status == "passed", text


def test_the_selection_is_every_ddp_test_torch_has():
    """Every _DistTestBase test that constructs DDP is selected or has its reason; no stale names."""
    selected, every = CPU + GPU, torch_ddp_port.ddp_tests()
    assert len(selected) == len(set(selected)) and not set(selected) & set(NOT_SELECTED)
    assert set(selected) | set(NOT_SELECTED) == every, (
        f"unlisted: {sorted(every - set(selected) - set(NOT_SELECTED))}; "
        f"not DDP tests: {sorted(set(selected) | set(NOT_SELECTED) - every)}")
    assert set(EXPECTED_FAIL) <= set(selected)


def test_the_docs_list_the_same_tests():
    """docs/torch_ddp_tests.md's tables name exactly the expected failures and the unselected."""
    import re
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "torch_ddp_tests.md").read_text()
    rows = re.findall(r"^\| `(test_\w+)` \|", doc, flags=re.M)
    assert sorted(rows) == sorted([*EXPECTED_FAIL, *NOT_SELECTED])
