"""How a rank's experts run on their routed rows: as grouped GEMMs (one kernel per projection for all of the rank's
experts, Megatron-core's `moe_grouped_gemm`), or as a loop of GEMMs, one expert at a time.

Both take the rows sorted by expert once (`sort_by_expert`: a stable permutation of the n·k assignments, kept to
scatter the outputs back) and give every expert the same GEMMs (grouped_mm's CPU kernel equals torch.mm on each
group's slice, bit for bit):

    hidden_e = silu(x_e W_gate,e^T) * (x_e W_up,e^T)     # (n_e, f/t)
    y_e      = hidden_e W_down,e^T                       # (n_e, h), this TP rank's partial sum over f

The one difference is silu and its backward: the grouped kernel applies them to all rows at once, the loop to
each expert's, and torch's vectorized CPU loop computes the elements past its last whole vector step by another
path, so where an expert's n_e·f/t elements end inside a vector step those few elements differ in the last bit
(measured 1.5e-8 in an fp32 output of a 64 x 48 test; none at Qwen3-30B-A3B's 2048 x 768).

`GroupedSwiGLU` runs them through `torch.nn.functional.grouped_mm` (torch >= 2.10; CPU and CUDA kernels) on the
rank's expert weights viewed as (E, rows, cols) tensors: `contiguous_experts` lays each layer's experts out in one
buffer at construction and ZeRO's flat buffers keep that order, so the view costs no copy (`stacked`; a copy,
made for the call and not kept, where the weights lie otherwise). Its backward is written out (input gradients by grouped
GEMMs against the weights, weight gradients by one GEMM per expert; aten's silu_backward) because the kernel's own
needs a contiguous incoming gradient and 16-byte-aligned strides. `choose_kernel` says which one runs
and why. The default (None) is the loop, which runs any shape: on this CPU torch's grouped_mm is one aten::mm per
group (profiled), and the two measured within 7% of each other, either way (benchmarks/expert_kernels.py; both
1.7-2.1x transformers' grouped_mm on a Qwen3-30B-A3B layer); "grouped_mm" is refused where it cannot run.
"""

from typing import NamedTuple, Optional, Sequence

import torch
import torch.nn.functional as F

ALIGNMENT_BYTES = 16  # grouped_mm's stride alignment


class SortedAssignments(NamedTuple):
    """The n·k assignments sorted by expert (stable: token order within an expert, then the k slots)."""

    order: torch.Tensor  # (r,) flat assignment index token·k + slot, grouped by expert
    counts: list  # rows of each expert, E entries (assignments to the sentinel expert E are left out)


def sort_by_expert(indices: torch.Tensor, num_experts: int) -> SortedAssignments:
    """indices (n, k), values in [0, E] (E: an assignment dropped by the capacity) -> the kept assignments grouped
    by expert in the order `torch.where(indices == e)` gives them one expert at a time."""
    flat = indices.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts + 1)[:num_experts].tolist()
    return SortedAssignments(order[:sum(counts)], counts)


def grouped_mm_available() -> bool:
    return hasattr(F, "grouped_mm")


def choose_kernel(requested: Optional[str], hidden: int, width: int, element_bytes: int) -> tuple[str, str]:
    """(kernel, why) for `requested` (one of config.EXPERT_KERNELS; None: the loop, see the module docstring) with
    experts of `hidden` x `width` (f/t) in a dtype of `element_bytes`. Raises ValueError where "grouped_mm" is asked
    for and cannot run."""
    if requested is None:
        return "loop", ("hybrid3d.expert_kernel null: one GEMM per expert, any shape, as fast as grouped_mm on the CPU "
                        "(benchmarks/expert_kernels.py); 'grouped_mm' runs grouped GEMMs")
    if requested == "loop":
        return "loop", "hybrid3d.expert_kernel 'loop'"
    if not grouped_mm_available():
        why = f"torch {torch.__version__} has no torch.nn.functional.grouped_mm"
    elif (hidden * element_bytes) % ALIGNMENT_BYTES or (width * element_bytes) % ALIGNMENT_BYTES:
        why = (f"grouped_mm needs {ALIGNMENT_BYTES}-byte strides: hidden {hidden} and expert width {width} "
               f"(per TP rank) at {element_bytes} bytes an element are not")
    else:
        return "grouped_mm", "hybrid3d.expert_kernel 'grouped_mm': torch.nn.functional.grouped_mm"
    raise ValueError(f"hybrid3d.expert_kernel 'grouped_mm': {why}")


def kernel_line(shape, tp: int, dtype: torch.dtype) -> str:
    """The start-up line: which kernel a mixture of experts' experts (LlamaShape `shape`, f_e/t a TP rank) run in
    `dtype`, and why."""
    kernel, why = choose_kernel(shape.expert_kernel, shape.hidden_size, shape.expert_intermediate_size // tp,
                                torch.finfo(dtype).bits // 8)
    return f"experts: {kernel} ({why})"


def _offsets(counts: Sequence[int], device) -> torch.Tensor:
    return torch.tensor(counts, dtype=torch.int64).cumsum(0).to(device=device, dtype=torch.int32)


def _weights(experts) -> list:
    """gate, up and down of each expert in turn: the order `stacked` and `GroupedSwiGLU` take."""
    return [w for e in experts for w in (e.gate_proj.weight, e.up_proj.weight, e.down_proj.weight)]


def contiguous_experts(experts) -> None:
    """Move the weights of `experts` (modules with gate_proj, up_proj, down_proj) into one buffer, expert after expert
    and gate, up, down within one, so that `stacked` views them without a copy (ZeRO's flat buffers keep that
    order: a layer's experts are consecutive parameters of DeepSpeed's expert group)."""
    weights = _weights(experts)
    if not weights:
        return
    buffer = torch.empty(sum(w.numel() for w in weights), dtype=weights[0].dtype, device=weights[0].device)
    offset = 0
    for w in weights:
        view = buffer[offset:offset + w.numel()].view_as(w)
        view.copy_(w.data)
        w.data = view
        offset += w.numel()


def stacked(weights: Sequence[torch.Tensor], first: int) -> torch.Tensor:
    """(E, rows, cols) of weights[first::3]: a strided view where the experts' weights lie at equal distances in one
    storage (`contiguous_experts`), else a stacked copy."""
    chosen = list(weights[first::3])
    head = chosen[0]
    step = weights[3].data_ptr() - weights[0].data_ptr() if len(weights) > 3 else 0
    element = head.element_size()
    even = (all(w.is_contiguous() and w.shape == head.shape and w.dtype == head.dtype for w in chosen)
            and step % element == 0
            and all(w.untyped_storage().data_ptr() == head.untyped_storage().data_ptr() for w in chosen)
            and all(w.data_ptr() - head.data_ptr() == i * step for i, w in enumerate(chosen)))
    if not even or len(chosen) == 1:
        return torch.stack(chosen)
    rows, cols = head.shape
    return head.as_strided((len(chosen), rows, cols), (step // element, cols, 1))


class GroupedSwiGLU(torch.autograd.Function):
    """rows (r, h) grouped by expert, `counts` rows each, and the experts' weights gate (f, h), up (f, h),
    down (h, f) of each in turn -> (r, h): every expert's SwiGLU on its rows, as the module docstring says."""

    @staticmethod
    def forward(ctx, rows, counts, *weights):
        gate, up, down = (stacked(weights, i) for i in range(3))  # (E, f, h), (E, f, h), (E, h, f)
        offs = _offsets(counts, rows.device)
        g = F.grouped_mm(rows, gate.transpose(-2, -1), offs=offs)  # (r, f)
        u = F.grouped_mm(rows, up.transpose(-2, -1), offs=offs)
        hidden = F.silu(g) * u
        ctx.save_for_backward(rows, g, u, *weights)
        ctx.counts = counts
        return F.grouped_mm(hidden, down.transpose(-2, -1), offs=offs)  # (r, h)

    @staticmethod
    def backward(ctx, grad):
        rows, g, u, *weights = ctx.saved_tensors
        gate, up, down = (stacked(weights, i) for i in range(3))
        offs = _offsets(ctx.counts, rows.device)
        grad = grad.contiguous()
        act = F.silu(g)
        hidden = act * u
        grad_hidden = F.grouped_mm(grad, down, offs=offs)  # (r, f)
        grad_g = torch.ops.aten.silu_backward(grad_hidden * u, g)
        grad_u = grad_hidden * act
        grad_rows = F.grouped_mm(grad_g, gate, offs=offs) + F.grouped_mm(grad_u, up, offs=offs)  # (r, h)
        # The weight gradients one expert at a time: grouped_mm's K-grouped form (2-D x 2-D) measured 4x slower on
        # the CPU than these GEMMs, and each expert's gradient is then its own tensor (autograd keeps it as .grad)
        parts = (grad_g, grad_u, grad, rows, hidden)
        per_expert = [w for dg, du, dy, x, a in zip(*(t.split(ctx.counts) for t in parts))
                      for w in (dg.t() @ x, du.t() @ x, dy.t() @ a)]  # (f, h), (f, h), (h, f)
        return (grad_rows, None, *per_expert)


def loop_swiglu(rows: torch.Tensor, counts: Sequence[int], experts) -> torch.Tensor:
    """The same as `GroupedSwiGLU` one expert at a time (`experts`: modules with `partial`)."""
    chunks = rows.split(list(counts))
    return torch.cat([expert.partial(chunk) for expert, chunk in zip(experts, chunks)])


def run_experts(kernel: str, rows: torch.Tensor, counts: Sequence[int], experts) -> torch.Tensor:
    """(r, h) rows grouped by expert -> (r, h) this TP rank's partial outputs, by `kernel` ("grouped_mm" or
    "loop"); `experts` in the order of `counts`, each with gate_proj, up_proj and down_proj."""
    experts = list(experts)
    if kernel == "loop":
        return loop_swiglu(rows, counts, experts)
    return GroupedSwiGLU.apply(rows, list(counts), *_weights(experts))
