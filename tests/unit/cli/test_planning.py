"""`fabric plan` on the mesh: nodes serving a model directory (their served id is its path) plan
from that directory's config.json, with no catalog file."""

from __future__ import annotations

from pathlib import Path
from types import TracebackType
from typing import Any

import pytest

from cli.planning import mesh_view, mesh_workloads
from scheduler.catalog import builtin_catalog
from scheduler.errors import WorkloadError
from tests.support.hf_configs import LLAMA_2_13B_CHAT_AWQ, model_dir


class FakeAgent:
    """The one admin call mesh_workloads makes: an agent's request-log sums."""

    def __init__(self, models: dict[str, dict[str, float]]) -> None:
        self.models = models

    def __enter__(self) -> FakeAgent:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        return None

    def workload(self, window_s: float) -> dict[str, Any]:
        return {"models": self.models}


def node(session_id: str, served: str | None) -> dict[str, Any]:
    return {
        "session_id": session_id,
        "liveness": "alive",
        "state": "serving" if served else "join",
        "hardware": {"gpu_type": "A100-80G", "gpu_count": 2},
        "models": [{"id": served}] if served else [],
        "addresses": {"http": f"http://{session_id}.invalid"},
    }


def test_served_model_directories_plan_from_their_config_json(tmp_path: Path) -> None:
    directory = model_dir(tmp_path / "shared", "Llama-2-13B-chat-AWQ", LLAMA_2_13B_CHAT_AWQ)
    nodes = [node("a" * 32, f"{directory}/"), node("b" * 32, None), node("c" * 32, "/gone/x-7b")]
    catalog = builtin_catalog()

    view = mesh_view(nodes, catalog)
    assert view.inventory == {"A100-80G": 4}  # the node serving an unknown model is left out
    assert view.nodes[0].models == (str(directory),)
    assert view.notes == ("2 GPUs left out: their nodes serve models not in the catalog",)

    sums = {"requests": 120.0, "measured": 120.0, "input_sum": 120_000.0, "output_sum": 24_000.0}
    agents = {n["addresses"]["http"]: FakeAgent({f"{directory}/": sums}) for n in nodes}
    loads, notes = mesh_workloads(nodes[:1], 60.0, catalog, client_for=agents.__getitem__)
    assert [(w.model, w.rate_rps, w.input_mean) for w in loads] == [(str(directory), 2.0, 1000.0)]
    assert notes == []
    assert catalog.model(loads[0].model).weight_bits == 4


def test_a_served_directory_with_a_broken_config_json_is_named_with_its_error(
    tmp_path: Path,
) -> None:
    broken = tmp_path / "shared" / "half-copied"
    broken.mkdir(parents=True)
    (broken / "config.json").write_text('{"hidden_size": 4096')
    nodes = [node("a" * 32, str(broken)), node("b" * 32, None)]
    catalog = builtin_catalog()
    view = mesh_view(nodes, catalog)
    assert view.inventory == {"A100-80G": 2}
    assert any("config.json" in n and "JSON" in n for n in view.notes), view.notes
    sums = {"requests": 60.0, "measured": 60.0, "input_sum": 6_000.0, "output_sum": 600.0}
    agents = {n["addresses"]["http"]: FakeAgent({str(broken): sums}) for n in nodes}
    # its traffic was the only traffic: the error says why it was left out
    with pytest.raises(WorkloadError, match=r"no workload.*traffic for .*half-copied.*JSON"):
        mesh_workloads(nodes[:1], 60.0, catalog, client_for=agents.__getitem__)
