#!/usr/bin/env bash
# The main command as a user runs it, at several sequence lengths, each planned by pretrain_gpt.py's
# planner (no flag beyond the ones named): one run per entry of RUNS, in order, on this machine's
# GPUs.
#   RESULTS_DIR=R [RUNS="4096:30 131072:2"] bash tools/benchmarks/bench_planner.sh
# An entry is LENGTH:ITERATIONS[:EXTRA] with EXTRA a comma-separated list of extra flags (e.g.
# 2097152:1:--num-layers,2); an item @FILE stands for the flags written in FILE (relative to
# tools/benchmarks/models/, e.g. 131072:2:@qwen3_next_4_layers.flags,@qwen3_next_gated_deltanet.flags
# runs a Qwen3-Next-shaped model). Each runs `SEQ_LENGTH=LENGTH TRAIN_ITERS=ITERATIONS bash
# scripts/train.sh EXTRA` with --metrics-jsonl (the measurement only) and writes
# R/plan_<LENGTH>[_<EXTRA>].log and .metrics.jsonl; then one line per run: the plan's flags, its
# predicted and the measured seconds per iteration (the last one logged) and tokens per second,
# the predicted and the measured peak allocated, or the exit status and the refusal.
set -uo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
RESULTS_DIR="${RESULTS_DIR:?set RESULTS_DIR}"
mkdir -p "$RESULTS_DIR"
RUNS="${RUNS:-4096:30 131072:2 524288:1 1048576:1 2097152:1:--num-layers,2}"

names=()
for entry in $RUNS; do
    IFS=: read -r length iterations extra <<< "$entry"
    IFS=, read -r -a items <<< "${extra:-}"
    extra_flags=()
    for item in ${items[@]+"${items[@]}"}; do
        if [ "${item:0:1}" = @ ]; then
            read -r -d '' -a words < "$REPO_ROOT/tools/benchmarks/models/${item:1}"
            extra_flags+=("${words[@]}")
        else
            extra_flags+=("$item")
        fi
    done
    tag="${extra//.flags/}"
    name="plan_${length}${extra:+_${tag//[^a-z0-9]/}}"
    names+=("$name")
    start=$(date +%s)
    SEQ_LENGTH="$length" TRAIN_ITERS="$iterations" LOG_INTERVAL=1 TENSORBOARD_DIR= \
        bash "$REPO_ROOT/scripts/train.sh" ${extra_flags[@]+"${extra_flags[@]}"} \
        --metrics-jsonl "$RESULTS_DIR/$name.metrics.jsonl" > "$RESULTS_DIR/$name.log" 2>&1
    echo "$name: exit $? after $(( $(date +%s) - start )) s" >> "$RESULTS_DIR/exits.txt"
done

python3 - "$RESULTS_DIR" "${names[@]}" <<'EOF'
import json, re, sys
from pathlib import Path

results = Path(sys.argv[1])
exits = dict(line.split(": ", 1) for line in (results / "exits.txt").read_text().splitlines())
for name in sys.argv[2:]:
    log = (results / f"{name}.log").read_text(errors="replace")
    plan = re.search(r"\[bounded\] plan: added (.*?) \(the fastest predicted of (\d+) plans, "
                     r"([\d.e+]+) s per step, that fits: peak allocated ([\d.]+) GiB", log)
    path = results / f"{name}.metrics.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    if not records:
        refusal = re.search(r"\[bounded\] error: (.*)", log)
        print(f"{name}: {exits.get(name)}; no iteration finished"
              + (f"; refused: {refusal.group(1)}" if refusal else ""))
        continue
    # the progress records time each iteration from the end of the one before (from the second
    # on); upstream's "elapsed time per iteration" at iteration 2 with --log-interval 1 is the
    # mean of the first two, whose first pays the kernels' warm-up: it serves one-iteration runs
    timed = [r["ms_per_iteration"] / 1e3 for r in records if "ms_per_iteration" in r]
    seconds = timed or [float(s) / 1e3 for s in
                        re.findall(r"elapsed time per iteration \(ms\): ([\d.]+)", log)]
    batch = re.findall(r"global batch size:\s+(\d+)", log)
    length = int(re.search(r"plan_(\d+)", name).group(1))
    rate = int(batch[-1]) * length / seconds[-1] if batch else float("nan")
    peak = max(r["peak_allocated_gib"] for r in records)
    line = (f"{name}: {exits.get(name)}; {seconds[-1]:.3f} s/iteration (last of {len(records)}), "
            f"{rate:,.0f} tokens/s")
    if plan:
        predicted_s, predicted_peak = float(plan.group(3)), float(plan.group(4))
        line += (f", predicted {predicted_s:.3f} s ({seconds[-1] / predicted_s:.3f}); peak "
                 f"{peak:.2f} GiB, predicted {predicted_peak:.2f} GiB "
                 f"({predicted_peak / peak:.3f}); plan of {plan.group(2)}: {plan.group(1)}")
    else:
        line += f"; peak {peak:.2f} GiB; no plan line"
    print(line)
EOF
