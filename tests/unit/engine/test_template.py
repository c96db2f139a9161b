"""The engine template a JOIN-only node renders when an operator assigns it a model."""

from __future__ import annotations

import pytest

from fabricnode.config import load_config
from fabricnode.engine.template import parse_template
from fabricnode.errors import ConfigError

VLLM = "vllm serve {model_path} --served-model-name {model} -tp {tp} --port {port}"


def test_vllm_template_renders_one_argument_per_word_with_the_mapped_path() -> None:
    t = parse_template(VLLM, ["llama-2-13b=/scratch/my models/13b"])
    cmd = t.render("llama-2-13b", 2, 1)
    port = cmd.url.rsplit(":", 1)[1]
    assert cmd.argv == (
        "vllm", "serve", "/scratch/my models/13b", "--served-model-name", "llama-2-13b",
        "-tp", "2", "--port", port,
    )  # fmt: skip
    assert cmd.kind == "vllm" and cmd.model_hint == "llama-2-13b"
    assert cmd.url == f"http://127.0.0.1:{port}"
    assert parse_template(VLLM).render("m", 1, 1).argv[2] == "m"  # unmapped: the id itself


def test_sim_template_runs_the_simulated_engine_on_the_nodes_gpu_type() -> None:
    cmd = parse_template("sim").render("llama-3.1-8b", 1, 1, "A100-80G")
    assert "fabricnode.simengine" in cmd.argv and "A100-80G" in cmd.argv
    assert parse_template("sim").render("m", 1, 1, "GH200").argv[-1] == "H100"  # unknown: default


@pytest.mark.parametrize(
    ("text", "paths", "message"),
    [
        ("vllm serve {model}", (), "must pass {port}"),
        ("vllm serve --port {port}", (), "must name the model"),
        ("vllm serve {modle} --port {port}", (), "unknown placeholder {modle}"),
        ("vllm serve {model!r} --port {port}", (), "unknown placeholder"),
        ("vllm serve '{model} --port {port}", (), "No closing quotation"),
        ("", (), "empty"),
        ("   ", (), "empty"),
        (VLLM, ("no-equals",), "expected MODEL=PATH"),
    ],
)
def test_bad_templates_fail_at_start_with_one_clear_line(
    text: str, paths: tuple[str, ...], message: str
) -> None:
    with pytest.raises(ConfigError, match="|".join([message.replace("{", r"\{")])):
        parse_template(text, paths)


def test_literal_braces_survive_rendering() -> None:
    t = parse_template("run {model} --port {port} --json {{}}")
    assert t.render("m", 1, 1).argv[-1] == "{}"


def test_config_takes_template_and_trusted_operators_from_flags_or_environment(tmp_path) -> None:  # type: ignore[no-untyped-def]
    env = {
        "FABRIC_HOME": str(tmp_path),
        "USER": "u",
        "FABRIC_ENGINE_TEMPLATE": "sim",
        "FABRIC_TRUST_OPERATORS": "0123456789abcdef, FEDCBA9876543210",
    }
    cfg = load_config(env=env, rendezvous="")
    assert cfg.engine_template is not None and cfg.engine_template.simulated
    assert cfg.mesh.trusted_operators == ("0123456789abcdef", "fedcba9876543210")
    cfg = load_config(env=env, rendezvous="", trust_operators=["aaaaaaaaaaaaaaaa"])
    assert cfg.mesh.trusted_operators == ("aaaaaaaaaaaaaaaa",)
    # A node with its own engine ignores a site-wide template from the environment...
    assert load_config(env=env, rendezvous="", sim="m").engine_template is None
    # ...but a template flag next to an engine is a mistake.
    with pytest.raises(ConfigError, match="started without an engine"):
        load_config(env=env, rendezvous="", sim="m", engine_template="sim")
    with pytest.raises(ConfigError, match="16 hex digits"):
        load_config(env=env, rendezvous="", trust_operators=["not-a-fingerprint"])
    with pytest.raises(ConfigError, match="only applies with --engine-template"):
        load_config(env={"FABRIC_HOME": str(tmp_path), "USER": "u"}, model_paths=["a=b"])
