"""Small model zoo used by tests, the demo and benchmarks.

Every model is traceable by ``torch.fx.symbolic_trace`` (no control flow on
tensor values) and has small defaults so forward+backward runs in tens of
milliseconds on CPU; constructor arguments scale them up for benchmarks.
Each family stresses a different graph shape: a plain chain (``mlp``), short
residuals with BatchNorm and in-place ops (``resnet``), attention with dropout
and a mask buffer (``gpt``), long skips (``unet``) and dense concatenation
(``densenet``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import torch
import torch.nn.functional as F
from torch import nn


class MLPChain(nn.Module):
    """``depth`` x (Linear(width, width) + GELU): the simplest linear chain."""

    def __init__(self, depth: int = 24, width: int = 256) -> None:
        super().__init__()
        self.width = width
        self.layers = nn.Sequential(
            *[m for _ in range(depth) for m in (nn.Linear(width, width), nn.GELU())]
        )

    def example_inputs(self, batch: int) -> tuple[torch.Tensor, ...]:
        """Random (batch, width) input."""
        return (torch.randn(batch, self.width),)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def _conv_bn(cin: int, cout: int, k: int = 3, stride: int = 1) -> list[nn.Module]:
    return [nn.Conv2d(cin, cout, k, stride, k // 2, bias=False), nn.BatchNorm2d(cout)]


class BasicBlock(nn.Module):
    """ResNet basic block with in-place ReLU and an in-place residual add."""

    def __init__(self, cin: int, cout: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1, self.bn1 = _conv_bn(cin, cout, 3, stride)
        self.relu = nn.ReLU(inplace=True)
        self.conv2, self.bn2 = _conv_bn(cout, cout, 3, 1)
        self.shortcut: nn.Module = (
            nn.Sequential(*_conv_bn(cin, cout, 1, stride))
            if stride != 1 or cin != cout
            else nn.Identity()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = self.shortcut(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += identity
        return self.relu(out)


class ResNet(nn.Module):
    """Small CIFAR-style ResNet on (B, 3, 32, 32); BatchNorm + in-place ReLU."""

    def __init__(
        self,
        widths: tuple[int, ...] = (16, 32, 64),
        blocks_per_stage: int = 1,
        num_classes: int = 10,
        in_ch: int = 3,
    ) -> None:
        super().__init__()
        self.in_ch = in_ch
        self.stem = nn.Sequential(*_conv_bn(in_ch, widths[0]), nn.ReLU(inplace=True))
        blocks: list[nn.Module] = []
        cin = widths[0]
        for i, w in enumerate(widths):
            for j in range(blocks_per_stage):
                blocks.append(BasicBlock(cin, w, 2 if (i > 0 and j == 0) else 1))
                cin = w
        self.blocks = nn.Sequential(*blocks)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(cin, num_classes)

    def example_inputs(self, batch: int) -> tuple[torch.Tensor, ...]:
        """Random (batch, in_ch, 32, 32) images."""
        return (torch.randn(batch, self.in_ch, 32, 32),)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks(self.stem(x))
        return self.head(torch.flatten(self.pool(x), 1))


class CausalSelfAttention(nn.Module):
    """Explicit multi-head causal attention (no fused SDPA, graph stays visible)."""

    def __init__(self, d: int, heads: int, seq: int, dropout: float) -> None:
        super().__init__()
        assert d % heads == 0, "d must be divisible by heads"
        self.d, self.heads, self.hd = d, heads, d // heads
        self.scale = 1.0 / math.sqrt(self.hd)  # a constant, not a traced op
        self.q = nn.Linear(d, d)
        self.k = nn.Linear(d, d)
        self.v = nn.Linear(d, d)
        self.proj = nn.Linear(d, d)
        self.attn_drop = nn.Dropout(dropout)
        self.resid_drop = nn.Dropout(dropout)
        self.register_buffer("mask", torch.tril(torch.ones(seq, seq)), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T = x.size(0), x.size(1)
        q = self.q(x).view(B, T, self.heads, self.hd).transpose(1, 2)
        k = self.k(x).view(B, T, self.heads, self.hd).transpose(1, 2)
        v = self.v(x).view(B, T, self.heads, self.hd).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * self.scale
        # narrow, not self.mask[:T, :T]: fx cannot slice a buffer with a Proxy T.
        mask = self.mask.narrow(0, 0, T).narrow(1, 0, T)
        att = att.masked_fill(mask == 0, float("-inf"))
        att = self.attn_drop(F.softmax(att, dim=-1))
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, self.d)
        return self.resid_drop(self.proj(y))


class Block(nn.Module):
    """Pre-LN transformer block: x + attn(ln(x)); x + mlp(ln(x))."""

    def __init__(self, d: int, heads: int, seq: int, dropout: float) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = CausalSelfAttention(d, heads, seq, dropout)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(
            nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d), nn.Dropout(dropout)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Tiny GPT: LongTensor tokens (B, T<=seq) -> logits (B, T, vocab)."""

    def __init__(
        self,
        vocab: int = 256,
        d: int = 64,
        heads: int = 4,
        layers: int = 4,
        seq: int = 32,
        dropout: float = 0.1,
    ) -> None:
        super().__init__()
        self.seq = seq
        self.tok_emb = nn.Embedding(vocab, d)
        self.pos_emb = nn.Embedding(seq, d)
        self.register_buffer("pos", torch.arange(seq), persistent=False)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.Sequential(
            *[Block(d, heads, seq, dropout) for _ in range(layers)]
        )
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def example_inputs(self, batch: int) -> tuple[torch.Tensor, ...]:
        """Random (batch, seq) token ids."""
        return (torch.randint(0, self.tok_emb.num_embeddings, (batch, self.seq)),)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.size(1)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(self.pos.narrow(0, 0, T)))
        return self.head(self.ln_f(self.blocks(x)))


def _double_conv(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(cin, cout, 3, padding=1), nn.ReLU(inplace=True),
        nn.Conv2d(cout, cout, 3, padding=1), nn.ReLU(inplace=True),
    )  # fmt: skip


class UNet(nn.Module):
    """Small U-Net on (B, in_ch, H, W), H and W divisible by 2**levels.

    Encoder outputs are kept alive until the matching decoder level (long skips).
    """

    def __init__(
        self, in_ch: int = 3, out_ch: int = 3, base: int = 8, levels: int = 3
    ) -> None:
        super().__init__()
        self.in_ch = in_ch
        chans = [base * 2**i for i in range(levels + 1)]
        self.down = nn.ModuleList()
        cin = in_ch
        for c in chans[:-1]:
            self.down.append(_double_conv(cin, c))
            cin = c
        self.pool = nn.MaxPool2d(2)
        self.bottleneck = _double_conv(chans[-2], chans[-1])
        self.up = nn.ModuleList()
        self.dec = nn.ModuleList()
        for c_hi, c_lo in zip(reversed(chans[1:]), reversed(chans[:-1]), strict=False):
            self.up.append(nn.ConvTranspose2d(c_hi, c_lo, 2, stride=2))
            self.dec.append(_double_conv(2 * c_lo, c_lo))
        self.out = nn.Conv2d(base, out_ch, 1)

    def example_inputs(self, batch: int) -> tuple[torch.Tensor, ...]:
        """Random (batch, in_ch, 32, 32) images."""
        return (torch.randn(batch, self.in_ch, 32, 32),)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips = []
        for down in self.down:
            x = down(x)
            skips.append(x)
            x = self.pool(x)
        x = self.bottleneck(x)
        for up, dec, skip in zip(self.up, self.dec, reversed(skips), strict=False):
            x = dec(torch.cat([up(x), skip], dim=1))
        return self.out(x)


def _bn_relu_conv(cin: int, cout: int, k: int = 3) -> nn.Sequential:
    conv = nn.Conv2d(cin, cout, k, padding=k // 2, bias=False)
    return nn.Sequential(nn.BatchNorm2d(cin), nn.ReLU(), conv)


class DenseNet(nn.Module):
    """DenseNet-style net: each layer sees ``torch.cat`` of all earlier maps.

    ``blocks`` dense blocks of ``layers`` layers, joined by BN-ReLU-1x1conv-avgpool
    transitions; input (B, in_ch, 16, 16) by default.
    """

    def __init__(
        self,
        in_ch: int = 3,
        init_ch: int = 16,
        growth: int = 8,
        layers: int = 5,
        blocks: int = 1,
        num_classes: int = 10,
    ) -> None:
        super().__init__()
        self.stem = nn.Conv2d(in_ch, init_ch, 3, padding=1, bias=False)
        self.blocks = nn.ModuleList()
        self.transitions = nn.ModuleList()
        c = init_ch
        for b in range(blocks):
            self.blocks.append(
                nn.ModuleList(
                    _bn_relu_conv(c + i * growth, growth) for i in range(layers)
                )
            )
            c += layers * growth
            if b < blocks - 1:
                trans = _bn_relu_conv(c, c // 2, 1).append(nn.AvgPool2d(2))
                self.transitions.append(trans)
                c //= 2
        self.norm = nn.BatchNorm2d(c)
        self.head = nn.Linear(c, num_classes)

    def example_inputs(self, batch: int) -> tuple[torch.Tensor, ...]:
        """Random (batch, in_ch, 16, 16) images."""
        return (torch.randn(batch, self.stem.in_channels, 16, 16),)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for i, block in enumerate(self.blocks):
            feats = [x]
            for layer in block:
                feats.append(layer(torch.cat(feats, dim=1)))
            x = torch.cat(feats, dim=1)
            if i < len(self.transitions):
                x = self.transitions[i](x)
        x = F.adaptive_avg_pool2d(F.relu(self.norm(x)), 1)
        return self.head(torch.flatten(x, 1))


# ---------------------------------------------------------------- registry

Example = tuple[nn.Module, tuple[torch.Tensor, ...]]
"""A model plus the positional example inputs for its ``forward``."""

Builder = Callable[..., Example]

DEFAULT_BATCH = {"mlp": 32, "resnet": 8, "gpt": 4, "unet": 4, "densenet": 8}


def _builder(cls: type[nn.Module]) -> Builder:
    def build(batch: int, **kwargs: object) -> Example:
        model = cls(**kwargs)
        return model, model.example_inputs(batch)

    build.__doc__ = f"Build a {cls.__name__} and example inputs for ``batch``."
    return build


ZOO: dict[str, Builder] = {
    "mlp": _builder(MLPChain),
    "resnet": _builder(ResNet),
    "gpt": _builder(GPT),
    "unet": _builder(UNet),
    "densenet": _builder(DenseNet),
}


def names() -> list[str]:
    """Names of all zoo models, in registry order."""
    return list(ZOO)


def make(
    name: str, *, batch: int | None = None, seed: int = 0, **kwargs: object
) -> Example:
    """Build zoo model ``name`` and example inputs, deterministically from ``seed``.

    ``batch`` defaults to ``DEFAULT_BATCH[name]``; ``kwargs`` go to the model
    constructor, e.g. ``make("mlp", depth=32, width=512, batch=4096)``.
    The model is returned in train mode on CPU.
    """
    if name not in ZOO:
        raise KeyError(f"unknown zoo model {name!r}; known: {', '.join(ZOO)}")
    torch.manual_seed(seed)
    return ZOO[name](DEFAULT_BATCH[name] if batch is None else batch, **kwargs)


def scalar_loss(output: object) -> torch.Tensor:
    """Scalar loss for any zoo output: mean of squares, summed over tuples/lists/dicts."""
    if isinstance(output, torch.Tensor):
        return output.float().pow(2).mean()
    if isinstance(output, Mapping):
        output = list(output.values())
    if isinstance(output, (tuple, list)):
        nested = (torch.Tensor, tuple, list, Mapping)
        losses = [scalar_loss(o) for o in output if isinstance(o, nested)]
        if not losses:
            raise TypeError("scalar_loss: output contains no tensors")
        return torch.stack(losses).sum()
    raise TypeError(f"scalar_loss: unsupported output type {type(output).__name__}")


loss_fn = scalar_loss
