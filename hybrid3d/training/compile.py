"""torch.compile of the decoder blocks (`hybrid3d.compile`), as torchtitan compiles each transformer block.

Each block's forward is compiled in place (`nn.Module.compile`: parameter names, state dicts and checkpoints are
unchanged). Dynamo treats a module's parameters as graph inputs, so the blocks share one compiled graph and a
process compiles once. The tensor-parallel collectives run inside autograd functions through deepspeed.comm, which
Dynamo does not trace: each is a graph break, and the compiled pieces are the GEMMs, norms, RoPE and SwiGLU between
them. Which combinations run is config/support.check_compile's; the measurement (benchmarks/compile_blocks.py)
decided the default: off.
"""

import torch

from hybrid3d.config.sections import CompileSection


def compile_blocks(module: torch.nn.Module, section: CompileSection) -> int:
    """Compile every decoder block of `module` in place; the number compiled."""
    from hybrid3d.model.layers import DecoderBlock

    blocks = [m for m in module.modules() if isinstance(m, DecoderBlock)] if section.enabled else []
    for block in blocks:
        block.compile(backend=section.backend)
    return len(blocks)
