"""amp_graph on tensor-parallel models (``torch.distributed.tensor.parallel``), gloo ranks on
the CPU: 2 ranks for 1-D tensor parallelism, 4 for FSDP2 x tensor parallelism (2-D).

The oracle is the same parallelized model run eagerly under ``torch.autocast``, from the
same initialization and data. The models are written as people write them: an MLP split
column-then-row (Megatron's), and a torchtitan-style LM whose norms are sequence parallel,
whose attention and MLP inputs are prepared by ``PrepareModuleInput``, and whose head feeds
``loss_parallel``.

What must hold, and why it can fail:

* DTensor's own autograd Functions (``from_local``, ``redistribute``, ``to_local``) are
  graph nodes that call them (``amp_graph.capture.autograd_functions``). Inlined, their
  collectives would be raw ``all_reduce`` nodes without a derivative: the gradients of every
  layer below a row-parallel layer would be wrong.
* The MLP computes bit for bit what torch.autocast computes, forward and gradients: the
  same aten ops at the same dtypes on the same shards. The LM's loss is bit for bit
  equal too; its gradients differ from autocast's by bf16 rounding only (atol 2e-3; measured
  2e-4), because amp_graph casts an input read by three projections once, and autograd
  then sums their gradients in bf16, where autocast casts it three times. The unsharded LM
  shows the same differences; a dropped gradient or a float32 op is far above it.
* Each op computes at the dtype the policy gives it on one process: the sharded graph's
  (op, compute dtype) pairs equal those of the same model captured unsharded.
* A float16 step whose gradient overflows on one rank's shard only is skipped by every
  rank: the scaler agrees over the DTensor gradients' mesh, both dimensions of it in 2-D.
* What the forward holds for backward per rank is at most what torch.autocast holds.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from dist_helpers import spawn_scenario
from parallel_lm import LM, full, lm_batches, parallel_lm

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch built without distributed")

LR = 0.5  # SGD: a parameter moves by LR x its gradient, so a wrong gradient shows


def _tp_mesh(two_d: bool = False) -> tuple[Any, Any]:
    """(the tensor-parallel mesh, the data-parallel one or None)."""
    from torch.distributed.device_mesh import init_device_mesh

    if two_d:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        return mesh["tp"], mesh["dp"]
    return init_device_mesh("cpu", (dist.get_world_size(),)), None


def parallel_mlp(mesh: Any) -> nn.Module:
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    torch.manual_seed(0)  # the same full parameters on every rank before sharding
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16))
    return parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})


def lm_loss(logits: torch.Tensor, target: torch.Tensor, parallel: bool = False) -> torch.Tensor:
    from torch.distributed.tensor.parallel import loss_parallel

    with loss_parallel() if parallel else contextlib.nullcontext():
        loss = F.cross_entropy(logits.flatten(0, 1).float(), target.flatten())
        loss.backward()  # loss_parallel: the backward too must run inside its context
    return loss


def op_dtypes(gm: Any, casts: bool = True) -> Counter:
    """(aten op, compute dtype) of every op node the passes planned, DTensor's conversions
    left out; ``casts=False``: the inserted casts too (the backend writes them as ``to``,
    compile as ``_to_copy`` or, recomputed, ``recomputed_cast``)."""
    from amp_graph.passes import AMP, Role

    from amp_graph.capture.autograd_functions import is_function_call

    pairs: Counter = Counter()
    for node in gm.graph.nodes:
        amp = node.meta.get(AMP)
        if node.op != "call_function" or amp is None or is_function_call(node):
            continue
        if casts or amp.role is not Role.CAST:
            pairs[(str(node.target), str(amp.compute_dtype))] += 1
    return pairs


def _casts(gm: Any) -> int:
    from amp_graph.passes import AMP, Role

    return sum(
        n.meta.get(AMP) is not None and n.meta[AMP].role is Role.CAST for n in gm.graph.nodes
    )


# ---- scenarios: each runs on every rank and returns what it measured ----


def _mlp_against_autocast(
    mesh: Any, model: nn.Module, compiled: nn.Module, x: torch.Tensor
) -> dict[str, Any]:
    """``compiled`` (of ``model``) called on ``x`` and differentiated, beside a fresh parallel
    MLP under torch.autocast: outputs, full gradients and the graph's code."""
    from amp_graph.frontends.compiler import as_graph_module

    out = compiled(x)
    out.float().square().sum().backward()
    reference = parallel_mlp(mesh)
    with torch.autocast("cpu", torch.bfloat16):
        ref = reference(x)
    ref.float().square().sum().backward()
    return {
        "out": out.detach(),
        "ref": ref.detach(),
        "grads": full(model, grads=True),
        "ref_grads": full(reference, grads=True),
        "code": as_graph_module(compiled).code,
    }


def mlp_exact(rank: int) -> dict[str, Any]:
    import amp_graph

    mesh, _ = _tp_mesh()
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    results = {}
    for entry, policy in (("compile", "autocast"), ("compile", "O1"), ("compile_", "O1")):
        model = parallel_mlp(mesh)
        if entry == "compile":
            compiled = amp_graph.compile(model, policy, torch.bfloat16)
        else:  # in place: the model itself runs the graph
            compiled = amp_graph.compile_(model, policy, torch.bfloat16)
        results[f"{entry} {policy}"] = _mlp_against_autocast(mesh, model, compiled, x)
    return results


def mlp_new_size(rank: int) -> dict[str, Any]:
    """Called at batch 8, then at batch 5: the second capture has symbolic sizes (the plan
    casts DTensors of symbolic shape). Output and gradients of the batch-5 call."""
    import amp_graph

    mesh, _ = _tp_mesh()
    gen = torch.Generator().manual_seed(1)
    first, x = torch.randn(8, 16, generator=gen), torch.randn(5, 16, generator=gen)
    results = {}
    for policy in ("O1", "autocast"):
        model = parallel_mlp(mesh)
        compiled = amp_graph.compile(model, policy, torch.bfloat16)
        compiled(first)
        results[f"compile {policy}"] = _mlp_against_autocast(mesh, model, compiled, x)
    return results


def graph_o2_refused(rank: int) -> dict[str, Any]:
    """A Graph under O2 (float32 master weights) over DTensor parameters: refused before
    any parameter changes."""
    import amp_graph

    mesh, _ = _tp_mesh()
    model = parallel_mlp(mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    class Step(amp_graph.Graph):
        def __init__(self) -> None:
            super().__init__()
            self.model = model
            self.add_optimizer(opt)
            self.config.enable_amp(True, policy="O2", dtype=torch.bfloat16)

        def build(self, x: torch.Tensor) -> torch.Tensor:
            loss = self.model(x).float().square().mean()
            loss.backward()
            return loss

    try:
        Step()(torch.randn(8, 16))
        error = ""
    except ValueError as refused:
        error = str(refused)
    dtypes = {(p.dtype, p.to_local().dtype) for p in model.parameters()}
    return {"error": error, "dtypes": dtypes}


def lm_compile(rank: int, loss_parallel: bool = False) -> dict[str, Any]:
    import amp_graph

    mesh, _ = _tp_mesh()
    idx, target = lm_batches(0)[0]
    model = parallel_lm(mesh, loss_parallel)
    compiled = amp_graph.compile(model, "O1", torch.bfloat16)
    logits = compiled(idx)
    loss = lm_loss(logits, target, loss_parallel)
    reference = parallel_lm(mesh, loss_parallel)
    with torch.autocast("cpu", torch.bfloat16):
        ref_logits = reference(idx)
    ref_loss = lm_loss(ref_logits, target, loss_parallel)
    torch.manual_seed(0)
    unsharded = amp_graph.compile(LM(), "O1", torch.bfloat16)
    unsharded(idx)
    return {
        "logits_type": type(logits).__name__,
        "logits_dtype": logits.dtype,
        "loss": loss.item(),
        "ref_loss": ref_loss.item(),
        "grads": full(model, grads=True),
        "ref_grads": full(reference, grads=True),
        "op_dtypes": op_dtypes(compiled.graph_module),
        "unsharded_op_dtypes": op_dtypes(unsharded.graph_module),
    }


def _sgd_autocast(model: nn.Module, data: list, dtype: torch.dtype) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for idx, target in data:
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype):
            logits = model(idx)
        losses.append(lm_loss(logits, target).item())
        opt.step()
    return losses


def _graph_step(model: nn.Module, policy: str) -> Any:
    import amp_graph

    opt = torch.optim.SGD(model.parameters(), lr=LR)

    class TrainStep(amp_graph.Graph):
        def __init__(self) -> None:
            super().__init__()
            self.model = model
            self.add_optimizer(opt)
            self.config.enable_amp(True, policy=policy, dtype=torch.bfloat16)

        def build(self, idx: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            return lm_loss(self.model(idx), target)

    return TrainStep()


def graph_training(rank: int, two_d: bool = False) -> dict[str, Any]:
    mesh, dp_mesh = _tp_mesh(two_d)
    data = lm_batches(dp_mesh.get_local_rank() if two_d else 0)  # each dp group its own
    model = parallel_lm(mesh, dp_mesh=dp_mesh)
    step = _graph_step(model, "O1")
    losses = [step(idx, target).item() for idx, target in data]
    reference = parallel_lm(mesh, dp_mesh=dp_mesh)
    return {
        "losses": losses,
        "ref_losses": _sgd_autocast(reference, data, torch.bfloat16),
        "params": full(model),
        "ref_params": full(reference),
        "grad_meshes": sorted({p.grad.device_mesh.ndim for p in model.parameters()}),
        "code": step.build_graph.code,
    }


POISONED_STEP = 1


def fp16_skip(rank: int, two_d: bool = False) -> dict[str, Any]:
    """float16 under amp_graph.GradScaler; the last rank's shard of one column-parallel
    weight's gradient is inf at POISONED_STEP: every rank must skip that step."""
    import amp_graph
    from amp_graph.scaler import GradScaler

    mesh, dp_mesh = _tp_mesh(two_d)
    model = parallel_lm(mesh, dp_mesh=dp_mesh)
    compiled = amp_graph.compile(model, "O1", torch.float16)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    scaler = GradScaler(init_scale=2.0**10)
    taken = []
    data = lm_batches(dp_mesh.get_local_rank() if two_d else 0)
    for step, (idx, target) in enumerate(data):
        opt.zero_grad(set_to_none=True)
        logits = compiled(idx)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), target.flatten())
        scaler.scale(loss).backward()
        if step == POISONED_STEP and rank == dist.get_world_size() - 1:
            model.layers[0].attention.wq.weight.grad.to_local()[0, 0] = float("inf")
        scaler.step(opt)
        scaler.update()
        taken.append(bool(scaler.last_step_taken))
    return {"taken": taken, "params": full(model), "scale": scaler.get_scale()}


def held_bytes(rank: int) -> dict[str, int]:
    import amp_graph
    from amp_graph.inspect.held import held_for_backward

    mesh, _ = _tp_mesh()
    idx, _ = lm_batches(0)[0]
    held = {}
    for name in ("amp_graph", "autocast"):
        model = parallel_lm(mesh)
        run = amp_graph.compile(model, "O1", torch.bfloat16) if name == "amp_graph" else model
        run(idx)  # the capture (and autocast's first call) outside the count
        with torch.autocast("cpu", torch.bfloat16, enabled=name == "autocast"):
            kept, out = held_for_backward(lambda m=run: m(idx), [*model.parameters()])
        out.float().sum().backward()
        held[name] = kept
    return held


def backend_mlp(rank: int) -> dict[str, Any]:
    """The MLP through torch.compile(backend=amp_graph.backend(...)), each inner backend."""
    import amp_graph

    mesh, _ = _tp_mesh()
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    results = {}
    for inner in ("eager", "aot_eager", "inductor"):
        model = parallel_mlp(mesh)
        backend = amp_graph.backend("autocast", torch.bfloat16, inner=inner)
        out = torch.compile(model, backend=backend)(x)
        out.float().square().sum().backward()
        reference = parallel_mlp(mesh)
        with torch.autocast("cpu", torch.bfloat16):
            ref = reference(x)
        ref.float().square().sum().backward()
        [gm] = backend.graphs
        results[inner] = {
            "out": out.detach(),
            "ref": ref.detach(),
            "grads": full(model, grads=True),
            "ref_grads": full(reference, grads=True),
            "code": gm.code,
        }
        torch._dynamo.reset()
    return results


def backend_lm(rank: int) -> dict[str, Any]:
    """The LM through the backend (O1, AOTAutograd), against autocast and compile."""
    import amp_graph

    mesh, _ = _tp_mesh()
    idx, target = lm_batches(0)[0]
    model = parallel_lm(mesh)
    backend = amp_graph.backend("O1", torch.bfloat16, inner="aot_eager")
    loss = lm_loss(torch.compile(model, backend=backend)(idx), target)
    reference = parallel_lm(mesh)
    with torch.autocast("cpu", torch.bfloat16):
        ref_logits = reference(idx)
    ref_loss = lm_loss(ref_logits, target)
    compiled = amp_graph.compile(parallel_lm(mesh), "O1", torch.bfloat16)
    compiled(idx)
    return {
        "loss": loss.item(),
        "ref_loss": ref_loss.item(),
        "grads": full(model, grads=True),
        "ref_grads": full(reference, grads=True),
        "op_dtypes": sum((op_dtypes(gm, casts=False) for gm in backend.graphs), Counter()),
        "compile_op_dtypes": op_dtypes(compiled.graph_module, casts=False),
        "casts": sum(_casts(gm) for gm in backend.graphs),
        "graphs": len(backend.graphs),
    }


def vocab_parallel_lm(rank: int) -> dict[str, Any]:
    """The LM with torchtitan's row-parallel embedding (a masked partial output) and with a
    column-parallel one, through compile and the backend, against autocast: loss and the
    embedding's gradient (the mask's backward)."""
    import amp_graph

    mesh, _ = _tp_mesh()
    idx, target = lm_batches(0)[0]
    results: dict[str, Any] = {}
    for vocab_parallel in (True, False):
        reference = parallel_lm(mesh, vocab_parallel=vocab_parallel)
        with torch.autocast("cpu", torch.bfloat16):
            ref_loss = lm_loss(reference(idx), target)  # and its backward
        ref_grad = full(reference, grads=True)["tok_embeddings.weight"]
        entries = {
            "compile": lambda m: amp_graph.compile(m, "autocast", torch.bfloat16),
            "backend": lambda m: torch.compile(
                m, backend=amp_graph.backend("autocast", torch.bfloat16, inner="eager")
            ),
        }
        for entry, make in entries.items():
            model = parallel_lm(mesh, vocab_parallel=vocab_parallel)
            with (
                torch.autocast("cpu", torch.bfloat16)
                if entry == "backend"
                else contextlib.nullcontext()
            ):
                loss = lm_loss(make(model)(idx), target)
            results[f"{entry}, {'row' if vocab_parallel else 'column'}-parallel"] = {
                "loss": loss.item(),
                "ref_loss": ref_loss.item(),
                "grad": full(model, grads=True)["tok_embeddings.weight"],
                "ref_grad": ref_grad,
                "row_placement": str(model.tok_embeddings.weight.placements),
            }
    return results


SCENARIOS = {
    "vocab_parallel_lm": vocab_parallel_lm,
    "mlp_exact": mlp_exact,
    "mlp_new_size": mlp_new_size,
    "graph_o2_refused": graph_o2_refused,
    "lm_compile": lm_compile,
    "lm_compile_loss_parallel": lambda rank: lm_compile(rank, loss_parallel=True),
    "graph_training": graph_training,
    "graph_training_2d": lambda rank: graph_training(rank, two_d=True),
    "fp16_skip": fp16_skip,
    "fp16_skip_2d": lambda rank: fp16_skip(rank, two_d=True),
    "held_bytes": held_bytes,
    "backend_mlp": backend_mlp,
    "backend_lm": backend_lm,
}


def run(scenario: str, tmp_path: Path, world: int = 2) -> list[Any]:
    return spawn_scenario(__name__, scenario, tmp_path, world)


# ---- the tests ----


def _assert_mlp_as_autocast(results: dict[str, dict[str, Any]]) -> None:
    """Per variant (entry point and policy, or inner backend): the MLP's output and every
    gradient bit for bit autocast's, DTensor's conversions kept whole in its graph."""
    for variant, result in results.items():
        assert result["out"].dtype == result["ref"].dtype == torch.bfloat16, variant
        assert torch.equal(result["out"], result["ref"]), variant
        for name, grad in result["grads"].items():
            assert torch.equal(grad, result["ref_grads"][name]), (variant, name)
        # DTensor's conversions are kept whole: their backward redistributes gradients
        for function in ("dtensor_from_local", "dtensor_redistribute", "dtensor_to_local"):
            assert function in result["code"], (variant, function)
        assert "all_reduce" not in result["code"], variant


def test_column_then_row_parallel_mlp_equals_autocast_bit_for_bit(tmp_path: Path) -> None:
    for rank in run("mlp_exact", tmp_path):
        _assert_mlp_as_autocast(rank)


def test_a_new_batch_size_captures_with_symbolic_sizes_as_autocast(tmp_path: Path) -> None:
    for rank in run("mlp_new_size", tmp_path):
        _assert_mlp_as_autocast(rank)


def test_graph_master_weights_of_dtensor_parameters_are_refused(tmp_path: Path) -> None:
    for rank in run("graph_o2_refused", tmp_path):
        assert "cannot be made of the tensor-parallel (DTensor) parameters" in rank["error"]
        assert "master_weights=False" in rank["error"]
        assert rank["dtypes"] == {(torch.float32, torch.float32)}  # nothing was changed


@pytest.mark.parametrize("scenario", ["lm_compile", "lm_compile_loss_parallel"])
def test_sequence_parallel_lm_computes_each_op_as_unsharded_and_matches_autocast(
    tmp_path: Path, scenario: str
) -> None:
    ranks = run(scenario, tmp_path)
    for result in ranks:
        # loss_parallel keeps the logits sharded along the vocabulary: a DTensor
        expected = "DTensor" if scenario.endswith("loss_parallel") else "Tensor"
        assert result["logits_type"] == expected
        assert result["logits_dtype"] == torch.bfloat16
        assert result["loss"] == result["ref_loss"]
        assert result["op_dtypes"] == result["unsharded_op_dtypes"]
        assert result["grads"].keys() == result["ref_grads"].keys()
        for name, grad in result["grads"].items():
            torch.testing.assert_close(grad, result["ref_grads"][name], rtol=0, atol=2e-3)
            assert grad.abs().max() > 0, name  # every layer gets a gradient
    for name, grad in ranks[0]["grads"].items():  # one model: the ranks agree exactly
        assert torch.equal(grad, ranks[1]["grads"][name]), name


@pytest.mark.parametrize("scenario, world", [("graph_training", 2), ("graph_training_2d", 4)])
def test_graph_trains_tensor_parallel_lm_as_autocast(
    tmp_path: Path, scenario: str, world: int
) -> None:
    ranks = run(scenario, tmp_path, world)
    for result in ranks:
        assert result["losses"][0] == result["ref_losses"][0]
        torch.testing.assert_close(
            torch.tensor(result["losses"]), torch.tensor(result["ref_losses"]), rtol=1e-3, atol=0
        )
        for name, value in result["params"].items():
            torch.testing.assert_close(value, result["ref_params"][name], rtol=0, atol=2e-3)
        # 2-D: the gradients are DTensors over both mesh dimensions
        assert result["grad_meshes"] == ([2] if world == 4 else [1])
        assert "dtensor_redistribute" in result["code"]
    for other in ranks[1:]:
        for name, value in ranks[0]["params"].items():
            assert torch.equal(value, other["params"][name]), name


@pytest.mark.parametrize("scenario, world", [("fp16_skip", 2), ("fp16_skip_2d", 4)])
def test_fp16_overflow_on_one_shard_skips_the_step_on_every_rank(
    tmp_path: Path, scenario: str, world: int
) -> None:
    ranks = run(scenario, tmp_path, world)
    for result in ranks:
        assert result["taken"] == [True, False, True]
        assert result["scale"] == 2.0**9  # halved once, by the one skip
        assert all(torch.isfinite(p).all() for p in result["params"].values())
    for other in ranks[1:]:
        for name, value in ranks[0]["params"].items():
            assert torch.equal(value, other["params"][name]), name


def test_held_for_backward_per_rank_at_most_autocast(tmp_path: Path) -> None:
    for held in run("held_bytes", tmp_path):
        assert 0 < held["amp_graph"] <= held["autocast"], held


def test_backend_rewrites_the_mlp_as_autocast_computes_it_bit_for_bit(tmp_path: Path) -> None:
    """dynamo's graph is exported on its fake DTensors, DTensor's conversions kept whole; the
    inner backends (eager, AOTAutograd, inductor) run it and differentiate through them."""
    for rank in run("backend_mlp", tmp_path):
        _assert_mlp_as_autocast(rank)


def test_backend_trains_the_sequence_parallel_lm_as_compile_does(tmp_path: Path) -> None:
    for result in run("backend_lm", tmp_path):
        assert result["graphs"] == 1
        assert result["loss"] == result["ref_loss"]
        assert result["op_dtypes"] == result["compile_op_dtypes"]  # every op, as compile
        assert result["casts"] > 0  # the casts are there, left to AOTAutograd's partitioner
        for name, grad in result["grads"].items():
            torch.testing.assert_close(grad, result["ref_grads"][name], rtol=0, atol=2e-3)
            assert grad.abs().max() > 0, name


def test_vocabulary_parallel_embedding_equals_autocast(tmp_path: Path) -> None:
    """torchtitan's row-parallel embedding: its masked partial output keeps its mask through
    the capture (on torch 2.15 the tracer's snapshot of it used to consume the mask, and the
    capture failed: amp_graph/capture/masked_partials.py). Loss and the embedding's gradient
    autocast's (the loss bit for bit), through compile and the backend, as with a
    column-parallel one."""
    for rank in run("vocab_parallel_lm", tmp_path):
        assert len(rank) == 4
        for variant, result in rank.items():
            assert result["loss"] == result["ref_loss"], variant
            # the embedding's gradient sums what every layer gives it: within bf16 rounding
            # of autocast's, as the other LM tests' gradients (a cast three projections share)
            torch.testing.assert_close(result["grad"], result["ref_grad"], atol=2e-3, rtol=0)
            shard = "Shard(dim=0)" if variant.endswith("row-parallel") else "Shard(dim=1)"
            assert shard in result["row_placement"], (variant, result["row_placement"])
