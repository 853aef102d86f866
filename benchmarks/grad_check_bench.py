"""What a non-finite gradient check costs in a training step, for each way of doing it.

A step that scales no loss (bfloat16, float32) must still skip steps with inf/nan gradients.
Each variant below is a full eager step (forward, backward, check, fused AdamW step that
skips on ``found_inf``), so a check that runs during backward (hooks) is measured fairly:

* ``none``: no check (unsafe; the floor);
* ``StaticGradScaler(1)``: what amp_graph.Graph did before: an unscale-by-1 pass, the scale
  update and its host mirror, through the GradScaler API;
* ``unscale-by-1 op``: torch's ``_amp_foreach_non_finite_check_and_unscale_`` with a scale of
  1 (one C++ call; rewrites each value as itself): NonFiniteGuard's CPU check;
* ``read-only aminmax``: ``amp_graph::non_finite_check_`` (on CPU: aminmax per tensor);
* ``_foreach_norm(inf)``: read-only, one call;
* ``post-accumulate hooks``: each gradient checked as backward produces it (still in cache);
* ``clip (norm check)``: clipping at a huge max_norm, the norm's finiteness as the check,
  against ``clip only`` (the same clipping, no check): what checking adds to a clipped step.
* ``host read``: the unscale-by-1 op, then ``found_inf.item()`` to decide on the host (what
  an optimizer without ``found_inf`` needs; on a GPU each one is a synchronization).

Steps are float32 (so that the check is not hidden behind this CPU's slow bfloat16 matmuls);
the check's cost depends on the gradients' bytes and count, not on the compute dtype.

    python benchmarks/grad_check_bench.py            # the run recorded in BENCHMARKS.md
    python benchmarks/grad_check_bench.py --quick
"""

from __future__ import annotations

import argparse
import copy
import statistics
from collections.abc import Callable

import torch
import torch.nn.functional as F
from measure import interleaved_seconds

from amp_graph.demo import models
from amp_graph.ops import scaler_ops as ops
from amp_graph.scaler import StaticGradScaler


def grads_of(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p.grad for g in opt.param_groups for p in g["params"] if p.grad is not None]


def make_step(model: torch.nn.Module, loss_fn: Callable, variant: str) -> Callable[[], None]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    found = torch.zeros(())
    one = torch.ones(())
    scaler = StaticGradScaler(1.0)
    norms: list[torch.Tensor] = []
    if variant == "post-accumulate hooks":

        def hook(p: torch.Tensor) -> None:
            norms.append(torch.linalg.vector_norm(p.grad, float("inf")))

        for p in model.parameters():
            p.register_post_accumulate_grad_hook(hook)

    def fused_step() -> None:
        opt.found_inf = found
        opt.step()
        del opt.found_inf
        found.zero_()

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        norms.clear()
        loss = loss_fn(model)
        if variant == "StaticGradScaler(1)":
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            return
        loss.backward()
        if variant == "none":
            opt.step()
            return
        if variant in ("unscale-by-1 op", "host read"):
            torch._amp_foreach_non_finite_check_and_unscale_(grads_of(opt), found, one)
        elif variant == "read-only aminmax":
            ops.non_finite_check_(grads_of(opt), found)
        elif variant == "_foreach_norm(inf)":
            norm = torch.stack(torch._foreach_norm(grads_of(opt), float("inf"))).amax()
            found.masked_fill_(~torch.isfinite(norm), 1.0)
        elif variant == "post-accumulate hooks":
            found.masked_fill_(~torch.isfinite(torch.stack(norms).amax()), 1.0)
        elif variant in ("clip (norm check)", "clip only"):
            norm = torch.nn.utils.clip_grad_norm_(list(model.parameters()), 1e30)
            if variant == "clip only":
                opt.step()
                return
            found.masked_fill_(~torch.isfinite(norm), 1.0)
        if variant == "host read":
            if found.item() == 0:
                opt.step()
            found.zero_()
            return
        fused_step()

    return step


VARIANTS = (
    "none",
    "StaticGradScaler(1)",
    "unscale-by-1 op",
    "read-only aminmax",
    "_foreach_norm(inf)",
    "post-accumulate hooks",
    "host read",
    "clip only",
    "clip (norm check)",
)


def cases(quick: bool) -> dict[str, tuple[torch.nn.Module, Callable]]:
    torch.manual_seed(0)
    out = {}
    for name, (batch, seq, dim, layers) in {
        "gpt small (2 layers, dim 64)": (4, 32, 64, 2),
        "gpt medium (4 layers, dim 256)": (8, 64, 256, 4),
    }.items():
        if quick and "medium" in name:
            continue
        model = models.GPTWithLoss(vocab=512, block=seq, dim=dim, heads=8, layers=layers)
        idx = torch.randint(0, 512, (batch, seq))
        out[name] = (model, lambda m, idx=idx: m(idx, idx))
    many = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(2000)) for _ in range(1000))
    out["many small gradients (1,000 x 2,000)"] = (
        many,
        lambda m: torch.stack([p.square().sum() for p in m]).sum(),
    )
    x, y = torch.randn(64, 1, 8, 8), torch.randint(0, 10, (64,))
    out["convnet (the demo's, width 32)"] = (
        models.ConvNet(channels=32),
        lambda m: F.cross_entropy(m(x), y),
    )
    return out


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--threads", type=int, default=None, help="intra-op threads")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    repeats = args.repeats or (10 if args.quick else 40)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; float32 eager steps, "
        f"fused AdamW; {repeats} interleaved repeats, medians\n"
    )
    for name, (base, loss_fn) in cases(args.quick).items():
        steps = {v: make_step(copy.deepcopy(base), loss_fn, v) for v in VARIANTS}
        n_grads = sum(1 for p in base.parameters() if p.requires_grad)
        n_elems = sum(p.numel() for p in base.parameters())
        times = interleaved_seconds(steps, repeats, warmup=2)
        none = times["none"]
        print(f"== {name}: {n_grads} gradients, {n_elems / 1e6:.2f}M elements")
        print(f"{'variant':<24} {'median ms':>10} {'added ms (median of rounds)':>28}")
        for v in VARIANTS:
            ref = times["clip only"] if v == "clip (norm check)" else none
            added = statistics.median(a - b for a, b in zip(times[v], ref, strict=True))
            print(f"{v:<24} {statistics.median(times[v]) * 1e3:>10.2f} {added * 1e3:>28.3f}")
        print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
