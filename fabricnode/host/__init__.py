"""Facts about the machine and the Slurm job the agent runs in, and the rendezvous file.

Owns what the agent learns from its host: the GPUs this job may use (``nvidia-smi`` and the
visible-device variables), the Slurm job and when it ends, when to leave before that end, and
the rendezvous file through which agents in different jobs find each other. Parsing is pure
and takes an injectable ``Runner``, so it is tested without GPUs or Slurm; ``hostcmd`` is the
one place that runs a host command.

May import: ``fabricnode.mesh`` (the registry's ``Hardware`` record, the gossip service the
rendezvous watcher bootstraps), ``fabricnode.errors``,
``fabricnode.addr`` and itself. Not the data plane, ``engine``, ``control`` or ``agent``; the
environment reaches it as a mapping passed in (only ``fabricnode.config`` reads it).

Modules, in reading order:

* ``hostcmd``     run a short host command (``nvidia-smi``, ``scontrol``), tolerate its absence.
* ``hardware``    GPU discovery in the registry's catalogue names; ``--sim-gpu``.
* ``slurm``       the Slurm job's facts, id and end time; when to leave (``plan_leave``,
                  ``move_leave``); the ``sbatch`` command line of ``fabric slurm submit``.
* ``lease``       ``follow_job``: the registry lease cap and the agent's leave time follow the
                  job's end when an admin extends or shortens the time limit (trio).
* ``rendezvous``  the shared rendezvous file (append, read, compact), and ``watch``, which
                  re-reads it while the agent knows no reachable member (trio).

docs/researcher-guide.md and docs/operators.md describe the rendezvous file and Slurm jobs.
"""
