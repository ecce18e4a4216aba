"""tools/benchmarks/bench_peers.py on the CPU, with a two-layer Qwen3-MoE of the benchmark's own
making (fp32): transformers' runner and this project's model, built from the very command line our
runner launches (examples/moe_small/train.sh, the planner on) with the import loaded, give the
same loss on the first step and the same losses over three steps of the shared optimizer, on the
same tokens (the peers' batches are pretrain_gpt.py's, read through upstream's data loader);
torchtitan's model of the same weights gives transformers' logits; a record has every field; the
micro-batch falls back on running out of memory; the longest-sequence search finds a boundary;
our run's log and metrics are read as they are written."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import pytest
import torch

from tests.harness.benchmark_modules import load_benchmark
from tests.unit.distributed import run_on_ranks
from megatron.bounded.units import GiB

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

SEQ_LENGTH = 64
GLOBAL_BATCH = 4
STEPS = 3
# a two-layer model of the small preset's shape at toy widths (every option stays on)
TINY = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
            intermediate_size=96, vocab_size=256)
FIRST_LOSS_TOLERANCE = 1e-5  # relative, fp32
# Three AdamW steps from the same weights and batches: the two models' gradients differ by fp32
# rounding, which Adam's normalized first steps carry into the weights
LOSS_TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("bench_peers.py")


@pytest.fixture(scope="module")
def work(bench, tmp_path_factory):
    from peers import workload

    return workload.make("small", tmp_path_factory.mktemp("peers") / "small", dtype="fp32",
                         stream_tokens=100_000, **TINY)


def _our_argv(work) -> list:
    """The pretrain_gpt.py flags our runner launches for the tiny run (fp32: without --bf16)."""
    from example_argv import example_argv
    from peers import ours

    env = ours.environment(work, SEQ_LENGTH, STEPS, GLOBAL_BATCH, os.environ)
    argv = example_argv(ours.EXAMPLE, env, ours.flags(work, SEQ_LENGTH, Path("unused.jsonl")))
    argv = argv[argv.index("pretrain_gpt.py") + 1:]
    argv.remove("--bf16")
    return argv


def _ours_three_steps(rank, world_size, argv, work_dir):
    """Our model of ``argv`` (pretrain_gpt.py's parsing and planning, its model config and
    upstream's builder), the import loaded, trained three steps on pretrain_gpt.py's own training
    data through upstream's data loader with the peers' optimizer; (losses, tokens per step)."""
    import pretrain_gpt
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.training import global_vars
    from megatron.training.datasets.data_samplers import build_pretraining_data_loader
    from megatron.training.models.gpt import GPTModelBuilder
    from megatron.training.training import get_train_valid_test_num_samples

    from megatron.bounded.launch.commands.hf_conversion import load_into
    from tests.conftest import keep_upstream_checkpoint_on_cpu, keep_upstream_rotary_on_cpu

    load_benchmark("bench_peers.py")
    from peers.training import Update, run_steps

    os.environ["WORLD_SIZE"] = "1"
    torch._dynamo.config.disable = True  # upstream's compiled helpers: the same values eager
    keep_upstream_rotary_on_cpu()
    keep_upstream_checkpoint_on_cpu()
    sys.argv = ["pretrain_gpt.py", *argv]
    args, settings = pretrain_gpt.parse_flags()
    parallel_state.initialize_model_parallel()
    model_config = pretrain_gpt.build_model_config(args, settings)
    model_config.transformer.use_cpu_initialization = True
    model = GPTModelBuilder(model_config).build_model(ProcessGroupCollection.use_mpu_process_groups())
    load_into(model, str(Path(work_dir) / "imported"))
    global_vars.rebuild_tokenizer(args)
    train, _, _ = pretrain_gpt.train_valid_test_datasets_provider(
        get_train_valid_test_num_samples())
    args.num_workers = 0  # its workers only read ahead, in the same order (none in a test rank)
    batches = iter(build_pretraining_data_loader(train, 0))
    steps_tokens = []

    class Upstream:  # the peers' loop reads the dataset by index: serve the loader's batches
        def __getitem__(self, index):
            if index % args.micro_batch_size == 0:
                self.batch = next(batches)
                steps_tokens.append(self.batch["tokens"].tolist())
            i = index % args.micro_batch_size
            return {key: self.batch[key][i] for key in ("tokens", "labels", "loss_mask")}

    def loss_of(tokens, labels):
        positions = torch.arange(tokens.shape[1]).expand_as(tokens)
        per_token = model(tokens, positions, attention_mask=None, labels=labels.clamp(min=0))
        mask = (labels != -100).float()
        return (per_token.float() * mask).sum() / mask.sum()

    losses, seconds = [], []
    run_steps(loss_of, Update(model, "fp32", "cpu"), Upstream(), STEPS, GLOBAL_BATCH,
              args.micro_batch_size, "cpu", losses, seconds)
    return losses, steps_tokens


@pytest.fixture(scope="module")
def both_runs(bench, work):
    from peers import hf, workload

    dataset = workload.training_dataset(work, SEQ_LENGTH, STEPS * GLOBAL_BATCH)
    settings = hf.Settings(precision="fp32", compile=False)
    recorded, measured = hf.run("hf", work, dataset, SEQ_LENGTH, GLOBAL_BATCH, STEPS, "cpu",
                                settings)
    peers_tokens = [dataset[i]["tokens"].tolist() for i in range(STEPS * GLOBAL_BATCH)]
    ours, ours_tokens = run_on_ranks(_ours_three_steps, 1, args=(_our_argv(work),
                                                                 str(work.directory)),
                                     timeout_s=600)[0]
    return recorded, measured, peers_tokens, ours, ours_tokens


def test_the_peers_read_the_sequences_pretrain_gpt_reads_in_its_order(both_runs):
    _, _, peers_tokens, _, ours_tokens = both_runs
    assert [row for batch in ours_tokens for row in batch] == peers_tokens


def test_transformers_and_ours_give_the_same_losses_on_the_same_weights_and_tokens(both_runs):
    _, measured, _, ours, _ = both_runs
    hf_losses = measured["losses"]
    assert measured["outcome"] == "ok" and len(hf_losses) == len(ours) == STEPS
    assert math.isclose(hf_losses[0], ours[0], rel_tol=FIRST_LOSS_TOLERANCE), (hf_losses, ours)
    assert max(abs(a - b) for a, b in zip(hf_losses, ours)) < LOSS_TOLERANCE, (hf_losses, ours)
    assert hf_losses[0] != hf_losses[-1]  # the optimizer moved the weights


def test_the_long_context_settings_train_the_same_function(bench, work, both_runs):
    pytest.importorskip("liger_kernel")
    from peers import hf, workload

    # the tiles (Liger-Kernel's tiled MLP), checkpoints and host offload run here; Liger's fused
    # kernels are Triton's (GPU only)
    settings = hf.Settings(precision="fp32", checkpointing=True, tiled_mlp=True, mlp_tiles=4,
                           offload=True)
    dataset = workload.training_dataset(work, SEQ_LENGTH, STEPS * GLOBAL_BATCH)
    _, measured = hf.run("hf_offload", work, dataset, SEQ_LENGTH, GLOBAL_BATCH, STEPS, "cpu",
                         settings)
    plain = both_runs[1]["losses"]
    assert max(abs(a - b) for a, b in zip(measured["losses"], plain)) < 1e-5, (measured, plain)


def test_a_record_has_every_field_and_is_json(bench, work, both_runs):
    from peers.training import record

    recorded, measured, _, _, _ = both_runs
    found = record("hf", recorded, work, SEQ_LENGTH, GLOBAL_BATCH, STEPS, 1, measured)
    assert set(found) >= {
        "system", "settings", "preset", "seq_length", "global_batch", "micro_batch", "steps",
        "warmup_steps", "outcome", "tokens_per_s_per_gpu", "peak_gib", "losses", "step_s",
        "weights_sha256", "tokens_sha256", "versions", "gpu", "date", "commit", "command"}
    assert found["settings"]["experts_backend"] and found["versions"]["torch"] == torch.__version__
    assert found["micro_batch"] == GLOBAL_BATCH and len(found["step_s"]) == STEPS - 1
    assert found["tokens_per_s_per_gpu"] > 0 and found["gpu"] == "cpu"
    assert json.loads(json.dumps(found)) == found


def test_the_largest_micro_batch_that_fits_is_kept(bench):
    from peers.training import Update, train

    model = torch.nn.Linear(4, 4)
    dataset = [{"tokens": torch.zeros(8, dtype=torch.long), "labels": torch.zeros(8, dtype=torch.long),
                "loss_mask": torch.ones(8)} for _ in range(16)]
    tried = []

    def loss_of(tokens, labels):
        tried.append(tokens.shape[0])
        if tokens.shape[0] > 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB")
        return model(torch.ones(4)).square().sum()

    measured = train(loss_of, Update(model, "fp32", "cpu"), dataset, 2, 8, 8, 64, "cpu")
    assert (measured["outcome"], measured["micro_batch"]) == ("ok", 2)
    assert tried[:2] == [8, 4] and len(measured["losses"]) == 2
    with pytest.raises(ValueError):  # another failure is not an out-of-memory: it goes on up
        train(lambda tokens, labels: (_ for _ in ()).throw(ValueError("bad")),
              Update(model, "fp32", "cpu"), dataset, 2, 8, 8, 64, "cpu")


@pytest.mark.parametrize("boundary", [150_000, 131_072, 3_000_000, 5_000])
def test_the_search_finds_the_longest_length_within_five_percent(bench, boundary):
    from peers import longest

    probed = []

    def probe(length):
        probed.append(length)
        return {"outcome": "ok" if length <= boundary else "oom"}

    found = longest.search(probe, 131_072)
    assert found["finished"] and found["longest"] <= boundary < found["shortest_failing"]
    assert found["shortest_failing"] <= found["longest"] * 1.05 + longest.GRANULE
    assert all(n % longest.GRANULE == 0 for n in probed) and len(set(probed)) == len(probed)


def test_the_search_probes_a_named_longest_length_and_stops_when_out_of_time(bench):
    from peers import longest

    def refusing(length):  # our planner: refused above its longest, naming it
        return ({"outcome": "ok"} if length <= 3_775_488 else
                {"outcome": "refused", "longest_hint": 3_775_488})

    found = longest.search(refusing, 131_072)
    assert found["longest"] == 3_775_488 and found["failing_outcome"] == "refused"
    lengths = [p["seq_length"] for p in found["probes"]]
    assert lengths[lengths.index(4_194_304) + 1] == 3_775_488  # the first refusal's hint next
    assert found["shortest_failing"] <= 3_775_488 * 1.05
    budget = iter([{"outcome": "ok"}, None])
    found = longest.search(lambda length: next(budget), 131_072)
    assert (found["finished"], found["longest"]) == (False, 131_072)


def test_our_runs_log_and_metrics_are_read(bench, tmp_path):
    from peers import ours

    metrics = tmp_path / "ours.metrics.jsonl"
    metrics.write_text("\n".join(json.dumps(r) for r in (
        {"iteration": 1, "lm_loss": 10.5, "peak_allocated_gib": 30.0},
        {"iteration": 2, "lm_loss": 10.1, "ms_per_iteration": 500.0, "peak_allocated_gib": 31.5},
    )) + "\n")
    log = ("[bounded] plan: added --micro-batch-size 2 (the fastest ...)\n"
           "  micro_batch_size ................................ 2\n[bounded] run: MoE ...\n")
    settings, measured = ours.measurements(log, 0, metrics)
    assert settings["plan"].startswith("[bounded] plan:") and settings["run"]
    assert measured == {"outcome": "ok", "micro_batch": 2, "losses": [10.5, 10.1],
                        "step_s": [None, 0.5], "peak_bytes": 31.5 * GiB}
    refusal = ("[bounded] error: --seq-length 8,388,608 at --micro-batch-size 1 does not fit ... "
               "The longest --seq-length that fits is 3,775,488 (planned there: ...).")
    _, measured = ours.measurements(refusal, 2, tmp_path / "none.jsonl")
    assert (measured["outcome"], measured["longest_hint"]) == ("refused", 3_775_488)
    _, measured = ours.measurements("torch.OutOfMemoryError: CUDA out of memory.\nexitcode: 1", 1,
                                    tmp_path / "none.jsonl")
    assert measured["outcome"] == "oom"
    assert measured["last_lines"] == ["torch.OutOfMemoryError: CUDA out of memory."]


def test_torchtitans_model_of_the_weights_gives_transformers_logits(bench, work, monkeypatch):
    pytest.importorskip("torchtitan.models.qwen3")
    import transformers
    from peers import titan, workload

    # its router counts tokens per expert with torch.histc on int64, which has no CPU kernel:
    # counted in float here (exact for these counts)
    histc = torch.histc
    monkeypatch.setattr(torch, "histc", lambda x, *a, **k: histc(x.float(), *a, **k).to(x.dtype))
    tokens, _ = workload.micro_batch(workload.training_dataset(work, SEQ_LENGTH, 2), 0, 2, "cpu")
    model = titan.build_model(work, SEQ_LENGTH, "cpu", grouped_mm=False).eval()
    reference = transformers.AutoModelForCausalLM.from_pretrained(work.hf_dir,
                                                                  dtype=torch.float32).eval()
    with torch.no_grad():
        ours, theirs = model(tokens), reference(input_ids=tokens).logits
    assert ((ours - theirs).abs().max() / theirs.abs().max()).item() < 1e-6


def test_a_run_past_its_limit_is_stopped_and_its_output_kept(tmp_path):
    from tests.tool_modules import load_tool

    run_logged = load_tool("stop_job.py").run_logged
    log = tmp_path / "job.log"
    assert run_logged(["bash", "-c", "echo started; sleep 60"], log, 2) is None
    assert log.read_text() == "started\n"
    assert run_logged(["bash", "-c", "echo done >&2; exit 3"], log, 30) == 3
    assert log.read_text() == "done\n"
