"""The functions that issue collectives, by traffic class, as DeepSpeed's comms logger records them (`debug: true`
names each record's calling function): many are DeepSpeed's own (private ones included), so the table lives here,
checked against one version, not in the benchmarks that classify the records.

tp: hybrid3d's tensor-parallel mappings and cross entropy; dp: DeepSpeed's gradient reduction and ZeRO's
parameter all-gather; pp: pipeline send/recv; pp_gather: PipelineEngine re-assembling TP-partitioned
activations/gradients; pp_tied: the tied weights' gradient sum; control: scalar reductions (norms, overflow, loss).
"""

CALLER_CLASSES = {
    "tp_all_reduce": "tp", "start_tp_all_reduce": "tp", "_gather_last_dim": "tp", "all_gather_sequence": "tp",
    "reduce_scatter_sequence": "tp",
    "allreduce_bucket": "dp", "allreduce_and_copy": "dp", "all_gather_into_tensor_dp_groups": "dp",
    "all_gather_dp_groups": "dp", "average_tensor": "dp", "reduce_scatter_coalesced": "dp",
    "allgather_fn": "dp", "_allgather_params_coalesced": "dp", "reduce_scatter_fn": "dp",
    "send": "pp", "recv": "pp", "full": "pp_gather", "_exec_reduce_tied_grads": "pp_tied",
    "has_overflow": "control", "get_grad_norm_direct": "control", "get_weight_norm": "control",
    "_model_parallel_all_reduce": "control", "_aggregate_total_loss": "control", "_dp_mean": "control",
    "get_global_norm_of_tensors": "control", "get_global_norm": "control",
}
TRAFFIC_CLASSES = ("tp", "dp", "pp", "pp_gather", "pp_tied", "control", "other")
CALLER_MARK = " | [Caller Func: "  # DeepSpeed 0.19.8's record name with `debug: true`: "all_reduce | [Caller Func: f]"
# ZeRO's gradient reduction and parameter all-gather, by the function DeepSpeed 0.19.8 issues them from
GRADIENT_REDUCE_CALLERS = {"allreduce_bucket", "allreduce_and_copy", "gradient_reduction_w_predivide", "average_tensor",
                           "buffered_allreduce_fallback", "allreduce_no_retain"}
PARAMETER_GATHER_CALLERS = {"all_gather_dp_groups", "all_gather_into_tensor_dp_groups"}
# ZeRO-3's: the parameter coordinator's coalesced all-gathers (and stage3's gather of the persistent parameters after
# the step), and the gradients' reduce-scatter
ZERO3_GATHER_CALLERS = {"allgather_fn", "_allgather_params_coalesced"}
ZERO3_REDUCE_SCATTER_CALLERS = {"reduce_scatter_fn"}


def op_and_caller(record_name: str) -> tuple[str, str]:
    """A comms-logger record's (collective, calling function): 'all_reduce | [Caller Func: _all_reduce]' ->
    ('all_reduce', '_all_reduce'); a record without a caller (`debug` off) -> (its name, its name)."""
    op, marked, caller = record_name.partition(CALLER_MARK)
    return (op.strip(), caller.rstrip("]")) if marked else (record_name.strip(), record_name)
