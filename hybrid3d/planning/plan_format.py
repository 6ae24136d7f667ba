"""The planner's tables as text: the fitting rows, the longest sequences, and why the others were refused."""

from hybrid3d.planning.hints import ZERO_FOOTER

SCHEDULE_FOOTER = ("sched: hybrid3d.pipeline_schedule: 1f1b; int-v2 'interleaved', virtual_pipeline_size 2; "
                   "dpv 'dualpipev'; - no pipeline")
COMM_FOOTER = ("comm: hybrid3d.context_parallel_comm: a2a Ulysses over the cp ranks; p2p ring attention over them;\n"
               "a2aU+p2p Ulysses over U of them (context_parallel_a2a_size) around a ring over cp/U; - no CP")
EP_FOOTER = ("ep: hybrid3d.expert_parallel_size: the ranks of the data-parallel group a MoE block's experts spread over "
             "(E/ep\nexperts a rank, reduced over dp/ep ranks)")
OFFLOAD_LABELS = {"none": "-", "optimizer": "opt", "optimizer+params": "opt+par"}
OFFLOAD_FOOTER = ("offload: opt zero_optimization.offload_optimizer cpu (fp32 master, its gradient and Adam's moments "
                  "in host memory,\nstepped by DeepSpeedCPUAdam); opt+par also offload_param cpu (ZeRO-3's weight "
                  "partitions); host GB: host memory\nper GPU (with --async-checkpoint also an asynchronous save's copy of the "
                  "rank's files); states: device bytes,\nZeRO-3's gathered layers included "
                  "(docs/configuration.md#zero-3-and-offload)")
# parallel/attention_blocks.block_kernel: a ring's masked blocks on GPUs are explicit fp32 tiles, not a fused kernel
RING_NOTE = ("note: on GPUs ring attention (p2p, a2aU+p2p) runs its masked blocks (documents, sliding windows) as "
             "explicit fp32 tiles (parallel/attention_blocks.py): ring rows' step times assume a fused kernel's speed")


def _refused_lines(refused: list[str]) -> list[str]:
    return ["", "refused:", *(f"  {r}" for r in refused)] if refused else []


def format_plan(feasible: list, refused: list[str], top: int, hints: list[str] = ()) -> str:
    lines = []
    if feasible:
        best = feasible[0].step_seconds
        lines.append(f"{'tp':>3} {'pp':>3} {'cp':>3} {'dp':>4} {'ep':>3} {'sp':>3} {'zero':>4} {'offload':>7} {'ckpt':>4} "
                     f"{'mb':>3} {'gas':>4} {'sched':>6} {'GB/GPU':>7} {'states':>7} {'acts':>6} {'host GB':>7} "
                     f"{'bubble':>6} {'pp comm':>7} {'rel.time':>8}")
        for c in feasible[:top]:
            lines.append(f"{c.tp:>3} {c.pp:>3} {c.cp:>3} {c.dp:>4} {c.ep:>3} {'yes' if c.sp else 'no':>3} {c.zero:>4} "
                         f"{OFFLOAD_LABELS[c.offload]:>7} {'yes' if c.checkpointing else 'no':>4} {c.micro_batch:>3} "
                         f"{c.gas:>4} {c.schedule_label:>6} {c.memory_gb:>7.1f} {c.states_gb:>7.1f} "
                         f"{c.activations_gb:>6.1f} {c.host_gb:>7.1f} {c.bubble:>6.1%} "
                         f"{c.pipe_seconds / c.step_seconds:>7.1%} {c.step_seconds / best:>8.2f}")
        if len(feasible) > top:
            lines.append(f"... {len(feasible) - top} more feasible layouts (--top)")
        lines.append("rel.time: step-time estimate / the first row's: compute, the schedule's bubble, TP, CP, DP")
        lines.append("and pipeline traffic (send/recv and its TP all-gathers), the optimizer step's memory traffic,")
        lines.append("not overlapped; pp comm: pipeline traffic's share; bubble: the schedule's idle share of the step")
        lines.append(SCHEDULE_FOOTER)
        lines.append(OFFLOAD_FOOTER)
        if any(c.ep > 1 for c in feasible):
            lines.append(EP_FOOTER)
    else:
        lines.append("no layout fits")
        lines += hints
    return "\n".join(lines + _refused_lines(refused) + ["", ZERO_FOOTER])


LONGEST_HEADER = (f"{'seq':>8} {'tp':>3} {'pp':>3} {'cp':>3} {'comm':>8} {'dp':>4} {'sp':>3} {'zero':>4} {'ckpt':>4} "
                  f"{'gas':>4} {'sched':>6} {'GB/GPU':>7} {'states':>7} {'acts':>6} {'rel.t/tok':>9}")


def _longest_line(c, seq: int, best: float) -> str:
    """One row of the longest-sequence table: `c` a planner Choice fitting `seq` tokens, `best` the first row's
    step seconds per token."""
    return (f"{seq:>8} {c.tp:>3} {c.pp:>3} {c.cp:>3} {c.cp_label:>8} {c.dp:>4} {'yes' if c.sp else 'no':>3} "
            f"{c.zero:>4} {'yes' if c.checkpointing else 'no':>4} {c.gas:>4} {c.schedule_label:>6} "
            f"{c.memory_gb:>7.1f} {c.states_gb:>7.1f} {c.activations_gb:>6.1f} {c.step_seconds / seq / best:>9.2f}")


def format_longest(rows: list, refused: list[str], top: int, cap: int) -> str:
    lines = []
    if rows:
        best = rows[0][0].step_seconds / rows[0][1]
        lines.append(LONGEST_HEADER)
        lines += [_longest_line(c, seq, best) for c, seq in rows[:top]]
        if len(rows) > top:
            lines.append(f"... {len(rows) - top} more layouts (--top)")
        capped = sum(seq == cap for _, seq in rows)
        lines.append("seq: the longest multiple of 128 (of lcm(128, cp·tp) with sp, lcm(128, cp) without; of 2·cp "
                     "too with a ring)")
        lines.append(f"that fits, at micro-batch 1, up to {cap} tokens (reached by {capped} of {len(rows)} layouts; "
                     "--max-seq-length)")
        lines.append("rel.t/tok: step-time estimate per token / the first row's (a ring's sends not overlapped)")
        lines.append(COMM_FOOTER)
        lines.append(SCHEDULE_FOOTER)
        lines += [RING_NOTE] if any(c.ring for c, _ in rows) else []
    else:
        lines.append("no layout fits a sequence")
    return "\n".join(lines + _refused_lines(refused))
