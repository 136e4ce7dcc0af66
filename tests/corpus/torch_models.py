"""Plain torch models shaped unlike the zoo's (graphckpt/tools/zoo.py): captured with torch.fx.

* :class:`SharedNormConvNet`: one BatchNorm module called at four places, so its running
  statistics are updated four times per step (and must be, exactly, after a rewrite).
* :class:`InplaceDropoutMLP`: residual MLP blocks written with in-place ops (``relu_``,
  ``add_``, ``mul_``) around dropout.
* :class:`ConcatDAG`: Inception-style branches joined by ``torch.cat`` and split by
  ``torch.chunk`` (views), with a long skip concatenation.
* :class:`GatedConvLM`: a recurrence-free sequence model: causal dilated 1-D convolutions
  with GLU gates, LayerNorm, a cumulative-sum mixer and its own cross-entropy loss.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tests.corpus.entries import Entry, Example


class SharedNormConvNet(nn.Module):
    """Convolutions of equal width, each followed by the same BatchNorm2d module."""

    def __init__(self, width: int = 16, convs: int = 4, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, width, 3, padding=1)
        self.convs = nn.ModuleList(nn.Conv2d(width, width, 3, padding=1) for _ in range(convs))
        self.norm = nn.BatchNorm2d(width)
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.stem(x))
        for conv in self.convs:
            x = x + F.relu(self.norm(conv(x)))
        return self.head(x.mean(dim=(2, 3)))


class InplaceDropoutMLP(nn.Module):
    """Residual blocks ``x += drop(relu_(fc2(relu_(fc1(x)))) * scale)`` written in place."""

    def __init__(self, width: int = 256, depth: int = 6, p: float = 0.1) -> None:
        super().__init__()
        self.fc1 = nn.ModuleList(nn.Linear(width, 2 * width) for _ in range(depth))
        self.fc2 = nn.ModuleList(nn.Linear(2 * width, width) for _ in range(depth))
        self.drop = nn.Dropout(p)
        self.out = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.out(x)
        for fc1, fc2 in zip(self.fc1, self.fc2, strict=True):
            h = fc1(x).relu_()
            h = self.drop(fc2(h)).mul_(0.5)
            x = x.clone().add_(h)
        return self.out(x)


class ConcatDAG(nn.Module):
    """Three Inception-style cells (1x1, 3x3, pooled branches concatenated), a chunk/swap of
    channels between cells and a skip concatenation of the stem to the last cell."""

    def __init__(self, width: int = 12, cells: int = 3, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, width, 3, padding=1)
        self.one = nn.ModuleList(nn.Conv2d(width, width, 1) for _ in range(cells))
        self.three = nn.ModuleList(nn.Conv2d(width, width, 3, padding=1) for _ in range(cells))
        self.pool = nn.ModuleList(nn.Conv2d(width, width, 1) for _ in range(cells))
        self.merge = nn.ModuleList(nn.Conv2d(3 * width, width, 1) for _ in range(cells))
        self.head = nn.Linear(2 * width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        stem = x = F.relu(self.stem(x))
        for one, three, pool, merge in zip(self.one, self.three, self.pool, self.merge, strict=True):
            branches = [one(x), three(x), pool(F.avg_pool2d(x, 3, stride=1, padding=1))]
            x = F.gelu(merge(torch.cat(branches, dim=1)))
            left, right = torch.chunk(x, 2, dim=1)
            x = torch.cat([right, left], dim=1)
        x = torch.cat([x, stem], dim=1)
        return self.head(x.mean(dim=(2, 3)))


class GatedConvLM(nn.Module):
    """Token embedding, causal dilated Conv1d + GLU blocks with LayerNorm and dropout, a
    causal cumulative-mean mixer, and the cross-entropy of next-token targets."""

    def __init__(self, vocab: int = 128, width: int = 64, depth: int = 4, p: float = 0.1) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.norms = nn.ModuleList(nn.LayerNorm(width) for _ in range(depth))
        self.convs = nn.ModuleList(nn.Conv1d(width, 2 * width, 3, dilation=2 ** i) for i in range(depth))
        self.mix = nn.Linear(width, width)
        self.drop = nn.Dropout(p)
        self.head = nn.Linear(width, vocab)

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.drop(self.embed(ids))
        for norm, conv in zip(self.norms, self.convs, strict=True):
            h = norm(x).transpose(1, 2)
            h = F.pad(h, (2 * conv.dilation[0], 0))
            x = x + self.drop(F.glu(conv(h), dim=1).transpose(1, 2))
        steps = torch.arange(1, x.shape[1] + 1, device=x.device, dtype=x.dtype).view(1, -1, 1)
        x = x + self.mix(x.cumsum(dim=1) / steps)
        logits = self.head(x)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def shared_bn_convnet() -> Example:
    return SharedNormConvNet(), (torch.randn(8, 3, 32, 32, generator=torch.Generator().manual_seed(1)),), {}


def inplace_dropout_mlp() -> Example:
    return InplaceDropoutMLP(), (torch.randn(256, 256, generator=torch.Generator().manual_seed(1)),), {}


def concat_dag() -> Example:
    return ConcatDAG(), (torch.randn(8, 3, 32, 32, generator=torch.Generator().manual_seed(1)),), {}


def gated_conv_lm() -> Example:
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 128, (8, 65), generator=generator)
    return GatedConvLM(), (ids[:, :-1], ids[:, 1:]), {}


def entries() -> list[Entry]:
    """The plain torch corpus entries."""
    def entry(name: str, family: str, description: str, builder) -> Entry:
        return Entry(name, family, description, builder, capture="fx", hf=False)

    return [
        entry("shared_bn_convnet", "torch: shared BatchNorm", "one BatchNorm2d called after each of 4 convs",
              shared_bn_convnet),
        entry("inplace_dropout_mlp", "torch: in-place MLP", "residual MLP, dropout 0.1, relu_/mul_/add_ in place",
              inplace_dropout_mlp),
        entry("concat_dag", "torch: branching DAG", "Inception-style cells, cat/chunk, skip concatenation",
              concat_dag),
        entry("gated_conv_lm", "torch: recurrence-free seq", "causal dilated conv + GLU, cumsum mixer, own loss",
              gated_conv_lm),
    ]
