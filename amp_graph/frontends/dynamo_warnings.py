"""What the dynamo backend says where dynamo runs code without it, in float32.

Dynamo calls a backend per graph; what it runs without calling one (code between graphs,
frames past ``torch._dynamo.config.recompile_limit``, frames whose compile failed under
``suppress_errors``) runs as written, with autocast off. The backend cannot convert that
code, but it can say so where it sees it coming: the compile that reaches the limit, its
own failure under ``suppress_errors``, and torch's fused inference fast paths, which
dynamo's trace (without autocast) takes and no policy rule can cast. Each function here
returns the message, or None where there is nothing to say; the backend warns.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from amp_graph.passes.classify import normalize_module_path
from amp_graph.passes.meta import short

# torch's fused inference kernels (nn.TransformerEncoderLayer / nn.MultiheadAttention in eval
# under no_grad): no autocast list names them, so they compute in their inputs' float32
FAST_PATH_OPS = frozenset(
    {"aten::_transformer_encoder_layer_fwd", "aten::_native_multi_head_attention"}
)


SUPPRESSED_FAILURE = (
    "amp_graph.backend failed to compile a graph while torch._dynamo.config.suppress_errors "
    "is True: dynamo will run this frame as written, without amp_graph and without "
    "torch.autocast, so in float32 (the error follows in dynamo's log). Fix the error, or "
    "set suppress_errors=False to have it raised."
)


def recompile_limit_warning(owner: str) -> str | None:
    """What to say when the compile now running is the last one dynamo allows for its frame
    (``torch._dynamo.config.recompile_limit``, which ``torch.compile`` may patch for its own
    compiles); None otherwise, and when ``fail_on_recompile_limit_hit`` makes the next one
    raise instead.

    Past the limit dynamo runs the frame for each new input signature as written, without
    calling any backend and without torch.autocast: in float32, which the backend cannot see.
    The count is dynamo's own (``CompileId.frame_compile_id``, its ``[frame/compile]`` log
    prefix), so the warning comes once per frame, at the compile numbered ``limit - 1``.
    """
    from torch._guards import CompileContext

    compile_id = CompileContext.current_compile_id()
    config = torch._dynamo.config
    if compile_id is None or compile_id.frame_compile_id is None:
        return None  # not called from a dynamo compile
    if getattr(config, "fail_on_recompile_limit_hit", False):
        return None
    limit = config.recompile_limit
    if compile_id.frame_compile_id + 1 != limit:
        return None
    hard_failure = (
        ", or set torch._dynamo.config.fail_on_recompile_limit_hit = True to get an error "
        "instead of float32"
        if hasattr(config, "fail_on_recompile_limit_hit")
        else ""
    )
    return (
        f"amp_graph.backend: dynamo has now compiled {_frame_name(owner)} {limit} times (frame "
        f"{compile_id}), its recompile_limit. It compiles this frame no more: each later "
        "input it has no graph for (a new shape with static shapes, a new dtype, a new "
        "Python value it guards on) runs as written, without amp_graph and without "
        "torch.autocast, so in float32, with only dynamo's own warning. To avoid it, compile "
        "with dynamic=True or torch._dynamo.mark_dynamic(x, dim) on the varying sizes, raise "
        f"torch._dynamo.config.recompile_limit{hard_failure}."
    )


def _frame_name(owner: str) -> str:
    """The function dynamo is compiling, as its own recompile warning names it
    (``'forward' (model.py:12)``); ``owner`` (the graph's) where dynamo does not say."""
    try:  # a private API: the frame being traced
        from torch._dynamo.symbolic_convert import InstructionTranslator

        code = InstructionTranslator.current_tx().f_code
    except Exception:
        return owner
    return f"{code.co_name!r} ({code.co_filename}:{code.co_firstlineno})"


def fast_path_modules(gm: fx.GraphModule) -> list[str]:
    """The module paths of the nodes of ``gm`` that call torch's fused inference kernels
    (:data:`FAST_PATH_OPS`), in graph order, each once."""
    found: dict[str, None] = {}
    for node in gm.graph.nodes:
        target = node.target
        if isinstance(target, torch._ops.OpOverload) and target._schema.name in FAST_PATH_OPS:
            stack = list((node.meta.get("nn_module_stack") or {}).values())
            found[normalize_module_path(stack[-1][0]) if stack else node.name] = None
    return list(found)


def fast_path_warning(modules: list[str], dtype: torch.dtype) -> str:
    """Say that ``modules`` run torch's fused fast path in float32, and how to get
    torch.autocast's path instead."""
    return (
        f"amp_graph.backend: {', '.join(repr(m) for m in modules[:4])}"
        f"{' ...' if len(modules) > 4 else ''} run torch's fused inference fast path "
        "(nn.TransformerEncoderLayer / nn.MultiheadAttention in eval under no_grad), one "
        f"kernel no policy rule can cast: they compute in float32, not {short(dtype)}. Dynamo "
        "traces without torch.autocast, so torch takes the fast path that eager autocast "
        "skips (calling under torch.autocast does not change this trace). For autocast's "
        "path, call torch.backends.mha.set_fastpath_enabled(False) before compiling."
    )


__all__ = [
    "FAST_PATH_OPS",
    "SUPPRESSED_FAILURE",
    "fast_path_modules",
    "fast_path_warning",
    "recompile_limit_warning",
]
