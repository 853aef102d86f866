"""Issue 57's figures: O2 with the cast placement (``passes/place_casts.py``, an exact min-cut)
against O2's rules alone (``place_casts=False``), side by side in one run.

Per model (HF GPT-2, Llama and BERT at 8x512 tokens, width 128, 2 layers, vocabulary 2048,
a size this CPU steps in seconds; a BERT returning its attention maps
(``output_attentions=True``, attention dropout 0), which O2 returns in float32; a BERT
sequence classifier at BERT's own vocabulary, 30522, whose word table no head shares; a
diffusers UNet2DModel, 8 images of 32x32), bf16:

* the bytes cast per call, forward and backward (a value with a gradient has its gradient
  cast back), counted on the rewritten graph: amp_graph's casts and the model's own that
  convert; and the cut's own figure for the plan it chose (they agree: the graph's casts
  are the optimum, which tests/test_cast_cut.py checks against brute force);
* what the forward holds for backward (:mod:`amp_graph.inspect.held`);
* the step time, forward and backward: ``--repeats`` interleaved pairs, the median;
* the placement pass's own time per node of the graph.

Then the calibrated GPT-2 (one MLP overridden to float32): whether the island's output is
read in float32 without a cast; and the pass's time per node on GPT-style decoders of 1.6k
and 16k nodes (linear: a ratio near 1).

    python benchmarks/cast_placement.py            # the run recorded in BENCHMARKS.md
    python benchmarks/cast_placement.py --quick    # small inputs, one repeat (a smoke run)
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch
from amp_graph.passes.meta import AMP, has_cast_role
from amp_graph.passes.place_casts import converted_bytes
from measure import interleaved_seconds

import amp_graph
from amp_graph.demo import models
from amp_graph.frontends.compiler import compile_record
from amp_graph.inspect.held import held_for_backward

BF16 = torch.bfloat16


def o2(place: bool) -> amp_graph.Policy:
    return dataclasses.replace(amp_graph.Policy.preset("O2"), place_casts=place)


def build(name: str, quick: bool):
    """(model, kwargs, loss of the output) of a random config, from seed 0."""
    import transformers

    torch.manual_seed(0)
    batch, seq = (2, 64) if quick else (8, 512)
    tokens = torch.randint(0, 2048, (batch, seq))
    width = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=2, vocab_size=2048)
    if name == "gpt2":
        config = transformers.GPT2Config(
            n_positions=seq, n_embd=128, n_layer=2, n_head=2, vocab_size=2048, use_cache=False
        )
        return transformers.GPT2LMHeadModel(config), {"input_ids": tokens}
    if name == "llama":
        config = transformers.LlamaConfig(
            **width, intermediate_size=344, max_position_embeddings=seq, use_cache=False
        )
        return transformers.LlamaForCausalLM(config), {"input_ids": tokens}
    if name == "bert":
        config = transformers.BertConfig(
            **width, intermediate_size=512, max_position_embeddings=seq
        )
        return transformers.BertForMaskedLM(config), {"input_ids": tokens}
    if name == "bert-attn":  # returning its attention maps, which O2 returns in float32
        config = transformers.BertConfig(  # attention dropout 0, as ViT's and Llama's
            **width,
            intermediate_size=512,
            max_position_embeddings=seq,
            attn_implementation="eager",
            attention_probs_dropout_prob=0.0,
        )
        return transformers.BertModel(config), {"input_ids": tokens, "output_attentions": True}
    if name == "bert-cls":  # fine-tuning a classifier: BERT's own vocabulary, no tied head
        config = transformers.BertConfig(
            **{**width, "vocab_size": 30522}, intermediate_size=512, max_position_embeddings=seq
        )
        tokens = torch.randint(0, 30522, (batch, seq))
        return transformers.BertForSequenceClassification(config), {"input_ids": tokens}
    import diffusers

    unet = diffusers.UNet2DModel(
        sample_size=32,
        block_out_channels=(32, 64),
        layers_per_block=1,
        down_block_types=("DownBlock2D", "AttnDownBlock2D"),
        up_block_types=("AttnUpBlock2D", "UpBlock2D"),
        norm_num_groups=8,
    )
    images = 2 if quick else 8
    return unet, {"sample": torch.randn(images, 3, 32, 32), "timestep": torch.tensor(10)}


def loss_of(out) -> torch.Tensor:
    value = next(getattr(out, k) for k in ("logits", "sample", "last_hidden_state") if k in out)
    return value.float().square().mean()


def one_model(name: str, repeats: int, quick: bool) -> None:
    rows = {}
    steps = {}
    for place in (False, True):
        model, kwargs = build(name, quick)
        compiled = amp_graph.compile(model, policy=o2(place), dtype=BF16)
        compiled(**kwargs)
        gm = compiled.graph_module
        record = compile_record(gm)
        params = [*model.parameters(), *model.buffers()]
        held, out = held_for_backward(lambda c=compiled, k=kwargs: c(**k), exclude=params)
        loss_of(out).backward()
        rows[place] = {
            "graph": converted_bytes(gm, BF16),
            "cut": record.stats.get("placed_cast_bytes_after"),
            "moved": record.stats.get("ops_moved_up", 0),
            "held": held,
            "pass_us_per_node": 1e6
            * record.seconds.get("place_casts", 0.0)
            / len(record.original.graph.nodes),
        }

        def step(c=compiled, k=kwargs, m=model) -> None:
            m.zero_grad(set_to_none=True)
            loss_of(c(**k)).backward()

        steps["placed" if place else "rules"] = step
    times = interleaved_seconds(steps, repeats, warmup=1)
    ratio = statistics.median(p / r for p, r in zip(times["placed"], times["rules"], strict=True))
    rules, placed = rows[False], rows[True]
    print(
        f"{name:6s} cast bytes/call {rules['graph'] / 2**20:8.2f} MiB -> "
        f"{placed['graph'] / 2**20:8.2f} MiB = {placed['graph'] / rules['graph']:.3f}x "
        f"(cut's optimum {placed['cut'] / 2**20:.2f} MiB; {placed['moved']} ops raised) | "
        f"held {placed['held'] / rules['held']:.3f}x | step {ratio:.3f}x "
        f"(rules {statistics.median(times['rules']) * 1e3:.0f} ms) | "
        f"pass {placed['pass_us_per_node']:.1f} us/node"
    )


def calibrated_island() -> None:
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_positions=64, n_embd=64, n_layer=2, n_head=2, vocab_size=100, use_cache=False
    )
    for place in (False, True):
        model = transformers.GPT2LMHeadModel(config)
        policy = o2(place).override(modules={"transformer.h.0.mlp": "fp32"})
        compiled = amp_graph.compile(model, policy=policy, dtype=BF16)
        compiled(input_ids=torch.randint(0, 100, (2, 16)))
        nodes = list(compiled.graph_module.graph.nodes)
        last = [n for n in nodes if n.meta[AMP].module_path.startswith("transformer.h.0.mlp")]
        exit_node = next(n for n in reversed(last) if not has_cast_role(n))
        cast_down = any(has_cast_role(u) for u in exit_node.users)
        print(
            f"calibrated GPT-2 (h.0.mlp fp32), place_casts={place}: the island's output "
            f"{'is cast down for' if cast_down else 'is read in float32 by'} "
            f"{', '.join(u.name for u in exit_node.users)}"
        )


def pass_growth(quick: bool) -> None:
    per_node = []
    for layers in (4, 40) if quick else (44, 444):
        torch.manual_seed(0)
        model = models.GPT(vocab=64, block=16, dim=32, heads=2, layers=layers)
        start = time.perf_counter()
        idx = torch.randint(0, 64, (1, 16))
        compiled = amp_graph.compile(model, o2(True), BF16, example_inputs=(idx,))
        wall = time.perf_counter() - start
        record = compile_record(compiled)
        nodes = len(record.original.graph.nodes)
        us = 1e6 * record.seconds["place_casts"] / nodes
        per_node.append(us)
        print(
            f"GPT {layers} layers ({nodes} nodes): place_casts {us:.1f} us/node, "
            f"{record.seconds['place_casts']:.2f} s of the compile's {wall:.1f} s"
        )
    print(f"place_casts per node, largest / smallest graph: {per_node[-1] / per_node[0]:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    repeats = 1 if args.quick else args.repeats
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; O2, bf16, on the CPU")
    for name in ("gpt2", "llama", "bert", "bert-attn", "bert-cls", "unet"):
        one_model(name, repeats, args.quick)
    calibrated_island()
    pass_growth(args.quick)


if __name__ == "__main__":
    main()
