"""Which children of a model are its blocks: the repeated layers per-block checkpointing
wraps (Hugging Face's ``gradient_checkpointing_enable``), found from the module tree alone.

Used by the ``blocks`` strategy (:func:`graphckpt.capture.block_paths`), the per-block
anchor of the benchmarks, and export's block stamping (:mod:`graphckpt.stamping`).
"""

from __future__ import annotations

from collections.abc import Iterator

from torch import nn


def _has_own_forward(module: nn.Module) -> bool:
    return type(module).forward is not nn.Module.forward and not isinstance(module, nn.ModuleList)


def _is_block(child: nn.Module) -> bool:
    """A callable, parametrised module with insides of its own: a layer a user checkpoints."""
    return (_has_own_forward(child) and any(True for _ in child.children())
            and any(True for _ in child.parameters()))


def find_blocks(module: nn.Module) -> Iterator[tuple[nn.Module, str]]:
    """``(container, name)`` of each block a user would checkpoint: the :func:`_is_block`
    children of ``nn.Sequential``/``nn.ModuleList`` containers, outermost first (a block's
    own insides are not searched). A model with none (timm's RegNet and DLA hold their
    stages as attributes: ``s1``, ``s2``...) has as blocks its outermost
    :func:`_repeated_children`."""
    found = list(_in_containers(module))
    return iter(found or _repeated_children(module))


def _in_containers(module: nn.Module) -> Iterator[tuple[nn.Module, str]]:
    container = isinstance(module, (nn.Sequential, nn.ModuleList))
    for name, child in module.named_children():
        if container and _is_block(child):
            yield module, name
        else:
            yield from _in_containers(child)


def _repeated_children(module: nn.Module) -> list[tuple[nn.Module, str]]:
    """``(module, name)`` of the :func:`_is_block` children of the outermost modules holding
    at least two of one class (those of the class it holds most of), searched outermost first.
    Containers are not blocks here: VGG's ``features`` and ``classifier`` are two
    containers, not two layers."""
    by_class: dict[type, list[str]] = {}
    for name, child in module.named_children():
        if _is_block(child) and not isinstance(child, (nn.Sequential, nn.ModuleList)):
            by_class.setdefault(type(child), []).append(name)
    names = max(by_class.values(), key=len, default=[])
    if len(names) >= 2:
        return [(module, name) for name in names]
    return [found for child in module.children() for found in _repeated_children(child)]


def join_path(parent: str, child: str) -> str:
    """A qualified module name: ``child`` inside ``parent`` (``""`` is the model itself).

    >>> join_path("model.layers", "3"), join_path("", "3")
    ('model.layers.3', '3')
    """
    return f"{parent}.{child}" if parent else child
