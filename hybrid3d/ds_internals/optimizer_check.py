"""DeepSpeed's ZeRO optimizer check without the Muon import it makes on the way.

`deepspeed.runtime.zero.utils.is_zero_supported_optimizer` (0.19.8), called by every `deepspeed.initialize`
with ZeRO, imports `deepspeed.runtime.zero.muon.muon_optimizer` to add Muon to its list of supported
optimizers. That module applies `torch.compile` at import, which imports TorchInductor: 2.5 s per process
on an idle core of this machine's Xeon, 5 s with four ranks on two cores, paid by every rank of every job,
which then never uses Muon. The check tolerates an ImportError (Muon is optional), and Python raises one for
a module whose `sys.modules` entry is None, so the import is declined for the initialisation only, and only
when the configured optimizer is not Muon.
"""

import sys
from contextlib import contextmanager

MUON_MODULE = "deepspeed.runtime.zero.muon.muon_optimizer"


@contextmanager
def zero_check_without_muon(ds_config: dict):
    """Inside the block, DeepSpeed's optimizer check skips the Muon import (see the module docstring)."""
    optimizer = str(ds_config.get("optimizer", {}).get("type", "")).lower()
    if "muon" in optimizer or MUON_MODULE in sys.modules:
        yield
        return
    sys.modules[MUON_MODULE] = None
    try:
        yield
    finally:
        if sys.modules.get(MUON_MODULE, 0) is None:
            del sys.modules[MUON_MODULE]
