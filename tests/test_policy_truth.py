"""What a policy says is what the graph does: the model's own autocast blocks, overrides that
name containers or match nothing, and ops no policy can cast.

The oracle is torch.autocast (each aten op's dtype, recorded by a dispatch mode), the dtypes
the compiled graph computes when it runs (an ``fx.Interpreter``), or the exact message.
"""

from __future__ import annotations

import logging
import warnings

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

import amp_graph
from amp_graph.frontends.compiler import as_graph_module

BF16, FP16, FP32, FP64 = torch.bfloat16, torch.float16, torch.float32, torch.float64


class _DtypeLog(TorchDispatchMode):
    """Each aten op torch runs, with its output dtype (torch.autocast's per-op answer)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, torch.dtype]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor):
            self.ops.append((func.overloadpacket.__name__, out.dtype))
        return out


def autocast_dtypes(model: nn.Module, *inputs: torch.Tensor, op: str) -> list[torch.dtype]:
    """The output dtypes of every ``op`` torch.autocast (CPU, bfloat16) runs, in order."""
    log = _DtypeLog()
    with torch.autocast("cpu", dtype=BF16), log:
        model(*inputs)
    return [dtype for name, dtype in log.ops if name == op]


def graph_dtypes(compiled: nn.Module, *inputs: torch.Tensor) -> dict[str, torch.dtype]:
    """Each node of the compiled graph with the dtype it returns when it runs."""
    found: dict[str, torch.dtype] = {}

    class Recorder(fx.Interpreter):
        def run_node(self, node: fx.Node):
            out = super().run_node(node)
            if isinstance(out, torch.Tensor):
                found[node.name] = out.dtype
            return out

    Recorder(as_graph_module(compiled)).run(*inputs)
    return found


def _compile(model: nn.Module, policy, *inputs: torch.Tensor, dtype=BF16) -> nn.Module:
    return amp_graph.compile(model, policy, dtype, example_inputs=inputs)


def _override(preset: str, **overrides) -> amp_graph.Policy:
    return amp_graph.Policy.preset(preset).override(**overrides)


# --- 1. the model's own autocast blocks decide inside them ----------------------------------


class HFStyleBlock(nn.Module):
    """As HF writes attention: rotary frequencies in an autocast-disabled float32 region, an
    upcast, then a projection the model runs in its own float16 block."""

    def __init__(self) -> None:
        super().__init__()
        self.inv_freq = nn.Parameter(torch.rand(8), requires_grad=False)
        self.q = nn.Linear(16, 16)
        self.o = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.q(x)
        with torch.autocast("cpu", enabled=False):
            freqs = self.inv_freq[:, None].float() @ self.inv_freq[None, :].float()  # float32
        h = h.float() * freqs.sum()
        with torch.autocast("cpu", dtype=torch.float16):
            return self.o(h)


@pytest.mark.parametrize("preset", ["O2", "O3"])
def test_the_models_fp16_block_after_an_upcast_computes_in_fp16(preset: str) -> None:
    """torch.autocast runs the block's linear in float16; so must O2 and O3, whose float32
    island of the upcast ``h.float()`` reached into the block (it computed in float32).
    The disabled region's matmul stays float32, as torch.autocast's."""
    torch.manual_seed(0)
    model, x = HFStyleBlock(), torch.randn(2, 16)
    expected = autocast_dtypes(model, x, op="addmm")
    assert expected == [BF16, FP16]
    compiled = _compile(model, preset, x)
    ran = graph_dtypes(compiled, x)
    report = amp_graph.report(compiled)
    linears = [r.name for r in report.rows if r.op == "aten.linear"]
    assert [ran[name] for name in linears][-1] == FP16
    [matmul] = [r.name for r in report.rows if r.op == "aten.matmul"]
    assert ran[matmul] == autocast_dtypes(model, x, op="mm")[0] == FP32


def test_explain_names_the_models_block_where_it_set_the_dtype() -> None:
    """Under O1 in bf16, the block's linear is fp16 because of the block, not the table."""
    torch.manual_seed(0)
    model, x = HFStyleBlock(), torch.randn(2, 16)
    compiled = _compile(model, "O1", x)
    report = amp_graph.report(compiled)
    [name] = [r.name for r in report.rows if r.op == "aten.linear" and r.module == "o"]
    said = amp_graph.explain(compiled, name)
    assert "returns fp16" in said
    assert "decided by the model's own torch.autocast block" in said
    assert "table level" not in said
    assert report.row(name).decided_by == "autocast region"


# --- 2. a path or type naming a container reaches the modules in it -------------------------


class Stack(nn.Module):
    def __init__(self, container: str = "list") -> None:
        super().__init__()
        layers = [nn.Linear(16, 16), nn.Linear(16, 16)]
        if container == "list":
            self.blocks = nn.ModuleList(layers)
        else:
            self.blocks = nn.ModuleDict({"first": layers[0], "second": layers[1]})
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        blocks = self.blocks if isinstance(self.blocks, nn.ModuleList) else self.blocks.values()
        for block in blocks:
            x = torch.relu(block(x))
        return self.head(x)


def _linear_dtypes(compiled: nn.Module, x: torch.Tensor) -> list[torch.dtype]:
    ran = graph_dtypes(compiled, x)
    report = amp_graph.report(compiled)
    return [ran[r.name] for r in report.rows if r.op == "aten.linear"]


@pytest.mark.parametrize("container", ["list", "dict"])
@pytest.mark.parametrize("preset", ["O1", "O2"])
def test_a_container_path_keeps_everything_in_it_float32(preset: str, container: str) -> None:
    """``modules={"blocks": "fp32"}`` means what ``"blocks.*"`` does: the container's layers
    in float32 (they ran in bf16: the never-called container is on no node's stack)."""
    model, x = Stack(container), torch.randn(2, 16)
    by_path = _linear_dtypes(_compile(model, _override(preset, modules={"blocks": "fp32"}), x), x)
    by_glob = _linear_dtypes(_compile(model, _override(preset, modules={"blocks.*": "fp32"}), x), x)
    assert by_path == by_glob == [FP32, FP32, BF16]


@pytest.mark.parametrize("container", [nn.ModuleList, nn.ModuleDict])
def test_a_container_type_override_reaches_the_modules_it_holds(container: type) -> None:
    model = Stack("list" if container is nn.ModuleList else "dict")
    x = torch.randn(2, 16)
    compiled = _compile(model, _override("O1", module_types={container: "fp32"}), x)
    assert _linear_dtypes(compiled, x) == [FP32, FP32, BF16]


def test_overrides_inside_a_container_keep_their_priority() -> None:
    """Innermost wins: a path inside the container over the container's path, a type inside
    it over the container's type; a path over a type."""
    model, x = Stack(), torch.randn(2, 16)
    inner_path = _override("O1", modules={"blocks": "fp32", "blocks.1": "low"})
    assert _linear_dtypes(_compile(model, inner_path, x), x) == [FP32, BF16, BF16]
    inner_type = _override("O1", module_types={nn.ModuleList: "fp32", nn.Linear: "low"})
    assert _linear_dtypes(_compile(model, inner_type, x), x) == [BF16, BF16, BF16]
    path_over_type = _override("O1", module_types={nn.Linear: "low"}, modules={"blocks": "fp32"})
    assert _linear_dtypes(_compile(model, path_over_type, x), x) == [FP32, FP32, BF16]


# --- 3. overrides that match nothing in this model say so ---------------------------------


class RMSNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


LookalikeRMSNorm = type("RMSNorm", (nn.Module,), {})  # the same name, another class object


class NormHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.norm = nn.Linear(16, 16), RMSNorm()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.norm(self.fc(x)), -1)


def test_an_op_override_naming_an_op_the_graph_lacks_warns_naming_the_nearest() -> None:
    """``"_softmax"`` is the op a profiler shows; the graph calls ``softmax``."""
    model, x = NormHead(), torch.randn(2, 16)
    nearest = r"'_softmax' matches no op of the captured graph.* Did you mean 'softmax'\?"
    with pytest.warns(UserWarning, match=nearest):
        compiled = _compile(model, _override("O1", ops={"_softmax": "low"}), x)
    assert graph_dtypes(compiled, x)["softmax"] == FP32  # as it said: nothing changed
    with pytest.warns(UserWarning, match="'conv2d' matches no op of the captured graph"):
        _compile(model, _override("O1", ops={"conv2d": "fp32"}), x)


def test_an_op_override_is_checked_against_the_model_it_is_applied_to() -> None:
    """One policy serves several models, as its tables do: building it says nothing; a
    model with the op takes it quietly, one without is told."""
    policy = _override("O1", ops={"softmax": "low"})
    x = torch.randn(2, 16)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*matches no")
        ran = graph_dtypes(_compile(NormHead(), policy, x), x)
    assert ran["softmax"] == BF16
    with pytest.warns(UserWarning, match="'softmax' matches no op"):
        _compile(nn.Sequential(nn.Linear(16, 4)), policy, x)


def test_a_module_type_of_another_class_object_raises_saying_which_is_which() -> None:
    model, x = NormHead(), torch.randn(2, 16)
    with pytest.raises(ValueError, match="different class object") as raised:
        _compile(model, _override("O1", module_types={LookalikeRMSNorm: "low"}), x)
    said = str(raised.value)
    assert f"{id(RMSNorm):#x}" in said and f"{id(LookalikeRMSNorm):#x}" in said
    ran = graph_dtypes(_compile(model, _override("O1", module_types={RMSNorm: "low"}), x), x)
    assert ran["mean"] == BF16  # the model's own class matches (O1 alone: float32)


def test_a_module_type_the_model_lacks_warns() -> None:
    model, x = NormHead(), torch.randn(2, 16)
    with pytest.warns(UserWarning, match="LayerNorm matches no module of the model"):
        _compile(model, _override("O1", module_types={nn.LayerNorm: "fp32"}), x)


# --- 4/5. ops that read nothing a policy casts: explain and report say so --------------------


class Mixed(nn.Module):
    """A float64 matmul the model chose, integer arithmetic, a factory op."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.register_buffer("w64", torch.randn(8, 8, dtype=FP64))

    def forward(self, x: torch.Tensor, ids: torch.Tensor):
        wide = x.double() @ self.w64
        scaled = ids * 3
        bias = torch.ones(8)
        return self.fc(x) + wide.float() + bias, scaled


def _mixed() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    return Mixed(), torch.randn(2, 8), torch.randint(0, 5, (2, 8))


@pytest.mark.parametrize("name", ["matmul", "mul", "ones"])
def test_explain_says_an_op_reading_nothing_castable_is_not_cast(name: str) -> None:
    model, x, ids = _mixed()
    compiled = _compile(model, "O2", x, ids)
    ran = graph_dtypes(compiled, x, ids)
    said = amp_graph.explain(compiled, name)
    short = {FP64: "fp64", torch.int64: "i64", FP32: "fp32"}[ran[name]]
    assert f"returns {short}" in said
    assert "Not cast: it reads no floating-point value the policy casts" in said
    assert "does not apply" in said and "compute in low precision" not in said
    assert amp_graph.report(compiled).row(name).rule == "not cast"


def test_an_integer_reduction_under_o1_is_not_called_float32() -> None:
    model, ids = nn.Identity(), torch.randint(0, 5, (2, 8))

    class Count(nn.Module):
        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return model(ids).sum()

    compiled = _compile(Count(), "O1", ids)
    said = amp_graph.explain(compiled, "sum_1")
    assert graph_dtypes(compiled, ids)["sum_1"] == torch.int64
    assert "returns i64" in said and "Not cast" in said and "compute in float32" not in said


def test_report_names_a_float64_product_float64() -> None:
    model, x, ids = _mixed()
    report = amp_graph.report(_compile(model, "O2", x, ids))
    assert "matmul" not in report.wide_products
    assert report.uncast_products["matmul"].startswith("fp64: not cast")
    assert report.low_products == {"bf16": 1}
    assert "matmul in fp64: not cast" in report.totals()
    assert "1 of 2 in bf16" in report.totals()


def test_a_node_override_on_a_node_it_cannot_cast_warns_and_explain_does_not_credit_it() -> None:
    model, x, ids = _mixed()
    policy = _override("O2", nodes={"matmul": "low"})
    with pytest.warns(UserWarning, match="node override 'matmul' -> allow has no effect"):
        compiled = _compile(model, policy, x, ids)
    assert graph_dtypes(compiled, x, ids)["matmul"] == FP64
    said = amp_graph.explain(compiled, "matmul")
    assert "Not cast" in said and "decided by the node level" not in said


# --- 6. requests and messages ---------------------------------------------------------------


def test_o0_takes_float32_and_changes_nothing() -> None:
    model, x = NormHead(), torch.randn(2, 16)
    compiled = _compile(model, "O0", x, dtype=FP32)
    assert torch.equal(compiled(x), model(x))


def test_o0_with_overrides_asks_for_a_low_dtype_without_pointing_at_o0() -> None:
    model, x = NormHead(), torch.randn(2, 16)
    with pytest.raises(ValueError) as raised:
        _compile(model, _override("O0", ops={"linear": "low"}), x, dtype=FP32)
    assert "use policy='O0'" not in str(raised.value)
    assert "computes in float32 already" in str(raised.value)


@pytest.mark.parametrize(("name", "full"), [("fp16", "float16"), ("bf16", "bfloat16")])
def test_a_dtype_given_as_the_policy_says_dtype_is_its_own_argument(name: str, full: str) -> None:
    x = torch.randn(2, 16)
    with pytest.raises(ValueError) as raised:
        amp_graph.compile(NormHead(), name, example_inputs=(x,))
    said = str(raised.value)
    assert f"amp_graph.compile(model, 'O1', torch.{full})" in said and "Did you mean" not in said
    with pytest.raises(ValueError) as raised:  # the preset itself, asked by name
        amp_graph.Policy.preset(name)
    assert str(raised.value) == said


def test_the_fp8_none_converted_warning_names_a_call_that_exists(caplog) -> None:
    odd = nn.Sequential(nn.Linear(10, 6), nn.ReLU(), nn.Linear(6, 3))
    x = torch.randn(4, 10)
    with caplog.at_level(logging.WARNING, logger="amp_graph.passes.fp8_linears"):
        compiled = amp_graph.compile(odd, "fp8", example_inputs=(x,))
    [said] = [r.getMessage() for r in caplog.records if "converted none" in r.getMessage()]
    assert "amp_graph.report(compiled).fp8_gemms" in said and "explain(model)" not in said
    assert len(amp_graph.report(compiled).fp8_gemms) == 2
