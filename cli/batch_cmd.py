"""``fabric batch ...``: the mesh's OpenAI Batch API from the shell, for a file of prompts.

* ``submit FILE`` turns FILE into a batch input file (``fabricnode.batch.prepare``: OpenAI batch
  lines, request bodies or plain prompts, one per line), uploads it, creates the batch and
  prints its id on stdout. It then waits up to ``VALIDATION_WAIT_S`` for the agents to validate
  the file, so that a bad line is reported at once (with its line number, exit 1). ``--wait``
  follows the batch to its end and ``--output`` then downloads its results.
* ``status ID [--wait]``, ``list``, ``cancel ID``, ``results ID [--output] [--errors]``.

Following a batch (``follow``) polls ``GET /v1/batches/{id}``: on a terminal (stderr a TTY) it
draws a progress bar of (completed + failed) / total, otherwise it writes one status line when
the state changes and every ``STATUS_EVERY_S`` seconds. Ctrl-C stops the following only: the
batch goes on, the message says how to resume or cancel, and the exit status is 130.

Exit status, besides the usual (see ``cli.main``): a batch that fails validation is 1, and so is
one that ends ``failed``, ``cancelled`` or ``expired`` while ``--wait`` follows it; a batch that
completes is 0 even when some of its requests failed (they are in its error file, and counted).
The HTTP calls are ``fabricnode.control.client.BatchClient``'s.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, BinaryIO, NoReturn, Protocol, TextIO

import typer
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

from cli.common import (
    JsonOption,
    batch_client,
    command_group,
    console,
    error,
    handled,
    print_json,
    usage_error,
)
from fabricnode.batch.prepare import prepare_input
from fabricnode.batch.validate import ENDPOINTS, Problem
from fabricnode.control.client import BatchClient
from fabricnode.errors import AgentApiError

batch_app = command_group(
    "Batch inference (the OpenAI Batch API): submit a file of prompts or requests, follow it, "
    "fetch its results."
)

Json = dict[str, Any]

FINAL = ("completed", "failed", "cancelled", "expired")
VALIDATION_WAIT_S = 10.0  # submit waits this long for a verdict on the file
STATUS_EVERY_S = 30.0  # without a terminal: a status line at least this often while it runs
GIVE_UP_S = 60.0  # while following: how long the agent may fail to answer before we stop


def poll_interval(elapsed_s: float) -> float:
    """Seconds between two looks at a batch: often at first, then every 5 s."""
    return 1.0 if elapsed_s < 120 else 5.0


# -- commands -----------------------------------------------------------------------------------


@batch_app.command(
    "submit",
    help="Submit FILE as a batch and print its id. FILE ('-': stdin) holds one request per "
    "line: an OpenAI batch line, a request body (a JSON object), or a prompt (a JSON string or "
    "a line of text, sent as a user message). --wait follows it to its end; --output then "
    "downloads its results.",
)
@handled
def submit(
    file: Annotated[Path, typer.Argument(metavar="FILE", help="JSONL or text, '-' for stdin.")],
    model: Annotated[
        str | None,
        typer.Option(metavar="MODEL", help="The model of every request (replaces any in FILE)."),
    ] = None,
    endpoint: Annotated[
        str | None,
        typer.Option(
            metavar="PATH",
            help="/v1/chat/completions, /v1/completions or /v1/embeddings (default: the url of "
            "FILE's OpenAI batch lines, else /v1/chat/completions).",
            show_default=False,
        ),
    ] = None,
    max_tokens: Annotated[
        int | None,
        typer.Option(metavar="N", min=1, help="max_tokens of every request (replaces any)."),
    ] = None,
    metadata: Annotated[
        list[str] | None,
        typer.Option(metavar="KEY=VALUE", help="Batch metadata (repeatable, at most 16)."),
    ] = None,
    wait: Annotated[
        bool,
        typer.Option("--wait", help="Follow the batch until it ends (Ctrl-C stops only that)."),
    ] = False,
    output: Annotated[
        Path | None,
        typer.Option(metavar="OUT", help="With --wait: write the results to OUT."),
    ] = None,
    errors: Annotated[
        Path | None,
        typer.Option(
            metavar="ERR",
            help="With --output: failed requests to ERR (default: beside OUT, results.jsonl -> "
            "results.errors.jsonl).",
        ),
    ] = None,
    as_json: JsonOption = False,
) -> None:
    if endpoint is not None and endpoint not in ENDPOINTS:
        usage_error("batch submit", f"--endpoint {endpoint!r}: choose {', '.join(ENDPOINTS)}")
    if max_tokens is not None and endpoint == "/v1/embeddings":
        usage_error("batch submit", "--max-tokens does not apply to /v1/embeddings")
    if (output is not None or errors is not None) and not wait:
        usage_error(
            "batch submit",
            "--output needs --wait (or fetch the results later: fabric batch results ID "
            "--output OUT)",
        )
    if errors is not None and output is None:
        usage_error("batch submit", "--errors needs --output")
    meta = _metadata(metadata)
    name = "stdin" if str(file) == "-" else str(file)
    data = sys.stdin.buffer.read() if str(file) == "-" else file.read_bytes()
    prepared = prepare_input(data, endpoint=endpoint, model=model, max_tokens=max_tokens)
    if isinstance(prepared, list):
        _refuse_input(name, prepared, model_given=model is not None)
    if max_tokens is not None and prepared.endpoint == "/v1/embeddings":
        usage_error("batch submit", "--max-tokens does not apply to /v1/embeddings")
    upload_name = "stdin.jsonl" if name == "stdin" else file.name
    with batch_client("batch submit") as client:
        uploaded = client.upload(upload_name, prepared.data)
        batch = client.create(str(uploaded["id"]), prepared.endpoint, meta)
        batch_id = str(batch["id"])
        if not as_json:
            print(batch_id, flush=True)
        prompts = f" ({prepared.prompts} of them prompts)" if prepared.prompts else ""
        models = ", ".join(prepared.models)
        _note(
            f"submitted batch {batch_id}: {_plural(prepared.requests, 'request')}{prompts} from "
            f"{name} to {prepared.endpoint}, model{'s' if len(prepared.models) > 1 else ''} "
            f"{models}"
        )
        if wait:
            final = _follow_or_stop(client, batch_id, sys.stderr, first=batch)
            _finish(client, final, output, errors, as_json, origin=name)
            return
        batch = _stop_on_interrupt(batch_id, lambda: _await_validation(client, batch))
    if as_json:
        print_json(batch)
    if batch.get("status") == "failed":
        _refuse_batch(batch, origin=name)
    if as_json:
        return
    if batch.get("status") == "validating":
        _note(f"it is still being validated ({VALIDATION_WAIT_S:g} s so far)")
    _note(f"follow:  fabric batch status {batch_id} --wait")
    _note(f"results: fabric batch results {batch_id} --output results.jsonl")


@batch_app.command("status", help="One batch: its state and request counts; --wait follows it.")
@handled
def status(
    batch_id: Annotated[str, typer.Argument(metavar="ID", help="The batch id (batch_...).")],
    wait: Annotated[
        bool,
        typer.Option("--wait", help="Follow the batch until it ends (Ctrl-C stops only that)."),
    ] = False,
    as_json: JsonOption = False,
) -> None:
    batch_id = _checked_id("batch status", batch_id)
    with batch_client("batch status") as client:
        batch = client.batch(batch_id)
        if wait and batch.get("status") not in FINAL:
            batch = _follow_or_stop(client, batch_id, sys.stderr, first=batch)
    if as_json:
        print_json(batch)
    else:
        _print_rows(describe(batch, time.time()))
        if batch.get("status") == "failed":
            for line in problem_lines(batch):
                print(f"  {line}")
    if wait and batch.get("status") != "completed":
        raise typer.Exit(1)


@batch_app.command("list", help="This API key's batches, newest first.")
@handled
def list_batches(
    limit: Annotated[
        int, typer.Option(metavar="N", min=1, max=100, help="How many (at most 100).")
    ] = 20,
    as_json: JsonOption = False,
) -> None:
    with batch_client("batch list") as client:
        page = client.batches(limit=limit)
    found: list[Json] = list(page.get("data") or [])
    more = bool(page.get("has_more"))
    if as_json:
        print_json({"batches": found, "has_more": more})
        return
    if not found:
        print("no batches (for this API key)")
        return
    table = Table(box=None, header_style="bold", pad_edge=False)
    for column in ("ID", "STATUS", "ENDPOINT", "COMPLETED", "FAILED", "TOTAL", "CREATED"):
        table.add_column(column, no_wrap=True)
    for b in found:
        counts = b.get("request_counts") or {}
        table.add_row(
            str(b["id"]),
            str(b.get("status")),
            str(b.get("endpoint")),
            str(counts.get("completed", 0)),
            str(counts.get("failed", 0)),
            str(counts.get("total", 0)),
            _utc(b.get("created_at")),
        )
    console().print(table)
    shown = _plural(len(found), "batch", "batches")
    if more:
        hint = f"more with --limit {min(100, limit * 2)}" if limit < 100 else "older not shown"
        shown = f"{shown} (newest first; {hint})"
    print(shown)


@batch_app.command("cancel", help="Cancel a batch: requests already answered keep their results.")
@handled
def cancel(
    batch_id: Annotated[str, typer.Argument(metavar="ID", help="The batch id (batch_...).")],
    as_json: JsonOption = False,
) -> None:
    batch_id = _checked_id("batch cancel", batch_id)
    with batch_client("batch cancel") as client:
        batch = client.cancel(batch_id)
    if as_json:
        print_json(batch)
        return
    if batch.get("status") == "cancelled":
        print(f"batch {batch_id} is cancelled: {_counts(batch)}")
        return
    print(
        f"cancelling batch {batch_id}: {_counts(batch)} so far; those answered stay in its "
        f"results (fabric batch results {batch_id} once it is cancelled)"
    )


@batch_app.command(
    "results",
    help="Download a finished batch's results: its output file and, if any, its error file (the "
    "failed requests). Without --output both go to stdout, output first.",
)
@handled
def results(
    batch_id: Annotated[str, typer.Argument(metavar="ID", help="The batch id (batch_...).")],
    output: Annotated[
        Path | None, typer.Option(metavar="OUT", help="Write the results to OUT (not stdout).")
    ] = None,
    errors: Annotated[
        Path | None,
        typer.Option(
            metavar="ERR",
            help="Failed requests to ERR (default: beside OUT, results.jsonl -> "
            "results.errors.jsonl; stdout without --output).",
        ),
    ] = None,
    as_json: Annotated[
        bool, typer.Option("--json", help="With --output: print where the lines went, as JSON.")
    ] = False,
) -> None:
    batch_id = _checked_id("batch results", batch_id)
    if as_json and output is None:
        usage_error("batch results", "--json needs --output (the results go to stdout without)")
    with batch_client("batch results") as client:
        batch = client.batch(batch_id)
        state = batch.get("status")
        if state == "failed":
            _refuse_batch(batch)
        if state not in FINAL:
            error(
                f"batch {batch_id} is {state} ({_counts(batch)}): its results are written when "
                f"it ends (fabric batch status {batch_id} --wait)"
            )
            raise typer.Exit(1)
        written = download_results(client, batch, output, errors)
    if as_json:
        print_json({"id": batch_id, "status": state, **written})


# -- following a batch ---------------------------------------------------------------------------


class View(Protocol):
    def update(self, batch: Json) -> None: ...

    def close(self) -> None: ...


class BarView:
    """rich's progress bar of (completed + failed) / total, on a terminal."""

    def __init__(self, out: Console) -> None:
        self.progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[failed]}"),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=out,
        )
        self.task: TaskID | None = None

    def update(self, batch: Json) -> None:
        counts = batch.get("request_counts") or {}
        total = int(counts.get("total") or 0)
        done = int(counts.get("completed") or 0) + int(counts.get("failed") or 0)
        failed = int(counts.get("failed") or 0)
        description = f"{batch['id']} {batch.get('status')}"
        note = f"{failed} failed" if failed else ""
        if self.task is None:
            self.progress.start()
            self.task = self.progress.add_task(description, total=None, failed=note)
        # total None until validated: an indeterminate bar
        self.progress.update(
            self.task, description=description, total=total or None, completed=done, failed=note
        )

    def close(self) -> None:
        if self.task is not None:
            self.progress.refresh()
            self.task = None
        self.progress.stop()


class LineView:
    """One status line when the state changes and every ``every_s`` seconds (logs, pipes)."""

    def __init__(
        self,
        out: TextIO,
        *,
        every_s: float = STATUS_EVERY_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.out = out
        self.every_s = every_s
        self.clock = clock
        self.started = clock()
        self.last: tuple[str, float] | None = None  # (status, when) of the last line

    def update(self, batch: Json) -> None:
        now = self.clock()
        state = str(batch.get("status"))
        if self.last is not None and self.last[0] == state and now - self.last[1] < self.every_s:
            return
        self.last = (state, now)
        elapsed = _duration(now - self.started)
        counts = "" if state == "validating" else f", {_counts(batch)}"
        print(f"{batch['id']}: {state}{counts} ({elapsed})", file=self.out, flush=True)

    def close(self) -> None:
        pass


def view_for(stream: TextIO) -> View:
    """A progress bar when ``stream`` is a terminal, else status lines."""
    if stream.isatty():
        return BarView(Console(file=stream, highlight=False))
    return LineView(stream)


def follow(
    fetch: Callable[[], Json],
    view: View,
    *,
    first: Json | None = None,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> Json:
    """Poll ``fetch`` (the batch) until it is in a final state; each answer goes to ``view``.
    An agent that does not answer (or answers 5xx) is retried for ``GIVE_UP_S``."""
    started = clock()
    failing_since: float | None = None
    batch = first
    while True:
        if batch is None:
            try:
                batch = fetch()
            except AgentApiError as exc:
                if exc.status not in (0, 502, 503, 504):
                    raise
                now = clock()
                failing_since = failing_since if failing_since is not None else now
                if now - failing_since >= GIVE_UP_S:
                    raise AgentApiError(f"{exc} (for {GIVE_UP_S:g} s)", exc.status) from None
                sleep(poll_interval(now - started))
                continue
            failing_since = None
        view.update(batch)
        if batch.get("status") in FINAL:
            return batch
        sleep(poll_interval(clock() - started))
        batch = None


def _follow_or_stop(
    client: BatchClient, batch_id: str, stream: TextIO, *, first: Json | None = None
) -> Json:
    view = view_for(stream)
    try:
        return _stop_on_interrupt(
            batch_id, lambda: follow(lambda: client.batch(batch_id), view, first=first), view
        )
    except AgentApiError as exc:
        raise AgentApiError(
            f"{exc}; the batch goes on: `fabric batch status {batch_id} --wait` follows it again",
            exc.status,
        ) from None
    finally:
        view.close()


def _stop_on_interrupt(batch_id: str, run: Callable[[], Json], view: View | None = None) -> Json:
    """``run()``; on Ctrl-C, say the batch goes on and how to resume or cancel it (exit 130)."""
    try:
        return run()
    except KeyboardInterrupt:
        if view is not None:
            view.close()
        fresh_line = "\n" if sys.stderr.isatty() else ""  # after the terminal's ^C
        print(
            f"{fresh_line}stopped waiting; batch {batch_id} goes on. Follow it again: fabric batch "
            f"status {batch_id} --wait; cancel it: fabric batch cancel {batch_id}",
            file=sys.stderr,
        )
        raise typer.Exit(130) from None


def _await_validation(
    client: BatchClient,
    batch: Json,
    *,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> Json:
    """The batch once the agents have validated its file, or as it is after VALIDATION_WAIT_S."""
    deadline = clock() + VALIDATION_WAIT_S
    while batch.get("status") == "validating" and clock() < deadline:
        sleep(0.2)
        batch = client.batch(str(batch["id"]))
    return batch


def _finish(
    client: BatchClient,
    batch: Json,
    output: Path | None,
    errors: Path | None,
    as_json: bool,
    *,
    origin: str,
) -> None:
    """A followed batch has ended: say how, download its results (``--output``), exit."""
    state = batch.get("status")
    if as_json:
        print_json(batch)
    if state == "failed":
        _refuse_batch(batch, origin=origin)
    if output is not None:
        download_results(client, batch, output, errors)
    else:
        _note(f"batch {batch['id']} {state}: {_counts(batch)}")
        if batch.get("output_file_id") or batch.get("error_file_id"):
            _note(f"results: fabric batch results {batch['id']} --output results.jsonl")
    if state != "completed":
        raise typer.Exit(1)


# -- results -------------------------------------------------------------------------------------


def errors_path(output: Path) -> Path:
    """Where the failed requests go next to ``output``: results.jsonl -> results.errors.jsonl."""
    return output.with_name(f"{output.stem}.errors{output.suffix or '.jsonl'}")


def download_results(
    client: BatchClient, batch: Json, output: Path | None, errors: Path | None
) -> Json:
    """The batch's output file to ``output`` (stdout when None; an empty file when it has no
    output file) and its error file, if any, to ``errors`` (default: beside ``output``, or
    stdout); what went where, ``{"output": {"path", "lines"}, "errors": {...} | None}``."""
    out_id = batch.get("output_file_id")
    err_id = batch.get("error_file_id")
    if errors is None and output is not None:
        errors = errors_path(output)
    done: Json = {"output": None, "errors": None}
    targets = (("output", out_id, output), ("errors", err_id, errors))
    for key, file_id, path in targets:
        if file_id is None and (key == "errors" or path is None):
            continue
        lines = _download(client, str(file_id) if file_id else None, path)
        done[key] = {"path": None if path is None else str(path), "lines": lines}
    out_lines = done["output"]["lines"] if done["output"] else 0
    err_lines = done["errors"]["lines"] if done["errors"] else 0
    where = []
    if output is not None:
        where.append(f"{_plural(out_lines, 'result')} in {output}")
    if done["errors"] is not None and errors is not None:
        where.append(f"{_plural(err_lines, 'failed request')} in {errors}")
    summary = (
        f"batch {batch['id']} {batch.get('status')}: {out_lines} succeeded, {err_lines} failed"
    )
    _note(summary + (f"; {', '.join(where)}" if where else ""))
    return done


def _download(client: BatchClient, file_id: str | None, path: Path | None) -> int:
    """A result file to ``path`` (stdout when None; empty when ``file_id`` is None); its lines."""
    counter = _LineCounter()
    if path is None:
        sys.stdout.flush()
        sink: BinaryIO = sys.stdout.buffer
        if file_id is not None:
            client.download(file_id, lambda chunk: counter.write(sink, chunk))
        sink.flush()
        return counter.lines
    partial = path.with_name(f".{path.name}.partial")
    try:
        with open(partial, "wb") as sink_file:
            if file_id is not None:
                client.download(file_id, lambda chunk: counter.write(sink_file, chunk))
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
    return counter.lines


class _LineCounter:
    def __init__(self) -> None:
        self.newlines = 0
        self.open_line = False  # the last byte written was not a newline

    def write(self, sink: BinaryIO, chunk: bytes) -> None:
        sink.write(chunk)
        if chunk:
            self.newlines += chunk.count(b"\n")
            self.open_line = not chunk.endswith(b"\n")

    @property
    def lines(self) -> int:
        return self.newlines + (1 if self.open_line else 0)


# -- rendering -----------------------------------------------------------------------------------


def describe(batch: Json, now: float) -> list[tuple[str, str]]:
    """``fabric batch status``: the batch as (key, value) rows."""
    rows = [
        ("id", str(batch["id"])),
        ("status", str(batch.get("status"))),
        ("endpoint", str(batch.get("endpoint"))),
        ("requests", _counts(batch)),
    ]
    for key in ("created", "in_progress", "finalizing", "completed", "failed", "cancelling",
                "cancelled", "expired", "expires"):  # fmt: skip
        at = batch.get(f"{key}_at")
        if at is not None and not (key == "expires" and batch.get("status") in FINAL):
            rows.append((key, _when(float(at), now)))
    rows.append(("input_file", str(batch.get("input_file_id"))))
    rows.append(("output_file", str(batch.get("output_file_id") or "-")))
    rows.append(("error_file", str(batch.get("error_file_id") or "-")))
    metadata = batch.get("metadata") or {}
    if metadata:
        rows.append(("metadata", ", ".join(f"{k}={v}" for k, v in metadata.items())))
    return rows


def problem_lines(batch: Json, origin: str | None = None) -> list[str]:
    """A failed batch's ``errors``, one line each: ``FILE:LINE: message`` (``line N: ...``
    without a file name)."""
    out = []
    for p in (batch.get("errors") or {}).get("data") or []:
        line = p.get("line")
        if line is None:
            where = f"{origin}: " if origin else ""
        else:
            where = f"{origin}:{line}: " if origin else f"line {line}: "
        out.append(f"{where}{p.get('message')}")
    return out


def _print_rows(rows: list[tuple[str, str]]) -> None:
    width = max(len(key) for key, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")


def _refuse_batch(batch: Json, *, origin: str | None = None) -> NoReturn:
    """A batch that failed (its file did not validate): every problem on stderr, exit 1."""
    lines = problem_lines(batch, origin)
    count = _plural(len(lines), "problem")
    error(f"batch {batch['id']} failed: its input file did not validate ({count}):")
    for line in lines:
        print(f"  {line}", file=sys.stderr)
    raise typer.Exit(1)


def _refuse_input(origin: str, problems: list[Problem], *, model_given: bool) -> NoReturn:
    """FILE cannot become a batch: nothing is sent. Only a missing --model is bad usage (2)."""
    unnamed = [p.line for p in problems if p.code == "missing_model"]
    if not model_given and len(unnamed) == len(problems):
        first = ", ".join(str(n) for n in unnamed[:5]) + (", ..." if len(unnamed) > 5 else "")
        usage_error(
            "batch submit",
            f"{origin}: {_plural(len(unnamed), 'request')} name no model (line {first}): "
            "give --model MODEL",
        )
    error(f"{origin}: {_plural(len(problems), 'problem')}, nothing was sent:")
    for p in problems:
        where = f"{origin}:{p.line}: " if p.line is not None else f"{origin}: "
        print(f"  {where}{p.message}", file=sys.stderr)
    raise typer.Exit(1)


def _metadata(pairs: list[str] | None) -> dict[str, str] | None:
    if not pairs:
        return None
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise typer.BadParameter(f"{pair!r}: expected KEY=VALUE", param_hint="--metadata")
        out[key] = value
    return out


def _checked_id(command: str, batch_id: str) -> str:
    if not batch_id.strip():
        usage_error(command, "ID is empty (see `fabric batch list` for the ids)")
    return batch_id.strip()


def _counts(batch: Json) -> str:
    counts = batch.get("request_counts") or {}
    total = int(counts.get("total") or 0)
    completed = int(counts.get("completed") or 0)
    failed = int(counts.get("failed") or 0)
    if not total and batch.get("status") in ("validating", "failed"):
        return "checking the input file" if batch.get("status") == "validating" else "none ran"
    return f"{completed + failed}/{total} done, {failed} failed"


def _note(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _plural(n: int, word: str, plural: str | None = None) -> str:
    return f"{n} {word if n == 1 else plural or word + 's'}"


def _utc(ts: Any) -> str:
    if ts is None:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(float(ts)))


def _duration(seconds: float) -> str:
    s = max(0, int(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def _when(ts: float, now: float) -> str:
    stamp = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(ts))
    delta = now - ts
    return (
        f"{stamp} ({_duration(delta)} ago)" if delta >= 0 else f"{stamp} (in {_duration(-delta)})"
    )
