"""What ``amp_graph.export`` gives a deployment, against the float32 export (issue 27).

Three measurements, side by side in one run:

* **Saved size.** HF BERT (``BertModel``), GPT-2 (``GPT2LMHeadModel``) and ViT
  (``ViTForImageClassification``), random small configs built from transformers' config
  classes (no downloads), each exported with ``amp_graph.export`` under O1, O2 and O3 in
  bfloat16 and float16 and written with ``amp_graph.deploy.save(..., "pt2")`` (that is
  ``torch.export.save`` plus a few kB of JSON, the ExportInfo); the file's size is divided by
  that of ``torch.export.save(torch.export.export(model.eval(), ...))`` of the float32 model
  (target: at most 0.55 for O2 and O3). The ONNX file's ratio too (``torch.onnx.export`` of
  the program, written unchecked), for float16 under each policy and for bfloat16 under O2,
  with whether onnxruntime's CPU provider opens the file (it has no bfloat16 kernels for
  most ops, and ONNX's Conv takes no bfloat16: a ``TargetError``, printed as "n/a").
* **Output error against float32** on the calibration inputs (a few random samples shaped
  like the example): relative L2 and max abs, of the saved ``.pt2`` loaded back
  (``amp_graph.deploy.load``), without calibration and with ``calibration=samples``, beside
  the policy's tolerance (autopolicy's default, 10 x the dtype's epsilon) and the nodes
  calibration demoted to float32. Targets: within the tolerance; with calibration never
  worse than without. Besides the three models, a stress case built to overflow float16:
  the GPT-2 with its eager attention and layer 0's ``c_attn`` weight scaled by 1000 (the
  attention scores pass float16's 65504).
* **Export time** on the 10k-node GPT (``amp_graph.demo.models.GPT``, dim 32, 280 layers: the
  10093-node graph of ``pass_bench.py``): (a) ``torch.export.export`` of the float32 model
  in eval mode, (b) amp_graph's passes (``export_info(program).seconds["passes"]`` of the
  same round's (c)), (c) the whole ``amp_graph.export(model, args, policy="O1",
  dtype=torch.bfloat16)``, which pauses Python's garbage collector while it traces and
  builds graphs; (a') is (a) with the collector paused too (like for like). Each from a
  fresh model instance after a full collection, (a), (a') and (c) interleaved, after an
  untimed warm-up of both on a 2-layer GPT (torch.export's one-time start-up); the ratio
  of the medians and the median of the rounds' ratios (target: c / (a + b) at most 1.2).

    python benchmarks/deploy_bench.py            # the run in BENCHMARKS.md (5 min idle, ~10 shared)
    python benchmarks/deploy_bench.py --quick    # a smoke run (small models, one round)
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from measure import cpu_name
from torch.export import ExportedProgram

import amp_graph
from amp_graph import deploy
from amp_graph.accuracy.autopolicy_search import AutopolicyError
from amp_graph.capture import gc_paused
from amp_graph.demo import models
from amp_graph.deploy.against_float32 import OutputError, error_against_float32, float32_program

POLICIES = ("O1", "O2", "O3")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
SIZE_TARGET = 0.55
TIME_TARGET = 1.2
Inputs = dict[str, torch.Tensor]


@dataclass
class Workload:
    name: str
    config: str
    model: nn.Module
    make_inputs: Callable[[], Inputs]


def hf_workloads(quick: bool, stress: bool = False) -> list[Workload]:
    """Random BERT, GPT-2 and ViT (or, with ``stress``, the overflowing GPT-2 alone)."""
    import transformers

    transformers.logging.set_verbosity_error()
    hidden, layers, vocab, heads = (64, 2, 512, 2) if quick else (256, 4, 4096, 4)
    batch, seq, image = 2, 64, 64
    shape = f"hidden {hidden}, {layers} layers, {heads} heads"

    def ids() -> torch.Tensor:
        return torch.randint(0, vocab, (batch, seq))

    def gpt2(eager: bool) -> nn.Module:
        config = transformers.GPT2Config(
            vocab_size=vocab,
            n_positions=128,
            n_embd=hidden,
            n_layer=layers,
            n_head=heads,
            use_cache=False,
        )
        if eager:
            config._attn_implementation = "eager"
        return transformers.GPT2LMHeadModel(config)

    torch.manual_seed(0)
    if stress:
        model = gpt2(eager=True)
        with torch.no_grad():  # layer 0's attention scores far beyond float16's range
            model.transformer.h[0].attn.c_attn.weight.mul_(1000.0)
        config = f"GPT-2 above, eager attention, layer 0's c_attn weight x1000, ids {batch}x{seq}"
        return [Workload("GPT-2 x1000", config, model, lambda: {"input_ids": ids()})]
    bert = transformers.BertModel(
        transformers.BertConfig(
            vocab_size=vocab,
            hidden_size=hidden,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            intermediate_size=4 * hidden,
            max_position_embeddings=128,
        )
    )
    vit = transformers.ViTForImageClassification(
        transformers.ViTConfig(
            image_size=image,
            patch_size=8,
            hidden_size=hidden,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            intermediate_size=4 * hidden,
            num_labels=10,
        )
    )
    return [
        Workload(
            "BERT",
            f"BertModel: vocab {vocab}, {shape}, ffn {4 * hidden}; ids + mask {batch}x{seq}",
            bert,
            lambda: {
                "input_ids": ids(),
                "attention_mask": torch.ones(batch, seq, dtype=torch.long),
            },
        ),
        Workload(
            "GPT-2",
            f"GPT2LMHeadModel: vocab {vocab}, {shape}, 128 positions; ids {batch}x{seq}",
            gpt2(eager=False),
            lambda: {"input_ids": ids()},
        ),
        Workload(
            "ViT",
            f"ViTForImageClassification: {image}x{image} images, patch 8, {shape}, ffn "
            f"{4 * hidden}, 10 labels; pixels {batch}x3x{image}x{image}",
            vit,
            lambda: {"pixel_values": torch.randn(batch, 3, image, image)},
        ),
    ]


@contextlib.contextmanager
def quiet() -> Any:
    """Swallow what torch.onnx.export prints on stdout (its constant folding's notes)."""
    with contextlib.redirect_stdout(io.StringIO()):
        yield


def mb(n: int) -> str:
    return f"{n / 1e6:.2f}"


def err(e: OutputError) -> str:
    return f"{e.rel_l2:.2e} / {e.max_abs:.2e}"


def short_reason(error: Exception) -> str:
    """A TargetError's first clause ("onnxruntime's ... has no bfloat16 kernel for Add ...")."""
    return str(error).split(": ", 1)[0]


def onnx_cell(
    program: ExportedProgram, model: nn.Module, path: Path, float32_bytes: int, samples: list
) -> str:
    """The ONNX file's size ratio, and whether onnxruntime's CPU provider runs it (with the
    error against float32 on the samples when it does)."""
    with quiet():
        deploy.save(program, path, "onnx", check=False)
    ratio = f"{path.stat().st_size / float32_bytes:.3f}"
    try:
        run = deploy.load(path, "onnx")
    except deploy.TargetError as error:
        return f"{ratio}, n/a ({short_reason(error)})"
    return f"{ratio}, runs (rel L2 {error_against_float32(run, model, samples).rel_l2:.1e})"


ONNX_CASES = (("O1", "fp16"), ("O2", "fp16"), ("O3", "fp16"), ("O2", "bf16"))


def sizes_and_errors(
    work: list[Workload], folder: Path, error_dtypes: list[str], n_samples: int, onnx: bool
) -> None:
    """The size tables (.pt2, ONNX) and the error table of the three HF models."""
    size_rows, onnx_rows, error_rows = [], [], []
    for w in work:
        model = w.model.eval()
        example = w.make_inputs()
        samples = [w.make_inputs() for _ in range(n_samples)]
        params = sum(p.numel() for p in model.parameters())
        fp32 = float32_program(model, (), example)
        fp32_path = folder / f"{w.name}-fp32.pt2"
        torch.export.save(fp32, fp32_path)
        fp32_bytes = fp32_path.stat().st_size
        state = deploy.against_float32.state_bytes(fp32)
        print(
            f"- {w.name}: {w.config}; {params / 1e6:.2f} M parameters; float32 .pt2 "
            f"{mb(fp32_bytes)} MB, of which state {mb(state)} MB",
            flush=True,
        )
        paths: dict[tuple[str, str], Path] = {}
        programs: dict[tuple[str, str], ExportedProgram] = {}
        for dname, dtype in DTYPES.items():
            ratios = []
            for policy in POLICIES:
                program = amp_graph.export(model, (), example, policy=policy, dtype=dtype)
                path = deploy.save(program, folder / f"{w.name}-{policy}-{dname}.pt2", "pt2")
                paths[policy, dname] = path
                if onnx and (policy, dname) in ONNX_CASES:
                    programs[policy, dname] = program
                ratio = path.stat().st_size / fp32_bytes
                ratios.append(f"{ratio:.3f}" + ("" if ratio <= SIZE_TARGET else " (> 0.55)"))
            size_rows.append(
                f"| {w.name} | {params / 1e6:.2f} M | {mb(fp32_bytes)} | {dname} | "
                + " | ".join(ratios)
                + " |"
            )
        if onnx:
            fp32_onnx = folder / f"{w.name}-fp32.onnx"
            with quiet():
                deploy.save(fp32, fp32_onnx, "onnx", check=False)
            onnx_bytes = fp32_onnx.stat().st_size
            cells = [
                onnx_cell(
                    programs[case],
                    model,
                    folder / f"{w.name}-{'-'.join(case)}.onnx",
                    onnx_bytes,
                    samples,
                )
                for case in ONNX_CASES
            ]
            onnx_rows.append(f"| {w.name} | {mb(onnx_bytes)} | " + " | ".join(cells) + " |")
        for dname in error_dtypes:
            for policy in POLICIES:
                error_rows.append(
                    error_row(
                        w, model, paths[policy, dname], example, samples, policy, dname, folder
                    )
                )
                print(f"  ({error_rows[-1]})", file=sys.stderr, flush=True)
    print("\n### Saved .pt2 size / the float32 export's (target <= 0.55 for O2 and O3)\n")
    print("| model | parameters | float32 .pt2 MB | dtype | O1 | O2 | O3 |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    print("\n".join(size_rows))
    if onnx:
        print("\n### ONNX file size / the float32 ONNX file's; onnxruntime (CPU) on it\n")
        print("| model | float32 .onnx MB | fp16 O1 | fp16 O2 | fp16 O3 | bf16 O2 |")
        print("| --- | --- | --- | --- | --- | --- |")
        print("\n".join(onnx_rows))
    print_errors(error_rows)


ERROR_HEADER = (
    "| model | dtype | policy | tol | no calibration: rel L2 / max abs | with calibration: "
    "rel L2 / max abs | calibrated export s | demoted to float32 | within tol (without / with) "
    "| with not worse |"
)


def print_errors(rows: list[str], title: str = "") -> None:
    if not rows:
        return
    print(f"\n### Output error against float32 on the calibration inputs (the saved .pt2){title}\n")
    print(ERROR_HEADER)
    print("|" + " --- |" * (ERROR_HEADER.count("|") - 1))
    print("\n".join(rows))


def error_row(
    w: Workload,
    model: nn.Module,
    plain_path: Path | None,
    example: Inputs,
    samples: list[Inputs],
    policy: str,
    dname: str,
    folder: Path,
) -> str:
    """One row of the error table: the saved program without and with calibration."""
    dtype = DTYPES[dname]
    tol = 10 * torch.finfo(dtype).eps  # autopolicy's default: the policy's tolerance
    if plain_path is None:  # not exported for sizes (the stress model)
        program = amp_graph.export(model, (), example, policy=policy, dtype=dtype)
        plain_path = deploy.save(program, folder / f"{w.name}-{policy}-{dname}.pt2", "pt2")
    plain = error_against_float32(deploy.load(plain_path, "pt2"), model, samples)
    plain_within = "yes" if plain.rel_l2 <= tol else "no"
    start = time.perf_counter()
    try:
        program = amp_graph.export(
            model, (), example, policy=policy, dtype=dtype, calibration=samples
        )
    except AutopolicyError as error:
        seconds = time.perf_counter() - start
        reason = str(error).split(": ", 1)[0].replace("autopolicy ", "")
        return (
            f"| {w.name} | {dname} | {policy} | {tol:.2e} | {err(plain)} | n/a (AutopolicyError: "
            f"{reason}) | {seconds:.1f} | {len(error.policy.nodes)} tried | {plain_within} / -"
            " | no program |"
        )
    seconds = time.perf_counter() - start
    info = amp_graph.export_info(program)
    path = deploy.save(program, folder / f"{w.name}-{policy}-{dname}-calibrated.pt2", "pt2")
    calibrated = error_against_float32(deploy.load(path, "pt2"), model, samples)
    demoted = ", ".join(info.demoted) or "none"
    within = f"{plain_within} / {'yes' if calibrated.rel_l2 <= tol else 'no'}"
    not_worse = "yes" if calibrated.rel_l2 <= plain.rel_l2 else "NO"
    return (
        f"| {w.name} | {dname} | {policy} | {tol:.2e} | {err(plain)} | {err(calibrated)} | "
        f"{seconds:.1f} | {demoted} | {within} | {not_worse} |"
    )


def export_times(layers: int, rounds: int) -> None:
    """(a) torch.export fp32, (a') the same with the garbage collector paused as
    amp_graph.export pauses it, (b) the passes, (c) amp_graph.export, interleaved rounds.
    Every timed export starts after a full collection, so none pays for another's garbage."""

    def gpt(n: int) -> tuple[nn.Module, tuple[torch.Tensor]]:
        torch.manual_seed(0)
        model = models.GPT(vocab=64, block=16, dim=32, heads=2, layers=n).eval()
        return model, (torch.randint(0, 64, (1, 16)),)

    def fp32_export(n: int, paused: bool = False) -> tuple[float, int]:
        model, args = gpt(n)
        gc.collect()
        start = time.perf_counter()
        with gc_paused() if paused else contextlib.nullcontext():
            program = torch.export.export(model, args)
        return time.perf_counter() - start, len(program.graph.nodes)

    def ours(n: int) -> tuple[float, dict[str, float], int]:
        model, args = gpt(n)
        gc.collect()
        start = time.perf_counter()
        program = amp_graph.export(model, args, policy="O1", dtype=torch.bfloat16)
        wall = time.perf_counter() - start
        return wall, amp_graph.export_info(program).seconds, len(program.graph.nodes)

    fp32_export(2), ours(2)  # warm-up: torch.export's one-time start-up, outside the clock
    a, a_paused, b, c, stages = [], [], [], [], []
    nodes = (0, 0)
    print(
        "| round | (a) torch.export fp32 s | (a') same, GC paused s | (b) passes s | "
        "(c) amp_graph.export s | (c): capture / passes / lift s | c / (a + b) | c / (a' + b) |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for i in range(rounds):
        seconds_a, nodes_a = fp32_export(layers)
        seconds_a_paused, _ = fp32_export(layers, paused=True)
        seconds_c, info, nodes_c = ours(layers)
        nodes = (nodes_a, nodes_c)
        a.append(seconds_a)
        a_paused.append(seconds_a_paused)
        b.append(info["passes"])
        c.append(seconds_c)
        stages.append(info)
        print(
            f"| {i + 1} | {seconds_a:.2f} | {seconds_a_paused:.2f} | {info['passes']:.2f} | "
            f"{seconds_c:.2f} | {info['capture']:.2f} / {info['passes']:.2f} / "
            f"{info['lift']:.2f} | {seconds_c / (seconds_a + info['passes']):.2f} | "
            f"{seconds_c / (seconds_a_paused + info['passes']):.2f} |",
            flush=True,
        )
    med_a, med_ap, med_b, med_c = (statistics.median(x) for x in (a, a_paused, b, c))
    capture = statistics.median(s["capture"] for s in stages)
    lift = statistics.median(s["lift"] for s in stages)
    ratio = med_c / (med_a + med_b)
    per_round = statistics.median(z / (x + y) for x, y, z in zip(a, b, c, strict=True))
    per_round_paused = statistics.median(
        z / (x + y) for x, y, z in zip(a_paused, b, c, strict=True)
    )
    print(
        f"| median | {med_a:.2f} | {med_ap:.2f} | {med_b:.2f} | {med_c:.2f} | {capture:.2f} / "
        f"{med_b:.2f} / {lift:.2f} | {per_round:.2f} | {per_round_paused:.2f} |"
    )
    print(
        f"\nGPT, {layers} layers: {nodes[0]} nodes in the float32 export's graph, {nodes[1]} in "
        f"amp_graph.export's (its casts). c / (a + b) of the medians = {ratio:.2f}, median of "
        f"the rounds' = {per_round:.2f} (target <= {TIME_TARGET}): "
        f"{'met' if max(ratio, per_round) <= TIME_TARGET else 'missed'}; against torch.export "
        f"with the collector paused too, c / (a' + b) = {med_c / (med_ap + med_b):.2f} "
        f"(medians), {per_round_paused:.2f} (rounds); capture alone / (a) = "
        f"{capture / med_a:.2f}, / (a') = {capture / med_ap:.2f}; lift / (a) = {lift / med_a:.2f}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="small models, one timing round")
    parser.add_argument("--rounds", type=int, default=None, help="export-time rounds (5)")
    parser.add_argument("--samples", type=int, default=3, help="calibration samples")
    parser.add_argument("--skip", nargs="*", default=(), choices=("sizes", "onnx", "time"))
    parser.add_argument(
        "--error-dtypes",
        default=None,
        help="dtypes of the error table, comma separated (default fp16,bf16; --quick: fp16)",
    )
    args = parser.parse_args()
    error_dtypes = (args.error_dtypes or ("fp16" if args.quick else "fp16,bf16")).split(",")
    rounds = args.rounds or (1 if args.quick else 5)
    try:
        import onnxruntime

        onnxruntime.set_default_logger_severity(3)  # no constant-folding warnings
    except ImportError:
        pass
    print(
        f"{cpu_name()}; torch {torch.__version__}, {torch.get_num_threads()} threads; "
        f"{time.strftime('%Y-%m-%d')}\n"
    )
    if "sizes" not in args.skip:
        with tempfile.TemporaryDirectory() as folder:
            work = hf_workloads(args.quick)
            sizes_and_errors(
                work, Path(folder), error_dtypes, args.samples, "onnx" not in args.skip
            )
            stress = hf_workloads(args.quick, stress=True)[0]
            print(f"\nStress case: {stress.config}")
            rows = []
            for dname in error_dtypes[:1]:
                example = stress.make_inputs()
                samples = [stress.make_inputs() for _ in range(args.samples)]
                for policy in POLICIES:
                    rows.append(
                        error_row(
                            stress,
                            stress.model.eval(),
                            None,
                            example,
                            samples,
                            policy,
                            dname,
                            Path(folder),
                        )
                    )
            print_errors(rows, ": the stress case")
    if "time" not in args.skip:
        layers = 28 if args.quick else 280
        print(f"\n### Export time, GPT (dim 32, {layers} layers), O1 bf16; {rounds} rounds\n")
        export_times(layers, rounds)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
