#!/usr/bin/env bash
# A lent GPU's minutes in one call (benchmarks/README.md, "accelerator.py"):
#
#   bash benchmarks/gpu_session.sh [SECONDS]      # default 560: a 600 s call, less a margin
#
# 1. accelerator.py's default run: the Llama-3.2-1B shape at 2048, 4096 and 8192 against HF
#    torch (torch.compile), decoding against HF generate, the planner's prediction, and each
#    compiled step's HLO (hlo/), with at most MAIN seconds (default 340; about 335 on an H200
#    on 2026-11-26) as its time limit;
# 2. then the largest shape the issue asks for, Llama-3.2-3B with full remat and the loss 512
#    positions at a time at 2048, against torch, with fewer steps (the time left less 20 s).
#    The chunks are the margin on an H100 (73 GiB lent at MEM_FRACTION 0.92): CPU's compiler
#    puts the 3B step at 100.9 GiB with the whole float32 logits [16, 2048, 128256] and 84.7
#    with the chunks (2026-11-26); the 1B's GPU step took 0.65x its CPU figure (68.87 GiB on
#    the H200 against 106.6), which puts the 3B at about 66 and 55 GiB. torch goes straight
#    to gradient checkpointing (its float32 weights and AdamW state alone are 51 GB: without
#    it, it would compile only to run out of memory);
# 3. then, while time is left (about 40 s each), flaxlm alone at 2048 with one of the 3B
#    row's knobs on the 1B: --loss-chunk-size 512, then --remat full: what each costs the
#    1B's measured step. (The H200's knobs of 2026-11-26, --remat none and --no-scan, are in
#    RESULTS.md; --remat none needs 128 GiB, more than an H100 has.)
#
# Everything lands under $OUT (the device tool's; ./gpu_out elsewhere), at most 8 files, as
# the device tool brings back: session.log (versions and every run's output), acc_1b.json,
# acc_3b.json, hlo/*.hlo.txt.gz, knob_*.json. Wheels under .whl/ (gin-config: the lent image
# lacks it) are installed first. ACC_ARGS, if set, is added to every accelerator.py command,
# and LARGEST replaces the second run's model (the tiny CPU check: ACC_ARGS="--model
# llama_tiny --lengths 32 --tokens 64 --dtype float32 --no-torch-compile --decode-new 4"
# LARGEST=llama_tiny).
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

{
  date -u
  git log -1 --format='commit %h %s' 2>/dev/null
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null
  python3 -c 'import flaxlm, flax, jax, optax, torch, transformers
print("jax", jax.__version__, "flax", flax.__version__, "optax", optax.__version__,
      "torch", torch.__version__, "transformers", transformers.__version__, jax.devices())'
} 2>&1 | tee "$log"

limit=$(($(left) - 75))
limit=$((limit < ${MAIN:-340} ? limit : ${MAIN:-340}))
echo "== accelerator.py, time limit ${limit} s" | tee -a "$log"
timeout $((limit + 30)) python3 benchmarks/accelerator.py "${extra[@]}" --time-limit "$limit" \
  --hlo "$out/hlo" --json "$out/acc_1b.json" 2>&1 | tee -a "$log"

l=$(($(left) - 20))
if [ "$l" -lt 90 ]; then
  echo "== ${l} s left: not run: the largest shape" | tee -a "$log"
else
  echo "== the largest shape, time limit ${l} s" | tee -a "$log"
  timeout $((l + 15)) python3 benchmarks/accelerator.py --lengths 2048 --remat full \
    --loss-chunk-size 512 --torch-checkpointing --no-decode --repeats 2 --steps 3 --warmup 1 \
    "${extra[@]}" --model "${LARGEST:-llama3_2_3b}" --time-limit "$l" --json "$out/acc_3b.json" \
    2>&1 | tee -a "$log"
fi

for knob in "--loss-chunk-size 512" "--remat full"; do
  l=$(left)
  if [ "$l" -lt 60 ]; then
    echo "== ${l} s left: not run: $knob" | tee -a "$log"
    continue
  fi
  name="knob_$(echo "$knob" | tr -dc 'a-z')"
  echo "== $knob, flaxlm alone, ${l} s left" | tee -a "$log"
  read -r -a words <<<"$knob"
  timeout "$l" python3 benchmarks/accelerator.py --lengths 2048 "${extra[@]}" --no-torch \
    --no-decode --repeats 2 --warmup 1 "${words[@]}" --time-limit $((l - 10)) \
    --json "$out/$name.json" 2>&1 | tee -a "$log"
done
echo "== done in $((SECONDS - start)) s" | tee -a "$log"
