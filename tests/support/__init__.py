"""Helpers shared by the tests: importable as ``tests.support`` (pytest puts the repo on sys.path).

* ``meshview``     read a running agent's registry, metrics and ports (free_port, ENTRY_KEYS).
* ``meshload``     drive load through a local mesh; find the processes an agent started.
* ``slurmcluster`` a throw-away single-node Slurm (slurmctld, slurmd, munge) for tests/slurm;
                   its accounting mode adds slurmdbd and MariaDB (QoS and account limits).
* ``elasticmesh``  an ingress and two elastic controllers on such a cluster (tests/slurm).
* ``sites``        emulated sites: a network namespace per node, a bridge and a subnet per site,
                   a WAN between the sites' gateways with delay, jitter, loss, bandwidth and
                   cuts (tests/sites); ``wandelay`` is its WAN router (script).
* ``stub_engine``  a tiny OpenAI-ish server run as a child engine (script).
* ``make_tiny_model`` builds a random-weight model for the real-vLLM test (script).
* ``vllm_cpu``     where the CPU build of vLLM lives and the environment it runs in.
"""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SUPPORT = Path(__file__).resolve().parent
