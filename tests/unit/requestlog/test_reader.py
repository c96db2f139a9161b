"""Reading a request log whole."""

from __future__ import annotations

from pathlib import Path

import pytest

from fabricnode.errors import ConfigError
from fabricnode.requestlog.reader import read_request_log
from fabricnode.requestlog.writer import RequestLog
from tests.unit.requestlog.test_format import record


def test_reader_skips_a_torn_last_line_and_refuses_other_files(tmp_path: Path) -> None:
    path = tmp_path / "log.jsonl"
    log = RequestLog(path)
    log.append(record())
    log.flush()
    with path.open("a") as f:
        f.write('{"v": 1, "T": 12')
    assert read_request_log(path) == [record()]
    other = tmp_path / "workload.toml"
    other.write_text('[[model]]\nname = "m"\n')
    with pytest.raises(ConfigError, match="not a fabric request log"):
        read_request_log(other)
    with pytest.raises(ConfigError, match="does not exist"):
        read_request_log(tmp_path / "missing.jsonl")
