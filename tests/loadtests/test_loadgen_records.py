"""The record format shared with the gateway's trace log: round trips, tolerance of extra fields."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from loadtests.loadgen.records import RequestRecord, read_records, write_records

RECORD = RequestRecord(
    request_id="r-1", t_send=1_700_000_000.25, class_name="interactive", tenant="acme", model="m",
    stream=True, status=200, error=None, ttft_s=0.12, itl_s=(0.01, 0.02), e2e_s=0.5, tokens_in=100,
    tokens_out=3, cached_tokens=64, slo_met=True, lateness_s=0.001,
)  # fmt: skip


def test_a_record_round_trips_through_json() -> None:
    assert RequestRecord.from_json(RECORD.to_json()) == RECORD


def test_the_json_has_the_documented_fields() -> None:
    data = orjson.loads(RECORD.to_json())
    assert data["itl_s"] == [0.01, 0.02]
    assert {"request_id", "t_send", "class_name", "tenant", "model", "stream", "status", "error", "ttft_s",
            "itl_s", "e2e_s", "tokens_in", "tokens_out", "cached_tokens", "slo_met"} <= data.keys()  # fmt: skip
    assert "extra" not in data


def test_extra_fields_of_the_gateway_trace_log_are_kept() -> None:
    line = orjson.dumps({**orjson.loads(RECORD.to_json()), "t_arrival": 1.0, "backend": "e1", "outcome": "ok"})
    record = RequestRecord.from_json(line)
    assert record.extra == {"t_arrival": 1.0, "backend": "e1", "outcome": "ok"}
    assert orjson.loads(record.to_json()) == orjson.loads(line)


def test_records_file_round_trips_and_reports_bad_lines(tmp_path: Path) -> None:
    path = tmp_path / "records.jsonl"
    write_records(path, [RECORD, RECORD])
    assert read_records(path) == [RECORD, RECORD]
    path.write_bytes(RECORD.to_json() + b"\n\n{not json}\n")
    with pytest.raises(ValueError, match=r"records.jsonl:3: not a request record"):
        read_records(path)


def test_tpot_is_decode_time_per_token_after_the_first() -> None:
    assert RECORD.tpot_s == pytest.approx((0.5 - 0.12) / 2)
