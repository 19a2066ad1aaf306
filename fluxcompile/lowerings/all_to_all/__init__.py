"""fluxcompile.all_to_all_matmul and fluxcompile.matmul_all_to_all: their choices. Both run their reference
implementation (``all_to_all_single`` + matmuls, registered by lowerings/choices.py) on every device; their
fused kernels register here, as the other ops' do in their folders.

Choices, in registration order:
* ``triton:<tile>`` and, for the dispatch, ``triton:<tile>-split`` (triton.py, experimental:
  ``FLUXCOMPILE_EXPERIMENTAL_MOE=1``): the persistent Triton grouped GEMM of kernels/grouped_gemm.py with the
  all-to-all built in; the dispatch pulls its rows from the peers' symmetric send buffers in the GEMM's launch
  (``-split``: in a launch of its own), the combine's epilogue stores every row at its final place in its
  destination's receive buffer. Expert weights (``[E, K, N]``, grouped by ``offs`` or equal groups) only: dense
  weights are declined;
* ``reference`` (NCCL ``all_to_all_single`` + matmuls, registered by lowerings/choices.py).
"""

from __future__ import annotations

from ..choices import Choice, register_choice
from . import triton

OPS = ("all_to_all_matmul", "matmul_all_to_all")

if triton.gg is not None:
    for _name in triton.DISPATCH_VARIANTS:
        register_choice(OPS[0], Choice(f"{triton.NAME}:{_name}", *triton.make_dispatch(_name)))
    for _name in triton.COMBINE_VARIANTS:
        register_choice(OPS[1], Choice(f"{triton.NAME}:{_name}", *triton.make_combine(_name)))
