#!/usr/bin/env bash
# A lent GPU's minutes in one call, the open accelerator parts in order of value
# (benchmarks/README.md, "accelerator.py"):
#
#   bash benchmarks/gpu_session.sh [SECONDS]      # default 560: a 600 s call, less a margin
#
# 1. The serving engine (issue 47, the open target: 60% of the HBM roofline at batch 64):
#    decode tokens/s of the Llama-3.2-1B shape at batch 1, 16 and 64 with a 1k-token
#    context, the batch path and the paged engine, against the roofline, with profiles of
#    both paths at batch 64 (decode_roofline.py --profile) and the optimized HLO (hlo.tgz:
#    the largest modules XLA dumped), to name what besides the matmuls and the KV reads
#    takes a step's time. Since the fourth session's figures: the contiguous cache is held
#    head-major (sixteenth), and decoding reads each weight once, the prefill's head one
#    position, the engine's sampler sorts nothing for greedy rows (seventeenth; all measured
#    on CPU only); the batch path's loop steps the model outside a cond (eighteenth: XLA:GPU
#    had copied the whole KV cache at each step, read off the H100's compiled program,
#    decode_hlo.py) and the engine can read its pages in place with JAX's Pallas kernel
#    (`paged_attention='pallas'`, the third path, timed here for the first time: if it beats
#    'gather', make it the GPU's default in serve.gin, infer.gin and Scheduler);
# 2. mixtures of experts (issue 45, met on an H200 in the sixteenth session): the dropless
#    experts' grouped matmul through JAX's Mosaic GPU kernels, checked against XLA's, the
#    transposed kernel's tiles tuned (grouped_matmul.py --tune); a Qwen3-30B-A3B-shaped
#    model cut to MOE_LAYERS layers (default 8; 4 when 8 do not fit), dropless, with its
#    profile and compiled HLO; the dense Llama-3.2-1B step at 2048 on the same card
#    (PROFILE=1: with a profile); the same MoE with `capacity` experts, with the time left.
# 3. Linear attention (issue 66), with what time is left after 1 and 2: one Gated DeltaNet
#    layer's forward + backward against the gated full attention of Qwen3-Next-80B-A3B's
#    width, and Kimi-Linear-48B-A3B's Kimi Delta Attention, at 4k and 32k tokens, bf16,
#    tokens/s and each row's profile (linear_attention.py; into session.log alone).
# 4. The planner's memory against the card's, with what time is left: one program compiled
#    here with cuDNN, its twin compiled from the CPU with the stand-in (into session.log).
#
# Everything lands under $OUT (the device tool's; ./gpu_out elsewhere), at most 8 files, as
# the device tool brings back: session.log (versions and every run's output), decode.json,
# hlo.tgz, grouped.json, moe.json, hlo_moe/ (the MoE step's HLO), dense.json,
# moe_capacity.json. Wheels under .whl/
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

# 1. Decode against the roofline, with a profile and the optimized HLO of the batch path.
l=$(($(left) - 330))
l=$((l < 200 ? l : 200))
echo "== decode against the HBM roofline, ${l} s" | tee -a "$log"
rm -rf /tmp/hlo_dump
XLA_FLAGS="${XLA_FLAGS:-} --xla_dump_to=/tmp/hlo_dump --xla_dump_hlo_as_text" \
  timeout "$l" python3 benchmarks/decode_roofline.py --repeats 2 --profile /tmp/decode_profile \
  --paths generate paged pallas sampled penalized "${decode_extra[@]}" --json "$out/decode.json" 2>&1 |
  tee -a "$log"
# The largest optimized modules (the decode loops), not every small one XLA dumped.
if compgen -G "/tmp/hlo_dump/*after_optimizations.txt" >/dev/null; then
  # shellcheck disable=SC2012
  ls -S /tmp/hlo_dump/*after_optimizations.txt | head -6 |
    xargs tar -czf "$out/hlo.tgz" --transform 's|.*/||' 2>/dev/null
fi
rm -rf /tmp/hlo_dump /tmp/decode_profile

# 2. Mixtures of experts.
# The dropless experts' grouped matmul: JAX's Mosaic GPU kernels against XLA's ragged_dot,
# then their TFLOP/s at the Qwen3-30B-A3B layer's shapes (grouped_matmul.py).
echo "== grouped matmul: the Mosaic GPU kernels checked and timed" | tee -a "$log"
timeout 150 python3 benchmarks/grouped_matmul.py --tune "${TUNE:-60}" --json "$out/grouped.json" \
  2>&1 | tee -a "$log"
kernels=$(grep -q '"pass": true' "$out/grouped.json" 2>/dev/null && echo mosaic_gpu || echo none)

# The MoE step, dropless through the kernels (when they passed), then the dense 1B and the
# capacity MoE on the same card for the ratio.
moe() {  # moe IMPL GROUPED_MATMUL SECONDS JSON [accelerator.py arguments]
  for layers in "${MOE_LAYERS:-8}" 4; do
    echo "== ${MOE:-qwen3_moe_30b_a3b} cut to $layers layers, $1 ($2) at 2048, $3 s" | tee -a "$log"
    timeout $(($3 + 20)) python3 benchmarks/accelerator.py --model "${MOE:-qwen3_moe_30b_a3b}" \
      --layers "$layers" --moe-impl "$1" --grouped-matmul "$2" --lengths 2048 "${common[@]}" \
      "${extra[@]}" "${@:5}" --time-limit "$3" --json "$4" 2>&1 | tee -a "$log"
    grep -q '"step_seconds"' "$4" 2>/dev/null && break
  done
}
l=$(($(left) - 100))
l=$((l < 200 ? l : 200))
if [ "$kernels" != mosaic_gpu ]; then
  echo "== the kernels did not pass: no dropless MoE step" | tee -a "$log"
elif [ "$l" -lt 60 ]; then
  echo "== ${l} s left: not run: the dropless MoE" | tee -a "$log"
else
  # With the step's profile and its compiled HLO: what the elementwise and reduction
  # fusions (a third of the step in the sixteenth session) are.
  moe dropless mosaic_gpu "$l" "$out/moe.json" --grouped-matmul-tiles "$out/grouped.json" \
    --profile /tmp/moe_profile --hlo "$out/hlo_moe"
  rm -rf /tmp/moe_profile
fi

l=$(($(left) - 10))
l=$((l < 120 ? l : 120))
if [ "$l" -ge 60 ]; then
  echo "== dense ${DENSE:-llama3_2_1b} at 2048, ${l} s" | tee -a "$log"
  timeout $((l + 20)) python3 benchmarks/accelerator.py --model "${DENSE:-llama3_2_1b}" \
    --lengths 2048 "${common[@]}" "${extra[@]}" ${PROFILE:+--profile "$out/profile"} \
    --time-limit "$l" --json "$out/dense.json" 2>&1 | tee -a "$log"
  rm -rf "$out/profile"  # the summary is in the log and dense.json; the trace is too large
else
  echo "== ${l} s left: not run: the dense step" | tee -a "$log"
fi

l=$(($(left) - 10))
l=$((l < 200 ? l : 200))
if [ "$l" -ge 60 ]; then
  moe capacity xla "$l" "$out/moe_capacity.json"
else
  echo "== ${l} s left: not run: the capacity MoE" | tee -a "$log"
fi

# 3. Linear attention layers against full attention (issue 66). Its numbers go to session.log
# alone: $OUT already holds the 8 files the device tool brings back. LINEAR_ARGS, if set, is
# added to its command (the tiny CPU check: LINEAR_ARGS="--model qwen3_next_tiny
# --kimi-model kimi_linear_tiny --lengths 128 --dtype float32").
read -r -a linear_extra <<<"${LINEAR_ARGS:-}"
l=$(($(left) - 10))
if [ "$l" -ge 90 ]; then
  echo "== linear attention: Gated DeltaNet, Kimi Delta Attention, full, ${l} s" | tee -a "$log"
  timeout "$l" python3 benchmarks/linear_attention.py --model qwen3_next_80b_a3b \
    --kimi-model kimi_linear_48b_a3b --layers gdn full kda --lengths 4096 32768 \
    --profile /tmp/linear_profile "${linear_extra[@]}" 2>&1 | tee -a "$log"
  rm -rf /tmp/linear_profile
else
  echo "== ${l} s left: not run: the linear attention layers" | tee -a "$log"
fi

# 4. The planner against the card (issue 67), with what time is left: the Llama-3.2-1B step at
# 8,192 tokens planned for this GPU (cuDNN's attention compiled) and for the same chip compiled
# from the CPU as the planner does without a GPU ('chunked' attention standing in for cuDNN's):
# the GiB each program holds and the predicted ms, side by side, into session.log.
l=$(($(left) - 10))
if [ "$l" -ge 120 ]; then
  echo "== the planner: this GPU against the CPU's compile for it, ${l} s" | tee -a "$log"
  chip=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | grep -qi h200 && echo h200 || echo h100)
  plan=(python3 -m flaxlm.plan --gin_file=gin/runs/pretrain.gin
    --gin_file=gin/models/llama3_2_1b.gin --gin_file=gin/partitioning/fsdp.gin
    "--gin.MODEL_DIR='/tmp/plan_unused'" "--gin.MIXTURE_OR_TASK_NAME='stdlib_py'"
    --gin.TRAIN_STEPS=1 "--gin.TASK_FEATURE_LENGTHS={'targets': 8192}" --gin.BATCH_SIZE=1
    --max_candidates=1 "--gin.planner.plan.meshes=[(1, 1, 1)]")
  timeout $((l / 2)) "${plan[@]}" --topology=this 2>&1 | grep -v '^\[' | tee -a "$log"
  timeout $((l / 2)) env JAX_PLATFORMS=cpu "${plan[@]}" --topology="$chip:1" 2>&1 |
    grep -v '^\[' | tee -a "$log"
else
  echo "== ${l} s left: not run: the planner against the card" | tee -a "$log"
fi

echo "== done in $((SECONDS - start)) s" | tee -a "$log"
