"""What the ``graphckpt`` command works on: a model and its example inputs, named by TARGET.

TARGET is either

* ``zoo:NAME`` with optional constructor arguments as a query string, e.g.
  ``zoo:gpt?layers=2&d=32&batch=2`` (``batch`` goes to :func:`graphckpt.tools.zoo.make`, the rest
  to the model's constructor), or
* ``package.module:callable`` (or ``path/to/file.py:callable``) naming a function that
  returns ``(model, example_inputs)``; it is called with ``batch=`` when ``--batch`` is
  given and it accepts that argument.

Every way this can go wrong raises :class:`TargetError` with a message a person can act on,
so the command line can print one line instead of a traceback.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl

import torch
from torch import nn

from graphckpt.tools import zoo


class TargetError(ValueError):
    """TARGET does not name a model we can build (bad syntax, import error, wrong return)."""


@dataclass
class Target:
    """A model ready to plan: the module, its positional example inputs and a display name."""

    spec: str
    model: nn.Module
    inputs: tuple
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def description(self) -> str:
        """``spec`` plus its parameter count, for titles and table captions."""
        params = sum(p.numel() for p in self.model.parameters())
        return f"{self.spec} ({type(self.model).__name__}, {params:,} parameters)"


def _coerce(text: str) -> Any:
    """A query-string value as int, float, bool, str, or a tuple of them where commas part it
    (``"4"`` -> 4, ``"0.1"`` -> 0.1, ``"32,64"`` or ``"(32,64)"`` -> (32, 64)): ResNet's
    ``widths`` are a tuple."""
    if "," in text:
        return tuple(_coerce(part.strip()) for part in text.strip("()[] ").split(",") if part.strip())
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def parse_zoo_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """``"zoo:gpt?layers=2&d=32"`` -> ``("gpt", {"layers": 2, "d": 32})``."""
    body = spec.removeprefix("zoo:")
    name, _, query = body.partition("?")
    try:
        pairs = parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query))
    except ValueError:
        raise TargetError(f"{spec!r}: cannot read the options after '?'; write them like "
                          "zoo:gpt?layers=2&d=32") from None
    return name, {key: _coerce(value) for key, value in pairs}


def _load_zoo(spec: str, batch: int | None) -> Target:
    name, options = parse_zoo_spec(spec)
    if name not in zoo.names():
        raise TargetError(f"unknown zoo model {name!r}; known: {', '.join(zoo.names())}")
    if batch is not None:
        options["batch"] = batch
    try:
        model, inputs = zoo.make(name, **options)
    except TypeError as error:
        raise TargetError(f"{spec}: {error}") from error
    return Target(spec, model, tuple(inputs), options)


def _import_module(module_name: str) -> Any:
    """Import ``package.module``, or load ``path/to/file.py`` as a module."""
    if module_name.endswith(".py"):
        path = Path(module_name)
        if not path.is_file():
            raise TargetError(f"no such file: {module_name}")
        spec = importlib.util.spec_from_file_location(path.stem, path)
        if spec is None or spec.loader is None:
            raise TargetError(f"cannot load {module_name} as a Python module")
        module = importlib.util.module_from_spec(spec)
        sys.modules[path.stem] = module
        spec.loader.exec_module(module)
        return module
    if "" not in sys.path and "." not in sys.path:
        sys.path.insert(0, "")  # like `python -m`: modules in the working directory import
    return importlib.import_module(module_name)


def _resolve_callable(spec: str) -> Any:
    module_name, _, attribute = spec.rpartition(":")
    if not module_name or not attribute:
        raise TargetError(f"TARGET {spec!r}: expected zoo:NAME or package.module:callable")
    try:
        obj: Any = _import_module(module_name)
    except TargetError:
        raise
    except Exception as error:  # any import-time failure of user code is the user's to fix
        raise TargetError(f"cannot import {module_name!r}: {type(error).__name__}: {error}") from error
    for part in attribute.split("."):
        if not hasattr(obj, part):
            raise TargetError(f"{module_name!r} has no attribute {attribute!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise TargetError(f"{spec}: {attribute!r} is a {type(obj).__name__}, not a callable")
    return obj


def _accepts_batch(function: Any) -> bool:
    try:
        parameters = inspect.signature(function).parameters
    except (TypeError, ValueError):
        return False
    return "batch" in parameters or any(p.kind is p.VAR_KEYWORD for p in parameters.values())


def _check_result(spec: str, result: Any) -> tuple[nn.Module, tuple]:
    """``(model, inputs)`` from what the user's callable returned, or a :class:`TargetError`."""
    if not isinstance(result, (tuple, list)) or len(result) != 2:
        raise TargetError(f"{spec} returned {type(result).__name__}; it must return (model, example_inputs)")
    model, inputs = result
    if not isinstance(model, nn.Module):
        raise TargetError(f"{spec} returned {type(model).__name__} as the model; expected a torch.nn.Module")
    if isinstance(inputs, torch.Tensor):
        inputs = (inputs,)
    if not isinstance(inputs, (tuple, list)):
        raise TargetError(f"{spec} returned {type(inputs).__name__} as example inputs; expected a tensor "
                          "or a tuple of positional arguments")
    return model, tuple(inputs)


def _load_callable(spec: str, batch: int | None) -> Target:
    function = _resolve_callable(spec)
    kwargs = {"batch": batch} if batch is not None and _accepts_batch(function) else {}
    try:
        result = function(**kwargs)
    except Exception as error:
        raise TargetError(f"{spec}() failed: {type(error).__name__}: {error}") from error
    model, inputs = _check_result(spec, result)
    return Target(spec, model, inputs, kwargs)


def load_target(spec: str, batch: int | None = None) -> Target:
    """Build the model and example inputs TARGET names (see the module docstring)."""
    if spec.startswith("zoo:"):
        return _load_zoo(spec, batch)
    return _load_callable(spec, batch)
