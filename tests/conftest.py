"""Test-run set-up. The suite runs on pytest-xdist workers (``-n auto`` in pyproject's
``addopts``): each worker gets its share of the CPU's threads for torch's intra-op pool, so
workers do not oversubscribe the cores (on 2 cores, two workers with two threads each ran
24 min of CPU for 12.5 min of wall time)."""

from __future__ import annotations

import os

import pytest


def pytest_configure(config: pytest.Config) -> None:
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        import torch

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))
