#!/bin/bash
# A/B of Flare servers on a shared machine: each serves the q4 core from its own tree (and environment), and the
# same `flare-bench serve` workload runs against them in alternating rounds, the order reversed every round, so that
# other work on the machine falls on both alike (docs/cpu.md, "Reproducing").
# Prints one line a round and server: output tok/s, mean TTFT and TPOT (ms), the engine's CPU seconds, load average.
# Usage, from the repository root after `make core`:
#   bash bench/lab/cpu/rounds.sh ROUNDS CONCURRENCY PROMPTS LABEL:TREE:PORT[:VAR=VALUE,...] ...
# e.g. bash bench/lab/cpu/rounds.sh 4 1 4 before:/tmp/before:8911 after:$PWD:8912
set -euo pipefail
rounds=$1 concurrency=$2 prompts=$3
shift 3
bin=$(realpath "${FLARE_BIN:-.venv/bin}")
core=$(realpath cores/smollm2-135m)
pids=() labels=() ports=()
trap 'for p in "${pids[@]}"; do kill -TERM -- "-$p" 2>/dev/null || true; done' EXIT
for spec in "$@"; do
    IFS=: read -r label tree port vars <<< "$spec"
    (cd "$tree" && export PYTHONPATH="$tree" && for v in ${vars//,/ }; do export "${v?}"; done &&
        exec setsid "$bin/python" -m common.cli run "$core" --port "$port") > "/tmp/flare-rounds-$label.log" 2>&1 &
    pids+=($!) labels+=("$label") ports+=("$port")
done
for port in "${ports[@]}"; do until curl -sf "localhost:$port/health" > /dev/null; do sleep 1; done; done
serve=("$bin/flare-bench" serve --endpoint completions --dataset random --input-len 128 --output-len 64 --ignore-eos
       --tokenizer "$core")
engine_cpu() {  # user + system ticks of the engine under the server on port $1
    local supervisor
    supervisor=$(pgrep -f "common.cli run.*--port $1" | head -1)
    awk '{print $14 + $15}' "/proc/$(pgrep -f engine.main -P "$supervisor" | head -1)/stat"
}
for port in "${ports[@]}"; do  # warm-up
    "${serve[@]}" --base-url "http://127.0.0.1:$port" --num-prompts 2 --max-concurrency 1 --seed 99 > /dev/null
done
for round in $(seq 1 "$rounds"); do
    order=("${!ports[@]}")
    if (( round % 2 == 0 )); then mapfile -t order < <(printf '%s\n' "${order[@]}" | tac); fi
    for i in "${order[@]}"; do
        before=$(engine_cpu "${ports[$i]}") load=$(cut -d' ' -f1 /proc/loadavg)
        figures=$("${serve[@]}" --base-url "http://127.0.0.1:${ports[$i]}" --num-prompts "$prompts" \
            --max-concurrency "$concurrency" --seed $((100 + round)) |
            awk -F: '/Output token thr|Mean TTFT|Mean TPOT/ {gsub(/ /, "", $2); printf "%s ", $2}')
        ticks=$(( $(engine_cpu "${ports[$i]}") - before ))
        echo "round $round ${labels[$i]}: tok/s, TTFT ms, TPOT ms: $figures engine CPU s: $((ticks / 100)).$((ticks % 100 / 10)) load: $load"
    done
done
