"""One CPU probe per machine run instead of two per DeepSpeed op load.

DeepSpeed 0.19.8's CPU op builders ask py-cpuinfo about the CPU every time an op is loaded, built or not:
`OpBuilder.cpu_arch` and `OpBuilder.simd_width` each call `cpuinfo.get_cpu_info()` (ops/op_builder/builder.py,
imported at call time), and py-cpuinfo answers by running itself in a fresh Python subprocess (measured on this
project's 2-core VM: 1.1-1.75 s of a core per call). A rank that loads CPU Adam and fused Adam pays four probes, and
every rank of a job pays them again, though the answer cannot change on the machine.

`share_cpu_info` makes `cpuinfo.get_cpu_info` probe once and keep the answer (JSON) in this process's environment,
where the processes it starts next (a world's ranks, a launched job's ranks, inheriting it) find it instead of
probing. DeepSpeed reads `arch` and `flags` of the answer; the whole answer is kept as py-cpuinfo gave it.
"""

import json
import os

CPU_INFO_VARIABLE = "HYBRID3D_CPU_INFO"


def share_cpu_info() -> None:
    """Replace `cpuinfo.get_cpu_info` (if py-cpuinfo is installed) with its one-probe form; idempotent."""
    try:
        import cpuinfo
    except ImportError:  # DeepSpeed then falls back to lscpu itself
        return
    probe = cpuinfo.get_cpu_info
    if getattr(probe, "shared_answer", False):
        return

    def get_cpu_info() -> dict:
        text = os.environ.get(CPU_INFO_VARIABLE)
        if text is None:
            text = json.dumps(probe())
            os.environ[CPU_INFO_VARIABLE] = text
        return json.loads(text)

    get_cpu_info.shared_answer = True
    cpuinfo.get_cpu_info = get_cpu_info


def cpu_info() -> dict | None:
    """py-cpuinfo's answer through the shared form (installing it, and probing once if no process before did); None
    without py-cpuinfo."""
    share_cpu_info()
    try:
        import cpuinfo
    except ImportError:
        return None
    return cpuinfo.get_cpu_info()
