"""A throw-away single-node Slurm cluster for the tests that need a real Slurm.

``SlurmCluster`` runs munged, slurmctld and slurmd (as root, from Debian's packages, installed
with apt when missing) with everything under one directory and no systemd::

    ROOT/etc/      slurm.conf, gres.conf, an empty plugstack.conf (cgroup.conf from 23.02),
                   slurmdbd.conf (mode 600; the accounting mode)
    ROOT/munge/    munge.key, munge.socket.2 (dir mode 711), pid and seed files
    ROOT/state/    slurmctld's StateSaveLocation
    ROOT/spool/    slurmd's SlurmdSpoolDir
    ROOT/dev/      the fake GPUs: character devices 1:3 like /dev/null (or links to it)
    ROOT/mariadb/  the accounting mode's database: data/, mariadbd.sock, mariadbd.pid
    ROOT/logs/     munged.log, slurmctld.log, slurmd.log (slurmdbd.log, mariadbd.log) and the
                   jobs' slurm-<id>.out
    ROOT/jobs/     batch scripts submitted as text
    ROOT/owner     pid and start time of the process that owns the cluster

ROOT's name contains ``fabric-slurmcluster``, and every daemon carries ROOT in its argv and
(as ``SLURM_CONF``) in its environment, which slurmstepd and the jobs inherit. That is how
clean-up finds them without ever touching a system Slurm: ``close()`` cancels every job, stops
the daemons by pid, then SIGKILLs whatever still mentions ROOT; ``kill_stale_clusters()`` (run
before each start) SIGKILLs the processes of clusters whose owner is gone (a crashed run).

The cluster (slurm.conf written by ``SlurmCluster.slurm_conf``):

* one node ``localhost`` (``slurmd -N localhost``: the host's own name differs) at 127.0.0.1,
  declared with ``cpus`` CPUs (8) and ``gpus`` fake GPUs (4) whatever the machine has
  (``SlurmdParameters=config_overrides``); ``select/cons_tres`` with ``CR_CPU``, so a default
  one-CPU job takes one of the 8 and several run at once on a 2-core machine;
* partition ``low`` (default, ``PriorityTier=1``, ``PreemptMode=CANCEL``,
  ``GraceTime=grace_time_s``) and partition ``high`` (``PriorityTier=10``, never preempted);
  ``PreemptType=preempt/partition_prio``: a ``high`` job that needs resources held by ``low``
  jobs cancels them; their steps (not the batch shell) get SIGTERM within about a second, and
  a job still running after ``grace_time_s`` is killed at the next time-limit check (below);
* quick: ``KillWait=kill_wait_s`` (5 s from SIGTERM to SIGKILL), scheduling at once on every
  event (``batch_sched_delay=0``) and a backfill pass every 2 s (``bf_interval=2``);
  ``MinJobAge=60`` keeps a finished job's record (and final state) a minute;
* no accounting (but see below), no cgroups: ``proctrack/linuxproc``, ``task/none``,
  ``jobacct_gather/none`` (``AccountingStorageTRES=gres/gpu`` without slurmdbd kills slurmctld:
  not set); no MPI.

slurmctld checks time limits (sending ``--signal`` warnings, ending grace times) every 30 s,
and the smallest time limit is one minute: ``--time=1 --signal=TERM@N`` signals the steps
60-N to 90-N s after the job starts, and the job is killed 60 to 90 s after it starts.

The accounting mode (``SlurmClusterConfig(accounting=True)``, fixture
``slurm_accounting_cluster``) adds what QoS and account limits need; ``install_slurm`` then
installs ``slurmdbd`` and ``mariadb-server`` too (about 13 s on a fresh bookworm machine; the
package scripts start no server). ``start`` takes about 5 s instead of 1:

* MariaDB: ``mariadb-install-db`` into ROOT/mariadb/data (0.5 s), then ``mariadbd
  --no-defaults`` on 127.0.0.1 and a free port, its own socket and pid file, as root only with
  ``--user=root`` when run as root, ``--skip-grant-tables`` (any user, no password: a throw-away
  database), InnoDB sized just enough that slurmdbd does not complain ("Database settings not
  recommended values");
* slurmdbd (``StorageType=accounting_storage/mysql``) on another free port, and slurmctld with
  ``AccountingStorageType=accounting_storage/slurmdbd``, ``AccountingStorageEnforce=limits,qos``
  (limits implies associations: a job needs an account its user belongs to) and
  ``AccountingStoragePass`` naming the cluster's munge socket (the connections to slurmdbd do
  not use ``AuthInfo``);
* with ``sacctmgr -i``, before slurmctld starts (it loads them): cluster ``fabrictest``, account
  ``fabric`` (the user's default), the user with QoS ``normal`` (its default, no limit) and
  ``single`` (``MaxSubmitJobsPerUser=1``: sbatch refuses a second job at submission, "Job
  violates accounting/QOS policy (job submit limit, user's size and/or time limits)");
  ``ACCOUNTING_QOS`` lists them;
* ``start`` returns once ``sacctmgr show cluster`` lists slurmctld's port (it registered);
  ``close`` stops slurmdbd and mariadbd with the rest and removes ROOT/mariadb (~80 MB).

Each cluster has its own ROOT and ports and every process carries its ROOT: the session's
``slurm_cluster`` and a module's ``slurm_accounting_cluster`` may be up at once.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import re
import shutil
import signal
import socket
import stat
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.debian import InstallError, Unavailable, install_packages, tail

SLURM_PACKAGES = ("munge", "slurmctld", "slurmd", "slurm-client")
SLURM_COMMANDS = (
    "munged",
    "slurmctld",
    "slurmd",
    "sbatch",
    "srun",
    "scancel",
    "scontrol",
    "sinfo",
    "squeue",
)
# The accounting mode's extras: slurmdbd and a MariaDB server for it (SlurmClusterConfig).
ACCOUNTING_PACKAGES = ("slurmdbd", "mariadb-server")
ACCOUNTING_COMMANDS = ("slurmdbd", "sacctmgr", "mariadbd", "mariadb-install-db")
MARKER = "fabric-slurmcluster"
NODE = "localhost"
CLUSTER_NAME = "fabrictest"
ACCOUNT = "fabric"
# The accounting mode's QoS and their limits (sacctmgr words); the user may use both, the first
# is its default. "single" lets a user have one job submitted at a time: sbatch refuses the next.
ACCOUNTING_QOS = {"normal": "", "single": "MaxSubmitJobsPerUser=1"}
SEARCH_PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin", "/usr/bin"])
# Errors every run logs: no PMIx library (MPI is off), no state on a first start, cancellations.
BENIGN_LOG_LINE = re.compile(r"pmix|state file|backup state save|\*\*\* (JOB|STEP) .* CANCELLED AT")


class SlurmUnavailable(Exception):
    """Slurm cannot be installed here at all (not root, no apt, no Debian mirror)."""


class SlurmError(Exception):
    """A Slurm daemon or command failed; the message carries the relevant log lines."""


@dataclass(frozen=True)
class SlurmClusterConfig:
    cpus: int = 8
    real_memory_mb: int = 8192
    gpus: int = 4
    grace_time_s: int = 10
    kill_wait_s: int = 5
    min_job_age_s: int = 60
    message_timeout_s: int = 10
    debug: str = "info"
    # slurmdbd + MariaDB, limits enforced, the QoS of ``ACCOUNTING_QOS`` (the module docstring)
    accounting: bool = False


# ---------------------------------------------------------------------------------------------
# Installing


def missing_commands(*, accounting: bool = False) -> list[str]:
    wanted = SLURM_COMMANDS + (ACCOUNTING_COMMANDS if accounting else ())
    return [c for c in wanted if shutil.which(c, path=SEARCH_PATH) is None]


def packages(*, accounting: bool = False) -> tuple[str, ...]:
    """The Debian packages ``install_slurm`` installs (with the accounting mode's or not)."""
    return SLURM_PACKAGES + (ACCOUNTING_PACKAGES if accounting else ())


def slurm_version() -> tuple[int, int, str]:
    """(major, minor, full text) of the installed slurmctld, e.g. (22, 5, "slurm-wlm 22.05.8")."""
    out = subprocess.run(
        [_which("slurmctld"), "-V"], capture_output=True, text=True, timeout=30, check=True
    ).stdout.strip()
    found = re.search(r"(\d+)\.(\d+)", out)
    if found is None:
        raise SlurmError(f"cannot read the Slurm version from {out!r}")
    return int(found[1]), int(found[2]), out


def install_slurm(
    *, accounting: bool = False, attempts: int = 3, lock_timeout_s: float = 1200
) -> float:
    """Install Slurm and munge with apt if a command is missing; the seconds it took (0 if none).

    ``accounting`` adds slurmdbd and MariaDB (``ACCOUNTING_PACKAGES``). Raises SlurmUnavailable
    when it cannot be done here (not root, no apt-get, the Debian mirrors unreachable) and
    SlurmError when apt itself fails (``debian.install_packages``: one install at a time across
    processes, ``apt-get update`` once per attempt, retried with a pause).
    """
    try:
        return install_packages(
            packages(accounting=accounting),
            lambda: missing_commands(accounting=accounting),
            attempts=attempts,
            lock_timeout_s=lock_timeout_s,
        )
    except Unavailable as exc:
        raise SlurmUnavailable(f"Slurm is not installed: {exc}") from None
    except InstallError as exc:
        raise SlurmError(str(exc)) from None


def _which(command: str) -> str:
    found = shutil.which(command, path=SEARCH_PATH)
    if found is None:
        raise SlurmError(f"{command} is not installed")
    return found


# ---------------------------------------------------------------------------------------------
# Processes: what mentions a cluster's root, and clusters left behind


def _start_time(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _mentions(pid: int) -> bytes:
    """The argv and environment of ``pid`` (empty if gone or a zombie)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        if state in ("Z", "X"):
            return b""
        return Path(f"/proc/{pid}/cmdline").read_bytes() + Path(f"/proc/{pid}/environ").read_bytes()
    except (OSError, IndexError):
        return b""


def _other_pids() -> Iterator[int]:
    me = os.getpid()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != me:
            yield int(entry.name)


def processes_under(root: Path) -> list[int]:
    """Live processes (not this one) whose argv or environment mentions ``root``."""
    needle = os.fsencode(str(root))
    return [pid for pid in _other_pids() if needle in _mentions(pid)]


def _owner_alive(root: Path) -> bool:
    try:
        pid, start = (root / "owner").read_text().split()
    except (OSError, ValueError):
        return False
    return _start_time(int(pid)) == start


def kill_stale_clusters() -> list[int]:
    """SIGKILL the processes of clusters whose owner is gone; their pids.

    A process belongs to a cluster when its argv or environment names ``ROOT/etc/slurm.conf``
    or ``ROOT/munge/munge.*`` with ``fabric-slurmcluster`` in ROOT's name; the cluster is stale
    when ``ROOT/owner`` is missing or names a process that no longer exists.
    """
    pattern = re.compile(
        rb"(/[^\0\s:=]*?/" + MARKER.encode() + rb"[^/\0\s:=]*)/(?:etc/slurm\.conf|munge/munge\.)"
    )
    stale: list[int] = []
    verdicts: dict[bytes, bool] = {}
    for pid in _other_pids():
        for root in set(pattern.findall(_mentions(pid))):
            if root not in verdicts:
                verdicts[root] = _owner_alive(Path(os.fsdecode(root)))
            if not verdicts[root]:
                stale.append(pid)
                break
    _kill_and_reap(stale)
    return stale


def _kill_and_reap(pids: Iterable[int], timeout_s: float = 10) -> None:
    pids = list(pids)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + timeout_s
    while any(_mentions(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)


def _accepts(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


# ---------------------------------------------------------------------------------------------
# The cluster


class SlurmCluster:
    """munged + slurmctld + slurmd under ``root``; ``start()`` then ``close()`` (or ``with``).

    Commands run with ``env``: the caller's environment without its SLURM_* variables, plus
    ``SLURM_CONF``. Jobs inherit it (``sbatch``'s default ``--export=ALL``), so ``srun`` inside
    a batch script reaches this cluster too.
    """

    def __init__(self, root: Path, config: SlurmClusterConfig | None = None) -> None:
        if MARKER not in root.name:
            raise ValueError(f"the cluster's directory name must contain {MARKER!r}: {root}")
        self.root = root.resolve()
        self.config = config or SlurmClusterConfig()
        self.etc_dir = self.root / "etc"
        self.munge_dir = self.root / "munge"
        self.state_dir = self.root / "state"
        self.spool_dir = self.root / "spool"
        self.dev_dir = self.root / "dev"
        self.logs_dir = self.root / "logs"
        self.jobs_dir = self.root / "jobs"
        self.db_dir = self.root / "mariadb"
        self.conf_path = self.etc_dir / "slurm.conf"
        self.dbd_conf_path = self.etc_dir / "slurmdbd.conf"  # read from SLURM_CONF's directory
        self.munge_socket = self.munge_dir / "munge.socket.2"
        self.ctld_port = 0
        self.slurmd_port = 0
        self.dbd_port = 0
        self.db_port = 0
        self.version: tuple[int, int, str] = (0, 0, "")
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
        self.env: dict[str, str] = {**env, "SLURM_CONF": str(self.conf_path)}
        self.started_in_s = 0.0
        self._procs: dict[str, subprocess.Popen[bytes]] = {}
        self._scripts = 0

    # -- lifecycle --------------------------------------------------------------------------

    def __enter__(self) -> SlurmCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self, timeout_s: float = 30) -> None:
        """Write the configs, start the three daemons, return once the node is idle.

        In the accounting mode MariaDB and slurmdbd come first, the cluster, account, user and
        QoS are added with sacctmgr, and it returns once slurmctld has registered too.
        """
        t0 = time.monotonic()
        kill_stale_clusters()
        self.version = slurm_version()
        for d in (self.etc_dir, self.state_dir, self.spool_dir, self.dev_dir, self.logs_dir):
            d.mkdir(parents=True, exist_ok=True)
        self.jobs_dir.mkdir(parents=True, exist_ok=True)
        self.munge_dir.mkdir(mode=0o711, exist_ok=True)
        self.munge_dir.chmod(0o711)  # munged insists on a socket dir others cannot write
        (self.root / "owner").write_text(f"{os.getpid()} {_start_time(os.getpid())}\n")
        key = self.munge_dir / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        gpu_files = self._make_gpu_devices()
        self.ctld_port, self.slurmd_port = _free_port(), _free_port()
        if self.config.accounting:
            self.dbd_port, self.db_port = _free_port(), _free_port()
        self.conf_path.write_text(self.slurm_conf())
        (self.etc_dir / "gres.conf").write_text(self.gres_conf(gpu_files))
        (self.etc_dir / "plugstack.conf").write_text("")
        if self.version[:2] >= (23, 2):  # "disabled" is new in 23.02: no cgroups, no dbus
            (self.etc_dir / "cgroup.conf").write_text("CgroupPlugin=disabled\n")
        try:
            self._spawn(
                "munged",
                "-F",
                "--force",
                f"--key-file={key}",
                f"--socket={self.munge_socket}",
                f"--pid-file={self.munge_dir / 'munged.pid'}",
                f"--seed-file={self.munge_dir / 'munged.seed'}",
                f"--log-file={self.logs_dir / 'munged.log'}",
            )
            self._wait(lambda: self.munge_socket.exists(), timeout_s, "munged's socket")
            if self.config.accounting:
                self._start_accounting(timeout_s)
            self._spawn("slurmctld", "-D", "-f", str(self.conf_path))
            self._spawn("slurmd", "-D", "-N", NODE, "-f", str(self.conf_path))
            self._wait(self._node_idle, timeout_s, f"node {NODE} idle")
            if self.config.accounting:
                self._wait(self._ctld_registered, timeout_s, "slurmctld registered in slurmdbd")
        except BaseException:
            self.close()
            raise
        self.started_in_s = time.monotonic() - t0

    def close(self) -> list[int]:
        """Cancel every job, stop the daemons, SIGKILL what is left; the pids that were left."""
        if self._alive("slurmctld"):
            with contextlib.suppress(SlurmError, subprocess.TimeoutExpired):
                self.cancel_all()
        for name in ("slurmd", "slurmctld", "slurmdbd", "mariadbd", "munged"):
            proc = self._procs.get(name)
            if proc is None:
                continue
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=10)
        self._procs.clear()
        left = processes_under(self.root)
        _kill_and_reap(left)
        shutil.rmtree(self.db_dir, ignore_errors=True)  # ~80 MB of InnoDB files
        return left

    # -- configuration ----------------------------------------------------------------------

    def slurm_conf(self) -> str:
        c = self.config
        conf = {
            "ClusterName": CLUSTER_NAME,
            "SlurmctldHost": f"{NODE}(127.0.0.1)",
            "SlurmctldPort": self.ctld_port,
            "SlurmdPort": self.slurmd_port,
            "SlurmUser": "root",
            "SlurmdUser": "root",
            "AuthType": "auth/munge",
            "CredType": "cred/munge",
            "AuthInfo": f"socket={self.munge_socket}",
            "StateSaveLocation": self.state_dir,
            "SlurmdSpoolDir": self.spool_dir,
            "SlurmctldPidFile": self.root / "slurmctld.pid",
            "SlurmdPidFile": self.root / "slurmd.pid",
            "SlurmctldLogFile": self.logs_dir / "slurmctld.log",
            "SlurmdLogFile": self.logs_dir / "slurmd.log",
            "SlurmctldDebug": c.debug,
            "SlurmdDebug": c.debug,
            "PlugStackConfig": self.etc_dir / "plugstack.conf",
            "ProctrackType": "proctrack/linuxproc",
            "TaskPlugin": "task/none",
            "JobAcctGatherType": "jobacct_gather/none",
            **self._accounting_conf(),
            "JobCompType": "jobcomp/none",
            "MpiDefault": "none",
            "ReturnToService": 2,
            "SlurmdParameters": "config_overrides",
            "SelectType": "select/cons_tres",
            "SelectTypeParameters": "CR_CPU",
            "GresTypes": "gpu",
            "SchedulerType": "sched/backfill",
            "SchedulerParameters": "bf_interval=2,batch_sched_delay=0",
            "PreemptType": "preempt/partition_prio",
            "PreemptMode": "CANCEL",
            "JobRequeue": 0,
            "KillWait": c.kill_wait_s,
            "MinJobAge": c.min_job_age_s,
            "MessageTimeout": c.message_timeout_s,
            "InactiveLimit": 0,
            "Waittime": 0,
            "OverTimeLimit": 0,
        }
        lines = [f"{k}={v}" for k, v in conf.items()]
        lines += [
            f"NodeName={NODE} NodeAddr=127.0.0.1 CPUs={c.cpus} RealMemory={c.real_memory_mb}"
            f" Gres=gpu:fake:{c.gpus} State=UNKNOWN",
            f"PartitionName=low Nodes={NODE} Default=YES MaxTime=INFINITE State=UP"
            f" PriorityTier=1 PreemptMode=CANCEL GraceTime={c.grace_time_s}",
            f"PartitionName=high Nodes={NODE} MaxTime=INFINITE State=UP"
            " PriorityTier=10 PreemptMode=OFF",
        ]
        return "\n".join(lines) + "\n"

    def _accounting_conf(self) -> dict[str, object]:
        if not self.config.accounting:
            return {"AccountingStorageType": "accounting_storage/none"}
        return {
            "AccountingStorageType": "accounting_storage/slurmdbd",
            "AccountingStorageHost": "127.0.0.1",
            "AccountingStoragePort": self.dbd_port,
            # the munge socket for slurmdbd connections (AuthInfo is not used for them)
            "AccountingStoragePass": self.munge_socket,
            # "limits" implies "associations": a job needs an account the user belongs to
            "AccountingStorageEnforce": "limits,qos",
        }

    def slurmdbd_conf(self) -> str:
        conf = {
            "AuthType": "auth/munge",
            "AuthInfo": f"socket={self.munge_socket}",
            "DbdHost": NODE,
            "DbdAddr": "127.0.0.1",
            "DbdPort": self.dbd_port,
            "SlurmUser": "root",
            "PidFile": self.root / "slurmdbd.pid",
            "LogFile": self.logs_dir / "slurmdbd.log",
            "DebugLevel": self.config.debug,
            "StorageType": "accounting_storage/mysql",
            "StorageHost": "127.0.0.1",
            "StoragePort": self.db_port,
            "StorageUser": "slurm",  # any name: the server skips its grant tables
            "StoragePass": "unused",
            "StorageLoc": "slurm_acct_db",
        }
        return "".join(f"{k}={v}\n" for k, v in conf.items())

    def gres_conf(self, gpu_files: Sequence[Path]) -> str:
        lines = ["AutoDetect=off"]
        lines += [f"NodeName={NODE} Name=gpu Type=fake File={f}" for f in gpu_files]
        return "\n".join(lines) + "\n"

    def _make_gpu_devices(self) -> list[Path]:
        files = []
        for i in range(self.config.gpus):
            dev = self.dev_dir / f"fakegpu{i}"
            if not dev.exists():
                try:
                    os.mknod(dev, stat.S_IFCHR | 0o666, os.makedev(1, 3))  # like /dev/null
                except OSError:  # no CAP_MKNOD, or a nodev mount: a link to one will do
                    dev.symlink_to("/dev/null")
            files.append(dev)
        return files

    # -- commands ---------------------------------------------------------------------------

    def run(
        self, command: str, *args: str, check: bool = True, timeout_s: float = 30
    ) -> subprocess.CompletedProcess[str]:
        """A Slurm command against this cluster; SlurmError (with its stderr) if it fails."""
        if command in ("sinfo", "squeue", "scontrol", "sbatch", "scancel") and not self._alive(
            "slurmctld"
        ):  # they would block for MessageTimeout against a dead controller
            raise SlurmError(f"slurmctld is not running: {self.log_tail('slurmctld')}")
        done = subprocess.run(
            [_which(command), *args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
            stdin=subprocess.DEVNULL,
        )
        if check and done.returncode != 0:
            raise SlurmError(f"{command} {' '.join(args)}: {done.stderr.strip() or done.stdout}")
        return done

    def sbatch(
        self,
        script: str | Path,
        *options: str,
        args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
    ) -> int:
        """Submit a batch job; its id. ``script`` is the script's text or an existing file.

        ``options`` go to sbatch (``"-p", "high"``, ``"--gres=gpu:2"``...), ``args`` to the
        script, ``env`` on top of ``self.env``. Output goes to ``output_path(job_id)`` unless
        ``options`` set ``-o``/``--output``.
        """
        if isinstance(script, str):
            self._scripts += 1
            path = self.jobs_dir / f"script-{self._scripts}.sh"
            path.write_text(script if script.startswith("#!") else "#!/bin/bash\n" + script)
            path.chmod(0o755)
        else:
            path = script
        argv = ["--parsable", *options]
        if not any(o in ("-o", "--output") or o.startswith("--output=") for o in options):
            argv.append(f"--output={self.logs_dir / 'slurm-%j.out'}")
        argv += [str(path), *args]
        if not self._alive("slurmctld"):
            raise SlurmError(f"slurmctld is not running: {self.log_tail('slurmctld')}")
        done = subprocess.run(
            [_which("sbatch"), *argv],
            env={**self.env, **(env or {})},
            cwd=cwd or self.jobs_dir,
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
            stdin=subprocess.DEVNULL,
        )
        if done.returncode != 0:
            raise SlurmError(f"sbatch {' '.join(argv)}: {done.stderr.strip()}")
        return int(done.stdout.strip().split(";")[0])

    def scancel(self, job_id: int, *options: str, signal: str | None = None) -> None:
        """Cancel the job, or send it ``signal`` (a name: "TERM", "USR1"); ``options`` such as
        ``"--batch"`` or ``"--full"`` choose who gets it."""
        sig = () if signal is None else (f"--signal={signal}",)
        self.run("scancel", *sig, *options, str(job_id))

    def cancel_all(self) -> None:
        """Cancel every job and wait until none is left pending, running or completing."""
        jobs = self.job_ids()
        if jobs:
            self.run("scancel", *map(str, jobs), check=False)
            self._wait(lambda: not self.job_ids(), self.config.kill_wait_s + 15, "jobs to end")

    def job(self, job_id: int) -> dict[str, str] | None:
        """``scontrol show job`` as a dict, or None once the job's record is gone."""
        done = self.run("scontrol", "show", "job", "-o", str(job_id), check=False)
        if done.returncode != 0:
            if "Invalid job id" in done.stderr:
                return None
            raise SlurmError(f"scontrol show job {job_id}: {done.stderr.strip()}")
        return parse_record(done.stdout)

    def job_state(self, job_id: int) -> str | None:
        """JobState (``PENDING``, ``RUNNING``, ``COMPLETED``, ``CANCELLED``, ``PREEMPTED``,
        ``TIMEOUT``...), or None once the job's record is gone (``MinJobAge`` after its end)."""
        record = self.job(job_id)
        return None if record is None else record.get("JobState")

    def squeue(self, *options: str) -> list[dict[str, str]]:
        """Jobs in the queue: id, partition, name, state, reason."""
        done = self.run("squeue", "-h", "-o", "%i|%P|%j|%T|%r", *options)
        keys = ("JobId", "Partition", "Name", "State", "Reason")
        return [dict(zip(keys, line.split("|"), strict=False)) for line in done.stdout.splitlines()]

    def job_ids(self) -> list[int]:
        """Jobs that are pending, running or completing."""
        return [int(j["JobId"]) for j in self.squeue("-t", "PD,CF,R,CG,S")]

    def wait_state(self, job_id: int, states: str | Iterable[str], timeout_s: float = 30) -> str:
        """Wait until the job is in one of ``states``; that state. SlurmError on timeout."""
        wanted = {states} if isinstance(states, str) else set(states)
        seen: list[str | None] = [None]

        def there() -> bool:
            seen[0] = self.job_state(job_id)
            return seen[0] in wanted

        try:
            self._wait(there, timeout_s, f"job {job_id} in {sorted(wanted)}")
        except SlurmError as e:
            raise SlurmError(f"{e}; it is {seen[0]}") from None
        assert seen[0] is not None
        return seen[0]

    def output_path(self, job_id: int) -> Path:
        return self.logs_dir / f"slurm-{job_id}.out"

    def output(self, job_id: int) -> str:
        path = self.output_path(job_id)
        return path.read_text(errors="replace") if path.exists() else ""

    def log_tail(self, daemon: str, lines: int = 15) -> str:
        path = self.logs_dir / f"{daemon}.log"
        text = path.read_text(errors="replace") if path.exists() else "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def log_errors(self, daemon: str, lines: int = 8) -> str:
        """The last error (and fatal) lines of a daemon's log."""
        path = self.logs_dir / f"{daemon}.log"
        text = path.read_text(errors="replace") if path.exists() else ""
        found = [
            line
            for line in text.splitlines()
            if re.search(r"error|fatal", line, re.I) and not BENIGN_LOG_LINE.search(line)
        ]
        return "\n".join(found[-lines:])

    # -- internals --------------------------------------------------------------------------

    def _spawn(self, name: str, *args: str) -> None:
        out = open(self.logs_dir / f"{name}.stderr", "ab")  # noqa: SIM115 (the child owns it)
        try:
            self._procs[name] = subprocess.Popen(
                [_which(name), *args],
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=out,
                start_new_session=True,
            )
        finally:
            out.close()

    def _alive(self, name: str) -> bool:
        proc = self._procs.get(name)
        return proc is not None and proc.poll() is None

    def sacctmgr(self, *args: str) -> str:
        """``sacctmgr -i ARGS`` (no questions asked); its output. SlurmError if it fails."""
        return self.run("sacctmgr", "-i", *args).stdout

    def _start_accounting(self, timeout_s: float) -> None:
        """MariaDB with its own datadir, socket and port under ``root``, then slurmdbd, then
        the cluster, account, user and QoS that slurmctld loads when it starts."""
        data = self.db_dir / "data"
        shutil.rmtree(self.db_dir, ignore_errors=True)
        data.mkdir(parents=True)
        server = [
            "--no-defaults",  # first: nothing from /etc/mysql
            f"--datadir={data}",
            # the least slurmdbd does not warn about ("Database settings not recommended")
            "--innodb-log-file-size=64M",
            "--innodb-buffer-pool-size=512M",
            "--innodb-lock-wait-timeout=900",
        ]
        if os.geteuid() == 0:
            server.append("--user=root")  # mariadbd refuses to run as root unless told so
        done = subprocess.run(
            [_which("mariadb-install-db"), *server, "--skip-test-db", "--skip-name-resolve"],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
            stdin=subprocess.DEVNULL,
        )
        if done.returncode != 0:
            raise SlurmError(f"mariadb-install-db: {tail(done.stdout + done.stderr, 10)}")
        self._spawn(
            "mariadbd",
            *server,
            f"--socket={self.db_dir / 'mariadbd.sock'}",
            f"--pid-file={self.db_dir / 'mariadbd.pid'}",
            f"--log-error={self.logs_dir / 'mariadbd.log'}",
            f"--port={self.db_port}",
            "--bind-address=127.0.0.1",
            "--skip-name-resolve",
            "--skip-grant-tables",  # any user, no password: a throw-away database on 127.0.0.1
            "--skip-log-bin",
            "--innodb-flush-log-at-trx-commit=0",
            "--innodb-doublewrite=0",
        )
        self._wait(lambda: _accepts(self.db_port), timeout_s, "MariaDB accepting connections")
        self.dbd_conf_path.write_text(self.slurmdbd_conf())
        self.dbd_conf_path.chmod(0o600)  # slurmdbd insists, and that SlurmUser owns it
        self._spawn("slurmdbd", "-D")
        self._wait(self._dbd_answers, timeout_s, "slurmdbd answering")
        self.sacctmgr("add", "cluster", CLUSTER_NAME)
        for name, limits in ACCOUNTING_QOS.items():
            if name == "normal":  # slurmdbd creates it
                if limits:
                    self.sacctmgr("modify", "qos", name, "set", *limits.split())
            else:
                self.sacctmgr("add", "qos", name, *limits.split())
        qos = ",".join(ACCOUNTING_QOS)
        default_qos = next(iter(ACCOUNTING_QOS))
        self.sacctmgr("add", "account", ACCOUNT, f"Cluster={CLUSTER_NAME}")
        user = pwd.getpwuid(os.geteuid()).pw_name
        self.sacctmgr(
            "add", "user", user, f"Account={ACCOUNT}", f"Cluster={CLUSTER_NAME}",
            f"QOS={qos}", f"DefaultQOS={default_qos}",
        )  # fmt: skip
        # "add cluster" made the user a member of account root too, its default until now
        self.sacctmgr("modify", "user", user, "set", f"DefaultAccount={ACCOUNT}")

    def _dbd_answers(self) -> bool:
        done = self.run("sacctmgr", "-n", "-P", "show", "cluster", check=False, timeout_s=15)
        return done.returncode == 0

    def _ctld_registered(self) -> bool:
        """slurmdbd knows slurmctld's address: ``sacctmgr show cluster`` lists its port."""
        done = self.run(
            "sacctmgr", "-n", "-P", "show", "cluster", "format=cluster,controlport",
            check=False, timeout_s=15,
        )  # fmt: skip
        return f"{CLUSTER_NAME}|{self.ctld_port}" in done.stdout.split()

    def _node_idle(self) -> bool:
        done = self.run("sinfo", "-h", "-n", NODE, "-o", "%T", check=False, timeout_s=15)
        return done.stdout.strip() == "idle"

    def _wait(self, predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            for name in self._procs:
                if not self._alive(name):
                    raise SlurmError(
                        f"{name} exited while waiting for {what}:\n"
                        f"{self.log_tail(name)}\n{self._stderr_tail(name)}"
                    )
            if predicate():
                return
            if time.monotonic() > deadline:
                raise SlurmError(f"timed out after {timeout_s} s waiting for {what}")
            time.sleep(0.1)

    def _stderr_tail(self, name: str) -> str:
        path = self.logs_dir / f"{name}.stderr"
        return tail(path.read_text(errors="replace"), 10) if path.exists() else ""


def parse_record(text: str) -> dict[str, str]:
    """``Key=Value Key=Value ...`` (one ``scontrol -o`` line); a word without ``=`` belongs to
    the value before it (values may contain spaces)."""
    record: dict[str, str] = {}
    last = None
    for word in text.split():
        key, eq, value = word.partition("=")
        if eq and re.fullmatch(r"[A-Za-z][\w/:]*", key):
            record[key] = value
            last = key
        elif last is not None:
            record[last] += " " + word
    return record


# ---------------------------------------------------------------------------------------------
# Fixtures (registered in tests/conftest.py)


def cluster_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh directory for a cluster, short enough for its unix sockets (108 bytes)."""
    root = tmp_path_factory.mktemp(MARKER)
    if len(str(root)) > 60:
        root = Path(tempfile.mkdtemp(prefix=f"{MARKER}-"))
    return root


def install_or_skip(*, accounting: bool = False) -> None:
    """install_slurm, or skip the test (fail on CI) when Slurm cannot be installed here."""
    if os.environ.get("FABRIC_SKIP_SLURM") == "1":
        pytest.skip("real Slurm tests disabled: FABRIC_SKIP_SLURM=1")
    try:
        took_s = install_slurm(accounting=accounting)
    except SlurmUnavailable as e:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(f"CI must run the real Slurm tests, but: {e}")
        pytest.skip(f"no Slurm here: {e}")
    if took_s:
        print(f"\nslurm: installed {', '.join(packages(accounting=accounting))} in {took_s:.1f} s")


def _print_errors(cluster: SlurmCluster, daemons: Iterable[str]) -> None:
    for daemon in daemons:
        errors = cluster.log_errors(daemon)
        if errors:
            print(f"--- {cluster.logs_dir / daemon}.log (errors) ---\n{errors}")


@contextlib.contextmanager
def throwaway_cluster(
    tmp_path_factory: pytest.TempPathFactory, config: SlurmClusterConfig | None = None
) -> Iterator[SlurmCluster]:
    """A cluster of its own directory and ports (it may run beside others), installed with apt
    if needed, skipped or failed as ``slurm_cluster`` says; closed on exit."""
    install_or_skip()
    cluster = SlurmCluster(cluster_root(tmp_path_factory), config or SlurmClusterConfig())
    cluster.start()
    gpus = cluster.config.gpus
    print(f"\nslurm: {cluster.version[2]} with {gpus} GPUs up in {cluster.started_in_s:.2f} s"
          f" at {cluster.root}")  # fmt: skip
    try:
        yield cluster
    finally:
        left = cluster.close()
        if left:
            print(f"\nslurm: SIGKILLed {len(left)} processes left at teardown: {left}")


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    """One throw-away Slurm cluster for the whole session, installed with apt if needed.

    Skips when Slurm cannot be installed here (not root, no apt, no Debian mirror) or with
    ``FABRIC_SKIP_SLURM=1``; on CI (``CI=true``) the first two fail instead of skipping.
    """
    with throwaway_cluster(tmp_path_factory) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def slurm_accounting_cluster(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[SlurmCluster]:
    """A cluster in the accounting mode (slurmdbd, MariaDB, the QoS of ``ACCOUNTING_QOS``) for
    one test module, installed with apt if needed; skips and fails as ``slurm_cluster`` does.

    Its own directory and ports: it may run while the session's ``slurm_cluster`` is up.
    """
    install_or_skip(accounting=True)
    cluster = SlurmCluster(cluster_root(tmp_path_factory), SlurmClusterConfig(accounting=True))
    cluster.start()
    print(
        f"\nslurm: {cluster.version[2]} with slurmdbd and MariaDB up in"
        f" {cluster.started_in_s:.2f} s at {cluster.root}"
    )
    try:
        yield cluster
    finally:
        try:
            left = cluster.close()
            if left:
                print(f"\nslurm: SIGKILLed {len(left)} processes left at teardown: {left}")
        finally:
            _print_errors(cluster, ("slurmctld", "slurmd", "slurmdbd", "mariadbd"))


@pytest.fixture
def slurm(slurm_cluster: SlurmCluster) -> Iterator[SlurmCluster]:
    """The session's cluster; every job is cancelled after the test, and the daemons' last
    error lines are printed (pytest shows them when the test failed)."""
    try:
        yield slurm_cluster
    finally:
        try:
            slurm_cluster.cancel_all()
        finally:
            _print_errors(slurm_cluster, ("slurmctld", "slurmd"))
