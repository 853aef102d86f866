"""Every ```python block of README.md, ARCHITECTURE.md and docs/*.md runs in the suite, so a
renamed argument or a removed API fails here, naming the page and the block.

What this test guarantees:

* Each page's ```python blocks (found by :data:`FENCE`, in page order, indented ones in list
  items included) run in order in one namespace, as a reader would paste them: a later block
  may use what an earlier one defined. One test per page that has such blocks (its id is the
  file name). A failure names the page, the block's index and the line and text of its first
  line of code, and the traceback points at the block's lines in the page.
* What the prose around a block assumes the reader has (``model``, ``x``, ``loss_fn``,
  ``loader``...) comes from :data:`SETUPS`, page by page and block by block: small random
  models and batches, made just before the block they serve (a block that starts an example
  of its own gets its own). Nothing in a block is rewritten before it runs. The blocks of
  docs/training.md that shard with FSDP2 and wrap with DDP run in a one-process gloo group
  that their setup opens (the test closes it).
* A block that cannot run on a CPU-only machine in one process says so in the page, in its
  first line: ``# needs: cuda`` (a CUDA device: ``torch.cuda.is_available()``) or
  ``# needs: torchrun`` (several processes launched by torchrun with their process group
  initialized: ``torch.distributed`` initialized with a world size above 1, which this suite
  never is; tests/test_pipeline_parallel.py and tests/test_tensor_parallel.py run those
  recipes on gloo ranks), or both, comma-separated. Such a block runs where its needs are
  met. Elsewhere it is checked, not run: it must compile, its imports from amp_graph and
  torch must work, the ``amp_graph.<name>`` and ``torch.<name>`` chains it reads must
  exist, and each call it makes of an amp_graph or torch callable must bind to that
  callable's signature (so a renamed keyword fails there too). An unknown need is an error.
* Output and pseudo-code are not ```python blocks (``text`` fences), so nothing else runs.

``test_a_failing_block_is_named`` and ``test_a_marked_block_is_checked_not_run`` run the
runner on made-up pages whose blocks fail. Files the blocks write (``model.pt2``,
``runs/amp``, ``repro/``, checkpoints) go to a temporary working directory.
"""

from __future__ import annotations

import ast
import inspect
import re
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sample_model import SmallNet

import amp_graph
from amp_graph.demo.models import MLP, ResidualMLP

ROOT = Path(__file__).resolve().parents[1]
PAGES = [
    "README.md",
    "ARCHITECTURE.md",
    *sorted(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md")),
]

# A ```python fence, possibly indented (in a list item), up to the closing fence at the same
# indentation.
FENCE = re.compile(
    r"^(?P<indent>[ \t]*)```python[ \t]*\n(?P<code>.*?)^(?P=indent)```[ \t]*$", re.M | re.S
)
NEEDS = re.compile(r"#\s*needs:\s*(?P<needs>.*)")


def _distributed_launch() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


MET: dict[str, Callable[[], bool]] = {
    "cuda": torch.cuda.is_available,
    "torchrun": _distributed_launch,
}


@dataclass(frozen=True)
class Block:
    page: str
    index: int
    line: int  # the page's line of the block's first line (the one after its fence)
    code: str

    @property
    def first_line(self) -> tuple[int, str]:
        """The page's line number and text of the block's first line of code (after its
        ``# needs:`` marker, if any)."""
        for number, text in enumerate(self.code.splitlines(), self.line):
            if text.strip() and not NEEDS.fullmatch(text.strip()):
                return number, text.strip()
        return self.line, ""

    @property
    def needs(self) -> frozenset[str]:
        first = self.code.splitlines()[0] if self.code else ""
        found = NEEDS.fullmatch(first.strip())
        if found is None:
            return frozenset()
        return frozenset(n.strip() for n in found["needs"].split(",") if n.strip())

    def __str__(self) -> str:
        number, text = self.first_line
        return f"{self.page} block {self.index} (line {number}: {text!r})"


class DocBlockFailed(AssertionError):
    """A block of a page failed: its message names the page, the block and its first line."""


def blocks_of(page: str, text: str) -> list[Block]:
    blocks = []
    for index, found in enumerate(FENCE.finditer(text)):
        indent = len(found["indent"])
        code = "".join(line[indent:] for line in found["code"].splitlines(keepends=True))
        line = text.count("\n", 0, found.start("code")) + 1
        blocks.append(Block(page, index, line, code))
    return blocks


Setup = Callable[[dict[str, Any]], None]


def run_page(
    page: str, text: str, setups: Mapping[int, Setup], namespace: dict[str, Any]
) -> list[tuple[Block, bool]]:
    """Run ``page``'s blocks in order in ``namespace`` (``setups[i]`` first, before block
    ``i``); returns each block with whether it ran (False: its needs are unmet here, and it
    was only checked). Raises :class:`DocBlockFailed` naming the block that failed."""
    done = []
    for block in blocks_of(page, text):
        unknown = block.needs - MET.keys()
        if unknown:
            raise DocBlockFailed(f"{block}: unknown need {sorted(unknown)}; known: {sorted(MET)}")
        try:
            # Blank lines first, so that a traceback's line numbers are the page's.
            code = compile("\n" * (block.line - 1) + block.code, page, "exec")
        except SyntaxError as error:
            raise DocBlockFailed(f"{block} does not compile: {error}") from error
        runs = all(MET[need]() for need in block.needs)
        try:
            if not runs:
                check_names(block, namespace)
            else:
                if block.index in setups:
                    setups[block.index](namespace)
                exec(code, namespace)
        except Exception as error:
            raise DocBlockFailed(f"{block} raised {type(error).__name__}: {error}") from error
        done.append((block, runs))
    return done


# ---- what a block that does not run is checked for ---------------------------------------


def _dotted(node: ast.expr) -> list[str] | None:
    """``a.b.c`` as ``["a", "b", "c"]``; None for anything but names and attributes."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return [node.id, *reversed(parts)]


OURS = ("amp_graph", "torch")


def _ours(obj: Any) -> bool:
    module = obj.__name__ if inspect.ismodule(obj) else getattr(obj, "__module__", None)
    return isinstance(module, str) and module.split(".")[0] in OURS


def check_names(block: Block, namespace: Mapping[str, Any]) -> None:
    """For a block that cannot run here: its imports from amp_graph and torch work, the
    ``amp_graph.<name>`` (and ``torch.<name>``) chains it reads exist, and its calls of
    amp_graph and torch callables bind to their signatures. Names the block takes from
    elsewhere (``model``, ``stage``) are not checked, nor imports of other packages that are
    not installed here."""
    tree = ast.parse(block.code)
    known: dict[str, Any] = {"torch": torch, "amp_graph": amp_graph, **namespace}
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            modules = (
                [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module]
            )
            try:
                exec(compile(ast.Module([node], []), block.page, "exec"), known)
            except ImportError:
                if any(str(m).split(".")[0] in OURS for m in modules):
                    raise
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Attribute, ast.Call)):
            continue
        parts = _dotted(node.func if isinstance(node, ast.Call) else node)
        if not parts or known.get(parts[0]) is None:
            continue
        obj = known[parts[0]]
        for i, attr in enumerate(parts[1:], 1):
            if not hasattr(obj, attr):
                if inspect.ismodule(obj) and _ours(obj):
                    raise AttributeError(f"{'.'.join(parts[:i])} has no attribute {attr!r}")
                obj = None
                break
            obj = getattr(obj, attr)
        if isinstance(node, ast.Call) and callable(obj) and _ours(obj):
            _bind(obj, node, ".".join(parts))


def _bind(obj: Any, call: ast.Call, name: str) -> None:
    if any(isinstance(a, ast.Starred) for a in call.args) or any(
        k.arg is None for k in call.keywords
    ):
        return  # *args / **kwargs: nothing to check by name
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):
        return  # a builtin without a signature
    try:
        signature.bind(*call.args, **{k.arg: k.value for k in call.keywords if k.arg})
    except TypeError as error:
        raise TypeError(f"{name}(...): {error}; the signature is {name}{signature}") from None


# ---- what the pages assume --------------------------------------------------------------


class ExpBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.exp(self.fc(x))


class ExpNet(nn.Module):
    """``fc``, then a ``block`` whose ``exp`` overflows float16 on inputs scaled by 30 (float32
    stays finite), then a ``head`` and a ``softmax``: what docs/compile.md's numerics, autopolicy
    and export examples look for."""

    def __init__(self, width: int = 16, classes: int = 4) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.block = ExpBlock(width)
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e = self.block(self.fc(x))
        return torch.softmax(self.head(e / e.sum(-1, keepdim=True)), dim=-1)


class TinyLM(nn.Module):
    """Token ids (vocabulary 1000, at most 64 positions) to logits, with dropout: an LM whose
    forward takes ``input_ids``, for docs/deploy.md."""

    def __init__(self, vocab: int = 1000, positions: int = 64, dim: int = 16) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(positions, dim)
        self.drop = nn.Dropout(0.1)
        self.fc = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(input_ids.shape[1], device=input_ids.device)
        h = self.drop(self.tok(input_ids) + self.pos(pos))
        return self.head(F.gelu(self.fc(h)))


class Layers(nn.Module):
    """Token ids through ``layers`` (for ``plan_fsdp``'s units) to logits."""

    def __init__(self, vocab: int = 64, dim: int = 16, n: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, dim), nn.GELU()) for _ in range(n)
        )
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for layer in self.layers:
            h = h + layer(h)
        return self.head(h)


class MyAttention(nn.Module):
    """The attention module type docs/policies.md overrides."""


def _base(ns: dict[str, Any]) -> None:
    """What every page's reader has imported."""
    ns.update(torch=torch, nn=nn, F=F, amp_graph=amp_graph)


Batch = tuple[torch.Tensor, torch.Tensor]


def _batches(n: int, shape: tuple[int, ...], classes: int, scale: float = 1.0) -> list[Batch]:
    """``n`` (inputs, class targets) pairs, the inputs of ``shape`` times ``scale``."""
    g = torch.Generator().manual_seed(0)
    return [
        (torch.randn(shape, generator=g) * scale, torch.randint(0, classes, shape[:1], generator=g))
        for _ in range(n)
    ]


def _data_loader(
    rows: int, features: int, classes: int, batch_size: int
) -> torch.utils.data.DataLoader:
    [(x, y)] = _batches(1, (rows, features), classes)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=batch_size)


def _small_net(ns: dict[str, Any]) -> None:
    """tests/sample_model.py's SmallNet (conv, batch norm, linear ``head``, ``softmax``)."""
    torch.manual_seed(0)
    ns.update(MyModel=SmallNet, model=SmallNet(), loss_fn=F.cross_entropy)
    ns["x"], ns["y"] = _batches(1, (4, 3, 8, 8), 10)[0]


def _hf_gpt2_config() -> Any:
    import transformers

    return transformers.GPT2Config(
        n_positions=32, n_embd=16, n_layer=1, n_head=2, vocab_size=64, use_cache=False
    )


def _readme(ns: dict[str, Any]) -> None:
    import transformers

    _small_net(ns)
    ns["hf_model"] = transformers.GPT2LMHeadModel(_hf_gpt2_config())


def _compile_page(ns: dict[str, Any]) -> None:
    torch.manual_seed(0)
    model = ExpNet()
    (x, y), (x1, _), (x2, _) = _batches(3, (8, 16), 4, scale=30.0)
    compiled = amp_graph.compile(model, "O1", torch.bfloat16, example_inputs=(x,))
    ns.update(MyModel=ExpNet, model=model, x=x, y=y, x1=x1, x2=x2, compiled=compiled)
    ns["loss_fn"] = lambda out: out.float().square().mean()  # numerics' loss_fn(output)


def _compile_loss(ns: dict[str, Any]) -> None:
    """A classifier whose logits are low under O1, and a loss computed outside the graph."""
    torch.manual_seed(0)
    ns["model"] = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    ns["x"], ns["y"] = _batches(1, (8, 16), 4)[0]
    ns["loss_fn"] = F.cross_entropy


def _compile_monitor(ns: dict[str, Any]) -> None:
    ns["loss_fn"] = F.cross_entropy  # the loop's loss_fn(output, target)
    ns["loader"] = _batches(3, (8, 16), 4)
    ns["scaler"] = amp_graph.GradScaler(init_scale=2.0**8)


def _inspect_diffs(ns: dict[str, Any]) -> None:
    model, x = ns["model"], ns["x"]
    keep_head = amp_graph.Policy.preset("O1").override(modules={"head": amp_graph.KEEP_FP32})
    ns["compiled_o1"] = amp_graph.compile(model, "O1", torch.bfloat16, example_inputs=(x,))
    ns["compiled_with_override"] = amp_graph.compile(
        model, keep_head, torch.bfloat16, example_inputs=(x,)
    )


def _deploy_page(ns: dict[str, Any]) -> None:
    torch.manual_seed(0)
    ns["MyModel"] = SmallNet
    g = torch.Generator().manual_seed(1)
    ns.update({f"x{i}": torch.randn(4, 3, 32, 32, generator=g) for i in (1, 2, 3)})


def _deploy_lm(ns: dict[str, Any]) -> None:
    ns["model"] = TinyLM()
    ns["ids"] = torch.randint(0, 1000, (4, 16), generator=torch.Generator().manual_seed(2))


def _fp8_page(ns: dict[str, Any]) -> None:
    torch.manual_seed(0)
    model = MLP(in_features=32, hidden=32, classes=16)  # fc1, fc2, head
    ns.update(model=model, x=torch.randn(16, 32))
    ns["weight"], ns["bias"] = torch.randn(32, 32), torch.randn(32)


def _integrations_page(ns: dict[str, Any]) -> None:
    torch.manual_seed(0)
    ns["model"] = MLP()


def _integrations_trainer(ns: dict[str, Any]) -> None:
    from transformers import GPT2LMHeadModel, Trainer, TrainingArguments

    ns.update(GPT2LMHeadModel=GPT2LMHeadModel, Trainer=Trainer, TrainingArguments=TrainingArguments)
    ns["config"] = _hf_gpt2_config()
    ids = torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(0))
    ns["ds"] = [{"input_ids": r, "labels": r} for r in ids]


def _integrations_accelerate(ns: dict[str, Any]) -> None:
    from accelerate import Accelerator

    torch.manual_seed(0)
    ns.update(Accelerator=Accelerator, model=MLP(), loss_fn=F.cross_entropy)
    ns["loader"] = _data_loader(16, 64, 10, batch_size=8)


def _monitor_page(ns: dict[str, Any]) -> None:
    torch.manual_seed(0)
    model = MLP(in_features=16, hidden=16, classes=4)
    ns.update(model=model, loss_fn=F.cross_entropy, loader=_batches(3, (8, 16), 4))
    ns["opt"] = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ns["scaler"] = amp_graph.GradScaler(init_scale=2.0**8)


def _monitor_selectors(ns: dict[str, Any]) -> None:
    """Block 1 is an example of its own: block 0's compiled module already has a monitor."""
    ns["compiled"] = amp_graph.compile(ns["model"], "O1", torch.float16)


class MonitoredGraph(amp_graph.Graph):
    """docs/monitor.md's ``TrainGraph(model, opt)``: bfloat16, so the non-finite guard skips."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        super().__init__()
        self.model = model
        self.add_optimizer(optimizer)
        self.config.enable_amp(True, policy="O1", dtype=torch.bfloat16)

    def build(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.cross_entropy(self.model(x), y)
        loss.backward()
        return loss


def _with_an_inf(batches: list[Batch], at: int) -> list[Batch]:
    """``batches`` with an inf in batch ``at``: that step's gradients are inf/nan, it is skipped."""
    x, y = batches[at]
    x = x.clone()
    x[0, 0] = float("inf")
    batches[at] = (x, y)
    return batches


def _monitor_graph_repro(ns: dict[str, Any]) -> None:
    torch.manual_seed(0)
    model = MLP(in_features=16, hidden=16, classes=4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ns.update(TrainGraph=MonitoredGraph, model=model, opt=opt, graph=MonitoredGraph(model, opt))
    ns["loader"] = _with_an_inf(_batches(4, (8, 16), 4), at=2)


def _monitor_compiled_repro(ns: dict[str, Any]) -> None:
    torch.manual_seed(0)
    ns["MyModel"] = lambda: MLP(in_features=16, hidden=16, classes=4)
    model = ns["model"] = ns["MyModel"]()
    opt = ns["opt"] = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ns["sched"] = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.9)
    ns["scaler"] = amp_graph.GradScaler(init_scale=2.0**8)
    ns["loader"] = _with_an_inf(_batches(4, (8, 16), 4), at=2)


def _policies_page(ns: dict[str, Any]) -> None:
    ns["MyAttention"] = MyAttention


def _training_page(ns: dict[str, Any]) -> None:
    torch.manual_seed(0)
    model = MLP(in_features=16, hidden=16, classes=4)
    ns.update(model=model, loss_fn=F.cross_entropy, loader=_batches(2, (8, 16), 4))
    ns["opt"] = torch.optim.AdamW(model.parameters(), lr=1e-3)


def _open_process_group(ns: dict[str, Any]) -> None:
    """One process is a whole world: FSDP2 and DDP run in it as on each rank of torchrun's."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    torch.manual_seed(0)
    ns.update(DDP=DDP, model=ResidualMLP(width=16, blocks=2))
    ns["plain_model"] = ResidualMLP(width=16, blocks=2)


def _training_plan(ns: dict[str, Any]) -> None:
    torch.manual_seed(0)
    ns["model"] = Layers()
    ns["tokens"] = torch.randint(0, 64, (2, 8))


def _close_process_group() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _training_lightning(ns: dict[str, Any]) -> None:
    import lightning

    _close_process_group()

    class Classifier(lightning.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = MLP(in_features=16, hidden=16, classes=4)

        def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], _: int) -> torch.Tensor:
            x, y = batch
            return F.cross_entropy(self.net(x), y)

        def on_train_batch_end(self, *_: Any) -> None:
            self.trainer.should_stop = True  # one step: the block sets no max_epochs

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    torch.manual_seed(0)
    ns["module"] = Classifier()
    ns["train_loader"] = _data_loader(8, 16, 4, batch_size=8)


def _device_page(ns: dict[str, Any]) -> None:
    """For the blocks marked ``# needs: cuda``, where they run: a model and batches there."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    ns.update(MyModel=lambda: MLP(in_features=16, hidden=16, classes=4), loss_fn=F.cross_entropy)
    ns["loader"] = [(x.to(device), y.to(device)) for x, y in _batches(2, (8, 16), 4)]


SETUPS: dict[str, dict[int, Setup]] = {
    "README.md": {0: _readme},
    "docs/backend.md": {0: _small_net},
    "docs/compile.md": {0: _compile_loss, 1: _compile_page, 3: _compile_monitor},
    "docs/deploy.md": {0: _deploy_page, 1: _deploy_lm},
    "docs/fp8.md": {0: _fp8_page},
    "docs/inspect.md": {0: _small_net, 2: _inspect_diffs},
    "docs/integrations.md": {
        0: _integrations_page,
        1: _integrations_trainer,
        2: _integrations_accelerate,
    },
    "docs/monitor.md": {
        0: _monitor_page,
        1: _monitor_selectors,
        2: _monitor_graph_repro,
        3: _monitor_compiled_repro,
    },
    "docs/policies.md": {0: _policies_page},
    "docs/scaler.md": {0: _device_page},
    "docs/training.md": {
        0: _training_page,
        1: _open_process_group,
        2: _training_plan,
        3: _training_lightning,
    },
}

PAGES_WITH_CODE = [p for p in PAGES if blocks_of(p, (ROOT / p).read_text(encoding="utf-8"))]


@pytest.mark.parametrize("page", PAGES_WITH_CODE, ids=[Path(p).name for p in PAGES_WITH_CODE])
def test_page_code_runs(page: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # what the blocks write stays out of the repository
    namespace: dict[str, Any] = {"__name__": "__docs__"}
    _base(namespace)
    try:
        run_page(page, (ROOT / page).read_text(encoding="utf-8"), SETUPS.get(page, {}), namespace)
    finally:
        _close_process_group()


def test_setups_name_existing_blocks() -> None:
    for page, setups in SETUPS.items():
        count = len(blocks_of(page, (ROOT / page).read_text(encoding="utf-8")))
        assert page in PAGES and set(setups) <= set(range(count)), (page, sorted(setups), count)


MADE_UP = """# A page

```python
x = 1
```

Some prose.

  ```python
  y = x + 1
  ```

```python
assert y == 3, "two is not three"
```
"""


def test_a_failing_block_is_named() -> None:
    namespace: dict[str, Any] = {}
    with pytest.raises(DocBlockFailed) as failed:
        run_page("made_up.md", MADE_UP, {}, namespace)
    message = str(failed.value)
    assert message.startswith("made_up.md block 2 (line 14: 'assert y == 3, \"two is not three\"')")
    assert "two is not three" in message and namespace["y"] == 2  # blocks 0 and 1 ran, in order
    frames = traceback.extract_tb(failed.value.__cause__.__traceback__)
    assert [f.lineno for f in frames if f.filename == "made_up.md"] == [14]  # the page's line


def test_a_marked_block_is_checked_not_run() -> None:
    unmet = "```python\n# needs: torchrun\nraise RuntimeError('ran')\n```\n"
    [(block, ran)] = run_page("p.md", unmet, {}, {})
    assert block.needs == {"torchrun"} and not ran
    for code, error in [
        ("x = (", "does not compile"),
        ("from amp_graph import GradScalr", "cannot import|has no attribute"),
        ("amp_graph.GradScaler(named_params=None)", "unexpected keyword argument 'named_params'"),
        ("amp_graph.complie(None)", "has no attribute 'complie'"),
    ]:
        page = f"```python\n# needs: cuda, torchrun\n{code}\n```\n"
        with pytest.raises(DocBlockFailed, match=f"p.md block 0 .*{error}"):
            run_page("p.md", page, {}, {})
    with pytest.raises(DocBlockFailed, match="unknown need"):
        run_page("p.md", "```python\n# needs: cdua\n```\n", {}, {})
