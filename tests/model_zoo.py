"""Models as people write them, from random small configs (no downloads): HF transformers,
diffusers, torch's own Transformer layers and amp_graph's ConvNet. Each builder returns
``(model, kwargs)``; :func:`build` seeds torch first. ``MODELS`` is the set the deploy tests
export end to end; ``ZOO`` adds the families the O2/O3 coverage tests capture as well."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from amp_graph.demo import models


def ids(batch: int = 2, seq: int = 12) -> torch.Tensor:
    return torch.randint(0, 100, (batch, seq))


def _gpt2():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        n_positions=32, n_embd=32, n_layer=2, n_head=2, vocab_size=100, use_cache=False
    )
    return transformers.GPT2LMHeadModel(config), {"input_ids": ids()}


def _bert():
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=32,
        vocab_size=100,
    )
    tokens = ids()
    model = transformers.BertForSequenceClassification(config)
    return model, {"input_ids": tokens, "attention_mask": torch.ones_like(tokens)}


def _vit():
    transformers = pytest.importorskip("transformers")
    config = transformers.ViTConfig(
        image_size=32,
        patch_size=8,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        num_labels=3,
    )
    model = transformers.ViTForImageClassification(config)
    return model, {"pixel_values": torch.randn(2, 3, 32, 32)}


def _t5_encoder():
    transformers = pytest.importorskip("transformers")
    config = transformers.T5Config(
        d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, vocab_size=100, use_cache=False
    )
    return transformers.T5EncoderModel(config), {"input_ids": ids()}


def _unet():
    diffusers = pytest.importorskip("diffusers")
    unet = diffusers.UNet2DModel(
        sample_size=8, in_channels=3, out_channels=3, layers_per_block=1,
        block_out_channels=(32, 64), down_block_types=("DownBlock2D", "AttnDownBlock2D"),
        up_block_types=("AttnUpBlock2D", "UpBlock2D"), norm_num_groups=8,
    )  # fmt: skip
    return unet, {"sample": torch.randn(2, 3, 8, 8), "timestep": torch.tensor([3, 5])}


def _convnet():
    """The ConvNet with batch norm, its running statistics moved off their initial values
    by a few training-mode calls (so that eval mode reads statistics of its own)."""
    model = models.ConvNet(in_channels=3, channels=8)
    with torch.no_grad():
        for _ in range(3):
            model(torch.randn(8, 3, 16, 16) * 3 + 1)
    return model, {"x": torch.randn(2, 3, 16, 16)}


MODELS = {
    "gpt2": _gpt2,
    "bert": _bert,
    "vit": _vit,
    "t5_encoder": _t5_encoder,
    "unet": _unet,
    "convnet_bn": _convnet,
}


def _unet_conditional():
    """Stable Diffusion's UNet in small: cross-attention blocks, GroupNorm, a sinusoidal
    timestep embedding cast to the sample's dtype; timesteps up to 999."""
    diffusers = pytest.importorskip("diffusers")
    unet = diffusers.UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, layers_per_block=1,
        block_out_channels=(32, 64), down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=32,
        norm_num_groups=8, attention_head_dim=8,
    )  # fmt: skip
    return unet, {
        "sample": torch.randn(2, 4, 8, 8),
        "timestep": torch.tensor([3, 999]),
        "encoder_hidden_states": torch.randn(2, 5, 32),
    }


def _autoencoder_kl():
    diffusers = pytest.importorskip("diffusers")
    vae = diffusers.AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(16, 32),
        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
        layers_per_block=1, norm_num_groups=8, sample_size=16,
    )  # fmt: skip
    return vae, {"sample": torch.randn(2, 3, 16, 16)}


def _convnext():
    transformers = pytest.importorskip("transformers")
    config = transformers.ConvNextConfig(
        num_channels=3, num_stages=2, hidden_sizes=[8, 16], depths=[1, 1], num_labels=3
    )
    model = transformers.ConvNextForImageClassification(config)
    return model, {"pixel_values": torch.randn(2, 3, 32, 32)}


def _whisper():
    transformers = pytest.importorskip("transformers")
    config = transformers.WhisperConfig(
        vocab_size=100, num_mel_bins=8, d_model=32, encoder_layers=1, decoder_layers=1,
        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64,
        decoder_ffn_dim=64, max_source_positions=16, max_target_positions=16,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1,
        use_cache=False,
    )  # fmt: skip
    model = transformers.WhisperForConditionalGeneration(config)
    return model, {
        "input_features": torch.randn(2, 8, 32),
        "decoder_input_ids": torch.randint(3, 100, (2, 6)),
    }


def _opt():
    """OPT: HF's ``pos_embeds.to(inputs_embeds.device)`` before every block."""
    transformers = pytest.importorskip("transformers")
    config = transformers.OPTConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, ffn_dim=64,
        word_embed_proj_dim=32, vocab_size=100, max_position_embeddings=64, use_cache=False,
    )  # fmt: skip
    return transformers.OPTForCausalLM(config), {"input_ids": ids()}


def _clip():
    """CLIP, text and vision towers: ``image_embeds.t().to(text_embeds.device)`` at the end."""
    transformers = pytest.importorskip("transformers")
    tower = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2}
    config = transformers.CLIPConfig(
        text_config={**tower, "intermediate_size": 64, "vocab_size": 100,
                     "max_position_embeddings": 16},
        vision_config={**tower, "intermediate_size": 64, "image_size": 32, "patch_size": 8},
        projection_dim=16,
    )  # fmt: skip
    return transformers.CLIPModel(config), {
        "input_ids": ids(2, 8),
        "pixel_values": torch.randn(2, 3, 32, 32),
    }


def _deberta_v2():
    """DeBERTa-v2: ``masked_fill(mask, torch.finfo(query_layer.dtype).min)`` on the scores."""
    transformers = pytest.importorskip("transformers")
    config = transformers.DebertaV2Config(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        vocab_size=100, max_position_embeddings=64,
    )  # fmt: skip
    return transformers.DebertaV2ForSequenceClassification(config), {"input_ids": ids()}


def _falcon():
    """Falcon: its linears compute ``x @ self.weight.T``, the weight read through a view."""
    transformers = pytest.importorskip("transformers")
    config = transformers.FalconConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, vocab_size=100,
        new_decoder_architecture=False, use_cache=False,
    )  # fmt: skip
    return transformers.FalconForCausalLM(config), {"input_ids": ids()}


class _TorchTransformer(nn.Module):
    """torch's own layers as a seq2seq model: nn.Transformer with a causal target mask."""

    def __init__(self, vocab: int = 100, dim: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.transformer = nn.Transformer(
            d_model=dim, nhead=2, num_encoder_layers=1, num_decoder_layers=1,
            dim_feedforward=64, dropout=0.0, batch_first=True,
        )  # fmt: skip
        self.head = nn.Linear(dim, vocab)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(tgt.size(1))
        out = self.transformer(self.embed(src), self.embed(tgt), tgt_mask=mask, tgt_is_causal=True)
        return self.head(out)


def _torch_transformer():
    return _TorchTransformer(), {"src": ids(), "tgt": ids(2, 7)}


ZOO = {
    **MODELS,
    "unet_conditional": _unet_conditional,
    "autoencoder_kl": _autoencoder_kl,
    "convnext": _convnext,
    "whisper": _whisper,
    "torch_transformer": _torch_transformer,
    "opt": _opt,
    "clip": _clip,
    "deberta_v2": _deberta_v2,
    "falcon": _falcon,
}


def build(name: str):
    """The named model of ``ZOO`` and its example kwargs, from torch's seed 0."""
    torch.manual_seed(0)
    return ZOO[name]()
