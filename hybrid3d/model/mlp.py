"""SwiGLU feed-forward (Shazeer 2020): down(silu(gate(x)) * up(x)); gate/up column-, down row-parallel."""

import torch.nn.functional as F
from torch import nn

from hybrid3d.model.config import LlamaShape
from hybrid3d.parallel.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    TensorParallelGroup,
    column_parallel_linears,
)
from hybrid3d.parallel.tensor_parallel.layers import normal_init


class SwiGLU(nn.Module):
    def __init__(self, shape: LlamaShape, tp: TensorParallelGroup, device=None, dtype=None):
        super().__init__()
        self.tp = tp
        h, f = shape.hidden_size, shape.intermediate_size
        init = normal_init(shape.initializer_range)
        kw = dict(device=device, dtype=dtype, init_method=init)
        self.gate_proj = ColumnParallelLinear(h, f, tp, **kw)
        self.up_proj = ColumnParallelLinear(h, f, tp, **kw)
        self.down_proj = RowParallelLinear(f, h, tp, input_is_parallel=True, **kw)

    def forward(self, x):  # (b, s, h) -> (b, s, h)
        # gate and up share one input-gradient all-reduce, overlapped with their weight gradients
        gate, up = column_parallel_linears(x, [self.gate_proj.weight, self.up_proj.weight], self.tp)  # (b, s, f/t)
        return self.down_proj(F.silu(gate) * up)
