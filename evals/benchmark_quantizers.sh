#!/usr/bin/env bash
# The quantizer benchmark in the README: gemma3-270m at the quantize defaults (128 x 512 Austen calibration
# tokens) unless a row says otherwise, perplexity and KL against the reference on held-out Persuasion. Usage: bash evals/benchmark_quantizers.sh [OUT]
set -euo pipefail
out=${1:-qinfer-bench}
q=$out/models
mkdir -p "$q"
quant() { name=$1; shift; [ -f "$q/$name/quant_config.json" ] || qinfer quantize gemma3-270m -o "$q/$name" "$@"; }
quant rtn-w4g128-sym --method rtn --bits 4 --sym
quant rtn-w4g128 --method rtn --bits 4
quant awq-w4g128 --method awq --bits 4
quant awq-w4g128-tuned --method awq --bits 4 --tune-steps 50
quant awq-w4g128-mse-e2e --method awq --bits 4 --mse-clip --e2e-steps 128
quant gptq-w4g128 --method gptq --bits 4
quant gptq-w4g128-tuned --method gptq --bits 4 --tune-steps 50
quant gptq-w4g128-e2e --method gptq --bits 4 --e2e-steps 128
quant gptq-w4g128-tuned-e2e --method gptq --bits 4 --tune-steps 50 --e2e-steps 128
quant gptq-w4g128-mse --method gptq --bits 4 --mse-clip
quant gptq-w4g128-mse-s256-e2e256 --method gptq --bits 4 --mse-clip --samples 256 --e2e-steps 256
quant gptq-w4g128-seq --method gptq --bits 4 --true-sequential
quant gptq-w4g128-seq-mse-e2e --method gptq --bits 4 --true-sequential --mse-clip --e2e-steps 128
quant rtn-w3g128 --method rtn --bits 3
quant gptq-w3g128 --method gptq --bits 3
quant fp8-rtn --bits 8 --format fp8 --method rtn
quant fp8 --bits 8 --format fp8
for m in "$q"/*/; do python -c "import json,sys; r=json.load(open(sys.argv[1])); print(sys.argv[2], f\"{r['seconds']:.0f} s, peak RSS {r['peak_rss_bytes']/2**20:.0f} MiB\")" "$m/quantize_report.json" "$(basename "$m")"; done
qinfer eval gemma3-270m "$q/rtn-w4g128-sym" "$q/rtn-w4g128" "$q/awq-w4g128" "$q/awq-w4g128-tuned" "$q/awq-w4g128-mse-e2e" "$q/gptq-w4g128" "$q/gptq-w4g128-tuned" \
  "$q/gptq-w4g128-e2e" "$q/gptq-w4g128-tuned-e2e" "$q/gptq-w4g128-mse" "$q/gptq-w4g128-mse-s256-e2e256" \
  "$q/gptq-w4g128-seq" "$q/gptq-w4g128-seq-mse-e2e" \
  "$q/rtn-w3g128" \
  "$q/gptq-w3g128" "$q/fp8-rtn" "$q/fp8" --tasks none --no-speed --out "$out"
