"""Hugging Face language models at benchmark sizes (random weights, no download), each
wrapped to return its own causal-LM loss: one training step is ``model(ids).backward()``.
Needs ``transformers``; imported only by the benchmarks that use it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

Loss = Callable[[Any], torch.Tensor]


class CausalLMLoss(nn.Module):
    """A Hugging Face causal LM's loss on its own input ids: what one training step computes.
    ``lm`` keeps the model's class, so ``gradient_checkpointing_enable`` still applies."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=ids, labels=ids).loss


def the_loss(loss: torch.Tensor) -> torch.Tensor:
    """The loss a :class:`CausalLMLoss` returns, as a benchmark's ``loss_fn``."""
    return loss


def _wrapped(lm: nn.Module, vocab: int, seq: int, batch: int) -> tuple[nn.Module, tuple, Loss]:
    torch.manual_seed(1)
    return CausalLMLoss(lm.train()), (torch.randint(0, vocab, (batch, seq)),), the_loss


def hf_gpt2(layers: int, d: int, seq: int, batch: int, vocab: int = 50257) -> tuple[nn.Module, tuple, Loss]:
    """GPT-2 LM (learned positions, GELU MLP, LayerNorm), dropout 0, under its own loss."""
    import transformers

    config = transformers.GPT2Config(n_layer=layers, n_embd=d, n_head=max(1, d // 64), n_positions=seq,
                                     vocab_size=vocab, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                     use_cache=False, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    return _wrapped(transformers.GPT2LMHeadModel(config), vocab, seq, batch)


def hf_llama(layers: int, d: int, seq: int, batch: int, heads: int = 8, kv_heads: int = 4,
             vocab: int = 8192) -> tuple[nn.Module, tuple, Loss]:
    """LLaMA LM (rotary embeddings, RMSNorm, gated SiLU MLP, grouped-query attention
    ``heads``/``kv_heads``), eager attention, under its own loss."""
    import transformers

    config = transformers.LlamaConfig(num_hidden_layers=layers, hidden_size=d, intermediate_size=4 * d,
                                      num_attention_heads=heads, num_key_value_heads=kv_heads,
                                      max_position_embeddings=seq, vocab_size=vocab, use_cache=False,
                                      attn_implementation="eager", bos_token_id=0, eos_token_id=0,
                                      pad_token_id=0)
    torch.manual_seed(0)
    return _wrapped(transformers.LlamaForCausalLM(config), vocab, seq, batch)


BENCHMARK_MODELS: dict[str, tuple[str, Callable[[], tuple[nn.Module, tuple, Loss]]]] = {
    "gpt2": ("HF GPT-2, 12 layers, d=256, seq 256, batch 8, vocab 8192",
             lambda: hf_gpt2(layers=12, d=256, seq=256, batch=8, vocab=8192)),
    "llama": ("HF LLaMA, 8 layers, d=256, GQA 8/4, seq 256, batch 8, vocab 8192",
              lambda: hf_llama(layers=8, d=256, seq=256, batch=8)),
    # GPU sizes: at d=256 a GPU step waits on Python, not on kernels.
    "gpt2-small": ("HF GPT-2 small, 12 layers, d=768, seq 1024, batch 8, vocab 50257",
                   lambda: hf_gpt2(layers=12, d=768, seq=1024, batch=8)),
    "llama-1k": ("HF LLaMA, 8 layers, d=1024, GQA 16/4, seq 1024, batch 4, vocab 32000",
                 lambda: hf_llama(layers=8, d=1024, seq=1024, batch=4, heads=16, kv_heads=4, vocab=32000)),
    # Seconds: the scripts' smoke tests.
    "llama-tiny": ("HF LLaMA, 2 layers, d=64, GQA 4/2, seq 32, batch 2, vocab 256",
                   lambda: hf_llama(layers=2, d=64, seq=32, batch=2, heads=4, kv_heads=2, vocab=256)),
}
"""The Hugging Face models the per-block and step-breakdown benchmarks measure: name ->
(description, builder)."""
