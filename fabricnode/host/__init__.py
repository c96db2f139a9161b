"""Facts about the machine and the Slurm job the agent runs in, and the rendezvous file.

Owns what the agent learns from its host: the GPUs this job may use (``nvidia-smi`` and the
visible-device variables), the Slurm job and when it ends, when to leave before that end, and
the rendezvous file through which agents in different jobs find each other. Parsing is pure
and takes an injectable ``Runner``, so it is tested without GPUs or Slurm; ``hostcmd`` is the
one place that runs a host command.

May import: ``fabricnode.mesh`` (the registry's ``Hardware`` record), ``fabricnode.errors``,
``fabricnode.addr`` and itself. Not the data plane, ``engine``, ``control`` or ``agent``; the
environment reaches it as a mapping passed in (only ``fabricnode.config`` reads it).

Modules, in reading order:

* ``hostcmd``     run a short host command (``nvidia-smi``, ``scontrol``), tolerate its absence.
* ``hardware``    GPU discovery in the registry's catalogue names; ``--sim-gpu``.
* ``slurm``       the Slurm job's facts, id and end time; when to leave (``plan_leave``); the
                  ``sbatch`` command line of ``fabric slurm submit``. (The agent keeps the
                  lease: it leaves before the job ends and follows time-limit changes.)
* ``rendezvous``  the shared rendezvous file (append, read, compact); the agent polls it while
                  it knows no reachable member.

docs/researcher-guide.md and docs/operators.md describe the rendezvous file and Slurm jobs.
"""
