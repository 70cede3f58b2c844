#!/usr/bin/env bash
# Per-kernel times of the GDN training forward (8 x 4096 tokens) for several tuning variants, one
# `bench_gdn.py --profile` run each (its own process, so its own compiled kernels), kernel rows printed per
# variant and each profile written to $OUT/gdn_tune_<i>.json. Called by `tools/h200_call.sh gdntune`.
#
#   bash tools/gdn_tune_profiles.sh "VARIANTS"
#
# VARIANTS: ";"-separated; each is "[@PRECISION] [NAME=INT ...]" (bench_gdn's --tune names; an empty variant is
# the registered configuration). Default: the registered one; scan 64x2; the all-ieee state pass (chain BV 16).
# GDN_TUNE_CASE=trainbwd profiles forward + backward instead (the BWD_* names tune the Triton backward); a case with
# its own size (e.g. decode:64, the chunk-form decode step with "@chunk:bf16") is profiled as given. GDN_TUNE_TAG
# prefixes the JSON names ($OUT/gdn_tune_<tag><i>.json), so two sweeps of one call keep both.
set -u
: "${OUT:?OUT must name the folder results are written to}"
variants=${1:-";SCAN_BV=64 SCAN_WARPS=2;@ieee"}
i=0
IFS=';' read -r -a list <<< "$variants"
for v in "${list[@]}"; do
  i=$((i + 1))
  case_spec=${GDN_TUNE_CASE:-train}
  case $case_spec in *:*) ;; *) case_spec="$case_spec:8x4096" ;; esac
  tune=()
  for w in $v; do
    case $w in
      @*) case_spec="$case_spec$w" ;;
      *) tune+=("$w") ;;
    esac
  done
  echo "=== variant $i: ${v:-registered}"
  args=(--profile "$case_spec" --out "$OUT/gdn_tune_${GDN_TUNE_TAG:-}$i.json")
  if [ ${#tune[@]} -gt 0 ]; then args+=(--tune "${tune[@]}"); fi
  timeout 70 python3 tools/bench_gdn.py "${args[@]}" 2>&1 | grep -E "^\| |wall \(synced\)" | cut -c1-160 | head -16
done
