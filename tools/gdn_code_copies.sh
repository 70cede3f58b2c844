#!/usr/bin/env bash
# Per-kernel times of one GDN case for several versions of the code in one device call: each version is a copy of
# megatron_iso/ and tools/ in its own folder (untracked; carry the parent folder), profiled by that copy's own
# bench_gdn.py with PYTHONPATH at the copy, so each runs its own kernels. Called by `tools/h200_call.sh gdncopies`.
#
#   bash tools/make_code_copy.sh variants/base HEAD~1 && bash tools/make_code_copy.sh variants/new HEAD some.patch
#   GDN_COPIES="variants/base variants/new" GDN_COPY_CASE=decode:64@chunk:bf16 bash tools/gdn_code_copies.sh
#
# GDN_COPIES: the folders ("." is the working tree); GDN_COPY_CASE: one or more bench_gdn --profile cases, separated by
# spaces (default decode:64@chunk:bf16; e.g. "decode:64@chunk:bf16 decodeclose:64@chunk:bf16"), each run for every
# copy; each profile goes to $OUT/copy_<folder name>_<case>.json (the case's ':' and '@' as '_'), its kernel rows to
# stdout.
set -u
: "${OUT:?OUT must name the folder results are written to}"
: "${GDN_COPIES:?GDN_COPIES must name the code copies (folders holding megatron_iso/ and tools/)}"
root=$PWD
deps=${PYTHONPATH:-}
for d in $GDN_COPIES; do  # every folder checked before any runs
  if [ ! -f "$d/megatron_iso/__init__.py" ] || [ ! -f "$d/tools/bench_gdn.py" ]; then
    echo "GDN_COPIES: $d holds no megatron_iso/ and tools/bench_gdn.py" >&2
    exit 2
  fi
done
for case in ${GDN_COPY_CASE:-decode:64@chunk:bf16}; do  # several cases: word splitting on purpose
  tag=$(printf '%s' "$case" | tr ':@/' '___')
  for d in $GDN_COPIES; do
    name=$(basename "$(cd "$d" && pwd)")
    echo "=== $d: $case"
    (cd "$d" && PYTHONPATH="$PWD${deps:+:$deps}" timeout 90 python3 tools/bench_gdn.py \
      --profile "$case" --out "$OUT/copy_${name}_$tag.json" 2>&1) \
      | grep -E "^\| |wall \(synced\)" | cut -c1-160 | head -12
  done
done
cd "$root" || exit 1
