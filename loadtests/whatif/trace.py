"""Reading a trace: a JSONL file (or a folder of them) into a ``Trace`` a replay can send.

Three formats are accepted, told apart by the first line of each file (every later line must be
of the same format, every file of a folder too):

* **gateway**: the gateway's request trace log (``gateway/telemetry/tracelog.py``): a line with
  ``t_arrival`` and ``outcome``. Rotated logs are read whole: give the folder, or the base
  path (``trace.jsonl`` reads ``trace.jsonl.N`` ... ``trace.jsonl.1`` then ``trace.jsonl``).
* **loadgen**: the load generator's ``records.jsonl`` (``loadtests/loadgen/records.py``): a line
  with ``request_id`` and ``t_send`` but no ``t_arrival``.
* **minimal**: traces from elsewhere, one JSON object per line (Mooncake's public traces read
  as they are)::

      {"timestamp": 27482, "input_length": 6955, "output_length": 52, "hash_ids": [46, 47, 48]}

  ``input_length`` and ``output_length`` (tokens) are required, and the arrival, in exactly one
  of ``timestamp`` (milliseconds, as in Mooncake's traces and the tools that replay them),
  ``timestamp_ms`` (the same, named) or ``timestamp_s`` (seconds). Optional: ``hash_ids``
  (Mooncake's per-block ids, ints or strings: two requests share a prefix as long as their ids
  agree), ``block_tokens`` (tokens per id, default 512 as in Mooncake), ``tenant``, ``class``,
  ``model``, ``stream`` (default true) and ``session_id`` (a conversation's id). A line without
  a tenant or model gets ``read_trace``'s defaults.

What a ``ReplayRequest`` is made of, and the rules where a trace says less than a replay needs:

* **Arrivals**: offsets from the first arrival (``t_arrival``, ``t_send`` or the timestamp),
  in arrival order (a gateway writes a line when a request *ends*).
* **Prompt size**: the engine's count (``tokens_in``, ``input_length``) when there is one; else
  (a request the engine never answered) the gateway's estimate ``prompt_tokens_est`` converted
  with the trace's ratio below. Lines with neither, or without a tenant or model (refused before
  the body was read or before validation), are left out and counted in ``Trace.skipped``.
* **Prefix chain and block size**: the recorded ``prefix_hashes``. The gateway cuts blocks of
  *estimated* tokens (four bytes each); a replay builds each block from *engine* tokens, so the
  block size is the recorded one times the trace's ratio of counted to estimated prompt tokens
  (the median over requests that have both; 1 without any). One ratio for the whole trace keeps
  equal blocks equal. The chain is then cut to the full blocks the prompt holds (a Mooncake
  trace's last id covers a partial block; an engine caches only full ones). A minimal trace's
  ids are hashed under the line's tenant and model (``prefix_signature.scoped_block_id``), so
  two tenants' ids never meet.
* **Output length**: the tokens a completed request got; otherwise (failed, rejected, no usage)
  the median of the completed ones of its tenant and class (else of the trace), at most the
  request's ``max_tokens``; its ``max_tokens`` when nothing completed; 1 when nothing is known.
* **Sessions**: ``session`` (gateway, load generator: already a per-tenant hash) or
  ``session_id`` (minimal: hashed here the same way). ``think_s`` is the gap from the end of the
  session's previous turn (gateway ``t_end``, load generator ``t_send + e2e_s``) to this
  arrival; None for a first turn, when the previous end is unknown, or when this turn arrived
  before the previous one ended (it did not wait for it, so the replay must not either).
* **What happened**: ``recorded`` (status, outcome code, TTFT, E2E, and for gateway lines the
  queue wait and backend); None for a minimal trace. Failed and rejected requests stay: their
  arrivals were real load.

A line that is not JSON, not an object, of none of the formats, or missing a required field
stops the reading with a ``TraceFormatError`` naming the file and line number.
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from gateway.routing.prefix_signature import DEFAULT_BLOCK_TOKENS, private_scope, scoped_block_id, session_hash
from gateway.telemetry.tracelog import rotated_files
from loadtests.whatif.model import Recorded, ReplayRequest, Trace

GATEWAY = "gateway"
LOADGEN = "loadgen"
MINIMAL = "minimal"
MOONCAKE_BLOCK_TOKENS = 512
UNKNOWN = "-"
"""What the gateway writes for a tenant, model or class it never learnt (``telemetry.UNKNOWN_LABEL``)."""

_TIME_FIELDS = {"timestamp": 1e-3, "timestamp_ms": 1e-3, "timestamp_s": 1.0}
"""The minimal format's arrival fields and their unit in seconds."""
_LOG_NAME = re.compile(r"^(?P<base>.+\.jsonl)(\.\d+)?$")


class TraceFormatError(ValueError):
    """A trace that cannot be read; the message names the file and line."""


@dataclass(frozen=True, slots=True)
class Defaults:
    """What a minimal line that says nothing of them is sent as."""

    tenant: str = "default"
    model: str = "default"


@dataclass(frozen=True, slots=True)
class Row:
    """One line as read, before the trace-wide rules (module docstring); times in seconds."""

    arrival: float
    end: float | None
    tenant: str
    class_name: str | None
    model: str
    stream: bool
    tokens_in: int | None
    """Counted by the engine (or the minimal trace's ``input_length``)."""
    tokens_est: int | None
    """The gateway's estimate (``prompt_tokens_est``)."""
    output_tokens: int | None
    """Known only for a completed request (or a minimal line)."""
    max_tokens: int | None
    block_tokens: int
    estimated_blocks: bool
    """Blocks of estimated tokens (gateway, load generator), converted with the trace's ratio."""
    hashes: tuple[str, ...]
    session: str | None
    recorded: Recorded | None


def read_trace(path: Path, *, default_tenant: str = "default", default_model: str = "default") -> Trace:
    """The trace in ``path``: a file, a rotated log's base path, or a folder of ``*.jsonl`` files.

    ``default_tenant`` and ``default_model`` fill minimal lines that name none (a Mooncake trace)."""
    defaults = Defaults(default_tenant, default_model)
    source: str | None = None
    rows: list[Row] = []
    skipped = 0
    for file in trace_files(path):
        file_source, file_rows, file_skipped = read_file(file, defaults)
        if file_source is None:
            continue
        if source is not None and file_source != source:
            raise TraceFormatError(f"{file}: {file_source} lines, but the files before it hold {source} lines")
        source = file_source
        rows += file_rows
        skipped += file_skipped
    if source is None:
        raise TraceFormatError(f"{path}: no trace lines")
    return Trace(tuple(build_requests(rows)), source, path, skipped)


def trace_files(path: Path) -> list[Path]:
    """The files to read, oldest first: a folder's ``*.jsonl`` logs (each with its rotated files),
    a log with its rotated files, or the one file named."""
    if path.is_dir():
        bases = sorted({match["base"] for p in path.iterdir() if p.is_file() and (match := _LOG_NAME.match(p.name))})
        files = [f for base in bases for f in rotated_files(path / base)]
        if not files:
            raise FileNotFoundError(f"{path}: no *.jsonl file in this folder")
        return files
    files = rotated_files(path)
    if not files:
        raise FileNotFoundError(f"{path}: no such file (nor rotated files {path.name}.N)")
    return files


def read_file(path: Path, defaults: Defaults) -> tuple[str | None, list[Row], int]:
    """``(format, rows, lines skipped)`` of one file; its format is its first line's."""
    source: str | None = None
    rows: list[Row] = []
    skipped = 0
    for number, line in _lines(path):
        where = f"{path}:{number}"
        line_source = line_format(line)
        if line_source is None:
            raise TraceFormatError(f"{where}: {_UNKNOWN_SHAPE}")
        if source is not None and line_source != source:
            raise TraceFormatError(f"{where}: a {line_source} line in a file of {source} lines")
        source = line_source
        try:
            row = PARSERS[line_source](line, defaults)
        except (KeyError, TypeError, ValueError) as exc:
            raise TraceFormatError(f"{where}: not a valid {line_source} line: {_reason(exc)}") from exc
        if row is None:
            skipped += 1
        else:
            rows.append(row)
    return source, rows, skipped


_UNKNOWN_SHAPE = (
    "not a trace line: expected a gateway trace-log line (t_arrival, outcome), a load-generator "
    "record (request_id, t_send) or a minimal line (timestamp, input_length, output_length)"
)


def _lines(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    with path.open("rb") as fh:
        for number, raw in enumerate(fh, start=1):
            if not raw.strip():
                continue
            try:
                value = orjson.loads(raw)
            except orjson.JSONDecodeError as exc:
                raise TraceFormatError(f"{path}:{number}: not JSON: {exc}") from exc
            if not isinstance(value, dict):
                raise TraceFormatError(f"{path}:{number}: {_UNKNOWN_SHAPE}")
            yield number, value


def line_format(line: Mapping[str, Any]) -> str | None:
    """Which format a parsed line is in (None: none of them)."""
    if "t_arrival" in line and "outcome" in line:
        return GATEWAY
    if "request_id" in line and "t_send" in line:
        return LOADGEN
    if "input_length" in line and any(name in line for name in _TIME_FIELDS):
        return MINIMAL
    return None


def _reason(exc: Exception) -> str:
    return f"missing field {exc}" if isinstance(exc, KeyError) else str(exc)


# --- one line of each format ----------------------------------------------------------------


def gateway_row(line: Mapping[str, Any], defaults: Defaults) -> Row | None:
    """A gateway trace-log line; None when it is not replayable (module docstring)."""
    completed = line["outcome"] == "completed"
    recorded = Recorded(
        status=_int(line, "status"),
        outcome=None if completed else str(line["outcome"]),
        ttft_s=_float_or_none(line, "ttft_s"),
        e2e_s=_float_or_none(line, "e2e_s"),
        queue_s=_float_or_none(line, "queue_s"),
        backend=line.get("backend") or None,
    )
    return _recorded_row(line, recorded, arrival=_float(line, "t_arrival"), end=_float_or_none(line, "t_end"))


def loadgen_row(line: Mapping[str, Any], defaults: Defaults) -> Row | None:
    """A load generator's record; None when it is not replayable."""
    status, error = _int(line, "status"), line.get("error")
    e2e, arrival = _float_or_none(line, "e2e_s"), _float(line, "t_send")
    recorded = Recorded(status, None if error is None else str(error), _float_or_none(line, "ttft_s"), e2e)
    return _recorded_row(line, recorded, arrival=arrival, end=None if e2e is None else arrival + e2e)


def _recorded_row(line: Mapping[str, Any], recorded: Recorded, *, arrival: float, end: float | None) -> Row | None:
    """What the gateway's and the load generator's lines share (the same field names)."""
    tenant, model = str(line["tenant"]), str(line["model"])
    tokens_in, tokens_est = _int_or_none(line, "tokens_in"), _int_or_none(line, "prompt_tokens_est")
    if UNKNOWN in (tenant, model) or (tokens_in is None and tokens_est is None):
        return None
    completed = recorded.outcome is None and 200 <= recorded.status < 300
    class_name = str(line["class_name"])
    return Row(
        arrival=arrival,
        end=end,
        tenant=tenant,
        class_name=None if class_name == UNKNOWN else class_name,
        model=model,
        stream=bool(line["stream"]),
        tokens_in=tokens_in,
        tokens_est=tokens_est,
        output_tokens=_int_or_none(line, "tokens_out") if completed else None,
        max_tokens=_int_or_none(line, "max_tokens"),
        block_tokens=_int_or_none(line, "prefix_block_tokens") or DEFAULT_BLOCK_TOKENS,
        estimated_blocks=True,
        hashes=tuple(str(h) for h in line.get("prefix_hashes") or ()),
        session=_str_or_none(line, "session"),
        recorded=recorded,
    )


def minimal_row(line: Mapping[str, Any], defaults: Defaults) -> Row:
    """A minimal (Mooncake-style) line (module docstring)."""
    tenant, model = str(line.get("tenant", defaults.tenant)), str(line.get("model", defaults.model))
    block_tokens = _int(line, "block_tokens") if "block_tokens" in line else MOONCAKE_BLOCK_TOKENS
    if block_tokens < 1:
        raise ValueError(f"block_tokens must be at least 1, not {block_tokens}")
    ids = line.get("hash_ids") or []
    if not isinstance(ids, list) or not all(isinstance(i, int | str) and not isinstance(i, bool) for i in ids):
        raise ValueError("hash_ids must be a list of ints or strings")
    session = line.get("session_id")
    class_name = line.get("class")
    return Row(
        arrival=_arrival(line),
        end=None,
        tenant=tenant,
        class_name=None if class_name is None else str(class_name),
        model=model,
        stream=_bool(line.get("stream", True), "stream"),
        tokens_in=_count(line, "input_length"),
        tokens_est=None,
        output_tokens=_count(line, "output_length"),
        max_tokens=None,
        block_tokens=block_tokens,
        estimated_blocks=False,
        hashes=tuple(scoped_block_id(private_scope(tenant), model, str(i)) for i in ids),
        session=None if session is None else session_hash(tenant, str(session)),
        recorded=None,
    )


PARSERS: Mapping[str, Callable[[Mapping[str, Any], Defaults], Row | None]] = {
    GATEWAY: gateway_row,
    LOADGEN: loadgen_row,
    MINIMAL: minimal_row,
}


def _arrival(line: Mapping[str, Any]) -> float:
    given = [name for name in _TIME_FIELDS if name in line]
    if len(given) != 1:
        raise ValueError(f"give the arrival in exactly one of timestamp, timestamp_ms, timestamp_s, not {given}")
    return _float(line, given[0]) * _TIME_FIELDS[given[0]]


def _float(line: Mapping[str, Any], name: str) -> float:
    value = line[name]
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name} must be a number, not {value!r}")
    return float(value)


def _float_or_none(line: Mapping[str, Any], name: str) -> float | None:
    return None if line.get(name) is None else _float(line, name)


def _int(line: Mapping[str, Any], name: str) -> int:
    value = line[name]
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, not {value!r}")
    return value


def _int_or_none(line: Mapping[str, Any], name: str) -> int | None:
    return None if line.get(name) is None else _int(line, name)


def _count(line: Mapping[str, Any], name: str) -> int:
    value = _int(line, name)
    if value < 0:
        raise ValueError(f"{name} must not be negative, not {value}")
    return value


def _bool(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false, not {value!r}")
    return value


def _str_or_none(line: Mapping[str, Any], name: str) -> str | None:
    value = line.get(name)
    return None if value is None else str(value)


# --- the trace-wide rules -------------------------------------------------------------------


def build_requests(rows: Sequence[Row]) -> list[ReplayRequest]:
    """Rows to replay requests in arrival order (module docstring: sizes, outputs, sessions)."""
    ordered = sorted(rows, key=lambda r: r.arrival)
    ratio = token_ratio(ordered)
    outputs = OutputFill(ordered)
    think = think_times(ordered)
    start = ordered[0].arrival if ordered else 0.0
    return [_request(row, start, ratio, outputs.of(row), gap) for row, gap in zip(ordered, think, strict=True)]


def _request(row: Row, start: float, ratio: float, output_tokens: int, think_s: float | None) -> ReplayRequest:
    block = max(1, round(row.block_tokens * ratio)) if row.estimated_blocks else row.block_tokens
    prompt = row.tokens_in if row.tokens_in is not None else round((row.tokens_est or 0) * ratio)
    return ReplayRequest(
        offset_s=row.arrival - start,
        tenant=row.tenant,
        class_name=row.class_name,
        model=row.model,
        stream=row.stream,
        prompt_tokens=prompt,
        output_tokens=output_tokens,
        block_tokens=block,
        prefix_hashes=row.hashes[: prompt // block],
        session=row.session,
        think_s=think_s,
        recorded=row.recorded,
    )


def token_ratio(rows: Sequence[Row]) -> float:
    """Engine tokens per estimated token: the median over rows with both counts (1 without any)."""
    ratios = [r.tokens_in / r.tokens_est for r in rows if r.estimated_blocks and r.tokens_in and r.tokens_est]
    return statistics.median(ratios) if ratios else 1.0


class OutputFill:
    """Output lengths of requests that did not complete (module docstring's rule)."""

    def __init__(self, rows: Sequence[Row]) -> None:
        known: dict[tuple[str, str | None], list[int]] = {}
        for row in rows:
            if row.output_tokens is not None:
                known.setdefault((row.tenant, row.class_name), []).append(row.output_tokens)
        self._by_group = {group: round(statistics.median(values)) for group, values in known.items()}
        every = [value for values in known.values() for value in values]
        self._overall = round(statistics.median(every)) if every else None

    def of(self, row: Row) -> int:
        if row.output_tokens is not None:
            return row.output_tokens
        typical = self._by_group.get((row.tenant, row.class_name), self._overall)
        if typical is None:
            return row.max_tokens or 1
        return typical if row.max_tokens is None else min(typical, row.max_tokens)


def think_times(rows: Sequence[Row]) -> list[float | None]:
    """Per row (arrival order): the gap since its session's previous turn ended (module docstring)."""
    previous_end: dict[str, float | None] = {}
    gaps: list[float | None] = []
    for row in rows:
        gap = None
        if row.session is not None:
            if row.session in previous_end:
                end = previous_end[row.session]
                gap = row.arrival - end if end is not None and row.arrival >= end else None
            previous_end[row.session] = row.end
        gaps.append(gap)
    return gaps
