#!/usr/bin/env bash
# `make unit`: the test suite in four lanes side by side, on a 2-core machine, and two tails.
#
# Why these lanes: what bounds each part of the suite is different, and only side by side do
# they keep both cores busy.
#   compute  tests/unit, tests/shell, tests/browser: pure code, in-process trio services on the
#            fake network under MockClock (the mesh simulations at 20-60 nodes are the slowest)
#            and one headless Chromium; they keep a core busy and seldom wait. Then the tests of
#            tests/system marked `compute` (the benches of a model, a simulation or a solver in
#            one process: no agents to wait for), as "compute-system". Then tests/sites and
#            SITES_AGENTS, as "sites": the emulated sites (network namespaces, a WAN router
#            process; about 25 s, mostly waiting out round trips) and the agents of several sites. Their own lane would start them beside every other
#            at the busiest moment; at the end of this one, which ends third (after the two Slurm
#            lanes, minutes before the agents lane), they lengthen no lane the run waits on.
#   agents   tests/system but the `compute` ones and LATE_AGENTS: real agents and simulated
#            engines as subprocesses on 127.0.0.1. Most of its time is waiting (an agent starting, a
#            simulated engine pacing its tokens, gossip converging, a replay running its trace
#            seconds), at well under a core on average, with bursts when a bench drives load.
#   slurm    tests/slurm but SLURM_ELASTIC: a real Slurm (jobs scheduled, agents starting inside
#            them, preemption, drains) and a real vLLM on CPU; mostly waiting.
#   slurm-elastic  SLURM_ELASTIC, on a Slurm of its own: the elastic controller waiting out
#            time limits, takeovers, ramps and replacements; at a fifth of a core. It tests the
#            control plane, so it runs interpreted (FABRIC_NATIVE=0) and needs neither the
#            compiled build nor lint: given LANES_SETUP (`make test`: lint, types, the build),
#            it starts first, beside that setup, and ends some three minutes before the others
#            (a fresh clone's setup took ~240 s, during which one core was mostly idle).
#   interpreted  the data plane's tests once more on the interpreted sources (FABRIC_NATIVE=0
#            on every tests/<kind>/dataplane folder and tests/unit/requestlog: what runs where
#            the compiled build is missing or stale, so it must stay correct too); it starts
#            when the compute lane or a Slurm lane ends, whichever is first.
#   agents-benches  BENCH_AGENTS (the benches' smoke runs with real agents), after interpreted.
#   agents-late  LATE_AGENTS (the Batch API's, plan-apply and CLI agent tests), when the next of
#            them ends: with them in it, the agents lane was the run's length (989 s of a fresh
#            clone's 1,204 s) while two lanes had ended.
# In two lanes (tests/slurm beside everything else, the rerun after both) the long main lane
# spent most of its time waiting on subprocesses, with the load average under 1. Four lanes
# from the start with tests/system split in two overloaded the machine (load 6.8) and an agent
# in the churn test took over a minute to start: the agent tests stay in one lane at a time
# (agents-late starts when a lane ends), and the two Slurm lanes mostly wait.
#
# The lanes share no timing-sensitive resource: every test binds port 0 or its own free port,
# each lane has its own pytest --basetemp (so none cleans up another's files), the Slurm lane
# has its own daemons and FABRIC_HOME under its basetemp. Since a lane runs beside others, a
# test must not depend on how fast the machine is (CONTRIBUTING.md: benches report numbers,
# tests assert behaviour; wait for the event, never for a time). Every lane runs to the end;
# the exit status is non-zero if any lane failed; each lane prints its slowest tests
# (--durations) and how many cores it kept busy, for whoever trims the suite, and the last line
# sums them up for CI.
set -uo pipefail
cd "$(dirname "$0")/.."

BIN=${BIN:-.venv/bin}
# One lane: split in two (tests/unit beside tests/shell and tests/browser), every lane ran slower
# (a fresh clone's run went from 21 min 59 s to 22 min 45 s, the agents lane 999 to 1,121 s).
COMPUTE=(tests/unit tests/shell tests/browser)
AGENTS=(tests/system)
# Agent tests that wait on the Batch API's worker, on plans applied through the mesh and on the
# CLI's views of a mesh: run as a tail (see below), so the agents lane is not the run's length.
LATE_AGENTS=(tests/system/test_batch_api.py tests/system/test_batch_cli.py
    tests/system/test_plan_apply.py tests/system/test_cli.py)
# The smoke runs of the benches that drive real agents: after the interpreted rerun, in its tail.
BENCH_AGENTS=(tests/system/test_bench_tiers.py tests/system/test_bench_routing.py)
# The elastic controller's tests wait out Slurm time limits, takeovers and ramps (most of
# tests/slurm's time, at a fifth of a core): a Slurm of their own, beside the rest of tests/slurm.
# The load jump's test (a six-GPU Slurm of its own) too: in the slurm lane it made that lane end
# second, and the interpreted rerun, which follows the first lane to end, two minutes later.
SLURM_ELASTIC=(tests/slurm/test_elastic.py tests/slurm/test_elastic_qos.py
    tests/slurm/test_dashboard_controller.py tests/slurm/test_elastic_jump.py)
SLURM=(tests/slurm)
# The emulated sites (tests/support/sites.py), and the agent tests of sites and federation
# (agents of several sites and meshes, gateways): after compute-system, in the compute lane's
# tail, not in the agents lane, the run's length.
SITES_AGENTS=(tests/system/test_sites.py tests/system/test_federation.py
    tests/system/test_residency.py tests/system/test_cross_site.py)
SITES=(tests/sites "${SITES_AGENTS[@]}")
# Every tests/<kind>/dataplane folder, and the request log's tests (three of its modules are
# compiled with the data plane: fabricnode.native.COMPANIONS): run again on the interpreted
# sources (FABRIC_NATIVE=0).
DATAPLANE_TESTS=(tests/*/dataplane tests/unit/requestlog)
WORK=$(mktemp -d "${TMPDIR:-/tmp}/fabric-test-lanes.XXXXXX")
trap 'rm -rf "$WORK"' EXIT

started=$(date +%s)

lane() { # lane NAME ENV... -- PYTEST-ARGS...: one pytest run, its log in $WORK/NAME.log
    local name=$1 t0
    shift
    local envs=()
    while [ "$1" != "--" ]; do envs+=("$1"); shift; done
    shift
    t0=$(date +%s)
    # bash's `time`: wall, and the CPU of pytest and every process it started and reaped
    # (agents, engines, browsers): how many cores the lane kept busy on average.
    local TIMEFORMAT="%R %U %S"
    { time env "${envs[@]}" "$BIN/pytest" -q --durations=15 --basetemp="$WORK/$name" "$@" \
        >"$WORK/$name.log" 2>&1; } 2>"$WORK/$name.time"
    local status=$?
    echo "$status $(($(date +%s) - t0))" >"$WORK/$name.status"
    return "$status"
}

cpu() { # cpu NAME: "user+sys CPU s, N cores" of a finished lane
    awk '{printf "%.0f s CPU, %.2f cores on average", $2 + $3, ($2 + $3) / ($1 > 0 ? $1 : 1)}' \
        "$WORK/$1.time" 2>/dev/null
}

setup_failed=0
if [ -n "${LANES_SETUP:-}" ]; then
    lane slurm-elastic FABRIC_NATIVE=0 -- "${SLURM_ELASTIC[@]}" &
    slurm_elastic=$!
    # A failed setup (lint, types) fails the run, but every lane still runs: one run tells all.
    bash -c "$LANES_SETUP" || setup_failed=1
    echo "== setup done after $(($(date +%s) - started)) s (exit status: $setup_failed)"
fi

(
    lane compute -- "${COMPUTE[@]}"
    lane compute-system -- -m compute "${AGENTS[@]}"
    lane sites -- "${SITES[@]}"
) &
compute=$!
ignoring() { # ignoring PATH...: pytest's --ignore for each
    local path
    for path in "$@"; do printf -- '--ignore=%s\n' "$path"; done
}
mapfile -t late_ignored < <(ignoring "${LATE_AGENTS[@]}" "${BENCH_AGENTS[@]}" "${SITES_AGENTS[@]}")
mapfile -t elastic_ignored < <(ignoring "${SLURM_ELASTIC[@]}")
lane agents -- -m "not compute" "${late_ignored[@]}" "${AGENTS[@]}" &
lane slurm -- "${elastic_ignored[@]}" "${SLURM[@]}" &
slurm=$!
if [ -z "${LANES_SETUP:-}" ]; then
    lane slurm-elastic FABRIC_NATIVE=0 -- "${SLURM_ELASTIC[@]}" &
    slurm_elastic=$!
fi
# Two tails take the places of the compute and the two Slurm lanes as they end, the longer
# first: the interpreted rerun (~5 min) after whichever ends first, the late agent tests (~3 min)
# after the next (which end first depends on the machine, and on whether Slurm and vLLM are
# there at all). The agents lane, the longest, is never followed.
# A lane (or the compute lane's chain) has ended when its last status file is written; the
# slurm-elastic lane may have ended before the first wait (it starts during the setup), and
# `wait -n` does not know a job that ended already: hence the files.
declare -A last_of=([compute]=sites [slurm]=slurm [slurm-elastic]=slurm-elastic)
waiting=(compute slurm slurm-elastic)
next_ended() { # sets `ended` to the first lane in `waiting` to end, and takes it out
    local name i
    while :; do
        for i in "${!waiting[@]}"; do
            name=${waiting[$i]}
            if [ -f "$WORK/${last_of[$name]}.status" ]; then
                ended=$name
                unset "waiting[$i]"
                waiting=("${waiting[@]}")
                return
            fi
        done
        wait -n "$compute" "$slurm" "$slurm_elastic" 2>/dev/null || sleep 1
    done
}
after=()
next_ended
after+=("$ended")
(
    lane interpreted FABRIC_NATIVE=0 -- "${DATAPLANE_TESTS[@]}"
    lane agents-benches -- -m "not compute" "${BENCH_AGENTS[@]}"
) &
next_ended
after+=("$ended")
lane agents-late -- -m "not compute" "${LATE_AGENTS[@]}" &
wait

LANES=(compute compute-system sites agents slurm slurm-elastic interpreted agents-benches
    agents-late)
failed_lanes=0
for name in "${LANES[@]}"; do
    read -r status took <"$WORK/$name.status" 2>/dev/null || { status=1 took=0; }
    echo "== lane $name: exit $status after $took s"
    cat "$WORK/$name.log"
    [ "$status" -eq 0 ] || failed_lanes=$((failed_lanes + 1))
done
for name in "${LANES[@]}"; do
    read -r status took <"$WORK/$name.status" 2>/dev/null || { status=1 took=0; }
    echo "== lane $name: exit $status, $took s, $(cpu "$name")"
done
echo "== interpreted started when the ${after[0]} lane ended, agents-late after ${after[1]}"
echo "== all lanes done after $(($(date +%s) - started)) s"

# One closing line for the runs, in the plain form CI reads ("N passed, N failed").
count() { # count WORD: the sum of "N WORD" over the runs' summary lines
    grep -hE "(passed|failed|error|skipped).* in [0-9.]+s" "$WORK"/*.log 2>/dev/null |
        grep -oE "[0-9]+ $1" | awk '{n += $1} END {print n + 0}'
}
failed=$(($(count failed) + $(count error)))
[ "$setup_failed" -eq 0 ] || echo "== the setup failed (lint, types or the build): see above"
echo "all lanes: $(count passed) passed, $failed failed, $(count skipped) skipped"

[ "$failed_lanes" -eq 0 ] && [ "$setup_failed" -eq 0 ]
