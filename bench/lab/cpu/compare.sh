#!/bin/bash
# Flare on the quantized core, Flare on the fp32 core and (with LLAMA_SERVER=path/to/llama-server) llama-server on
# the same GGUF, the same prompts, interleaved by `flare-bench compare`: 1 stream, then 16 (docs/cpu.md).
# Usage, from the repository root after `make core`: bash bench/lab/cpu/compare.sh OUT_DIR [PROMPTS_1 PROMPTS_16]
# THREADS=N gives every server N threads (OMP_NUM_THREADS for Flare, -t/-tb for llama-server); default: the cores.
set -euo pipefail
out=${1:?usage: bench/lab/cpu/compare.sh OUT_DIR [PROMPTS_1 PROMPTS_16]}
one=${2:-16}
many=${3:-64}
mkdir -p "$out"
bin=${FLARE_BIN:-.venv/bin}
gguf=${GGUF:-.cache/SmolLM2-135M-Instruct.Q4_1.gguf}
threads=${THREADS:-$(nproc)}
export OMP_NUM_THREADS=$threads
pids=()
trap 'for p in "${pids[@]}"; do kill -TERM -- "-$p" 2>/dev/null || true; done' EXIT
setsid $bin/flare run cores/smollm2-135m --port 8741 > "$out/flare-q4.log" 2>&1 & pids+=($!)
setsid $bin/flare run cores/smollm2-135m-fp32 --port 8742 > "$out/flare-fp32.log" 2>&1 & pids+=($!)
urls=(--base-url http://127.0.0.1:8741 --base-url http://127.0.0.1:8742 --label flare-q4 --label flare-fp32)
ports=(8741 8742)
if [[ -n "${LLAMA_SERVER:-}" ]]; then
    setsid "$LLAMA_SERVER" -m $gguf -t "$threads" -tb "$threads" -c 8192 -np 16 --port 8736 > "$out/llama-server.log" 2>&1 & pids+=($!)
    urls+=(--base-url http://127.0.0.1:8736 --label llama-server)
    ports+=(8736)
fi
for port in "${ports[@]}"; do until curl -sf "localhost:$port/health" > /dev/null; do sleep 1; done; done
common=("${urls[@]}" --endpoint completions --dataset random --input-len 128 --output-len 64 --ignore-eos
        --tokenizer cores/smollm2-135m)
uptime | tee "$out/load.txt"
$bin/flare-bench compare "${common[@]}" --num-prompts "$one" --max-concurrency 1 --seed 3 --json "$out/one.json" \
    | tee "$out/one.md"
uptime | tee -a "$out/load.txt"
$bin/flare-bench compare "${common[@]}" --num-prompts "$many" --max-concurrency 16 --seed 7 --json "$out/many.json" \
    | tee "$out/many.md"
uptime | tee -a "$out/load.txt"
