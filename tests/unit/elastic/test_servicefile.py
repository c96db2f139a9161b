"""The service file: its format, every check with the line it names, and its canonical bytes."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fabricnode.elastic.plans import plans_of
from fabricnode.elastic.servicefile import (
    DOMAIN,
    ENGINE_SHORTHANDS,
    MODEL_KEYS,
    Limits,
    ModelService,
    ServiceSpec,
    engine_template,
    format_duration,
    format_time_limit,
    from_canonical,
    join_command,
    load,
    parse,
)
from fabricnode.elastic.servicespec import SIM
from fabricnode.elastic.slurmctl import SlurmControl
from fabricnode.elastic.vocab import MIN_REPLICAS, Submit
from fabricnode.engine import template
from fabricnode.errors import ConfigError, DecodeError, ServiceFileError
from fabricnode.host.slurm import parse_time_limit
from scheduler.catalog import builtin_catalog

FULL = """\
# The mesh's services.
[defaults]                 # applies to every [[model]] unless it overrides
partitions = ["gpu-preempt", "gpu"]
account = "proj123"
qos = "normal"
time_limit = "2:00:00"
sbatch_args = ["--constraint=a100"]

[limits]
max_jobs = 32
max_gpus = 64

[[model]]
name = "llama-3.1-8b"
engine = "vllm serve /scratch/models/Llama-3.1-8B --served-model-name {model} --port {port} --tensor-parallel-size {tp}"
gpu_types = ["A100-80G", "H100"]
gres_types = ["a100", "h100"]
gpus_per_replica = 2
min_replicas = 0
max_replicas = 4
ttft_p95 = "2s"
idle_to_zero = "10m"
hold_requests = "3m"

[[model]]
name = "qwen2.5-72b"
engine = "vllm"
model_path = "/scratch/models/Qwen2.5-72B-Instruct"
gpus_per_replica = "auto"
min_replicas = 1
max_replicas = 2
ttft_p95 = 0.5
partitions = ["gpu-long"]
time_limit = 1440

[[model]]
name = "tiny-sim"
engine = "sim"
"""  # noqa: E501

LIMITS = "[limits]\nmax_jobs = 8\nmax_gpus = 16\n"


def problems(text: str) -> list[tuple[int, str, str, str]]:
    """(line, where, key, message) of every problem ``parse`` reports, in its order."""
    with pytest.raises(ServiceFileError) as caught:
        parse(text, "services.toml")
    return [(p.line, p.where, p.key, p.message) for p in caught.value.problems]


def marked_line(text: str) -> int:
    """The line marked ``# <-`` in a test file."""
    (line,) = [n for n, row in enumerate(text.splitlines(), 1) if "# <-" in row]
    return line


# -- valid files ---------------------------------------------------------------------------------


def test_full_file_parses_to_the_normalised_spec() -> None:
    spec = parse(FULL, "services.toml")
    assert spec.limits == Limits(max_jobs=32, max_gpus=64)
    assert [m.name for m in spec.models] == ["llama-3.1-8b", "qwen2.5-72b", "tiny-sim"]
    llama, qwen, sim = spec.models
    assert llama == ModelService(
        name="llama-3.1-8b",
        engine="vllm serve /scratch/models/Llama-3.1-8B --served-model-name {model} "
        "--port {port} --tensor-parallel-size {tp}",
        gpu_types=("A100-80G", "H100-SXM"),
        gres_types=("a100", "h100"),
        gpus_per_replica=2,
        min_replicas=0,
        max_replicas=4,
        ttft_p95_s=2.0,
        idle_to_zero_s=600.0,
        hold_requests_s=180.0,
        partitions=("gpu-preempt", "gpu"),
        account="proj123",
        qos="normal",
        time_limit_s=7200,
        sbatch_args=("--constraint=a100",),
    )
    assert qwen.engine == ENGINE_SHORTHANDS["vllm"]
    assert engine_template(qwen).model_paths == {
        "qwen2.5-72b": "/scratch/models/Qwen2.5-72B-Instruct"
    }
    assert qwen.gpus_per_replica is None and qwen.ttft_p95_s == 0.5
    assert qwen.partitions == ("gpu-long",) and qwen.time_limit == "1-00:00:00"
    assert qwen.idle_to_zero_s is None  # it does not scale to zero
    assert sim.simulated and engine_template(sim).simulated
    assert spec.model("LLAMA-3.1-8B") is llama and spec.model("nope") is None


def test_the_spec_names_the_simulated_engine_as_engine_templates_do() -> None:
    # servicespec keeps its own copy of the word so that it imports nothing of the engine
    assert SIM == template.SIM


def test_full_file_round_trips_through_toml_json_and_canonical_bytes() -> None:
    spec = parse(FULL, "services.toml")
    assert parse(spec.to_toml()) == spec
    assert from_canonical(spec.canonical()) == spec
    doc = spec.to_json()
    assert json.loads(json.dumps(doc)) == doc
    assert list(doc) == ["version", "digest", "limits", "models"]
    assert doc["digest"] == spec.digest()
    first = doc["models"][0]  # type: ignore[index]
    assert first["gpus_per_replica"] == 2 and first["time_limit"] == "02:00:00"
    assert doc["models"][1]["gpus_per_replica"] == "auto"  # type: ignore[index]


def test_defaults_apply_to_every_model_and_a_models_own_key_wins() -> None:
    spec = parse(FULL)
    llama, qwen, sim = spec.models
    assert llama.partitions == sim.partitions == ("gpu-preempt", "gpu")
    assert qwen.partitions == ("gpu-long",)
    assert llama.time_limit_s == sim.time_limit_s == 7200 and qwen.time_limit_s == 86400
    assert {m.account for m in spec.models} == {"proj123"}
    assert {m.sbatch_args for m in spec.models} == {("--constraint=a100",)}


def test_defaults_may_hold_every_model_key_but_name_and_model_path() -> None:
    text = f"""{LIMITS}
[defaults]
engine = "sim"
gpu_types = ["A100"]
gpus_per_replica = 1
min_replicas = 0
max_replicas = 3
ttft_p95 = "800ms"
idle_to_zero = "30m"
hold_requests = "1m"

[[model]]
name = "a"

[[model]]
name = "b"
min_replicas = 2
"""
    a, b = parse(text).models
    assert a == ModelService(
        name="a",
        engine="sim",
        gpu_types=("A100-80G",),
        gpus_per_replica=1,
        min_replicas=0,
        max_replicas=3,
        ttft_p95_s=0.8,
        idle_to_zero_s=1800.0,
        hold_requests_s=60.0,
    )
    assert b.min_replicas == 2 and b.max_replicas == 3 and b.idle_to_zero_s is None


def test_builtin_defaults_serve_one_replica_with_auto_gpus() -> None:
    (one,) = parse(f'{LIMITS}[[model]]\nname = "m"\nengine = "sim"\n').models
    assert (one.min_replicas, one.max_replicas, one.gpus_per_replica) == (1, 1, None)
    assert one.hold_requests_s == 180.0 and one.idle_to_zero_s is None
    assert one.ttft_p95_s is None and one.time_limit_s is None
    assert one.gpu_types == one.partitions == one.sbatch_args == ()
    (zero,) = parse(f'{LIMITS}[[model]]\nname = "m"\nengine = "sim"\nmin_replicas = 0\n').models
    assert (zero.min_replicas, zero.max_replicas, zero.idle_to_zero_s) == (0, 1, 600.0)


def test_the_example_in_the_reference_docs_is_a_valid_file() -> None:
    docs = Path(__file__).resolve().parents[3] / "docs" / "services.md"
    found = re.search(r"```toml\n(.*?)```", docs.read_text(encoding="utf-8"), re.S)
    assert found is not None
    spec = parse(found.group(1), "docs/services.md")
    assert spec == parse(FULL.replace("ttft_p95 = 0.5\n", ""))  # the same file, but for that


def test_a_file_without_models_declares_that_nothing_is_served() -> None:
    assert parse(LIMITS).models == ()


def test_gpu_aliases_are_normalised_to_catalog_names_in_the_order_given() -> None:
    text = f"""{LIMITS}[[model]]
name = "m"
engine = "sim"
gpu_types = ["h100 80gb hbm3", "a100", "RTX_4090", "v100"]
"""
    (model,) = parse(text).models
    assert model.gpu_types == ("H100-SXM", "A100-80G", "RTX-4090", "V100-32G")


def test_engine_templates_are_normalised_to_single_spaces_and_minimal_quotes() -> None:
    text = f"""{LIMITS}[[model]]
name = "m"
engine = '''
  vllm   serve "/scratch/my models/m"
      --port={{port}}   --served-model-name {{model}}
'''
"""
    (model,) = parse(text).models
    assert (
        model.engine
        == "vllm serve '/scratch/my models/m' --port={port} --served-model-name {model}"
    )
    assert join_command(["a b", "{x}", "it's"]) == "'a b' {x} 'it'\"'\"'s'"


def test_durations_and_time_limits_accept_every_documented_form() -> None:
    for written, seconds in [
        ('"500ms"', 0.5),
        ('"2s"', 2.0),
        ('"1m30s"', 90.0),
        ('"5m"', 300.0),
        ('"1.5s"', 1.5),
        ("2", 2.0),
        ("0.25", 0.25),
    ]:
        text = f'{LIMITS}[[model]]\nname = "m"\nengine = "sim"\nttft_p95 = {written}\n'
        assert parse(text).models[0].ttft_p95_s == seconds, written
    for written, limit in [
        ("2", 120),
        ('"30:00"', 1800),
        ('"2:00:00"', 7200),
        ('"1-12"', 129600),
        ('"2-00:30:00"', 174600),
    ]:
        text = f'{LIMITS}[[model]]\nname = "m"\nengine = "sim"\ntime_limit = {written}\n'
        assert parse(text).models[0].time_limit_s == limit, written
    assert [format_duration(s) for s in (0.5, 2, 90, 600, 3600, 1.234)] == [
        "500ms",
        "2s",
        "90s",
        "10m",
        "1h",
        "1234ms",
    ]
    assert format_time_limit(7200) == "02:00:00" and format_time_limit(90061) == "1-01:01:01"


# -- problems, each with its line ----------------------------------------------------------------

M = '[[model]]\nname = "m"\nengine = "sim"\n'
N = '[[model]]\nname = "n"\nengine = "sim"\n'

ERRORS = [
    # (test id, file, where, key, part of the message); the line is the one marked "# <-".
    ("unknown top-level key", f"services = 1 # <-\n{LIMITS}", "", "services", "allowed: version"),
    ("version", f"version = 2 # <-\n{LIMITS}", "", "version", "unsupported format version 2"),
    ("defaults not a table", f"defaults = 3 # <-\n{LIMITS}", "", "defaults", "expected a table"),
    (
        "unknown defaults key, with a guess",
        f'{LIMITS}[defaults]\npartition = ["gpu"] # <-\n',
        "[defaults]",
        "partition",
        "did you mean partitions?",
    ),
    (
        "name is no default",
        f'{LIMITS}[defaults]\nname = "x" # <-\n',
        "[defaults]",
        "name",
        "cannot be a default",
    ),
    (
        "bad default",
        f'{LIMITS}[defaults]\ntime_limit = "1:00" # <-\n{M}',
        "[defaults]",
        "time_limit",
        "under 2 minutes",
    ),
    ("limits missing key", "[limits] # <-\nmax_jobs = 1\n", "[limits]", "max_gpus", "missing"),
    (
        "limits unknown key",
        f"{LIMITS}max_nodes = 3 # <-\n",
        "[limits]",
        "max_nodes",
        "allowed: max_jobs, max_gpus",
    ),
    (
        "limits zero",
        "[limits]\nmax_jobs = 0 # <-\nmax_gpus = 1\n",
        "[limits]",
        "max_jobs",
        "expected 1..",
    ),
    (
        "limits quoted number",
        '[limits]\nmax_jobs = 1\nmax_gpus = "64" # <-\n',
        "[limits]",
        "max_gpus",
        "expected an integer (without quotes)",
    ),
    (
        "[model] instead of [[model]]",
        f'{LIMITS}[model] # <-\nname = "m"\n',
        "",
        "model",
        "write [[model]], not [model]",
    ),
    (
        "unknown model key, with hints",
        f"{LIMITS}{M}gpus = 2 # <-\n",
        '[[model]] "m"',
        "gpus",
        "did you mean gpu_types (the allowed GPU types) or gpus_per_replica (how many)?",
    ),
    (
        "a limit in a model",
        f"{LIMITS}{M}max_jobs = 2 # <-\n",
        '[[model]] "m"',
        "max_jobs",
        "belongs in [limits]",
    ),
    (
        "name missing",
        f'{LIMITS}[[model]] # <-\nengine = "sim"\n',
        "[[model]] #1",
        "name",
        "missing",
    ),
    (
        "name with a space",
        f'{LIMITS}[[model]]\nname = "my model" # <-\nengine = "sim"\n',
        "[[model]] #1",
        "name",
        "contains spaces",
    ),
    (
        "name not a string",
        f'{LIMITS}[[model]]\nname = 7 # <-\nengine = "sim"\n',
        "[[model]] #1",
        "name",
        "got an integer",
    ),
    (
        "duplicate name, case-insensitively",
        f'{LIMITS}{M}[[model]]\nname = "M" # <-\nengine = "sim"\n',
        '[[model]] "M"',
        "name",
        "already the name of the [[model]] at line 5 (names are compared case-insensitively)",
    ),
    (
        "engine missing",
        f'{LIMITS}[[model]] # <-\nname = "m"\n',
        '[[model]] "m"',
        "engine",
        "missing",
    ),
    (
        "engine unknown placeholder",
        f'{LIMITS}[[model]]\nname = "m"\nengine = "vllm serve {{modle}} --port {{port}}" # <-\n',
        '[[model]] "m"',
        "engine",
        "unknown placeholder {modle}",
    ),
    (
        "engine without port",
        f'{LIMITS}[[model]]\nname = "m"\nengine = "vllm serve {{model}}" # <-\n',
        '[[model]] "m"',
        "engine",
        "must pass {port}",
    ),
    (
        "engine empty",
        f'{LIMITS}[[model]]\nname = "m"\nengine = "  " # <-\n',
        '[[model]] "m"',
        "engine",
        "empty",
    ),
    (
        "engine shorthand unknown",
        f'{LIMITS}[[model]]\nname = "m"\nengine = "tgi" # <-\n',
        '[[model]] "m"',
        "engine",
        "must pass {port}",
    ),
    (
        "model_path unused",
        f'{LIMITS}[[model]]\nname = "m"\nengine = "x {{model}} --port {{port}}"\n'
        'model_path = "/m" # <-\n',
        '[[model]] "m"',
        "model_path",
        "does not use {model_path}",
    ),
    (
        "unknown GPU type, at its entry",
        f'{LIMITS}{M}gpu_types = [\n  "A100",\n  "B200", # <-\n]\n',
        '[[model]] "m"',
        "gpu_types",
        'unknown GPU type "B200" (known: A100-40G',
    ),
    (
        "GPU type twice, by alias",
        f'{LIMITS}{M}gpu_types = ["A100-80G",\n "a100"] # <-\n',
        '[[model]] "m"',
        "gpu_types",
        '"a100" is the same as "A100-80G"',
    ),
    (
        "Slurm GPU types not one per GPU type",
        f'{LIMITS}{M}gpu_types = ["A100-80G", "H100"]\ngres_types = ["a100"] # <-\n',
        '[[model]] "m"',
        "gres_types",
        "1 Slurm GPU type(s) for 2 gpu_types: give Slurm's name of each GPU type",
    ),
    (
        "Slurm GPU type with a colon",
        f'{LIMITS}{M}gres_types = ["a100:2"] # <-\n',
        '[[model]] "m"',
        "gres_types",
        "contains :",
    ),
    (
        "GPU types empty",
        f"{LIMITS}{M}gpu_types = [] # <-\n",
        '[[model]] "m"',
        "gpu_types",
        "omit the key",
    ),
    (
        "GPU types a string",
        f'{LIMITS}{M}gpu_types = "A100" # <-\n',
        '[[model]] "m"',
        "gpu_types",
        'write ["A100"]',
    ),
    (
        "gpus_per_replica zero",
        f"{LIMITS}{M}gpus_per_replica = 0 # <-\n",
        '[[model]] "m"',
        "gpus_per_replica",
        'or "auto"',
    ),
    (
        "gpus_per_replica a boolean",
        f"{LIMITS}{M}gpus_per_replica = true # <-\n",
        '[[model]] "m"',
        "gpus_per_replica",
        "got true",
    ),
    (
        "gpus_per_replica over max_gpus",
        f"{LIMITS}{M}gpus_per_replica = 32 # <-\nmin_replicas = 0\n",
        '[[model]] "m"',
        "gpus_per_replica",
        "more than [limits] max_gpus 16",
    ),
    (
        "min_replicas negative",
        f"{LIMITS}{M}min_replicas = -1 # <-\n",
        '[[model]] "m"',
        "min_replicas",
        "expected 0..",
    ),
    (
        "max_replicas zero",
        f"{LIMITS}{M}min_replicas = 0\nmax_replicas = 0 # <-\n",
        '[[model]] "m"',
        "max_replicas",
        "expected 1..",
    ),
    (
        "min above max",
        f"{LIMITS}{M}min_replicas = 3\nmax_replicas = 2 # <-\n",
        '[[model]] "m"',
        "max_replicas",
        "2 is below min_replicas 3",
    ),
    (
        "min above a default max",
        f"{LIMITS}[defaults]\nmax_replicas = 2\n{M}min_replicas = 3 # <-\n",
        '[[model]] "m"',
        "min_replicas",
        "3 is above max_replicas 2 (from [defaults])",
    ),
    (
        "ttft zero",
        f'{LIMITS}{M}ttft_p95 = "0ms" # <-\n',
        '[[model]] "m"',
        "ttft_p95",
        "more than 0",
    ),
    (
        "ttft unit",
        f'{LIMITS}{M}ttft_p95 = "2 sec" # <-\n',
        '[[model]] "m"',
        "ttft_p95",
        'like "500ms"',
    ),
    (
        "ttft nan",
        f"{LIMITS}{M}ttft_p95 = nan # <-\n",
        '[[model]] "m"',
        "ttft_p95",
        "got nan",
    ),
    (
        "ttft too long: meant ms",
        f"{LIMITS}{M}ttft_p95 = 2000 # <-\n",
        '[[model]] "m"',
        "ttft_p95",
        "at most 10m",
    ),
    (
        "idle_to_zero on a model that keeps replicas",
        f'{LIMITS}{M}idle_to_zero = "5m" # <-\n',
        '[[model]] "m"',
        "idle_to_zero",
        "only to a model that scales to zero",
    ),
    (
        "hold_requests negative",
        f"{LIMITS}{M}hold_requests = -1 # <-\n",
        '[[model]] "m"',
        "hold_requests",
        "0 or more",
    ),
    (
        "partitions empty",
        f"{LIMITS}{M}partitions = [] # <-\n",
        '[[model]] "m"',
        "partitions",
        "empty list",
    ),
    (
        "partitions a string",
        f'{LIMITS}{M}partitions = "gpu" # <-\n',
        '[[model]] "m"',
        "partitions",
        'write ["gpu"]',
    ),
    (
        "partition empty",
        f'{LIMITS}{M}partitions = ["gpu", ""] # <-\n',
        '[[model]] "m"',
        "partitions",
        "empty string",
    ),
    (
        "partition with a comma",
        f'{LIMITS}{M}partitions = ["gpu,cpu"] # <-\n',
        '[[model]] "m"',
        "partitions",
        "contains ,",
    ),
    (
        "partition twice",
        f'{LIMITS}{M}partitions = ["gpu", "gpu"] # <-\n',
        '[[model]] "m"',
        "partitions",
        "listed twice",
    ),
    (
        "account with a space",
        f'{LIMITS}{M}account = "my proj" # <-\n',
        '[[model]] "m"',
        "account",
        "contains spaces",
    ),
    (
        "time limit under 2 minutes",
        f"{LIMITS}{M}time_limit = 1 # <-\n",
        '[[model]] "m"',
        "time_limit",
        "under 2 minutes",
    ),
    (
        "time limit unlimited",
        f'{LIMITS}{M}time_limit = "UNLIMITED" # <-\n',
        '[[model]] "m"',
        "time_limit",
        "omit time_limit for the partition's default",
    ),
    (
        "time limit a float",
        f"{LIMITS}{M}time_limit = 90.5 # <-\n",
        '[[model]] "m"',
        "time_limit",
        "expected a Slurm time limit",
    ),
    (
        "sbatch argument that is no option",
        f'{LIMITS}{M}sbatch_args = ["constraint=a100"] # <-\n',
        '[[model]] "m"',
        "sbatch_args",
        "is not an sbatch option",
    ),
    (
        "sbatch option with a key of its own",
        f'{LIMITS}{M}sbatch_args = ["--mem=8G",\n "--partition=x"] # <-\n',
        '[[model]] "m"',
        "sbatch_args",
        "--partition=x is not allowed here: use the partitions key",
    ),
    (
        "sbatch short option",
        f'{LIMITS}{M}sbatch_args = ["-C", "a100",\n "-t", "5"] # <-\n',
        '[[model]] "m"',
        "sbatch_args",
        "-t is not allowed here: use the time_limit key",
    ),
    (
        "sbatch abbreviated option",
        f'{LIMITS}{M}sbatch_args = ["--gre=gpu:2"] # <-\n',
        '[[model]] "m"',
        "sbatch_args",
        "use gpus_per_replica",
    ),
    (
        "min_replicas over max_jobs",
        f"[limits]\nmax_jobs = 2 # <-\nmax_gpus = 16\n{M}min_replicas = 2\n{N}",
        "[limits]",
        "max_jobs",
        "2 is less than the 3 jobs the models' min_replicas need: m 2, n 1",
    ),
    (
        "min_replicas over max_gpus",
        f"[limits]\nmax_jobs = 9\nmax_gpus = 4 # <-\n{M}min_replicas = 2\ngpus_per_replica = 2\n"
        f"{N}",
        "[limits]",
        "max_gpus",
        "4 is less than the 5 GPUs the models' min_replicas need (auto counts 1 GPU per replica)",
    ),
]


@pytest.mark.parametrize(
    ("text", "where", "key", "message"),
    [case[1:] for case in ERRORS],
    ids=[case[0] for case in ERRORS],
)
def test_each_problem_names_its_line_table_and_key(
    text: str, where: str, key: str, message: str
) -> None:
    found = problems(text)
    assert len(found) == 1, found
    ((line, got_where, got_key, got_message),) = found
    assert (line, got_where, got_key) == (marked_line(text), where, key)
    assert message in got_message


def test_missing_limits_is_a_problem_of_the_whole_file() -> None:
    ((line, where, key, message),) = problems(M)
    assert (line, where, key) == (0, "[limits]", "")
    assert "max_jobs and max_gpus are required" in message
    with pytest.raises(ServiceFileError) as caught:
        parse(M, "services.toml")
    assert str(caught.value).startswith("services.toml: [limits]: missing")


def test_every_problem_is_reported_together_in_line_order() -> None:
    text = """\
version = 3
[defaults]
partition = "gpu"
time_limit = "1:00"

[limits]
max_jobs = 1
max_gpus = 2

[[model]]
name = "A"
engine = "vllm serve {modle} --port {port}"
min_replicas = 3
max_replicas = 2

[[model]]
name = "a"
engine = "vllm"
gpu_types = ["B200"]
ttft_p95 = "2 sec"
"""
    found = problems(text)
    assert [(line, key) for line, _, key, _ in found] == [
        (1, "version"),
        (3, "partition"),
        (4, "time_limit"),
        (7, "max_jobs"),  # 3 + 1 jobs: each model that checked counts
        (8, "max_gpus"),
        (12, "engine"),
        (14, "max_replicas"),
        (17, "name"),
        (19, "gpu_types"),
        (20, "ttft_p95"),
    ]
    with pytest.raises(ServiceFileError) as caught:
        parse(text, "services.toml")
    lines = str(caught.value).splitlines()
    assert lines[0] == "services.toml: 10 problems:"
    assert (
        lines[1]
        == "services.toml:1: version: unsupported format version 3 (this fabric reads version 1)"
    )
    assert lines[5].startswith("services.toml:8: [limits] max_gpus: 2 is less than the 4 GPUs")
    assert lines[7] == 'services.toml:14: [[model]] "A" max_replicas: 2 is below min_replicas 3'
    assert len(lines) == 11


def test_a_bad_default_is_reported_once_not_for_every_model() -> None:
    text = f'{LIMITS}[defaults]\nengine = "nope"\n{M}{N}'
    assert [(line, key) for line, _, key, _ in problems(text)] == [(5, "engine")]


def test_service_file_error_is_a_config_error_printed_as_one_line() -> None:
    with pytest.raises(ConfigError) as caught:
        parse(f"{LIMITS}{M}max_replicas = 0\n", "services.toml")
    assert isinstance(caught.value, ServiceFileError)
    assert str(caught.value) == (
        'services.toml:7: [[model]] "m" max_replicas: expected 1..1024, got 0'
    )


@pytest.mark.parametrize(
    ("text", "line", "message"),
    [
        ("[limits]\nmax_jobs = 1\nmax_gpus = \n[[model]]\n", 3, "Invalid value (column 12)"),
        ("[limits\nmax_jobs = 1\n", 1, "Expected ']' at the end of a table declaration"),
        ("[limits]\nmax_jobs = 1\nmax_jobs = 2\n", 3, "Cannot overwrite a value"),
        ('[limits]\nmax_jobs = "1\n', 2, "Illegal character"),
        ('[limits]\nmax_jobs = """1\n', 2, "Unterminated string (at the end of the file)"),
    ],
)
def test_toml_syntax_errors_name_the_line_tomllib_gives(text: str, line: int, message: str) -> None:
    ((got_line, where, key, got),) = problems(text)
    assert (got_line, where, key) == (line, "", "")
    assert got.startswith("not valid TOML: ") and message in got


def test_lines_are_found_past_strings_comments_inline_tables_and_dotted_keys() -> None:
    text = '''\
limits = { max_jobs = 4, max_gpus = 8 }
[[model]]
name = "a"
engine = """
max_replicas = 0
[[model]]
vllm serve {model} --port {port}"""
"min_replicas" = 2  # [[model]] in a comment
max_replicas = 1
[[model]]
name = 'b'  # "quoted # not a comment
engine = 'sim'
sbatch_args = [ "--exclusive", # a comment between entries
  "--mem=8G", [] ]
[[ model ]]
name = "c"
engine = "sim"
model.nested = 1
'''
    found = problems(text)
    assert [(line, where, key) for line, where, key, _ in found] == [
        (9, '[[model]] "a"', "max_replicas"),  # not line 5, inside the string
        (14, '[[model]] "b"', "sbatch_args"),  # the entry, on the array's second line
        (18, '[[model]] "c"', "model"),  # the dotted key makes a key "model" in the table
    ]
    assert "expected an sbatch option (a string), got a list" in found[1][3]
    found = problems(text.replace("max_gpus = 8", 'max_gpus = "8"'))
    assert found[0][:3] == (1, "[limits]", "max_gpus")  # in the inline table


def test_load_names_the_file_and_reports_an_unreadable_one(tmp_path: Path) -> None:
    path = tmp_path / "services.toml"
    path.write_text(FULL)
    assert load(path) == parse(FULL)
    with pytest.raises(ServiceFileError, match=r"^.*missing\.toml: cannot read the service file"):
        load(tmp_path / "missing.toml")
    path.write_bytes(b"\xff\xfe")
    with pytest.raises(ServiceFileError, match="not UTF-8"):
        load(path)
    path.write_text(f"{LIMITS}{M}max_replicas = 0\n")
    with pytest.raises(ServiceFileError, match=rf"^{re.escape(str(path))}:7: "):
        load(path)


# -- canonical bytes ---------------------------------------------------------------------------

SAME_AS_FULL = """\
[[model]]
engine = "sim"
name = "tiny-sim"
account = "proj123"
partitions = ['gpu-preempt', 'gpu']
sbatch_args = ["--constraint=a100"]
qos = "normal"
time_limit = 120            # minutes
min_replicas = 1

[limits]
max_gpus = 64
max_jobs = 32

[defaults]
time_limit = "0-02:00"
sbatch_args = ["--constraint=a100"]
qos = "normal"
account = "proj123"
partitions = ["gpu-preempt", "gpu"]

[[model]]
min_replicas = 1
max_replicas = 2
name = "qwen2.5-72b"
model_path = "/scratch/models/Qwen2.5-72B-Instruct"
engine = "vllm   serve   {model_path} --served-model-name {model} --tensor-parallel-size {tp} --host {host} --port {port}"
ttft_p95 = "500ms"
partitions = ["gpu-long"]
time_limit = "24:00:00"

[[model]]
name = "llama-3.1-8b"
hold_requests = 180
idle_to_zero = 600.0
ttft_p95 = "2000ms"
max_replicas = 4
min_replicas = 0
gpus_per_replica = 2
gpu_types = ["a100-80gb", "H100-SXM5"]
gres_types = ["a100", "h100"]
engine = "vllm serve /scratch/models/Llama-3.1-8B --served-model-name {model} --port {port} --tensor-parallel-size {tp}"
"""  # noqa: E501


def test_canonical_bytes_depend_on_meaning_not_on_how_the_file_is_written() -> None:
    spec = parse(FULL)
    other = parse(SAME_AS_FULL)
    assert other == spec
    assert other.canonical() == spec.canonical() and other.digest() == spec.digest()
    assert spec.canonical() == parse(spec.to_toml()).canonical()


def test_digest_is_16_hex_digits_and_changes_with_any_value() -> None:
    spec = parse(FULL)
    assert len(spec.digest()) == 16 and int(spec.digest(), 16) >= 0
    changed = parse(FULL.replace("max_replicas = 4", "max_replicas = 5"))
    assert changed.digest() != spec.digest()
    assert parse(FULL.replace('"proj123"', '"proj124"')).digest() != spec.digest()


def test_canonical_bytes_are_a_domain_tagged_fixed_order_array() -> None:
    spec = parse(FULL)
    domain, version, limits, models = msgpack.unpackb(spec.canonical(), raw=False)
    assert (domain, version, limits) == (DOMAIN, 1, [32, 64])
    assert [row[0] for row in models] == ["llama-3.1-8b", "qwen2.5-72b", "tiny-sim"]
    assert models[0][7:10] == [2000, 600000, 180000]  # durations in whole milliseconds
    assert models[1][8] is None  # no idle_to_zero: it does not scale to zero
    # keys added later come last, each only up to the last one set (ROW_EXTENSIONS)
    assert models[0][15:] == [None, ["a100", "h100"]] and len(models[1]) == 15


def test_from_canonical_accepts_only_canonical_bytes_that_check() -> None:
    spec = parse(FULL)
    data = spec.canonical()
    domain, version, limits, models = msgpack.unpackb(data, raw=False)

    def packed(*fields: object) -> bytes:
        return bytes(msgpack.packb(list(fields), use_bin_type=True))

    assert from_canonical(packed(domain, version, limits, models)) == spec
    for bad, message in [
        (b"\xc1", "undecodable msgpack"),
        (data + b"\x00", "undecodable msgpack"),
        (b"\x91" + b"\xc4\x00" * (1 << 20), "exceeds"),
        (packed(b"fabric/other/v1", version, limits, models), r"not a \[domain"),
        (packed(domain, 2, limits, models), "unsupported format version 2"),
        (packed(domain, version, [32, 0], models), "max_gpus"),
        (packed(domain, version, limits, models[::-1]), "not in canonical form"),
        (packed(domain, version, limits, [models[0][:14]]), "malformed model"),
        (packed(domain, version, limits, [[*models[0], None, None, None, None]]), "malformed"),
        (packed(domain, version, limits, [[*models[1], None]]), "not in canonical form"),
        (packed(domain, version, limits, [[*models[0][:3], ["B200"], *models[0][4:]]]), "B200"),
        (packed(domain, version, limits, [[*models[0][:7], "2s", *models[0][8:]]]), "ttft_p95"),
        (packed(domain, version, limits, [[*models[0][:3], ["A100"], *models[0][4:]]]), "canon"),
    ]:
        with pytest.raises(DecodeError, match=message):
            from_canonical(bad)


# -- laws ----------------------------------------------------------------------------------------

GPU_NAMES = sorted(builtin_catalog().gpus)
WORD = st.text(
    st.characters(categories=("L", "N", "P", "S"), exclude_characters=","), min_size=1, max_size=12
)
ENGINE_WORDS = st.lists(st.text("ab -'\"\\/=.é", max_size=6), max_size=3)
SBATCH = st.lists(
    st.sampled_from(["--exclusive", "--constraint=a100", "--mem=64G", '--mail-user=a "note"']),
    unique=True,
    max_size=3,
).map(tuple)


SITE_NAMES = st.from_regex(r"[A-Za-z0-9]([A-Za-z0-9_-]{0,6}[A-Za-z0-9])?", fullmatch=True)


@st.composite
def model_services(draw: st.DrawFn, name: str) -> ModelService:
    words = draw(ENGINE_WORDS)
    kind = draw(st.sampled_from(["sim", "path", "model"]))
    model_path = None
    if kind == "sim":
        engine = "sim"
    else:
        target = "{model_path}" if kind == "path" else "{model}"
        engine = join_command(["serve", *words, target, "--port", "{port}"])
        if kind == "path":
            model_path = draw(
                st.none()
                | st.text(
                    st.characters(categories=("L", "N"), include_characters=" /"), min_size=1
                ).filter(str.strip)
            )
    low = draw(st.integers(0, 3))
    ms = st.integers(1, 600_000)
    sites = tuple(sorted(draw(st.lists(SITE_NAMES, unique=True, max_size=3))))
    preferred = draw(st.integers(0, len(sites)))
    return ModelService(
        name=name,
        engine=engine,
        model_path=model_path,
        gpu_types=tuple(draw(st.lists(st.sampled_from(GPU_NAMES), unique=True, max_size=3))),
        gpus_per_replica=draw(st.none() | st.integers(1, 8)),
        min_replicas=low,
        max_replicas=draw(st.integers(max(low, 1), 6)),
        ttft_p95_s=draw(st.none() | ms.map(lambda n: n / 1000)),
        idle_to_zero_s=draw(ms.map(lambda n: n / 1000)) if low == 0 else None,
        hold_requests_s=draw(st.integers(0, 3_600_000).map(lambda n: n / 1000)),
        partitions=tuple(draw(st.lists(WORD, unique=True, max_size=3))),
        account=draw(st.none() | WORD),
        qos=draw(st.none() | WORD),
        time_limit_s=draw(st.none() | st.integers(120, 365 * 86400)),
        sbatch_args=draw(SBATCH),
        sleep_after_s=draw(st.none() | ms.map(lambda n: n / 1000)),
        scale_in_hold_s=draw(st.none() | st.integers(0, 86_400_000).map(lambda n: n / 1000)),
        sites=sites,
        prefer_sites=tuple(draw(st.permutations(sites))[:preferred]) if sites else (),
    )


@st.composite
def specs(draw: st.DrawFn) -> ServiceSpec:
    names = draw(st.lists(WORD, unique_by=str.casefold, max_size=4))
    models = [draw(model_services(name)) for name in names]
    jobs = sum(m.min_replicas for m in models)
    gpus = sum(m.min_replicas * (m.gpus_per_replica or 1) for m in models)
    widest = max((m.gpus_per_replica or 1 for m in models), default=1)
    return ServiceSpec(
        Limits(
            max_jobs=max(1, jobs) + draw(st.integers(0, 5)),
            max_gpus=max(1, gpus, widest) + draw(st.integers(0, 5)),
        ),
        tuple(models),
    )


@settings(max_examples=200, deadline=None)
@given(specs())
def test_a_rendered_spec_parses_back_to_the_same_spec_and_bytes(spec: ServiceSpec) -> None:
    again = parse(spec.to_toml())
    assert again == spec
    assert again.canonical() == spec.canonical()
    assert from_canonical(spec.canonical()) == spec


@settings(max_examples=100, deadline=None)
@given(specs(), st.randoms(use_true_random=False))
def test_canonical_bytes_ignore_the_order_of_keys_and_models(
    spec: ServiceSpec, rng: random.Random
) -> None:
    blocks = spec.to_toml().split("\n\n")
    head, tables = blocks[:2], blocks[2:]
    shuffled = []
    for table in tables:
        header, *keys = table.strip().splitlines()
        rng.shuffle(keys)
        shuffled.append("\n".join([header, *keys]))
    rng.shuffle(shuffled)
    text = "\n\n# a comment\n\n".join([*head, *shuffled]) + "\n"
    assert parse(text).canonical() == spec.canonical()


@given(st.integers(120, 365 * 86400))
def test_time_limits_render_in_a_form_slurm_and_the_parser_read_back(seconds: int) -> None:
    assert parse_time_limit(format_time_limit(seconds)) == seconds


@settings(max_examples=100, deadline=None)
@given(specs(), st.data())
def test_an_unknown_key_anywhere_is_reported_at_its_own_line(
    spec: ServiceSpec, data: st.DataObject
) -> None:
    lines = spec.to_toml().splitlines()
    tables = [n for n, row in enumerate(lines) if row.startswith("[")]
    start = data.draw(st.sampled_from(tables))
    end = next((n for n in tables if n > start), len(lines))
    at = data.draw(st.integers(start + 1, end))
    lines.insert(at, "bogus_key = 1")
    found = problems("\n".join(lines) + "\n")
    assert [(line, key) for line, _, key, _ in found] == [(at + 1, "bogus_key")]


def toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return repr(value)


SCALARS = (
    st.booleans() | st.integers(-3, 70_000) | st.floats(allow_subnormal=False) | st.text(max_size=8)
)
VALUES = SCALARS | st.lists(SCALARS, max_size=3)
# Per key, values a person might write: most check, some do not.
LIKELY: dict[str, list[object]] = {
    "name": ["m", "n", "M", "a b", ""],
    "engine": ["sim", "vllm", "sglang", "x {model} --port {port}", "x {model_path} --port {port}"],
    "model_path": ["/m", "", "a b"],
    "gpu_types": [["A100"], ["h100", "a100-80gb"], [], "A100", ["B200"], ["a100", "A100-80G"]],
    "gres_types": [["a100"], ["a100", "h100"], [], "a100", ["a:b"], ["x", "x"]],
    "gpus_per_replica": ["auto", 1, 2, 0, 64],
    "min_replicas": [0, 1, 2, -1],
    "max_replicas": [1, 2, 4, 0],
    "ttft_p95": ["2s", 0.5, "0ms", 700, "1m30s"],
    "idle_to_zero": ["10m", 30, 0],
    "hold_requests": ["3m", 0, -1],
    "sleep_after": ["5m", 30, 0, "8d"],
    "scale_in_hold": ["5m", "0s", 30, "25h"],
    "sites": [["A"], ["eu-1", "us_2"], [], "A", ["a b"], ["A", "A"], ["A", "a"], ["-x"]],
    "prefer_sites": [["A"], ["us_2", "eu-1"], [], "A", ["A", "A"], ["B", "A"]],
    "partitions": [["gpu"], ["a", "b"], [], "gpu", ["a,b"], ["a", "a"]],
    "account": ["proj", "a b", ""],
    "qos": ["normal", 3],
    "time_limit": ["2:00:00", 120, 1, "UNLIMITED", "1-00:00"],
    "sbatch_args": [["--exclusive"], ["-C", "a100"], ["--time=5"], ["x"], ["--gres=gpu:1"]],
    "max_jobs": [1, 4, 50, 0],
    "max_gpus": [1, 8, 100, "8"],
    "bogus": [1],
}


def written(keys: list[str], always: tuple[str, ...] = ()) -> st.SearchStrategy[dict[str, object]]:
    """A table with ``always`` and some of ``keys``, each likely or arbitrary."""

    def value(key: str) -> st.SearchStrategy[object]:
        likely = st.sampled_from(LIKELY[key])
        return st.one_of(likely, likely, likely, likely, likely, VALUES)

    @st.composite
    def table(draw: st.DrawFn) -> dict[str, object]:
        chosen = draw(st.lists(st.sampled_from(keys), unique=True, max_size=4))
        return {key: draw(value(key)) for key in (*always, *chosen)}

    return table()


@settings(max_examples=300, deadline=None)
@given(
    st.lists(written([*MODEL_KEYS[2:], "bogus"], ("name", "engine")), max_size=3),
    written(["bogus"], ("max_jobs", "max_gpus")),
    st.none() | written([*MODEL_KEYS[1:], "bogus"]),
)
def test_whatever_is_written_parse_accepts_it_in_normal_form_or_lists_its_problems(
    models: list[dict[str, object]],
    limits: dict[str, object],
    defaults: dict[str, object] | None,
) -> None:
    rows = ["[limits]", *(f"{k} = {toml_value(v)}" for k, v in limits.items())]
    if defaults is not None:
        rows += ["[defaults]", *(f"{k} = {toml_value(v)}" for k, v in defaults.items())]
    for model in models:
        rows += ["[[model]]", *(f"{k} = {toml_value(v)}" for k, v in model.items())]
    try:
        spec = parse("\n".join(rows) + "\n", "fuzz.toml")
    except ServiceFileError as exc:
        assert exc.problems and all(p.line > 0 for p in exc.problems)
        assert all(str(p).startswith(f"fuzz.toml:{p.line}: ") for p in exc.problems)
        return
    assert parse(spec.to_toml()) == spec
    assert from_canonical(spec.canonical()) == spec


def test_sleep_after_is_a_duration_passed_to_the_jobs_and_absent_it_signs_as_before() -> None:
    without = parse(FULL)
    with_it = parse(FULL.replace('qos = "normal"\n', 'qos = "normal"\nsleep_after = "5m"\n', 1))
    assert {m.sleep_after_s for m in without.models} == {None}
    assert {m.sleep_after_s for m in with_it.models} == {300.0}
    rows = msgpack.unpackb(without.canonical(), raw=False)[3]
    assert [len(row) for row in rows] == [17, 15, 15]  # the last two as before the key existed
    rows = msgpack.unpackb(with_it.canonical(), raw=False)[3]
    assert {row[15] for row in rows} == {300_000}
    assert from_canonical(with_it.canonical()) == with_it
    assert from_canonical(without.canonical()) == without
    assert parse(with_it.to_toml()) == with_it
    assert with_it.models[0].to_json()["sleep_after_s"] == 300.0
    with pytest.raises(ServiceFileError, match="sleep_after"):
        parse(FULL.replace('qos = "normal"\n', 'qos = "normal"\nsleep_after = 0\n', 1))

    plan = plans_of(with_it).models[0]
    assert plan.service.sleep_after_s == 300.0
    argv = SlurmControl("mesh", Path("/x.sbatch"), "me", dry_run=True).sbatch_argv(
        Submit(plan, plan.placements()[0], MIN_REPLICAS)
    )
    agent = argv[argv.index("/x.sbatch") + 1 :]
    assert agent[agent.index("--sleep-after") + 1] == "300"
    plain = plans_of(without).models[0]
    argv = SlurmControl("mesh", Path("/x.sbatch"), "me", dry_run=True).sbatch_argv(
        Submit(plain, plain.placements()[0], MIN_REPLICAS)
    )
    assert "--sleep-after" not in argv


@pytest.mark.parametrize(
    ("args", "message"),
    [
        # getopt_long takes any unambiguous prefix: each of these is an option the controller owns.
        (["--ar=1-40"], "--ar=1-40 is not allowed here: use nothing: the controller submits one"),
        (["--qo=high"], "use the qos key"),
        (["--par=gpu"], "use the partitions key"),
        (["--comment=mine"], "the controller tags its jobs with it"),
        (["--co=mine"], "the controller tags its jobs with it"),
        (["--exp=ALL,FABRIC_ENGINE=x"], "the controller sets the job's environment"),
        (["--export-file=env"], "the controller sets the job's environment"),
        (["--sig=KILL@10"], "the warning before the time limit"),
        (["--wait"], "must not wait for the job to end"),
        (["-W"], "must not wait for the job to end"),
        (["-M", "other"], "lists its jobs on this cluster"),
        (["-vp", "gpu"], "use the partitions key"),  # getopt's cluster: -v -p gpu
        (["-Cx", "-Jname"], "the controller names its jobs"),
        # A word that is no option's value would be sbatch's script.
        (["--constraint", "a100"], "a long option's value goes after ="),
        (["--exclusive", "evil.sh"], "is not an sbatch option"),
        (["-C"], "needs a value"),
        (["--"], "ends sbatch's options"),
        (["-Z"], "-Z is not an sbatch option"),
    ],
)
def test_sbatch_args_are_read_as_sbatchs_getopt_reads_them(args: list[str], message: str) -> None:
    text = f"{LIMITS}{M}sbatch_args = {json.dumps(args)} # <-\n"
    ((line, _, key, got),) = problems(text)
    assert (line, key) == (marked_line(text), "sbatch_args")
    assert message in got


def test_sbatch_args_sbatch_reads_as_others_pass() -> None:
    args = [
        "--exclusive",
        "-C",
        "a100",
        "--mem=64G",
        "-vC",
        "ib",
        "--time-min=10",
        "--gres-flags=enforce-binding",
    ]
    spec = parse(f"{LIMITS}{M}sbatch_args = {json.dumps(args)}\n", "services.toml")
    assert spec.models[0].sbatch_args == tuple(args)


def test_scale_in_hold_is_a_bounded_duration_and_absent_it_signs_as_before() -> None:
    without = parse(FULL)
    with_it = parse(FULL.replace('qos = "normal"\n', 'qos = "normal"\nscale_in_hold = "90s"\n', 1))
    assert {m.scale_in_hold_s for m in without.models} == {None}
    assert {m.scale_in_hold_s for m in with_it.models} == {90.0}
    assert without.canonical() == parse(FULL).canonical()
    rows = msgpack.unpackb(with_it.canonical(), raw=False)[3]
    assert {row[17] for row in rows} == {90_000}
    assert from_canonical(with_it.canonical()) == with_it
    assert parse(with_it.to_toml()) == with_it
    assert with_it.models[0].to_json()["scale_in_hold_s"] == 90.0
    zero = parse(FULL.replace('qos = "normal"\n', 'qos = "normal"\nscale_in_hold = "0s"\n', 1))
    assert {m.scale_in_hold_s for m in zero.models} == {0.0}
    for bad in ('"25h"', '"soon"', "-1"):
        with pytest.raises(ServiceFileError, match="scale_in_hold"):
            parse(FULL.replace('qos = "normal"\n', f'qos = "normal"\nscale_in_hold = {bad}\n', 1))


def test_sites_limit_where_a_model_is_served_and_absent_it_signs_as_before() -> None:
    without = parse(FULL)
    text = FULL.replace('name = "tiny-sim"\n', 'name = "tiny-sim"\nsites = ["eu-2", "A"]\n', 1)
    with_it = parse(text)
    assert {m.name: m.sites for m in with_it.models}["tiny-sim"] == ("A", "eu-2")  # sorted
    assert {m.sites for m in without.models} == {()}
    assert without.canonical() == parse(FULL).canonical()
    rows = {row[0]: row for row in msgpack.unpackb(with_it.canonical(), raw=False)[3]}
    assert rows["tiny-sim"][18] == ["A", "eu-2"] and len(rows["qwen2.5-72b"]) == 15
    assert from_canonical(with_it.canonical()) == with_it
    assert parse(with_it.to_toml()) == with_it
    assert with_it.model("tiny-sim").to_json()["sites"] == ["A", "eu-2"]  # type: ignore[union-attr]
    # the order the file lists them in means nothing: the same spec, the same signature
    swapped = parse(text.replace('["eu-2", "A"]', '["A", "eu-2"]'))
    assert swapped.canonical() == with_it.canonical()


def test_prefer_sites_keeps_its_order_signs_it_and_stays_within_the_sites() -> None:
    text = FULL.replace(
        'name = "tiny-sim"\n',
        'name = "tiny-sim"\nsites = ["A", "B"]\nprefer_sites = ["B", "A"]\n',
        1,
    )
    spec = parse(text)
    tiny = spec.model("tiny-sim")
    assert tiny is not None and tiny.prefer_sites == ("B", "A")  # the order is the preference
    rows = {row[0]: row for row in msgpack.unpackb(spec.canonical(), raw=False)[3]}
    assert rows["tiny-sim"][19] == ["B", "A"] and len(rows["qwen2.5-72b"]) == 15
    assert from_canonical(spec.canonical()) == spec
    assert parse(spec.to_toml()) == spec
    assert tiny.to_json()["prefer_sites"] == ["B", "A"]
    swapped = parse(text.replace('["B", "A"]\n', '["A", "B"]\n'))
    assert swapped.canonical() != spec.canonical()  # another preference, another file
    # a preferred site the model may not be served at (data residency) is refused
    outside = text.replace('prefer_sites = ["B", "A"]', 'prefer_sites = ["B", "C"]  # <-')
    found = problems(outside)
    assert len(found) == 1
    line, where, key, said = found[0]
    assert (line, where, key) == (marked_line(outside), '[[model]] "tiny-sim"', "prefer_sites")
    assert "C not in sites (A, B)" in said
    # without sites, any site may be preferred
    free = parse(text.replace('sites = ["A", "B"]\n', "", 1))
    assert free.model("tiny-sim").prefer_sites == ("B", "A")  # type: ignore[union-attr]


def test_sites_in_defaults_apply_to_every_model_that_does_not_set_its_own() -> None:
    text = FULL.replace('qos = "normal"\n', 'qos = "normal"\nsites = ["A"]\n', 1)
    text = text.replace('name = "tiny-sim"\n', 'name = "tiny-sim"\nsites = ["C"]\n', 1)
    assert {m.name: m.sites for m in parse(text).models} == {
        "llama-3.1-8b": ("A",),
        "qwen2.5-72b": ("A",),
        "tiny-sim": ("C",),
    }


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ('"A"', 'expected a list of site names (write ["A"])'),
        ("[]", "empty list: omit the key instead"),
        ('["A", "A"]', '"A" is listed twice'),
        ('["A", "a b"]', "ASCII letters, digits"),
        ('["-x"]', "beginning and ending with a letter or a digit"),
        (f'["{"x" * 33}"]', "at most 32 characters"),
        ("[3]", "expected a site name (a string), got an integer"),
    ],
)
def test_a_bad_sites_value_is_reported_at_its_line(value: str, message: str) -> None:
    text = f'{LIMITS}\n[[model]]\nname = "m"\nengine = "sim"\nsites = {value}  # <-\n'
    found = problems(text)
    assert len(found) == 1
    line, where, key, said = found[0]
    assert (line, where, key) == (marked_line(text), '[[model]] "m"', "sites")
    assert message in said
