#!/usr/bin/env bash
# `make unit`: the test suite in two lanes side by side, then the data plane's tests once more
# interpreted.
#
# Why two lanes: the tests under tests/slurm spend their time waiting (a real Slurm schedules
# jobs, agents start inside them, the elastic controller waits out replacements), at well under
# one core, while the rest (unit, shell, system, browser) keep a core busy. Run one after the
# other they took most of `make test`'s time on a 2-core machine with a core idle; side by side
# they share no timing-sensitive resource (the Slurm lane has its own daemons, ports and
# FABRIC_HOME under its own basetemp). Each lane has its own pytest basetemp, so neither cleans
# up the other's files. Both lanes always run to the end; the exit status is non-zero if any
# lane failed, and each lane prints its slowest tests (--durations) for whoever trims the suite.
set -uo pipefail
cd "$(dirname "$0")/.."

BIN=${BIN:-.venv/bin}
WAIT_LANE=(tests/slurm)
# Every tests/<kind>/dataplane folder: run again on the interpreted sources (FABRIC_NATIVE=0),
# which is what runs where the compiled build is missing or stale.
DATAPLANE_TESTS=(tests/*/dataplane)
WORK=$(mktemp -d "${TMPDIR:-/tmp}/fabric-test-lanes.XXXXXX")
trap 'rm -rf "$WORK"' EXIT

started=$(date +%s)
"$BIN/pytest" -q --durations=15 --basetemp="$WORK/slurm" "${WAIT_LANE[@]}" \
    >"$WORK/slurm.log" 2>&1 &
wait_lane=$!

ignore=()
for path in "${WAIT_LANE[@]}"; do ignore+=(--ignore="$path"); done
"$BIN/pytest" -q --durations=25 --basetemp="$WORK/main" "${ignore[@]}" 2>&1 | tee "$WORK/main.log"
main_status=${PIPESTATUS[0]}
echo "== main lane: exit $main_status after $(($(date +%s) - started)) s"

FABRIC_NATIVE=0 "$BIN/pytest" -q --basetemp="$WORK/interpreted" "${DATAPLANE_TESTS[@]}" 2>&1 |
    tee "$WORK/interpreted.log"
interpreted_status=${PIPESTATUS[0]}
echo "== interpreted data plane: exit $interpreted_status after $(($(date +%s) - started)) s"

wait "$wait_lane"
wait_status=$?
echo "== Slurm lane (${WAIT_LANE[*]}), run beside the others: exit $wait_status"
cat "$WORK/slurm.log"
echo "== all lanes done after $(($(date +%s) - started)) s"

# One closing line for the three runs, in the plain form CI reads ("N passed, N failed").
count() { # count WORD: the sum of "N WORD" over the three runs' summary lines
    grep -hE "(passed|failed|error|skipped).* in [0-9.]+s" "$WORK"/{main,interpreted,slurm}.log 2>/dev/null |
        grep -oE "[0-9]+ $1" | awk '{n += $1} END {print n + 0}'
}
failed=$(($(count failed) + $(count error)))
echo "all lanes: $(count passed) passed, $failed failed, $(count skipped) skipped"

[ "$main_status" -eq 0 ] && [ "$interpreted_status" -eq 0 ] && [ "$wait_status" -eq 0 ]
