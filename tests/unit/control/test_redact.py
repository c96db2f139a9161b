"""Laws of the engine command's redaction (``control.redact``); the cases it must hide are in
tests/unit/ui/test_dashboard_api.py beside the view that shows the command."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from fabricnode.control.redact import HIDDEN, redact

SECRETS = st.text(alphabet="abcdefXYZ0123456789", min_size=12, max_size=20)
PLAIN = st.sampled_from(["vllm", "serve", "m", "--port", "8000", "--max-model-len", "4096", "-1"])
SECRET_FLAGS = st.sampled_from(["--api-key", "--hf-token", "--api_key", "--ssl-key-password"])


@given(st.lists(PLAIN | SECRET_FLAGS, max_size=12), st.lists(SECRETS, min_size=1, max_size=3))
def test_every_value_of_a_secret_option_is_hidden_and_nothing_else_moves(
    head: list[str], secrets: list[str]
) -> None:
    argv = [*head, "--api-key", *secrets, "--port", "8000"]
    shown = redact(argv)
    assert len(shown) == len(argv)
    assert not any(s in " ".join(shown) for s in secrets)
    assert shown[-2:] == ["--port", "8000"]
    assert redact(shown) == shown  # the asking agent redacts again: nothing changes


@given(SECRETS)
def test_a_secret_in_a_json_value_or_a_url_never_shows(secret: str) -> None:
    argv = [
        "--kv-transfer-config",
        '{"a": [{"token": "' + secret + '"}]}',
        "--model",
        f"s3://user:{secret}@bucket/m",
        f"--speculative-config=password={secret}",
    ]
    shown = redact(argv)
    assert secret not in " ".join(shown)
    assert HIDDEN in shown[1] and HIDDEN in shown[3] and HIDDEN in shown[4]
