"""DeepSpeed's Muon module is imported without TorchInductor, and its compiled functions still compile on first use."""

import subprocess
import sys

import torch

from hybrid3d.ds_internals.muon_import import _compile_on_first_call


def test_compile_is_deferred_to_the_first_call_with_the_same_options(monkeypatch):
    calls = []

    def recording_compile(model, **options):
        calls.append(options)
        return lambda *args: ("compiled", model(*args))

    monkeypatch.setattr(torch, "compile", recording_compile)

    @_compile_on_first_call
    def double(x):
        return 2 * x

    @_compile_on_first_call(fullgraph=True)
    def triple(x):
        return 3 * x

    assert calls == [] and double.__name__ == "double"
    assert double(2) == ("compiled", 4) and double(3) == ("compiled", 6)
    assert triple(1) == ("compiled", 3)
    assert calls == [{}, {"fullgraph": True}]  # once per function, with its own options


def test_muon_imports_without_the_compiler_and_torch_compile_is_restored():
    code = """
import sys, torch
compile_before = torch.compile
from hybrid3d.ds_internals.muon_import import import_muon_lazily
import_muon_lazily()
from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam
from deepspeed.runtime.zero.muon import original_muon
assert torch.compile is compile_before
assert "torch._inductor.compile_fx" not in sys.modules, "TorchInductor was imported"
assert original_muon.muon_update.__code__.co_filename.endswith("muon_import.py")  # compiled on first call
print("ok")
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.stdout.strip().endswith("ok"), result.stdout + result.stderr
