"""The dashboard's Controller view against a real elastic controller on a real Slurm: opened
on the ingress (which runs no controller), it finds the acting controller, asks it, and shows
the model's target against its replicas and the controller's decisions with their Slurm jobs.
Writes controller.png with the other screenshots (tests/browser)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.browser.test_dashboard import texts, wait_for
from tests.support.browser import console_errors, screenshot
from tests.support.elasticmesh import Elastic, elastic_mesh
from tests.support.meshview import fabric
from tests.support.slurmcluster import SlurmCluster

MODEL = "sim-dashboard"
SERVICE = f"""
[limits]
max_jobs = 2
max_gpus = 2

[[model]]
name = "{MODEL}"
engine = "sim"
gpus_per_replica = 1
min_replicas = 1
max_replicas = 1
partitions = ["high"]
time_limit = "5:00"
ttft_p95 = "2s"
"""


@pytest.fixture(scope="module")
def elastic(
    slurm_cluster: SlurmCluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Elastic]:
    with elastic_mesh(slurm_cluster, tmp_path_factory.mktemp("ui-elastic")) as elastic:
        yield elastic


def test_the_controller_view_shows_targets_replicas_and_decisions(
    chromium: Any, elastic: Elastic, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    service = tmp_path / "services.toml"
    service.write_text(SERVICE)
    done = fabric(elastic.mesh, elastic.ingress, "services", "apply", str(service))
    assert done.returncode == 0, done.stdout + done.stderr
    page = chromium
    console_errors(page)
    page.get(f"{elastic.ingress.http_url}/ui#/controller")
    row = f'#controller-detail tr[data-model="{MODEL}"]'

    def serving(d: Any) -> bool:
        cells = texts(d, f"{row} td")
        return len(cells) == 8 and cells[1] == "1" and cells[2] == "1"

    wait_for(page, serving, 120, "the model's one replica serving, on the controller view")
    text = page.find_element("id", "controller-detail").text
    assert "submit" in text  # the decision that started the replica, with its reason
    assert "acting controller" in text
    shots = os.environ.get("FABRIC_SCREENSHOTS")
    screenshot(page, Path(shots) / "controller.png" if shots else tmp_path / "controller.png")

    # The Models view shows the objective the service file declares.
    page.get(f"{elastic.ingress.http_url}/ui#/models")
    wait_for(
        page,
        lambda d: texts(d, f'[data-model="{MODEL}"] [data-figure="objective"]') == ["2.00 s"],
        30,
        "the TTFT objective on the model's card",
    )
    assert console_errors(page) == []
