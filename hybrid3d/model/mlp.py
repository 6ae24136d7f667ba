"""SwiGLU feed-forward (Shazeer 2020): down(silu(gate(x)) * up(x)); gate/up column-, down row-parallel."""

import torch.nn.functional as F
from torch import nn

from hybrid3d.model.adapters import attach_block_adapters
from hybrid3d.model.config import LlamaShape
from hybrid3d.parallel.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    TensorParallelGroup,
)
from hybrid3d.parallel.tensor_parallel.layers import normal_init
from hybrid3d.parallel.tensor_parallel.lora import column_linears_with_adapters


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
        attach_block_adapters(self, "mlp", shape, tp, device=device, dtype=dtype)  # LoRA, where shape asks

    def forward(self, x):  # (b, s, h) -> (b, s, h)
        # gate and up share one input-gradient all-reduce, overlapped with their weight gradients
        projections = [self.gate_proj, self.up_proj]
        gate, up = column_linears_with_adapters(x, [p.weight for p in projections], projections, self.tp,
                                                self.training)  # (b, s, f/t); LoRA deltas added
        return self.down_proj(F.silu(gate) * up)
