"""The training entry point end to end through the `deepspeed` launcher, plus its input checks.

Launches (each 15-50 s on 2 cores, start-up ~13 s of it) are shared through module fixtures:
one uninterrupted TP2xPP2 run, one run stopped by SIGTERM and resumed, and eval-only loads of
the uninterrupted run's checkpoint at other layouts through the universal checkpoint.
"""

import json
import math
import re
import signal
import subprocess

import pytest
import torch

from tests.launcher.harness import (REPO, STEPS, config_copy, copy_checkpoint, deepspeed_command, demo_config,
                                    fault_env, layer_states, rank_process, read_metrics, resume_copy,
                                    wait_for)
from tests.launcher.in_world import run_job

METRIC_FIELDS = {"step", "loss", "lr", "grad_norm", "tokens_per_s", "tflops", "mfu", "memory_bytes", "step_time_s"}


def test_demo_trains_and_loss_falls(uninterrupted):
    metrics = uninterrupted["metrics"]
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    assert metrics[-1]["loss"] < metrics[0]["loss"] - 0.5, [m["loss"] for m in metrics]
    for record in metrics:
        assert METRIC_FIELDS <= set(record)
        assert record["tokens_per_s"] > 0 and record["tflops"] > 0 and record["grad_norm"] > 0
    assert [m["step"] for m in metrics if "eval_loss" in m] == [4, 8]
    stdout = uninterrupted["result"].stdout
    assert "layout TP2-PP2-DP1" in stdout and "stage 1: layers" in stdout
    assert f"done: {STEPS} steps; checkpoint {uninterrupted['out'] / 'checkpoints' / 'global_step8'}" in stdout
    checkpoints = uninterrupted["out"] / "checkpoints"
    assert (checkpoints / "latest").read_text().strip() == "global_step8"
    assert (checkpoints / "global_step4" / "hybrid3d.json").is_file()
    assert (checkpoints / "hf" / "tokenizer.json").is_file()
    # DeepSpeed's csv monitor received hybrid3d's values (and its own).
    monitored = {p.name for p in (uninterrupted["tmp"] / "monitor").rglob("*.csv")}
    assert "Train_hybrid3d_tokens_per_s.csv" in monitored and "Eval_hybrid3d_loss.csv" in monitored, monitored


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory):
    """The same run with asynchronous saves every 2 steps, rank 1's background write of step 2 held (the fault
    `hold_background_write`) until SIGTERM reaches rank 1, then resumed from `latest`."""
    tmp = tmp_path_factory.mktemp("interrupted")
    config = demo_config(tmp, checkpoint={"save_interval": 2, "keep_last": 0, "async": True})
    marker = tmp / "held"
    env = fault_env({"kind": "hold_background_write", "rank": 1, "match": "global_step2", "marker": str(marker)})
    proc = subprocess.Popen(deepspeed_command(4, config), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, cwd=tmp, env=env)
    if wait_for(marker.exists, proc):  # the write of step 2 is in flight on rank 1
        rank_process(proc, 1).send_signal(signal.SIGTERM)
    first_output, _ = proc.communicate(timeout=300)
    resumed = run_job(4, config, "--checkpoint.load", "latest")
    return dict(first_rc=proc.returncode, first_output=first_output, resumed=resumed, out=tmp / "run",
                held=marker.exists(), config=config)


def test_sigterm_during_a_background_write_commits_it_saves_and_resume_continues_exactly(uninterrupted,
                                                                                         interrupted):
    """SIGTERM to one rank while its background write of step 2 runs: the job commits step 2, saves the step it
    stops at, exits 0, and the resume from there is the uninterrupted run bit for bit."""
    assert interrupted["held"] and interrupted["first_rc"] == 0, interrupted["first_output"][-3000:]
    output = interrupted["first_output"]
    stopped = re.search(r"stopped by SIGTERM \(rank 1\) after step (\d+); checkpoint (\S+)", output)
    assert stopped, output[-3000:]
    stop_step = int(stopped.group(1))
    assert 2 <= stop_step < STEPS
    committed = output.index("checkpoint global_step2 committed: the step was held")
    assert committed < stopped.start()  # the write in flight was committed before the stop's own save
    checkpoints = interrupted["out"] / "checkpoints"
    assert (checkpoints / "global_step2").is_dir() and not list(checkpoints.glob("*.incomplete"))
    resumed = interrupted["resumed"]
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert f"at step {stop_step}" in resumed.stdout
    metrics = read_metrics(interrupted["out"], "steps")
    assert [m["step"] for m in metrics] == list(range(1, stop_step + 1)) + list(range(stop_step + 1, STEPS + 1))
    # fp32 on the CPU: the interrupted-and-resumed run is the uninterrupted run, bit for bit.
    assert [m["loss"] for m in metrics] == [m["loss"] for m in uninterrupted["metrics"]]
    assert [m.get("eval_loss") for m in metrics] == [m.get("eval_loss") for m in uninterrupted["metrics"]]
    final = layer_states(checkpoints / "global_step8")
    reference = layer_states(uninterrupted["out"] / "checkpoints" / "global_step8")
    assert final.keys() == reference.keys() and len(final) == 14
    for name in final:
        for key in final[name]:
            assert torch.equal(final[name][key], reference[name][key]), (name, key)


def test_an_asynchronous_checkpoint_reshards_like_a_synchronous_one(uninterrupted, interrupted):
    """The resumed run's last checkpoint, saved asynchronously, evaluates at TP1 x PP1 through DeepSpeed's universal
    checkpoint to the uninterrupted run's eval loss."""
    result = run_job(1, interrupted["config"], "--tensor_parallel_size", "1", "--pipeline_parallel_size", "1",
                     "--checkpoint.load", str(interrupted["out"] / "checkpoints"), "--eval-only")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "global_step8" in result.stdout and "through DeepSpeed's universal checkpoint" in result.stdout
    eval_loss = float(re.search(r"eval_loss (\S+) perplexity", result.stdout).group(1))
    assert math.isclose(eval_loss, uninterrupted["metrics"][-1]["eval_loss"], rel_tol=1e-5)


@pytest.mark.parametrize("num_gpus, overrides", [
    (1, ["--tensor_parallel_size", "1", "--pipeline_parallel_size", "1"]),
    (4, ["--tensor_parallel_size", "1", "--pipeline_parallel_size", "2", "--gradient_accumulation_steps", "2"]),
    # sequence and context parallelism change no weight: the TP2xPP2 checkpoint evaluates the same
    (4, ["--pipeline_parallel_size", "1", "--context_parallel_size", "2", "--sequence_parallel", "true"]),
    # the same sizes under another schedule hold other layers per rank: resharded too
    (4, ["--pipeline_schedule", "interleaved", "--virtual_pipeline_size", "2"]),
    (4, ["--pipeline_schedule", "dualpipev"]),
    # the same layout with its stages cut by block count, set: the demo's head (2.8 blocks) no longer moves a
    # block to stage 0
    (4, ["--partition_method", "type:DecoderBlock"]),
], ids=["TP1-PP1-DP1", "TP1-PP2-DP2", "TP2+SP-CP2", "TP2-PP2-interleaved", "TP2-PP2-dualpipev", "TP2-PP2-count"])
def test_resume_at_another_layout_through_universal_checkpoint(uninterrupted, num_gpus, overrides):
    result = run_job(num_gpus, uninterrupted["config"], *overrides, "--checkpoint.load",
                    str(uninterrupted["out"] / "checkpoints"), "--eval-only")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "through DeepSpeed's universal checkpoint" in result.stdout
    if "type:DecoderBlock" in overrides:
        assert ("through DeepSpeed's universal checkpoint: its stages were cut by partition_method 'cost' (layer-spec "
                "bounds [0, 4, 7]), hybrid3d.partition_method 'type:DecoderBlock' cuts them [0, 3, 7]") in result.stdout
        assert "stage 0: layers 0-2 (29% of the FLOPs)" in result.stdout, result.stdout  # the embedding and 2 blocks
    eval_loss = float(re.search(r"eval_loss (\S+) perplexity", result.stdout).group(1))
    reference = uninterrupted["metrics"][-1]["eval_loss"]
    assert math.isclose(eval_loss, reference, rel_tol=1e-5), (eval_loss, reference)


def test_checkpoint_cut_by_block_count_resumes_on_its_own_stages(tmp_path):
    """A demo checkpoint cut by block count (the default before "cost"; its method and bounds recorded): a resume at
    its layout that leaves partition_method unset keeps those stages, says so in one line, loads the files as saved
    (no reshard), continues bit for bit and records them again (a set method reshards:
    test_resume_at_another_layout_through_universal_checkpoint)."""
    config = demo_config(tmp_path)
    short = ("--train.steps", "4", "--checkpoint.save_interval", "2")
    trained = run_job(4, config, *short, "--partition_method", "type:DecoderBlock")
    assert trained.returncode == 0, trained.stdout[-3000:] + trained.stderr[-3000:]
    assert "stage 0: layers 0-2 (29% of the FLOPs)" in trained.stdout
    metrics = read_metrics(tmp_path / "run")

    copy_checkpoint(tmp_path / "run", "global_step2", tmp_path / "resumed")
    resumed = run_job(4, config, *short, "--train.output_dir", str(tmp_path / "resumed"), "--checkpoint.load", "latest")
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    kept = [line for line in resumed.stdout.splitlines() if "keeping the pipeline stages" in line]
    assert len(kept) == 1 and kept[0].endswith(
        "global_step2: they were cut by partition_method 'type:DecoderBlock' (layer-spec bounds [0, 3, 7]) at this "
        "layout, so its files load as saved, without a reshard (hybrid3d.partition_method is unset; set it to re-cut "
        "them through the universal checkpoint)"), kept
    assert "universal checkpoint" not in resumed.stdout.replace(kept[0], "")
    assert "stage 0: layers 0-2 (29% of the FLOPs)" in resumed.stdout
    assert [m["loss"] for m in read_metrics(tmp_path / "resumed")] == [m["loss"] for m in metrics[2:]]
    layout = json.loads((tmp_path / "resumed" / "checkpoints" / "global_step4" / "hybrid3d.json").read_text())["layout"]
    assert (layout["partition"], layout["stage_bounds"]) == ("type:DecoderBlock", [0, 3, 7])


def test_interleaved_run_trains_like_1f1b_resumes_exactly_and_reshards(uninterrupted, tmp_path):
    """The demo at TP2xPP2 with the interleaved schedule (2 chunks per rank): the 1F1B run's losses (fp32); its
    step-4 checkpoint resumed continues bit for bit; its last checkpoint evaluates at TP1xPP1 through the
    universal checkpoint to its own eval loss. Its saves are asynchronous (the chunks' layer files copied to host
    memory and written in the background)."""
    config = demo_config(tmp_path, pipeline_schedule="interleaved", virtual_pipeline_size=2,
                         checkpoint={"save_interval": 4, "keep_last": 0, "async": True})
    trained = run_job(4, config)
    assert trained.returncode == 0, trained.stdout[-3000:] + trained.stderr[-3000:]
    assert "interleaved 1F1B schedule (2 chunks per rank)" in trained.stdout
    assert "stage 0: layers 0-1 and 3-3" in trained.stdout  # rank 0 holds stages 0 and 2 of 4
    assert [r["checkpoint"] for r in read_metrics(tmp_path / "run", "saves")] == ["global_step4", "global_step8"]
    metrics = read_metrics(tmp_path / "run", "steps")
    reference = uninterrupted["metrics"]
    for field in ("loss", "eval_loss"):
        ours, theirs = [m.get(field) for m in metrics], [m.get(field) for m in reference]
        assert [x is None for x in ours] == [x is None for x in theirs]
        assert all(math.isclose(a, b, rel_tol=1e-5) for a, b in zip(ours, theirs) if a is not None), (ours, theirs)

    checkpoints = tmp_path / "run" / "checkpoints"
    resumed = resume_copy(4, config, tmp_path / "run", "global_step4", tmp_path / "resumed")
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "through DeepSpeed's universal checkpoint" not in resumed.stdout
    assert [m["loss"] for m in read_metrics(tmp_path / "resumed", "steps")] == [m["loss"] for m in metrics[4:]]

    evaluated = run_job(1, config, "--tensor_parallel_size", "1", "--pipeline_parallel_size", "1",
                       "--pipeline_schedule", "1f1b", "--virtual_pipeline_size", "1", "--checkpoint.load",
                       str(checkpoints), "--eval-only")
    assert evaluated.returncode == 0, evaluated.stdout[-3000:] + evaluated.stderr[-3000:]
    assert "through DeepSpeed's universal checkpoint" in evaluated.stdout
    eval_loss = float(re.search(r"eval_loss (\S+) perplexity", evaluated.stdout).group(1))
    assert math.isclose(eval_loss, metrics[-1]["eval_loss"], rel_tol=1e-5), (eval_loss, metrics[-1]["eval_loss"])


def tiny_hf_model_and_documents(tmp_path):
    """(tokenizer, model folder, documents file, texts): a tiny HF Llama over the built-in tokenizer, saved with it in
    tmp_path/hf, and 200 text documents in tmp_path/docs.jsonl."""
    from transformers import AutoTokenizer

    from hybrid3d.data.builtin import builtin_tokenizer_path
    from tests.tiny_llama import make_hf_llama

    tokenizer = AutoTokenizer.from_pretrained(builtin_tokenizer_path())
    model_dir = tmp_path / "hf"
    make_hf_llama(str(model_dir), "gqa_llama3", vocab_size=len(tokenizer), max_position_embeddings=256)
    tokenizer.save_pretrained(model_dir)
    texts = [f"Example {i}: " + "the quick brown fox " * (i % 5 + 3) for i in range(200)]
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
    return tokenizer, model_dir, docs, texts


def test_training_starts_from_hf_weights(tmp_path):
    """`model.hf_model` + `init_from_hf`: the first step's loss is HF's loss on the same batch (a blend from HF weights,
    trained and resumed against HF:
    test_a_blend_stopped_after_a_checkpoint_resumes_megatron_cores_order_at_another_dp_size)."""
    import torch.nn.functional as F
    from transformers import LlamaForCausalLM

    from hybrid3d.config.sections import DataSection
    from hybrid3d.data import build_training_data, micro_batches
    from hybrid3d.data.pipeline import TokenizerSource

    tokenizer, model_dir, docs, _ = tiny_hf_model_and_documents(tmp_path)
    data_section = {"path": str(docs), "seq_length": 64}
    config = demo_config(tmp_path, tensor_parallel_size=2, pipeline_parallel_size=1, data=data_section,
                         model={"hf_model": str(model_dir), "init_from_hf": True})
    result = run_job(2, config, "--train.steps", "1", "--train.eval_interval", "0")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    metrics = read_metrics(tmp_path / "run")

    tokenizers = TokenizerSource(load=lambda: tokenizer, identity="t", config_eos_id=None)
    data = build_training_data(DataSection(**data_section), tokenizers, len(tokenizer))
    ids, targets = next(micro_batches(data.train, 0, 16, 0, 1, 16))[:2]
    with torch.no_grad():
        hf = LlamaForCausalLM.from_pretrained(model_dir).eval()
        expected = F.cross_entropy(hf(ids).logits.flatten(0, 1), targets.flatten()).item()
    assert math.isclose(metrics[0]["loss"], expected, rel_tol=1e-5), (metrics[0]["loss"], expected)


def hf_trained(model_dir, raw: dict, batches) -> tuple[list[float], dict]:
    """HF LlamaForCausalLM trained one step per (ids, targets) of `batches` as the config `raw` trains: torch's AdamW
    with its optimizer parameters, DeepSpeed's own WarmupDecayLR class with its scheduler's, clipping to its
    gradient_clipping, the loss the mean over every target of the batch; (the loss of each step, the weights after)."""
    import torch.nn.functional as F
    from deepspeed.runtime.lr_schedules import WarmupDecayLR
    from transformers import LlamaForCausalLM

    assert raw["scheduler"]["type"] == "WarmupDecayLR"
    params = raw["optimizer"]["params"]
    model = LlamaForCausalLM.from_pretrained(model_dir).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=params["lr"], betas=tuple(params["betas"]), eps=params["eps"],
                                  weight_decay=params["weight_decay"])
    scheduler = WarmupDecayLR(optimizer, **raw["scheduler"]["params"])
    losses = []
    for ids, targets in batches:
        loss = F.cross_entropy(model(ids).logits.flatten(0, 1), targets.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), raw["gradient_clipping"])
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, {name: p.detach().clone() for name, p in model.named_parameters()}


def test_a_blend_stopped_after_a_checkpoint_resumes_megatron_cores_order_at_another_dp_size(tmp_path):
    """A blend (`data.blend`) of a Megatron indexed dataset written by megatron-core (weight 2) and text documents
    (weight 1), each holding out its last 10% for its own evaluation, trained from HF weights at TP2 (DP1: 16
    sequences a step) with a checkpoint at step 3, and resumed from that checkpoint at TP1 x DP2 (32 sequences a step,
    through the universal checkpoint): the resumed run continues at sample 48 (mid-epoch in both datasets), and every
    step of both runs trains like HF + torch AdamW on the samples megatron-core's `build_blending_indices` names, each
    a window this test cuts from its dataset's own documents. The same comparison fails for a resume that lost the
    samples consumed (3 steps x 32) or restarted the blend.

    The stop: a job killed -9 after step 3 leaves the step-3 checkpoint as `latest` and nothing of later steps under a
    tag (a launched job whose ranks are killed -9 mid-save resumes so: test_multinode.py); the resume here starts from
    a copy of that checkpoint alone, in the pooled world of 2."""
    import numpy as np

    from hybrid3d.convert.hybrid_to_hf import hybrid_to_hf
    from tests.distributed.reports import read_safetensors_folder
    from tests.megatron_oracle import megatron_datasets
    from tests.tiny_llama import max_rel_error

    tokenizer, model_dir, docs, texts = tiny_hf_model_and_documents(tmp_path)
    eos, s = tokenizer.eos_token_id, 64
    records = [tokenizer(f"Record {i} says " + "lorem ipsum " * (i % 4 + 2), add_special_tokens=False)["input_ids"]
               + [eos] for i in range(150)]  # each document followed by EOS, as preprocessing's --append-eos writes
    prefix = str(tmp_path / "megatron")
    builder = megatron_datasets().indexed.IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for ids in records:
        builder.add_document(np.asarray(ids), [len(ids)])
    builder.finalize(prefix + ".idx")
    blend = [{"path": prefix, "weight": 2}, {"path": str(docs), "weight": 1}]
    config = demo_config(tmp_path, tensor_parallel_size=2, pipeline_parallel_size=1,
                         model={"hf_model": str(model_dir), "init_from_hf": True},
                         data={"blend": blend, "seq_length": s, "eval_fraction": 0.1},
                         checkpoint={"save_interval": 3, "keep_last": 0})
    raw = json.loads(config.read_text())
    raw["hybrid3d"]["train"].update(steps=5, eval_interval=5)
    config.write_text(json.dumps(raw))
    trained = run_job(2, config)
    assert trained.returncode == 0, trained.stdout[-3000:] + trained.stderr[-3000:]
    copy_checkpoint(tmp_path / "run", "global_step3", tmp_path / "resumed")
    resumed = run_job(2, config, "--tensor_parallel_size", "1", "--train.output_dir", str(tmp_path / "resumed"),
                      "--checkpoint.load", "latest", "--train.eval_interval", "0")
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "layout TP1-PP1-DP2" in resumed.stdout and "through DeepSpeed's universal checkpoint" in resumed.stdout
    assert "data: continuing at sample 48 (the checkpoint's samples consumed; 3 steps of this run's 32 sequences " \
           "would be 96)" in resumed.stdout, resumed.stdout[-3000:]
    first = read_metrics(tmp_path / "run", "steps")
    second = read_metrics(tmp_path / "resumed", "steps")
    assert [(m["step"], m["samples_consumed"]) for m in first] == [(k, 16 * k) for k in range(1, 6)]
    assert [(m["step"], m["samples_consumed"]) for m in second] == [(4, 80), (5, 112)]

    # Each dataset's training documents (the first 90%; the last 10% are its evaluation), EOS after each, as one
    # stream; its sample j is the (s+1)-token window at j*s, counted again from its start past its last window (its
    # next epoch). Global sample i is dataset order[i]'s sample within[i] (megatron-core's blending order).
    streams = [[t for ids in records[:135] for t in ids],
               [t for text in texts[:180] for t in tokenizer(text, add_special_tokens=False)["input_ids"] + [eos]]]
    windows = [(len(stream) - 1) // s for stream in streams]
    n = 160  # samples 0-159: the furthest a run below reads
    order, within = np.zeros(n, np.int16), np.zeros(n, np.int64)
    megatron_datasets().helpers.build_blending_indices(order, within, np.array([2 / 3, 1 / 3]), 2, n, False)
    # The checkpoint is mid-epoch in both datasets, and the resumed steps run past the Megatron dataset's end into
    # its second epoch (measured: 51 and 143 samples; 32 and 16 taken at sample 48, 75 and 37 at 112).
    taken = np.bincount(order[:48], minlength=2)
    assert all(0 < t % w for t, w in zip(taken, windows)), (taken, windows)
    assert np.bincount(order[:112], minlength=2)[0] > windows[0] > taken[0], windows

    def batch(first_sample: int, size: int):
        """(ids, targets), each (size, s): global samples first_sample .. first_sample + size - 1."""
        rows = []
        for i in range(first_sample, first_sample + size):
            stream, j = streams[order[i]], int(within[i]) % windows[order[i]]
            rows.append(stream[j * s:j * s + s + 1])
        rows = torch.tensor(rows)  # (size, s + 1)
        return rows[:, :-1], rows[:, 1:]

    before = [batch(16 * k, 16) for k in range(3)]  # the steps up to the checkpoint
    reference = {"run": hf_trained(model_dir, raw, before + [batch(48, 16), batch(64, 16)]),
                 "resumed": hf_trained(model_dir, raw, before + [batch(48, 32), batch(80, 32)])}
    # fp32, as the equivalence matrix (tests/distributed/test_engine.py): the first loss within 1e-5, the losses and
    # the weights after the last step within 1e-4 (measured: 1.2e-7 and 7e-7). The losses barely tell the data apart
    # (the model is 3 steps from random, its loss ~log V); the weights do: a resume one sample off ends 0.03 away.
    assert max_rel_error(torch.tensor(first[0]["loss"]), torch.tensor(reference["run"][0][0])) <= 1e-5
    for name, metrics, steps in (("run", first, slice(0, 5)), ("resumed", second, slice(3, 5))):
        losses, weights = reference[name]
        assert max_rel_error(torch.tensor([m["loss"] for m in metrics]), torch.tensor(losses[steps])) <= 1e-4, name
        hybrid_to_hf(tmp_path / name / "checkpoints", tmp_path / f"{name}-hf", hf_config_dir=model_dir)
        trained_weights = read_safetensors_folder(tmp_path / f"{name}-hf")
        assert trained_weights.keys() == weights.keys()
        bad = {n: e for n, w in weights.items() if not (e := max_rel_error(trained_weights[n], w)) <= 1e-4}
        assert not bad, (name, bad)
    # what a resume that lost the cursor would train on: sample 3 x 32 (steps x this run's batch), or the blend
    # started again at sample 0 (measured: 0.067 and 0.091 from the resumed run's weights)
    for wrong in ([batch(96, 32), batch(128, 32)], [batch(0, 32), batch(32, 32)]):
        weights = hf_trained(model_dir, raw, before + wrong)[1]
        assert max(max_rel_error(w, reference["resumed"][1][n]) for n, w in weights.items()) > 100 * 1e-4

    assert "data: a blend of 2 datasets" in trained.stdout and "  megatron: 135 documents, " in trained.stdout
    assert "; weight 0.667; " in trained.stdout and "blend's training tokens" in trained.stdout
    assert sorted(first[-1]["eval_losses"]) == ["docs", "megatron"]
    per_dataset = first[-1]["eval_losses"]
    assert math.isclose(first[-1]["eval_loss"], (2 * per_dataset["megatron"] + per_dataset["docs"]) / 3, rel_tol=1e-9)


def test_context_parallel_run_resumes_at_another_layout(tmp_path):
    """A TP2+SP x Ulysses CP2 run's checkpoint (ZeRO partitions over the d·c = 2 sequence-data-parallel ranks)
    reshards to ring attention's CP2 without TP through the universal checkpoint and evaluates to the run's own last
    eval loss."""
    config = demo_config(tmp_path, pipeline_parallel_size=1, context_parallel_size=2, sequence_parallel=True)
    trained = run_job(4, config)
    assert trained.returncode == 0, trained.stdout[-3000:] + trained.stderr[-3000:]
    assert "layout TP2+SP-CP2-PP1-DP1" in trained.stdout and "16 tokens per rank" in trained.stdout
    metrics = read_metrics(tmp_path / "run")
    assert metrics[-1]["loss"] < metrics[0]["loss"] - 0.5, [m["loss"] for m in metrics]
    result = run_job(2, config, "--tensor_parallel_size", "1", "--context_parallel_comm", "p2p", "--sequence_parallel",
                    "false", "--checkpoint.load", str(tmp_path / "run" / "checkpoints"), "--eval-only")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "through DeepSpeed's universal checkpoint" in result.stdout
    eval_loss = float(re.search(r"eval_loss (\S+) perplexity", result.stdout).group(1))
    assert math.isclose(eval_loss, metrics[-1]["eval_loss"], rel_tol=1e-5), (eval_loss, metrics[-1]["eval_loss"])


def test_mixtral_with_expert_parallelism_trains_from_hf_and_resumes_exactly(tmp_path):
    """A tiny HF Mixtral folder (`model.hf_model` + `init_from_hf`) trains at DP2 x EP2 (each rank holds 2 of the 4
    experts) through the launcher; its step-4 checkpoint (DeepSpeed's files plus each EP rank's expert file)
    resumed continues with the same losses bit for bit (fp32)."""
    from tests.tiny_mixtral import make_mixtral

    model_dir = tmp_path / "mixtral"
    make_mixtral(model_dir, vocab_size=4096)  # the built-in tokenizer's vocabulary
    config = demo_config(tmp_path, tensor_parallel_size=1, pipeline_parallel_size=1, expert_parallel_size=2,
                         model={"hf_model": str(model_dir), "init_from_hf": True})
    trained = run_job(2, config)
    assert trained.returncode == 0, trained.stdout[-3000:] + trained.stderr[-3000:]
    assert "EP2" in trained.stdout
    assert "experts: loop (hybrid3d.expert_kernel null: one GEMM per expert, any shape" in trained.stdout
    metrics = read_metrics(tmp_path / "run")
    for record in metrics:  # the routing fields (their values are checked against HF in tests/distributed/test_moe.py)
        assert record["aux_loss"] > 0 and record["expert_load_max"] >= 1.0
        assert len(record["expert_load"]) == 4 and abs(sum(record["expert_load"]) - 1.0) < 1e-4
    assert "busiest expert" in trained.stdout
    checkpoints = tmp_path / "run" / "checkpoints"
    assert list((checkpoints / "global_step4").glob("experts_ep_rank_*"))

    resumed = resume_copy(2, config, tmp_path / "run", "global_step4", tmp_path / "resumed")
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert [m["loss"] for m in read_metrics(tmp_path / "resumed")] == [m["loss"] for m in metrics[4:]]


def test_chat_fine_tune_demo_runs_on_the_converted_demo_model(uninterrupted, tmp_path):
    """The README's fine-tuning path: the demo's checkpoint exported to HF, then ds_configs/cpu_chat_finetune.json
    (the built-in conversations, chat template, document masking) trains from it; bad chat data ends with one
    line, exit 2, and no output folder."""
    from hybrid3d.convert.__main__ import main as convert_main

    export = tmp_path / "tiny-hf"
    # the export's command line, in this process (the command as a process: test_first_run's README commands)
    assert convert_main(["hybrid2hf", "--checkpoint", str(uninterrupted["out"] / "checkpoints"), "--out",
                         str(export)]) == 0
    config = config_copy(REPO / "ds_configs" / "cpu_chat_finetune.json", tmp_path / "chat.json", tmp_path / "chat")
    common = ("--model.hf_model", str(export), "--data.chat_template", str(REPO / "ds_configs" / "chat_template.jinja"),
              "--train.steps", "4", "--train.eval_interval", "4", "--train.log_interval", "1",
              "--scheduler.params.total_num_steps", "4")
    result = run_job(4, config, *common)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "data: " in result.stdout and " examples in " in result.stdout and "documents masked" in result.stdout
    metrics = read_metrics(tmp_path / "chat")
    assert len(metrics) == 4 and all(math.isfinite(m["loss"]) for m in metrics) and "eval_loss" in metrics[-1]

    bad = tmp_path / "bad.jsonl"
    bad.write_text("".join(json.dumps({"text": f"no messages here {i}"}) + "\n" for i in range(40)))
    refused = run_job(4, config, *common, "--data.path", str(bad), "--train.output_dir", str(tmp_path / "refused"))
    assert refused.returncode == 2
    errors = [line for line in refused.stdout.splitlines() + refused.stderr.splitlines() if "error:" in line]
    assert errors and all("'chat' needs column 'messages'" in line for line in errors), errors
    assert not (tmp_path / "refused").exists()


def test_auto_layout_decides_reports_writes_the_resolved_config_and_keeps_it_on_resume(tmp_path):
    """`"layout": "auto"`: the start-up says what was chosen and why, `resolved_config.json` is a written-out config
    the job accepts as it is, `config.json` keeps the config as given; a resume at the same world size keeps the
    checkpoint's sizes even where another budget would plan others."""
    config = demo_config(tmp_path, layout="auto", device_memory_gb=1.0)
    raw = json.loads(config.read_text())
    for key in ("tensor_parallel_size", "pipeline_parallel_size"):
        del raw["hybrid3d"][key]
    for key in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
        del raw[key]
    del raw["zero_optimization"]["stage"]
    raw["train_batch_size"] = 16
    config.write_text(json.dumps(raw))
    trained = run_job(2, config, "--train.steps", "4")
    assert trained.returncode == 0, trained.stdout[-3000:] + trained.stderr[-3000:]
    chosen = re.search(r"auto: TP(\d) PP(\d) CP(\d) DP(\d)", trained.stdout)
    assert chosen and "auto:   predicted" in trained.stdout and "auto:   next:" in trained.stdout
    resolved = json.loads((tmp_path / "run" / "resolved_config.json").read_text())
    assert json.loads((tmp_path / "run" / "config.json").read_text())["hybrid3d"]["layout"] == "auto"
    tp, pp, cp, dp = map(int, chosen.groups())
    section = resolved["hybrid3d"]
    assert "layout" not in section and (section["tensor_parallel_size"], section["pipeline_parallel_size"],
                                        section["context_parallel_size"]) == (tp, pp, cp)
    assert f"layout TP{tp}" in trained.stdout
    resumed = run_job(2, config, "--train.steps", "6", "--checkpoint.load", "latest", "--device_memory_gb", "0.02")
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert re.search(rf"auto: TP{tp} PP{pp} CP{cp} DP{dp}.*\(the sizes of .*global_step4\)", resumed.stdout)
    assert "universal checkpoint" not in resumed.stdout and "at step 4" in resumed.stdout
