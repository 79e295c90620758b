#!/usr/bin/env bash
# CrossHair over every contract-bearing pure module of the oracle (the storage oracle's keys.py
# too) and over pools/page_math.py,
# then diffbehavior between the reference page helpers and their fast variants.
#
#   .ci/crosshair.sh                 # CI gate: must print nothing but the summary lines
#   .ci/crosshair.sh --report_all    # also prove each contract ran ("Confirmed"/"Not confirmed",
#                                    # never "Unable to meet precondition")
#   CROSSHAIR_TIMEOUT=5 .ci/crosshair.sh   # longer per-condition budget (CPU seconds)
#
# Exits non-zero on any counterexample, error or behaviour difference.
set -euo pipefail
cd "$(dirname "$0")/.."
CROSSHAIR="${CROSSHAIR:-.venv/bin/crosshair}"
TIMEOUT="${CROSSHAIR_TIMEOUT:-1}"
EXTRA=("$@")

# path:factor -- the per-condition budget is TIMEOUT * factor. contracts.py drives whole step
# sequences, so one path costs ~0.5 s of CPU under CrossHair; 1 s would end before any finished.
TARGETS=(
  hicache_ref/oracle/geometry.py:1
  hicache_ref/oracle/state.py:1
  hicache_ref/oracle/streams.py:1
  hicache_ref/oracle/slots.py:1
  hicache_ref/oracle/write_path.py:1
  hicache_ref/oracle/contracts.py:3
  hicache_ref/oracle/storage/keys.py:3
  hicache_ref/formal/optimized.py:1
  hicache_ref/pools/page_math.py:1
)
DIFFS=(
  "hicache_ref.pools.page_math.compute_page_owner hicache_ref.formal.optimized.compute_page_owner_fast"
  "hicache_ref.pools.page_math.compute_padded_len hicache_ref.formal.optimized.compute_padded_len_fast"
)

status=0
for entry in "${TARGETS[@]}"; do
  target="${entry%%:*}"
  budget=$((TIMEOUT * ${entry##*:}))
  echo "== crosshair check ${target} (per condition ${budget}s)"
  "$CROSSHAIR" check --per_condition_timeout="$budget" --max_uninteresting_iterations=20 \
    ${EXTRA[@]+"${EXTRA[@]}"} "$target" || status=1
done
for pair in "${DIFFS[@]}"; do
  echo "== crosshair diffbehavior ${pair}"
  # shellcheck disable=SC2086
  "$CROSSHAIR" diffbehavior --per_condition_timeout="$((TIMEOUT * 2))" $pair || status=1
done
exit "$status"
