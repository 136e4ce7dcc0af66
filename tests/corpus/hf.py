"""Hugging Face architectures from tiny random configs (no hub access), dropout at its default.

Sizes are picked so one rewrite and a measured step take seconds on a 2-core CPU while the
activations (hundreds of KiB to a few MiB) dominate a step's memory. Token models take a
batch of 4 sequences of 32 tokens, the last one padded; vision transformers 4 images of 32x32, convolutional nets 8 of 64x64;
audio models 4 clips of 1600 samples (Whisper: 4 log-mel spectrograms of 32 frames).
"""

from __future__ import annotations

from typing import Any

import torch
import transformers as tf

from tests.corpus.entries import Entry, Example

VOCAB, SEQ, BATCH = 128, 32, 4
WIDTH, HEADS, FFN, LAYERS = 64, 4, 128, 2


def tokens(labels: str = "ids") -> dict[str, torch.Tensor]:
    """Token ids, an attention mask (the last sequence ends in 6 pads) and labels: the ids
    themselves (language modelling), ``"binary"`` per-token 0/1 (ELECTRA's discriminator)."""
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (BATCH, SEQ), generator=generator)
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[-1, SEQ - 6:] = 0
    target = ids.clone() if labels == "ids" else torch.randint(0, 2, (BATCH, SEQ), generator=generator)
    return {"input_ids": ids, "attention_mask": mask, "labels": target}


def images(classes: int = 10, size: int = 32, batch: int = BATCH) -> dict[str, torch.Tensor]:
    """A batch of random RGB images and class labels."""
    generator = torch.Generator().manual_seed(1)
    return {"pixel_values": torch.randn(batch, 3, size, size, generator=generator),
            "labels": torch.randint(0, classes, (batch,), generator=generator)}


def conv_images() -> dict[str, torch.Tensor]:
    """8 images of 64x64 for the convolutional nets (their stems divide the size by 4)."""
    return images(size=64, batch=8)


def audio(classes: int = 4, samples: int = 1600) -> dict[str, torch.Tensor]:
    """A batch of random raw waveforms and clip labels."""
    generator = torch.Generator().manual_seed(1)
    return {"input_values": torch.randn(BATCH, samples, generator=generator),
            "labels": torch.randint(0, classes, (BATCH,), generator=generator)}


def _lm(model: Any, attention: str = "eager", labels: str = "ids") -> Example:
    model.config._attn_implementation = attention
    return model, (), tokens(labels)


SPECIAL_TOKENS = {"bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2}
_DECODER = {"vocab_size": VOCAB, "hidden_size": WIDTH, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
            "intermediate_size": FFN, "max_position_embeddings": 64, "use_cache": False, **SPECIAL_TOKENS}


# ---------------------------------------------------------------- decoder language models

def gpt2() -> Example:
    config = tf.GPT2Config(n_layer=LAYERS, n_embd=WIDTH, n_head=HEADS, vocab_size=VOCAB, n_positions=64,
                           use_cache=False, bos_token_id=0, eos_token_id=1)
    return _lm(tf.GPT2LMHeadModel(config))


def opt() -> Example:
    config = tf.OPTConfig(vocab_size=VOCAB, hidden_size=WIDTH, num_hidden_layers=LAYERS, ffn_dim=FFN,
                          num_attention_heads=HEADS, max_position_embeddings=64, word_embed_proj_dim=WIDTH,
                          use_cache=False, **SPECIAL_TOKENS)
    return _lm(tf.OPTForCausalLM(config))


def gpt_neox() -> Example:
    config = tf.GPTNeoXConfig(**_DECODER, rotary_pct=0.25)
    return _lm(tf.GPTNeoXForCausalLM(config))


def bloom() -> Example:
    config = tf.BloomConfig(vocab_size=VOCAB, hidden_size=WIDTH, n_layer=LAYERS, n_head=HEADS, use_cache=False,
                            **SPECIAL_TOKENS)
    return _lm(tf.BloomForCausalLM(config))


def llama() -> Example:
    config = tf.LlamaConfig(**_DECODER, num_key_value_heads=2)
    return _lm(tf.LlamaForCausalLM(config), "sdpa")


def mistral() -> Example:
    config = tf.MistralConfig(**_DECODER, num_key_value_heads=2, sliding_window=16)
    return _lm(tf.MistralForCausalLM(config))


def qwen2() -> Example:
    config = tf.Qwen2Config(**_DECODER, num_key_value_heads=2)
    return _lm(tf.Qwen2ForCausalLM(config), "sdpa")


def gemma() -> Example:
    config = tf.GemmaConfig(**_DECODER, num_key_value_heads=1, head_dim=16)
    return _lm(tf.GemmaForCausalLM(config))


def phi() -> Example:
    config = tf.PhiConfig(**_DECODER, partial_rotary_factor=0.5)
    return _lm(tf.PhiForCausalLM(config))


def mixtral() -> Example:
    config = tf.MixtralConfig(**_DECODER, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)
    return _lm(tf.MixtralForCausalLM(config))


def mamba() -> Example:
    """Mamba's reference PyTorch path (no ``mamba_ssm`` kernels): a selective scan over the
    sequence, written as a Python loop of small ops."""
    config = tf.MambaConfig(vocab_size=VOCAB, hidden_size=WIDTH, num_hidden_layers=LAYERS, state_size=8,
                            use_cache=False, **SPECIAL_TOKENS)
    return _lm(tf.MambaForCausalLM(config))



def gemma2() -> Example:
    config = tf.Gemma2Config(**_DECODER, num_key_value_heads=2, head_dim=16, sliding_window=16)
    return _lm(tf.Gemma2ForCausalLM(config))


def qwen2_moe() -> Example:
    config = tf.Qwen2MoeConfig(**_DECODER, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                               moe_intermediate_size=64, shared_expert_intermediate_size=64)
    return _lm(tf.Qwen2MoeForCausalLM(config))


def falcon() -> Example:
    config = tf.FalconConfig(vocab_size=VOCAB, hidden_size=WIDTH, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                             use_cache=False, **SPECIAL_TOKENS)
    return _lm(tf.FalconForCausalLM(config))


def gpt_bigcode() -> Example:
    config = tf.GPTBigCodeConfig(n_layer=LAYERS, n_embd=WIDTH, n_head=HEADS, vocab_size=VOCAB, n_positions=64,
                                 use_cache=False, bos_token_id=0, eos_token_id=1)
    return _lm(tf.GPTBigCodeForCausalLM(config))

# ---------------------------------------------------------------- encoders (dropout on)

_ENCODER = {"vocab_size": VOCAB, "hidden_size": WIDTH, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
            "intermediate_size": FFN, "max_position_embeddings": 64}


def bert() -> Example:
    return _lm(tf.BertForMaskedLM(tf.BertConfig(**_ENCODER)))


def roberta() -> Example:
    return _lm(tf.RobertaForMaskedLM(tf.RobertaConfig(**_ENCODER, pad_token_id=1)))


def electra() -> Example:
    """Without an attention mask: with one, the discriminator's loss selects the unmasked
    tokens by boolean indexing (a data-dependent shape, which torch.export refuses)."""
    config = tf.ElectraConfig(**_ENCODER, embedding_size=32)
    model, args, kwargs = _lm(tf.ElectraForPreTraining(config), labels="binary")
    del kwargs["attention_mask"]
    return model, args, kwargs


def distilbert() -> Example:
    config = tf.DistilBertConfig(vocab_size=VOCAB, dim=WIDTH, n_layers=LAYERS, n_heads=HEADS, hidden_dim=FFN,
                                 max_position_embeddings=64)
    return _lm(tf.DistilBertForMaskedLM(config))


def albert() -> Example:
    config = tf.AlbertConfig(**_ENCODER, embedding_size=32, hidden_dropout_prob=0.1,
                             attention_probs_dropout_prob=0.1)
    return _lm(tf.AlbertForMaskedLM(config))



def deberta_v2() -> Example:
    return _lm(tf.DebertaV2ForMaskedLM(tf.DebertaV2Config(**_ENCODER)))


def funnel() -> Example:
    config = tf.FunnelConfig(vocab_size=VOCAB, block_sizes=[1, 1], d_model=WIDTH, n_head=HEADS, d_head=16, d_inner=FFN)
    return _lm(tf.FunnelForMaskedLM(config))


def convbert() -> Example:
    return _lm(tf.ConvBertForMaskedLM(tf.ConvBertConfig(**_ENCODER)))


def modernbert() -> Example:
    config = tf.ModernBertConfig(vocab_size=VOCAB, hidden_size=WIDTH, num_hidden_layers=LAYERS,
                                 num_attention_heads=HEADS, intermediate_size=FFN, max_position_embeddings=64,
                                 cls_token_id=0, sep_token_id=1, **SPECIAL_TOKENS)
    return _lm(tf.ModernBertForMaskedLM(config))

# ---------------------------------------------------------------- encoder-decoder

def t5() -> Example:
    config = tf.T5Config(vocab_size=VOCAB, d_model=WIDTH, d_kv=16, d_ff=FFN, num_layers=LAYERS,
                         num_decoder_layers=LAYERS, num_heads=HEADS, use_cache=False, decoder_start_token_id=0,
                         pad_token_id=0, eos_token_id=1)
    return _lm(tf.T5ForConditionalGeneration(config))


def bart() -> Example:
    config = tf.BartConfig(vocab_size=VOCAB, d_model=WIDTH, encoder_layers=LAYERS, decoder_layers=LAYERS,
                           encoder_attention_heads=HEADS, decoder_attention_heads=HEADS, encoder_ffn_dim=FFN,
                           decoder_ffn_dim=FFN, max_position_embeddings=64, attention_dropout=0.1,
                           activation_dropout=0.1, use_cache=False, pad_token_id=1, bos_token_id=0,
                           eos_token_id=2, decoder_start_token_id=2, forced_eos_token_id=None)
    return _lm(tf.BartForConditionalGeneration(config), "sdpa")


def gpt2_real_width(layers: int = 12, seq: int = 512, batch: int = 2) -> Example:
    """GPT-2 small at its real width: d=768, 12 heads, the 50257-token vocabulary, ``layers``
    blocks, ``batch`` sequences of ``seq`` tokens (no padding), dropout 0.1, eager attention."""
    config = tf.GPT2Config(n_layer=layers, n_embd=768, n_head=12, vocab_size=50257, n_positions=1024,
                           use_cache=False, bos_token_id=50256, eos_token_id=50256)
    model = tf.GPT2LMHeadModel(config)
    model.config._attn_implementation = "eager"
    ids = torch.randint(0, 50257, (batch, seq), generator=torch.Generator().manual_seed(1))
    return model, (), {"input_ids": ids, "labels": ids.clone()}


GPT2_REAL_WIDTH = Entry("gpt2_real_width", "decoder LM", "GPT-2 small: 12 layers, d=768, 12 heads, vocab 50257, "
                        "seq 512, batch 2", gpt2_real_width)
"""Not in the corpus registry (a step takes many seconds): its own slow test."""


def entries() -> list[Entry]:
    """The language models (decoders, encoders, encoder-decoders), grouped by family; the
    vision, convolutional and audio ones are in :mod:`tests.corpus.hf_vision`."""
    return [
        Entry("gpt2", "decoder LM", "GPT-2: learned positions, Conv1D projections, dropout 0.1", gpt2),
        Entry("opt", "decoder LM", "OPT: learned positions (offset 2), ReLU MLP, dropout 0.1", opt),
        Entry("gpt_neox", "decoder LM", "GPT-NeoX: parallel attention+MLP residual, partial rotary", gpt_neox),
        Entry("bloom", "decoder LM", "BLOOM: ALiBi position bias, embedding LayerNorm", bloom),
        Entry("llama", "decoder LM", "LLaMA: RMSNorm, rotary, grouped-query attention, SwiGLU (sdpa)", llama),
        Entry("mistral", "decoder LM", "Mistral: GQA with a sliding window of 16, SwiGLU", mistral),
        Entry("qwen2", "decoder LM", "Qwen2: GQA with q/k/v biases, rotary, RMSNorm (sdpa)", qwen2),
        Entry("gemma", "decoder LM", "Gemma: multi-query attention, GeGLU, scaled embeddings", gemma),
        Entry("phi", "decoder LM", "Phi: parallel block, partial rotary, dense GELU MLP", phi),
        Entry("mixtral", "decoder LM", "Mixtral: sparse mixture of 4 experts, top-2 routing, GQA", mixtral),
        Entry("gemma2", "decoder LM", "Gemma 2: logit soft-capping, alternating sliding-window layers", gemma2),
        Entry("qwen2_moe", "decoder LM", "Qwen2-MoE: 4 routed experts beside a gated shared expert", qwen2_moe),
        Entry("falcon", "decoder LM", "Falcon: parallel attention and MLP, multi-query attention", falcon),
        Entry("gpt_bigcode", "decoder LM", "GPT-BigCode: GPT-2 layout with multi-query attention", gpt_bigcode),
        Entry("mamba", "state space", "Mamba: selective scan (reference PyTorch path), causal conv1d, RMSNorm", mamba),
        Entry("bert", "encoder", "BERT masked LM: post-LN, token types, dropout 0.1", bert),
        Entry("roberta", "encoder", "RoBERTa masked LM: padding-offset positions, dropout 0.1", roberta),
        Entry("electra", "encoder", "ELECTRA discriminator: factorised embeddings, per-token BCE loss", electra),
        Entry("distilbert", "encoder", "DistilBERT masked LM: no token types, dropout 0.1", distilbert),
        Entry("albert", "encoder", "ALBERT masked LM: one layer's weights shared by every layer", albert),
        Entry("deberta_v2", "encoder", "DeBERTa-v2: disentangled relative attention", deberta_v2),
        Entry("funnel", "encoder", "Funnel: pooled query sequence between blocks, then upsampled", funnel),
        Entry("convbert", "encoder", "ConvBERT: span-based dynamic convolution heads beside attention", convbert),
        Entry("modernbert", "encoder", "ModernBERT: alternating local and global attention, GeGLU, no biases",
              modernbert),
        Entry("t5", "encoder-decoder", "T5: relative position buckets, RMS LayerNorm, dropout 0.1", t5),
        Entry("bart", "encoder-decoder", "BART: learned positions, shared embeddings, dropout 0.1 (sdpa)", bart),
    ]
