"""What capturing under the policy costs: torch.export of a model with and without
:mod:`amp_graph.capture.planned_dtypes` (the mode that shows the model's Python the policy's
dtypes, and under O2/O3 a half model), side by side in one run, interleaved.

For the GPT-style decoder (amp_graph.demo.models) and, when transformers is installed, HF GPT-2
and Llama with small random configs, under O1 and O2 in bf16: the median capture time of
each variant and their ratio, and how many matmuls the rewritten graph computes in bf16.

    python benchmarks/capture_policy_bench.py            # the run recorded in BENCHMARKS.md
    python benchmarks/capture_policy_bench.py --quick    # a smoke run
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn as nn
from amp_graph.passes import AMP

import amp_graph
from amp_graph.capture import capture_module
from amp_graph.demo import models

DTYPE = torch.bfloat16
MATMULS = {"linear", "matmul", "bmm", "mm", "addmm", "baddbmm", "scaled_dot_product_attention"}


class _Logits(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids).logits


def _models() -> dict[str, tuple[nn.Module, tuple]]:
    torch.manual_seed(0)
    ids = torch.randint(0, 100, (2, 32))
    found: dict[str, tuple[nn.Module, tuple]] = {
        "GPT-style decoder (4 layers)": (models.GPTWithLoss(layers=4).eval(), (ids, ids)),
    }
    try:
        import transformers
    except ImportError:
        return found
    gpt2 = transformers.GPT2Config(n_positions=64, n_embd=64, n_layer=4, n_head=4, vocab_size=100)
    gpt2._attn_implementation = "eager"
    llama = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=100,
        use_cache=False,
    )
    found["HF GPT-2 (eager attention)"] = (
        _Logits(transformers.GPT2LMHeadModel(gpt2)).eval(),
        (ids,),
    )
    found["HF Llama"] = (_Logits(transformers.LlamaForCausalLM(llama)).eval(), (ids,))
    return found


def _capture(model: nn.Module, args: tuple, policy: amp_graph.Policy | None) -> float:
    start = time.perf_counter()
    capture_module(
        model,
        args,
        {},
        device_type="cpu",
        autocast_dtype=DTYPE,
        policy=policy,
        low_dtype=DTYPE,
    )
    return time.perf_counter() - start


def _low_matmuls(model: nn.Module, args: tuple, policy: str) -> str:
    compiled = amp_graph.compile(model, policy, DTYPE, example_inputs=args)
    amps = [n.meta[AMP] for n in compiled.graph.nodes]
    matmuls = [a for a in amps if (a.aten or "").split(".")[0] in MATMULS]
    return f"{sum(a.compute_dtype == DTYPE for a in matmuls)}/{len(matmuls)}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    options = parser.parse_args()
    repeats = 2 if options.quick else 7
    print(f"CPU: {platform.processor() or platform.machine()}; torch {torch.__version__}; bf16")
    print(
        f"{'model':30} {'policy':6} {'plain s':>8} {'policy s':>9} {'ratio':>6} "
        f"{'bf16 matmuls':>12}"
    )
    for name, (model, args) in _models().items():
        for preset in ("O1", "O2"):
            policy = amp_graph.Policy.preset(preset)
            runs: dict[str, list[float]] = {"plain": [], "policy": []}
            variants: dict[str, Callable[[], float]] = {
                "plain": lambda m=model, a=args: _capture(m, a, None),
                "policy": lambda m=model, a=args, p=policy: _capture(m, a, p),
            }
            _capture(model, args, policy)  # warm up export's caches
            for _ in range(repeats):
                for key, run in variants.items():
                    runs[key].append(run())
            plain, ours = statistics.median(runs["plain"]), statistics.median(runs["policy"])
            print(
                f"{name:30} {preset:6} {plain:8.3f} {ours:9.3f} {ours / plain:6.2f} "
                f"{_low_matmuls(model, args, preset):>12}"
            )


if __name__ == "__main__":
    main()
