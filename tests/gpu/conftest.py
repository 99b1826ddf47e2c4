"""What the GPU tests report beside pass or fail: figures measured on the lent GPU (scripts/gpu_checks.sh
collects them into its table from $ZEN_GPU_FIGURES)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable

import pytest


@pytest.fixture
def gpu_figure(request: pytest.FixtureRequest) -> Callable[[str, float, str], None]:
    def record(figure: str, value: float, unit: str) -> None:
        print(f"GPU_FIGURE {request.node.name}: {figure} = {value:.4g} {unit}", flush=True)
        path = os.environ.get("ZEN_GPU_FIGURES")
        if path:
            with open(path, "a") as f:
                f.write(json.dumps({"test": request.node.name, "figure": figure, "value": value, "unit": unit}) + "\n")
    return record
