"""ZeRO-2's gradient bookkeeping replayed on a list of parameter sizes (DeepSpeed 0.19's `stage_1_and_2.py`): what
a rank holds outside its reduction bucket after a backward, which parameters overlap its partition, and the peak of
`hybrid3d.pipeline_zero2`. The model-state accounting (`planning/memory.py`) builds on these."""

import itertools


def zero2_boundary_grads(numels: list[int], partition: int, dp_rank: int, bucket: int, gas: int) -> int:
    """Gradient elements ZeRO-2 holds outside its bucket after the last backward, before its epilogue.

    Replays the bucketing of `reduce_independent_p_g_buckets_and_remove_grads` in backward order
    (the reverse of the parameters'): a bucket is reduced when the next gradient would overflow it.
    - `grads_in_partition` (G: whole parameters overlapping this rank's range) exists once a gradient
      of this rank's partition has been reduced in this backward;
    - a gradient larger than the bucket bypasses it and waits, as `.grad`, for the next reduction;
    - with m > 1, `all_grad_tensors` (G) holds the previous micro-batches' sum."""
    start, end = partition * dp_rank, partition * (dp_rank + 1)
    offsets = [0, *itertools.accumulate(numels)][:-1]  # where each parameter starts in the flat buffer
    mine = {i for i, (o, n) in enumerate(zip(offsets, numels)) if start <= o < end or o < start < o + n}
    whole = sum(numels[i] for i in mine)
    reduced, pending, running = set(), [], 0
    for i in reversed(range(len(numels))):
        if running + numels[i] > bucket:
            reduced.update(pending)
            pending, running = [], 0
        pending.append(i)
        running += numels[i]
    held = whole if reduced & mine else 0
    held += sum(numels[i] for i in pending if numels[i] > bucket)
    return held + (whole if gas > 1 else 0)


def params_in_partition(numels: list[int], partition: int, dp_rank: int) -> set[int]:
    """Indices of the parameters overlapping [dp_rank·P, (dp_rank+1)·P) (`is_param_in_current_partition`)."""
    start, end = partition * dp_rank, partition * (dp_rank + 1)
    offsets = [0, *itertools.accumulate(numels)][:-1]  # where each parameter starts in the flat buffer
    return {i for i, (o, n) in enumerate(zip(offsets, numels)) if start <= o < end or o < start < o + n}


def pipeline_zero2_grads(numels: list[int], deferred: set[int], mine: set[int], bucket: int, partition: int,
                          gas: int) -> int:
    """Peak gradient bytes (bf16 weights, fp32 accumulation) of a rank under `hybrid3d.pipeline_zero2`.

    Replays, like `zero2_boundary_grads`, what `reduce_independent_p_g_buckets_and_remove_grads`
    holds at each bucket reduction of the last backward (reverse parameter order) and of the release
    of the deferred gradients (forward order): the 2B bucket, gradients outside it (the one that
    triggers the reduction, oversized ones waiting as `.grad` for the next reduction and, when they
    overlap this rank's partition (`mine`), until the epilogue, `stage_1_and_2.py:2179-2182`), the
    4-byte accumulators of the deferred gradients not yet released, and the 4·P fp32 partition once a
    reduction has touched `mine`. A deferred gradient triggers reductions but enters the bucket only
    when released."""
    accumulators = 4 * sum(numels[i] for i in deferred) if gas > 1 else 0
    has_partition = gas > 1 and bool(mine - deferred)
    worst, running, waiting, waiting_mine, kept, bucket_mine = 0, 0, 0, 0, 0, False

    def held(extra: int) -> int:
        return 4 * partition * has_partition + 2 * bucket + 2 * (kept + waiting + extra) + accumulators

    def offer(i: int, enters: bool) -> None:
        nonlocal worst, running, waiting, waiting_mine, kept, bucket_mine, has_partition
        if running + numels[i] > bucket:
            worst = max(worst, held(numels[i]))
            has_partition |= bucket_mine
            running, waiting, kept, waiting_mine, bucket_mine = 0, 0, kept + waiting_mine, 0, False
        if enters:
            running += numels[i]
            bucket_mine |= i in mine
            if numels[i] > bucket:
                waiting += numels[i]
                waiting_mine += numels[i] if i in mine else 0

    def epilogue() -> None:
        nonlocal worst, running, waiting, waiting_mine, kept, bucket_mine, has_partition
        worst = max(worst, held(0))
        has_partition |= bucket_mine
        running, waiting, waiting_mine, kept, bucket_mine = 0, 0, 0, 0, False

    for i in reversed(range(len(numels))):
        offer(i, enters=i not in deferred)
        if i in deferred and gas == 1:
            accumulators += 4 * numels[i]
    epilogue()
    for i in sorted(deferred):
        accumulators -= 4 * numels[i]
        offer(i, enters=True)
    if deferred:
        epilogue()
    return max(worst, 4 * partition)
