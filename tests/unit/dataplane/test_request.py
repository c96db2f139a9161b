"""The pure request decoder: every check before routing, its order, statuses and messages, the
header grammars, and the one OpenAI error body of the public port."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fabricnode.control.app import error_response
from fabricnode.dataplane.apikeys import ApiKeyStore, RateLimiter
from fabricnode.dataplane.request import (
    KEY_REJECTION,
    Rejection,
    Requirements,
    Routed,
    authorize,
    decode,
    error_body,
    malformed_code,
    parse_providers,
    parse_require,
    prompt_text,
)

FP_A = "a1b2c3d4e5f60718"
BODY = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}'
NOW = 100.0


def open_decode(body: bytes = BODY, kind: str = "chat", **headers: str) -> Routed | Rejection:
    raw = {k.replace("_", "-").encode(): v.encode("latin-1") for k, v in headers.items()}
    return decode(kind, raw, body, None, RateLimiter(), NOW)


def decoded(result: Routed | Rejection) -> Routed:
    assert isinstance(result, Routed), result
    return result


def rejected(result: Routed | Rejection, status: int, code: str) -> Rejection:
    assert isinstance(result, Rejection), "expected a rejection"
    assert (result.status, result.code) == (status, code), result
    return result


@pytest.fixture
def store(tmp_path: Path) -> ApiKeyStore:
    return ApiKeyStore.load(tmp_path / "api-keys.json")


# -- what passes ------------------------------------------------------------------------------


def test_an_open_ingress_decodes_model_stream_and_body() -> None:
    d = decoded(open_decode(b'{"model": "llama", "stream": true, "user": "u1"}'))
    assert (d.kind, d.model, d.stream, d.key) == ("chat", "llama", True, None)
    assert d.doc["user"] == "u1" and d.session_key == "u1"
    assert d.providers == frozenset() and d.requirements is None


@pytest.mark.parametrize(
    ("value", "stream"), [("true", True), ("false", False), ('"yes"', False), ("1", False)]
)
def test_only_a_json_true_asks_for_a_stream(value: str, stream: bool) -> None:
    assert decoded(open_decode(b'{"model": "m", "stream": %s}' % value.encode())).stream is stream


def test_embeddings_never_stream() -> None:
    assert not decoded(open_decode(b'{"model": "m", "stream": true}', "embeddings")).stream


def test_session_key_comes_from_the_header_before_the_user_field() -> None:
    body = b'{"model": "m", "user": "from-body"}'
    assert decoded(open_decode(body, x_session_id="from-header")).session_key == "from-header"
    assert decoded(open_decode(body)).session_key == "from-body"
    assert decoded(open_decode(b'{"model": "m", "user": ""}')).session_key is None
    assert decoded(open_decode(body, x_session_id="s" * 1000)).session_key == "s" * 256


def test_headers_narrow_the_nodes() -> None:
    d = decoded(open_decode(x_fabric_providers="p1, p2", x_fabric_require="gpu=H100,quant>=8"))
    assert d.providers == frozenset({"p1", "p2"})
    assert d.requirements == Requirements(gpu=frozenset({"h100"}), min_quant_bits=8)


# -- API keys ---------------------------------------------------------------------------------


def test_a_valid_key_is_decoded_with_the_request(store: ApiKeyStore) -> None:
    token, key = store.new_key("alice", now=1.0)
    headers = {b"authorization": f"Bearer {token}".encode()}
    d = decoded(decode("chat", headers, BODY, store, RateLimiter(), NOW))
    assert d.key == key


@pytest.mark.parametrize("header", [None, b"", b"Basic abc", b"Bearer", b"Bearer fab-nope"])
def test_a_missing_or_unknown_key_is_401(store: ApiKeyStore, header: bytes | None) -> None:
    store.new_key("alice", now=1.0)
    headers = {} if header is None else {b"authorization": header}
    why = rejected(
        decode("chat", headers, b"not json", store, RateLimiter(), NOW), 401, "invalid_api_key"
    )
    assert why.message == (
        "missing or invalid API key (Authorization: Bearer KEY, or x-api-key: KEY)"
    )


def test_rate_limit_is_429_with_retry_after_and_comes_before_the_body(store: ApiKeyStore) -> None:
    token, _ = store.new_key("alice", rate_per_s=0.5, burst=1, now=1.0)
    headers = {b"authorization": f"Bearer {token}".encode()}
    limiter = RateLimiter()
    decoded(decode("chat", headers, BODY, store, limiter, NOW))
    why = rejected(
        decode("chat", headers, b"not json", store, limiter, NOW), 429, "rate_limit_exceeded"
    )
    assert why.message == "rate limit of 0.5 requests/s exceeded"
    assert why.headers == [(b"retry-after", b"2")]
    decoded(decode("chat", headers, BODY, store, limiter, NOW + 2.0))  # a token again


def test_the_key_allowlist_always_applies_and_a_header_only_narrows_it(store: ApiKeyStore) -> None:
    token, _ = store.new_key("alice", ["p1", "p2"], now=1.0)
    auth = {b"authorization": f"Bearer {token}".encode()}
    d = decoded(decode("chat", auth, BODY, store, RateLimiter(), NOW))
    assert d.providers == frozenset({"p1", "p2"})
    narrowed = {**auth, b"x-fabric-providers": b"p2, p3"}
    assert decoded(decode("chat", narrowed, BODY, store, RateLimiter(), NOW)).providers == {"p2"}
    outside = {**auth, b"x-fabric-providers": b"p3"}
    why = rejected(decode("chat", outside, BODY, store, RateLimiter(), NOW), 400, "invalid_header")
    assert why.message == "X-Fabric-Providers names no provider this API key may use"


# -- bodies and headers -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "code", "message"),
    [
        (b"", "invalid_json", "request body is not valid JSON"),
        (b"{nope", "invalid_json", "request body is not valid JSON"),
        (b"[1, 2]", "invalid_json", "request body must be a JSON object"),
        (b'"model"', "invalid_json", "request body must be a JSON object"),
        (b"{}", "invalid_model", "'model' is required and must be a string"),
        (b'{"model": ""}', "invalid_model", "'model' is required and must be a string"),
        (b'{"model": 7}', "invalid_model", "'model' is required and must be a string"),
    ],
)
def test_a_bad_body_is_400(body: bytes, code: str, message: str) -> None:
    assert rejected(open_decode(body), 400, code).message == message


def test_the_model_is_checked_before_the_headers() -> None:
    rejected(open_decode(b"{}", x_fabric_require="vram>=80"), 400, "invalid_model")


@pytest.mark.parametrize(
    "headers",
    [{"x_fabric_require": "vram>=80"}, {"x_fabric_providers": " , "}, {"x_fabric_require": "gpu="}],
)
def test_a_bad_fabric_header_is_400_naming_it(headers: dict[str, str]) -> None:
    why = rejected(open_decode(**headers), 400, "invalid_header")
    assert "\n" not in why.message and why.message


@settings(max_examples=200, deadline=None)
@given(
    body=st.binary(max_size=200)
    | st.builds(
        lambda d: json.dumps(d).encode(),
        st.dictionaries(
            st.sampled_from(["model", "stream", "user", "messages", "prompt", "input"]),
            st.none()
            | st.booleans()
            | st.integers()
            | st.text(max_size=20)
            | st.lists(st.text(max_size=5), max_size=3),
        ),
    ),
    require=st.binary(max_size=80),
    providers=st.binary(max_size=80),
    session=st.binary(max_size=300),
    kind=st.sampled_from(
        ["chat", "completions", "embeddings", "responses", "messages", "rerank", "transcriptions"]
    ),
)
def test_arbitrary_input_decodes_or_is_refused_with_a_4xx(
    body: bytes, require: bytes, providers: bytes, session: bytes, kind: str
) -> None:
    headers = {
        b"x-fabric-require": require,
        b"x-fabric-providers": providers,
        b"x-session-id": session,
    }
    result = decode(kind, headers, body, None, RateLimiter(), NOW)
    if isinstance(result, Rejection):
        assert 400 <= result.status < 500 and result.message and result.code
    else:
        assert isinstance(result.model, str) and result.model
        assert isinstance(prompt_text(result.doc, kind), str)


# -- prompt text ------------------------------------------------------------------------------


def test_prompt_text_per_endpoint() -> None:
    chat = {
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image_url"}]},
            "not a message",
        ]
    }
    assert prompt_text(chat, "chat") == "system\x1ebe brief\x1euser\x1ehi"
    assert prompt_text({"messages": "nope"}, "chat") == ""
    assert prompt_text({"prompt": "once upon"}, "completions") == "once upon"
    assert prompt_text({"prompt": ["first", "second"]}, "completions") == "first"
    assert prompt_text({"prompt": [1, 2, 3]}, "completions") == ""
    assert prompt_text({"input": "embed me"}, "embeddings") == "embed me"
    assert prompt_text({"prompt": "not for embeddings"}, "embeddings") == ""


def test_prompt_text_of_responses_and_messages_reads_them_like_chat() -> None:
    assert prompt_text({"input": "tell me"}, "responses") == "tell me"
    items = {"instructions": "be brief", "input": [{"role": "user", "content": "hi"}]}
    assert prompt_text(items, "responses") == "system\x1ebe brief\x1euser\x1ehi"
    anthropic = {
        "system": [{"type": "text", "text": "be brief"}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
    }
    assert prompt_text(anthropic, "messages") == "system\x1ebe brief\x1euser\x1ehi"
    assert prompt_text({**anthropic, "system": "short"}, "messages") == (
        "system\x1eshort\x1euser\x1ehi"
    )
    assert prompt_text({"query": "q"}, "rerank") == ""


# -- other endpoints ----------------------------------------------------------------------------


def test_responses_and_messages_may_stream_rerank_never() -> None:
    body = b'{"model": "m", "stream": true}'
    assert decoded(open_decode(body, "responses")).stream
    assert decoded(open_decode(body, "messages")).stream
    assert not decoded(open_decode(body, "rerank")).stream


FORM = (
    b'--B\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n\r\nRIFF\r\n'
    b'--B\r\nContent-Disposition: form-data; name="model"\r\n\r\nwhisper\r\n'
    b'--B\r\nContent-Disposition: form-data; name="stream"\r\n\r\ntrue\r\n--B--\r\n'
)


def test_an_audio_form_is_routed_by_its_model_field() -> None:
    d = decoded(open_decode(FORM, "transcriptions", content_type="multipart/form-data; boundary=B"))
    assert (d.kind, d.model, d.stream) == ("transcriptions", "whisper", True)


def test_an_audio_request_that_is_not_a_readable_form_is_400() -> None:
    rejected(open_decode(FORM, "transcriptions"), 400, "invalid_form")
    no_model = FORM.replace(b'name="model"', b'name="language"')
    ct = "multipart/form-data; boundary=B"
    rejected(open_decode(no_model, "translations", content_type=ct), 400, "invalid_model")
    # A JSON body for a JSON endpoint is never read as a form.
    rejected(open_decode(FORM, "chat", content_type=ct), 400, "invalid_json")


def test_anthropics_key_header_names_the_key_too(store: ApiKeyStore) -> None:
    token, key = store.new_key("alice", now=1.0)
    for headers in (
        {b"x-api-key": token.encode()},
        {b"x-api-key": b" " + token.encode() + b" "},
        {b"authorization": b"Bearer fab-nope", b"x-api-key": token.encode()},
    ):
        assert decoded(decode("messages", headers, BODY, store, RateLimiter(), NOW)).key == key
    rejected(
        decode("messages", {b"x-api-key": b"fab-nope"}, BODY, store, RateLimiter(), NOW),
        401,
        "invalid_api_key",
    )


def test_authorize_alone_checks_the_key_and_its_rate(store: ApiKeyStore) -> None:
    token, key = store.new_key("bob", rate_per_s=0.5, burst=1, now=1.0)
    limiter = RateLimiter()
    headers = {b"authorization": b"Bearer " + token.encode()}
    assert authorize(headers, store, limiter, NOW) == key
    limited = authorize(headers, store, limiter, NOW)
    assert isinstance(limited, Rejection) and limited.status == 429
    assert authorize({}, None, limiter, NOW) is None
    assert authorize({}, store, limiter, NOW) is KEY_REJECTION


# -- error bodies -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "kind"),
    [
        (400, "invalid_request_error"),
        (401, "authentication_error"),
        (403, "permission_error"),
        (404, "not_found_error"),
        (405, "invalid_request_error"),
        (413, "invalid_request_error"),
        (429, "rate_limit_error"),
        (500, "server_error"),
        (503, "server_error"),
    ],
)
def test_error_type_per_status_is_the_same_on_every_port(status: int, kind: str) -> None:
    doc = json.loads(error_body(status, "why", "some_code"))
    assert doc == {"error": {"message": "why", "type": kind, "code": "some_code"}}
    assert json.loads(error_response(status, "why", "some_code").body) == doc


def test_malformed_http_codes() -> None:
    assert malformed_code(431) == "headers_too_large"
    assert malformed_code(413) == "request_too_large"
    assert malformed_code(418) == "bad_request"


# -- header grammars --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("header", "expected"),
    [
        ("", Requirements()),
        ("  ", Requirements()),
        ("gpu=H100", Requirements(gpu=frozenset({"h100"}))),
        ("gpu=H100|A100-80G", Requirements(gpu=frozenset({"h100", "a100-80g"}))),
        ("quant>=8", Requirements(min_quant_bits=8)),
        ("ctx>=32768", Requirements(min_context=32768)),
        (
            " gpu = h100 , quant >= 16 , CTX>=4096 ",
            Requirements(gpu=frozenset({"h100"}), min_quant_bits=16, min_context=4096),
        ),
    ],
)
def test_parse_require_accepts_good_terms(header: str, expected: Requirements) -> None:
    assert parse_require(header) == expected


@pytest.mark.parametrize(
    ("header", "named"),
    [
        ("gpu=H100,", "empty requirement"),
        ("gpu", "'gpu'"),
        ("gpu>=H100", "'gpu>=H100'"),
        ("gpu=", "'gpu='"),
        ("gpu=H100||A100", "'gpu=H100||A100'"),
        ("quant=8", "'quant=8'"),
        ("quant>=eight", "'quant>=eight'"),
        ("quant>=64", "'quant>=64'"),
        ("ctx>=-5", "'ctx>=-5'"),
        ("ctx>=0", "'ctx>=0'"),
        ("ctx>=32k", "'ctx>=32k'"),
        ("vram>=80", "'vram>=80'"),
        ("quant>=8,quant>=4", "given twice"),
        ("gpu=" + "|".join(["H100"] * 40), "gpu needs"),
        ("gpu=" + "x" * 2000, "longer than"),
    ],
)
def test_parse_require_rejects_bad_terms_with_one_clear_line(header: str, named: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_require(header)
    message = str(info.value)
    assert named in message and "\n" not in message and len(message) < 200


def test_parse_providers_accepts_a_list() -> None:
    assert parse_providers("p1, p2") == frozenset({"p1", "p2"})
    assert parse_providers(FP_A) == frozenset({FP_A})


@pytest.mark.parametrize(
    ("header", "named"),
    [
        ("", "empty provider list"),
        (" , ", "empty provider list"),
        ("p1,,p2", "empty provider name"),
        (",".join(f"p{i}" for i in range(33)), "more than 32"),
        ("p" * 200, "longer than 128"),
        ("p," * 5000, "too long"),
    ],
)
def test_parse_providers_rejects_empty_and_oversized_lists(header: str, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        parse_providers(header)


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=120))
def test_parse_require_raises_only_value_error(header: str) -> None:
    try:
        parse_require(header)
    except ValueError as exc:
        assert "\n" not in str(exc)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.text(st.characters(blacklist_characters=","), min_size=1, max_size=20).filter(str.strip),
        min_size=1,
        max_size=32,
    )
)
def test_parse_providers_round_trips_a_list(items: list[str]) -> None:
    assert parse_providers(", ".join(items)) == frozenset(i.strip() for i in items)


def test_an_audio_form_that_names_its_model_twice_is_refused() -> None:
    """The engine reads the form again with its own parser, which takes the last ``model``
    where the ingress would take the first: routed by one model, served as another. One form,
    one model; the same for ``stream``, and before or after the file."""
    ct = "multipart/form-data; boundary=B"
    for field in (b"model", b"stream"):
        second = (
            b'--B\r\nContent-Disposition: form-data; name="%s"\r\n\r\nother\r\n--B--\r\n' % field
        )
        twice = FORM.removesuffix(b"--B--\r\n") + second
        r = rejected(open_decode(twice, "transcriptions", content_type=ct), 400, "invalid_form")
        assert "given twice" in r.message
    upper = FORM.removesuffix(b"--B--\r\n") + FORM.replace(b'name="model"', b'NAME="model"')
    r = rejected(open_decode(upper, "transcriptions", content_type=ct), 400, "invalid_form")
    assert "'model' given twice" in r.message


def test_an_audio_form_of_too_many_parts_is_refused() -> None:
    ct = "multipart/form-data; boundary=B"
    many = b'--B\r\nContent-Disposition: form-data; name="x"\r\n\r\n1\r\n' * 300
    r = rejected(open_decode(many + FORM, "transcriptions", content_type=ct), 400, "invalid_form")
    assert "more than 256 parts" in r.message


def test_forms_two_parsers_would_read_differently_are_refused() -> None:
    two_boundaries = "multipart/form-data; boundary=B; boundary=C"
    rejected(open_decode(FORM, "transcriptions", content_type=two_boundaries), 400, "invalid_form")
    renamed = FORM.replace(b'name="model"', b'name="stream"; name="model"')
    ct = "multipart/form-data; boundary=B"
    r = rejected(open_decode(renamed, "transcriptions", content_type=ct), 400, "invalid_form")
    assert "names itself twice" in r.message
