"""The test suite, by kind: each kind is a folder, and a package's tests sit under its name.

* ``unit/<package>/``   pure tests of one package (``mesh``, ``dataplane``, ``engine``, ``host``,
                        ``control``, ``simengine``, ``scheduler``, ``cli``): no sockets, no
                        subprocesses, no real time (trio only under ``MockClock``);
                        Hypothesis for the laws and the parsers.
* ``shell/<package>/``  trio services in process: real sockets on 127.0.0.1 or the seeded
                        fake network under ``MockClock``, no agent subprocess.
* ``system/``           real agents as subprocesses (``cli.localmesh.LocalMesh``, the ``mesh``
                        fixture of ``tests/conftest.py``), with simulated or stub engines;
                        most are marked ``slow``.
* ``slurm/``            a real single-node Slurm (``tests.support.slurmcluster``) and a real
                        vLLM on CPU; they skip with the reason when Slurm or the vLLM venv is
                        missing (``FABRIC_SKIP_SLURM=1``, ``FABRIC_SKIP_VLLM=1``).
* ``support/``          helpers, importable as ``tests.support.*``; no tests.

Run one kind (``make test`` runs lint, types and every kind)::

    .venv/bin/pytest tests/unit                    # or tests/shell, tests/system, tests/slurm
    .venv/bin/pytest tests/unit/mesh -k registry   # one package, tests matching a name
    FABRIC_NATIVE=0 .venv/bin/pytest tests/unit/dataplane   # the data plane interpreted

CONTRIBUTING.md says which kind a new test belongs to.
"""
