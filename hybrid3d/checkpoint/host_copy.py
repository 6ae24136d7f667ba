"""The host copy of an asynchronous save (`hybrid3d.checkpoint.async`, checkpoint/async_save.py): what the step is
held for.

A file's state (the dict DeepSpeed's engine hands to `torch.save`) is copied storage by storage into host buffers,
each tensor rebuilt as the same view (dtype, offset, size, stride, requires_grad, its type and attributes) of the
copied storage, and every container and other object copied too (the scheduler, the step counters and the RNG
states change once training goes on). So `torch.save` of the copy, later and on the writer's thread, writes what it
would have written of the state at the save (the whole of each storage a tensor views, as it always does), the
tensors that lived on an accelerator aside: their records hold the same bytes and say `cpu` for the device they are
loaded to (DeepSpeed and hybrid3d load checkpoints onto the host first, `map_location`, and copy from there).

States on an accelerator go to page-locked ("pinned") host memory, all copies queued without waiting and one
synchronisation at the end: a copy from device memory into pageable memory is staged and synchronous, so a pinned
copy is the fast one (torchtitan's and Megatron-core's asynchronous saves stage into pinned memory too). On CUDA
the buffers are plain host allocations registered with the driver (`exact_pinned`), not `pin_memory()`'s: torch's
pinned allocator rounds every request up to a power of two, which would hold up to twice the states. The buffers are
kept from one save to the next (`HostBuffers`: pinning is slow to allocate), as the next save only starts once the
last one is written: a rank holds one copy of its states in host memory for the rest of the run, which the planner
counts (planning/checkpoint_copy.py).
"""

import copy
import warnings
import weakref
from pathlib import Path

import torch
from deepspeed.accelerator import get_accelerator


def exact_pinned(nbytes: int) -> torch.Tensor:
    """(nbytes,) uint8 page-locked host memory of exactly `nbytes`: on CUDA a plain allocation registered with
    `cudaHostRegister` (undone when the buffer is freed), since torch's pinned allocator (CachingHostAllocator) rounds
    each request up to the next power of two; elsewhere, or if the driver refuses, the accelerator's `pin_memory`."""
    buffer = torch.empty(nbytes, dtype=torch.uint8)
    if nbytes and torch.cuda.is_available():
        cudart = torch.cuda.cudart()
        error = int(cudart.cudaHostRegister(buffer.data_ptr(), nbytes, 0))
        if error == 0:
            weakref.finalize(buffer, cudart.cudaHostUnregister, buffer.data_ptr()).atexit = False
            return buffer
        warnings.warn(f"cudaHostRegister of {nbytes} bytes failed (CUDA error {error}): the checkpoint copy uses "
                      "torch's pinned allocator, which rounds it up to a power of two")
    return get_accelerator().pin_memory(buffer)


class HostBuffers:
    """A rank's host buffers, one per (file name, storage), reused by each save while its size stays the same."""

    def __init__(self):
        self._buffers: dict = {}  # (file name, storage index in the file) -> uint8 tensor on the host

    def take(self, slot: tuple, nbytes: int, pinned: bool) -> torch.Tensor:
        buffer = self._buffers.get(slot)
        if buffer is None or buffer.numel() != nbytes or buffer.is_pinned() != pinned:
            buffer = exact_pinned(nbytes) if pinned else torch.empty(nbytes, dtype=torch.uint8)
            self._buffers[slot] = buffer
        return buffer


class Snapshot:
    """One save's files as host copies, {path: (state, zipfile)}, for `async_save.BackgroundWriter` to write
    (`zipfile`: torch.save's `_use_new_zipfile_serialization`, as the checkpoint engine would write it)."""

    def __init__(self, buffers: HostBuffers):
        self.files: dict = {}
        self.copied_bytes = 0
        self._buffers = buffers
        self._on_accelerator = False

    def add(self, path, state, zipfile: bool = True) -> None:
        path = Path(path)
        copier = _Copier(lambda index, nbytes, pinned: self._buffers.take((path.name, index), nbytes, pinned))
        self.files[str(path)] = (copier.copy(state), zipfile)
        self.copied_bytes += copier.copied_bytes
        self._on_accelerator |= copier.on_accelerator

    def keep(self, path, state: dict) -> None:
        """A {name: tensor} state already copied to the host for this save alone, kept as it is."""
        self.files[str(Path(path))] = (state, True)
        self.copied_bytes += sum(t.untyped_storage().nbytes() for t in state.values())

    def wait_for_copies(self) -> None:
        """Block until every queued device-to-host copy has landed (nothing to wait for on the host)."""
        if self._on_accelerator:
            get_accelerator().synchronize()


class _Copier:
    """Copies one file's state; each storage once, however many tensors view it (as torch.save writes it once)."""

    def __init__(self, take):
        self._take = take  # (storage index, nbytes, pinned) -> uint8 host buffer
        self._storages: dict = {}  # the source storage's StorageImpl -> its host copy
        self._memo: dict = {}  # copy.deepcopy's memo: a tensor reached twice is copied once
        self.copied_bytes = 0
        self.on_accelerator = False

    def copy(self, obj):
        if id(obj) in self._memo:
            return self._memo[id(obj)]
        if isinstance(obj, torch.Tensor) and type(obj) in (torch.Tensor, torch.nn.Parameter) \
                and obj.layout == torch.strided and not obj.is_meta:
            out = self._tensor(obj)
        elif isinstance(obj, dict):
            out = copy.copy(obj)  # keeps its type and attributes (a state dict's `_metadata`)
            for key, value in obj.items():
                out[key] = self.copy(value)
        elif type(obj) in (list, tuple):
            out = type(obj)(self.copy(x) for x in obj)
        else:  # numbers, strings, the scheduler's and loss scaler's objects, RNG states of numpy and Python
            return copy.deepcopy(obj, self._memo)
        self._memo[id(obj)] = out
        return out

    def _tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = self._storage(tensor.untyped_storage(), tensor.device)
        out = torch.empty(0, dtype=tensor.dtype).set_(storage, tensor.storage_offset(), tensor.size(),
                                                      tensor.stride())
        if type(tensor) is torch.nn.Parameter:
            out = torch.nn.Parameter(out, requires_grad=tensor.requires_grad)
        elif tensor.requires_grad:
            out.requires_grad_(True)
        if tensor.__dict__:  # torch.save pickles a tensor's attributes too
            out.__dict__.update(self.copy(tensor.__dict__))
        return out

    def _storage(self, storage: torch.UntypedStorage, device: torch.device) -> torch.UntypedStorage:
        if storage._cdata not in self._storages:
            pinned = device.type != "cpu"
            self.on_accelerator |= pinned
            buffer = self._take(len(self._storages), storage.nbytes(), pinned)
            source = torch.empty(0, dtype=torch.uint8, device=device).set_(storage)  # (nbytes,) the raw bytes
            buffer.copy_(source, non_blocking=pinned)
            self._storages[storage._cdata] = buffer.untyped_storage()
            self.copied_bytes += storage.nbytes()
        return self._storages[storage._cdata]
