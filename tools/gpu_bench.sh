#!/usr/bin/env bash
# GPU tests and benchmarks on a CUDA machine, as named steps. Run from the repo root with the package's
# dependencies importable (the `gpu` extra, plus `hf` for the decode step's HF `generate` column):
#
#   bash tools/gpu_bench.sh -o runs/bench gputests gdn rl   # steps in the order given, results under runs/bench
#   OUT=runs/bench bash tools/gpu_bench.sh decode            # the same, output folder from $OUT
#   STEP_LIMIT_SCALE=0.5 bash tools/gpu_bench.sh ...         # scale every step's time limit
#   WHEELS=wheels/ bash tools/gpu_bench.sh ...               # first install wheels/*.whl (no index) into a
#                                                            # private folder put on PYTHONPATH
#
# Each step runs under its own time limit and writes STEP.log (and its JSON, if any) into the output folder; a
# step cut by its limit keeps its log and the JSON rows written so far. stdout gets "=== STEP", the exit status,
# the seconds taken and the tail of the log. The script exits 0 once every step has run; read each step's rc.
#
# Steps (seconds are each step's limit):
#   gputests 300    pytest -v tests/gpu except the GDN kernel file (GPU_TESTS="files..." names the files instead;
#                   on a fresh machine the whole set compiles for longer than the limit: name files)
#   gdntests 540    pytest -v tests/gpu/test_gdn_triton.py alone (compile-bound: about 400 s on a fresh
#                   machine; GDN_TESTS_K="expr" narrows it with pytest -k)
#   gdn      200    bench_gdn --quick: the GDN rule vs FLA (training fwd, fwd+bwd, prefill, decode, mismatch) in the
#                   op's default form (scan); the correctness profile's CUDA form is chunk:bf16, timed by gdndot with
#                   GDN_VARIANTS=chunk:bf16 GDN_BENCH_ARGS=--fla-bwd-unchecked
#   gdnprof   90    bench_gdn --profile train:8x4096: per-kernel table of our training forward
#   flaprof   90    bench_gdn --profile flatrain:8x4096: per-kernel table of FLA's chunk forward
#   gdndot   300    bench_gdn --dot-precision $GDN_VARIANTS (default "ieee tf32x3 tf32") $GDN_BENCH_ARGS: per
#                   variant (dot precision, or FORM:PRECISION such as chunk:bf16) training fwd (+bwd), prefill
#                   1024, decode 64, accuracy, train-vs-rollout bits; GDN_TUNE_TAG suffixes the log and JSON names
#   gdnbwd   300    bench_gdn --quick with FLA's refused gated backward timed anyway (--fla-bwd-unchecked: a speed
#                   reference only), then --profile trainbwd:8x4096: per-kernel table of our fwd+bwd (scan form)
#   rl       150    bench_rl_step, Qwen3-0.6B shapes, iso and native in one run
#   study    600    iso-bench study, Qwen3-0.6B shapes, 10 RL steps per profile, 8 x 8 samples of up to 256 tokens:
#                   study.md / study.json / study.png under study/ (the README's study table; STUDY_OVERRIDES
#                   appends overrides, e.g. "logger=wandb")
#   rlppo    400    bench_rl_step, correctness profile, Qwen3-0.6B shapes, 2 PPO mini-batches x 2 epochs: pi_old
#                   from the rollout (no forward), then the same with rl.recompute_old_logprobs=true (the stock
#                   stacks' recompute forward; timing/old_logp_s): what exactness saves per step
#   rlhybrid 300    bench_rl_step, qwen3p5_small_hybrid_moe (GDN + MoE), iso and native in one run, trainer
#                   micro-batches of 16 sequences; RLHYBRID_PROFILES picks the profiles, RLHYBRID_OVERRIDES appends
#                   Hydra overrides (e.g. "profile.gdn_form=scan")
#   decode   200    bench_decode, Qwen3-0.6B, batch 1 8 64 256, 512-token prompts, 512 new tokens
#   decoderoof 250  bench_decode iso + native, Qwen3-0.6B, batch 1 64 256, 512 + 256 tokens: the roofline table
#   decode8b 150    the same at Qwen3-8B widths with 8 layers, batch 64
#   rl8b     300    bench_rl_step iso + native, Qwen3-8B widths with 8 layers, 8 x 8 samples of 256 + 512 tokens,
#                   trainer micro-batches of 16 (the RL-step table's first row)
#   rl8bwhole 300   the same with the whole batch in one trainer pass (the table's second row; native runs out of
#                   memory there)
#   rl8bleaf1 200   rl8b's workload, iso only, as a deployment that never shards over TP runs it:
#                   profile.leaves=1 profile.tp_domain=[1] (one-leaf row-parallel GEMMs and vocab scoring)
#   decodeeager 150 bench_decode iso + native, batch 8 and 64, 128 new tokens, --no-cuda-graphs
#   kvpaged  120    bench_decode iso, batch 8 and 64, 128 new tokens: paged KV reads (the CUDA default)
#   kvstaged 120    the same with --staged-kv (staging + write-back)
#   moe      100    bench_ops --moe: grouped expert GEMM vs a cuBLAS per-expert loop
#   attnbwd  200    bench_ops --attention-backward --attention-backward-sweep: the training attention backward vs
#                   SDPA's at Qwen3-8B heads, and its kernels' tile candidates (bits, time)
#   gemmsweep 300   bench_ops --sweep --sweep-large-only: the 8-leaf GEMM's tile and loop variants (flat, TMA, Gluon)
#                   and the one-leaf GEMM's TMA and Gluon variants at the Qwen3-8B row-parallel shapes, time against
#                   cuBLAS and bits against the shipped tile
#   rl8b4k   420    bench_rl_step iso + native, Qwen3-8B widths with 8 layers, 32 x (512 + 3584) tokens, trainer
#                   micro-batches of 2 (RL-length row; both profiles fit one 80 GB card)
#   rl8b4kleaf1 300 rl8b4k's workload, iso only, with profile.leaves=1 profile.tp_domain=[1] (exact between a
#                   trainer and a rollout of the same layout, not across TP sizes): what the TP-invariant leaves cost
#                   at 4096 tokens
#   rl8b8k   540    the same at 16 x (1024 + 7168), micro-batches of 1
#   rlhybrid4k 540  bench_rl_step iso + native, qwen3p5_small_hybrid_moe, 32 x (512 + 3584), micro-batches of 4
#   rlhybrid8k 560  bench_rl_step iso + native, qwen3p5_small_hybrid_moe, 16 x (1024 + 7168), micro-batches of 1
#                   with full activation recompute (the hybrid row at 8192 tokens, sized for 80 GB)
#   rlhybrid4kmem 360 rlhybrid4k's workload, iso only, with full activation recompute of every layer and the GDN
#                   chunk states recomputed in the backward (the <= 40 GB peak target; the same bits)
#   rlmoe    300    bench_rl_step iso + native, Qwen3-30B-A3B widths with 2 layers, 64 x (128 + 256), micro-batches of 16
#   moebwd   120    bench_moe_backward: the grouped expert backward vs the per-expert loop and torch's grouped mm
#   opsites  150    op_sites: the hybrid's eager rollout ops per generated token by package source line (the
#                   decode glue's sites; Triton kernels not counted)
#   decode8bfull 300 bench_decode iso + native, Qwen3-8B (36 layers), batch 1 and 64, 4096-token prompts
#   decodemoe 250   bench_decode iso + native, Qwen3-30B-A3B widths with 4 layers, batch 1 8 64, 512 + 256 tokens:
#                   MoE decode from CUDA graphs in both profiles (native: the static dispatch, torch's grouped_mm)
#   decodemoeeager 250 the same with --no-cuda-graphs (the native row: the static dispatch without graphs)
#   nccl     300    needs 2 GPUs: tests/multigpu over NCCL (invariance, TP-2 decode graphs)
#   rltp2    420    needs 2 GPUs: bench_rl_step at TP=2 under torchrun
#   rlcp2    420    needs 2 GPUs: bench_rl_step at CP=2 under torchrun (correctness; the performance profile with
#                   profile.cp_domain=[1,2], docs/CONTEXT_PARALLEL.md): rollout CP 1 vs trainer CP 2 over NCCL
# The numbers these steps produced: docs/PERFORMANCE.md.
set -u
out=${OUT:-}
if [ "${1:-}" = "-o" ] || [ "${1:-}" = "--out" ]; then
  out=${2:-}
  shift 2 || shift $#
fi
if [ -z "$out" ]; then
  echo "no output folder: pass -o DIR or set OUT" >&2
  exit 2
fi
steps="gputests gdntests gdn gdnprof flaprof gdndot gdnbwd rl study rlppo rlhybrid rl8b rl8bwhole rl8bleaf1 rl8b4k rl8b4kleaf1 rl8b8k rlhybrid4k rlhybrid8k rlhybrid4kmem rlmoe moebwd opsites decode decoderoof decode8b decode8bfull decodemoe decodemoeeager decodeeager kvpaged kvstaged moe attnbwd gemmsweep nccl rltp2 rlcp2"
for s in "$@"; do
  case " $steps " in *" $s "*) ;; *) echo "unknown step '$s'; allowed: $steps" >&2; exit 2 ;; esac
done
mkdir -p "$out" || exit 2
OUT=$(cd "$out" && pwd)
export OUT
if [ -n "${WHEELS:-}" ]; then
  site=$(mktemp -d)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "$WHEELS"/*.whl || exit 2
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD" PYTHONUNBUFFERED=1
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
      # -v: a run cut by its limit still names every test that finished (a cold machine compiles for minutes)
      step gputests 300 30 python3 -m pytest -v -p no:warnings -rfE ${GPU_TESTS:-tests/gpu --ignore=$gdn_test_file} ;;
    gdntests)
      step gdntests 540 40 python3 -m pytest -v -p no:warnings -rfE "$gdn_test_file" ${GDN_TESTS_K:+-k "$GDN_TESTS_K"} ;;
    gdn) step gdn 200 30 python3 tools/bench_gdn.py --quick --out "$OUT/bench_gdn.json" ;;
    gdnprof) step gdnprof 90 20 python3 tools/bench_gdn.py --profile train:8x4096 --out "$OUT/gdn_prof_train.json" ;;
    flaprof) step flaprof 90 24 python3 tools/bench_gdn.py --profile flatrain:8x4096 --out "$OUT/fla_prof_train.json" ;;
    gdndot)  # GDN_VARIANTS: the variants, e.g. "chunk:bf16 chunk:tf32"; GDN_BENCH_ARGS: more bench_gdn arguments
      # shellcheck disable=SC2086
      step "gdndot${GDN_TUNE_TAG:-}" 300 14 python3 tools/bench_gdn.py --quick --prefill 1024 --decode 64 \
        --dot-precision ${GDN_VARIANTS:-ieee tf32x3 tf32} ${GDN_BENCH_ARGS:-} \
        --out "$OUT/bench_gdn_dot${GDN_TUNE_TAG:-}.json" ;;
    gdnbwd)
      step gdnbwd 240 14 python3 tools/bench_gdn.py --quick --prefill 512 --decode 64 --fla-bwd-unchecked \
        --out "$OUT/bench_gdn_bwd.json"
      step gdnbwdprof 60 16 python3 tools/bench_gdn.py --profile trainbwd:8x4096 --out "$OUT/gdn_prof_trainbwd.json" ;;
    rl) step rl 150 8 python3 tools/bench_rl_step.py --model qwen3_0p6b --steps 3 --prompts 8 --group 8 \
      --new-tokens 32 --prompt-len 32 --kv-cache-mb 8192 --out "$OUT/rl_step.json" ;;
    study)  # STUDY_OVERRIDES holds several words: word splitting on purpose
      # shellcheck disable=SC2086
      step study 600 12 python3 -m megatron_iso.cli.bench study model=qwen3_0p6b device=cuda bench.study.steps=10 \
      task.prompts_per_step=8 rl.max_response_length=256 out_dir="$OUT/study" ${STUDY_OVERRIDES:-} ;;
    rlppo)
      step rlppo 200 8 python3 tools/bench_rl_step.py --model qwen3_0p6b --profiles correctness --steps 4 --prompts 8 \
      --group 8 --new-tokens 128 --prompt-len 32 --kv-cache-mb 8192 --out "$OUT/rl_step_ppo_rollout.json" \
      rl.ppo_mini_batch_size=2 rl.ppo_epochs=2
      step rlppo_recompute 200 8 python3 tools/bench_rl_step.py --model qwen3_0p6b --profiles correctness --steps 4 \
      --prompts 8 --group 8 --new-tokens 128 --prompt-len 32 --kv-cache-mb 8192 \
      --out "$OUT/rl_step_ppo_recompute.json" rl.ppo_mini_batch_size=2 rl.ppo_epochs=2 rl.recompute_old_logprobs=true ;;
    rl8b) step rl8b 300 8 python3 tools/bench_rl_step.py --model qwen3_8b --steps 3 --prompts 8 --group 8 \
      --prompt-len 256 --new-tokens 512 --kv-cache-mb 16384 --train-micro-batch-seqs 16 \
      --out "$OUT/rl_step_qwen3_8b_l8_mb16.json" model.num_layers=8 ;;
    rl8bwhole) step rl8bwhole 300 8 python3 tools/bench_rl_step.py --model qwen3_8b --steps 3 --prompts 8 --group 8 \
      --prompt-len 256 --new-tokens 512 --kv-cache-mb 16384 --out "$OUT/rl_step_qwen3_8b_l8_whole.json" \
      model.num_layers=8 ;;
    rl8bleaf1) step rl8bleaf1 200 8 python3 tools/bench_rl_step.py --model qwen3_8b --steps 3 --prompts 8 --group 8 \
      --prompt-len 256 --new-tokens 512 --kv-cache-mb 16384 --train-micro-batch-seqs 16 --profiles correctness \
      --out "$OUT/rl_step_qwen3_8b_l8_mb16_leaf1.json" model.num_layers=8 profile.leaves=1 "profile.tp_domain=[1]" ;;
    rlhybrid)  # RLHYBRID_PROFILES and RLHYBRID_OVERRIDES hold several words: word splitting on purpose
      # shellcheck disable=SC2086
      step rlhybrid 300 8 python3 tools/bench_rl_step.py --model qwen3p5_small_hybrid_moe --steps 3 \
      --prompts 8 --group 8 --prompt-len 128 --new-tokens 96 --kv-cache-mb 2048 --train-micro-batch-seqs 16 \
      --profiles ${RLHYBRID_PROFILES:-correctness performance} --out "$OUT/rl_step_hybrid.json" \
      ${RLHYBRID_OVERRIDES:-} ;;
    decode) step decode 200 20 python3 tools/bench_decode.py --model qwen3_0p6b --batch 1 8 64 256 --prompt-len 512 \
      --new-tokens 512 --max-seconds 8 --budget-seconds 190 --out "$OUT/bench_decode.json" ;;
    decoderoof) step decoderoof 250 12 python3 tools/bench_decode.py --model qwen3_0p6b --engines iso native \
      --batch 1 64 256 --prompt-len 512 --new-tokens 256 --max-seconds 10 --budget-seconds 240 \
      --out "$OUT/bench_decode_roofline.json" ;;
    decode8b) step decode8b 150 8 python3 tools/bench_decode.py --model qwen3_8b --engines iso native --batch 64 \
      --prompt-len 512 --new-tokens 256 --max-seconds 10 --budget-seconds 140 --out "$OUT/bench_decode_8b_l8.json" \
      model.num_layers=8 ;;
    decodeeager) step decodeeager 150 12 python3 tools/bench_decode.py --model qwen3_0p6b --engines iso native \
      --batch 8 64 --prompt-len 512 --new-tokens 128 --max-seconds 15 --budget-seconds 140 --no-cuda-graphs \
      --out "$OUT/bench_decode_eager.json" ;;
    kvpaged) step kvpaged 120 8 python3 tools/bench_decode.py --model qwen3_0p6b --engines iso --batch 8 64 \
      --prompt-len 512 --new-tokens 128 --max-seconds 20 --budget-seconds 110 --out "$OUT/bench_decode_paged.json" ;;
    kvstaged) step kvstaged 120 8 python3 tools/bench_decode.py --model qwen3_0p6b --engines iso --batch 8 64 \
      --prompt-len 512 --new-tokens 128 --max-seconds 20 --budget-seconds 110 --staged-kv \
      --out "$OUT/bench_decode_staged.json" ;;
    moe) step moe 100 20 python3 tools/bench_ops.py --moe --skip-gemm --skip-mem --out "$OUT/bench_moe.json" ;;
    attnbwd) step attnbwd 200 60 python3 tools/bench_ops.py --attention-backward --attention-backward-sweep \
      --skip-gemm --skip-mem --out "$OUT/bench_attention_backward.json" ;;
    gemmsweep) step gemmsweep 300 70 python3 tools/bench_ops.py --sweep --sweep-large-only --skip-gemm --skip-mem \
      --out "$OUT/bench_gemm_sweep.json" ;;
    rl8b4k) step rl8b4k 420 8 python3 tools/bench_rl_step.py --model qwen3_8b --steps 2 --prompts 8 --group 4 \
      --prompt-len 512 --new-tokens 3584 --kv-cache-mb 16384 --train-micro-batch-seqs 2 \
      --out "$OUT/rl_step_qwen3_8b_l8_4k.json" model.num_layers=8 ;;
    rl8b4kleaf1) step rl8b4kleaf1 300 8 python3 tools/bench_rl_step.py --model qwen3_8b --steps 2 --prompts 8 --group 4 \
      --prompt-len 512 --new-tokens 3584 --kv-cache-mb 16384 --train-micro-batch-seqs 2 --profiles correctness \
      --out "$OUT/rl_step_qwen3_8b_l8_4k_leaf1.json" model.num_layers=8 profile.leaves=1 "profile.tp_domain=[1]" ;;
    rl8b8k) step rl8b8k 540 8 python3 tools/bench_rl_step.py --model qwen3_8b --steps 2 --prompts 4 --group 4 \
      --prompt-len 1024 --new-tokens 7168 --kv-cache-mb 16384 --train-micro-batch-seqs 1 \
      --out "$OUT/rl_step_qwen3_8b_l8_8k.json" model.num_layers=8 ;;
    rlhybrid4k) step rlhybrid4k 540 8 python3 tools/bench_rl_step.py --model qwen3p5_small_hybrid_moe --steps 2 \
      --prompts 8 --group 4 --prompt-len 512 --new-tokens 3584 --kv-cache-mb 8192 --train-micro-batch-seqs 4 \
      --out "$OUT/rl_step_hybrid_4k.json" ;;
    rlhybrid8k) step rlhybrid8k 560 8 python3 tools/bench_rl_step.py --model qwen3p5_small_hybrid_moe --steps 2 \
      --prompts 4 --group 4 --prompt-len 1024 --new-tokens 7168 --kv-cache-mb 8192 --train-micro-batch-seqs 1 \
      --out "$OUT/rl_step_hybrid_8k.json" rl.recompute_granularity=full rl.recompute_method=uniform \
      rl.recompute_num_layers=1 ;;
    rlhybrid4kmem) step rlhybrid4kmem 360 8 python3 tools/bench_rl_step.py --model qwen3p5_small_hybrid_moe --steps 2 \
      --profiles correctness --prompts 8 --group 4 --prompt-len 512 --new-tokens 3584 --kv-cache-mb 8192 \
      --train-micro-batch-seqs 4 --out "$OUT/rl_step_hybrid_4k_recompute.json" rl.recompute_granularity=full \
      rl.recompute_method=uniform rl.recompute_num_layers=1 rl.gdn_backward_states=recompute ;;
    rlmoe) step rlmoe 300 8 python3 tools/bench_rl_step.py --model qwen3_30b_a3b --steps 3 --prompts 8 --group 8 \
      --prompt-len 128 --new-tokens 256 --kv-cache-mb 4096 --train-micro-batch-seqs 16 \
      --out "$OUT/rl_step_qwen3_30b_a3b_l2.json" model.num_layers=2 ;;
    moebwd) step moebwd 120 8 python3 tools/bench_moe_backward.py --out "$OUT/bench_moe_backward.json" ;;
    opsites) step opsites 150 40 python3 tools/op_sites.py --model qwen3p5_small_hybrid_moe --phase rollout \
      --out "$OUT/op_sites_hybrid_rollout.json" rollout.cuda_graphs=false rollout.kv_cache_mb=2048 ;;
    decode8bfull) step decode8bfull 300 8 python3 tools/bench_decode.py --model qwen3_8b --engines iso native \
      --batch 1 64 --prompt-len 4096 --new-tokens 256 --max-seconds 20 --budget-seconds 290 \
      --out "$OUT/bench_decode_8b_full.json" ;;
    decodemoe) step decodemoe 250 10 python3 tools/bench_decode.py --model qwen3_30b_a3b --engines iso native \
      --batch 1 8 64 --prompt-len 512 --new-tokens 256 --max-seconds 10 --budget-seconds 240 \
      --out "$OUT/bench_decode_moe_l4.json" model.num_layers=4 ;;
    decodemoeeager) step decodemoeeager 250 10 python3 tools/bench_decode.py --model qwen3_30b_a3b --engines iso \
      native --batch 1 8 64 --prompt-len 512 --new-tokens 256 --max-seconds 10 --budget-seconds 240 --no-cuda-graphs \
      --out "$OUT/bench_decode_moe_l4_eager.json" model.num_layers=4 ;;
    nccl) step nccl 300 15 python3 -m pytest -q -p no:warnings -rfE tests/multigpu ;;
    rltp2) step rltp2 420 8 python3 -m torch.distributed.run --standalone --nproc-per-node 2 tools/bench_rl_step.py \
      --model qwen3_0p6b --steps 3 --prompts 8 --group 8 --new-tokens 32 --prompt-len 32 --kv-cache-mb 8192 \
      --out "$OUT/rl_step_tp2.json" parallel.tp=2 ;;
    rlcp2) step rlcp2 420 8 python3 -m torch.distributed.run --standalone --nproc-per-node 2 tools/bench_rl_step.py \
      --model qwen3_0p6b --steps 3 --prompts 8 --group 8 --new-tokens 32 --prompt-len 32 --kv-cache-mb 8192 \
      --out "$OUT/rl_step_cp2.json" parallel.cp=2 "profile.cp_domain=[1,2]" ;;
  esac
done
