"""A checkpoint saved both ways inside a pooled world: synchronously and as an asynchronous save writes it (every
file copied to host memory by checkpoint/host_copy.py, then written by checkpoint/async_save.py's background writer),
so a run can resume from the background-written files and a test can check they are the synchronous ones."""


def save_both_ways(trainer, save_dir: str, tag: str, client_state=None) -> dict:
    """Save the same state synchronously (tag `<tag>-sync`) and then asynchronously (`tag`, which DeepSpeed's `latest`
    names afterwards); {"mine": the files this rank wrote in the background, relative to their tag, "same": whether
    each is the synchronous save's file byte for byte}."""
    from pathlib import Path

    import deepspeed.comm as dist

    from hybrid3d.checkpoint.async_save import BackgroundWriter
    from hybrid3d.checkpoint.host_copy import HostBuffers, Snapshot

    trainer.save(save_dir, tag=f"{tag}-sync", client_state=client_state)
    snapshot = Snapshot(HostBuffers())
    # nothing is written before the background write
    assert trainer.save(save_dir, tag=tag, client_state=client_state, snapshot=snapshot) == {}
    written = BackgroundWriter(snapshot.files).wait()
    dist.barrier()
    mine = sorted(str(Path(path).relative_to(Path(save_dir) / tag)) for path in written)
    same = all(Path(path).read_bytes() == (Path(save_dir) / f"{tag}-sync" / name).read_bytes()
               for path, name in zip(sorted(written), mine))
    return {"mine": mine, "same": same}
