"""Spawned gloo worlds for the tests (see hybrid3d.spawn).

Spawning a world costs seconds on 2 cores (imports dominate), so each world runs many checks
and returns their raw results; assertions then happen in the pytest process.
"""

from hybrid3d.parallel.spawn import free_port, run_world

__all__ = ["free_port", "run_world"]
