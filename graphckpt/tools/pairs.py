"""Head-to-head step times that mean something on a shared CPU machine.

Two rules (issue 14): time with an allocator that keeps freed memory, as a GPU's caching
allocator does, else page faults decide CPU step times; and compare two variants only by
steps taken moments apart, one pair per round with the order alternating, reporting the
median ratio with a bootstrap interval.
"""

from __future__ import annotations

import os
import random
import resource
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

RETAINING = "glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=68719476736"


def allocator_retains() -> bool:
    """Whether this process runs with glibc told to keep freed memory (:data:`RETAINING`)."""
    return RETAINING in os.environ.get("GLIBC_TUNABLES", "")


def rerun_with_retaining_allocator(argv: Sequence[str] | None = None) -> None:
    """Replace this process by itself with :data:`RETAINING` set (glibc reads it only at
    start); a no-op when it is set already. Call first thing in a benchmark's ``main``."""
    if allocator_retains():
        return
    tunables = ":".join(filter(None, [os.environ.get("GLIBC_TUNABLES", ""), RETAINING]))
    os.execve(sys.executable, [sys.executable, *(argv if argv is not None else sys.argv)],
              {**os.environ, "GLIBC_TUNABLES": tunables})


def minor_faults() -> int:
    """Minor page faults of this process so far (memory the OS had to hand back in)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


@dataclass(frozen=True)
class HeadToHead:
    """Step-time ratios of ``ours`` over ``theirs``, one per round, and page faults per step."""

    ratios: tuple[float, ...]
    faults_per_step: tuple[float, float]

    @property
    def median(self) -> float:
        return statistics.median(self.ratios)

    def interval(self, draws: int = 2000) -> tuple[float, float]:
        """95% bootstrap interval of the median ratio."""
        return bootstrap_interval(self.ratios, draws)

    def summary(self, ours: str, theirs: str) -> str:
        low, high = self.interval()
        faster = sum(r < 1 for r in self.ratios)
        return (f"{ours} over {theirs}: median {self.median:.3f}x (95% bootstrap interval {low:.3f}-{high:.3f}), "
                f"faster in {faster} of {len(self.ratios)} rounds; minor page faults per step "
                f"{self.faults_per_step[0]:.0f} vs {self.faults_per_step[1]:.0f}")


def head_to_head(ours: Callable[[], None], theirs: Callable[[], None], rounds: int) -> HeadToHead:
    """Time ``rounds`` pairs of one step each (after one warm-up step each), who goes first
    alternating: on a VM whose speed drifts by tens of percent, only steps taken moments
    apart compare."""
    steps = (ours, theirs)
    for step in steps:
        step()
    ratios, faults = [], [0, 0]
    for round_index in range(rounds):
        seconds = [0.0, 0.0]
        for index in (0, 1) if round_index % 2 else (1, 0):
            before = minor_faults()
            start = time.perf_counter()
            steps[index]()
            seconds[index] = time.perf_counter() - start
            faults[index] += minor_faults() - before
        ratios.append(seconds[0] / seconds[1])
    return HeadToHead(tuple(ratios), (faults[0] / rounds, faults[1] / rounds))


def bootstrap_interval(ratios: Sequence[float], draws: int = 2000) -> tuple[float, float]:
    """95% bootstrap interval of the median of ``ratios``."""
    rng = random.Random(0)
    medians = sorted(statistics.median(rng.choices(list(ratios), k=len(ratios))) for _ in range(draws))
    return medians[int(0.025 * draws)], medians[int(0.975 * draws) - 1]
