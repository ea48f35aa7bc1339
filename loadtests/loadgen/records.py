"""One JSONL line per request: the load generator's record and the gateway trace log's common format.

The generator writes a `RequestRecord` for every request it sends; the gateway's own request
trace log writes the same fields plus its own (``t_arrival``, ``t_admit``, ``t_dispatch``,
``backend``, ``outcome``, ``reason``...). Reading is therefore tolerant: fields this class does
not know are kept in ``extra`` and written back unchanged, so one reader serves both files.

Units: every ``t_*`` is unix epoch seconds; every ``*_s`` is a duration in seconds.
``status`` is the HTTP status, 0 when the request never got one (transport error, cancelled
at the end of a run). ``error`` is a reason code: the OpenAI error ``code`` from the body, a
transport error's class name, or one of the generator's own codes; ``None`` on success.
Token counts come from the response's ``usage`` object, never from counting chunks, because
one chunk may carry several tokens.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

RECORDS_FILE = "records.jsonl"


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """What happened to one request, as seen by the client that sent it."""

    request_id: str
    t_send: float
    class_name: str
    tenant: str
    model: str
    stream: bool
    status: int
    error: str | None
    ttft_s: float | None
    itl_s: tuple[float, ...]
    e2e_s: float | None
    tokens_in: int | None
    tokens_out: int | None
    cached_tokens: int | None
    slo_met: bool
    lateness_s: float = 0.0
    """Actual send time minus scheduled send time: the generator falling behind shows here first."""
    extra: Mapping[str, Any] = field(default_factory=dict)
    """Fields written by another producer (the gateway's trace log); kept for round trips."""

    @property
    def ok(self) -> bool:
        return self.error is None and 200 <= self.status < 300

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first: (e2e − ttft) / (tokens_out − 1), MLPerf's TPOT."""
        if self.ttft_s is None or self.e2e_s is None or self.tokens_out is None or self.tokens_out < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.tokens_out - 1)

    @property
    def itl_values(self) -> tuple[float, ...]:
        """Every inter-token gap; for a gateway trace line, which keeps only a summary, its median gap."""
        if self.itl_s:
            return self.itl_s
        median = self.extra.get("itl_p50_s")
        return (float(median),) if isinstance(median, int | float) else ()

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = dict(self.extra)
        for name in _FIELDS:
            out[name] = getattr(self, name)
        return out

    def to_json(self) -> bytes:
        """One line, newline excluded."""
        return orjson.dumps(self.to_dict())

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RequestRecord:
        known = {name: data[name] for name in _FIELDS if name in data}
        known["itl_s"] = tuple(known.get("itl_s") or ())
        extra = {k: v for k, v in data.items() if k not in _FIELD_SET}
        return cls(**known, extra=extra)

    @classmethod
    def from_json(cls, line: bytes | str) -> RequestRecord:
        data = orjson.loads(line)
        if not isinstance(data, dict):
            raise ValueError("a request record must be a JSON object")
        return cls.from_dict(data)


_FIELDS: tuple[str, ...] = tuple(f for f in RequestRecord.__dataclass_fields__ if f != "extra")
_FIELD_SET = frozenset(_FIELDS) | {"extra"}


def write_records(path: Path, records: Iterable[RequestRecord]) -> None:
    with path.open("wb") as fh:
        for record in records:
            fh.write(record.to_json() + b"\n")


def iter_records(path: Path) -> Iterator[RequestRecord]:
    """Read a JSONL file; blank lines are skipped, a malformed line fails with its line number."""
    with path.open("rb") as fh:
        for number, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                yield RequestRecord.from_json(line)
            except (orjson.JSONDecodeError, ValueError, TypeError) as exc:
                raise ValueError(f"{path}:{number}: not a request record: {exc}") from exc


def read_records(path: Path) -> list[RequestRecord]:
    return list(iter_records(path))
