#!/usr/bin/env bash
# `make unit` / `make test`: the test suite in five lanes side by side on a 2-core machine, and a
# queue of lanes that take the places of those that end.
#
# Why these lanes: what bounds each part of the suite is different, and only side by side do
# they keep both cores busy. Five places run a lane each; when a lane ends, the next queued lane
# takes its place (QUEUE, longest first).
#   interpreted  the data plane's tests once more on the interpreted sources (FABRIC_NATIVE=0
#            on every tests/<kind>/dataplane folder and tests/unit/requestlog: what runs where
#            the compiled build is missing or stale, so it must stay correct too). It needs
#            neither the compiled build nor lint, so it starts first, beside `make test`'s
#            setup (LANES_SETUP: lint, types, the build, the vLLM venv: ~25 s with the build
#            cached, ~230 s without, a core mostly idle meanwhile).
#   slurm-elastic  SLURM_ELASTIC, on a Slurm of its own: the elastic controller waiting out
#            time limits, takeovers and replacements; at a fifth of a core. (Run interpreted
#            beside the setup, its two-minute jobs' drains slowed enough to leave a replica
#            alone for 16 s: compiled, after the setup.)
#   compute  tests/unit, tests/shell: pure code, in-process trio services on the fake network
#            under MockClock (the mesh simulations at 20-60 nodes are the slowest); they keep a
#            core busy and seldom wait.
#   agents   tests/system but the `compute` ones and the queued agent tests: real agents and
#            simulated engines as subprocesses on 127.0.0.1. Most of its time is waiting (an
#            agent starting, a simulated engine pacing its tokens, gossip converging, a replay
#            running its trace seconds), at well under a core on average.
#   slurm    tests/slurm but SLURM_ELASTIC: a real Slurm (jobs scheduled, agents starting inside
#            them, preemption, drains) and a real vLLM on CPU; mostly waiting.
# Queued:
#   compute-tail  COMPUTE_TAIL (the longest compute tests: mesh simulations at scale, the fuzzer).
#   agents-late  LATE_AGENTS (the Batch API's, plan-apply and CLI agent tests).
#   agents-tail  TAIL_AGENTS (the longest agent tests).
#   sites    tests/sites and SITES_AGENTS: the emulated sites (network namespaces, a WAN router
#            process, real agents of three sites over it) and the agents of several sites.
#   agents-benches  BENCH_AGENTS (the benches' smoke runs with real agents).
#   compute-system  the tests of tests/system marked `compute` (the benches of a model, a
#            simulation or a solver in one process: no agents to wait for).
#   browser  tests/browser: the dashboard in headless Chromium.
#   slurm-jump  SLURM_JUMP: the elastic controller under a load jump, last (see there).
# In two lanes (tests/slurm beside everything else, the rerun after both) the long main lane
# spent most of its time waiting on subprocesses, with the load average under 1. Four lanes
# from the start with tests/system split in two overloaded the machine (load 6.8) and an agent
# in the churn test took over a minute to start: the agent-heavy lanes are queued, so at most
# five lanes run at once, the two Slurm ones mostly waiting.
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
# The compute lane was the run's length (847 s of a fresh clone's 1,286): the browser tests are a
# queued lane of their own. (Split in two from the start, tests/unit beside tests/shell, every
# lane ran slower: a fresh clone's run went from 21 min 59 s to 22 min 45 s.)
COMPUTE=(tests/unit tests/shell)
# The compute tests that take longest (the mesh simulations at scale and the datagram fuzzer:
# 336 s of the compute lane's 1,073 in a fresh clone's run, the run's length): a queued lane,
# first in the queue, so that they run in the place of the first lane to end.
COMPUTE_TAIL=(tests/unit/mesh/test_core_sim.py tests/unit/mesh/test_security.py
    tests/shell/mesh/test_service_fakenet.py)
BROWSER=(tests/browser)
AGENTS=(tests/system)
# The agent tests that take longest (churn under load, a busy engine, the demo and the key
# rotation): a queued lane, so that the agents lane is not the run's length (935 s).
TAIL_AGENTS=(tests/system/test_churn.py tests/system/test_busy_engine.py
    tests/system/test_agent_integration.py)
# Agent tests that wait on the Batch API's worker, on plans applied through the mesh and on the
# CLI's views of a mesh, and the engines' KV-cache events (a simulated engine's, through an
# agent: ~40 s that had made the agents lane, the run's length, longer): a queued lane.
LATE_AGENTS=(tests/system/test_batch_api.py tests/system/test_batch_cli.py
    tests/system/test_plan_apply.py tests/system/test_cli.py
    tests/system/test_simengine_kv_events.py tests/system/test_kv_events_agent.py)
# The smoke runs of the benches that drive real agents: a queued lane.
BENCH_AGENTS=(tests/system/test_bench_tiers.py tests/system/test_bench_routing.py)
# The elastic controller's tests wait out Slurm time limits, takeovers and ramps (most of
# tests/slurm's time, at a fifth of a core): a Slurm of their own, beside the rest of tests/slurm.
# The load jump's test (a six-GPU Slurm of its own) too: in the slurm lane it made that lane end
# second, and the interpreted rerun, which follows the first lane to end, two minutes later.
SLURM_ELASTIC=(tests/slurm/test_elastic.py tests/slurm/test_elastic_qos.py
    tests/slurm/test_dashboard_controller.py)
# The load jump (a six-GPU Slurm of its own): five simulated engines must keep their pace, which
# a machine running five lanes besides slows (beside the setup and four lanes, first tokens of
# 14 s where 2 s is usual): the queue's last lane, compiled, when most lanes have ended.
SLURM_JUMP=(tests/slurm/test_elastic_jump.py)
SLURM=(tests/slurm)
# The emulated sites (tests/support/sites.py), and the agent tests of sites and federation
# (agents of several sites and meshes, gateways): a queued lane.
SITES_AGENTS=(tests/system/test_sites.py tests/system/test_federation.py
    tests/system/test_residency.py tests/system/test_cross_site.py
    tests/system/test_cross_site_state.py tests/system/test_push_across_sites.py)
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

ignoring() { # ignoring PATH...: pytest's --ignore for each
    local path
    for path in "$@"; do printf -- '--ignore=%s\n' "$path"; done
}
mapfile -t late_ignored < <(ignoring "${LATE_AGENTS[@]}" "${TAIL_AGENTS[@]}" \
    "${BENCH_AGENTS[@]}" "${SITES_AGENTS[@]}")
mapfile -t elastic_ignored < <(ignoring "${SLURM_ELASTIC[@]}" "${SLURM_JUMP[@]}")
mapfile -t compute_ignored < <(ignoring "${COMPUTE_TAIL[@]}")

# The queued lanes, longest first: each starts in the place of the next lane to end.
run_compute_tail() { lane compute-tail -- "${COMPUTE_TAIL[@]}"; }
run_agents_late() { lane agents-late -- -m "not compute" "${LATE_AGENTS[@]}"; }
run_agents_tail() { lane agents-tail -- -m "not compute" "${TAIL_AGENTS[@]}"; }
run_sites() { lane sites -- "${SITES[@]}"; }
run_agents_benches() { lane agents-benches -- -m "not compute" "${BENCH_AGENTS[@]}"; }
run_compute_system() { lane compute-system -- -m compute "${AGENTS[@]}"; }
run_browser() { lane browser -- "${BROWSER[@]}"; }
run_slurm_jump() { lane slurm-jump -- "${SLURM_JUMP[@]}"; }
QUEUE=(compute-tail agents-late agents-tail sites agents-benches compute-system browser
    slurm-jump)

declare -A in_slot=() # a place -> the lane in it now (ended when its status file is there)
setup_failed=0
# The lane that needs nothing of the setup (interpreted) first: beside it when there is one.
lane interpreted FABRIC_NATIVE=0 -- "${DATAPLANE_TESTS[@]}" &
in_slot[interpreted]=interpreted
if [ -n "${LANES_SETUP:-}" ]; then
    # A failed setup (lint, types) fails the run, but every lane still runs: one run tells all.
    bash -c "$LANES_SETUP" || setup_failed=1
    echo "== setup done after $(($(date +%s) - started)) s (exit status: $setup_failed)"
fi
lane slurm-elastic -- "${SLURM_ELASTIC[@]}" &
in_slot[slurm-elastic]=slurm-elastic
lane compute -- "${compute_ignored[@]}" "${COMPUTE[@]}" &
in_slot[compute]=compute
lane agents -- -m "not compute" "${late_ignored[@]}" "${AGENTS[@]}" &
in_slot[agents]=agents
lane slurm -- "${elastic_ignored[@]}" "${SLURM[@]}" &
in_slot[slurm]=slurm

# `wait -n` does not know a job that ended before it was called: a place is free when the
# status file of its lane is there.
after=()
while [ ${#QUEUE[@]} -gt 0 ]; do
    free=""
    for place in "${!in_slot[@]}"; do
        if [ -f "$WORK/${in_slot[$place]}.status" ]; then
            free=$place
            break
        fi
    done
    if [ -z "$free" ]; then
        wait -n 2>/dev/null || sleep 1
        continue
    fi
    next=${QUEUE[0]}
    QUEUE=("${QUEUE[@]:1}")
    "run_${next//-/_}" &
    after+=("$next after ${in_slot[$free]}")
    in_slot[$free]=$next
done
wait

LANES=(slurm-elastic interpreted compute agents slurm compute-tail agents-late agents-tail sites
    agents-benches compute-system browser slurm-jump)
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
echo "== queued lanes: $(IFS=,; echo "${after[*]}" | sed 's/,/, /g')"
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
