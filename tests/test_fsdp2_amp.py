"""amp_graph on models sharded with FSDP2 (``fully_shard``) and on DDP: 2 CPU processes, gloo.

Each test trains the same sharded model two ways from the same initialization, on each
rank's own data: through amp_graph (``compile`` or ``Graph``) and by a hand-written
``torch.autocast`` loop, the oracle. Every rank returns its losses and the full
parameters (``p.full_tensor()``) through a file; the parent compares them.

Tolerances: the graph runs the same aten ops at the same dtypes as the oracle (O1 decides
these ops as CPU autocast does), casts each parameter once per forward as autocast's weight
cache does, and runs FSDP's own hooks at the same places, so the numbers come out bit for
bit equal on torch 2.13. The tests allow 1e-6 (absolute on parameters of size ~1,
relative on losses ~3.6), room for a different float32 summation order only: a missed
unshard (shard-sized garbage), a dropped hook (no reduce-scatter: ranks diverge), a wrong
dtype (bf16 rounding is 4e-3) or a step not skipped (AdamW moves each parameter by ~1e-2)
are all far above it. The ranks must agree exactly: they hold one model.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from dist_helpers import spawn_scenario
from hf_configs import small_llama_config

WORLD = 2
STEPS = 3
VOCAB, DIM, SEQ, BATCH = 32, 16, 8, 4
JOIN_SECONDS = 90  # a rank that hangs on a collective fails the test instead of hanging it


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.fc1 = nn.Linear(DIM, 4 * DIM)
        self.fc2 = nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class TinyLM(nn.Module):
    """Embedding, two pre-norm MLP blocks, a final norm and a head: nanoGPT's shape."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def sharded_model(**fully_shard_kwargs: Any) -> TinyLM:
    from amp_graph.demo.models import shard_blocks

    torch.manual_seed(0)  # the same full parameters on every rank before sharding
    return shard_blocks(TinyLM(), **fully_shard_kwargs)


def batches(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(100 + rank)  # each rank its own data
    return [
        (
            torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen),
            torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen),
        )
        for _ in range(STEPS)
    ]


def loss_fn(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().reshape(-1, VOCAB), y.reshape(-1))


def full_parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
        for name, p in model.named_parameters()
    }


def train_autocast(
    model: nn.Module, rank: int, dtype: torch.dtype, micro_batches: int = 1
) -> list[float]:
    """The oracle: eager FSDP2 under torch.autocast (with ``micro_batches``, gradients
    accumulated over that many chunks of each batch, each loss divided by their number)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for x, y in batches(rank):
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for xc, yc in zip(x.chunk(micro_batches), y.chunk(micro_batches), strict=True):
            with torch.autocast("cpu", dtype=dtype):
                loss = loss_fn(model(xc), yc)
            (loss / micro_batches).backward()
            total += loss.item() / micro_batches
        opt.step()
        losses.append(total)
    return losses


def train_compiled(step_model: nn.Module, model: nn.Module, rank: int) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for x, y in batches(rank):
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(step_model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def loss_step(
    model: nn.Module, opt: torch.optim.Optimizer, policy: str, micro_batches: int = 1
) -> Any:
    """An ``amp_graph.Graph`` training ``model`` on ``loss_fn(model(x), y)`` with ``opt``,
    under ``policy`` in bf16, ``micro_batches`` per step."""
    import amp_graph

    class LossStep(amp_graph.Graph):
        def __init__(self) -> None:
            super().__init__()
            self.model = model
            self.add_optimizer(opt)
            self.config.enable_amp(True, policy=policy, dtype=torch.bfloat16)
            self.config.set_gradient_accumulation_steps(micro_batches)

        def build(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            loss = loss_fn(self.model(x), y)
            loss.backward()
            return loss

    return LossStep()


def train_counting(
    model: nn.Module, loss_of: Callable[[Any], torch.Tensor], inputs: list[Any]
) -> tuple[list[float], int]:
    """AdamW over ``model``'s parameters, a step on ``loss_of(x)`` per input: the losses,
    and the bytes the last step's forward and backward all-gathered."""
    from amp_graph.inspect.traffic import CollectiveBytes

    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, gathered = [], 0
    for x in inputs:
        opt.zero_grad(set_to_none=True)
        with CollectiveBytes() as counted:
            loss = loss_of(x)
            loss.backward()
        opt.step()
        losses.append(loss.item())
        gathered = counted.all_gather
    return losses, gathered


# ---- the scenarios, one per test: each runs on every rank and returns what it measured ----


def compile_bf16(rank: int) -> dict[str, Any]:
    import amp_graph

    model = sharded_model()
    compiled = amp_graph.compile(model, policy="O1", dtype=torch.bfloat16)
    losses = train_compiled(compiled, model, rank)
    gm = compiled.graph_module
    reference = sharded_model()
    return {
        "losses": losses,
        "params": full_parameters(model),
        "ref_losses": train_autocast(reference, rank, torch.bfloat16),
        "ref_params": full_parameters(reference),
        "code": gm.code,
        "recomputed": gm.meta["amp_graph"].stats["casts_recomputed"],
        "order": _hook_order(gm),
        "shares": _shares_parameters(gm, model),
    }


def graph_bf16(rank: int, micro_batches: int = 1) -> dict[str, Any]:
    """``micro_batches`` > 1: gradient accumulation, where the casts of FSDP parameters must
    stay inside the build graph (outside its unit's calls a parameter is a shard)."""
    model = sharded_model()
    step = loss_step(model, torch.optim.AdamW(model.parameters(), lr=1e-2), "O1", micro_batches)
    losses = [step(x, y).item() for x, y in batches(rank)]
    reference = sharded_model()
    return {
        "losses": losses,
        "params": full_parameters(model),
        "ref_losses": train_autocast(reference, rank, torch.bfloat16, micro_batches),
        "ref_params": full_parameters(reference),
        "code": step.build_graph.code,
        "skipped": step.skipped_steps,
    }


POISONED_STEP = 1


def _train_scaled(forward: Callable, model: nn.Module, rank: int, autocast: bool) -> dict:
    """float16 with amp_graph.GradScaler; rank 1's shard of one gradient is inf at
    POISONED_STEP, so the scaler (checking the sharded gradients over the mesh) must make
    every rank skip that step."""
    from amp_graph.scaler import GradScaler

    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = GradScaler(init_scale=2.0**10)
    taken = []
    for step, (x, y) in enumerate(batches(rank)):
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16, enabled=autocast):
            logits = forward(x)
        scaler.scale(loss_fn(logits, y)).backward()
        if step == POISONED_STEP and rank == 1:
            model.blocks[1].fc2.weight.grad.to_local()[0, 0] = float("inf")
        scaler.step(opt)
        scaler.update()
        taken.append(bool(scaler.last_step_taken))
    return {"taken": taken, "params": full_parameters(model), "scale": scaler.get_scale()}


def compile_fp16_scaler(rank: int) -> dict[str, Any]:
    import amp_graph

    model = sharded_model()
    compiled = amp_graph.compile(model, policy="O1", dtype=torch.float16)
    ours = _train_scaled(compiled, model, rank, autocast=False)
    reference = sharded_model()
    theirs = _train_scaled(reference, reference, rank, autocast=True)
    return {"ours": ours, "theirs": theirs}


def ddp_compile(rank: int) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    import amp_graph

    torch.manual_seed(0)
    model, reference = TinyLM(), TinyLM()
    reference.load_state_dict(model.state_dict())
    # every cast recomputed (a DDP replica has no FSDP2 unit, and copies this small are kept
    # under "auto"): the recompute under DDP's hooks
    recompute_all = dataclasses.replace(amp_graph.Policy.preset("O1"), recompute_casts=True)
    compiled = DDP(amp_graph.compile(model, policy=recompute_all, dtype=torch.bfloat16))
    losses = train_compiled(compiled, model, rank)
    ref = DDP(reference)
    return {
        "losses": losses,
        "params": full_parameters(model),
        "ref_losses": train_autocast(ref, rank, torch.bfloat16),
        "ref_params": full_parameters(reference),
        "recomputed": compiled.module.graph_module.meta["amp_graph"].stats["casts_recomputed"],
    }


class BranchingLM(TinyLM):
    """Python that branches on a value: export fails inside the capture."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        logits = super().forward(idx)
        return logits * 2 if logits.sum() > 0 else logits


def _hooks(model: nn.Module) -> list[tuple[list, list]]:
    return [
        (list(m._forward_pre_hooks.items()), list(m._forward_hooks.items()))
        for m in model.modules()
    ]


def refusals(rank: int) -> dict[str, Any]:
    from torch.distributed.fsdp import FSDPModule

    import amp_graph
    from amp_graph.demo.models import shard_blocks

    def capture_error(model: nn.Module) -> str:
        try:
            amp_graph.compile(model, policy="O1", dtype=torch.bfloat16)(batches(rank)[0][0])
        except amp_graph.CaptureError as error:
            return str(error)
        return ""

    torch.manual_seed(0)
    branching = shard_blocks(BranchingLM())
    before = _hooks(branching)
    failed = capture_error(branching)
    # the torch internals the capture and the pass rely on (FSDP2's hook handles)
    state = branching.blocks[0]._get_fsdp_state()
    pinned = isinstance(branching.blocks[0], FSDPModule) and (
        branching.blocks[0]._forward_pre_hooks[state._pre_forward_hook_handle.id]
        == state._pre_forward
        and branching.blocks[0]._forward_hooks[state._post_forward_hook_handle.id]
        == state._post_forward
    )
    loss = loss_fn(branching(batches(rank)[0][0]), batches(rank)[0][1])
    loss.backward()  # eager FSDP still works after the failed capture

    try:
        masters_model = sharded_model()
        loss_step(masters_model, torch.optim.SGD(masters_model.parameters(), lr=0.1), "O2")(
            *batches(rank)[0]
        )
        masters = ""
    except ValueError as error:
        masters = str(error)
    # O0 casts nothing: units gathering bf16 must cast their own inputs (FSDP2's default)
    from torch.distributed.fsdp import MixedPrecisionPolicy

    x = batches(rank)[0][0]
    uncast = MixedPrecisionPolicy(param_dtype=torch.bfloat16, cast_forward_inputs=False)
    try:
        amp_graph.compile(sharded_model(mp_policy=uncast), policy="O0")(x)
        o0_uncast = ""
    except amp_graph.CaptureError as error:
        o0_uncast = str(error)
    casting = sharded_model(mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    o0_out = amp_graph.compile(casting, policy="O0")(x)
    return {
        "o0_uncast": o0_uncast,
        "o0_casting": (o0_out.dtype == torch.bfloat16, torch.equal(o0_out, casting(x))),
        "masters": masters,
        "failed": failed,
        "hooks_kept": before == _hooks(branching),
        "resharded": all(type(p).__name__ == "DTensor" for p in branching.parameters()),
        "pinned": pinned,
        "grads": all(p.grad is not None for p in branching.parameters()),
    }


def mixed_precision(rank: int) -> dict[str, Any]:
    """A user's own ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` (inputs
    cast by FSDP, its default), honoured: the graph against the same sharded model under
    torch.autocast, eager; and the bytes each variant's collectives move in one step."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    import amp_graph
    from amp_graph.inspect.traffic import CollectiveBytes

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = sharded_model(mp_policy=mp)
    compiled = amp_graph.compile(model, policy="autocast", dtype=torch.bfloat16)
    losses = train_compiled(compiled, model, rank)
    reference = sharded_model(mp_policy=mp)
    ref_losses = train_autocast(reference, rank, torch.bfloat16)

    def comm(model: nn.Module, forward: Callable) -> tuple[int, int]:
        x, y = batches(rank)[0]
        with CollectiveBytes() as counted:
            loss_fn(forward(x), y).backward()
        model.zero_grad(set_to_none=True)
        return counted.all_gather, counted.reduce_scatter

    plain = sharded_model()
    plain_compiled = amp_graph.compile(plain, policy="autocast", dtype=torch.bfloat16)
    comm(plain, plain_compiled)  # captured outside the count

    def autocast(x: torch.Tensor, m: nn.Module = plain) -> torch.Tensor:
        with torch.autocast("cpu", torch.bfloat16):
            return m(x)

    def parameter_casts_to_bf16(gm: Any) -> int:
        return sum(
            n.meta["amp"].role.value == "cast"
            and n.args[0].op == "get_attr"
            and n.args[1] == torch.bfloat16
            for n in gm.graph.nodes
        )

    return {
        "losses": losses,
        "params": full_parameters(model),
        "ref_losses": ref_losses,
        "ref_params": full_parameters(reference),
        "report": amp_graph.report(compiled).totals(),
        # units mixing norms (read in float32) and linears: no low all-gather is proposed
        "read_low": amp_graph.report(plain_compiled).fsdp_read_low,
        "parameter_casts": (
            parameter_casts_to_bf16(compiled.graph_module),
            parameter_casts_to_bf16(plain_compiled.graph_module),
        ),
        "comm": {
            "amp_graph, param_dtype=bf16": comm(model, compiled),
            "autocast, param_dtype=bf16": comm(reference, lambda x: autocast(x, reference)),
            "amp_graph": comm(plain, plain_compiled),
            "autocast": comm(plain, autocast),
        },
    }


def read_low(rank: int) -> dict[str, Any]:
    """Residual MLP blocks, whose every parameter read is a cast to bf16 under O1: report
    names the units; the policy it proposes trains the same bits at half the all-gather."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    import amp_graph
    from amp_graph.demo.models import ResidualMLP

    def sharded(**kwargs: Any) -> nn.Module:
        torch.manual_seed(0)
        model = ResidualMLP(width=32, blocks=2)
        for block in model.blocks:
            fully_shard(block, **kwargs)
        fully_shard(model)
        return model

    gen = torch.Generator().manual_seed(rank)
    xs = [torch.randn(4, 32, generator=gen) for _ in range(STEPS)]
    results: dict[str, Any] = {}
    proposed = MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=False
    )
    for name, kwargs in (("plain", {}), ("proposed", {"mp_policy": proposed})):
        model = sharded(**kwargs)
        compiled = amp_graph.compile(model, policy="O1", dtype=torch.bfloat16)
        _, gathered = train_counting(model, lambda x, c=compiled: c(x).float().square().mean(), xs)
        report = amp_graph.report(compiled)
        results[name] = {
            "params": full_parameters(model),
            "read_low": report.fsdp_read_low,
            "all_gather": gathered,
            "totals": report.totals(),
        }
    return results


def planned(rank: int) -> dict[str, Any]:
    """Models sharded as ``amp_graph.plan_fsdp`` plans them (the Llama-style layers with
    the children the plan names as units of their own), against the same models sharded
    per block with float32 all-gathers: trained through compile and ``Graph`` (O1, bf16)."""
    import amp_graph
    from amp_graph.demo import models

    class TrainStep(amp_graph.Graph):
        def __init__(self, model: nn.Module, opt: torch.optim.Optimizer) -> None:
            super().__init__()
            self.model = model
            self.add_optimizer(opt)
            self.config.enable_amp(True, policy="O1", dtype=torch.bfloat16)

        def build(self, x: torch.Tensor) -> torch.Tensor:
            loss = self.model(x).float().square().mean()
            loss.backward()
            return loss

    gen = torch.Generator().manual_seed(rank)
    setups: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...]]] = {
        "mlp": (lambda: models.ResidualMLP(width=32, blocks=2), (4, 32)),
        "llama": (lambda: models.LlamaStyle(dim=32, blocks=2), (2, 16, 32)),
    }
    results: dict[str, Any] = {}
    for name, (make, shape) in setups.items():
        xs = [torch.randn(*shape, generator=gen) for _ in range(STEPS)]

        def plain(make: Callable[[], nn.Module] = make) -> tuple[nn.Module, Any]:
            torch.manual_seed(0)
            return models.shard_blocks(make()), None

        def by_plan(make: Callable[[], nn.Module] = make, x: torch.Tensor = xs[0]) -> Any:
            torch.manual_seed(0)
            model = make()
            units = [*model.blocks, model]
            plan = amp_graph.plan_fsdp(model, units, "O1", example_inputs=(x,), split_mixed=True)
            return plan.fully_shard(), plan

        per: dict[str, Any] = {}
        for variant, build in (("plain", plain), ("planned", by_plan)):
            model, plan = build()
            compiled = amp_graph.compile(model, "O1", torch.bfloat16)
            _, gathered = train_counting(
                model, lambda x, c=compiled: c(x).float().square().mean(), xs
            )
            graph_model, _ = build()
            step = TrainStep(graph_model, torch.optim.AdamW(graph_model.parameters(), lr=1e-2))
            graph_losses = [step(x).item() for x in xs]
            per[variant] = {
                "params": full_parameters(model),
                "graph_params": full_parameters(graph_model),
                "graph_losses": graph_losses,
                "all_gather": gathered,
                "planned_ratio": plan.all_gather_ratio if plan else 1.0,
                "report": amp_graph.report(compiled).totals(),
            }
            if plan is not None:
                try:
                    amp_graph.plan_fsdp(model, [model], example_inputs=(xs[0],))
                except ValueError as error:
                    per[variant]["sharded_refused"] = str(error)
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    pinned = amp_graph.Policy.preset("O1").override(modules={"blocks.0.*": "deny"})
                    for policy in ("O1", pinned):  # as planned; block 0 in float32
                        amp_graph.compile(model, policy, torch.bfloat16)(xs[0])
                per[variant]["warned"] = [
                    str(w.message) for w in caught if "plan_fsdp planned" in str(w.message)
                ]
        results[name] = per
    return results


def _load_full(sharded: nn.Module, full: nn.Module) -> None:
    """Each rank's shards of ``full``'s parameters (and its buffers) into ``sharded``."""
    from torch.distributed.tensor import distribute_tensor

    values = dict(full.named_parameters())
    with torch.no_grad():
        for name, param in sharded.named_parameters():
            local = distribute_tensor(values[name].detach(), param.device_mesh, param.placements)
            param.to_local().copy_(local.to_local())
        buffers = dict(full.named_buffers())
        for name, buffer in sharded.named_buffers():
            buffer.copy_(buffers[name])


def planned_hf_llama(rank: int) -> dict[str, Any]:
    """HF ``LlamaForCausalLM`` (random small config) sharded per decoder layer and at the
    root, with float32 all-gathers, against the same model built on the meta device,
    planned there by ``plan_fsdp`` (with the units its split names: each layer's attention
    and MLP, the head), sharded so, then given the same weights."""
    import transformers
    from torch.distributed.fsdp import fully_shard

    import amp_graph

    def llama() -> nn.Module:
        torch.manual_seed(0)
        return transformers.LlamaForCausalLM(small_llama_config())

    gen = torch.Generator().manual_seed(rank)
    ids = [torch.randint(0, 100, (2, 16), generator=gen) for _ in range(STEPS)]
    results: dict[str, Any] = {}
    for variant in ("plain", "planned"):
        model = llama()
        units = [*model.model.layers, model]
        if variant == "plain":
            for unit in units:
                fully_shard(unit)
        else:  # FSDP2's recipe for a model larger than a rank: built, planned, sharded on meta
            with torch.device("meta"):
                model = llama()
            units = [*model.model.layers, model]
            meta_ids = ids[0].to("meta")
            plan = amp_graph.plan_fsdp(
                model, units, "O1", example_inputs=(meta_ids,), split_mixed=True
            )
            plan.fully_shard()
            model.to_empty(device="cpu")
            _load_full(model, llama())
            results["plan"] = str(plan)
            results["planned_ratio"] = plan.all_gather_ratio
        compiled = amp_graph.compile(model, "O1", torch.bfloat16)
        losses, gathered = train_counting(
            model, lambda x, c=compiled: c(input_ids=x, labels=x).loss, ids
        )
        results[variant] = {
            "params": full_parameters(model),
            "losses": losses,
            "all_gather": gathered,
        }
    return results


class CheckpointedLM(TinyLM):
    """Blocks 0 and 1 recomputed in backward: one checkpoint per block (supported) or one
    over both (spans two FSDP units: refused)."""

    def __init__(self, per_block: bool) -> None:
        super().__init__()
        self.per_block = per_block

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        x = self.emb(idx)
        if self.per_block:
            for block in self.blocks:
                x = checkpoint(block, x, use_reentrant=False)
        else:
            x = checkpoint(lambda h: self.blocks[1](self.blocks[0](h)), x, use_reentrant=False)
        return self.head(self.norm(x))


def _sharded_checkpointed(per_block: bool) -> CheckpointedLM:
    from amp_graph.demo.models import shard_blocks

    torch.manual_seed(0)
    return shard_blocks(CheckpointedLM(per_block))


def checkpoints(rank: int) -> dict[str, Any]:
    import amp_graph

    model = _sharded_checkpointed(per_block=True)
    compiled = amp_graph.compile(model, policy="O1", dtype=torch.bfloat16)
    losses = train_compiled(compiled, model, rank)
    reference = _sharded_checkpointed(per_block=True)
    spanning = _sharded_checkpointed(per_block=False)
    try:
        amp_graph.compile(spanning, policy="O1", dtype=torch.bfloat16)(batches(rank)[0][0])
    except amp_graph.CaptureError as error:
        message = str(error)
    else:
        message = ""
    return {
        "losses": losses,
        "params": full_parameters(model),
        "ref_losses": train_autocast(reference, rank, torch.bfloat16),
        "ref_params": full_parameters(reference),
        "code": compiled.graph_module.code,
        "spanning": message,
    }


def _held_variants(make: Callable[[], nn.Module], x: torch.Tensor) -> dict[str, int]:
    """Bytes each rank holds for backward at the end of the forward, per variant."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    import amp_graph
    from amp_graph.demo.models import shard_blocks
    from amp_graph.inspect.held import held_for_backward

    def sharded(**kwargs: Any) -> nn.Module:
        torch.manual_seed(0)
        return shard_blocks(make(), **kwargs)

    def measure(model: nn.Module, forward: Callable[[], torch.Tensor]) -> tuple[int, list]:
        """The least held over three steps: FSDP2 frees some communication buffers on
        timing-dependent paths (in some interleavings one unit's gathered parameters are
        still alive after the forward, eager torch.autocast included); what the graph
        itself keeps for backward is kept in every step."""
        held = []
        for _ in range(3):
            exclude = [*model.parameters(), *model.buffers()]
            step_held, out = held_for_backward(forward, exclude, model)
            held.append(step_held)
            out.float().square().mean().backward()
            # full_tensor() may return a tensor whose all-gather completes when first used:
            # use it now (clone), or its buffer would be made during the next forward
            grads = [p.grad.full_tensor().clone() for p in model.parameters()]
            model.zero_grad(set_to_none=True)
        return min(held), grads

    results, grads = {}, {}
    for recompute in (True, False):
        model = sharded()
        policy = dataclasses.replace(amp_graph.Policy.preset("O1"), recompute_casts=recompute)
        compiled = amp_graph.compile(model, policy=policy, dtype=torch.bfloat16)
        measure(model, lambda c=compiled: c(x))  # capture
        key = "amp_graph" if recompute else "amp_graph_keeping_casts"
        results[key], grads[key] = measure(model, lambda c=compiled: c(x))
        if recompute:
            results["casts_recomputed"] = compiled.graph_module.meta["amp_graph"].stats[
                "casts_recomputed"
            ]
    model = sharded()

    def autocast() -> torch.Tensor:
        with torch.autocast("cpu", torch.bfloat16):
            return model(x)

    results["autocast"], _ = measure(model, autocast)
    mixed = sharded(mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    results["fsdp_mixed_precision"], _ = measure(mixed, lambda: mixed(x))
    results["same_grads"] = all(
        torch.equal(a, b)
        for a, b in zip(grads["amp_graph"], grads["amp_graph_keeping_casts"], strict=True)
    )
    return results


def held_bytes(rank: int) -> dict[str, Any]:
    from amp_graph.demo import models

    gen = torch.Generator().manual_seed(rank)
    return {
        "mlp": _held_variants(models.ResidualMLP, torch.randn(8, 256, generator=gen)),
        "llama": _held_variants(models.LlamaStyle, torch.randn(4, 64, 128, generator=gen)),
    }


def _hook_order(gm: Any) -> list[str]:
    """The FSDP hook calls and the parameter reads, in graph order: ``pre:blocks_0``,
    ``param:model.blocks.0.fc1.weight``, ``post:blocks_0``..."""
    order = []
    for node in gm.graph.nodes:
        name = getattr(node.target, "__name__", "")
        if name in ("fsdp_pre_forward", "fsdp_post_forward"):
            order.append(f"{name[5:-8]}:{node.name.split('_', 2)[2]}")
        elif node.op == "get_attr" and node.target.endswith(("weight", "bias")):
            order.append(f"param:{node.target}")
    return order


def _shares_parameters(gm: Any, model: nn.Module) -> bool:
    """The graph reads the model itself (no copy): the graph's model is the user's object,
    and between two calls its parameter reads give the model's (sharded) parameters."""
    reads = [n.target for n in gm.graph.nodes if n.op == "get_attr" and "weight" in n.target]
    return gm.get_submodule("model") is model and all(
        gm.get_parameter(t) is model.get_parameter(t.removeprefix("model.")) for t in reads
    )


# ---- the harness ---------------------------------------------------------------------


def run_ranks(scenario: str, tmp_path: Path, module: str = __name__) -> list[dict[str, Any]]:
    """Run ``scenario`` (of ``module``'s ``SCENARIOS``) on WORLD processes; fail (not hang)
    if a rank fails or stalls."""
    return spawn_scenario(
        module,
        scenario,
        tmp_path,
        WORLD,
        join_seconds=JOIN_SECONDS,
        collective_timeout_seconds=30,
    )


SCENARIOS: dict[str, Callable[[int], dict[str, Any]]] = {
    "compile_bf16": compile_bf16,
    "graph_bf16": graph_bf16,
    "graph_bf16_accumulation": lambda rank: graph_bf16(rank, micro_batches=2),
    "compile_fp16_scaler": compile_fp16_scaler,
    "ddp_compile": ddp_compile,
    "refusals": refusals,
    "checkpoints": checkpoints,
    "held_bytes": held_bytes,
    "mixed_precision": mixed_precision,
    "read_low": read_low,
    "planned": planned,
    "planned_hf_llama": planned_hf_llama,
}


def _assert_close_to_reference(ranks: list[dict[str, Any]], atol: float = 1e-6) -> None:
    for result in ranks:
        torch.testing.assert_close(
            torch.tensor(result["losses"]), torch.tensor(result["ref_losses"]), rtol=1e-6, atol=0
        )
        assert result["params"].keys() == result["ref_params"].keys()
        for name, value in result["params"].items():
            torch.testing.assert_close(value, result["ref_params"][name], rtol=0, atol=atol)
    for name, value in ranks[0]["params"].items():  # one model: the ranks agree exactly
        assert torch.equal(value, ranks[1]["params"][name]), name


def test_compile_fsdp2_bf16_matches_autocast(tmp_path: Path) -> None:
    ranks = run_ranks("compile_bf16", tmp_path)
    _assert_close_to_reference(ranks)
    assert all(rank["recomputed"] > 0 for rank in ranks)  # the unsharded weights' casts
    code = ranks[0]["code"]
    for unit in ("root", "blocks_0", "blocks_1"):
        assert f"fsdp_unshard_{unit} = " in code and f"fsdp_reshard_{unit} = " in code
    # nested as eager runs the hooks; every parameter read inside its own unit's calls
    hooks = [e for e in ranks[0]["order"] if not e.startswith("param:")]
    assert hooks == [
        "pre:root",
        "pre:blocks_0",
        "post:blocks_0",
        "pre:blocks_1",
        "post:blocks_1",
        "post:root",
    ]
    order = ranks[0]["order"]
    for entry in order:
        if entry.startswith("param:model.blocks."):
            unit = "blocks_" + entry.split(".")[2]
            assert order.index(f"pre:{unit}") < order.index(entry) < order.index(f"post:{unit}")
    assert ranks[0]["shares"]


def test_graph_fsdp2_bf16_matches_autocast(tmp_path: Path) -> None:
    ranks = run_ranks("graph_bf16", tmp_path)
    _assert_close_to_reference(ranks)
    assert "fsdp_unshard_model_blocks_1 = " in ranks[0]["code"]
    assert all(r["skipped"] == 0 for r in ranks)


def test_graph_fsdp2_gradient_accumulation_matches_autocast(tmp_path: Path) -> None:
    ranks = run_ranks("graph_bf16_accumulation", tmp_path)
    _assert_close_to_reference(ranks)
    # the parameter casts stay inside the units' calls (no low_precision_weights input)
    assert "low_precision_weights" not in ranks[0]["code"]


def test_compile_fsdp2_fp16_scaler_skips_a_step_poisoned_on_one_rank(tmp_path: Path) -> None:
    ranks = run_ranks("compile_fp16_scaler", tmp_path)
    for result in ranks:
        ours, theirs = result["ours"], result["theirs"]
        assert ours["taken"] == [step != POISONED_STEP for step in range(STEPS)]
        assert ours["taken"] == theirs["taken"] and ours["scale"] == theirs["scale"]
        for name, value in ours["params"].items():
            torch.testing.assert_close(value, theirs["params"][name], rtol=0, atol=1e-6)
    for name, value in ranks[0]["ours"]["params"].items():
        assert torch.equal(value, ranks[1]["ours"]["params"][name]), name


def test_ddp_of_compiled_module_matches_ddp_autocast(tmp_path: Path) -> None:
    """(with the weights' casts recomputed in backward, not kept)"""
    ranks = run_ranks("ddp_compile", tmp_path)
    _assert_close_to_reference(ranks)
    assert all(rank["recomputed"] > 0 for rank in ranks)


def test_fsdp2_refusals_say_what_to_do_and_leave_fsdp_as_it_was(tmp_path: Path) -> None:
    for result in run_ranks("refusals", tmp_path):
        assert "already are the masters" in result["masters"]
        assert (
            "casts nothing (O0), but the FSDP2 units '<root>', 'blocks.0', 'blocks.1'"
            in result["o0_uncast"]
            and "cast_forward_inputs=False" in result["o0_uncast"]
        )
        assert result["o0_casting"] == (True, True)  # FSDP2's own casts, honoured
        assert "branches on the values inside a tensor" in result["failed"]
        assert result["hooks_kept"] and result["resharded"] and result["grads"]
        assert result["pinned"]


def test_fsdp2_checkpoint_per_block_kept_and_spanning_refused(tmp_path: Path) -> None:
    ranks = run_ranks("checkpoints", tmp_path)
    _assert_close_to_reference(ranks)
    code = ranks[0]["code"]
    assert code.count("torch.utils.checkpoint.checkpoint(") == 2
    assert "spans the FSDP2 units 'blocks.0', 'blocks.1'" in ranks[0]["spanning"]


if __name__ == "__main__":  # pragma: no cover
    pytest.main([__file__, "-q"])


def test_fsdp2_holds_for_backward_what_its_own_mixed_precision_holds(tmp_path: Path) -> None:
    """Issue 24: the casts of each unit's unsharded parameters are not kept from forward to
    backward (each unit's backward casts its all-gathered parameters again), so a rank holds
    no more than 2x what ``MixedPrecisionPolicy(param_dtype=bf16)`` holds, far below
    torch.autocast's (the whole model in bf16); and the gradients are the same bits as with
    the casts kept."""
    for rank in run_ranks("held_bytes", tmp_path):
        for name, held in rank.items():
            assert held["casts_recomputed"] > 0, name
            assert held["same_grads"], name
            assert held["amp_graph"] <= 2 * held["fsdp_mixed_precision"], (name, held)
            assert held["amp_graph"] < held["amp_graph_keeping_casts"], (name, held)
            assert held["amp_graph"] < held["autocast"], (name, held)


def test_a_users_mixed_precision_policy_is_honoured(tmp_path: Path) -> None:
    """MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) on every unit: the graph
    trains as the same sharded model does eagerly under torch.autocast, all-gathers half the
    float32 bytes, reduce-scatters in float32, and report says what the policy means."""
    ranks = run_ranks("mixed_precision", tmp_path)
    _assert_close_to_reference(ranks)
    for rank in ranks:
        assert "FSDP2 MixedPrecisionPolicy honoured" in rank["report"]
        # the plan reads the parameters as gathered (bf16): nothing casts them to bf16
        honoured, plain = rank["parameter_casts"]
        assert honoured == 0 < plain
        assert rank["read_low"] == []  # TinyLM's blocks hold LayerNorms: kept exact
        assert "param_dtype=bf16" in rank["report"]
        comm = rank["comm"]
        low, full = comm["amp_graph, param_dtype=bf16"], comm["amp_graph"]
        assert low == comm["autocast, param_dtype=bf16"] and full == comm["autocast"]
        assert low[0] * 2 == full[0] and low[1] == full[1] > 0  # half gathered; fp32 reduced


def test_report_names_units_read_only_in_low_precision_and_their_policy_changes_no_value(
    tmp_path: Path,
) -> None:
    for rank in run_ranks("read_low", tmp_path):
        plain, proposed = rank["plain"], rank["proposed"]
        assert plain["read_low"] == ["blocks.0", "blocks.1"]
        assert "MixedPrecisionPolicy(param_dtype=torch.bfloat16" in plain["totals"]
        assert proposed["read_low"] == []  # honoured now, not proposed again
        for name, value in plain["params"].items():
            assert torch.equal(value, proposed["params"][name]), name
        assert proposed["all_gather"] * 2 == plain["all_gather"]


def test_models_sharded_as_plan_fsdp_plans_train_the_same_bits_at_half_the_all_gather(
    tmp_path: Path,
) -> None:
    """Issue 24: "FSDP2 should all-gather parameters in the low dtype where the policy
    permits". Residual MLP blocks (read only low: their own units gather bf16) and
    Llama-style layers (each mixes RMSNorms read in float32 with linears: the layer keeps
    its norms in float32, its attention and MLP linears gather bf16 as the units the plan
    names): the same bits as float32 all-gathers through compile and Graph, at <= 0.55 of
    their all-gather bytes, reduce-scatters in float32 (the bytes of float32 gradients)."""
    for rank in run_ranks("planned", tmp_path):
        for name, per in rank.items():
            plain, planned = per["plain"], per["planned"]
            for key in ("params", "graph_params"):
                for param, value in plain[key].items():
                    assert torch.equal(value, planned[key][param]), (name, key, param)
            assert plain["graph_losses"] == planned["graph_losses"], name
            ratio = planned["all_gather"] / plain["all_gather"]
            assert ratio <= 0.55, (name, ratio)
            assert abs(ratio - planned["planned_ratio"]) < 0.02, (name, ratio, planned)
            assert "FSDP2 MixedPrecisionPolicy honoured" in planned["report"], name
            assert "plans a model before fully_shard" in planned["sharded_refused"]
            # compiled as planned: no warning; with block 0 pinned to float32 its low-gathered
            # parameters are read in float32 (rounded by the all-gather): a warning names them
            [warned] = planned["warned"]
            assert "for O1, bf16" in warned and "blocks.0." in warned, warned


def test_hf_llama_sharded_as_planned_trains_the_same_bits_with_its_linears_gathered_low(
    tmp_path: Path,
) -> None:
    """HF Llama's decoder layers mix RMSNorms (read in float32 under O1) with linears: each
    layer keeps its norms in a float32 unit, its attention and MLP gather bf16 as units of
    their own, and so does the head; the root keeps the embedding (read in float32) and
    the final norm. The same bits as float32 all-gathers, with the all-gather bytes the plan
    says (0.58x here, where the embedding is a large part of a tiny model)."""
    pytest.importorskip("transformers")
    for rank in run_ranks("planned_hf_llama", tmp_path):
        plain, planned = rank["plain"], rank["planned"]
        assert plain["losses"] == planned["losses"]
        for name, value in plain["params"].items():
            assert torch.equal(value, planned["params"][name]), name
        ratio = planned["all_gather"] / plain["all_gather"]
        assert abs(ratio - rank["planned_ratio"]) < 0.02 and ratio < 0.6, ratio
        plan = rank["plan"]
        assert "model.layers.0.self_attn: 4 parameters, all-gather bf16" in plan
        assert "model.layers.0.mlp: 3 parameters, all-gather bf16" in plan
        assert "lm_head: 1 parameter, all-gather bf16" in plan
        assert "read in float32: model.embed_tokens.weight, model.norm.weight" in plan
