"""A Hugging Face model's key/value cache: a checkpointed training step builds none.

A causal LM's config says ``use_cache=True`` unless told otherwise (every ``from_pretrained``
GPT-2, LLaMA, Mistral...), and its forward then builds a ``DynamicCache`` that each layer
updates as it runs. Under checkpointing that goes wrong twice: torch.export cannot return the
cache object, so capturing any such model failed ("neither torch.fx nor torch.export could
capture GPT2LMHeadModel") unless its user had switched the cache off; and a recompute would
update the cache a second time, while the cache keeps every layer's keys and values alive to
the end of the step, beyond what the plan simulated. Hugging Face's own
``gradient_checkpointing_enable()`` switches the cache off for training calls
(``use_cache=True is incompatible with gradient checkpointing``); graphckpt does the same:

- capture runs the model with its config's ``use_cache`` off (:func:`cache_off_while_captured`),
  so the plan is a training step's and ``rewrite``'s module builds no cache (its code says so);
- ``enable`` adds a forward pre-hook to the model (:func:`training_calls_without_cache`)
  passing ``use_cache=False`` to calls that train with gradients; ``eval()``, ``no_grad`` and
  ``generate`` keep the cache.
"""

from __future__ import annotations

import contextlib
import inspect
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn


def caches_by_default(model: nn.Module) -> bool:
    """Whether ``model`` is a Hugging Face model whose forward builds a KV cache unless told not
    to: its config says ``use_cache=True`` and its forward takes ``use_cache``."""
    config = getattr(model, "config", None)
    if not getattr(config, "use_cache", False):
        return False
    try:
        return "use_cache" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


@contextlib.contextmanager
def cache_off_while_captured(model: nn.Module) -> Iterator[bool]:
    """``model.config.use_cache`` set to False inside, as it was after; yields whether it was on."""
    if not caches_by_default(model):
        yield False
        return
    model.config.use_cache = False
    try:
        yield True
    finally:
        model.config.use_cache = True


def training_calls_without_cache(model: nn.Module) -> Any:
    """A forward pre-hook on ``model`` passing ``use_cache=False`` to each call that trains with
    gradients (warning once when the call asked for the cache); its handle, or None where
    ``model`` builds no cache by default."""
    if not caches_by_default(model):
        return None
    return model.register_forward_pre_hook(_without_cache_when_training, with_kwargs=True)


def _without_cache_when_training(module: nn.Module, args: tuple,
                                 kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]] | None:
    if not (module.training and torch.is_grad_enabled()):
        return None
    if kwargs.get("use_cache"):
        warnings.warn("graphckpt: use_cache=True is incompatible with checkpointing; a training call runs with "
                      "use_cache=False, as Hugging Face's gradient_checkpointing_enable() does", stacklevel=2)
    return args, {**kwargs, "use_cache": False}
