#!/usr/bin/env bash
# One device call on the lent H200 machine(s), run from the repo root: named steps, each with its own time
# limit, logs and JSON under $OUT, a short tail of each log on stdout. Carry [".whl", ".pydeps"] (the wheels
# the device image lacks: megatron-core, hydra-core, fla-core, einops; omegaconf/antlr4 sources).
#
#   bash tools/h200_call.sh gputests gdn rl            # steps in the order given
#   STEP_LIMIT_SCALE=0.5 bash tools/h200_call.sh ...   # scale every step's limit (a shorter call)
#
# Steps (seconds are each step's limit; a step cut by its limit still leaves its log and partial JSON):
#   gputests 300   pytest tests/gpu but the GDN kernel file (every other single-GPU bitwise test; GPU_TESTS="files..."
#                  names the files instead)
#   gdntests 540   pytest -v tests/gpu/test_gdn_triton.py alone (68 compile-bound tests, about 400 s on a fresh
#                  machine, past gputests' limit; Session 18 saw 23 of them take 310 s: run it alone in a call;
#                  GDN_TESTS_K="expr": pytest -k expr narrows it; -v leaves each test's result in the log if cut)
#   gdn      200   bench_gdn --quick: GDN layer vs FLA (training fwd, fwd+bwd, prefill, decode, mismatch), the op's
#                  default form (scan); the correctness profile runs chunk:bf16 on cuda (gdn_form auto): gdndot with
#                  GDN_VARIANTS=chunk:bf16 GDN_BENCH_ARGS=--fla-bwd-unchecked times that
#   gdnprof   90   bench_gdn --profile train:8x4096: per-kernel table of our training forward
#   flaprof   90   bench_gdn --profile flatrain:8x4096: per-kernel table of FLA's chunk forward (our budget)
#   gdndot   300   bench_gdn --dot-precision $GDN_VARIANTS (default ieee tf32x3 tf32) $GDN_BENCH_ARGS: variants of
#                  the rule, dot precision and output form (chunk:bf16 ...): train fwd (+bwd), prefill 1024, decode
#                  64, accuracy, bits
#   gdntune  200   bench_gdn --profile train:8x4096 per tuning variant in GDN_TUNES (";"-separated --tune sets;
#                  default: the registered layout, scan 64x2, the all-ieee state pass): per-kernel ms;
#                  GDN_TUNE_CASE=trainbwd: forward + backward (e.g. GDN_TUNES="@chunk:bf16;@chunk:bf16 BWD_KS=16");
#                  GDN_TUNE_CASE=decode:64: the decode step; GDN_TUNE_TAG: a prefix for this sweep's JSON names
#   gdncopies 360  bench_gdn --profile per case in $GDN_COPY_CASE (default decode:64@chunk:bf16) per code copy in GDN_COPIES
#                  (folders holding megatron_iso/ and tools/, e.g. from tools/make_code_copy.sh; carry them):
#                  several versions of the kernels timed in one call (tools/gdn_code_copies.sh)
#   gdnbwd   300   bench_gdn --quick with FLA's refused gated backward timed anyway (--fla-bwd-unchecked: a speed
#                  anchor only), then --profile trainbwd:8x4096: per-kernel table of our fwd+bwd (both the scan form)
#   probe     90   probe_dot_rows: do a tl.dot row's bits depend on other rows, tile size, warps (chunk-form CPR)
#   rl       150   bench_rl_step, Qwen3-0.6B shapes, iso and native in one run
#   rlhybrid 300   bench_rl_step, qwen3p5_small_hybrid_moe (GDN + MoE), iso and native in one run; trainer
#                  micro-batches of 16 sequences (64 samples -> 4: native ran out of memory in one batch);
#                  RLHYBRID_OVERRIDES: Hydra overrides appended (e.g. "profile.gdn_form=scan" with
#                  RLHYBRID_PROFILES=correctness: the default, gdn_form auto, is the chunk form on cuda)
#   decode   200   bench_decode, Qwen3-0.6B, batch 1 8 64 256, 512-token prompts, 512 new tokens (cut per run)
#   decodeeager 150 bench_decode iso + native, batch 8 and 64, 128 new tokens, --no-cuda-graphs: what graphs save
#   kvpaged  120   bench_decode iso, batch 8 and 64, 128 new tokens: paged KV reads (the CUDA default)
#   kvstaged 120   the same with --staged-kv (staging + write-back): what the paged reads save or cost
#   moe      100   bench_ops --moe: grouped expert GEMM vs cuBLAS per-expert loop
#   nccl     300   needs 2 GPUs (nvidia-h200-x2): tests/multigpu over NCCL
#   rltp2    420   needs 2 GPUs: bench_rl_step at TP=2 under torchrun
# Commands and the numbers they produced: docs/PERFORMANCE.md.
set -u
: "${OUT:?OUT must name the folder results are written to}"
steps="gputests gdntests gdn gdnprof flaprof gdndot gdntune gdncopies gdnbwd probe rl rlhybrid decode decodeeager kvpaged kvstaged moe nccl rltp2"
for s in "$@"; do
  case " $steps " in *" $s "*) ;; *) echo "unknown step '$s'; allowed: $steps" >&2; exit 2 ;; esac
done
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH="/tmp/site:$PWD/.pydeps:$PWD" PYTHONUNBUFFERED=1
export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"
scale=${STEP_LIMIT_SCALE:-1}
gdn_test_file=tests/gpu/test_gdn_triton.py  # run by gdntests, left out of gputests

step() {  # step NAME LIMIT_S TAIL_LINES CMD...
  local name=$1 limit tail_n=$3 t0=$SECONDS
  limit=$(python3 -c "print(max(1, int($2 * $scale)))")
  shift 3
  echo "=== $name (limit ${limit}s)"
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "rc=$? in $((SECONDS - t0)) s"
  grep -v -e "Warning" -e "warnings.warn" "$OUT/$name.log" | tail -n "$tail_n"
}

for s in "$@"; do
  case $s in
    gputests)  # GPU_TESTS may name several files: word splitting on purpose
      # shellcheck disable=SC2086
      step gputests 300 30 python3 -m pytest -q -p no:warnings -rfE ${GPU_TESTS:-tests/gpu --ignore=$gdn_test_file} ;;
    gdntests)
      step gdntests 540 40 python3 -m pytest -v -p no:warnings -rfE "$gdn_test_file" ${GDN_TESTS_K:+-k "$GDN_TESTS_K"} ;;
    gdn) step gdn 200 30 python3 tools/bench_gdn.py --quick --out "$OUT/bench_gdn.json" ;;
    gdnprof) step gdnprof 90 20 python3 tools/bench_gdn.py --profile train:8x4096 --out "$OUT/gdn_prof_train.json" ;;
    flaprof) step flaprof 90 24 python3 tools/bench_gdn.py --profile flatrain:8x4096 --out "$OUT/fla_prof_train.json" ;;
    gdndot)  # GDN_VARIANTS: the variants (default the state pass's precisions), e.g. "chunk:bf16 chunk:tf32";
      # GDN_BENCH_ARGS: more bench_gdn arguments (e.g. "--fla-bwd-unchecked --tune DECODE_MAXNREG=168")
      # shellcheck disable=SC2086
      step "gdndot${GDN_TUNE_TAG:-}" 300 14 python3 tools/bench_gdn.py --quick --prefill 1024 --decode 64 \
        --dot-precision ${GDN_VARIANTS:-ieee tf32x3 tf32} ${GDN_BENCH_ARGS:-} \
        --out "$OUT/bench_gdn_dot${GDN_TUNE_TAG:-}.json" ;;
    gdntune) step "gdntune${GDN_TUNE_TAG:-}" 200 40 bash tools/gdn_tune_profiles.sh "${GDN_TUNES:-}" ;;
    gdncopies) step gdncopies 360 80 bash tools/gdn_code_copies.sh ;;
    gdnbwd)
      step gdnbwd 240 14 python3 tools/bench_gdn.py --quick --prefill 512 --decode 64 --fla-bwd-unchecked \
        --out "$OUT/bench_gdn_bwd.json"
      step gdnbwdprof 60 16 python3 tools/bench_gdn.py --profile trainbwd:8x4096 --out "$OUT/gdn_prof_trainbwd.json" ;;
    probe) step probe 90 100 python3 tools/probe_dot_rows.py --out "$OUT/probe_dot_rows.json" ;;
    rl) step rl 150 8 python3 tools/bench_rl_step.py --model qwen3_0p6b --steps 3 --prompts 8 --group 8 \
      --new-tokens 32 --prompt-len 32 --kv-cache-mb 8192 --out "$OUT/rl_step.json" ;;
    rlhybrid)  # RLHYBRID_PROFILES and RLHYBRID_OVERRIDES hold several words: word splitting on purpose
      # shellcheck disable=SC2086
      step rlhybrid 300 8 python3 tools/bench_rl_step.py --model qwen3p5_small_hybrid_moe --steps 3 \
      --prompts 8 --group 8 --prompt-len 128 --new-tokens 96 --kv-cache-mb 2048 --train-micro-batch-seqs 16 \
      --profiles ${RLHYBRID_PROFILES:-correctness performance} --out "$OUT/rl_step_hybrid.json" \
      ${RLHYBRID_OVERRIDES:-} ;;
    decode) step decode 200 20 python3 tools/bench_decode.py --model qwen3_0p6b --batch 1 8 64 256 --prompt-len 512 \
      --new-tokens 512 --max-seconds 8 --budget-seconds 190 --out "$OUT/bench_decode.json" ;;
    decodeeager) step decodeeager 150 12 python3 tools/bench_decode.py --model qwen3_0p6b --engines iso native \
      --batch 8 64 --prompt-len 512 --new-tokens 128 --max-seconds 15 --budget-seconds 140 --no-cuda-graphs \
      --out "$OUT/bench_decode_eager.json" ;;
    kvpaged) step kvpaged 120 8 python3 tools/bench_decode.py --model qwen3_0p6b --engines iso --batch 8 64 \
      --prompt-len 512 --new-tokens 128 --max-seconds 20 --budget-seconds 110 --out "$OUT/bench_decode_paged.json" ;;
    kvstaged) step kvstaged 120 8 python3 tools/bench_decode.py --model qwen3_0p6b --engines iso --batch 8 64 \
      --prompt-len 512 --new-tokens 128 --max-seconds 20 --budget-seconds 110 --staged-kv \
      --out "$OUT/bench_decode_staged.json" ;;
    moe) step moe 100 20 python3 tools/bench_ops.py --moe --skip-gemm --skip-mem --out "$OUT/bench_moe.json" ;;
    nccl) step nccl 300 15 python3 -m pytest -q -p no:warnings -rfE tests/multigpu/test_nccl_invariance.py ;;
    rltp2) step rltp2 420 8 python3 -m torch.distributed.run --standalone --nproc-per-node 2 tools/bench_rl_step.py \
      --model qwen3_0p6b --steps 3 --prompts 8 --group 8 --new-tokens 32 --prompt-len 32 --kv-cache-mb 8192 \
      --out "$OUT/rl_step_tp2.json" parallel.tp=2 ;;
  esac
done
