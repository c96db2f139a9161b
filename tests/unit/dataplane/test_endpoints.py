"""The endpoint table, the dialects' error shapes and stream error events, the response ids
that name their node, and reading the fields of a multipart form: pure, no sockets."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fabricnode.dataplane.endpoints import (
    ANTHROPIC_KINDS,
    ENDPOINTS,
    FORM_KINDS,
    RESPONSE_CANCEL,
    RESPONSE_GET,
    RESUMABLE_KINDS,
    anthropic_error_body,
    anthropic_path,
    last_sequence_number,
    node_of_response,
    parse_response_id,
    response_follow_up,
    response_id,
    site_of_response,
    stream_error_events,
)
from fabricnode.dataplane.multipart import boundary_of, form_fields
from fabricnode.dataplane.request import error_body, error_body_for

SID = "0123456789abcdef0123456789abcdef"

# == the table ===============================================================================


def test_every_model_addressed_vllm_endpoint_is_in_the_table() -> None:
    assert set(ENDPOINTS) == {
        b"/v1/chat/completions",
        b"/v1/completions",
        b"/v1/embeddings",
        b"/v1/responses",
        b"/v1/messages",
        b"/v1/messages/count_tokens",
        b"/v1/rerank",
        b"/rerank",
        b"/v2/rerank",
        b"/v1/score",
        b"/score",
        b"/pooling",
        b"/classify",
        b"/tokenize",
        b"/detokenize",
        b"/v1/audio/transcriptions",
        b"/v1/audio/translations",
    }
    # The agent's own paths never collide with a routed one.
    for own in (b"/health", b"/ready", b"/metrics", b"/version", b"/ping", b"/v1/models"):
        assert own not in ENDPOINTS
    assert {ENDPOINTS[b"/v1/messages"], ENDPOINTS[b"/v1/messages/count_tokens"]} == ANTHROPIC_KINDS
    audio = {ENDPOINTS[b"/v1/audio/transcriptions"], ENDPOINTS[b"/v1/audio/translations"]}
    assert audio == FORM_KINDS
    assert {"chat", "completions"} == RESUMABLE_KINDS


@pytest.mark.parametrize(
    ("path", "anthropic"),
    [
        (b"/v1/messages", True),
        (b"/v1/messages/count_tokens", True),
        (b"/v1/messagesx", False),
        (b"/v1/chat/completions", False),
        (b"/messages", False),
        (b"", False),
    ],
)
def test_the_anthropic_dialect_is_the_messages_paths(path: bytes, anthropic: bool) -> None:
    assert anthropic_path(path) is anthropic


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        (b"/v1/responses/resp_1", (RESPONSE_GET, "resp_1")),
        (b"/v1/responses/resp_1/cancel", (RESPONSE_CANCEL, "resp_1")),
        (b"/v1/responses/", None),
        (b"/v1/responses//cancel", None),
        (b"/v1/responses/a/b", None),
        (b"/v1/responses", None),
        (b"/v1/responses/" + b"x" * 300, None),
    ],
)
def test_stateful_responses_paths_are_recognised(
    path: bytes, expected: tuple[str, str] | None
) -> None:
    assert response_follow_up(path) == expected


# == response ids ============================================================================


def test_a_response_id_names_its_node_and_its_owner_tag() -> None:
    rid = response_id(SID, bytes(range(8)), bytes(range(8, 16)))
    assert rid == "resp_" + SID + "0001020304050607" + "08090a0b0c0d0e0f"
    assert len(rid) == 69
    assert node_of_response(rid) == SID
    assert parse_response_id(rid) == (SID, bytes(range(8)), bytes(range(8, 16)))
    # An id from before owner tags still names its node, with no tag.
    legacy = "resp_" + SID + "0001020304050607"
    assert node_of_response(legacy) == SID
    assert parse_response_id(legacy) == (SID, bytes(range(8)), None)


@given(
    sid=st.binary(min_size=16, max_size=16),
    nonce=st.binary(min_size=8, max_size=8),
    tag=st.binary(min_size=8, max_size=8),
    site=st.sampled_from(["", "C", "site-2", "eu.west_1", "0a" * 32]),
)
@settings(max_examples=50)
def test_any_node_nonce_tag_and_site_round_trip(
    sid: bytes, nonce: bytes, tag: bytes, site: str
) -> None:
    rid = response_id(sid.hex(), nonce, tag, site)
    assert node_of_response(rid) == sid.hex()
    assert parse_response_id(rid) == (sid.hex(), nonce, tag)
    assert site_of_response(rid) == site


@pytest.mark.parametrize("suffix", ["_", "_-x", "_" + "a" * 65, "_a b", "_a/b", "-C"])
def test_an_id_with_a_malformed_site_names_nothing(suffix: str) -> None:
    rid = response_id(SID, bytes(8), bytes(8)) + suffix
    assert node_of_response(rid) is None and site_of_response(rid) == ""


@pytest.mark.parametrize(
    "rid",
    [
        "resp_" + "0" * 32,  # vLLM's own: resp_<uuid hex>, no node
        "resp_" + SID.upper() + "0" * 16,
        "resp_" + SID + "0" * 15,
        "resp_" + SID + "0" * 17,
        "resp_" + SID + "0" * 33,
        "msg_" + SID + "0" * 16,
        "",
    ],
)
def test_ids_of_another_form_name_no_node(rid: str) -> None:
    assert node_of_response(rid) is None
    assert parse_response_id(rid) is None


def test_a_response_id_needs_a_session_id_and_eight_bytes() -> None:
    with pytest.raises(ValueError):
        response_id("abc", bytes(8), bytes(8))
    with pytest.raises(ValueError):
        response_id(SID, bytes(4), bytes(8))
    with pytest.raises(ValueError):
        response_id(SID, bytes(8), bytes(4))


# == errors in each dialect ==================================================================


@pytest.mark.parametrize(
    ("status", "kind"),
    [
        (400, "invalid_request_error"),
        (401, "authentication_error"),
        (403, "permission_error"),
        (404, "not_found_error"),
        (405, "invalid_request_error"),
        (413, "request_too_large"),
        (429, "rate_limit_error"),
        (502, "api_error"),
        (503, "overloaded_error"),
    ],
)
def test_anthropic_errors_have_anthropics_shape_and_types(status: int, kind: str) -> None:
    body = json.loads(anthropic_error_body(status, "why"))
    assert body == {"type": "error", "error": {"type": kind, "message": "why"}}
    assert json.loads(error_body_for(b"/v1/messages", status, "why", "c")) == body


def test_other_paths_keep_openais_shape() -> None:
    for path in (b"/v1/chat/completions", b"/v1/responses", b"/rerank", b""):
        assert error_body_for(path, 404, "why", "model_not_found") == error_body(
            404, "why", "model_not_found"
        )


def events(data: bytes) -> list[tuple[str, dict[str, object]]]:
    out = []
    for block in data.decode().split("\n\n"):
        if not block:
            continue
        lines = dict(line.split(": ", 1) for line in block.splitlines())
        out.append((lines.get("event", ""), json.loads(lines["data"])))
    return out


def test_a_broken_chat_stream_ends_with_the_openai_error_event() -> None:
    openai_body = error_body(502, "broke", "upstream_broken")
    data = stream_error_events("chat", 502, "broke", "upstream_broken", openai_body)
    assert data == b"data: " + openai_body + b"\n\n"


def test_a_broken_messages_stream_ends_with_anthropics_error_event() -> None:
    data = stream_error_events("messages", 502, "broke", "upstream_broken", b"")
    error = {"type": "error", "error": {"type": "api_error", "message": "broke"}}
    assert events(data) == [("error", error)]


def test_a_broken_responses_stream_ends_with_error_then_response_failed() -> None:
    data = stream_error_events(
        "responses",
        502,
        "broke",
        "upstream_broken",
        b"",
        response_id="resp_x",
        model="m",
        sequence_number=7,
        created_at=5,
    )
    (error_type, error), (failed_type, failed) = events(data)
    assert (error_type, failed_type) == ("error", "response.failed")
    assert error == {
        "type": "error",
        "code": "upstream_broken",
        "message": "broke",
        "param": None,
        "sequence_number": 7,
    }
    assert failed["type"] == "response.failed" and failed["sequence_number"] == 8
    response = failed["response"]
    assert isinstance(response, dict)
    assert response["id"] == "resp_x" and response["status"] == "failed"
    assert response["error"] == {"code": "server_error", "message": "broke"}


def test_the_sequence_number_of_the_last_event_is_read_back() -> None:
    delta = b'{"type":"response.output_text.delta","sequence_number": 12}'
    assert last_sequence_number(delta) == 12
    assert last_sequence_number(b'{"delta":"\\"sequence_number\\": 3"}') is None
    assert last_sequence_number(None) is None


# == multipart ===============================================================================


def form(parts: list[tuple[str, bytes, str | None]], boundary: bytes = b"XyZ") -> bytes:
    out = b""
    for name, value, filename in parts:
        disposition = b'form-data; name="%s"' % name.encode()
        if filename:
            disposition += b'; filename="%s"' % filename.encode()
        out += b"--" + boundary + b"\r\nContent-Disposition: " + disposition + b"\r\n"
        if filename:
            out += b"Content-Type: audio/wav\r\n"
        out += b"\r\n" + value + b"\r\n"
    return out + b"--" + boundary + b"--\r\n"


CT = b"multipart/form-data; boundary=XyZ"


def test_the_model_field_is_found_after_a_large_file() -> None:
    audio = b"\r\n--XY" * 200_000  # looks like delimiters, but not this form's
    body = form([("file", audio, "a.wav"), ("model", b"whisper", None), ("stream", b"true", None)])
    assert form_fields(body, CT, ("model", "stream")) == {"model": "whisper", "stream": "true"}


def test_fields_that_are_absent_are_left_out() -> None:
    body = form([("model", b"w", None), ("file", b"RIFF", "a.wav")])
    assert form_fields(body, CT, ("model", "stream")) == {"model": "w"}


def test_a_preamble_and_a_quoted_boundary_are_read() -> None:
    body = b"preamble\r\n" + form([("model", b"w", None)], boundary=b"a b;c")
    content_type = b'multipart/form-data; charset=utf-8; boundary="a b;c"'
    assert form_fields(body, content_type, ("model",)) == {"model": "w"}


def test_a_filename_is_not_taken_for_the_name() -> None:
    body = form([("file", b"x", "model"), ("model", b"w", None)])
    assert form_fields(body, CT, ("model",)) == {"model": "w"}


@pytest.mark.parametrize(
    ("content_type", "body", "why"),
    [
        (b"application/json", b"{}", "multipart/form-data"),
        (b"multipart/form-data", b"", "boundary"),
        (CT, b"no parts here", "no part"),
        (CT, b"--XyZ\r\nContent-Disposition: form-data; name=model\r\n\r\nw", "ends inside"),
        (CT, b"--XyZ\r\nContent-Disposition: form-data; name=model", "headers do not end"),
        (CT, form([("model", b"w" * 5000, None)]), "longer than"),
        (CT, form([("model", b"\xff\xfe", None)]), "UTF-8"),
    ],
)
def test_unreadable_forms_say_why(content_type: bytes, body: bytes, why: str) -> None:
    result = form_fields(body, content_type, ("model",))
    assert isinstance(result, str) and why in result


@pytest.mark.parametrize(
    ("content_type", "boundary"),
    [
        (b"multipart/form-data; boundary=abc", b"abc"),
        (b'Multipart/Form-Data; Boundary="a=b"', b"a=b"),
        (b"multipart/mixed; boundary=abc", None),
        (b"multipart/form-data; boundary=", None),
    ],
)
def test_the_boundary_comes_from_the_content_type(
    content_type: bytes, boundary: bytes | None
) -> None:
    assert boundary_of(content_type) == boundary


@given(st.binary(max_size=300))
@settings(max_examples=300)
def test_any_bytes_give_fields_or_a_reason_never_an_exception(data: bytes) -> None:
    result = form_fields(b"--XyZ\r\n" + data, CT, ("model", "stream"))
    assert isinstance(result, dict | str)
