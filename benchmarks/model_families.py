"""A policy means the same through compile, the torch.compile backend, Graph and export, on
33 HF transformers and diffusers families (random small configs, no downloads), in one run.

Per family, bf16, eval mode, on the CPU:

* ``autocast``: ``compile(policy="autocast")``, the backend (``inner="eager"``) called in
  float32, and the backend called under ``torch.autocast`` (so that dynamo traces the dtypes
  the model reads as autocast gives them) against ``torch.autocast("cpu")``, every floating
  output bit for bit ("ok" or "differs");
* ``O2 products low``: the matrix products and convolutions ``report`` counts in bf16, of
  all, through compile and through the backend (each graph dynamo hands it);
* ``Graph O2 = compile O2``: the model's first floating output from a ``Graph`` under O2
  (float32 masters) equal, bit for bit, to ``compile``'s under O2 (both with autograd on:
  torch's CPU attention takes another kernel under ``no_grad``);
* ``export O2 bytes``: ``amp_graph.export(policy="O2")``'s state over the float32 program's
  (target <= 0.55).

A check that raises prints its error instead. Counts and bits only: no timings.

    python benchmarks/model_families.py                 # all, about 5 minutes on 2 CPUs
    python benchmarks/model_families.py --only llama,opt
"""

from __future__ import annotations

import argparse
import platform
from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _pytree as pytree

import amp_graph
from amp_graph.deploy.against_float32 import float32_program, state_bytes

BF16 = torch.bfloat16


def _ids(batch: int = 2, seq: int = 12) -> torch.Tensor:
    return torch.randint(0, 100, (batch, seq))


def _causal_lm(model_type: str, **extra: Any) -> Callable[[], tuple]:
    def make() -> tuple:
        import transformers

        config = transformers.AutoConfig.for_model(
            model_type,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=64,
            vocab_size=100,
            max_position_embeddings=64,
            use_cache=False,
            **extra,
        )
        return transformers.AutoModelForCausalLM.from_config(config), {"input_ids": _ids()}

    return make


def _hf(cls: str, config: str, kwargs: Callable[[], dict], **fields: Any) -> Callable[[], tuple]:
    def make() -> tuple:
        import transformers

        model = getattr(transformers, cls)(getattr(transformers, config)(**fields))
        return model, kwargs()

    return make


def _diffusers(cls: str, kwargs: Callable[[], dict], **fields: Any) -> Callable[[], tuple]:
    def make() -> tuple:
        import diffusers

        return getattr(diffusers, cls)(**fields), kwargs()

    return make


_TOWER = {
    "hidden_size": 32,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "intermediate_size": 64,
}
_TEXT = {**_TOWER, "vocab_size": 100, "max_position_embeddings": 16}
_VISION = {**_TOWER, "image_size": 32, "patch_size": 8}
_ENCODER = {
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "intermediate_size": 64,
    "vocab_size": 100,
    "max_position_embeddings": 64,
}
_IMAGES = lambda: {"pixel_values": torch.randn(2, 3, 32, 32)}  # noqa: E731
_TOKENS = lambda: {"input_ids": _ids()}  # noqa: E731
_LATENTS = lambda: {  # noqa: E731
    "hidden_states": torch.randn(2, 4, 8, 8),
    "timestep": torch.tensor([3, 999]),
}

FAMILIES: dict[str, Callable[[], tuple]] = {
    "llama": _causal_lm("llama", num_key_value_heads=2),
    "mistral": _causal_lm("mistral", num_key_value_heads=2, sliding_window=8),
    "qwen2": _causal_lm("qwen2", num_key_value_heads=2),
    "qwen3": _causal_lm("qwen3", num_key_value_heads=2, head_dim=8),
    "qwen3_moe": _causal_lm(
        "qwen3_moe",
        num_key_value_heads=2,
        head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
    ),
    "gemma": _causal_lm("gemma", num_key_value_heads=2, head_dim=8),
    "gemma2": _causal_lm("gemma2", num_key_value_heads=2, head_dim=8, sliding_window=8),
    "gemma3": _causal_lm("gemma3_text", num_key_value_heads=2, head_dim=8, sliding_window=8),
    "phi": _causal_lm("phi"),
    "falcon": _causal_lm("falcon", new_decoder_architecture=False),
    "bloom": _causal_lm("bloom", n_layer=2, n_head=4),
    "gpt_neox": _causal_lm("gpt_neox"),
    "opt": _causal_lm("opt", ffn_dim=64, word_embed_proj_dim=32),
    "gptj": _causal_lm("gptj", n_embd=32, n_layer=2, n_head=4, rotary_dim=4, n_positions=64),
    "olmo2": _causal_lm("olmo2", num_key_value_heads=2),
    "mamba": _hf(
        "MambaForCausalLM",
        "MambaConfig",
        _TOKENS,
        hidden_size=32,
        num_hidden_layers=2,
        vocab_size=100,
        state_size=8,
        use_cache=False,
    ),
    "bart": _hf(
        "BartForConditionalGeneration",
        "BartConfig",
        lambda: {"input_ids": _ids(), "decoder_input_ids": _ids(2, 6)},
        d_model=32,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        vocab_size=100,
        max_position_embeddings=64,
        use_cache=False,
    ),
    "roberta": _hf("RobertaForMaskedLM", "RobertaConfig", _TOKENS, **_ENCODER),
    "deberta_v2": _hf("DebertaV2ForSequenceClassification", "DebertaV2Config", _TOKENS, **_ENCODER),
    "distilbert": _hf(
        "DistilBertForMaskedLM",
        "DistilBertConfig",
        _TOKENS,
        dim=32,
        n_layers=2,
        n_heads=2,
        hidden_dim=64,
        vocab_size=100,
        max_position_embeddings=64,
    ),
    "modernbert": _hf(
        "ModernBertForMaskedLM", "ModernBertConfig", _TOKENS, pad_token_id=0, **_ENCODER
    ),
    "clip": _hf(
        "CLIPModel",
        "CLIPConfig",
        lambda: {"input_ids": _ids(2, 8), **_IMAGES()},
        text_config=_TEXT,
        vision_config=_VISION,
        projection_dim=16,
    ),
    "siglip": _hf(
        "SiglipModel",
        "SiglipConfig",
        lambda: {"input_ids": _ids(2, 8), **_IMAGES()},
        text_config=_TEXT,
        vision_config=_VISION,
    ),
    "wav2vec2": _hf(
        "Wav2Vec2ForCTC",
        "Wav2Vec2Config",
        lambda: {"input_values": torch.randn(2, 400)},
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        vocab_size=20,
        conv_dim=(16, 16),
        conv_kernel=(10, 3),
        conv_stride=(5, 2),
        num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=2,
    ),
    "swin": _hf(
        "SwinForImageClassification",
        "SwinConfig",
        _IMAGES,
        image_size=32,
        patch_size=4,
        embed_dim=16,
        depths=[1, 1],
        num_heads=[2, 2],
        window_size=4,
        num_labels=3,
    ),
    "dinov2": _hf(
        "Dinov2Model",
        "Dinov2Config",
        _IMAGES,
        image_size=32,
        patch_size=8,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        mlp_ratio=2,
    ),
    "segformer": _hf(
        "SegformerForSemanticSegmentation",
        "SegformerConfig",
        _IMAGES,
        num_encoder_blocks=2,
        depths=[1, 1],
        sr_ratios=[2, 1],
        hidden_sizes=[16, 32],
        num_attention_heads=[1, 2],
        decoder_hidden_size=32,
        num_labels=3,
        patch_sizes=[7, 3],
        strides=[4, 2],
        mlp_ratios=[2, 2],
    ),
    "resnet": _hf(
        "ResNetForImageClassification",
        "ResNetConfig",
        _IMAGES,
        embedding_size=8,
        hidden_sizes=[8, 16],
        depths=[1, 1],
        num_labels=3,
    ),
    "dit": _diffusers(
        "DiTTransformer2DModel",
        lambda: {**_LATENTS(), "class_labels": torch.tensor([1, 2])},
        num_attention_heads=2,
        attention_head_dim=8,
        in_channels=4,
        num_layers=1,
        sample_size=8,
        patch_size=2,
        num_embeds_ada_norm=10,
        norm_num_groups=8,
    ),
    "sd3": _diffusers(
        "SD3Transformer2DModel",
        lambda: {
            **_LATENTS(),
            "encoder_hidden_states": torch.randn(2, 5, 32),
            "pooled_projections": torch.randn(2, 16),
        },
        sample_size=8,
        patch_size=2,
        in_channels=4,
        num_layers=1,
        attention_head_dim=8,
        num_attention_heads=2,
        joint_attention_dim=32,
        caption_projection_dim=16,
        pooled_projection_dim=16,
        out_channels=4,
        pos_embed_max_size=16,
    ),
    "flux": _diffusers(
        "FluxTransformer2DModel",
        lambda: {
            "hidden_states": torch.randn(2, 16, 8),
            "encoder_hidden_states": torch.randn(2, 5, 32),
            "pooled_projections": torch.randn(2, 16),
            "timestep": torch.tensor([0.3, 0.9]),
            "img_ids": torch.zeros(16, 3),
            "txt_ids": torch.zeros(5, 3),
        },
        patch_size=1,
        in_channels=8,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=8,
        num_attention_heads=2,
        joint_attention_dim=32,
        pooled_projection_dim=16,
        axes_dims_rope=(2, 2, 4),
    ),
    "pixart": _diffusers(
        "PixArtTransformer2DModel",
        lambda: {
            **_LATENTS(),
            "encoder_hidden_states": torch.randn(2, 5, 32),
            "added_cond_kwargs": {"resolution": None, "aspect_ratio": None},
        },
        num_attention_heads=2,
        attention_head_dim=8,
        in_channels=4,
        out_channels=8,
        num_layers=1,
        sample_size=8,
        patch_size=2,
        cross_attention_dim=16,
        caption_channels=32,
        norm_num_groups=8,
    ),
    "vae_tiny": _diffusers(
        "AutoencoderTiny",
        lambda: {"sample": torch.randn(2, 3, 32, 32)},
        encoder_block_out_channels=(8, 8, 8, 8),
        decoder_block_out_channels=(8, 8, 8, 8),
        num_encoder_blocks=(1, 1, 1, 1),
        num_decoder_blocks=(1, 1, 1, 1),
        latent_channels=4,
    ),
}


def _floats(out: Any) -> list[torch.Tensor]:
    if hasattr(out, "to_tuple"):
        out = out.to_tuple()
    leaves = pytree.tree_leaves(out)
    return [v for v in leaves if isinstance(v, torch.Tensor) and v.is_floating_point()]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    pairs = zip(a, b, strict=False)
    return len(a) == len(b) and all(x.dtype == y.dtype and torch.equal(x, y) for x, y in pairs)


def _backend(model: torch.nn.Module, policy: str) -> Any:
    torch._dynamo.reset()
    return torch.compile(model, backend=amp_graph.backend(policy, BF16, inner="eager"))


def _low_products(graphs: list) -> str:
    low = total = 0
    for gm in graphs:
        report = amp_graph.report(gm)
        total += report.products
        low += sum(report.low_products.values())  # neither float32 nor float64 (uncast)
    return f"{low}/{total}"


class _O2Graph(amp_graph.Graph):
    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model
        self.add_optimizer(torch.optim.SGD(model.parameters(), lr=0.0))
        self.config.enable_amp(True, policy="O2", dtype=BF16)

    def build(self, kwargs: dict) -> torch.Tensor:
        out = _floats(self.model(**kwargs))[0]
        out.float().sum().backward()
        return out.detach()


def check(make: Callable[[], tuple]) -> dict[str, str]:
    """The four checks on one family (a fresh model from seed 0 for each)."""

    def fresh() -> tuple:
        torch.manual_seed(0)
        model, kwargs = make()
        return model.eval(), kwargs

    row: dict[str, str] = {}

    def attempt(name: str, run: Callable[[], str]) -> None:
        try:
            row[name] = run()
        except Exception as error:
            row[name] = f"raises {type(error).__name__}"

    def autocast() -> str:
        model, kwargs = fresh()
        with torch.no_grad():
            with torch.autocast("cpu", BF16):
                theirs = _floats(model(**kwargs))
            ours = _floats(amp_graph.compile(model, "autocast", BF16)(**kwargs))
            backend = _floats(_backend(model, "autocast")(**kwargs))
            # called under torch.autocast, dynamo traces the dtypes the model reads as
            # autocast gives them; the backend turns autocast off inside its graphs
            under = _backend(model, "autocast")
            with torch.autocast("cpu", BF16):
                traced_low = _floats(under(**kwargs))
        runs = (ours, backend, traced_low)
        return " / ".join("ok" if _same(out, theirs) else "differs" for out in runs)

    def products() -> str:
        model, kwargs = fresh()
        with torch.no_grad():
            compiled = amp_graph.compile(model, "O2", BF16)
            compiled(**kwargs)
            dynamo = _backend(model, "O2")
            dynamo(**kwargs)
        compiled_gm = amp_graph.frontends.compiler.as_graph_module(compiled)
        backend_gms = amp_graph.captured_graphs(dynamo)
        return f"{_low_products([compiled_gm])} / {_low_products(backend_gms)}"

    def graph_o2() -> str:
        model, kwargs = fresh()
        # with autograd on, as the Graph runs it: CPU attention picks its kernel by grad mode
        reference = _floats(amp_graph.compile(model, "O2", BF16)(**kwargs))[0].detach()
        return "ok" if torch.equal(_O2Graph(model)(kwargs), reference) else "differs"

    def export_bytes() -> str:
        model, kwargs = fresh()
        program = amp_graph.export(model, (), kwargs, policy="O2", dtype=BF16)
        ratio = state_bytes(program) / state_bytes(float32_program(model, (), kwargs))
        return f"{ratio:.3f}"

    attempt("autocast: compile / backend / backend under autocast", autocast)
    attempt("O2 products low: compile / backend", products)
    attempt("Graph O2 = compile O2", graph_o2)
    attempt("export O2 bytes", export_bytes)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default=None, help="comma list of families")
    args = parser.parse_args()
    names = args.only.split(",") if args.only else list(FAMILIES)
    unknown = [n for n in names if n not in FAMILIES]
    if unknown:
        parser.error(f"unknown families {unknown}; known: {list(FAMILIES)}")
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, {platform.processor() or platform.machine()}, bf16")
    columns = None
    for name in names:
        row = check(FAMILIES[name])
        if columns is None:
            columns = list(row)
            print("| family | " + " | ".join(columns) + " |")
            print("|---" * (len(columns) + 1) + "|")
        print(f"| {name} | " + " | ".join(row[c] for c in columns) + " |", flush=True)


if __name__ == "__main__":
    main()
