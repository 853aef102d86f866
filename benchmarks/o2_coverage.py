"""O2 on diffusion models: where the matrix products run, what export stores, and the output
error against float32, side by side in one run (issue 39, part 1).

Models (random small configs, no downloads): diffusers ``UNet2DConditionModel`` (cross
attention, GroupNorm, a sinusoidal timestep embedding; timesteps 3 and 999),
``UNet2DModel`` and ``AutoencoderKL``. For each, bf16, eval mode, no autograd:

* matrix products and convolutions computing in bf16 under O1, O2 and O3, of all
  (``amp_graph.report``'s count; every float32 one is listed with its reason);
* ``amp_graph.export(policy="O2")``'s stored state against the float32 program's;
* the output's relative error against float32 (L2 norm of the difference over the norm of
  float32's output, computed in float64) for O1, O2, and O2 with the sinusoid rounded to
  bf16 (an override allowing the nodes the float32-from-integers rule keeps float32, which
  is what O2 computed before that rule).

    python benchmarks/o2_coverage.py
"""

from __future__ import annotations

import platform

import torch

import amp_graph
from amp_graph.deploy.against_float32 import float32_program, state_bytes

BF16 = torch.bfloat16


def unet_conditional():
    import diffusers

    model = diffusers.UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, layers_per_block=1,
        block_out_channels=(32, 64), down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=32,
        norm_num_groups=8, attention_head_dim=8,
    )  # fmt: skip
    return model, {
        "sample": torch.randn(2, 4, 8, 8),
        "timestep": torch.tensor([3, 999]),
        "encoder_hidden_states": torch.randn(2, 5, 32),
    }


def unet():
    import diffusers

    model = diffusers.UNet2DModel(
        sample_size=8, in_channels=3, out_channels=3, layers_per_block=1,
        block_out_channels=(32, 64), down_block_types=("DownBlock2D", "AttnDownBlock2D"),
        up_block_types=("AttnUpBlock2D", "UpBlock2D"), norm_num_groups=8,
    )  # fmt: skip
    return model, {"sample": torch.randn(2, 3, 8, 8), "timestep": torch.tensor([3, 999])}


def autoencoder_kl():
    import diffusers

    model = diffusers.AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(16, 32),
        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
        layers_per_block=1, norm_num_groups=8, sample_size=16,
    )  # fmt: skip
    return model, {"sample": torch.randn(2, 3, 16, 16)}


def _output(value) -> torch.Tensor:
    return value.sample if hasattr(value, "sample") else value[0]


def _error(out: torch.Tensor, reference: torch.Tensor) -> float:
    out, reference = out.double(), reference.double()
    return ((out - reference).norm() / reference.norm()).item()


def measure(name: str, build) -> None:
    torch.manual_seed(0)
    model, kwargs = build()
    model.eval()
    print(f"\n{name}")
    with torch.no_grad():
        reference = _output(model(**kwargs))
        errors, rounded = {}, {}
        for policy in ("O1", "O2", "O3"):
            compiled = amp_graph.compile(model, policy, BF16)
            errors[policy] = _error(_output(compiled(**kwargs)), reference)
            report = amp_graph.report(compiled)
            low = sum(report.low_products.values())  # neither float32 nor float64 (uncast)
            print(f"  {policy}: {low} of {report.products} products in bf16", end="")
            print(
                "".join(f"; {n} float32 ({why[-60:]})" for n, why in report.wide_products.items())
            )
            if policy == "O2":
                rounded = {
                    row.name: "allow"
                    for row in report.rows
                    if "from integers or constants" in row.detail
                }
        if rounded:
            policy = amp_graph.Policy.preset("O2").override(nodes=rounded)
            compiled = amp_graph.compile(model, policy, BF16)
            errors["O2, sinusoid in bf16"] = _error(_output(compiled(**kwargs)), reference)
    program = amp_graph.export(model, (), kwargs, policy="O2", dtype=BF16)
    ratio = state_bytes(program) / state_bytes(float32_program(model, (), kwargs))
    print(f"  export O2: state {ratio:.3f}x the float32 program's")
    print(f"  nodes kept float32 as made from integers under O2: {len(rounded)}")
    for policy, error in errors.items():
        print(f"  output error against float32, {policy}: {error:.5f}")


def main() -> None:
    print(f"torch {torch.__version__}, {platform.processor() or platform.machine()}, bf16")
    measure("diffusers UNet2DConditionModel", unet_conditional)
    measure("diffusers UNet2DModel", unet)
    measure("diffusers AutoencoderKL", autoencoder_kl)


if __name__ == "__main__":
    main()
