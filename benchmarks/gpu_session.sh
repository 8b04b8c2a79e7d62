#!/usr/bin/env bash
# A lent GPU's minutes in one call, the open accelerator parts in order of value
# (benchmarks/README.md, "accelerator.py"):
#
#   bash benchmarks/gpu_session.sh [SECONDS]      # default 560: a 600 s call, less a margin
#
# 1. Mixtures of experts (issue 45): the dense Llama-3.2-1B step at 2048 (flaxlm alone; its
#    torch comparison is in RESULTS.md) with a profile of where its time goes
#    (accelerator.py --profile, profile_summary.py), then a Qwen3-30B-A3B-shaped model cut to
#    MOE_LAYERS layers (default 8; 4 when the planner says 8 do not fit) on the same card:
#    MFU of active-parameter FLOPs against the dense 1B's;
# 2. the serving engine (issue 47): decode tokens/s of the Llama-3.2-1B shape at batch 1, 16
#    and 64 with a 1k-token context, the batch path and the paged engine, against the HBM
#    roofline (decode_roofline.py), with the time left.
#
# Everything lands under $OUT (the device tool's; ./gpu_out elsewhere), at most 8 files, as
# the device tool brings back: session.log (versions and every run's output), dense.json,
# moe.json, decode.json, profile/ (the trace; only its summary is read). Wheels under .whl/
# (gin-config: the lent image lacks it) are installed first. ACC_ARGS, if set, is added to
# every accelerator.py command and DECODE_ARGS to decode_roofline.py's; DENSE and MOE replace
# the models (the tiny CPU check: DENSE=llama_tiny MOE=qwen3_moe_tiny MOE_LAYERS=2
# ACC_ARGS="--lengths 32 --tokens 64 --dtype float32" DECODE_ARGS="--model llama_tiny
# --batches 1 4 --context 32 --new 8 --dtype float32 --repeats 1").
set -uo pipefail
budget=${1:-560}
out=${OUT:-gpu_out}
mkdir -p "$out"
log="$out/session.log"
start=$SECONDS
left() { echo $((budget - (SECONDS - start))); }

if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=.:${PYTHONPATH:-}
export PYTHONUNBUFFERED=1
read -r -a extra <<<"${ACC_ARGS:-}"
read -r -a decode_extra <<<"${DECODE_ARGS:-}"
common=(--no-torch --no-decode --repeats 2 --steps 3 --warmup 1)

{
  date -u
  git log -1 --format='commit %h %s' 2>/dev/null
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null
  python3 -c 'import flaxlm, flax, jax, optax
print("jax", jax.__version__, "flax", flax.__version__, "optax", optax.__version__, jax.devices())'
} 2>&1 | tee "$log"

l=$(($(left) - 380))
l=$((l < 120 ? l : 120))
echo "== dense ${DENSE:-llama3_2_1b} at 2048 with a profile, ${l} s" | tee -a "$log"
timeout $((l + 20)) python3 benchmarks/accelerator.py --model "${DENSE:-llama3_2_1b}" \
  --lengths 2048 "${common[@]}" "${extra[@]}" --profile "$out/profile" --time-limit "$l" \
  --json "$out/dense.json" 2>&1 | tee -a "$log"
rm -rf "$out/profile"  # the summary is in the log and dense.json; the trace is too large

for layers in "${MOE_LAYERS:-8}" 4; do
  l=$(($(left) - 200))
  l=$((l < 200 ? l : 200))
  if [ "$l" -lt 60 ]; then
    echo "== ${l} s left: not run: the MoE at $layers layers" | tee -a "$log"
    break
  fi
  echo "== ${MOE:-qwen3_moe_30b_a3b} cut to $layers layers at 2048, ${l} s" | tee -a "$log"
  timeout $((l + 20)) python3 benchmarks/accelerator.py --model "${MOE:-qwen3_moe_30b_a3b}" \
    --layers "$layers" --lengths 2048 "${common[@]}" "${extra[@]}" --time-limit "$l" \
    --json "$out/moe.json" 2>&1 | tee -a "$log"
  grep -q '"step_seconds"' "$out/moe.json" 2>/dev/null && break
done

l=$(($(left) - 10))
if [ "$l" -lt 60 ]; then
  echo "== ${l} s left: not run: decode against the roofline" | tee -a "$log"
else
  echo "== decode against the HBM roofline, ${l} s" | tee -a "$log"
  timeout "$l" python3 benchmarks/decode_roofline.py --repeats 2 "${decode_extra[@]}" \
    --json "$out/decode.json" 2>&1 | tee -a "$log"
fi
echo "== done in $((SECONDS - start)) s" | tee -a "$log"
