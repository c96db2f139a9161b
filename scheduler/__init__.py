"""Placement scheduler: which GPUs each model gets, and with what DP x TP (paper §3.3).

Importable without OR-Tools. The pieces, in the order data flows through them:

* ``specs``     the records the catalogs hold (``GpuSpec``, ``ModelSpec``), local model names.
* ``catalog``   GPU types and model architectures, shipped as TOML data, extended by files.
* ``hf_config`` a model's catalog entry from its Hugging Face config.json or model directory.
* ``inventory`` the GPU inventory as nodes: node groups, pools, exclusive or shared nodes.
* ``workload``  per-model Poisson workloads with normal lengths; inventory/workload files.
* ``roofline``  per-operator FLOPs/bytes -> time of one engine iteration; memory feasibility.
* ``replica``   one (model, GPU type, TP) replica with its engine limits; feasible TP degrees.
* ``analytic``  steady state of a replica vs arrival rate -> the solver's tables; a
                placement's analytic prediction.
* ``des``       discrete-event simulation of continuous batching to evaluate a placement.
* ``placement`` the decision (allocation matrix with DP x TP) and its constraints C1-C3.
* ``objective`` a placement problem (feasible options per model and pool) and its exact analytic
                cost; modes ``fair`` (default: weighted max-min share first), ``latency``,
                ``throughput``.
* ``search``    greedy placement, exact-cost local search (pure Python), ``next_replica``.
* ``solver``    the CP-SAT model (OR-Tools, optional extra ``fabricnode[scheduler]``, imported
                only when a solve starts).
* ``baselines`` memP (paper §5) and the exact optimum by dynamic programming (numpy).
* ``realise``   a pool placement on named nodes (one engine per exclusive node).
* ``node_assign`` the realised engines as ``--apply``'s assignments to the mesh's nodes.
* ``plan``      ``plan(inventory, workloads, ...) -> PlanResult``: what ``fabric plan`` prints.

docs/scheduler.md describes the model; errors are in ``scheduler.errors``.
"""

from scheduler.analytic import (
    ModelEstimate,
    PlacementEstimate,
    ReplicaTable,
    SteadyState,
    estimate_model,
    estimate_placement,
    max_rate,
    replica_table,
    replica_tables,
    steady_state,
)
from scheduler.baselines import ExactResult, exact, memp
from scheduler.catalog import Catalog, GpuSpec, ModelSpec, builtin_catalog, load_catalog
from scheduler.des import (
    ModelResult,
    Request,
    SimConfig,
    SimResult,
    generate_requests,
    simulate,
    simulate_requests,
)
from scheduler.errors import CatalogError, SchedulerError, WorkloadError
from scheduler.inventory import Inventory, NodeGroup, Pool
from scheduler.objective import MODES, Cost, ModelCost, Option, Problem, Unservable
from scheduler.placement import Allocation, Placement, check_placement
from scheduler.plan import ModelPrediction, PlanResult, Prediction, SolverInfo, plan, plan_problem
from scheduler.realise import Layout, NodeEngine, realise
from scheduler.replica import ReplicaPerf, ServingConfig, tp_options
from scheduler.roofline import Batch, MemoryFit, OpCost, RooflineConfig, StepModel, memory_fit
from scheduler.search import greedy, local_search, next_replica
from scheduler.solver import PhaseStats, Progress, Solution, solve
from scheduler.workload import (
    LengthStats,
    Workload,
    load_inventory,
    load_workloads,
    parse_inventory,
    parse_workloads,
)

__all__ = [
    "MODES",
    "Allocation",
    "Batch",
    "Catalog",
    "CatalogError",
    "Cost",
    "ExactResult",
    "GpuSpec",
    "Inventory",
    "Layout",
    "LengthStats",
    "MemoryFit",
    "ModelCost",
    "ModelEstimate",
    "ModelPrediction",
    "ModelResult",
    "ModelSpec",
    "NodeEngine",
    "NodeGroup",
    "OpCost",
    "Option",
    "PhaseStats",
    "Placement",
    "PlacementEstimate",
    "PlanResult",
    "Pool",
    "Prediction",
    "Problem",
    "Progress",
    "ReplicaPerf",
    "ReplicaTable",
    "Request",
    "RooflineConfig",
    "SchedulerError",
    "ServingConfig",
    "SimConfig",
    "SimResult",
    "Solution",
    "SolverInfo",
    "SteadyState",
    "StepModel",
    "Unservable",
    "Workload",
    "WorkloadError",
    "builtin_catalog",
    "check_placement",
    "estimate_model",
    "estimate_placement",
    "exact",
    "generate_requests",
    "greedy",
    "load_catalog",
    "load_inventory",
    "load_workloads",
    "local_search",
    "max_rate",
    "memory_fit",
    "memp",
    "next_replica",
    "parse_inventory",
    "parse_workloads",
    "plan",
    "plan_problem",
    "realise",
    "replica_table",
    "replica_tables",
    "simulate",
    "simulate_requests",
    "solve",
    "steady_state",
    "tp_options",
]
