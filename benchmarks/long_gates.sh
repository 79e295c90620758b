#!/usr/bin/env bash
# Long gates of upstream's storage threads under schedule points (issue 32), for a many-core
# runner with no network: sglang 0.5.10, 0.5.22, 0.5.23 and the seed fork, one after the other,
# each with a worker per core for BUDGET (default 90s), the campaign profile (its PCT bias over
# the storage threads; each failure's record names the PCT depth that found it) and --keep-going
# (every new failure is kept, not only the first). Storage worlds with schedule points are part
# of every gate's default draw.
#
#   benchmarks/long_gates.sh OUT_DIR [BUDGET]
#
# Reads the release trees from ~/.cache/hicache_ref/sglang-<version> (or $HICACHE_TREES; carry
# them there, nothing is fetched). The seed is gated from $HICACHE_SEED_TREE (an unpacked fork
# tree) or built from $HICACHE_SEED_FILE (its re-indented controller); without either it is
# skipped with a line saying so. Writes, per gate, OUT_DIR/<name>.json (the --json report),
# OUT_DIR/<name>.log (its summary) and OUT_DIR/<name>/ (every failing trace, minimized beside
# it, with the replay line the log prints). Exit status: 0 when every gate passed, 1 when one
# found a new failure, 2 on a missing tree or a bad argument.
set -u

if [ $# -lt 1 ] || [ $# -gt 2 ]; then
    echo "usage: $0 OUT_DIR [BUDGET]  (BUDGET as hicache-fuzz takes it: 90s, 2m; default 90s)" >&2
    exit 2
fi
out=$1
budget=${2:-90s}
trees=${HICACHE_TREES:-$HOME/.cache/hicache_ref}
here=$(cd "$(dirname "$0")/.." && pwd)
fuzz=$here/.venv/bin/hicache-fuzz
[ -x "$fuzz" ] || fuzz=$(command -v hicache-fuzz) || {
    echo "long_gates: no hicache-fuzz (make the venv: see CONTRIBUTING)" >&2
    exit 2
}
workers=$(nproc)
mkdir -p "$out" || exit 2

for version in 0.5.10 0.5.22 0.5.23; do
    if [ ! -d "$trees/sglang-$version/sglang" ]; then
        echo "long_gates: no tree $trees/sglang-$version; carry it there (hicache-fuzz setup --from WHEEL on a machine with the wheel)" >&2
        exit 2
    fi
done

status=0
gate() {  # name, then the arguments that choose the implementation
    local name=$1
    shift
    local started=$SECONDS
    "$fuzz" gate "$@" --budget "$budget" --workers "$workers" --profile campaign --keep-going \
        --no-progress --seed 0 --out "$out/$name" --json "$out/$name.json" >"$out/$name.log" 2>&1
    local rc=$?
    echo "long_gates: $name exit $rc in $((SECONDS - started)) s: $(tail -n 1 "$out/$name.log")"
    if [ "$rc" -eq 1 ]; then
        status=1
    elif [ "$rc" -ne 0 ]; then
        echo "long_gates: $name could not run (exit $rc); see $out/$name.log" >&2
        [ "$status" -eq 0 ] && status=2
    fi
}

for version in 0.5.10 0.5.22 0.5.23; do
    gate "sglang-$version" --impl sglang --sglang-src "$trees/sglang-$version"
done
if [ -n "${HICACHE_SEED_TREE:-}" ]; then
    gate seed --impl seed --sglang-src "$HICACHE_SEED_TREE" --known all
elif [ -n "${HICACHE_SEED_FILE:-}" ]; then
    gate seed --impl seed --known all
else
    echo "long_gates: seed skipped (set HICACHE_SEED_TREE or HICACHE_SEED_FILE)"
fi
exit $status
