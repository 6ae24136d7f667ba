"""Everything that depends on DeepSpeed's private attributes, behind one version check.

hybrid3d uses DeepSpeed's public API everywhere else. The modules here read or replace internals
that DeepSpeed may change in any release (PipelineEngine's instruction table and ZeRO-2 bookkeeping
in pipeline_zero2.py, the interleaved schedule's module and engine in interleaved_pipeline.py, the fp32
pipeline's gradient clipping in pipeline_clip.py, optimizer buffers in memory_probe.py, the expert groups
and the engine's MoE detection in experts.py, the backward pass of tuple-output stages in tuple_backward.py,
the checkpoint engine's file writes in durable_save.py, the CPU shared-memory segments in shm_buffers.py and
when their all-reduce may serve a group in shm_all_reduce.py,
the process groups and engines a run leaves behind in process_groups.py, the Muon module's import-time
`torch.compile` deferred to first use in muon_import.py, `ds_to_universal` run in this process in
universal_convert.py, the comms logger's calling functions in comms_callers.py, the engine's optimizer step
in step_timing.py, TORCH_CUDA_ARCH_LIST spelled for the JIT op builder in op_build_arch.py, the op builders' CPU
probe kept once per machine run in cpu_info.py, the grid's topology (`grid_topology`),
PipelineModule's stage bounds below and in pipeline_bounds.py), so they are written and tested against one version:
`check_deepspeed_version()` turns any other into one line at start-up.
"""

from contextlib import contextmanager

TESTED_DEEPSPEED = "0.19.8"
# pipeline_zero2's cross-stage sum of a tied weight's gradient runs in fp32 chunks of at most this many elements
# (64 MiB), whatever reduce_bucket_size says (DeepSpeed's default, 5e8 elements, would be a 2 GB buffer);
# the memory model counts one chunk (planning/memory.py).
TIED_SUM_CHUNK_ELEMENTS = 2**24


def check_deepspeed_version(installed: str | None = None) -> None:
    """Raise a UserError unless the installed DeepSpeed is the one these internals were written for."""
    from hybrid3d.errors import UserError

    if installed is None:
        import deepspeed

        installed = deepspeed.__version__
    if installed.split("+")[0] != TESTED_DEEPSPEED:
        raise UserError(f"deepspeed {installed} is installed; hybrid3d is tested with deepspeed {TESTED_DEEPSPEED} "
                        f"(pip install deepspeed=={TESTED_DEEPSPEED})")


def pipeline_stage_layers(module) -> list[tuple[int, int]]:
    """[(first, last) global layer index] of each stage a PipelineModule built on this rank (DeepSpeed keeps
    them private): one stage, or a DualPipeVModule's two (`phase_bounds`: stages r and 2p-1-r)."""
    bounds = getattr(module, "phase_bounds", [(module._local_start, module._local_stop)])
    return [(int(start), int(stop) - 1) for start, stop in bounds]


def pipeline_parts(module) -> list[int]:
    """The layer-spec bounds of every stage a PipelineModule was cut into (DeepSpeed keeps them as `parts`; a
    DualPipeVModule's 2p stages, an interleaved module's v·p)."""
    return [int(b) for b in module.parts]


def grid_topology(grid):
    """The ProcessTopology a PipelineParallelGrid was built on (DeepSpeed keeps it as `_topo`)."""
    return grid._topo


@contextmanager
def swapped(owner, name: str, value):
    """Rebind `owner.name` to `value` inside the block only (how a DeepSpeed class is replaced for one call)."""
    saved = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, saved)


@contextmanager
def pipeline_module_uses_grid(grid):
    """Build PipelineModules on the layout's `PipelineParallelGrid` instead of a second one.

    `PipelineModule.__init__` always creates its own grid (`runtime/pipe/module.py:183`), i.e. a
    second process group for every TP, DP, pipe and model-parallel group next to the layout's: on
    NCCL a second communicator each (memory and start-up time). The grid class it calls is
    replaced by one returning `grid` while the module is built."""
    from deepspeed.runtime.pipe import module as pipe_module

    built = pipe_module.PipelineParallelGrid

    def layout_grid(process_group=None, topology=None):
        dims = lambda topo: {axis: topo.get_dim(axis) for axis in topo.get_axis_names()}  # noqa: E731
        if topology is not None and dims(topology) != dims(grid._topo):
            raise ValueError(f"PipelineModule topology {dims(topology)} is not the layout's {dims(grid._topo)}")
        return grid

    pipe_module.PipelineParallelGrid = layout_grid
    try:
        yield
    finally:
        pipe_module.PipelineParallelGrid = built
