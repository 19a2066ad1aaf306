"""Triton 3.6's interpreter turns a scalar into a Python int with ``int(array)``, which numpy >= 2.4 refuses
for the 1-element (not 0-d) arrays the interpreter holds scalars in ("only 0-dimensional arrays can be
converted to Python scalars"): every ``range()`` over a runtime bound fails. Importing this module makes
``__index__`` take the single element instead. A no-op where numpy still accepts it."""

from __future__ import annotations

import numpy as np
from triton.runtime import interpreter as _interpreter

_original = _interpreter._patch_lang_tensor


def _index(self) -> int:
    data = np.asarray(self.handle.data)
    if data.size != 1:
        raise TypeError(f"only single-element tensors can be used as an index, got shape {data.shape}")
    return int(data.reshape(-1)[0])


def _patch_lang_tensor(tensor, scope) -> None:
    _original(tensor, scope)
    scope.set_attr(tensor, "__index__", _index)  # recorded after the original's, so restored in order


_interpreter._patch_lang_tensor = _patch_lang_tensor
