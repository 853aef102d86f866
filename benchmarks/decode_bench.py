"""Benchmark: HF generate with a KV cache, amp_graph.compile_ against eager torch.autocast.

A random GPT-2 (no download) generates greedily from a prompt, three ways, side by side in
one process, interleaved round by round (``measure.interleaved_seconds``):

* ``autocast``: the model itself, ``generate`` under ``torch.autocast(device, bf16)``: the
  reference;
* ``amp_graph O1``: ``amp_graph.compile_(model, "O1", bf16)``, then ``generate``;
* ``amp_graph autocast``: the same with ``policy="autocast"``.

Measured per variant: the **prefill** (one forward over the prompt without a cache, which
runs amp_graph's captured graph) and the **per-token decode** time, ``(generate of 1 + N
tokens - generate of 1 token) / N``, where every call holds a KV cache and amp_graph runs
its decode graphs, the cache's tensors their inputs and outputs
(``amp_graph/frontends/cached_decode.py``). ``--cache static`` decodes with a StaticCache
(``cache_implementation="static"``).
Reported: medians, and each variant's ratio to ``autocast`` (the median of per-round
ratios). Target: <= 1.0 on both.

Run:  python benchmarks/decode_bench.py                  (about 1 minute on 2 CPU cores)
      python benchmarks/decode_bench.py --new-tokens 16 --rounds 10
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import statistics
from collections.abc import Callable

import torch
from measure import interleaved_seconds

import amp_graph


def gpt2(layers: int, width: int, vocab: int) -> torch.nn.Module:
    import transformers

    config = transformers.GPT2Config(
        n_positions=512,
        n_embd=width,
        n_layer=layers,
        n_head=width // 64,
        vocab_size=vocab,
        use_cache=False,  # the captured forward; generate passes use_cache=True
    )
    config.bos_token_id = config.eos_token_id = config.pad_token_id = 0
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config).eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--cache", choices=("dynamic", "static"), default="dynamic")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device, dtype = "cpu", torch.bfloat16
    base = gpt2(args.layers, args.width, args.vocab)
    prompt = torch.randint(
        1, args.vocab, (args.batch, args.prompt), generator=torch.Generator().manual_seed(1)
    )
    models = {"autocast": base}
    for policy in ("O1", "autocast"):
        model = copy.deepcopy(base)
        amp_graph.compile_(model, policy, dtype, example_kwargs={"input_ids": prompt})
        models[f"amp_graph {policy}"] = model

    def inference(name: str) -> contextlib.ExitStack:
        """No gradients, and torch.autocast around the reference alone."""
        stack = contextlib.ExitStack()
        stack.enter_context(torch.no_grad())
        stack.enter_context(torch.autocast(device, dtype, enabled=name == "autocast"))
        return stack

    def generate(name: str, tokens: int) -> Callable[[], object]:
        model = models[name]
        options = dict(max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
        if args.cache == "static":
            options["cache_implementation"] = "static"

        def run() -> object:
            with inference(name):
                return model.generate(prompt, use_cache=True, **options)

        return run

    def prefill(name: str) -> Callable[[], object]:
        model = models[name]

        def run() -> object:
            with inference(name):
                return model(input_ids=prompt, use_cache=False)

        return run

    steps: dict[str, Callable[[], object]] = {}
    for name in models:
        steps[f"{name}|prefill"] = prefill(name)
        steps[f"{name}|gen1"] = generate(name, 1)
        steps[f"{name}|genN"] = generate(name, 1 + args.new_tokens)
    times = interleaved_seconds(steps, args.rounds, warmup=2, device=device)

    def per_round(name: str, what: str) -> list[float]:
        if what == "prefill":
            return times[f"{name}|prefill"]
        return [
            (n - one) / args.new_tokens
            for n, one in zip(times[f"{name}|genN"], times[f"{name}|gen1"], strict=True)
        ]

    print(
        f"GPT-2 {args.layers} layers x {args.width}, vocab {args.vocab}; prompt "
        f"{args.batch}x{args.prompt}, {args.new_tokens} new tokens, {args.cache} cache, "
        f"bf16 on {device}, "
        f"{torch.get_num_threads()} threads, torch {torch.__version__}, {args.rounds} rounds"
    )
    print(f"{'variant':<22}{'prefill ms':>12}{'ratio':>8}{'decode ms/token':>18}{'ratio':>8}")
    for name in models:
        row = f"{name:<22}"
        for what in ("prefill", "decode"):
            mine, ref = per_round(name, what), per_round("autocast", what)
            ratio = statistics.median(m / r for m, r in zip(mine, ref, strict=True))
            width = 12 if what == "prefill" else 18
            row += f"{statistics.median(mine) * 1e3:>{width}.2f}{ratio:>8.2f}"
        print(row)


if __name__ == "__main__":
    main()
