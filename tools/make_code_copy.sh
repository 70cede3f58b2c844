#!/usr/bin/env bash
# A code copy for tools/gdn_code_copies.sh: megatron_iso/, tools/, tests/, conf/ and pyproject.toml of a revision
# (so the copy's own bench and GPU tests run in it), with patches applied, in a folder of its own (untracked: list
# its parent in .git/info/exclude and carry it to the device machine).
#
#   bash tools/make_code_copy.sh v/new HEAD docs/perf/patches/a.patch [more patches]
#   GDN_COPIES="v/base v/new" bash tools/h200_call.sh gdncopies
#
# Every patch must apply whole, or the script fails: `git apply` run inside a subfolder of the repository skips the
# paths outside it without an error, which once had unpatched copies timed as patched ones (Session 16).
set -eu
if [ $# -lt 2 ]; then
  echo "usage: $0 DIR REV [PATCH...]" >&2
  exit 2
fi
dir=$1 rev=$2
shift 2
root=$(git rev-parse --show-toplevel)
if [ -e "$dir" ]; then
  echo "$dir exists; remove it first (a copy is built whole from REV)" >&2
  exit 2
fi
for p in "$@"; do
  if [ ! -f "$p" ]; then
    echo "patch $p: no such file" >&2
    exit 2
  fi
done
mkdir -p "$dir"
git -C "$root" archive "$rev" megatron_iso tools tests conf pyproject.toml | tar -x -C "$dir"
for p in "$@"; do  # patch(1), unlike git apply in a subfolder, fails on a file it cannot find
  if ! patch -d "$dir" -p1 --batch --forward --silent < "$p"; then
    echo "patch $p does not apply to $rev" >&2
    exit 1
  fi
done
echo "$dir: $rev$(printf ' + %s' "$@")"
