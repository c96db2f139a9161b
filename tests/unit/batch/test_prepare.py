"""`fabric batch submit`'s input rules (fabricnode.batch.prepare): what each kind of line becomes,
and the problems that stop a file before anything is sent."""

from __future__ import annotations

import json
from typing import Any

import pytest

from fabricnode.batch.prepare import Prepared, prepare_input
from fabricnode.batch.validate import ENDPOINTS, MAX_ERRORS, Problem, validate_input


def prepared(data: bytes | str, **kwargs: Any) -> Prepared:
    raw = data.encode() if isinstance(data, str) else data
    out = prepare_input(raw, **kwargs)
    assert isinstance(out, Prepared), out
    return out


def lines_of(p: Prepared) -> list[dict[str, Any] | None]:
    """The uploaded file's lines, None for a blank one."""
    text = p.data.decode()
    assert text.endswith("\n")
    return [json.loads(line) if line else None for line in text[:-1].split("\n")]


def problems(data: str, **kwargs: Any) -> list[Problem]:
    out = prepare_input(data.encode(), **kwargs)
    assert isinstance(out, list), out
    return out


def test_a_line_of_text_becomes_a_chat_request_named_by_its_line_number() -> None:
    p = prepared("What is 2+2?\nName a colour.\n", model="m")
    assert lines_of(p) == [
        {
            "custom_id": "line-1",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": "m", "messages": [{"role": "user", "content": "What is 2+2?"}]},
        },
        {
            "custom_id": "line-2",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": "m", "messages": [{"role": "user", "content": "Name a colour."}]},
        },
    ]
    assert (p.endpoint, p.requests, p.prompts, p.models) == ("/v1/chat/completions", 2, 2, ("m",))


def test_a_json_string_is_a_prompt_and_text_that_parses_as_a_number_stays_text() -> None:
    p = prepared('"line one\\nline two"\n2024\ntrue\n', model="m")
    contents = [line["body"]["messages"][0]["content"] for line in lines_of(p) if line]
    assert contents == ["line one\nline two", "2024", "true"]


@pytest.mark.parametrize("text", ['"Hello," she said.', "[INST] Hi [/INST]", "  indented prompt"])
def test_lines_that_only_look_like_json_are_prompts(text: str) -> None:
    (line,) = lines_of(prepared(text + "\n", model="m"))
    assert line is not None and line["body"]["messages"][0]["content"] == text


def test_a_json_object_without_body_is_the_body_and_its_custom_id_names_the_request() -> None:
    p = prepared(
        '{"model": "x", "messages": [{"role": "user", "content": "hi"}], "temperature": 0}\n'
        '{"custom_id": "q7", "model": "x", "messages": []}\n'
    )
    first, second = lines_of(p)
    assert first is not None and second is not None
    assert first == {
        "custom_id": "line-1",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": "x", "messages": [{"role": "user", "content": "hi"}], "temperature": 0},
    }
    assert second["custom_id"] == "q7" and "custom_id" not in second["body"]
    assert p.prompts == 0


def test_an_openai_batch_line_passes_and_gets_what_it_lacks() -> None:
    full = {
        "custom_id": "a",
        "method": "POST",
        "url": "/v1/completions",
        "body": {"model": "m", "prompt": "p"},
    }
    p = prepared(json.dumps(full) + "\n" + json.dumps({"body": {"model": "m", "prompt": "q"}}))
    assert lines_of(p) == [
        full,
        {"body": {"model": "m", "prompt": "q"}, "custom_id": "line-2", "method": "POST",
         "url": "/v1/completions"},
    ]  # fmt: skip
    assert p.endpoint == "/v1/completions", "the endpoint comes from the file's url"


@pytest.mark.parametrize(
    ("endpoint", "body"),
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "t"}]}),
        ("/v1/completions", {"prompt": "t"}),
        ("/v1/embeddings", {"input": "t"}),
    ],
)
def test_a_prompt_takes_the_shape_of_the_endpoint(endpoint: str, body: dict[str, Any]) -> None:
    (line,) = lines_of(prepared("t\n", endpoint=endpoint, model="m"))
    assert line is not None
    assert line["url"] == endpoint and line["body"] == {"model": "m", **body}


def test_model_and_max_tokens_replace_those_of_every_line() -> None:
    p = prepared(
        '{"model": "old", "max_tokens": 900, "messages": []}\nplain\n', model="new", max_tokens=8
    )
    bodies = [line["body"] for line in lines_of(p) if line]
    assert [(b["model"], b["max_tokens"]) for b in bodies] == [("new", 8), ("new", 8)]
    assert next(iter(bodies[0])) == "model"
    assert p.models == ("new",)


def test_without_model_every_line_must_name_one() -> None:
    found = problems('{"model": "m", "messages": []}\nno model here\n\nnor here\n')
    assert [(p.line, p.code) for p in found] == [(2, "missing_model"), (4, "missing_model")]
    assert prepared('{"model": "a", "messages": []}\n{"model": "b", "messages": []}').models == (
        "a",
        "b",
    )


def test_blank_lines_stay_so_that_the_agent_names_the_researchers_line_numbers() -> None:
    data = "\nfirst\n\n   \nsecond\r\n"
    p = prepared(data, model="m")
    assert [line["custom_id"] if line else None for line in lines_of(p)] == [
        None,
        "line-2",
        None,
        None,
        "line-5",
    ]
    # The agent's validation counts lines the same way: a bad line 5 is reported as line 5.
    plan = validate_input(p.data, p.endpoint, known_model=lambda m: m == "m", shard_size=10)
    assert not isinstance(plan, list) and plan.lines == 2
    found = validate_input(p.data, p.endpoint, known_model=lambda m: False, shard_size=10)
    assert isinstance(found, list) and [x.line for x in found] == [2, 5]


def test_broken_json_lines_and_arrays_are_problems_with_their_line() -> None:
    found = problems('fine\n{"messages": [\n["a", "b"]\n\xff\n', model="m")
    assert [(p.line, p.code) for p in found] == [(2, "invalid_json_line"), (3, "invalid_json_line")]
    assert "column" in found[0].message and "array" in found[1].message
    bad_utf8 = prepare_input(b"ok\n\xff\xfe\n", model="m")
    assert isinstance(bad_utf8, list)
    assert [(p.line, p.code) for p in bad_utf8] == [(2, "invalid_encoding")]


def test_an_empty_file_is_a_problem_and_a_bom_is_skipped() -> None:
    assert [p.code for p in problems("\n\n  \n", model="m")] == ["empty_file"]
    (line,) = lines_of(prepared(b"\xef\xbb\xbfhello\n", model="m"))
    assert line is not None and line["body"]["messages"][0]["content"] == "hello"


def test_problems_are_in_line_order_and_capped() -> None:
    data = "".join(f"{{broken {i}\n" if i % 2 else f"prompt {i}\n" for i in range(300))
    found = problems(data)  # no model: every prompt line is a problem too
    assert len(found) == MAX_ERRORS + 1 and found[-1].code == "too_many_errors"
    lines = [p.line for p in found[:-1]]
    assert lines == sorted(lines) and lines[:3] == [1, 2, 3]
    assert found[-1].message == f"{300 - MAX_ERRORS} more problems are not listed"


def test_an_unknown_endpoint_is_refused() -> None:
    with pytest.raises(ValueError, match="/v1/responses"):
        prepare_input(b"x\n", endpoint="/v1/responses", model="m")
    assert "/v1/chat/completions" in ENDPOINTS
