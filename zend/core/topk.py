"""Top-k sparsification with error feedback (DGC-style) for dense layers.

Each call adds the residual left from earlier steps, keeps the k largest magnitudes and
carries the rest over: nothing is dropped, only delayed.
"""

from __future__ import annotations

import math

import torch

from zend.core.sparse import SparseGrad, SparseGradError


class TopKCompressor:
    """Keeps `ratio` of each tensor's elements per step; one residual per tensor name."""

    def __init__(self, ratio: float):
        if not 0.0 < ratio <= 1.0:
            raise SparseGradError(f"top-k ratio {ratio} outside (0, 1]")
        self.ratio = ratio
        self.residuals: dict[str, torch.Tensor] = {}

    def compress(self, name: str, grad: torch.Tensor) -> SparseGrad:
        """An element-sparse gradient over the flattened tensor (rows = elements)."""
        flat = grad.detach().reshape(-1)
        residual = self.residuals.get(name)
        if residual is not None:
            if residual.shape != flat.shape or residual.dtype != flat.dtype:
                raise SparseGradError(
                    f"tensor {name!r}: shape {tuple(grad.shape)} / {grad.dtype} differs from earlier steps"
                )
            flat = flat + residual
        else:
            flat = flat.clone()
        k = max(1, math.ceil(self.ratio * flat.numel())) if flat.numel() else 0
        keep = torch.topk(flat.abs().float(), k, sorted=False).indices.sort().values
        values = flat[keep]
        flat[keep] = 0
        self.residuals[name] = flat
        return SparseGrad(keep, values, flat.numel(), name, True)

    @staticmethod
    def decompress(sparse: SparseGrad, shape: torch.Size | tuple[int, ...]) -> torch.Tensor:
        return sparse.to_dense().reshape(shape)
