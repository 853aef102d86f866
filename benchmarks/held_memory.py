"""What the forward holds for backward, and what that costs: amp_graph with
``recompute_casts`` on and off against torch.autocast, side by side in one run.

Held = bytes of the distinct storages still alive at the end of the forward among every
tensor an aten op made during it, parameters and buffers left out
(:mod:`amp_graph.inspect.held`): what autograd saved, and anything else kept.

1. One device, bf16 on this CPU: the GPT-style decoder (``amp_graph.demo.models.GPT``, 4
   layers, width 128, 4x64 tokens; width 256, 8x128 tokens, under O1; and
   ``benchmarks/compile_bench.py``'s GPT, width 256, 16x128 tokens) and HF Llama
   (eager attention, 2 layers, width 128, 4x64 tokens), under ``O1`` and ``autocast``.
   Also: the casts backward runs, the aten ops backward runs beyond the kept-casts
   variant, and the step time (forward + backward) of on against off: 101 pairs,
   interleaved, the median of the paired ratios with its quartiles.
2. FSDP2 on 2 gloo ranks (CPU): issue 24's six residual MLP blocks of width 256 (batch 8)
   and four Llama-style layers of width 128 (4x64 tokens), ``fully_shard`` per block and
   on the root: amp_graph O1 bf16 (casts recomputed, kept, with the user's
   ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``, and sharded as
   ``amp_graph.plan_fsdp`` plans it, the units its split names added) against torch.autocast on
   the same sharded model and against ``MixedPrecisionPolicy(param_dtype=bf16)`` eager:
   held bytes, and the bytes all-gathered and reduce-scattered in one step
   (:mod:`amp_graph.inspect.traffic`, counted on c10d's collectives).

3. ``--part3``: activations not held twice: held bytes keeping against recomputing on the
   GPT, nanoGPT's attention, HF GPT-2, HF Llama (O1 and O2), HF BERT (O2) and a diffusers
   UNet, with what was decided (parameter copies, kept results, widened activations, casts
   absorbed into ``dtype=``); and the casts per step of ``policy="autocast"`` against
   torch.autocast on the GPT, by kind.

    python benchmarks/held_memory.py            # the run recorded in BENCHMARKS.md
    python benchmarks/held_memory.py --quick    # fewer timing repeats
    python benchmarks/held_memory.py --fsdp     # only part 2 (20 s)
    python benchmarks/held_memory.py --part3    # section 3 only (no timing; a minute)
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import platform
import socket
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from amp_graph.passes import recompute_casts as recompute_casts_pass
from torch.utils._python_dispatch import TorchDispatchMode

import amp_graph
from amp_graph.demo import models
from amp_graph.inspect.held import held_for_backward
from amp_graph.inspect.traffic import CollectiveBytes
from amp_graph.ops.recompute_ops import recomputed_cast

BF16 = torch.bfloat16
MB = 1e6


class CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _policy(name: str, recompute: bool) -> amp_graph.Policy:
    return dataclasses.replace(amp_graph.Policy.preset(name), recompute_casts=recompute)


def _held_and_backward_ops(model: nn.Module, forward: Callable[[], Any]) -> tuple[int, Counter]:
    model.zero_grad(set_to_none=True)
    held, out = held_for_backward(forward, [*model.parameters(), *model.buffers()])
    loss = out.float().square().mean()
    with CountOps() as counter:
        loss.backward()
    return held, counter.ops


def _step_seconds(model: nn.Module, forward: Callable[[], Any]) -> float:
    model.zero_grad(set_to_none=True)
    start = time.perf_counter()
    forward().float().square().mean().backward()
    return time.perf_counter() - start


def one_device(name: str, model: nn.Module, call: Callable, repeats: int) -> None:
    compiled = {
        rc: amp_graph.compile(model, _policy(policy, rc), BF16)
        for policy in (name,)
        for rc in (True, False)
    }
    for c in compiled.values():
        _step_seconds(model, lambda c=c: call(c))  # capture

    def autocast(m: nn.Module = model) -> Any:
        with torch.autocast("cpu", BF16):
            return call(m)

    held_ac, ops_ac = _held_and_backward_ops(model, autocast)
    held_on, ops_on = _held_and_backward_ops(model, lambda: call(compiled[True]))
    held_off, ops_off = _held_and_backward_ops(model, lambda: call(compiled[False]))
    extra = ops_on - ops_off
    times: dict[bool, list[float]] = {True: [], False: []}
    for i in range(repeats):  # paired and interleaved, alternating which runs first
        for rc in (True, False) if i % 2 else (False, True):
            times[rc].append(_step_seconds(model, lambda rc=rc: call(compiled[rc])))
    stats = compiled[True].graph_module.meta["amp_graph"].stats
    on, off = statistics.median(times[True]), statistics.median(times[False])
    ratios = [a / b for a, b in zip(times[True], times[False], strict=True)]
    quartiles = statistics.quantiles(ratios, n=4)
    print(
        f"  {name:8s} held: autocast {held_ac / MB:6.2f} MB | keeping casts "
        f"{held_off / MB:6.2f} MB ({held_off / held_ac:.2f}x) | recomputing "
        f"{held_on / MB:6.2f} MB ({held_on / held_ac:.2f}x autocast)"
    )
    print(
        f"           casts recomputed {stats['casts_recomputed']} "
        f"({stats['recomputed_cast_bytes'] / MB:.2f} MB of copies); backward's extra ops: "
        f"{dict(extra)}; backward casts: autocast {ops_ac['_to_copy']}, keeping "
        f"{ops_off['_to_copy']}, recomputing {ops_on['_to_copy']}"
    )
    print(
        f"           step median over {repeats}: recomputing {on * 1e3:.1f} ms, keeping "
        f"{off * 1e3:.1f} ms; paired ratio median {statistics.median(ratios):.3f}x "
        f"(quartiles {quartiles[0]:.3f}-{quartiles[2]:.3f})"
    )


def _llama() -> tuple[nn.Module, Callable]:
    import transformers

    config = transformers.LlamaConfig(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=512,
        max_position_embeddings=64,
        use_cache=False,
    )
    config._attn_implementation = "eager"
    ids = torch.randint(0, 512, (4, 64))
    return transformers.LlamaForCausalLM(config).train(), lambda m: m(ids).logits


# ---- widened activations and absorbed casts (issue 24, part 3) ------------------------------


def _hf_gpt2() -> tuple[nn.Module, Callable]:
    import transformers

    config = transformers.GPT2Config(
        n_positions=64, n_embd=128, n_layer=2, n_head=4, vocab_size=512, use_cache=False
    )
    config.attn_pdrop = config.resid_pdrop = config.embd_pdrop = 0.0
    config._attn_implementation = "eager"
    ids = torch.randint(0, 512, (4, 64))
    return transformers.GPT2LMHeadModel(config).train(), lambda m: m(ids).logits


def _bert() -> tuple[nn.Module, Callable]:
    import transformers

    config = transformers.BertConfig(
        vocab_size=512,
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=256,
        max_position_embeddings=64,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    config._attn_implementation = "eager"
    ids = torch.randint(0, 512, (4, 64))
    return transformers.BertForMaskedLM(config).train(), lambda m: m(input_ids=ids).logits


def _unet() -> tuple[nn.Module, Callable]:
    import diffusers

    unet = diffusers.UNet2DModel(
        sample_size=16,
        in_channels=3,
        out_channels=3,
        block_out_channels=(32, 64),
        layers_per_block=1,
        norm_num_groups=8,
        down_block_types=("DownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "UpBlock2D"),
    ).train()
    sample, timestep = torch.randn(4, 3, 16, 16), torch.tensor([10])
    return unet, lambda m: m(sample, timestep).sample


def widened(label: str, policy: str, model: nn.Module, call: Callable) -> None:
    """Held bytes keeping against recomputing, and what part 3's two mechanisms decided:
    widened activations kept narrow (``"smaller"``) and casts absorbed into ``dtype=``."""
    held = {}
    for variant in ("keeping", "recomputing, widened kept", "recomputing"):
        # the middle variant turns off only the widened activations (this script's own
        # switch on the pass's private predicate: no policy field for it)
        widens = recompute_casts_pass._widens
        if variant == "recomputing, widened kept":
            recompute_casts_pass._widens = lambda source, dtype: False
        try:
            compiled = amp_graph.compile(model, _policy(policy, variant != "keeping"), BF16)
            _held_and_backward_ops(model, lambda c=compiled: call(c))  # capture, passes
        finally:
            recompute_casts_pass._widens = widens
        held[variant], _ = _held_and_backward_ops(model, lambda c=compiled: call(c))
        if variant == "recomputing":
            graph = compiled.graph_module
            kinds = Counter(n.args[2] for n in graph.graph.nodes if n.target is recomputed_cast)
            absorbed = graph.meta["amp_graph"].stats.get("casts_absorbed", 0)
    keeping = held["keeping"]
    print(
        f"  {label:38s} {policy:3s} keeping {keeping / MB:5.2f} MB | recomputing, widened "
        f"kept {held['recomputing, widened kept'] / MB:5.2f} MB "
        f"({held['recomputing, widened kept'] / keeping:.2f}x) | recomputing "
        f"{held['recomputing'] / MB:5.2f} MB ({held['recomputing'] / keeping:.2f}x) | "
        f"decided: {kinds['module']} parameter, {kinds['autograd']} kept-result, "
        f"{kinds['smaller']} widened; {absorbed} absorbed into dtype="
    )


class CastsPerStep(TorchDispatchMode):
    """``_to_copy`` calls and their bytes read + written, forward and backward apart, and by
    kind: whether the copy is shaped like one of ``parameters``."""

    def __init__(self, parameters: Iterable[torch.Tensor]) -> None:
        super().__init__()
        self.parameter_shapes = {tuple(p.shape) for p in parameters}
        self.phase = "forward"
        self.count: Counter[str] = Counter()
        self.bytes: Counter[str] = Counter()
        self.kinds: Counter[tuple[str, str, str, bool]] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._to_copy.default:
            self.count[self.phase] += 1
            self.bytes[self.phase] += out.numel() * (args[0].element_size() + out.element_size())
            shaped = tuple(out.shape) in self.parameter_shapes
            self.kinds[(self.phase, str(args[0].dtype)[6:], str(out.dtype)[6:], shaped)] += 1
        return out


def like_for_like_casts(model: nn.Module, ids: torch.Tensor) -> None:
    """Casts per step, ``policy="autocast"`` against torch.autocast on the same GPT."""

    def count(forward: Callable[[], torch.Tensor]) -> CastsPerStep:
        mode = CastsPerStep(model.parameters())
        with mode:
            out = forward()
            mode.phase = "backward"
            out.float().square().mean().backward()
        model.zero_grad(set_to_none=True)
        return mode

    def autocast() -> torch.Tensor:
        with torch.autocast("cpu", BF16):
            return model(ids)

    runs = {"torch.autocast": count(autocast)}
    for rc in (False, True):
        compiled = amp_graph.compile(model, _policy("autocast", rc), BF16)
        count(lambda c=compiled: c(ids))  # capture
        runs["amp_graph, recomputing" if rc else "amp_graph, keeping"] = count(
            lambda c=compiled: c(ids)
        )
    base = runs["torch.autocast"]
    for label, run in runs.items():
        total, nbytes = sum(run.count.values()), sum(run.bytes.values())
        print(
            f"  {label:24s} casts fwd {run.count['forward']:3d} bwd {run.count['backward']:3d}"
            f" = {total:3d} ({total / sum(base.count.values()):.2f}x) | bytes "
            f"{nbytes / MB:6.2f} MB ({nbytes / sum(base.bytes.values()):.2f}x)"
        )
    print("  by kind (phase, from, to, parameter-shaped): autocast / keeping / recomputing")
    keys = sorted(set().union(*(run.kinds for run in runs.values())))
    for key in keys:
        print(f"    {key}: " + " / ".join(str(run.kinds[key]) for run in runs.values()))


# ---- FSDP2 on 2 gloo ranks -----------------------------------------------------------------


def _fsdp_held(make: Callable[[], nn.Module], x: torch.Tensor) -> dict[str, tuple[int, ...]]:
    """Per variant on this rank, ``make()`` 's blocks and root sharded: (held bytes,
    all-gather bytes, reduce-scatter bytes) of a forward + backward; held bytes are the
    least of three steps, as in tests/test_fsdp2_amp.py (FSDP2 frees some communication
    buffers on timing-dependent paths; what the graph keeps is kept every step)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    def sharded(**kwargs: Any) -> nn.Module:
        torch.manual_seed(0)
        return models.shard_blocks(make(), **kwargs)

    def held(model: nn.Module, forward: Callable[[], Any]) -> tuple[int, ...]:
        steps = []
        for _ in range(3):
            with CollectiveBytes() as moved:
                exclude = [*model.parameters(), *model.buffers()]
                n, out = held_for_backward(forward, exclude, model)
                out.float().square().mean().backward()
            model.zero_grad(set_to_none=True)
            steps.append((n, moved.all_gather, moved.reduce_scatter))
        return min(n for n, _, _ in steps), *steps[-1][1:]

    def planned() -> nn.Module:
        """Sharded as amp_graph.plan_fsdp plans it, the units its split names included."""
        torch.manual_seed(0)
        model = make()
        plan = amp_graph.plan_fsdp(
            model, [*model.blocks, model], "O1", BF16, example_inputs=(x,), split_mixed=True
        )
        return plan.fully_shard()

    row = {}
    user = MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=torch.float32)
    for label, recompute, mp_policy in (
        ("amp_graph O1", True, None),
        ("amp_graph O1, casts kept", False, None),
        ("amp_graph O1 + MPP(bf16)", True, user),
        ("amp_graph O1, plan_fsdp", True, "plan"),
    ):
        if mp_policy == "plan":
            model = planned()
        else:
            model = sharded(mp_policy=mp_policy) if mp_policy else sharded()
        compiled = amp_graph.compile(model, _policy("O1", recompute), BF16)
        held(model, lambda c=compiled: c(x))
        row[label] = held(model, lambda c=compiled: c(x))
    model = sharded()

    def autocast() -> Any:
        with torch.autocast("cpu", BF16):
            return model(x)

    row["torch.autocast"] = held(model, autocast)
    mixed = sharded(mp_policy=MixedPrecisionPolicy(param_dtype=BF16))
    row["MixedPrecisionPolicy"] = held(mixed, lambda: mixed(x))
    return row


def _fsdp_rank(rank: int, port: int, out_dir: str) -> None:
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=datetime.timedelta(seconds=60),
    )
    torch.set_num_threads(1)
    results = {}
    setups = {
        "6 residual MLP blocks, width 256, batch 8": (models.ResidualMLP, (8, 256)),
        "4 Llama-style layers, width 128, 4x64 tokens": (models.LlamaStyle, (4, 64, 128)),
    }
    for label, (make, shape) in setups.items():
        x = torch.randn(*shape, generator=torch.Generator().manual_seed(rank))
        results[label] = _fsdp_held(make, x)
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    dist.destroy_process_group()


def fsdp2() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(_fsdp_rank, args=(port, out), nprocs=2, join=True)
        rank0 = torch.load(Path(out) / "rank0.pt")
    for label, row in rank0.items():
        mpp = row["MixedPrecisionPolicy"][0]
        fp32_gather = row["amp_graph O1"][1]
        print(f"  {label} (rank 0): held | all-gather | reduce-scatter, per step")
        for variant, (held, gathered, reduced) in row.items():
            print(
                f"    {variant:26s} {held / MB:7.3f} MB ({held / mpp:5.2f}x MPP) | "
                f"{gathered / MB:6.3f} MB ({gathered / fp32_gather:4.2f}x fp32) | "
                f"{reduced / MB:6.3f} MB"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--fsdp", action="store_true", help="only the FSDP2 tables")
    parser.add_argument(
        "--part3",
        action="store_true",
        help="only issue 24 part 3: widened activations, absorbed casts, like-for-like casts",
    )
    options = parser.parse_args()
    repeats = 5 if options.quick else 101
    torch.set_num_threads(1)
    print(
        f"torch {torch.__version__}, CPU {platform.processor() or platform.machine()}, "
        f"python {sys.version.split()[0]}, bf16, 1 thread"
    )
    torch.manual_seed(0)
    gpt = models.GPT(vocab=512, block=64, dim=128, heads=4, layers=4)
    ids = torch.randint(0, 512, (4, 64))
    if options.part3:
        part3(gpt, ids)
        return
    if options.fsdp:
        print("FSDP2, 2 gloo ranks, O1 bf16 (held at the end of the forward, per rank):")
        fsdp2()
        return
    print("GPT-style decoder (4 layers, width 128, 4x64 tokens):")
    for name in ("O1", "autocast"):
        one_device(name, gpt, lambda m: m(ids), repeats)
    torch.manual_seed(0)
    wider = models.GPT(vocab=512, block=128, dim=256, heads=8, layers=4)
    wide_ids = torch.randint(0, 512, (8, 128))
    print("GPT-style decoder (4 layers, width 256, 8x128 tokens):")
    one_device("O1", wider, lambda m: m(wide_ids), repeats)
    torch.manual_seed(0)
    bench_ids = torch.randint(0, 512, (16, 128))
    print("compile_bench.py's GPT (4 layers, width 256, 16x128 tokens):")
    for name in ("O1", "autocast"):
        one_device(name, wider, lambda m: m(bench_ids), max(repeats // 3, 5))
    llama, call = _llama()
    print("HF Llama (eager attention, 2 layers, width 128, 4x64 tokens):")
    for name in ("O1", "autocast"):
        one_device(name, llama, call, repeats)
    print("FSDP2, 2 gloo ranks, O1 bf16 (held at the end of the forward, per rank):")
    fsdp2()


def part3(gpt: nn.Module, ids: torch.Tensor) -> None:
    print("Held for backward, casts kept against recomputed (widened activations kept narrow):")
    torch.manual_seed(0)
    widened("GPT-style decoder (SDPA)", "O1", gpt, lambda m: m(ids))
    nano, tokens = models.NanoAttention(dim=128, heads=4, block=64), torch.randn(4, 64, 128)
    widened("nanoGPT attention (no flash, 4x64x128)", "O1", nano, lambda m: m(tokens))
    gpt2, call = _hf_gpt2()
    widened("HF GPT-2 (eager, 2x128, 4x64)", "O1", gpt2, call)
    llama, call = _llama()
    for policy in ("O1", "O2"):
        widened("HF Llama (eager, 2x128, 4x64)", policy, llama, call)
    bert, call = _bert()
    widened("HF BERT (eager, 2x128, 4x64)", "O2", bert, call)
    unet, call = _unet()
    widened("diffusers UNet2D (32/64 ch, 4x16x16)", "O1", unet, call)
    print("Casts per step (forward + backward), policy='autocast' vs torch.autocast, GPT:")
    like_for_like_casts(gpt, ids)


if __name__ == "__main__":
    main()
