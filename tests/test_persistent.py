"""symm_mem.persistent: the fused ops' persistent buffers are made on a thread of their own, outside the CUDA graph
memory pool the calling thread may be routed to (CUDA graph trees' warm-up). The facility itself on CPU: another
thread, its result, its exception; the refusal during capture."""

from __future__ import annotations

import threading

import pytest
import torch

from fluxcompile.symm_mem import persistent


def test_runs_on_another_thread_and_returns_its_result():
    caller = threading.get_ident()
    ident, t = persistent(lambda: (threading.get_ident(), torch.arange(4)))
    assert ident != caller
    assert t.tolist() == [0, 1, 2, 3]


class _Custom(Exception):
    pass


@pytest.mark.parametrize("error", [ValueError("bad size 7"), _Custom("no peer 3"), KeyError("group")])
def test_raises_the_functions_exception(error):
    def make():
        raise error

    with pytest.raises(type(error)) as info:
        persistent(make)
    assert info.value is error  # the same object: type, message and the worker's traceback
    assert str(info.value) == str(error)


def test_refuses_during_cuda_graph_capture(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    made = []
    with pytest.raises(RuntimeError, match="the error words cannot be made during CUDA graph capture"):
        persistent(lambda: made.append(1), "the error words")
    assert made == []
