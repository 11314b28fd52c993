"""TensorRef: how an architecture names part of a checkpoint tensor (an expert of a fused
tensor, the even rows of an interleaved gate/up, a gather of rows), and how that part is cut
from the whole. The architectures (colibrid/models/) write them; the converter reads them."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class TensorRef:
    """Part of a checkpoint tensor: ``index`` selects along its leading axes (expert e of a
    fused (E, R, C) tensor: ``(e,)``), then ``rows`` slices the row axis (the second to last:
    ``slice(0, None, 2)`` for the even rows of an interleaved gate/up; of a 1-D part, a bias
    with one value per row, its elements). ``rows`` may also be a tuple of row numbers, a
    gather in that order (a fused projection whose parts interleave per head: Qwen3.5's
    q_proj, Qwen3-Next's in_proj_qkvz); such a part is read through read_f32.

    ``transposed``: a value tensor (F32/BF16/F16/F8) stores the part as (..., C, R), the way
    transformers keeps gpt-oss's fused experts (used as x @ W); it is read as its (..., R, C)
    transpose, rows sliced after. An MXFP4 tensor always holds its groups of 32 along the
    input dim, i.e. already (..., R, C) (gpt-oss's published ``*_blocks``), so the flag does
    not apply to it.

    ``view``: the part's shape read as this one, same elements in the same order (a depthwise
    conv weight (C, 1, Kc) as the (C, Kc) matrix it is); applied right after ``index``. A part
    whose element count differs keeps its own shape, so the shape check names the mismatch."""

    name: str
    index: tuple[int, ...] = ()
    rows: slice | tuple[int, ...] | None = None
    transposed: bool = False
    view: tuple[int, ...] | None = None

    @classmethod
    def of(cls, ref: "str | TensorRef") -> "TensorRef":
        return ref if isinstance(ref, TensorRef) else cls(ref)

    def __str__(self) -> str:
        parts = [str(i) for i in self.index]
        if isinstance(self.rows, slice):
            parts.append(f"{self.rows.start or ''}:{self.rows.stop or ''}:{self.rows.step or ''}")
        elif self.rows is not None:
            parts.append(f"<{len(self.rows)} rows from {min(self.rows, default=0)}>")
        named = f"{self.name}[{', '.join(parts)}]" if parts else self.name
        return named + (".T" if self.transposed else "")

    def select(self, array: np.ndarray, transpose: bool = True) -> np.ndarray:
        """This part of ``array`` (the whole tensor, or a same-leading-shape companion) as a
        view; ``transpose`` False ignores ``transposed`` (MXFP4 parts)."""
        part = array[self.index] if self.index else array
        if self.view is not None and part.size == math.prod(self.view):
            part = part.reshape(self.view)
        if self.transposed and transpose and part.ndim >= 2:
            part = part.swapaxes(-1, -2)
        return slice_rows(part, self.rows)


def slice_rows(part: np.ndarray, rows: slice | tuple[int, ...] | None) -> np.ndarray:
    """``rows`` of the row axis (the second to last; of a 1-D part, its elements)."""
    if rows is None:
        return part
    if not isinstance(rows, slice):
        rows = np.asarray(rows, dtype=np.int64)  # a gather (a tuple would index several axes)
    return part[rows] if part.ndim == 1 else part[..., rows, :]
