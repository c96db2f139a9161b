"""`fabric plan` from files, as a real process: a node-shaped inventory keeps one engine per node
and `--json` names the node of every replica; the overload line names every model's share."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

# 3 nodes x 4 A100-80G and two models whose best pooled placement splits a node between them
# (tests/unit/scheduler/test_nodes.py shows it does).
NODES = """
[[nodes]]
gpu = "A100-80G"
count = 3
gpus = 4
"""

WORKLOAD = """
[[model]]
name = "llama-3.1-8b"
rate = 60
input_mean = 800
output_mean = 200
input_std = 200
output_std = 60

[[model]]
name = "llama-2-13b"
rate = 20
input_mean = 600
output_mean = 300
input_std = 200
output_std = 100
"""


def plan(
    tmp_path: Path, inventory: str, workload: str, *args: str
) -> subprocess.CompletedProcess[str]:
    (tmp_path / "inventory.toml").write_text(inventory)
    (tmp_path / "workload.toml").write_text(workload)
    return subprocess.run(
        [sys.executable, "-m", "cli.main", "plan", "--inventory", str(tmp_path / "inventory.toml"),
         "--workload", str(tmp_path / "workload.toml"), "--time-limit", "3", *args],
        capture_output=True, text=True, timeout=120, env={"PATH": "/usr/bin:/bin",
        "FABRIC_HOME": str(tmp_path)},
    )  # fmt: skip


def test_node_inventory_gives_each_node_one_engine_and_json_names_the_nodes(
    tmp_path: Path,
) -> None:
    done = plan(tmp_path, NODES, WORKLOAD, "--json")
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    assert doc["pools"] == [
        {"pool": "A100-80G", "gpu": "A100-80G", "nodes": 3, "gpus_per_node": 4, "shared": False}
    ]
    engines = doc["nodes"]
    assert Counter(e["node"] for e in engines) == {f"A100-80G#{i}": 1 for i in range(3)}
    for e in engines:
        assert e["tp"] * e["dp"] == e["node_gpus"] == 4
    assert {e["model"] for e in engines} == {"llama-3.1-8b", "llama-2-13b"}
    for row in doc["allocations"]:  # every replica's node, per allocation
        mine = [e for e in engines if e["model"] == row["model"]]
        assert row["nodes"] == [e["node"] for e in mine]
        assert row["dp"] == sum(e["dp"] for e in mine)

    shared = plan(tmp_path, NODES + "shared = true\n", WORKLOAD, "--json")
    assert shared.returncode == 0, shared.stderr
    per_node = Counter(e["node"] for e in json.loads(shared.stdout)["nodes"])
    assert max(per_node.values()) == 2  # allowed to share, the plan does


def test_overload_is_one_line_naming_each_models_share(tmp_path: Path) -> None:
    heavy = WORKLOAD.replace("rate = 60", "rate = 600").replace("rate = 20", "rate = 200")
    done = plan(tmp_path, NODES, heavy)
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stdout.splitlines() if line.startswith("overloaded: ")]
    assert len(lines) == 1, done.stdout
    assert "llama-3.1-8b" in lines[0] and "llama-2-13b" in lines[0] and "req/s short" in lines[0]
    assert "placement (fair mode" in done.stdout
    assert "NODES" in done.stdout and "A100-80G#0" in done.stdout


def test_a_bad_nodes_entry_is_one_line_on_stderr(tmp_path: Path) -> None:
    done = plan(tmp_path, NODES.replace("gpus = 4", "gpus = 0"), WORKLOAD)
    assert done.returncode != 0
    assert "nodes #1: gpus must be an integer >= 1" in done.stderr
    assert "Traceback" not in done.stderr
