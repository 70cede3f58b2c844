# shellcheck shell=bash
# Sourced by the example launch scripts: finds torchrun and checks the paths a recipe names before any rank starts.
# torchrun: the one on PATH (an active virtualenv, or a container's), else the checkout's .venv (`make venv`). A
# missing one or a missing path is one line on stderr and exit 2, not torchrun's ChildFailedError from every rank.

examples_dir="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

find_torchrun() {
  if command -v torchrun >/dev/null 2>&1; then
    command -v torchrun
  elif [ -x "$examples_dir/../.venv/bin/torchrun" ]; then
    echo "$examples_dir/../.venv/bin/torchrun"
  else
    echo "error: torchrun not found: activate the environment that has megatron_iso (source .venv/bin/activate)," \
      "or run 'make venv' in $(cd "$examples_dir/.." && pwd)" >&2
    exit 2
  fi
}

# require_path NAME PATH [file|dir]: PATH must exist (as a file or a directory); NAME is the variable that set it.
require_path() {
  local name=$1 path=$2 kind=${3:-any}
  case $kind in
    file) [ -f "$path" ] && return 0 ;;
    dir) [ -d "$path" ] && return 0 ;;
    *) [ -e "$path" ] && return 0 ;;
  esac
  echo "error: $name=$path: no such ${kind/any/path}" >&2
  exit 2
}
