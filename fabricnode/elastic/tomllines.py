"""The line of every key of a valid TOML document: where a service file's problems are.

tomllib gives no line numbers. Once tomllib has accepted a document, ``Locator`` scans it with a
small TOML tokenizer (it skips strings and comments, follows ``[[array]]`` headers, inline
tables and arrays) and records the first line of every table header, key and array element by
its path, e.g. ``("model", 2, "gpu_types", 1)``. ``Locator.line`` gives a path the line of its
longest recorded prefix, so a missing key points at its table's header. ``locate`` never raises:
on anything its tokenizer does not read, it gives no lines (0), never a wrong one.

Pure: text in, line numbers out.
"""

from __future__ import annotations

import re
import tomllib
from bisect import bisect_left
from collections.abc import Sequence


class _ScanError(Exception):
    """The locator met something it does not read (it then gives no lines, never a wrong one)."""


_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


def locate(text: str) -> Locator:
    try:
        return Locator(text)
    except (_ScanError, IndexError, ValueError):
        return Locator("")


class Locator:
    """The first line of every table header, key and array element of a valid TOML
    document, by path (module docstring)."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.lines: dict[tuple[object, ...], int] = {}
        self._newlines = [i for i, c in enumerate(text) if c == "\n"]
        self._arrays: dict[tuple[object, ...], int] = {}  # [[array]] path -> its last index
        self._i = 0
        self._scan()

    def line(self, path: Sequence[object]) -> int:
        """The line of ``path``, or of its longest prefix that has one (0: none)."""
        for end in range(len(path), 0, -1):
            found = self.lines.get(tuple(path[:end]))
            if found:
                return found
        return 0

    def _line_here(self) -> int:
        return bisect_left(self._newlines, self._i) + 1

    def _peek(self, ahead: int = 0) -> str:
        at = self._i + ahead
        return self.text[at] if at < len(self.text) else ""

    def _skip(self, newlines: bool) -> None:
        text = self.text
        while self._i < len(text):
            c = text[self._i]
            if c in " \t" or (newlines and c in "\r\n"):
                self._i += 1
            elif c == "#":
                end = text.find("\n", self._i)
                self._i = len(text) if end < 0 else end
            else:
                return

    def _expect(self, token: str) -> None:
        if not self.text.startswith(token, self._i):
            raise _ScanError(f"expected {token!r} at {self._i}")
        self._i += len(token)

    def _scan(self) -> None:
        table: tuple[object, ...] = ()
        while True:
            self._skip(newlines=True)
            if self._i >= len(self.text):
                return
            line = self._line_here()
            if self._peek() == "[":
                array = self._peek(1) == "["
                self._i += 2 if array else 1
                table = self._header(self._key(), array, line)
                self._skip(newlines=False)
                self._expect("]]" if array else "]")
            else:
                self._pair(table, line)

    def _header(self, keys: tuple[str, ...], array: bool, line: int) -> tuple[object, ...]:
        path: tuple[object, ...] = ()
        for n, key in enumerate(keys):
            path = (*path, key)
            if array and n == len(keys) - 1:
                self.lines.setdefault(path, line)
                index = self._arrays.get(path, -1) + 1
                self._arrays[path] = index
                path = (*path, index)
            elif path in self._arrays:
                path = (*path, self._arrays[path])
        self.lines.setdefault(path, line)
        return path

    def _pair(self, table: tuple[object, ...], line: int) -> None:
        keys = self._key()
        for end in range(1, len(keys) + 1):
            self.lines.setdefault((*table, *keys[:end]), line)
        self._skip(newlines=False)
        self._expect("=")
        self._skip(newlines=False)
        self._value((*table, *keys))

    def _key(self) -> tuple[str, ...]:
        keys: list[str] = []
        while True:
            self._skip(newlines=False)
            c = self._peek()
            if c == '"':
                start = self._i
                self._basic_string()
                keys.append(tomllib.loads("k = " + self.text[start : self._i])["k"])
            elif c == "'":
                end = self.text.index("'", self._i + 1)
                keys.append(self.text[self._i + 1 : end])
                self._i = end + 1
            else:
                found = _BARE_KEY.match(self.text, self._i)
                if found is None:
                    raise _ScanError(f"no key at {self._i}")
                keys.append(found.group())
                self._i = found.end()
            self._skip(newlines=False)
            if self._peek() != ".":
                return tuple(keys)
            self._i += 1

    def _value(self, path: tuple[object, ...]) -> None:
        text = self.text
        c = self._peek()
        if c == "{":
            self._i += 1
            while True:
                self._skip(newlines=True)
                if self._peek() == "}":
                    self._i += 1
                    return
                if self._peek() == ",":
                    self._i += 1
                    continue
                self._pair(path, self._line_here())
        elif c == "[":
            self._i += 1
            index = 0
            while True:
                self._skip(newlines=True)
                if self._peek() == "]":
                    self._i += 1
                    return
                if self._peek() == ",":
                    self._i += 1
                    continue
                self.lines.setdefault((*path, index), self._line_here())
                self._value((*path, index))
                index += 1
        elif text.startswith('"""', self._i):
            self._multiline_string('"""', escapes=True)
        elif text.startswith("'''", self._i):
            self._multiline_string("'''", escapes=False)
        elif c == '"':
            self._basic_string()
        elif c == "'":
            self._i = text.index("'", self._i + 1) + 1
        elif c:
            while self._i < len(text) and text[self._i] not in ",]}\n#":
                self._i += 1
        else:
            raise _ScanError("value missing at the end")

    def _basic_string(self) -> None:
        text = self.text
        i = self._i + 1
        while text[i] != '"':
            i += 2 if text[i] == "\\" else 1
        self._i = i + 1

    def _multiline_string(self, quotes: str, escapes: bool) -> None:
        text = self.text
        i = self._i + 3
        while not text.startswith(quotes, i):
            if i >= len(text):
                raise _ScanError("unterminated string")
            i += 2 if escapes and text[i] == "\\" else 1
        i += 3
        while i < len(text) and text[i] == quotes[0]:  # up to two quotes end the content
            i += 1
        self._i = i
