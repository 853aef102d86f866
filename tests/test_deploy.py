"""amp_graph.export: the inference ExportedProgram, bit for bit what the compiled model
computes in eval mode without autograd; its weights stored low; its three targets (.pt2,
AOTInductor, ONNX) end to end with dynamic sizes; calibration; and the errors for what
cannot be exported."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.utils._pytree as pytree
from model_zoo import MODELS, build, ids

import amp_graph
from amp_graph import deploy
from amp_graph.demo import models
from amp_graph.deploy.against_float32 import error_against_float32, float32_program, state_bytes
from amp_graph.deploy.lift import LiftError
from amp_graph.deploy.program import CAST_OPS

BF16, FP16 = torch.bfloat16, torch.float16
TO_COPY = torch.ops.aten._to_copy.default
ROOT = Path(__file__).resolve().parents[1]


def _leaves(value) -> list[torch.Tensor]:
    return [v for v in pytree.tree_leaves(value) if isinstance(v, torch.Tensor)]


def _compiled_eval(model: nn.Module, policy: str, dtype: torch.dtype, kwargs: dict):
    """What the program must equal: the compiled model in eval mode, without autograd."""
    model.eval()
    try:
        with torch.no_grad():
            return amp_graph.compile(model, policy, dtype)(**kwargs)
    finally:
        model.train()


def _assert_bit_equal(got, want) -> None:
    got, want = _leaves(got), _leaves(want)
    assert len(got) == len(want) and got
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)


# ---- the program ----------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["O1", "O2"])
@pytest.mark.parametrize("name", list(MODELS))
def test_program_is_bit_equal_to_the_compiled_model_in_eval_without_grad(name, policy):
    model, kwargs = build(name)
    model.train()
    program = amp_graph.export(model, (), kwargs, policy=policy, dtype=BF16)
    assert model.training, "the model's own mode is restored after the export"
    want = _compiled_eval(model, policy, BF16, kwargs)
    with torch.no_grad():
        got = program.module()(**kwargs)
    _assert_bit_equal(got, want)
    info = amp_graph.export_info(program)
    graph = program.graph
    # every cast is an aten op; one reads a stored tensor only where other ops read that
    # tensor as it is (GPT-2's tied wte under O1: the embedding in float32, the head in bf16)
    assert not [n for n in graph.nodes if n.op == "call_method"]
    state = {s.arg.name for s in program.graph_signature.input_specs if s.kind.name != "USER_INPUT"}
    casts = [n for n in graph.nodes if n.target in CAST_OPS]
    assert info.casts == sum(
        n.meta["val"].dtype.is_floating_point and n.args[0].meta["val"].dtype.is_floating_point
        for n in casts
    )
    for cast in casts:
        source = cast.args[0]
        if source.name in state:
            assert any(u.target not in CAST_OPS for u in source.users), cast.name
    # state read only through a cast to bf16 is stored in bf16, the rest as it was
    stored = {**program.state_dict, **program.constants}
    for fqn, dtype in info.stored_low.items():
        assert stored[fqn].dtype == dtype == BF16
    assert info.stored_low, "some weights are read only by bf16 ops"
    for fqn, tensor in model.state_dict().items():
        if fqn in stored and fqn not in info.stored_low:
            assert stored[fqn].dtype == tensor.dtype


def test_islands_are_every_op_computing_in_float32_and_say_why():
    """A residual add of a float32 input and a float16 linear follows its inputs into
    float32: an island too, beside the policy's float32 ops."""

    class Residual(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.softmax(x + self.fc(x), -1).reshape(-1)

    program = amp_graph.export(Residual(), (torch.randn(2, 8),), dtype=FP16)
    islands = {i.node: i.why for i in amp_graph.export_info(program).islands}
    values = {n.name: n.meta["val"] for n in program.graph.nodes if n.op == "call_function"}
    assert set(islands) == {"add", "softmax"}  # not the view (reshape), not the casts
    assert all(values[name].dtype == torch.float32 for name in islands)
    assert islands["add"].endswith("its inputs are float32")
    assert "deny table" in islands["softmax"]


def test_o2_program_state_is_about_half_the_float32_programs():
    model, kwargs = build("gpt2")
    program = amp_graph.export(model, (), kwargs, policy="O2", dtype=BF16)
    float32 = float32_program(model, (), kwargs)
    ratio = state_bytes(program) / state_bytes(float32)
    assert 0.5 <= ratio <= 0.55, ratio  # layer norms stay float32 under O2
    o3 = amp_graph.export(model, (), kwargs, policy="O3", dtype=BF16)
    assert state_bytes(o3) / state_bytes(float32) == pytest.approx(0.5, abs=1e-3)


def test_tied_weights_are_stored_once():
    """GPT-2 ties lm_head to wte: O1 reads wte in float32 (the embedding) and in bf16 (the
    head), so it stays float32; O2 reads it in bf16 only, so it is stored in bf16, once."""
    model, kwargs = build("gpt2")
    o1 = amp_graph.export(model, (), kwargs, policy="O1", dtype=BF16)
    assert "transformer.wte.weight" not in amp_graph.export_info(o1).stored_low
    o2 = amp_graph.export(model, (), kwargs, policy="O2", dtype=BF16)
    tied = [k for k in o2.state_dict if k in ("transformer.wte.weight", "lm_head.weight")]
    assert len(tied) == 1 and o2.state_dict[tied[0]].dtype == BF16


def test_dynamic_batch_and_sequence():
    model, _ = build("gpt2")
    batch, seq = torch.export.Dim("batch", max=16), torch.export.Dim("seq", max=32)
    program = amp_graph.export(
        model,
        (),
        {"input_ids": ids(2, 12)},
        dtype=BF16,
        dynamic_shapes={"input_ids": {0: batch, 1: seq}},
    )
    for shape in [(1, 5), (3, 12), (7, 31)]:
        kwargs = {"input_ids": ids(*shape)}
        with torch.no_grad():
            got = program.module()(**kwargs)
        _assert_bit_equal(got, _compiled_eval(model, "O1", BF16, kwargs))


def test_a_compiled_module_exports_with_its_policy_and_dtype():
    model, kwargs = build("bert")
    compiled = amp_graph.compile(model, "O2", FP16)
    program = amp_graph.export(compiled, (), kwargs)
    info = amp_graph.export_info(program)
    assert (info.policy.name, info.dtype) == ("O2", FP16)
    with torch.no_grad():
        _assert_bit_equal(program.module()(**kwargs), _compiled_eval(model, "O2", FP16, kwargs))
    amp_graph.compile_(model, "O1", BF16)  # in place: its class's forward is exported
    info = amp_graph.export_info(amp_graph.export(model, (), kwargs))
    assert (info.policy.name, info.dtype) == ("O1", BF16)


def test_torch_export_of_a_compiled_module_points_to_amp_graph_export():
    model = models.GPT(vocab=64, block=16, dim=32, heads=2, layers=1)
    idx = torch.randint(0, 64, (2, 16))
    for compiled in (amp_graph.compile(model), amp_graph.compile_(model)):
        with pytest.raises(RuntimeError, match=r"amp_graph\.export\(model, args"):
            torch.export.export(compiled, (idx,))


# ---- targets --------------------------------------------------------------------------


TARGET_MODELS = {
    # (model, example input, a bigger batch, the batch dimension's spec)
    "gpt2": lambda: (build("gpt2")[0], ids(2, 12), ids(5, 12), {"input_ids": {0: "b"}}),
    "convnet_bn": lambda: (
        build("convnet_bn")[0],
        torch.randn(2, 3, 16, 16),
        torch.randn(5, 3, 16, 16),
        {"x": {0: "b"}},
    ),
}


def _dynamic(spec: dict) -> dict:
    batch = torch.export.Dim("batch", max=64)
    return {k: {d: batch for d in dims} for k, dims in spec.items()}


@pytest.mark.parametrize("name", list(TARGET_MODELS))
def test_pt2_and_aoti_round_trip_with_a_dynamic_batch(name, tmp_path):
    model, example, bigger, spec = TARGET_MODELS[name]()
    key = next(iter(spec))
    program = amp_graph.export(
        model, (), {key: example}, policy="O1", dtype=BF16, dynamic_shapes=_dynamic(spec)
    )
    want = _leaves(_compiled_eval(model, "O1", BF16, {key: bigger}))
    path = deploy.save(program, tmp_path / "model.pt2", "pt2")
    with torch.no_grad():
        _assert_bit_equal(deploy.load(path, "pt2")(**{key: bigger}), want)
    assert deploy.load_info(path)["stored_low"] == {
        k: "bf16" for k in amp_graph.export_info(program).stored_low
    }
    package = deploy.save(program, tmp_path / "model_aoti.pt2", "aoti")
    with torch.no_grad():
        got = _leaves(deploy.load(package, "aoti")(**{key: bigger}))
    # inductor fuses and reorders, so equal to within bf16 rounding, in the same dtypes
    assert [t.dtype for t in got] == [t.dtype for t in want]
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a.float(), b.float(), atol=0.05, rtol=0.02)


def _floating_casts(onnx, proto) -> int:
    """The ONNX graph's Cast nodes from one floating type to another."""
    inferred = onnx.shape_inference.infer_shapes(proto)
    graph = inferred.graph
    types = {v.name: v.type.tensor_type.elem_type for v in (*graph.input, *graph.value_info)}
    types.update({i.name: i.data_type for i in graph.initializer})
    floating = {
        onnx.TensorProto.FLOAT,
        onnx.TensorProto.FLOAT16,
        onnx.TensorProto.BFLOAT16,
        onnx.TensorProto.DOUBLE,
    }
    return sum(
        node.op_type == "Cast"
        and types.get(node.input[0]) in floating
        and next(a.i for a in node.attribute if a.name == "to") in floating
        for node in graph.node
    )


# the ConvNet under O1: a float16 convolution into a batch norm with float32 parameters,
# which torch.onnx's optimizer would fold into an ill-typed Conv (onnx_target.onnx_program)
@pytest.mark.parametrize(("name", "policy"), [("gpt2", "O2"), ("convnet_bn", "O1")])
def test_onnx_runs_float16_with_low_initializers_and_no_weight_casts(
    name, policy, tmp_path, caplog
):
    pytest.importorskip("onnxruntime")
    onnx = pytest.importorskip("onnx")
    from amp_graph.deploy.onnx_target import onnx_stats

    model, example, bigger, spec = TARGET_MODELS[name]()
    key = next(iter(spec))
    program = amp_graph.export(
        model, (), {key: example}, policy=policy, dtype=FP16, dynamic_shapes=_dynamic(spec)
    )
    with caplog.at_level("WARNING", logger="amp_graph.deploy.onnx_target"):
        path = deploy.save(program, tmp_path / "model.onnx", "onnx")
    proto = onnx.load(str(path))
    initializers = {i.name: i.data_type for i in proto.graph.initializer}
    stored = amp_graph.export_info(program).stored_low
    named = [fqn for fqn in stored if fqn in initializers]
    assert len(named) >= len(stored) // 2  # torch.onnx folds some (biases, positions)
    assert all(initializers[fqn] == onnx.TensorProto.FLOAT16 for fqn in named)
    half_bytes = sum(
        onnx.numpy_helper.to_array(i).nbytes
        for i in proto.graph.initializer
        if i.data_type == onnx.TensorProto.FLOAT16
    )
    stored_bytes = sum(program.state_dict[fqn].nbytes for fqn in stored)
    assert half_bytes >= 0.9 * stored_bytes  # folded or not, the weights stay float16
    stats = onnx_stats(path)
    cast_of_weight = [
        n.name for n in proto.graph.node if n.op_type == "Cast" and n.input[0] in initializers
    ]
    assert not cast_of_weight  # weights are stored float16, not float32 plus a Cast
    # torch.onnx adds no conversion between floating dtypes (its own Cast of a bool mask to
    # int64 is not one; the program counts only those)
    assert _floating_casts(onnx, proto) <= amp_graph.export_info(program).casts
    # the CPU runtime's own float32 computing is said at save, where it was only counted
    said = [r.getMessage() for r in caplog.records if "in float32" in r.getMessage()]
    assert len(said) == (stats.runtime_casts > stats.casts)
    if said:
        assert f"{stats.runtime_casts - stats.casts} more casts" in said[0]
    run = deploy.load(path, "onnx")
    for value in (example, bigger):
        (want,) = _leaves(_compiled_eval(model, policy, FP16, {key: value}))
        got = run(**{key: value})
        assert got.dtype == want.dtype and got.shape == want.shape
        torch.testing.assert_close(got.float(), want.float(), atol=2e-3, rtol=2e-2)
    assert deploy.load_info(path, "onnx")["dtype"] == "fp16"


@pytest.mark.parametrize(("name", "op"), [("gpt2", "(MatMul|Gemm)"), ("convnet_bn", "Conv")])
def test_onnx_names_the_op_and_dtype_its_cpu_runtime_cannot_run(name, op, tmp_path):
    pytest.importorskip("onnxruntime")
    model, example, _, spec = TARGET_MODELS[name]()
    key = next(iter(spec))
    program = amp_graph.export(model, (), {key: example}, dtype=BF16)
    with pytest.raises(deploy.TargetError, match=rf"{op}.*bfloat16.*'onnx'|bfloat16.*{op}"):
        deploy.save(program, tmp_path / "model.onnx", "onnx")
    unchecked = deploy.save(program, tmp_path / "model.onnx", "onnx", check=False)
    assert unchecked.exists()  # written for a runtime with those kernels, when asked
    with pytest.raises(deploy.TargetError, match="bfloat16"):
        deploy.load(unchecked, "onnx")
    from amp_graph.deploy.onnx_target import onnx_stats

    with pytest.raises(deploy.TargetError, match="bfloat16"):
        onnx_stats(unchecked)  # it opens the file in onnxruntime too


def test_bad_formats_and_paths(tmp_path):
    model, kwargs = build("convnet_bn")
    program = amp_graph.export(model, (), kwargs, dtype=BF16)
    with pytest.raises(ValueError, match="pt2, aoti, onnx"):
        deploy.save(program, tmp_path / "m.trt", "tensorrt")
    with pytest.raises(ValueError, match=r"AOTInductor package is a \.pt2 file"):
        deploy.save(program, tmp_path / "m.so", "aoti")


def test_import_amp_graph_imports_no_onnx():
    code = (
        "import sys, amp_graph, amp_graph.deploy;"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('onnx', 'onnxruntime', 'onnxscript')))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


# ---- calibration ------------------------------------------------------------------------


class HotMLP(nn.Module):
    """A block whose hidden activation exceeds float16's range (a weight scaled up), which
    a layer norm brings back: finite in float32, inf in float16 unless kept float32."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(16, 64)
        self.norm = nn.LayerNorm(64)
        self.down = nn.Linear(64, 4)
        with torch.no_grad():
            self.up.weight.mul_(1e5)  # |w| <= 25000: the weights fit float16

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.norm(self.up(x)))


def test_calibration_keeps_the_overflowing_node_in_float32_and_names_it():
    torch.manual_seed(0)
    model = HotMLP()
    x = torch.randn(4, 16)
    samples = [(torch.randn(4, 16),) for _ in range(3)]
    plain = amp_graph.export(model, (x,), policy="O1", dtype=FP16)
    with torch.no_grad():
        assert not torch.isfinite(plain.module()(x)).all()
    program = amp_graph.export(model, (x,), policy="O1", dtype=FP16, calibration=samples)
    info = amp_graph.export_info(program)
    assert list(info.demoted) == ["linear"]
    assert "float16 max" in info.demoted["linear"] or "inf" in info.demoted["linear"]
    assert any(i.node == "linear" and "autopolicy" in i.why for i in info.islands)
    assert "up.weight" not in info.stored_low  # a float32 op reads it
    calibrated = error_against_float32(program.module(), model, samples)
    uncalibrated = error_against_float32(plain.module(), model, samples)
    assert calibrated.rel_l2 <= 10 * torch.finfo(FP16).eps < uncalibrated.rel_l2
    with torch.no_grad():
        _assert_bit_equal(
            program.module()(x), amp_graph.compile(model.eval(), info.policy, FP16)(x)
        )


@pytest.mark.parametrize("policy", ["O2", "O3"])
def test_calibration_of_an_hf_gpt2_whose_attention_overflows_float16(policy):
    """Layer 0's attention scores far beyond float16 (its c_attn weight x1000): without
    calibration the program gives inf; with it, the program is within tol of float32. It
    takes more than the overflowing matmul: a causal mask HF builds from the embeddings'
    dtype (float16's min) no longer masks float32 scores, so it must be built in float32
    too (the program holds no float16-min constant)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        n_positions=128, n_embd=64, n_layer=2, n_head=2, vocab_size=512, use_cache=False
    )
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        model.transformer.h[0].attn.c_attn.weight.mul_(1000.0)
    samples = [{"input_ids": torch.randint(0, 512, (2, 64))} for _ in range(3)]
    example = {"input_ids": torch.randint(0, 512, (2, 64))}
    plain = amp_graph.export(model, (), example, policy=policy, dtype=FP16)
    assert error_against_float32(plain.module(), model, samples).rel_l2 == float("inf")
    program = amp_graph.export(model, (), example, policy=policy, dtype=FP16, calibration=samples)
    info = amp_graph.export_info(program)
    assert "matmul" in info.demoted  # layer 0's scores
    calibrated = error_against_float32(program.module(), model, samples)
    assert calibrated.rel_l2 <= 10 * torch.finfo(FP16).eps
    assert info.calibration_error is not None
    assert info.calibration_error.rel_l2 <= 10 * torch.finfo(FP16).eps
    fp16_min = torch.finfo(FP16).min
    constants = [a for n in program.graph.nodes for a in n.args if isinstance(a, float)]
    assert fp16_min in [a for n in plain.graph.nodes for a in n.args if isinstance(a, float)]
    assert fp16_min not in constants


def test_a_calibrated_program_is_checked_on_the_samples_it_ships_with():
    """What calibration promises is checked on the program itself: one that misses tol on
    a sample is an error, never a program returned as calibrated."""
    from amp_graph.deploy.program import _check_calibrated

    torch.manual_seed(0)
    model, x = HotMLP(), torch.randn(4, 16)
    plain = amp_graph.export(model, (x,), policy="O1", dtype=FP16)
    with pytest.raises(amp_graph.AutopolicyError, match=r"misses tol=.* on calibration sample 0"):
        _check_calibrated(plain, model, [((x,), {})], FP16, None, amp_graph.export_info(plain))
    program = amp_graph.export(model, (x,), policy="O1", dtype=FP16, calibration=[(x,)])
    error = amp_graph.export_info(program).calibration_error
    assert error is not None and error.rel_l2 <= 10 * torch.finfo(FP16).eps


class ShapeArithmetic(nn.Module):
    """Python on the input's sizes (``b * t``): under symbolic sizes the capture computes it
    in a node of the graph, which shifts the numbering of the node names after it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        big = x.reshape(b * t, d) * 1000.0  # beyond float16's range
        return self.lin(big * 0.001)


@pytest.mark.parametrize("dynamic", [False, True])
def test_calibration_names_nodes_of_the_graph_it_exports(dynamic):
    """Calibration captures as the export does (the same dynamic shapes), so the nodes it
    demotes are the exported graph's, with a dynamic batch too."""
    torch.manual_seed(0)
    model = ShapeArithmetic().eval()
    samples = [(100 * torch.randn(2, 4, 8),) for _ in range(2)]
    (x,) = samples[0]
    shapes = {"x": {0: torch.export.Dim("batch", max=64)}} if dynamic else None
    program = amp_graph.export(
        model, (x,), policy="O2", dtype=FP16, dynamic_shapes=shapes, calibration=samples
    )
    info = amp_graph.export_info(program)
    assert info.demoted
    products = {n.name for n in program.graph.nodes if n.target is torch.ops.aten.mul.Tensor}
    float_products = {i.node for i in info.islands if i.op == "aten.mul.Tensor"}
    assert set(info.demoted) == float_products == products  # both scalings, nothing else
    with torch.no_grad():
        for batch in (2, 5) if dynamic else (2,):
            assert torch.isfinite(program.module()(100 * torch.randn(batch, 4, 8))).all()


def test_calibration_samples_of_the_wrong_structure_name_the_signature():
    model, _ = build("convnet_bn")
    x = torch.randn(2, 3, 16, 16)
    with pytest.raises(TypeError, match=r"sample 1 .* does not fit ConvNet\.forward\(x"):
        amp_graph.export(model, (x,), calibration=[(x,), (x, x)])
    with pytest.raises(TypeError, match=r"sample 0 .*exported with \(Tensor\[2, 3, 16, 16\]"):
        amp_graph.export(model, (x,), calibration=[((x, x),)])
    with pytest.raises(TypeError, match="iterable of sample inputs"):
        amp_graph.export(model, (x,), calibration=x)
    with pytest.raises(ValueError, match="calibration is empty"):
        amp_graph.export(model, (x,), calibration=[])


# ---- what is exported, and what cannot be ----------------------------------------------


class DropoutNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.fc(x))


def test_a_model_in_training_mode_is_exported_in_eval_mode():
    torch.manual_seed(0)
    model = DropoutNet().train()
    x = torch.randn(4, 8)
    program = amp_graph.export(model, (x,), dtype=BF16)
    assert model.training and model.drop.training
    run = program.module()
    with torch.no_grad():
        first, second = run(x), run(x)
        assert torch.equal(first, second)  # no dropout
        model.eval()
        assert torch.equal(first, amp_graph.compile(model, "O1", BF16)(x))


class Counter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.fc(x)


def test_a_model_that_writes_its_buffers_is_refused_clearly():
    with pytest.raises(LiftError, match=r"writes 'model\.calls' in its forward"):
        amp_graph.export(Counter(), (torch.randn(2, 4),))


def test_fp8_and_bad_arguments_are_refused():
    model, kwargs = build("convnet_bn")
    with pytest.raises(NotImplementedError, match="fp8"):
        amp_graph.export(model, (), kwargs, policy="fp8")
    with pytest.raises(ValueError, match="dtype is the low-precision compute dtype"):
        amp_graph.export(model, (), kwargs, dtype=torch.float32)
    with pytest.raises(TypeError, match=r"takes an nn\.Module"):
        amp_graph.export(lambda x: x, (torch.randn(2),))
    with pytest.raises(TypeError, match="kwargs is a dict"):
        amp_graph.export(model, (), [torch.randn(2)])


# ---- the CLI ----------------------------------------------------------------------------


def test_cli_export_with_calibration_prints_sizes_casts_islands_and_error(tmp_path):
    samples = tmp_path / "samples.pt"
    torch.save([(torch.randn(3, 16),) for _ in range(2)], samples)
    model_file = tmp_path / "hot.py"
    model_file.write_text(
        "import torch\n"
        "from tests.test_deploy import HotMLP\n"
        "def hot():\n"
        "    torch.manual_seed(0)\n"
        "    return HotMLP()\n"
    )
    out = tmp_path / "hot.pt2"
    done = subprocess.run(
        [sys.executable, "-m", "amp_graph", "export", f"{model_file}:hot", "--input-shape",
         "2,16", "--dtype", "fp16", "--calibrate", str(samples), "--dynamic-batch",
         "--format", "pt2", "-o", str(out)],
        capture_output=True, text=True, cwd=ROOT, timeout=300, check=False,
        env={**os.environ, "PYTHONPATH": str(ROOT / "tests")},  # test_deploy's model_zoo
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    text = done.stdout
    assert out.exists() and f"wrote {out}" in text
    assert "float32 export" in text and "x (" in text  # sizes against float32
    assert "casts in the program:" in text
    assert "demoted by calibration: linear" in text
    assert "linear (aten.linear in up): demoted by autopolicy" in text
    assert "max error against float32:" in text and "inf" not in text.split("max error")[1]
    program = torch.export.load(str(out))
    with torch.no_grad():
        assert torch.isfinite(program.module()(torch.randn(5, 16))).all()  # dynamic batch


def test_cli_export_bad_calibration_file_is_a_usage_error(tmp_path):
    bad = tmp_path / "bad.pt"
    torch.save({"x": 1}, bad)
    sample = str(Path(__file__).with_name("sample_model.py"))
    done = subprocess.run(
        [sys.executable, "-m", "amp_graph", "export", f"{sample}:SmallNet", "--input-shape",
         "2,3,16,16", "--calibrate", str(bad), "-o", str(tmp_path / "m.pt2")],
        capture_output=True, text=True, cwd=ROOT, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 2
    assert "--calibrate takes a file written by torch.save(samples, path)" in done.stderr
