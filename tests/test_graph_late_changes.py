"""What a :class:`amp_graph.Graph` does with changes made after its first call.

Config: clipping, accumulation steps and the process group may change between calls (the
step graphs are built again around the same captures; under CUDA graphs captured again);
AMP and torch.compile may not (the setter raises), nor may optimizers or the scaler be
added. O2: writes to the model's low-precision parameters between steps
(``model.load_state_dict``, an in-place re-initialization) reach the float32 masters
before the next step, with the optimizer's state kept; a parameter replaced on its module
is refused. Oracles: eager torch.autocast training, and the Graph's own ``load_state_dict``.
"""

from __future__ import annotations

import copy
from typing import Any, ClassVar

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils import _pytree as pytree
from zoo import GPTConfig, NanoGPT

import amp_graph

BF16 = torch.bfloat16


class Step(amp_graph.Graph):
    """One training step: cross-entropy of the model's float32 logits."""

    def __init__(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, policy: str = "autocast"
    ) -> None:
        super().__init__()
        self.model = model
        self.add_optimizer(optimizer)
        self.config.enable_amp(True, policy=policy, dtype=BF16)

    def build(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.cross_entropy(self.model(x).float(), y)
        loss.backward()
        return loss


class GPTStep(Step):
    """nanoGPT's training step: the model computes its own loss."""

    def build(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        _, loss = self.model(idx, targets)
        loss.backward()
        return loss


def mlp(batch_norm: bool = False) -> nn.Sequential:
    torch.manual_seed(0)
    norm = [nn.BatchNorm1d(32)] if batch_norm else []
    return nn.Sequential(nn.Linear(16, 32), *norm, nn.ReLU(), nn.Linear(32, 4))


def data(steps: int, rows: int = 16) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [
        (torch.randn(rows, 16, generator=gen), torch.randint(0, 4, (rows,), generator=gen))
        for _ in range(steps)
    ]


def eager_step(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    x: torch.Tensor,
    y: torch.Tensor,
    clip: float | None = None,
    micro: int = 1,
) -> None:
    """The oracle: the same step written by hand under torch.autocast."""
    opt.zero_grad(set_to_none=True)
    for xs, ys in zip(x.chunk(micro), y.chunk(micro), strict=True):
        with torch.autocast("cpu", dtype=BF16):
            loss = F.cross_entropy(model(xs).float(), ys)
        (loss if micro == 1 else loss / micro).backward()
    if clip is not None:
        nn.utils.clip_grad_norm_(model.parameters(), clip)
    opt.step()


def assert_same_state(a: nn.Module, b: nn.Module) -> None:
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(x, y), name


# ---- config ------------------------------------------------------------------------------


def test_clipping_changed_between_calls_takes_effect() -> None:
    model, ref = mlp(), mlp()
    g = Step(model, torch.optim.SGD(model.parameters(), lr=0.1))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for (x, y), clip in zip(data(4), (None, 1e-3, 0.5, None), strict=True):
        g.config.set_gradient_clipping(clip)
        g(x, y)
        eager_step(ref, ref_opt, x, y, clip=clip)
        assert_same_state(model, ref)


def test_accumulation_steps_changed_between_calls_take_effect() -> None:
    # batch norm makes the number of micro-batches visible in every weight and statistic.
    # Micro-batches of 8 and 4 rows share one capture with symbolic sizes, whose weight
    # casts the first accumulating step hoisted: the last step runs it on one batch of 8
    model, ref = mlp(batch_norm=True), mlp(batch_norm=True)
    g = Step(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    batches = [*data(5), data(1, rows=8)[0]]
    for (x, y), micro in zip(batches, (1, 2, 4, 2, 1, 1), strict=True):
        g.config.set_gradient_accumulation_steps(micro)
        g(x, y)
        eager_step(ref, ref_opt, x, y, micro=micro)
        assert_same_state(model, ref)
        assert len([n for n in g.step_graph.graph.nodes if n.op == "call_module"]) == micro


def test_amp_and_compile_changed_after_the_first_call_raise() -> None:
    model = mlp()
    g = Step(model, torch.optim.SGD(model.parameters(), lr=0.1))
    g(*data(1)[0])
    g.config.enable_amp(True, policy="autocast", dtype=BF16)  # the same: nothing changes
    with pytest.raises(RuntimeError, match=r"config\.enable_amp\(mode=False.*before the first"):
        g.config.enable_amp(False)
    with pytest.raises(RuntimeError, match=r"config\.enable_compile.*new Graph"):
        g.config.enable_compile()
    assert g.config.amp and not g.config.compile  # refused, not half set


def test_amp_changed_after_a_failed_first_call_takes_effect() -> None:
    # the first call captures build, then refuses the CUDA graph (a CPU model); turning
    # the graph off and AMP off, as the user may before a step was taken, captures again
    model, ref = mlp(), mlp()
    g = Step(model, torch.optim.SGD(model.parameters(), lr=0.1))
    g.config.enable_cuda_graph(True)
    x, y = data(1)[0]
    with pytest.raises(amp_graph.training.cuda_graph_step.CudaGraphError):
        g(x, y)
    g.config.enable_cuda_graph(False)
    g.config.enable_amp(False)
    g(x, y)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    ref_opt.zero_grad()
    F.cross_entropy(ref(x), y).backward()  # float32, no autocast
    ref_opt.step()
    assert_same_state(model, ref)


def test_optimizer_and_scaler_added_after_the_first_call_raise() -> None:
    model = mlp()
    g = Step(model, torch.optim.SGD(model.parameters(), lr=0.1))
    g.set_grad_scaler(amp_graph.GradScaler())  # before the first call: fine
    g(*data(1)[0])
    g.set_grad_scaler(g._scaler)  # the same scaler again: nothing changes
    with pytest.raises(RuntimeError, match=r"Step\.add_optimizer after the first call"):
        g.add_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(RuntimeError, match=r"set_grad_scaler after the first call"):
        g.set_grad_scaler(amp_graph.GradScaler())
    assert len(g.optimizers) == 1


# ---- config under CUDA graphs (a stand-in for the capture: the CPU has none) --------------


class Rerun:
    """Stands in for CudaGraphCapture: a capture records the step, a replay reruns it."""

    def check_devices(self, named: Any) -> None:
        pass

    def warmup(self, fn: Any) -> Any:
        return fn()

    def capture(self, fn: Any) -> list:
        return [fn, None]

    def replay(self, captured: list) -> Any:
        fn, outputs = captured
        fresh = fn()
        if outputs is None:
            captured[1] = fresh
        else:  # a graph's outputs live at fixed addresses: each replay overwrites them
            for old, new in zip(pytree.tree_leaves(outputs), pytree.tree_leaves(fresh)):  # noqa: B905
                old.detach().copy_(new)
        return captured[1]

    def release(self) -> None:
        pass


class CapturedStep(Step):
    _step_capture = Rerun


def fused_sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=torch.tensor(0.1), fused=True)


def test_clipping_changed_under_cuda_graphs_captures_again() -> None:
    model, ref = mlp(), mlp()
    g = CapturedStep(model, fused_sgd(model))
    g.config.enable_cuda_graph(True, warmup_steps=1)
    ref_opt = fused_sgd(ref)
    for i, (x, y) in enumerate(data(6)):
        clip = 1e-3 if i >= 3 else None  # set after the capture (step 2), replayed since
        g.config.set_gradient_clipping(clip)
        g(x, y)
        eager_step(ref, ref_opt, x, y, clip=clip)
        assert_same_state(model, ref)
    assert g._builder.replayer.captures == 2


def test_cuda_graph_options_changed_after_the_first_call_raise() -> None:
    model = mlp()
    g = CapturedStep(model, fused_sgd(model))
    g.config.enable_cuda_graph(True, warmup_steps=1)
    g(*data(1)[0])
    g.config.enable_cuda_graph(True, warmup_steps=1, set_to_none=True)
    with pytest.raises(RuntimeError, match="changed after the first call"):
        g(*data(1)[0])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_o2_writes_and_late_clipping_under_real_cuda_graphs() -> None:
    """A replay moves no version counter and runs no Python: a write between replays is
    found by the counters the capture recorded and reaches the master (a fixed address)
    before the replay; a late clipping captures again. Against the same steps uncaptured."""

    def run(captured: bool) -> tuple[Step, list[torch.Tensor]]:
        torch.manual_seed(0)
        model = mlp().cuda()
        lr = torch.tensor(1e-2, device="cuda")
        g = Step(model, torch.optim.AdamW(model.parameters(), lr=lr, fused=True), "O2")
        if captured:
            g.config.enable_cuda_graph(True, warmup_steps=1)
        out = []
        for i, (x, y) in enumerate(data(8)):
            if i == 4:  # replayed since step 2
                with torch.no_grad():
                    nn.init.zeros_(model[2].weight)
            if i == 5:
                g.config.set_gradient_clipping(1e-2)
            out.append(g(x.cuda(), y.cuda()))
            if i == 4:  # one AdamW step from zero moves each element by about lr
                assert model[2].weight.abs().max() < 2e-2
        masters = g.state_dict()["modules"]["model"].values()
        return g, [*out, *model.parameters(), *masters]

    g, got = run(captured=True)
    _, ref = run(captured=False)
    assert g._builder.replayer.captures == 2
    torch.testing.assert_close(got, ref, rtol=0, atol=0)


# ---- O2: writes to the model between steps ------------------------------------------------


def o2_pair(make: Any, graph_cls: type[Step], lr: float) -> tuple[Step, Step]:
    """Two identical O2 Graphs (AdamW, whose moments must survive a write)."""
    graphs = []
    for _ in range(2):
        torch.manual_seed(0)
        model = make()
        graphs.append(graph_cls(model, torch.optim.AdamW(model.parameters(), lr=lr), "O2"))
    return graphs[0], graphs[1]


def new_values(model: nn.Module, keep: str) -> dict[str, torch.Tensor]:
    """A float32 state dict for ``model``: random values, but ``keep``'s own."""
    gen = torch.Generator().manual_seed(7)
    return {
        k: v.float() if k == keep else torch.randn(v.shape, generator=gen) * 0.1
        for k, v in model.state_dict().items()
    }


def through_graph(g: Step, values: dict[str, torch.Tensor]) -> None:
    """The oracle's write: the Graph's own load_state_dict, each master taking the value its
    low-precision copy can hold, but keeping its float32 value where that rounds to it; the
    optimizer's state kept."""
    state = g.state_dict()
    masters = state["modules"]["model"]
    params = g.model.named_parameters(remove_duplicate=False)  # a tied one under each name
    low = {k: p.dtype for k, p in params if p.dtype != torch.float32}
    for key, value in values.items():
        if key not in low:
            masters[key] = value
            continue
        stored, master = value.to(low[key]), masters[key]
        masters[key] = torch.where(stored == master.to(low[key]), master, stored.float())
    g.load_state_dict(state)


def test_o2_model_load_state_dict_between_steps_reaches_the_masters() -> None:
    cfg = GPTConfig(n_layer=1, n_embd=32, block_size=8, vocab_size=64)
    g, ref = o2_pair(lambda: NanoGPT(cfg), GPTStep, lr=1e-2)
    torch.manual_seed(3)
    batches = [(torch.randint(0, 64, (4, 8)), torch.randint(0, 64, (4, 8))) for _ in range(3)]
    g(*batches[0])
    ref(*batches[0])
    keep = "transformer.h.0.mlp.c_fc.weight"
    values = new_values(g.model, keep)
    moments = copy.deepcopy(g.optimizers[0].state_dict()["state"])
    g.model.load_state_dict(values)  # bf16 parameters: the values rounded
    through_graph(ref, values)
    # the Graph's checkpoint says what the model holds, with the unchanged master's bits
    assert_same_state(g.model, ref.model)
    for key, value in g.state_dict()["modules"]["model"].items():
        assert torch.equal(value, ref.state_dict()["modules"]["model"][key]), key
    for x, y in batches[1:]:
        assert torch.equal(g(x, y), ref(x, y))
    assert_same_state(g.model, ref.model)
    after = g.optimizers[0].state_dict()["state"]
    assert all(after[i]["step"] == moments[i]["step"] + 2 for i in moments)  # not reset


def test_o2_in_place_reinitialization_survives_the_next_step() -> None:
    model = mlp()
    g = Step(model, torch.optim.SGD(model.parameters(), lr=0.0), "O2")  # lr 0: nothing moves
    x, y = data(1)[0]
    g(x, y)
    with torch.no_grad():
        nn.init.zeros_(model[2].weight)
        model[0].bias.fill_(0.25)
    g(x, y)
    assert torch.equal(model[2].weight, torch.zeros_like(model[2].weight))
    assert torch.equal(model[0].bias, torch.full_like(model[0].bias, 0.25))
    # the eager oracle: the same weights in float32 under torch.autocast, same logits
    ref = mlp()
    ref.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    with torch.autocast("cpu", dtype=BF16):
        assert torch.equal(ref(x), model(x.to(BF16)))


def test_o2_parameter_replaced_on_its_module_raises() -> None:
    cfg = GPTConfig(n_layer=1, n_embd=32, block_size=8, vocab_size=64)
    model = NanoGPT(cfg)
    g = GPTStep(model, torch.optim.AdamW(model.parameters(), lr=1e-3), "O2")
    batch = (torch.randint(0, 64, (4, 8)), torch.randint(0, 64, (4, 8)))
    g(*batch)
    weight = model.lm_head.weight  # tied to transformer.wte.weight
    model.lm_head.weight = nn.Parameter(weight.detach().float().clone())
    with pytest.raises(RuntimeError, match=r"lm_head\.weight replaced on its module"):
        g(*batch)
    with pytest.raises(RuntimeError, match=r"lm_head\.weight replaced"):
        g.state_dict()
    model.lm_head.weight = weight  # put back: the step runs again
    g(*batch)


def test_o2_data_assigned_between_steps_reaches_the_masters() -> None:
    # param.data = value (float32 or bfloat16) moves no version counter: the new storage is
    # found by its address; the oracle writes the same values with the Graph's
    # load_state_dict
    g, ref = o2_pair(mlp, Step, lr=1e-2)
    batches = data(3)
    g(*batches[0])
    ref(*batches[0])
    gen = torch.Generator().manual_seed(5)
    w0, b2 = torch.randn(32, 16, generator=gen), torch.randn(4, generator=gen)
    address = g.model[0].weight.data_ptr()
    g.model[0].weight.data = w0  # float32
    g.model[2].bias.data = b2.to(BF16)  # the copy's own dtype, new storage
    # the oracle's write: the float32 value whole; the bfloat16 one where it is not the
    # master's rounding (there the master keeps its bits, as a load_state_dict's would)
    state = ref.state_dict()
    masters = state["modules"]["model"]
    masters["0.weight"] = w0
    stored = b2.to(BF16)
    masters["2.bias"] = torch.where(
        stored == masters["2.bias"].to(BF16), masters["2.bias"], stored.float()
    )
    ref.load_state_dict(state)
    for x, y in batches[1:]:
        assert torch.equal(g(x, y), ref(x, y))
    assert_same_state(g.model, ref.model)
    assert g.model[0].weight.dtype == BF16
    assert g.model[0].weight.data_ptr() == address  # the storage the step (a CUDA graph) reads
    masters = ref.state_dict()["modules"]["model"]
    for key, value in g.state_dict()["modules"]["model"].items():
        assert torch.equal(value, masters[key]), key


def test_o2_model_float_between_steps_changes_nothing() -> None:
    # model.float() turns the copies into float32 roundings of the masters: the masters
    # keep their float32 bits and the copies their dtype, as if nothing had been done
    g, ref = o2_pair(mlp, Step, lr=1e-2)
    batches = data(3)
    g(*batches[0])
    ref(*batches[0])
    g.model.float()
    assert g.model[0].weight.dtype == torch.float32
    for x, y in batches[1:]:
        assert torch.equal(g(x, y), ref(x, y))
    assert_same_state(g.model, ref.model)
    assert all(p.dtype == BF16 for p in g.model.parameters())


def test_o2_data_of_another_shape_raises_and_changes_nothing() -> None:
    model = mlp()
    g = Step(model, torch.optim.SGD(model.parameters(), lr=0.1), "O2")
    g(*data(1)[0])
    before = copy.deepcopy(g.state_dict())
    model[0].weight.data = torch.zeros(8, 16)
    with pytest.raises(
        RuntimeError, match=r"model\.0\.weight was given a tensor of shape \(8, 16\)"
    ):
        g(*data(1)[0])
    assert model[0].weight.shape == (32, 16)
    after = g.state_dict()
    for key, value in before["modules"]["model"].items():
        assert torch.equal(value, after["modules"]["model"][key]), key


def test_o2_module_replaced_on_its_parent_raises() -> None:
    model = mlp()
    g = Step(model, torch.optim.SGD(model.parameters(), lr=0.1), "O2")
    g(*data(1)[0])
    head = model[2]
    model[2] = nn.Linear(32, 4)  # float32, no master, not in the optimizer
    with pytest.raises(RuntimeError, match=r"module model\.2 replaced since the last step"):
        g(*data(1)[0])
    model[2] = head  # put back: the step runs again
    g(*data(1)[0])


@pytest.mark.parametrize("policy", ["autocast", "O2"])
def test_param_group_added_after_the_first_call_is_trained(policy: str) -> None:
    # unfreezing a layer: its group, added after the first step, is stepped from the next
    # one (under O2 through its masters). Oracle: the same group present from the start at
    # lr 0 (plain SGD: a step at lr 0 changes nothing), raised to the same lr at that step
    torch.manual_seed(0)
    model = mlp()
    opt = torch.optim.SGD(model[2].parameters(), lr=0.1)
    g = Step(model, opt, policy)
    torch.manual_seed(0)
    model_ref = mlp()
    opt_ref = torch.optim.SGD(model_ref[2].parameters(), lr=0.1)
    opt_ref.add_param_group({"params": list(model_ref[0].parameters()), "lr": 0.0})
    ref = Step(model_ref, opt_ref, policy)
    batches = data(3)
    g(*batches[0])
    ref(*batches[0])
    opt.add_param_group({"params": list(model[0].parameters())})
    opt_ref.param_groups[1]["lr"] = 0.1
    first = model[0].weight.detach().clone()
    for x, y in batches[1:]:
        assert torch.equal(g(x, y), ref(x, y))
    assert not torch.equal(model[0].weight, first)
    assert_same_state(model, model_ref)


def test_module_registered_on_the_graph_after_the_first_call_raises() -> None:
    model = mlp()
    g = Step(model, torch.optim.SGD(model.parameters(), lr=0.1))
    g.model = model  # before the first call, and the same module again: fine
    g(*data(1)[0])
    g.model = model
    with pytest.raises(RuntimeError, match=r"Step\.model = Sequential\(\.\.\.\) after the first"):
        g.model = mlp()
    with pytest.raises(RuntimeError, match=r"Step\.head = Linear\(\.\.\.\) after the first"):
        g.head = nn.Linear(4, 4)
    with pytest.raises(RuntimeError, match=r"Step\.model = NoneType"):
        g.model = None
    assert g.registered_modules == {"model": model}


# ---- under CUDA graphs: a replay reads the addresses and groups its capture saw ----------


class AddressesRerun(Rerun):
    """A stricter stand-in: a replay, like a CUDA graph's, reads the parameters, buffers and
    param groups its capture saw; it refuses to rerun the step where they changed (a real
    replay would read the old storage, and step the old groups)."""

    watched: ClassVar[list[Any]] = []  # the model and optimizer, set by the test

    def _seen(self) -> tuple:
        model, opt = self.watched
        tensors = [*model.parameters(), *model.buffers()]
        groups = [tuple(map(id, g["params"])) for g in opt.param_groups]
        return tuple(map(id, tensors)), tuple(t.data_ptr() for t in tensors), tuple(groups)

    def capture(self, fn: Any) -> list:
        return [fn, None, self._seen()]

    def replay(self, captured: list) -> Any:
        assert self._seen() == captured[2], "a replay would read what its capture saw"
        return super().replay(captured[:2])


class AddressesStep(Step):
    _step_capture = AddressesRerun


@pytest.mark.parametrize("change", ["data", "to", "param_group"])
def test_cuda_graphs_capture_again_after_storage_or_groups_change(change: str) -> None:
    model, ref = mlp(batch_norm=True), mlp(batch_norm=True)
    opt = torch.optim.SGD(model[0].parameters(), lr=torch.tensor(0.1), fused=True)
    ref_opt = torch.optim.SGD(ref[0].parameters(), lr=torch.tensor(0.1), fused=True)
    g = AddressesStep(model, opt)
    AddressesRerun.watched = [model, opt]
    g.config.enable_cuda_graph(True, warmup_steps=1)
    for i, (x, y) in enumerate(data(6)):
        if i == 3:  # after the capture (step 2), replayed since
            for m, o in ((model, opt), (ref, ref_opt)):
                if change == "data":
                    m[0].weight.data = torch.full_like(m[0].weight, 0.01)
                elif change == "to":
                    m.to(torch.float64).to(torch.float32)  # every parameter and buffer moved
                else:
                    o.add_param_group({"params": list(m[3].parameters())})
        g(x, y)
        eager_step(ref, ref_opt, x, y)
        assert_same_state(model, ref)
    assert g._builder.replayer.captures == 2
