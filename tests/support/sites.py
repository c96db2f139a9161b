"""Emulated sites on one machine: Linux network namespaces, a bridge and a subnet per site, and a
WAN with delay, jitter, loss, bandwidth and partitions between them.

A federation test needs what a real deployment has: inside a site every node reaches every other
directly; between sites only the gateways reach each other, over a slow and lossy WAN that can
be cut; a compute node has no route off its site at all. ``emulated_sites(topology)`` builds
that with ``ip`` (iproute2) and tears it down after, and gives the test a way to run processes
and open sockets inside each node::

    topology = Topology(
        sites=(Site("a", computes=2), Site("b"), Site("c")),
        links={("a", "b"): Link(rtt_ms=40), ("a", "c"): Link(rtt_ms=150),
               ("b", "c"): Link(rtt_ms=250, loss=0.01, bandwidth_mbit=50)},
    )
    with emulated_sites(topology) as sites:
        node = sites.node("a-c0")                      # node.address: 10.200.0.11
        agent = sites.popen("a-c0", [sys.executable, "-m", "cli.main", "start", ...])
        gw = sites.node("b-gw0")                       # gw.address, and gw.wan_address
        sock = sites.socket("b-gw0")                   # a socket inside b's gateway
        sites.cut("a", "b"); ...; sites.heal("a", "b")  # or isolate("a") / reconnect("a")
        sites.set_link("a", "b", Link(rtt_ms=80))      # from now on

``three_sites`` (a fixture, tests/conftest.py) is ``THREE_SITES`` up for a test module: the
federation's acceptance topology, 40, 150 and 250 ms apart, reset after each test.

Namespaces (one run; each name starts with the run's ``prefix``,
``fabricsites-<pid>-<start>-<n>``: the owning process, its start time, a counter)::

    PREFIX-<site>-lan    the site's switch: bridge br0 with a port p<k> per node, no address
    PREFIX-<site>-gw<g>  a gateway: eth0 on the site's LAN, wan0 on the site's WAN segment
    PREFIX-<site>-c<k>   a compute node: eth0 only
    PREFIX-wan           the WAN router: a bridge brw<i> per site's WAN segment (the router is
                         .1 on it), tun0, and the delay process (tests/support/wandelay.py)

Addresses exist only inside these namespaces (the host's own network is never touched), so
parallel runs reuse them without colliding; a site is numbered by its place in the topology:

    site i's LAN            10.200.i.0/24   gateways .10, .11, ..., then the compute nodes
    site i's WAN segment    10.201.i.0/24   the router .1, gateways .10, .11, ...

Routes: a compute node has its LAN's /24 and nothing else, no default route, so a connect to
another site fails at once (ENETUNREACH); a gateway has its LAN, its WAN segment and
10.201.0.0/16 via the router: other sites' gateways only; the router knows the WAN segments
only, so even a packet addressed to another site's LAN dies there. Forwarding is on in the
router alone; rp_filter is off there (packets come back in on tun0, not where their source is).

The WAN: the router policy-routes what comes in on a site's segment into tun0
(``ip rule iif brw<i> lookup 100``, table 100 ``default dev tun0``); ``wandelay.py`` holds each
packet as the link between the two sites says and writes it back, and the kernel forwards it by
the main table to the destination segment. Why a userspace router: this kernel has no
``netem``, and ``tbf``/``htb`` cannot delay (wandelay.py says more). Why cuts there and not in
nftables: the process answers each command once it is in force, packets already on the wire
included, so ``cut()`` returning means nothing crosses any more; and no firewall is needed.
Why a switch namespace per site rather than the site bridges in the router's: a site's LAN
traffic never enters the router's namespace, whose counters then show the WAN alone.

Processes: ``popen`` runs argv under ``ip netns exec`` in a new session; ``socket`` opens a
socket inside a node's namespace from this process (a short thread that ``setns``-es into it:
the socket stays in that namespace), so a test can probe without a subprocess
(``probe_rtts_ms`` does). Only the network is separate: files, users and the host name are the
machine's, so a node is told its address (``Node.address``), it does not look it up.

Ready means ready: ``start`` returns once every interface of the run is operationally up. The
kernel's link watcher, which batches carrier events up to a second apart, gives a new link its
queue; until then the link drops what it is given, and the first connect after setup took
TCP's one-second SYN retransmission.

Bounded and torn down: every ``ip`` call has a timeout; the delay process exits when its stdin
closes (the harness closed it, or died) or after ``lifetime_s``; ``close()`` (the context's
exit) stops the processes started with ``popen`` (SIGTERM to their session, SIGKILL after
``stop_timeout_s``), SIGKILLs anything else still in the run's namespaces, and deletes them.
Before each setup, ``remove_stale_runs()`` removes the namespaces (and their processes) of runs
whose owning process is gone, recognised by the prefix above only.

Accuracy and cost: the router holds a packet its full time, never less, so a round trip
measures what was set plus the router's own path and wake-ups, a fraction of a millisecond:
within 5% from RTTs of a few tens of milliseconds, less close at 10 ms. About a second to build
the three-site topology of the tests (mostly waiting for the link watcher), as long for fifty
namespaces; the router spends tens of microseconds of CPU per packet, so it carries gossip and
HTTP streams at ease and bulk transfers up to about 100 Mbit/s (docs/benchmarks.md, "Emulated
sites").
It needs root, ``ip`` (iproute2, installed with apt when missing: ``require_sites``) and
/dev/net/tun.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import json
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pytest

from tests.support import wandelay
from tests.support.debian import InstallError, Unavailable, install_packages
from tests.support.wandelay import DirectionStatistics, Link, WanStatistics

__all__ = [
    "THREE_SITES",
    "DirectionStatistics",
    "Link",
    "Node",
    "Site",
    "Sites",
    "SitesError",
    "SitesUnavailable",
    "Topology",
    "WanStatistics",
    "emulated_sites",
    "remove_stale_runs",
    "require_sites",
]

PACKAGES = ("iproute2",)
SEARCH_PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin", "/usr/bin"])
NETNS_DIR = Path("/var/run/netns")
MARKER = "fabricsites"
RUN_NAME = re.compile(rf"^{MARKER}-(\d+)-(\d+)-(\d+)-")
SITE_NAME = re.compile(r"^[a-z][a-z0-9]{0,7}$")
LAN = "10.200.{i}.{host}"
WAN = "10.201.{i}.{host}"
WAN_ROUTE = "10.201.0.0/16"
FIRST_HOST = 10
ROUTER_HOST = 1
WAN_TABLE = 100
CLONE_NEWNET = 0x40000000
T = TypeVar("T")

_runs = itertools.count()


# The WAN router and the probes run under SCHED_FIFO (root only; a no-op elsewhere): make test
# runs the sites tests beside three other lanes on two cores, and at normal priority the router's
# wake-ups came late by milliseconds (43.6 ms measured on a 40 ms link: +9%). A kernel qdisc
# (netem, missing here) delays packets in softirq context, above every process; a real-time
# router is the userspace equivalent. It sleeps in select() between packets, never spins, and
# the kernel's real-time throttling bounds it all the same.
REALTIME_PRIORITY = 20


def _realtime() -> None:
    """In a child before exec: SCHED_FIFO, when the scheduler allows it."""
    with contextlib.suppress(OSError, AttributeError):
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(REALTIME_PRIORITY))


@contextlib.contextmanager
def _realtime_thread() -> Iterator[None]:
    """This thread under SCHED_FIFO for the block, then back to its own policy."""
    try:
        before = os.sched_getscheduler(0), os.sched_getparam(0)
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(REALTIME_PRIORITY))
    except (OSError, AttributeError):
        yield
        return
    try:
        yield
    finally:
        os.sched_setscheduler(0, before[0], before[1])


class SitesUnavailable(Exception):
    """Namespaces cannot be made here (not root, no ``ip``, no /dev/net/tun, no privilege)."""


class SitesError(Exception):
    """Building the sites or talking to the delay process failed; the message says which step."""


# ---------------------------------------------------------------------------------------------
# The topology


@dataclass(frozen=True)
class Site:
    """A cluster network: ``gateways`` long-running hosts reachable from other sites, and
    ``computes`` nodes reachable only from inside the site."""

    name: str
    computes: int = 1
    gateways: int = 1

    def __post_init__(self) -> None:
        if not SITE_NAME.match(self.name):
            raise ValueError(f"a site's name is 1-8 of [a-z0-9], starting with a letter: {self}")
        if self.computes < 0 or self.gateways < 0 or self.computes + self.gateways < 1:
            raise ValueError(f"a site has at least one node: {self}")
        if FIRST_HOST + self.computes + self.gateways > 254:
            raise ValueError(f"at most {254 - FIRST_HOST} nodes per site: {self}")


@dataclass(frozen=True)
class Topology:
    """Sites and the WAN links between them: ``links`` maps a pair of site names (either
    order) to its ``Link``; a pair not named gets ``default_link``. ``seed`` seeds the delay
    process's loss and jitter."""

    sites: tuple[Site, ...]
    links: Mapping[tuple[str, str], Link] = field(default_factory=dict)
    default_link: Link = field(default_factory=Link)
    seed: int = 0

    def __post_init__(self) -> None:
        names = [s.name for s in self.sites]
        if len(set(names)) != len(names) or not names:
            raise ValueError(f"sites need distinct names, at least one: {names}")
        if len(names) > 250:
            raise ValueError("at most 250 sites")
        for a, b in self.links:
            if a not in names or b not in names or a == b:
                raise ValueError(f"a link joins two sites of the topology, not {a!r}-{b!r}")
        pairs = [frozenset(p) for p in self.links]
        if len(set(pairs)) != len(pairs):
            raise ValueError("a pair of sites has two links")

    def link(self, a: str, b: str) -> Link:
        return self.links.get((a, b)) or self.links.get((b, a)) or self.default_link

    def pairs(self) -> Iterator[tuple[str, str]]:
        names = [s.name for s in self.sites]
        for i, a in enumerate(names):
            for b in names[i + 1 :]:
                yield a, b

    def site(self, name: str) -> Site:
        for s in self.sites:
            if s.name == name:
                return s
        raise KeyError(f"no site {name!r}")


@dataclass(frozen=True)
class Node:
    """One host: ``address`` on its site's LAN; a gateway has ``wan_address`` too, the one
    other sites reach it at."""

    name: str
    site: str
    gateway: bool
    index: int  # among the site's gateways, or among its compute nodes
    netns: str
    address: str
    wan_address: str | None


# ---------------------------------------------------------------------------------------------
# Running things in namespaces


def _which(command: str) -> str:
    found = shutil.which(command, path=SEARCH_PATH)
    if found is None:
        raise SitesUnavailable(f"{command} is not installed")
    return found


def _ip(*args: str, stdin: str | None = None, timeout_s: float = 30) -> None:
    """``ip ARGS`` (``-batch -`` reads ``stdin``); SitesError with ip's message if it fails."""
    argv = [_which("ip"), *args]
    try:
        done = subprocess.run(
            argv, input=stdin, capture_output=True, text=True, timeout=timeout_s, check=False
        )
    except subprocess.TimeoutExpired as exc:
        raise SitesError(f"{' '.join(argv)} took over {exc.timeout} s") from None
    if done.returncode != 0:
        where = f" (batch: {stdin.strip().splitlines()[:3]}...)" if stdin else ""
        raise SitesError(f"{' '.join(argv)} failed: {done.stderr.strip()}{where}")


def _ip_batches(batches: Mapping[str, Sequence[str]], timeout_s: float = 30) -> None:
    """One ``ip -n NETNS -batch -`` per namespace, side by side."""
    ip = _which("ip")
    procs = []
    for netns, lines in batches.items():
        proc = subprocess.Popen(
            [ip, "-n", netns, "-batch", "-"],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        procs.append((netns, lines, proc))
    errors = []
    for netns, lines, proc in procs:
        try:
            _, err = proc.communicate("\n".join(lines) + "\n", timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            err = f"took over {timeout_s} s"
        if proc.returncode != 0:
            errors.append(f"{netns}: {err.strip()}")
    if errors:
        raise SitesError("configuring the namespaces failed: " + "; ".join(errors))


_libc = ctypes.CDLL(None, use_errno=True)


def in_netns(netns: str, fn: Callable[[], T]) -> T:
    """``fn()`` run by a thread that entered network namespace ``netns`` (a socket it opens
    stays there; files under /proc/sys/net are that namespace's)."""
    results: list[T] = []
    errors: list[BaseException] = []

    def enter_and_run() -> None:
        try:
            fd = os.open(NETNS_DIR / netns, os.O_RDONLY | os.O_CLOEXEC)
            try:
                if _libc.setns(fd, CLONE_NEWNET) != 0:
                    err = ctypes.get_errno()
                    raise OSError(err, f"setns into {netns}: {os.strerror(err)}")
            finally:
                os.close(fd)
            results.append(fn())
        except BaseException as exc:  # handed to the caller's thread
            errors.append(exc)

    thread = threading.Thread(target=enter_and_run, name=f"netns {netns}")
    thread.start()
    thread.join()
    if errors:
        raise errors[0]
    return results[0]


def _sysctls(netns: str, values: Mapping[str, str]) -> None:
    def write() -> None:
        for key, value in values.items():
            Path("/proc/sys", key.replace(".", "/")).write_text(value)

    in_netns(netns, write)


def _netns_inode(path: Path) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def pids_in(netns_names: Sequence[str]) -> list[int]:
    """Live processes (not this one) inside any of these network namespaces."""
    wanted = {ino for n in netns_names if (ino := _netns_inode(NETNS_DIR / n)) is not None}
    if not wanted:
        return []
    me = os.getpid()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        if _netns_inode(entry / "ns" / "net") in wanted and not _is_zombie(int(entry.name)):
            found.append(int(entry.name))
    return found


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        return True


def _start_time(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _owner_alive(pid: int, start: str) -> bool:
    """Whether process ``pid``, started at ``start``, still runs (a zombie does not)."""
    return _start_time(pid) == start and not _is_zombie(pid)


def _kill_all(pids: Sequence[int], timeout_s: float = 10) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + timeout_s
    while any(not _is_zombie(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.02)


def _run_namespaces(prefix: str) -> list[str]:
    try:
        names = [p.name for p in NETNS_DIR.iterdir()]
    except FileNotFoundError:
        return []
    return sorted(n for n in names if n.startswith(prefix + "-"))


def _delete_namespaces(names: Sequence[str]) -> None:
    if names:
        # -force: go on past a name already gone.
        _ip("-force", "-batch", "-", stdin="".join(f"netns del {n}\n" for n in names))


def remove_stale_runs() -> list[str]:
    """Delete the namespaces of runs whose owner process is gone (a crashed test), after
    SIGKILLing what still runs in them; the names deleted. Only names of this module's scheme
    (``fabricsites-<pid>-<start>-<n>-...``) are looked at."""
    try:
        names = [p.name for p in NETNS_DIR.iterdir()]
    except FileNotFoundError:
        return []
    stale = []
    for name in names:
        found = RUN_NAME.match(name)
        if found and not _owner_alive(int(found[1]), found[2]):
            stale.append(name)
    if stale:
        _kill_all(pids_in(stale))
        _delete_namespaces(stale)
    return sorted(stale)


# ---------------------------------------------------------------------------------------------
# The sites


class Sites:
    """The emulated sites of one run (module docstring); made by ``emulated_sites``."""

    def __init__(self, topology: Topology, *, lifetime_s: float, stop_timeout_s: float) -> None:
        me = os.getpid()
        self.topology = topology
        self.prefix = f"{MARKER}-{me}-{_start_time(me)}-{next(_runs)}"
        self.wan_netns = f"{self.prefix}-wan"
        self.lifetime_s = lifetime_s
        self.stop_timeout_s = stop_timeout_s
        self.nodes: dict[str, Node] = {}
        self.setup_s = 0.0
        self._procs: list[subprocess.Popen[Any]] = []
        self._delay: subprocess.Popen[bytes] | None = None
        self._control = threading.Lock()
        self._closed = False
        self._links = {frozenset(p): topology.link(*p) for p in topology.pairs()}
        for i, site in enumerate(topology.sites):
            for g in range(site.gateways):
                name = f"{site.name}-gw{g}"
                self.nodes[name] = Node(
                    name,
                    site.name,
                    True,
                    g,
                    f"{self.prefix}-{name}",
                    LAN.format(i=i, host=FIRST_HOST + g),
                    WAN.format(i=i, host=FIRST_HOST + g),
                )
            for k in range(site.computes):
                name = f"{site.name}-c{k}"
                self.nodes[name] = Node(
                    name,
                    site.name,
                    False,
                    k,
                    f"{self.prefix}-{name}",
                    LAN.format(i=i, host=FIRST_HOST + site.gateways + k),
                    None,
                )

    # -- what there is ------------------------------------------------------------------------

    def node(self, name: str) -> Node:
        try:
            return self.nodes[name]
        except KeyError:
            raise KeyError(f"no node {name!r} (nodes: {', '.join(self.nodes)})") from None

    def gateways(self, site: str) -> list[Node]:
        self.topology.site(site)
        return [n for n in self.nodes.values() if n.site == site and n.gateway]

    def computes(self, site: str) -> list[Node]:
        self.topology.site(site)
        return [n for n in self.nodes.values() if n.site == site and not n.gateway]

    def namespaces(self) -> list[str]:
        """Every namespace of this run that exists now."""
        return _run_namespaces(self.prefix)

    @property
    def delay_pid(self) -> int | None:
        return None if self._delay is None else self._delay.pid

    # -- building and tearing down ------------------------------------------------------------

    def start(self) -> None:
        t0 = time.monotonic()
        try:
            self._build()
            self._start_delay()
            self._wait_links_up()
        except BaseException:
            self.close()
            raise
        self.setup_s = time.monotonic() - t0

    def _build(self) -> None:
        sites = self.topology.sites
        lan_ns = {s.name: f"{self.prefix}-{s.name}-lan" for s in sites}
        names = [*lan_ns.values(), *(n.netns for n in self.nodes.values()), self.wan_netns]
        _ip("-batch", "-", stdin="".join(f"netns add {n}\n" for n in names))
        # The links, made straight inside their namespaces (never in the host's).
        links = [f"link add br0 netns {ns} type bridge" for ns in lan_ns.values()]
        batches: dict[str, list[str]] = {n: ["link set lo up"] for n in names}
        wan = batches[self.wan_netns]
        wan += ["tuntap add dev tun0 mode tun", "link set tun0 up"]
        wan.append(f"route add default dev tun0 table {WAN_TABLE}")
        for i, site in enumerate(sites):
            bridge = f"brw{i}"
            links.append(f"link add {bridge} netns {self.wan_netns} type bridge")
            wan += [
                f"addr add {WAN.format(i=i, host=ROUTER_HOST)}/24 dev {bridge}",
                f"link set {bridge} up",
                f"rule add iif {bridge} lookup {WAN_TABLE} pref 1000",
            ]
            lan = batches[lan_ns[site.name]]
            lan.append("link set br0 up")
            for k, node in enumerate(n for n in self.nodes.values() if n.site == site.name):
                port = f"p{k}"
                links.append(
                    f"link add eth0 netns {node.netns} type veth peer name {port}"
                    f" netns {lan_ns[site.name]}"
                )
                lan += [f"link set {port} master br0", f"link set {port} up"]
                mine = batches[node.netns]
                mine += [f"addr add {node.address}/24 dev eth0", "link set eth0 up"]
                if node.gateway:
                    port = f"g{i}x{node.index}"
                    links.append(
                        f"link add wan0 netns {node.netns} type veth peer name {port}"
                        f" netns {self.wan_netns}"
                    )
                    wan += [f"link set {port} master {bridge}", f"link set {port} up"]
                    mine += [
                        f"addr add {node.wan_address}/24 dev wan0",
                        "link set wan0 up",
                        f"route add {WAN_ROUTE} via {WAN.format(i=i, host=ROUTER_HOST)} dev wan0",
                    ]
        _ip("-batch", "-", stdin="\n".join(links) + "\n")
        # Forwarding off everywhere but in the router (a new namespace's IPv4 settings are
        # copied from the host's, whatever they are); rp_filter off in the router.
        for node in self.nodes.values():
            _sysctls(node.netns, {"net.ipv4.ip_forward": "0"})
        # No IPv6 on tun0: its router solicitations would reach the delay process.
        router = {"net.ipv4.ip_forward": "1", "net.ipv6.conf.tun0.disable_ipv6": "1"}
        for iface in ("all", "default", "tun0", *(f"brw{i}" for i in range(len(sites)))):
            router[f"net.ipv4.conf.{iface}.rp_filter"] = "0"
        _ip_batches(batches)
        _sysctls(self.wan_netns, router)

    def _start_delay(self) -> None:
        sites = {s.name: WAN.format(i=i, host=0) + "/24" for i, s in enumerate(self.topology.sites)}
        links = [(a, b, self.topology.link(a, b)) for a, b in self.topology.pairs()]
        config = json.loads(wandelay.config_json(sites, links, seed=self.topology.seed, tun="tun0"))
        config["lifetime_s"] = self.lifetime_s
        self._delay = subprocess.Popen(
            [_which("ip"), "netns", "exec", self.wan_netns, sys.executable, wandelay.__file__],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
            preexec_fn=_realtime,  # the WAN's delays, not the machine's load (``_realtime``)
        )
        reply = self._command(config, timeout_s=30)
        if not reply.get("ready"):
            raise SitesError(f"the delay process did not start: {reply}")

    def _wait_links_up(self, timeout_s: float = 20) -> None:
        """Wait until every interface of the run is operationally up. Until the kernel's
        link watcher has seen a new link's carrier (it batches events, up to a second apart)
        the link has no queue and drops what it is given: the first packets sent right after
        setup were lost, and a TCP connect then took its one-second SYN retransmission."""
        ip = _which("ip")
        waiting = self.namespaces()
        deadline = time.monotonic() + timeout_s
        while True:
            listings = [
                (ns, subprocess.Popen([ip, "-n", ns, "-o", "link"], stdout=subprocess.PIPE))
                for ns in waiting
            ]
            down: dict[str, list[str]] = {}
            for ns, proc in listings:
                out, _ = proc.communicate(timeout=timeout_s)
                for line in out.decode().splitlines():
                    words = line.split()
                    state = words[words.index("state") + 1] if "state" in words else "?"
                    if words[1] != "lo:" and state != "UP":
                        down.setdefault(ns, []).append(f"{words[1]}{state}")
            if not down:
                return
            if time.monotonic() > deadline:
                raise SitesError(f"links not up after {timeout_s} s: {down}")
            waiting = list(down)
            time.sleep(0.05)

    def close(self) -> list[int]:
        """Stop every process of the run and delete its namespaces; the pids that had to be
        SIGKILLed because nothing else stopped them (processes ``popen`` did not start)."""
        if self._closed:
            return []
        self._closed = True
        for proc in self._procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + self.stop_timeout_s
        for proc in self._procs:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        if self._delay is not None:
            delay = self._delay
            if delay.stdin is not None:
                with contextlib.suppress(OSError):
                    delay.stdin.close()  # end of stdin: the delay process exits
            try:
                delay.wait(timeout=5)
            except subprocess.TimeoutExpired:
                delay.kill()
                delay.wait()
            for pipe in (delay.stdout, delay.stderr):
                if pipe is not None:
                    pipe.close()
        names = self.namespaces()
        left = pids_in(names)
        _kill_all(left)
        _delete_namespaces(names)
        return left

    # -- running things inside ----------------------------------------------------------------

    def popen(self, node: str, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """``argv`` started inside ``node``'s namespace (``ip netns exec``), in a session of
        its own; ``close()`` sends its session SIGTERM, then SIGKILL, and SIGKILLs whatever
        else is left in the run's namespaces. ``kwargs`` go to ``subprocess.Popen`` (env,
        stdout, cwd, ...)."""
        if self._closed:
            raise SitesError("the sites are torn down")
        kwargs["start_new_session"] = True  # close() signals the session
        proc = subprocess.Popen(
            [_which("ip"), "netns", "exec", self.node(node).netns, *argv], **kwargs
        )
        self._procs.append(proc)
        return proc

    def run(
        self, node: str, argv: Sequence[str], *, timeout_s: float = 60, **kwargs: Any
    ) -> subprocess.CompletedProcess[Any]:
        """``argv`` run to its end inside ``node``'s namespace (``subprocess.run``'s kwargs)."""
        return subprocess.run(
            [_which("ip"), "netns", "exec", self.node(node).netns, *argv],
            timeout=timeout_s,
            check=kwargs.pop("check", False),
            **kwargs,
        )

    def socket(
        self,
        node: str,
        family: socket.AddressFamily = socket.AF_INET,
        kind: socket.SocketKind = socket.SOCK_STREAM,
    ) -> socket.socket:
        """A socket of this process inside ``node``'s namespace (close it when done)."""
        netns = self.node(node).netns
        return in_netns(netns, lambda: socket.socket(family, kind))

    def in_node(self, node: str, fn: Callable[[], T]) -> T:
        """``fn()`` run by a thread inside ``node``'s namespace (``in_netns``)."""
        return in_netns(self.node(node).netns, fn)

    def probe_rtts_ms(
        self, src: str, dst: str, count: int = 20, *, timeout_s: float = 5
    ) -> list[float]:
        """``count`` round trips from ``src`` to ``dst`` in milliseconds, one after the other:
        each the time a TCP connect takes (SYN out, SYN-ACK back: one RTT; the kernel answers,
        no process at ``dst`` adds its own time). ``dst``'s WAN address across sites, its LAN
        address inside one. The probing thread runs under the real-time scheduler meanwhile
        (``_realtime``): its wake-up is not the machine's load either."""
        with _realtime_thread():
            return self._probe_rtts_ms(src, dst, count, timeout_s)

    def _probe_rtts_ms(self, src: str, dst: str, count: int, timeout_s: float) -> list[float]:
        target = self.node(dst)
        host = target.address if self.node(src).site == target.site else target.wan_address
        if host is None:
            raise SitesError(f"{dst} is a compute node: no other site reaches it")
        with self.socket(dst) as server:
            server.bind(("0.0.0.0", 0))
            server.listen(count + 8)
            port = server.getsockname()[1]
            rtts = []
            for _ in range(count):
                with self.socket(src) as client:
                    client.settimeout(timeout_s)
                    t0 = time.perf_counter()
                    client.connect((host, port))
                    rtts.append((time.perf_counter() - t0) * 1000)
        return rtts  # the connections left in the backlog are reset when the server closes

    # -- the WAN ------------------------------------------------------------------------------

    def link(self, a: str, b: str) -> Link:
        """The link between sites ``a`` and ``b`` as set now."""
        self._others(a)
        return self._links[frozenset((a, b))]

    def set_link(self, a: str, b: str, link: Link) -> None:
        """Change the link between ``a`` and ``b`` from now on (packets on the wire keep
        their times)."""
        self._ok({"op": "set", "a": a, "b": b, "link": link.to_json()})
        self._links[frozenset((a, b))] = link

    def cut(self, a: str, b: str) -> None:
        """Partition ``a`` from ``b``: once this returns no packet crosses between them, those
        already on the wire included, until ``heal``."""
        self._ok({"op": "cut", "a": a, "b": b})

    def heal(self, a: str, b: str) -> None:
        self._ok({"op": "heal", "a": a, "b": b})

    def reset(self) -> None:
        """Every link as the topology set it, none cut (what the ``three_sites`` fixture does
        after each test)."""
        for a, b in self.topology.pairs():
            self.heal(a, b)
            if self.link(a, b) != self.topology.link(a, b):
                self.set_link(a, b, self.topology.link(a, b))

    def isolate(self, site: str) -> None:
        """Cut ``site`` from every other site."""
        for other in self._others(site):
            self.cut(site, other)

    def reconnect(self, site: str) -> None:
        """Heal every link of ``site``."""
        for other in self._others(site):
            self.heal(site, other)

    def statistics(self) -> WanStatistics:
        """The delay process's counters, per direction of each site pair."""
        return WanStatistics.from_json(self._ok({"op": "stats"}))

    def _others(self, site: str) -> list[str]:
        self.topology.site(site)
        return [s.name for s in self.topology.sites if s.name != site]

    def _ok(self, command: Mapping[str, Any]) -> dict[str, Any]:
        reply = self._command(command)
        if not reply.get("ok"):
            raise SitesError(f"the delay process refused {command}: {reply.get('error')}")
        return reply

    def _command(self, command: Mapping[str, Any], timeout_s: float = 10) -> dict[str, Any]:
        """One JSON line to the delay process, its one-line answer."""
        delay = self._delay
        if delay is None or delay.stdin is None or delay.stdout is None or self._closed:
            raise SitesError("no delay process (the sites are not up)")
        with self._control:
            try:
                delay.stdin.write(json.dumps(command).encode() + b"\n")
                delay.stdin.flush()
            except OSError as exc:
                raise SitesError(f"the delay process is gone: {exc}{self._delay_err()}") from None
            line = b""
            deadline = time.monotonic() + timeout_s
            fd = delay.stdout.fileno()
            while not line.endswith(b"\n"):
                left = deadline - time.monotonic()
                if left <= 0 or not select.select([fd], [], [], left)[0]:
                    raise SitesError(f"the delay process did not answer {command} in {timeout_s} s")
                chunk = os.read(fd, 65536)
                if not chunk:
                    raise SitesError(f"the delay process exited{self._delay_err()}")
                line += chunk
        result: dict[str, Any] = json.loads(line)
        return result

    def _delay_err(self) -> str:
        delay = self._delay
        if delay is None or delay.stderr is None or delay.poll() is None:
            return ""
        return f" (exit {delay.returncode}): {delay.stderr.read().decode(errors='replace')[-800:]}"


@contextlib.contextmanager
def emulated_sites(
    topology: Topology, *, lifetime_s: float = 3600, stop_timeout_s: float = 5
) -> Iterator[Sites]:
    """The sites of ``topology``, up; torn down on exit (module docstring). ``lifetime_s``
    bounds the delay process even if nothing closes it."""
    remove_stale_runs()
    sites = Sites(topology, lifetime_s=lifetime_s, stop_timeout_s=stop_timeout_s)
    sites.start()
    try:
        yield sites
    finally:
        sites.close()


# ---------------------------------------------------------------------------------------------
# Can it run here? And the fixtures (registered in tests/conftest.py)


def check_sites() -> None:
    """Raise SitesUnavailable with the reason when emulated sites cannot be built here;
    install iproute2 with apt when ``ip`` is missing (root only)."""
    if os.geteuid() != 0:
        raise SitesUnavailable("network namespaces need root")
    try:
        took = install_packages(
            PACKAGES, lambda: [] if shutil.which("ip", path=SEARCH_PATH) else ["ip"]
        )
    except Unavailable as exc:
        raise SitesUnavailable(f"no iproute2: {exc}") from None
    except InstallError as exc:
        raise SitesError(str(exc)) from None
    if took:
        print(f"\nsites: installed {', '.join(PACKAGES)} in {took:.1f} s")
    if not os.path.exists("/dev/net/tun"):
        raise SitesUnavailable("no /dev/net/tun (the WAN's delay process needs a TUN device)")
    me = os.getpid()
    probe = f"{MARKER}-{me}-{_start_time(me)}-{next(_runs)}-probe"  # a crash leaves it stale
    try:
        _ip("netns", "add", probe, timeout_s=10)
    except SitesError as exc:
        raise SitesUnavailable(f"cannot create a network namespace: {exc}") from None
    _ip("netns", "del", probe, timeout_s=10)


def require_sites() -> None:
    """``check_sites``, or skip the test with the reason (fail it on CI, ``CI=true``, which
    runs as root as Slurm does); ``FABRIC_SKIP_SITES=1`` skips."""
    if os.environ.get("FABRIC_SKIP_SITES") == "1":
        pytest.skip("emulated sites disabled: FABRIC_SKIP_SITES=1")
    try:
        check_sites()
    except SitesUnavailable as exc:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(f"CI must run the emulated-sites tests, but: {exc}")
        pytest.skip(f"no emulated sites here: {exc}")


# The sites of the federation's acceptance: three sites, 40, 150 and 250 ms apart; a has two
# compute nodes (two nodes to serve a model inside one site), b and c one each.
THREE_SITES = Topology(
    sites=(Site("a", computes=2), Site("b"), Site("c")),
    links={
        ("a", "b"): Link(rtt_ms=40),
        ("a", "c"): Link(rtt_ms=150),
        ("b", "c"): Link(rtt_ms=250),
    },
)


@pytest.fixture(scope="module")
def three_sites_module() -> Iterator[Sites]:
    """``THREE_SITES`` up for one test module (about a second to build); skips as
    ``require_sites`` says. Use ``three_sites``, which resets the WAN after each test."""
    require_sites()
    with emulated_sites(THREE_SITES) as sites:
        print(f"\nsites: {len(sites.nodes)} nodes of 3 sites up in {sites.setup_s:.2f} s")
        yield sites


@pytest.fixture
def three_sites(three_sites_module: Sites) -> Iterator[Sites]:
    """The module's ``THREE_SITES``; after the test every link is as set and none is cut."""
    try:
        yield three_sites_module
    finally:
        three_sites_module.reset()
