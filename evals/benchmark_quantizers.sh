#!/usr/bin/env bash
# The quantizer benchmark in the README: gemma3-270m at the quantize defaults (128 x 512 Austen calibration
# tokens) unless a row says otherwise, perplexity and KL against the reference on held-out Persuasion
# (2048 and 8192 tokens; with --long also 32768).
# Usage: bash evals/benchmark_quantizers.sh [OUT] [--all] [--long] [--seeds]
#   --all adds the slower tuning variants (block tuning, learned rounding, AWQ with end-to-end tuning, GPTQ without
#   sequential calibration; hours on 2 cores).
#   --long also scores every model on 32768 held-out tokens (slow: the reference and one model took 39 min on 2 AVX2
#   cores).
#   --seeds adds the rows the goals rest on (GPTQ at the defaults, GPTQ --fp-target --mse-clip, AWQ --fp-target) on
#   two more calibration draws (--seed 1 and 2; ~20 min on 2 AVX-512 cores), to show how far the draw moves them;
#   with --all also AWQ --fp-target + learned rounding on 512 samples at --seed 1 and 2.
# GPTQ's default includes the clip search (--mse-clip) since 2026-12-01; --no-mse-clip is GPTQ as its authors run it.
set -euo pipefail
out=qinfer-bench all=0 long=0 seeds=0
for a in "$@"; do
  case $a in --all) all=1 ;; --long) long=1 ;; --seeds) seeds=1 ;; *) out=$a ;; esac
done
q=$out/models
mkdir -p "$q"
models=()
quant() { name=$1; shift; models+=("$q/$name"); [ -f "$q/$name/quant_config.json" ] || qinfer quantize gemma3-270m -o "$q/$name" "$@"; }
quant rtn-w4g128-sym --method rtn --bits 4 --sym
quant rtn-w4g128 --method rtn --bits 4
quant awq-w4g128 --method awq --bits 4
quant awq-w4g128-fpt --method awq --bits 4 --fp-target
quant gptq-w4g128 --method gptq --bits 4
quant gptq-w4g128-nomse --method gptq --bits 4 --no-mse-clip
quant gptq-w4g128-e2e --method gptq --bits 4 --e2e-steps 128
quant gptq-w4g128-fpt --method gptq --bits 4 --fp-target --no-mse-clip
quant gptq-w4g128-fpt-mse --method gptq --bits 4 --fp-target --mse-clip
if [ $all = 1 ]; then
  quant awq-w4g128-e2e --method awq --bits 4 --e2e-steps 128
  quant awq-w4g128-tuned --method awq --bits 4 --tune-steps 50
  quant awq-w4g128-seq --method awq --bits 4 --true-sequential
  quant awq-w4g128-fpt-round --method awq --bits 4 --fp-target --tune-steps 200 --tune-rounding
  quant awq-w4g128-fpt-round-s512 --method awq --bits 4 --fp-target --samples 512 --tune-steps 200 --tune-rounding \
    --tune-holdout 16
  quant gptq-w4g128-tuned --method gptq --bits 4 --tune-steps 50
  quant gptq-w4g128-tuned-e2e --method gptq --bits 4 --tune-steps 50 --e2e-steps 128
  quant gptq-w4g128-mse-s256-e2e256 --method gptq --bits 4 --mse-clip --samples 256 --e2e-steps 256
  quant gptq-w4g128-noseq --method gptq --bits 4 --no-true-sequential
fi
if [ $seeds = 1 ]; then
  for seed in 1 2; do
    quant gptq-w4g128-seed$seed --method gptq --bits 4 --seed $seed
    quant gptq-w4g128-fpt-mse-seed$seed --method gptq --bits 4 --fp-target --mse-clip --seed $seed
    quant awq-w4g128-fpt-seed$seed --method awq --bits 4 --fp-target --seed $seed
    if [ $all = 1 ]; then  # learned rounding on 512 samples (70-80 min each on 2 AVX-512 cores)
      quant awq-w4g128-fpt-round-s512-seed$seed --method awq --bits 4 --fp-target --samples 512 --tune-steps 200 \
        --tune-rounding --tune-holdout 16 --seed $seed
    fi
  done
fi
quant rtn-w3g128 --method rtn --bits 3
quant gptq-w3g128 --method gptq --bits 3
quant fp8-rtn --bits 8 --format fp8 --method rtn
quant fp8 --bits 8 --format fp8
for m in "${models[@]}"; do python -c "import json,sys; r=json.load(open(sys.argv[1])); print(sys.argv[2], f\"{r['seconds']:.0f} s, peak RSS {r['peak_rss_bytes']/2**20:.0f} MiB\")" "$m/quantize_report.json" "$(basename "$m")"; done
# Scored on the first 2048 held-out tokens and on 8192 (four times the text, less noise); --long adds 32768.
qinfer eval gemma3-270m "${models[@]}" --tasks none --no-speed --out "$out"
qinfer eval gemma3-270m "${models[@]}" --tasks none --no-speed --max-tokens 8192 --out "$out/8192-tokens"
if [ $long = 1 ]; then
  qinfer eval gemma3-270m "${models[@]}" --tasks none --no-speed --max-tokens 32768 --out "$out/32768-tokens"
fi
