"""The terminal report's stack excerpt reads both stack formats the agent collects."""

from __future__ import annotations

from hangwatch.analyzer.text import stack_excerpt

FAULTHANDLER = """Current thread 0x00007f1 (most recent call first):
  File "/x/torch/distributed/debug.py", line 10 in _serve
  File "/usr/lib/python3.11/threading.py", line 982 in run

Thread 0x00007f2 (most recent call first):
  File "/repo/train.py", line 40 in load_batch
  File "/repo/train.py", line 77 in step
  File "/repo/train.py", line 90 in <module>
"""

PYSPY = """Process 123: python train.py
Python v3.11.7 (/usr/bin/python3.11)

Thread 123 (active+gil): "MainThread"
    spin (native.py:12)
    step (/repo/train.py:77)
    <module> (/repo/train.py:90)
Thread 130 (idle): "Thread-1"
    wait (threading.py:331)
"""


def test_faulthandler_dump_picks_the_main_thread_innermost_first() -> None:
    assert stack_excerpt(FAULTHANDLER, frames=2) == [
        "load_batch (train.py:40)",
        "step (train.py:77)",
        "... 1 outer frames",
    ]


def test_pyspy_dump_picks_mainthread() -> None:
    assert stack_excerpt(PYSPY) == [
        "spin (native.py:12)",
        "step (train.py:77)",
        "<module> (train.py:90)",
    ]


def test_text_without_frames_gives_nothing() -> None:
    assert stack_excerpt("") == []
    assert stack_excerpt("<no Python frame>\n") == []
