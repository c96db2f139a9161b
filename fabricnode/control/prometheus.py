"""A minimal writer of the Prometheus text exposition format (version 0.0.4).

Enough for ``/metrics`` without a client library: counters and gauges, labels escaped, one
``# HELP``/``# TYPE`` header per metric family however many samples it has.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class MetricsText:
    def __init__(self, prefix: str = "fabric_") -> None:
        self.prefix = prefix
        self._families: dict[str, tuple[str, str, list[str]]] = {}

    def counter(
        self, name: str, help_text: str, value: float, labels: Mapping[str, str] | None = None
    ) -> None:
        self._add(name, "counter", help_text, value, labels)

    def gauge(
        self, name: str, help_text: str, value: float, labels: Mapping[str, str] | None = None
    ) -> None:
        self._add(name, "gauge", help_text, value, labels)

    def _add(
        self,
        name: str,
        kind: str,
        help_text: str,
        value: float,
        labels: Mapping[str, str] | None,
    ) -> None:
        full = self.prefix + name
        family = self._families.setdefault(full, (kind, help_text, []))
        label_text = ""
        if labels:
            inner = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
            label_text = "{" + inner + "}"
        family[2].append(f"{full}{label_text} {_number(value)}")

    def render(self) -> str:
        lines: list[str] = []
        for name, (kind, help_text, samples) in self._families.items():
            lines.append(f"# HELP {name} {help_text}")
            lines.append(f"# TYPE {name} {kind}")
            lines.extend(samples)
        return "\n".join(lines) + "\n"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(value: float) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, int):
        return str(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))
