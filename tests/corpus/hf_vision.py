"""Hugging Face vision, convolutional and audio architectures from tiny random configs, as
:mod:`tests.corpus.hf` builds the language models (the same inputs and sizes)."""

from __future__ import annotations

import torch
import transformers as tf

from tests.corpus.entries import Entry, Example
from tests.corpus.hf import BATCH, FFN, HEADS, LAYERS, SPECIAL_TOKENS, VOCAB, WIDTH, audio, conv_images, images, tokens

# ---------------------------------------------------------------- vision transformers

_VIT = {"hidden_size": WIDTH, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS, "intermediate_size": FFN,
        "image_size": 32, "patch_size": 4, "num_labels": 10, "hidden_dropout_prob": 0.1,
        "attention_probs_dropout_prob": 0.1}


def vit() -> Example:
    return tf.ViTForImageClassification(tf.ViTConfig(**_VIT)), (), images()


def deit() -> Example:
    return tf.DeiTForImageClassification(tf.DeiTConfig(**_VIT)), (), images()


def swin() -> Example:
    """Shifted windows of 4x4 patches, a learned relative position bias (zeros at first) added
    to each window's attention mask."""
    config = tf.SwinConfig(image_size=32, patch_size=4, embed_dim=16, depths=[2, 2], num_heads=[2, 4], window_size=4,
                           num_labels=10)
    return tf.SwinForImageClassification(config), (), images()


def levit() -> Example:
    """A convolutional stem of four stride-2 convolutions, then attention with learned biases
    and BatchNorm'd linear layers."""
    config = tf.LevitConfig(image_size=64, hidden_sizes=[32, 48, 64], num_attention_heads=[1, 2, 4], depths=[1, 1, 1],
                            key_dim=[8, 8, 8], num_labels=10)
    return tf.LevitForImageClassification(config), (), conv_images()


def clip() -> Example:
    """Text and image towers trained on their contrastive loss (``return_loss``)."""
    text = {"vocab_size": VOCAB, "hidden_size": WIDTH, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
            "intermediate_size": FFN, "max_position_embeddings": 64, **SPECIAL_TOKENS}
    vision = {"image_size": 32, "patch_size": 4, "hidden_size": WIDTH, "num_hidden_layers": LAYERS,
              "num_attention_heads": HEADS, "intermediate_size": FFN}
    model = tf.CLIPModel(tf.CLIPConfig(text_config=text, vision_config=vision))
    text_inputs = tokens()
    del text_inputs["labels"]
    return model, (), {**text_inputs, "pixel_values": images()["pixel_values"], "return_loss": True}



def beit() -> Example:
    config = tf.BeitConfig(image_size=32, patch_size=4, hidden_size=WIDTH, num_hidden_layers=LAYERS,
                           num_attention_heads=HEADS, intermediate_size=FFN, num_labels=10,
                           use_relative_position_bias=True)
    return tf.BeitForImageClassification(config), (), images()


def dinov2() -> Example:
    config = tf.Dinov2Config(image_size=32, patch_size=4, hidden_size=WIDTH, num_hidden_layers=LAYERS,
                             num_attention_heads=HEADS, intermediate_size=FFN, num_labels=10)
    return tf.Dinov2ForImageClassification(config), (), images()


def vitmae() -> Example:
    """Pre-training: a random 75% of the patches masked (``torch.rand``, ``argsort``, ``gather``
    inside the graph), the rest encoded, a small decoder rebuilding the pixels."""
    config = tf.ViTMAEConfig(image_size=32, patch_size=4, hidden_size=WIDTH, num_hidden_layers=LAYERS,
                             num_attention_heads=HEADS, intermediate_size=FFN, decoder_hidden_size=32,
                             decoder_num_hidden_layers=1, decoder_num_attention_heads=HEADS, decoder_intermediate_size=64)
    return tf.ViTMAEForPreTraining(config), (), {"pixel_values": images()["pixel_values"]}


def segformer() -> Example:
    config = tf.SegformerConfig(num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[16, 32],
                                num_attention_heads=[1, 2], mlp_ratios=[2, 2], num_labels=10, decoder_hidden_size=32)
    return tf.SegformerForImageClassification(config), (), images()


def mobilevit() -> Example:
    config = tf.MobileViTConfig(image_size=64, hidden_sizes=[32, 48, 64], neck_hidden_sizes=[8, 8, 16, 16, 32, 48, 160],
                                num_labels=10)
    return tf.MobileViTForImageClassification(config), (), conv_images()

# ---------------------------------------------------------------- convolutional nets

def resnet() -> Example:
    config = tf.ResNetConfig(embedding_size=16, hidden_sizes=[16, 32, 64, 64], depths=[1, 1, 1, 1],
                             layer_type="basic", num_labels=10)
    return tf.ResNetForImageClassification(config), (), conv_images()


def regnet() -> Example:
    config = tf.RegNetConfig(embedding_size=16, hidden_sizes=[16, 32, 48, 64], depths=[1, 1, 2, 1],
                             groups_width=8, num_labels=10)
    return tf.RegNetForImageClassification(config), (), conv_images()


def mobilenet_v2() -> Example:
    config = tf.MobileNetV2Config(depth_multiplier=0.35, image_size=64, num_labels=10, classifier_dropout_prob=0.2)
    return tf.MobileNetV2ForImageClassification(config), (), conv_images()


def efficientnet() -> Example:
    config = tf.EfficientNetConfig(image_size=64, width_coefficient=0.25, depth_coefficient=0.25, hidden_dim=320,
                                   num_labels=10)
    return tf.EfficientNetForImageClassification(config), (), conv_images()


def convnext() -> Example:
    config = tf.ConvNextConfig(hidden_sizes=[16, 32, 48, 64], depths=[1, 1, 2, 1], num_labels=10,
                               drop_path_rate=0.1)
    return tf.ConvNextForImageClassification(config), (), conv_images()


# ---------------------------------------------------------------- speech / audio

# SpecAugment (mask_time_prob) draws its masks with numpy and LayerDrop decides with a Python
# `if` on torch.rand: neither can be captured as a graph (numpy draws would be baked in as
# constants), so both are off; every dropout stays at its default.
_SPEECH = {"hidden_size": WIDTH, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS, "intermediate_size": FFN,
           "conv_dim": (32, 32, 32), "conv_stride": (5, 2, 2), "conv_kernel": (10, 3, 3),
           "num_conv_pos_embeddings": 16, "num_conv_pos_embedding_groups": 4, "num_labels": 4,
           "mask_time_prob": 0.0, "layerdrop": 0.0}


def wav2vec2() -> Example:
    return tf.Wav2Vec2ForSequenceClassification(tf.Wav2Vec2Config(**_SPEECH)), (), audio()


def hubert() -> Example:
    return tf.HubertForSequenceClassification(tf.HubertConfig(**_SPEECH)), (), audio()


def whisper() -> Example:
    config = tf.WhisperConfig(vocab_size=VOCAB, num_mel_bins=16, encoder_layers=LAYERS, decoder_layers=LAYERS,
                              encoder_attention_heads=HEADS, decoder_attention_heads=HEADS, encoder_ffn_dim=FFN,
                              decoder_ffn_dim=FFN, d_model=WIDTH, max_source_positions=16, max_target_positions=64,
                              dropout=0.1, attention_dropout=0.1, activation_dropout=0.1, use_cache=False,
                              decoder_start_token_id=0, pad_token_id=2, bos_token_id=0, eos_token_id=1,
                              begin_suppress_tokens=None, suppress_tokens=None)
    generator = torch.Generator().manual_seed(1)
    inputs = {"input_features": torch.randn(BATCH, 16, 32, generator=generator),
              "labels": torch.randint(3, VOCAB, (BATCH, 16), generator=generator)}
    model = tf.WhisperForConditionalGeneration(config)
    model.config._attn_implementation = "eager"
    return model, (), inputs


def entries() -> list[Entry]:
    """The vision, convolutional and audio entries, grouped by family."""
    return [
        Entry("vit", "vision transformer", "ViT: 4x4 patches of 32x32 images, CLS token, dropout 0.1", vit),
        Entry("deit", "vision transformer", "DeiT: ViT with a distillation token, dropout 0.1", deit),
        Entry("swin", "vision transformer", "Swin: shifted windows, learned relative position bias, patch merging",
              swin),
        Entry("levit", "vision transformer", "LeViT: convolutional stem, attention biases, BatchNorm'd linears", levit),
        Entry("beit", "vision transformer", "BEiT: learned relative position bias, layer scale", beit),
        Entry("dinov2", "vision transformer", "DINOv2: layer scale, interpolated position embeddings", dinov2),
        Entry("vitmae", "vision transformer", "ViTMAE pre-training: random patch masking in the graph, pixel decoder",
              vitmae),
        Entry("segformer", "vision transformer", "SegFormer: hierarchical encoder, spatially reduced attention, "
              "Mix-FFN depthwise convs", segformer),
        Entry("mobilevit", "conv + attention", "MobileViT: inverted residuals, unfolded-patch transformers", mobilevit),
        Entry("clip", "contrastive", "CLIP: text and vision towers, contrastive loss", clip),
        Entry("resnet", "conv + BatchNorm", "ResNet: basic blocks, BatchNorm, max-pool stem", resnet),
        Entry("regnet", "conv + BatchNorm", "RegNet: grouped convs, squeeze-excitation, BatchNorm", regnet),
        Entry("mobilenet_v2", "conv + BatchNorm", "MobileNetV2: inverted residuals, depthwise convs, ReLU6",
              mobilenet_v2),
        Entry("efficientnet", "conv + BatchNorm", "EfficientNet: MBConv blocks, squeeze-excitation, SiLU, drop path",
              efficientnet),
        Entry("convnext", "conv + LayerNorm", "ConvNeXt: depthwise 7x7, channels-last LayerNorm, drop path",
              convnext),
        Entry("wav2vec2", "speech", "Wav2Vec2: conv feature encoder, GroupNorm, conv positions, dropout 0.1",
              wav2vec2),
        Entry("hubert", "speech", "HuBERT: Wav2Vec2-style encoder, sequence classification", hubert),
        Entry("whisper", "speech", "Whisper: conv stem on log-mel, encoder-decoder, dropout 0.1", whisper),
    ]
