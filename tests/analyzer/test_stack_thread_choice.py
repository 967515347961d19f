"""The stack excerpt shows the thread that matters: the one blocked in
torch.distributed, else the main thread; never hangwatch's own helpers."""

from __future__ import annotations

from pathlib import Path

from hangwatch.analyzer.report import StackState
from hangwatch.analyzer.stackdiag import classify
from hangwatch.analyzer.text import stack_excerpt

from hangwatch.formats import RankMeta
from hangwatch.stacktext import parse_threads, reading_order

# `python -m train`: the main thread's outermost frame is runpy's; a helper
# thread is deep in an import (more frames, and `<module>` frames inside).
PYTHON_M = """Thread 0x00007f2 (most recent call first):
  File "<frozen importlib._bootstrap>", line 241 in _call_with_frames_removed
  File "/site/big/__init__.py", line 3 in <module>
  File "<frozen importlib._bootstrap>", line 1147 in _find_and_load_unlocked
  File "<frozen importlib._bootstrap>", line 1176 in _find_and_load
  File "/site/big/loader.py", line 9 in <module>
  File "/site/big/loader.py", line 20 in warm
  File "/usr/lib/python3.11/threading.py", line 975 in run
  File "/usr/lib/python3.11/threading.py", line 1038 in _bootstrap_inner
  File "/usr/lib/python3.11/threading.py", line 995 in _bootstrap

Current thread 0x00007f1 (most recent call first):
  File "/repo/train/loop.py", line 40 in step
  File "/repo/train/__main__.py", line 9 in main
  File "<frozen runpy>", line 88 in _run_code
  File "<frozen runpy>", line 198 in _run_module_as_main
"""

# The main thread blocked in all_reduce, called through hangwatch's hook;
# hangwatch's endpoint thread is in torch.distributed too (taking a dump).
IN_COLLECTIVE = """Thread 0x00007f3 (most recent call first):
  File "/site/torch/distributed/distributed_c10d.py", line 4800 in _dump_nccl_trace
  File "/site/hangwatch/hook_server.py", line 90 in _serve
  File "/usr/lib/python3.11/threading.py", line 975 in run
  File "/usr/lib/python3.11/threading.py", line 1038 in _bootstrap_inner
  File "/usr/lib/python3.11/threading.py", line 995 in _bootstrap

Thread 0x00007f2 (most recent call first):
  File "/repo/data.py", line 12 in prefetch
  File "/repo/data.py", line 30 in loop
  File "/repo/data.py", line 31 in loop2
  File "/repo/data.py", line 32 in loop3
  File "/usr/lib/python3.11/threading.py", line 975 in run
  File "/usr/lib/python3.11/threading.py", line 995 in _bootstrap

Current thread 0x00007f1 (most recent call first):
  File "/site/torch/distributed/distributed_c10d.py", line 2800 in all_reduce
  File "/site/torch/distributed/c10d_logger.py", line 81 in wrapper
  File "/site/hangwatch/hook.py", line 300 in wrapped
  File "/repo/train.py", line 77 in step
  File "/repo/train.py", line 90 in <module>
"""

PYSPY_HELPERS = """Process 123: python -m train
Python v3.11.7 (/usr/bin/python3.11)

Thread 140 (idle): "hangwatch-fr-endpoint"
    select (selectors.py:415)
    _serve (/site/hangwatch/hook_server.py:90)
    run (threading.py:975)
    _bootstrap_inner (threading.py:1038)
    _bootstrap (threading.py:995)
Thread 130 (active): "Thread-1 (worker)"
    all_gather (/site/torch/distributed/distributed_c10d.py:3000)
    sync (/repo/ckpt.py:10)
    run (threading.py:975)
    _bootstrap (threading.py:995)
Thread 123 (idle): "MainThread"
    wait (threading.py:331)
    join (/repo/ckpt.py:40)
    _run_module_as_main (<frozen runpy>:198)
"""


def test_python_m_launch_shows_the_main_thread_not_a_helper_deep_in_an_import() -> None:
    assert stack_excerpt(PYTHON_M, frames=2) == [
        "step (loop.py:40)",
        "main (__main__.py:9)",
        "... 2 outer frames",
    ]


def test_the_thread_blocked_in_torch_distributed_wins_never_hangwatchs_own() -> None:
    assert stack_excerpt(IN_COLLECTIVE, frames=2) == [
        "all_reduce (distributed_c10d.py:2800)",
        "wrapper (c10d_logger.py:81)",
        "... 3 outer frames",
    ]


def test_pyspy_thread_in_a_collective_beats_mainthread_and_helpers_are_skipped() -> None:
    assert stack_excerpt(PYSPY_HELPERS, frames=1) == [
        "all_gather (distributed_c10d.py:3000)",
        "... 3 outer frames",
    ]
    only_helper_and_main = PYSPY_HELPERS.split("Thread 130")[0] + (
        'Thread 123 (idle): "MainThread"\n    wait (threading.py:331)\n'
    )
    assert stack_excerpt(only_helper_and_main) == ["wait (threading.py:331)"]


def test_py_spy_mainthread_when_nobody_is_in_a_collective() -> None:
    text = PYSPY_HELPERS.replace("torch/distributed/distributed_c10d.py", "repo/gather.py")
    assert stack_excerpt(text, frames=1) == ["wait (threading.py:331)", "... 2 outer frames"]


# A real dump (torch's worker server, faulthandler format) of a rank stuck
# outside collectives while the hook's FR handler, entered from C++, was
# deep in an import: torch's first stack-symbolising dump imports inductor.
# The handler's thread is deeper and not started by threading; it is not the
# main thread. Paths are shortened, the frames are as captured.
WORKER_SERVER_HANDLER = (
    Path(__file__).resolve().parent / "stacks" / "worker-server-handler.txt"
).read_text()


def test_a_hook_handler_entered_from_cpp_is_never_taken_for_the_main_thread() -> None:
    got = stack_excerpt(WORKER_SERVER_HANDLER, frames=3)
    assert got == [
        "wait (threading.py:331)",
        "wait (threading.py:629)",
        "_stall_outside_collectives (job.py:246)",
        "... 5 outer frames",
    ], got
    # The stack diagnosis reads the same thread: the rank waits, it is not importing.
    assert classify(1, RankMeta(rank=1, stacks=WORKER_SERVER_HANDLER)).state == StackState.SLEEPING


def test_the_page_shows_the_thread_that_matters_first_and_loses_nothing() -> None:
    """The incident page's stacks box (reading_order): the rank's own thread
    opens it with its innermost frame of the job's code marked; the hook's
    100-line handler thread is folded apart, still there."""
    order = reading_order(WORKER_SERVER_HANDLER)
    first_block = order.shown.split("\nThread ")[0]
    assert "_stall_outside_collectives" in first_block, first_block[:500]
    assert "importlib" not in order.shown and "hook_endpoint" not in order.shown
    assert order.helper_count == 1 and "hook_endpoint" in order.helpers
    both = order.shown.splitlines() + order.helpers.splitlines()
    assert sorted(filter(None, both)) == sorted(filter(None, WORKER_SERVER_HANDLER.splitlines()))
    assert order.user_line is not None
    assert "_stall_outside_collectives" in order.shown.splitlines()[order.user_line]
    assert order.user_frame == "_stall_outside_collectives (job.py:246)"
    # Text with no thread in it comes back as it was.
    assert reading_order("<no Python frame>\n").shown == "<no Python frame>\n"


# Sampled from a 2-rank gloo DDP job on torch 2.13 (paths shortened):
# DistributedDataParallel's constructor imports torch._dynamo.
DDP_IMPORTS_DYNAMO = """Current thread 0x00007fd38c438b80 (most recent call first):
  File "<frozen importlib._bootstrap_external>", line 1131 in get_data
  File "<frozen importlib._bootstrap>", line 1176 in _find_and_load
  File "/site/torch/_dynamo/symbolic_convert.py", line 56 in <module>
  File "<frozen importlib._bootstrap>", line 1176 in _find_and_load
  File "/site/torch/_dynamo/convert_frame.py", line 62 in <module>
  File "/site/torch/_dynamo/aot_compile.py", line 17 in <module>
  File "/site/torch/_dynamo/__init__.py", line 13 in <module>
  File "/usr/lib/python3.11/importlib/__init__.py", line 126 in import_module
  File "/site/torch/__init__.py", line 2954 in __getattr__
  File "/site/torch/nn/parallel/distributed.py", line 842 in __init__
  File "/repo/train.py", line 90 in main
"""


def test_importing_torch_compile_modules_is_not_compiling() -> None:
    (imports,) = parse_threads(DDP_IMPORTS_DYNAMO)
    assert not imports.in_torch_compile
    # The same imports under a compile that runs: compiling.
    compiling = DDP_IMPORTS_DYNAMO.replace(
        '  File "/usr/lib/python3.11/importlib/__init__.py"',
        '  File "/site/torch/_dynamo/convert_frame.py", line 1400 in _compile\n'
        '  File "/usr/lib/python3.11/importlib/__init__.py"',
    )
    (compile_thread,) = parse_threads(compiling)
    assert compile_thread.in_torch_compile
