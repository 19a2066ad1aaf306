"""symm_mem.ErrorWords on CPU (Triton's interpreter): a report checks the words at once, through the kernel
family's check; nothing is raised while the words are zero."""

from __future__ import annotations

import pytest
import torch

from fluxcompile.symm_mem import ErrorWords


def _check(words: torch.Tensor, what: str) -> None:
    if int(words[0]):
        raise RuntimeError(f"{what}: rank {int(words[1])} timed out")


def test_report_on_cpu_checks_at_once():
    errors = ErrorWords.make("cpu", 6, "the test kernels")
    assert errors.err.shape == (6,) and errors.err.dtype == torch.int32 and not errors.err.any()
    errors.check_previous("call 1", _check)
    errors.report("call 1", _check)  # zero words: no error
    errors.err[:2] = torch.tensor([1, 3])
    errors.check_previous("call 2", _check)  # on CPU only a report checks
    with pytest.raises(RuntimeError, match="call 2: rank 3 timed out"):
        errors.report("call 2", _check)
    errors.clear()
    assert not errors.err.any() and not errors.host.any()
    errors.report("call 3", _check)  # cleared: no error
