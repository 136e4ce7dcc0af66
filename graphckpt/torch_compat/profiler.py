"""The torch profiler's private internals: whether a session runs, named ranges in its trace,
its event tree and allocation events, and its memory timeline (how graphckpt measures peaks
on CPU). Part of :mod:`graphckpt.torch_compat`, which re-exports every name here."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import re
import sys
import tempfile
from collections.abc import Hashable, Iterator
from typing import Any

import torch

__all__ = ["RANGE_PREFIX", "allocations_under", "memory_timeline_allocations", "profiled_event_tree",
           "profiled_range", "profiler_enabled", "quiet_profile", "stderr_without"]


def profiler_enabled() -> bool:
    """Whether a torch profiler session is running (a second one would corrupt both).

    ``torch.autograd.profiler._is_profiler_enabled``. Checked on 2.5, 2.6, 2.13.
    """
    return bool(torch.autograd.profiler._is_profiler_enabled)


KINETO_MARKER = re.compile(r"USDT:[^\n]*ActivityProfilerHandler\.cpp:\d+\] profiler_(start|stop)\s*")
"""A line kineto writes to the process's stderr as each profiler session starts and stops
(torch 2.13: ``USDT:2026-12-03 10:20:10 31154:31154 SyncActivityProfilerHandler.cpp:52]
profiler_start``). Only ``KINETO_LOG_LEVEL=6`` set before the process's first session silences
it, and that silences kineto's warnings and errors for the user's own sessions too."""


@contextlib.contextmanager
def quiet_profile(**options: Any) -> Iterator[torch.profiler.profile]:
    """``torch.profiler.profile(**options)`` whose start and stop leave no kineto marker line
    (:data:`KINETO_MARKER`) on stderr: graphckpt measures op times and peaks in profiler
    sessions, and a user calling ``rewrite(model, inputs)`` would see two such lines per
    session. Whatever else is written to stderr while a session starts or stops is passed on."""
    prof = torch.profiler.profile(**options)
    with stderr_without(KINETO_MARKER):
        prof.__enter__()
    try:
        yield prof
    finally:
        with stderr_without(KINETO_MARKER):
            prof.__exit__(*sys.exc_info())


@contextlib.contextmanager
def stderr_without(lines: re.Pattern[str]) -> Iterator[None]:
    """The process's stderr (file descriptor 2, where torch's C++ writes) caught while the
    block runs, then written back less the lines ``lines`` matches at their start: the one
    filter for the profiler's chatter (:func:`quiet_profile`, the CLI's
    :func:`graphckpt.tools.console.quiet_profiler`)."""
    sys.stderr.flush()
    try:
        saved = os.dup(2)
    except OSError:  # no file descriptor 2 (embedded interpreters): nothing to filter
        yield
        return
    with tempfile.TemporaryFile(mode="w+b") as caught:
        os.dup2(caught.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            caught.seek(0)
            kept = [line for line in caught.read().decode(errors="replace").splitlines(keepends=True)
                    if not lines.match(line)]
            if kept:
                sys.stderr.write("".join(kept))


_NO_RANGE = contextlib.nullcontext()
RANGE_PREFIX = "graphckpt "  # what every range :func:`profiled_range` marks is named from


def profiled_range(*words: object) -> contextlib.AbstractContextManager:
    """A range named ``graphckpt <words>`` in the running profiler's trace
    (``record_function``), or nothing when no profiler runs (the name is not even made):
    a rewritten module's segments show in a user's traces at no cost to an unprofiled step."""
    if not profiler_enabled():
        return _NO_RANGE
    return torch.profiler.record_function(RANGE_PREFIX + " ".join(map(str, words)))


def profiled_event_tree(prof: torch.profiler.profile) -> list[Any]:
    """The root events of a finished profiler session (each with ``name`` and ``children``).

    ``prof.profiler.kineto_results.experimental_event_tree()``. Checked on 2.5, 2.6, 2.13.
    """
    results = prof.profiler.kineto_results if prof.profiler is not None else None
    return list(results.experimental_event_tree()) if results is not None else []


def allocations_under(event: Any) -> list[tuple[int, Hashable, int]]:
    """Every allocation and free under a profiler event, in time order: ``(time_ns,
    address, bytes)``, bytes negative for a free.

    Events tagged ``torch._C._profiler._EventType.Allocation`` and their ``extra_fields``
    (``ptr``, ``alloc_size``). Checked on 2.5, 2.6, 2.13.
    """
    from torch._C._profiler import _EventType

    allocations, stack = [], [event]
    while stack:
        node = stack.pop()
        if node.tag == _EventType.Allocation:
            allocations.append((node.start_time_ns, node.extra_fields.ptr, node.extra_fields.alloc_size))
        stack.extend(node.children)
    return sorted(allocations, key=lambda allocation: allocation[0])


def _timeline_events(prof: torch.profiler.profile,
                     device: torch.device) -> list[tuple[Hashable | None, int]]:
    """The storages created and destroyed on ``device`` during a profiler session run with
    ``profile_memory=True, record_shapes=True``, in time order: ``(key, +bytes)`` for a
    creation, ``(key, -bytes)`` for a destruction. ``key`` names one storage, or is ``None``
    when the profiler could not tie the allocation to a tensor (a creation and destruction
    then cannot be matched). Rows for storages that existed before, and in-place writes,
    are left out.

    ``torch.profiler._memory_profiler.MemoryProfile(...).timeline`` rows ``(time, Action,
    (key, version), bytes)``, a ``TensorKey`` or a bare ``Key``. (``prof._memory_profile()``
    would insist on ``with_stack=True``, which only feeds category heuristics the timeline
    does not need.) Checked on 2.5, 2.6, 2.13.
    """
    from torch.profiler._memory_profiler import Action, MemoryProfile, TensorKey

    results = prof.profiler.kineto_results if prof.profiler is not None else None
    if results is None:
        raise RuntimeError("the profiler returned no results; is another profiler (e.g. kineto/nsys) interfering?")
    events: list[tuple[Hashable | None, int]] = []
    for _time, action, (key, _version), size in MemoryProfile(results).timeline:
        if key is None or key.device != device or action not in (Action.CREATE, Action.DESTROY):
            continue
        events.append((key if isinstance(key, TensorKey) else None, size if action == Action.CREATE else -size))
    return events


_NONE_BALLAST: list[None] = []  # references to None that torch's profiler bindings dropped without owning them
ctypes.pythonapi.Py_IncRef(ctypes.py_object(_NONE_BALLAST))  # never freed, not even as the interpreter exits


def memory_timeline_allocations(prof: torch.profiler.profile,
                                device: torch.device) -> list[tuple[Hashable | None, int]]:
    """:func:`_timeline_events`, giving ``None`` back the references reading it drops.

    Torch 2.13's ``TensorMetadata.storage_data_ptr`` (which ``MemoryProfile`` reads for every
    tensor input of every op) returns ``None`` without a new reference, so each read drops
    one of None's: a process measuring many steps (the bf16 corpus; MobileNetV2 ~33k a step)
    ran None's count to zero and died, "Fatal Python error: none_dealloc". What the read
    dropped (None's count before, less after, plus the ``None`` keys the result holds) is
    kept here, in a list never freed (freed with the modules at exit, it gave the deficit
    back); a reference too many to None is harmless. Pythons from 3.12 on, whose None is
    immortal, skip the count and the collection it needs.
    """
    if sys.version_info >= (3, 12):  # None is immortal there (PEP 683): nothing to give back
        return _timeline_events(prof, device)
    before = sys.getrefcount(None)
    with _collecting_only_new_objects():
        events = _timeline_events(prof, device)
        gc.collect()  # the profile's own cycles hold some of those Nones until they are collected
    held = sum(key is None for key, _ in events)
    _NONE_BALLAST.extend([None] * (max(before - sys.getrefcount(None) + held, 0) + 8))  # and a margin
    return events


@contextlib.contextmanager
def _collecting_only_new_objects():
    """Within it, a ``gc.collect()`` scans only the objects made inside it: every older one
    is frozen (``gc.freeze``) and thawed on the way out. The memory timeline's cycles are all
    new; a full collection in a test process or a benchmark took 0.25-0.3 s a measurement,
    more than reading the timeline (stop 66). Where the process froze objects itself
    (``gc.get_freeze_count()``), nothing is frozen here: thawing would thaw its objects too."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
