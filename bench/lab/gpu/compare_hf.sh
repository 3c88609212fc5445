#!/usr/bin/env bash
# Flare against Hugging Face transformers' continuous batching (bench/hf_server.py) on one random-weight
# architecture, one GPU each, the same prompts. Needs two GPUs; run it from the repository root with a python3 that
# holds Flare's dependencies, the ignition extra (transformers) and CuPy (docs/gpu.md, Reproducing).
#   bench/lab/gpu/compare_hf.sh OUT_DIR [LAYERS]
set -euo pipefail
out=${1:?output directory}; layers=${2:-8}
core=/tmp/flare-gpu-compare-core
[ -f "$core/manifest.json" ] || python3 -m ignition.main synth --preset llama-3.1-8b --layers "$layers" --dtype bfloat16 --force "$core"
CUDA_VISIBLE_DEVICES=0 python3 -m common.cli run "$core" --device cuda --port 8000 > "$out/flare.log" 2>&1 &
CUDA_VISIBLE_DEVICES=1 python3 -m bench.hf_server "$core" --device cuda --port 8100 > "$out/hf.log" 2>&1 &
trap 'kill $(jobs -p) 2>/dev/null' EXIT
for port in 8000 8100; do
  for _ in $(seq 300); do curl -sf "http://127.0.0.1:$port/health" > /dev/null && break; sleep 1; done
done
python3 -c "import sys; from bench.main import main; sys.exit(main())" compare --base-url http://127.0.0.1:8000 --base-url http://127.0.0.1:8100 \
  --label flare --label transformers-cb --endpoint completions --tokenizer "$core" --dataset random \
  --input-len 512 --output-len 128 --ignore-eos --num-prompts 256 --max-concurrency 64 --seed 0 \
  --json "$out/gpu.json" 2>&1 | grep -v '%|' | tee "$out/compare.txt"
