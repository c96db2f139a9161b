"""Prometheus text parsing and engine load extraction (vLLM, SGLang); nothing in a page raises."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import generate_latest
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from fabricnode.engine.metrics import (
    EngineLoad,
    Sample,
    engine_load,
    parse_engine_load,
    parse_line,
    parse_samples,
)
from fabricnode.metricfamilies import gauge, registry_of

MODEL = "meta-llama/Llama-3.1-8B-Instruct"

# Excerpt of a vLLM (V1 engine) /metrics page: process metrics, gauges, counters with _total and
# _created samples, a histogram.
VLLM_PAGE = f"""\
# HELP python_gc_objects_collected_total Objects collected during gc
# TYPE python_gc_objects_collected_total counter
python_gc_objects_collected_total{{generation="0"}} 13262.0
python_gc_objects_collected_total{{generation="1"}} 1803.0
# HELP process_resident_memory_bytes Resident memory size in bytes.
# TYPE process_resident_memory_bytes gauge
process_resident_memory_bytes 6.55261696e+08
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{engine="0",model_name="{MODEL}"}} 3.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{{engine="0",model_name="{MODEL}"}} 1.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{{engine="0",model_name="{MODEL}"}} 0.4217
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{{engine="0",model_name="{MODEL}"}} 12800.0
# HELP vllm:prefix_cache_queries_created Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_created gauge
vllm:prefix_cache_queries_created{{engine="0",model_name="{MODEL}"}} 1.7637787361954e+09
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{{engine="0",model_name="{MODEL}"}} 6400.0
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{{engine="0",le="0.001",model_name="{MODEL}"}} 0.0
vllm:time_to_first_token_seconds_bucket{{engine="0",le="+Inf",model_name="{MODEL}"}} 41.0
vllm:time_to_first_token_seconds_count{{engine="0",model_name="{MODEL}"}} 41.0
vllm:time_to_first_token_seconds_sum{{engine="0",model_name="{MODEL}"}} 5.311
"""

# An older vLLM (V0 engine) page: gpu_cache_usage_perc, no engine label, gpu_prefix_* counters.
VLLM_V0_PAGE = f"""\
# HELP vllm:num_requests_running Number of requests currently running on GPU.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{model_name="{MODEL}"}} 7.0
# HELP vllm:num_requests_swapped Number of requests swapped to CPU.
# TYPE vllm:num_requests_swapped gauge
vllm:num_requests_swapped{{model_name="{MODEL}"}} 0.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{{model_name="{MODEL}"}} 12.0
# HELP vllm:gpu_cache_usage_perc GPU KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{{model_name="{MODEL}"}} 0.9871
# HELP vllm:gpu_prefix_cache_queries_total GPU prefix cache queries.
# TYPE vllm:gpu_prefix_cache_queries_total counter
vllm:gpu_prefix_cache_queries_total{{model_name="{MODEL}"}} 1000.0
# HELP vllm:gpu_prefix_cache_hits_total GPU prefix cache hits.
# TYPE vllm:gpu_prefix_cache_hits_total counter
vllm:gpu_prefix_cache_hits_total{{model_name="{MODEL}"}} 250.0
"""

# A data-parallel vLLM: one label set per engine.
VLLM_DP_PAGE = f"""\
vllm:num_requests_running{{engine="0",model_name="{MODEL}"}} 2.0
vllm:num_requests_running{{engine="1",model_name="{MODEL}"}} 5.0
vllm:num_requests_waiting{{engine="0",model_name="{MODEL}"}} 0.0
vllm:num_requests_waiting{{engine="1",model_name="{MODEL}"}} 4.0
vllm:kv_cache_usage_perc{{engine="0",model_name="{MODEL}"}} 0.25
vllm:kv_cache_usage_perc{{engine="1",model_name="{MODEL}"}} 0.75
"""

# SGLang's /metrics (enable_metrics): gauges labelled by model name.
SGLANG_PAGE = f"""\
# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{{model_name="{MODEL}"}} 4.0
# HELP sglang:num_used_tokens The number of used tokens.
# TYPE sglang:num_used_tokens gauge
sglang:num_used_tokens{{model_name="{MODEL}"}} 5212.0
# HELP sglang:token_usage The token usage.
# TYPE sglang:token_usage gauge
sglang:token_usage{{model_name="{MODEL}"}} 0.28
# HELP sglang:gen_throughput The generation throughput (token/s).
# TYPE sglang:gen_throughput gauge
sglang:gen_throughput{{model_name="{MODEL}"}} 412.66
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{{model_name="{MODEL}"}} 2.0
# HELP sglang:cache_hit_rate The prefix cache hit rate.
# TYPE sglang:cache_hit_rate gauge
sglang:cache_hit_rate{{model_name="{MODEL}"}} 0.0075
"""


# -- the text format -----------------------------------------------------------------------------


def test_samples_of_a_real_page_parse_and_comments_are_skipped() -> None:
    samples = parse_samples(VLLM_PAGE)
    assert len(samples) == 13
    assert samples[0] == Sample(
        "python_gc_objects_collected_total", (("generation", "0"),), 13262.0
    )
    assert samples[2] == Sample("process_resident_memory_bytes", (), 6.55261696e08)
    bucket = [s for s in samples if s.label("le") == "+Inf"]
    assert len(bucket) == 1 and bucket[0].value == 41.0


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ('m{a="x\\"y"} 1', Sample("m", (("a", 'x"y'),), 1.0)),
        (
            'm{a="back\\\\slash",b="new\\nline"} 2',
            Sample("m", (("a", "back\\slash"), ("b", "new\nline")), 2.0),
        ),
        ('m{a="}{,= "} 3', Sample("m", (("a", "}{,= "),), 3.0)),
        ('m{a="1",} 4', Sample("m", (("a", "1"),), 4.0)),
        ("m{} 5", Sample("m", (), 5.0)),
        ('m{ a = "1" , b="2" } 6', Sample("m", (("a", "1"), ("b", "2")), 6.0)),
        ("m 7 1700000000000", Sample("m", (), 7.0)),
        ('m_total 8 # {trace_id="abc"} 1.0', Sample("m_total", (), 8.0)),
        ("m\t9\r", Sample("m", (), 9.0)),
        ("m -1.5e-3", Sample("m", (), -0.0015)),
        ("m .5", Sample("m", (), 0.5)),
        ('m{a="\\q"} 1', Sample("m", (("a", "\\q"),), 1.0)),
    ],
)
def test_sample_line_forms(line: str, expected: Sample) -> None:
    assert parse_line(line) == expected


def test_special_values() -> None:
    values = [parse_line(f"m {text}") for text in ("+Inf", "-Inf", "Inf", "NaN", "nan")]
    assert [s.value if s else None for s in values[:3]] == [math.inf, -math.inf, math.inf]
    assert all(s is not None and math.isnan(s.value) for s in values[3:])


@pytest.mark.parametrize(
    "line",
    [
        "",
        "# HELP m help",
        "#m 1",
        "m",
        "m{",
        'm{a="1" 1',
        'm{a="1} 1',
        "m{a=1} 1",
        'm{1a="x"} 1',
        'm{a="1"b="2"} 1',
        "m{a} 1",
        "1m 1",
        "m-x 1",
        "m one",
        "m 1_000",
        "m 0x10",
        "m 1 later",
        'm{a="1"}1',
        "{} 1",
    ],
)
def test_malformed_lines_are_skipped(line: str) -> None:
    assert parse_line(line) is None


def test_malformed_lines_do_not_hide_good_ones() -> None:
    text = "garbage here\nvllm:num_requests_running{x=} 9\nvllm:num_requests_running 2\n\x00\n"
    assert parse_engine_load(text) == EngineLoad(kind="vllm", running=2)


# Names and values our pages (prometheus-client, fabricnode.metricfamilies) can hold.
_names = st.from_regex(r"\A[a-zA-Z_:][a-zA-Z0-9_:]{0,20}\Z")
_label_keys = st.from_regex(r"\A[a-zA-Z_][a-zA-Z0-9_]{0,10}\Z")
_label_values = st.text(max_size=20)


@given(
    name=_names,
    labels=st.dictionaries(_label_keys, _label_values, max_size=4),
    value=st.floats(allow_nan=False) | st.integers(-(2**53), 2**53),
)
def test_what_our_writer_writes_parses_back(
    name: str, labels: dict[str, str], value: float
) -> None:
    family = gauge(name, "help", value, labels)
    page = generate_latest(registry_of(_Families([family]))).decode()
    samples = parse_samples(page)
    # prometheus-client writes the labels sorted by name
    assert samples == [Sample(name, tuple(sorted(labels.items())), float(value))]


class _Families(Collector):
    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> list[Metric]:
        return self.families


@given(st.text())
def test_arbitrary_text_never_raises(text: str) -> None:
    for sample in parse_samples(text):
        assert isinstance(sample.value, float)
    load = parse_engine_load(text)
    assert load.waiting >= 0 and load.running >= 0 and 0.0 <= load.kv_usage <= 1.0


_line_parts = st.sampled_from(
    [
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "sglang:token_usage",
        "{",
        "}",
        '"',
        "\\",
        "=",
        ",",
        " ",
        "\n",
        "#",
        'model_name="m"',
        "1",
        "-2.5",
        "NaN",
        "+Inf",
        "-Inf",
        "1e308",
        "9e999",
    ]
)


@given(st.lists(_line_parts, max_size=40).map("".join))
def test_near_miss_pages_never_raise(text: str) -> None:
    load = parse_engine_load(text)
    assert load.waiting >= 0 and load.running >= 0 and 0.0 <= load.kv_usage <= 1.0
    assert load.prefix_hits is None and load.prefix_queries is None


# -- engine load ---------------------------------------------------------------------------------


def test_vllm_load() -> None:
    load = parse_engine_load(VLLM_PAGE)
    assert load == EngineLoad("vllm", 1, 3, 0.4217, 6400.0, 12800.0)
    assert load.prefix_hit_rate == 0.5


def test_older_vllm_names_are_understood() -> None:
    assert parse_engine_load(VLLM_V0_PAGE) == EngineLoad("vllm", 12, 7, 0.9871, 250.0, 1000.0)


def test_data_parallel_vllm_sums_requests_and_takes_the_fullest_kv_cache() -> None:
    load = parse_engine_load(VLLM_DP_PAGE)
    assert (load.waiting, load.running, load.kv_usage) == (4, 7, 0.75)
    assert load.prefix_hits is None and load.prefix_hit_rate is None


def test_new_kv_name_wins_over_old_when_both_are_present() -> None:
    text = "vllm:kv_cache_usage_perc 0.2\nvllm:gpu_cache_usage_perc 0.9\n"
    assert parse_engine_load(text).kv_usage == 0.2


def test_sglang_load() -> None:
    load = parse_engine_load(SGLANG_PAGE)
    assert load == EngineLoad("sglang", 2, 4, 0.28, None, None)


def test_sglang_ranks_are_summed() -> None:
    text = (
        'sglang:num_running_reqs{dp_rank="0",model_name="m"} 3\n'
        'sglang:num_running_reqs{dp_rank="1",model_name="m"} 4\n'
        'sglang:num_queue_reqs{dp_rank="0",model_name="m"} 1\n'
        'sglang:num_queue_reqs{dp_rank="1",model_name="m"} 0\n'
    )
    assert parse_engine_load(text) == EngineLoad("sglang", 1, 7, 0.0)


def test_page_without_engine_metrics_is_unknown_and_empty() -> None:
    assert parse_engine_load("process_cpu_seconds_total 12.5\n") == EngineLoad()
    assert parse_engine_load("") == EngineLoad()


def test_nan_inf_and_out_of_range_values_are_tamed() -> None:
    text = (
        "vllm:num_requests_running NaN\n"
        "vllm:num_requests_waiting +Inf\n"
        "vllm:num_requests_waiting -3\n"
        "vllm:kv_cache_usage_perc 1.7\n"
        "vllm:prefix_cache_hits_total NaN\n"
    )
    load = parse_engine_load(text)
    assert (load.running, load.waiting, load.kv_usage) == (0, 0, 1.0)
    assert load.prefix_hits is None  # only a NaN sample: as if absent


def test_engine_load_accepts_samples_directly() -> None:
    samples = [Sample("vllm:num_requests_running", (("model_name", "a"),), 1.0)] * 3
    assert engine_load(samples).running == 3


def test_prefix_hit_rate_is_none_without_queries() -> None:
    assert EngineLoad("vllm", prefix_hits=0.0, prefix_queries=0.0).prefix_hit_rate is None
