#!/usr/bin/env bash
# Entrypoint of both megatron_iso images. It decides what to run, then execs it (PID 1 stays
# the workload, so `docker stop` and SLURM signals reach torchrun/iso-train directly):
#   demo [overrides], or none  the README demo (`make demo`): iso-train into a new runs/demo-<time>
#   key=value ... (Hydra)      iso-train key=value ...
#   test [pytest args]         ruff check + format check + pytest (what `make test` runs)
#   anything else              run as given: iso-train, torchrun, iso-convert, bash, python, ...
# On the NVIDIA image the command goes through NVIDIA's own entrypoint (driver and compat checks,
# banner) when it exists; ISO_NVIDIA_ENTRYPOINT names it.
set -euo pipefail

nvidia_entrypoint="${ISO_NVIDIA_ENTRYPOINT:-/opt/nvidia/nvidia_entrypoint.sh}"

if [[ $# -eq 0 ]]; then
    set -- demo
fi
case "$1" in
    test)
        shift
        # From the source tree the package was installed from (ruff and pytest read pyproject.toml).
        cd "$(python -c 'import importlib.util as u, pathlib; print(pathlib.Path(u.find_spec("megatron_iso").origin).parents[1])')"
        # No caches in the source tree: on the GPU image it belongs to root, not to the user.
        export RUFF_CACHE_DIR="${RUFF_CACHE_DIR:-/tmp/ruff-cache}"
        set -- bash -c 'ruff check . && ruff format --check . && exec python -m pytest -p no:cacheprovider "$@"' \
            test "$@"
        ;;
    demo)
        shift
        set -- iso-train "out_dir=runs/demo-$(date +%Y%m%d-%H%M%S)" "$@"
        ;;
    -* | ~* | *=*)
        # Hydra overrides (key=value, +key=value, ~key) and iso-train's own flags (--cfg job, -m).
        set -- iso-train "$@"
        ;;
esac

if [[ -x "$nvidia_entrypoint" ]]; then
    exec "$nvidia_entrypoint" "$@"
fi
exec "$@"
