"""One matrix product for projections that read the same input (q/k/v, gate/up) in compiled decoding.

A decode step multiplies one row per sequence by each weight matrix, so it is bound by reading the weights; small
products (Qwen3-8B's ``k_proj``/``v_proj``: 1024 x 4096) run far below the memory bandwidth and cuBLAS adds a
split-K reduction kernel to each. Reading ``q/k/v`` as one 6144 x 4096 matrix, and ``gate/up`` as one
24576 x 4096 matrix, removes three products and their reductions per layer.

Two parts, neither of which changes what eager code computes:

* :func:`fuse_projection_storage` stores the weights of each group of sibling ``nn.Linear`` modules (same input,
  no bias) row after row in one buffer. Each module becomes a :class:`SharedStorageLinear`: its ``weight`` stays a
  parameter (a view of the buffer, so state dicts and eager readers see the same tensors as before) and its forward
  multiplies by its row block of the buffer, so a traced graph states which rows of which buffer each product reads.
* :class:`AdjacentMatmulFusion`, an inductor post-grad pass, replaces products of one input by row blocks that tile
  a range of one buffer (``mm(x, B[a:b].T)``, ``mm(x, B[b:c].T)``) by one product over ``B[a:c]`` and a column
  slice per product. It reads only the graph, so inductor's graph caches key it correctly.

:func:`fused_compile_config` gives the ``CompileConfig`` for ``generate`` that runs the pass.
"""

from __future__ import annotations

import hashlib
import inspect
from collections import defaultdict

import torch
import torch.nn.functional as F
from torch import nn
from torch._inductor.custom_graph_pass import CustomGraphPass

# sibling projections that read one input in the attention and MLP blocks of Llama-style decoders
DEFAULT_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class SharedStorageLinear(nn.Linear):
    """A bias-free ``nn.Linear`` whose weight is the row block ``[start, stop)`` of a buffer shared with its siblings.

    ``weight``: ``(out_features, in_features)``, a view of ``stacked`` (``(rows of the group, in_features)``, a
    non-persistent buffer). The forward reads the block from ``stacked`` (the same memory, so the same numbers as
    ``nn.Linear``); change weights in place (``load_state_dict``, ``copy_``), not by assigning a new parameter."""

    def __init__(self, stacked: torch.Tensor, start: int, stop: int, requires_grad: bool = False):
        super().__init__(stacked.shape[1], stop - start, bias=False, device="meta")
        self.weight = nn.Parameter(stacked[start:stop], requires_grad=requires_grad)
        self.register_buffer("stacked", stacked, persistent=False)
        self.start, self.stop = start, stop

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.stacked[self.start:self.stop])


def _linear_group(module: nn.Module, names: tuple[str, ...]) -> list[nn.Linear] | None:
    linears = [getattr(module, n, None) for n in names]
    if not all(type(m) is nn.Linear for m in linears):
        return None
    first = linears[0].weight
    if any(m.bias is not None for m in linears):
        return None
    if any(m.weight.shape[1] != first.shape[1] or m.weight.dtype != first.dtype or m.weight.device != first.device
           for m in linears):
        return None
    return linears


def fuse_projection_storage(model: nn.Module, groups=DEFAULT_GROUPS) -> int:
    """Store each group of sibling projections of ``model`` in one buffer (in place); returns the groups stored.

    Only bias-free ``nn.Linear`` modules with one input width, dtype and device are grouped (a LoRA-wrapped
    projection is not: merge the adapter first). Call it after moving the model to its device and dtype (a move
    copies parameters and buffers apart). Raises ``ValueError`` when no group is found. ``save_pretrained``
    afterwards writes the same tensors under the same names (the buffer is not saved)."""
    stored = 0
    for module in model.modules():
        for names in groups:
            linears = _linear_group(module, names)
            if linears is None:
                continue
            with torch.no_grad():
                stacked = torch.cat([m.weight.detach() for m in linears], dim=0)
            start = 0
            for name, old in zip(names, linears):
                stop = start + old.weight.shape[0]
                setattr(module, name, SharedStorageLinear(stacked, start, stop, old.weight.requires_grad))
                start = stop
            stored += 1
    if stored == 0:
        raise ValueError(f"fuse_projection_storage: no group of bias-free nn.Linear siblings named {list(groups)} in "
                         f"{type(model).__name__}; pass groups=... with the projection names of this architecture")
    return stored


def _base_and_shape(node):
    """The tensor a product's left operand is a view of, so that views of one input made twice group together."""
    target = getattr(node, "target", None)
    if target in (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default, torch.ops.aten.reshape.default):
        return node.args[0], tuple(node.meta["val"].shape)
    return node, None


def _row_block(mm_node):
    """``(B, start, rows)`` for ``mm(x, permute(slice(B, 0, start, ...), [1, 0]))`` with ``B`` 2-D row-major."""
    aten = torch.ops.aten
    rhs = mm_node.args[1]
    if getattr(rhs, "target", None) is not aten.permute.default or list(rhs.args[1]) != [1, 0]:
        return None
    block = rhs.args[0]
    if getattr(block, "target", None) is not aten.slice.Tensor or len(block.users) != 1:
        return None
    base, dim = block.args[0], (block.args[1] if len(block.args) > 1 else 0)
    start = block.args[2] if len(block.args) > 2 else 0
    step = block.args[4] if len(block.args) > 4 else block.kwargs.get("step", 1)
    val, base_val = block.meta.get("val"), getattr(base, "meta", {}).get("val")
    if dim != 0 or step != 1 or not isinstance(start, int) or start < 0:
        return None
    if not isinstance(base_val, torch.Tensor) or base_val.dim() != 2:
        return None
    if base_val.stride() != (base_val.shape[1], 1) or not isinstance(val, torch.Tensor):
        return None
    return base, start, int(val.shape[0])


def _tiling_runs(members):
    """Split ``[(mm, (B, start, rows))]`` of one buffer into runs of blocks that follow each other."""
    members = sorted(members, key=lambda m: m[1][1])
    runs, run = [], []
    for mm, block in members:
        if run and block[1] != run[-1][1][1] + run[-1][1][2]:
            runs.append(run)
            run = []
        run.append((mm, block))
    runs.append(run)
    return [r for r in runs if len(r) > 1]


def fuse_adjacent_matmuls(graph: torch.fx.Graph) -> int:
    """Rewrite ``graph`` in place (see the module docstring); returns the products removed."""
    from torch._guards import detect_fake_mode

    aten = torch.ops.aten
    groups = defaultdict(list)
    for node in graph.nodes:
        if node.op == "call_function" and node.target is aten.mm.default:
            block = _row_block(node)
            if block is not None:
                groups[(_base_and_shape(node.args[0]), block[0])].append((node, block))
    removed = 0
    order = {n: i for i, n in enumerate(graph.nodes)}
    for members in groups.values():
        for run in _tiling_runs(members):
            base = run[0][1][0]
            first_mm = min((mm for mm, _ in run), key=order.__getitem__)
            lhs = first_mm.args[0]
            start, stop = run[0][1][1], run[-1][1][1] + run[-1][1][2]
            with graph.inserting_before(first_mm), detect_fake_mode([base.meta["val"]]):
                rows = graph.call_function(aten.slice.Tensor, (base, 0, start, stop))
                rows.meta["val"] = aten.slice.Tensor(base.meta["val"], 0, start, stop)
                rows_t = graph.call_function(aten.permute.default, (rows, [1, 0]))
                rows_t.meta["val"] = aten.permute.default(rows.meta["val"], [1, 0])
                out = graph.call_function(aten.mm.default, (lhs, rows_t))
                out.meta["val"] = aten.mm.default(lhs.meta["val"], rows_t.meta["val"])
                for mm, (_, block_start, block_rows) in run:
                    lo = block_start - start
                    piece = graph.call_function(aten.slice.Tensor, (out, 1, lo, lo + block_rows))
                    piece.meta["val"] = aten.slice.Tensor(out.meta["val"], 1, lo, lo + block_rows)
                    mm.replace_all_uses_with(piece)
            for mm, _ in run:
                transposed = mm.args[1]
                graph.erase_node(mm)
                if not transposed.users:
                    block = transposed.args[0]
                    graph.erase_node(transposed)
                    if not block.users:
                        graph.erase_node(block)
            removed += len(run) - 1
    if removed:
        graph.lint()
    return removed


class AdjacentMatmulFusion(CustomGraphPass):
    """Inductor post-grad pass running :func:`fuse_adjacent_matmuls`; its ``uuid`` (a hash of the pass's source)
    keys inductor's graph caches, so compiled artifacts stay reusable across processes."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        fuse_adjacent_matmuls(graph)

    def uuid(self):
        src = "".join(inspect.getsource(f) for f in (fuse_adjacent_matmuls, _tiling_runs, _row_block, _base_and_shape))
        return hashlib.sha256(src.encode()).hexdigest()

    def __eq__(self, other):  # generate reuses its compiled call while the CompileConfig compares equal
        return type(other) is type(self)

    def __hash__(self):
        return hash(type(self))


def fused_compile_config(mode: str | None = None, **kwargs):
    """``transformers.CompileConfig`` for ``generate``: torch.compile's ``mode`` options plus the fusion pass.

    ``mode``: ``"reduce-overhead"``, ``"max-autotune"``, or None for ``CompileConfig``'s own default mode (the one
    ``generate`` uses without a ``compile_config``); further keyword arguments go to
    ``CompileConfig`` (``fullgraph``, ``dynamic``, ...). Use with a model passed through
    :func:`fuse_projection_storage`; without it the pass finds nothing to fuse and changes nothing."""
    from torch._inductor import list_mode_options
    from transformers import CompileConfig

    mode = CompileConfig().mode if mode is None else mode
    if mode not in ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"):
        raise ValueError(f"fused_compile_config: unknown mode {mode!r}; use 'reduce-overhead' or 'max-autotune'")
    options = dict(list_mode_options(mode))
    options["post_grad_custom_post_pass"] = AdjacentMatmulFusion()
    return CompileConfig(mode=None, options=options, **kwargs)
