"""The request trace log: its record format, SLO judgement, the writer thread and rotation."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import xxhash

from gateway.dialects.chat import CHAT
from gateway.policy.model import Slo
from gateway.routing.prefix_keys import CHARS_PER_TOKEN, chain, scope_root
from gateway.routing.prefix_secret import PrefixSecret
from gateway.routing.prefix_signature import session_hash
from gateway.service import parse_policy
from gateway.settings import Settings
from gateway.telemetry.goodput import meets_slo
from gateway.telemetry.prefix_signature import PrefixSignature
from gateway.telemetry.tracelog import (
    TRACE_LINE_FIELDS,
    ItlSummary,
    TraceLog,
    TraceLogConfig,
    rotated_files,
    trace_line,
)
from loadtests.loadgen.records import RequestRecord, iter_records
from tests.conftest import CHAT_MODEL, KEY_ACME, BackendServer
from tests.fake_backend import FakeBackend
from tests.policy_builder import session_policy
from tests.servers import serve_gateway_in_thread, wait_until

SLO = Slo(ttft_ms=500, itl_ms=30, e2e_ms=10_000)
EPOCH = 1_700_000_000.0


def record(request_id: str = "r1", **overrides: Any) -> dict[str, Any]:
    values: dict[str, Any] = {
        "request_id": request_id,
        "epoch_offset": EPOCH,
        "t_arrival": 10.0,
        "t_admit": 10.001,
        "t_dispatch": 10.25,
        "t_first_token": 10.5,
        "t_end": 11.5,
        "class_name": "interactive",
        "tenant": "acme",
        "model": "test/chat",
        "stream": True,
        "status": 200,
        "outcome": "completed",
        "backend": "b1",
        "queue_s": 0.249,
        "itl": ItlSummary.of([0.25, 0.5, 0.25]),
        "tokens_in": 12,
        "tokens_out": 4,
        "cached_tokens": 8,
        "slo_met": True,
    }
    values.update(overrides)
    return trace_line(**values)


def test_a_trace_record_is_a_request_record_with_the_gateways_extras() -> None:
    parsed = RequestRecord.from_dict(record())
    assert parsed.t_send == EPOCH + 10.0
    assert parsed.ttft_s == pytest.approx(0.5)
    assert parsed.e2e_s == pytest.approx(1.5)
    assert (parsed.status, parsed.error, parsed.ok, parsed.slo_met) == (200, None, True, True)
    assert (parsed.tokens_in, parsed.tokens_out, parsed.cached_tokens) == (12, 4, 8)
    assert parsed.itl_s == ()
    extra = parsed.extra
    assert extra["t_dispatch"] == pytest.approx(EPOCH + 10.25)
    assert extra["t_end"] == pytest.approx(EPOCH + 11.5)
    assert (extra["backend"], extra["outcome"], extra["reason"], extra["queue_s"]) == ("b1", "completed", None, 0.249)
    assert (extra["itl_count"], extra["itl_p50_s"], extra["itl_max_s"]) == (3, 0.25, 0.5)
    assert RequestRecord.from_json(parsed.to_json()) == parsed


def test_a_rejected_request_carries_its_reason_code_and_no_timings_it_never_had() -> None:
    line = record(
        outcome="queue_full", status=503, backend="", t_dispatch=None, t_first_token=None, itl=None, slo_met=False
    )
    parsed = RequestRecord.from_dict(line)
    assert (parsed.error, parsed.ok, parsed.ttft_s) == ("queue_full", False, None)
    assert (line["reason"], line["backend"], line["t_dispatch"], line["itl_p99_s"]) == ("queue_full", None, None, None)


def test_no_field_of_a_record_can_hold_prompt_or_completion_text() -> None:
    line = record(api="chat", session="0123456789abcdef", signature=PrefixSignature(64, ("00ff" * 4,), 70))
    text_fields = {k for k, v in line.items() if isinstance(v, str)}
    assert text_fields == {"request_id", "class_name", "tenant", "model", "backend", "outcome", "api", "session"}
    assert line["prefix_hashes"] == ["00ff" * 4]  # hashes, 16 hex digits each


def test_a_record_carries_what_a_replay_needs_and_the_reader_keeps_it() -> None:
    signature = PrefixSignature(64, ("a" * 16, "b" * 16), 140)
    line = record(api="chat", max_tokens=256, signature=signature, session="0123456789abcdef", tokens_in=None)
    extra = RequestRecord.from_dict(line).extra
    assert (extra["api"], extra["max_tokens"], extra["session"]) == ("chat", 256, "0123456789abcdef")
    assert (extra["prefix_block_tokens"], extra["prefix_hashes"], extra["prompt_tokens_est"]) == (
        64,
        ["a" * 16, "b" * 16],
        140,
    )


def test_a_request_that_ended_before_validation_has_no_signature_nor_session() -> None:
    line = record(api="chat")
    assert (line["prefix_block_tokens"], line["prefix_hashes"], line["prompt_tokens_est"]) == (None, [], None)
    assert (line["max_tokens"], line["session"], line["api"]) == (None, None, "chat")


@pytest.mark.parametrize(
    ("gaps", "expected"),
    [
        ([0.1], ItlSummary(1, 0.1, 0.1, 0.1, 0.1)),
        ([0.25, 0.5, 0.25, 1.0], ItlSummary(4, 0.5, 0.25, 1.0, 1.0)),
        (list(range(1, 101)), ItlSummary(100, 50.5, 50, 99, 100)),
    ],
    ids=["one gap is every statistic", "four gaps take nearest ranks", "P99 of 1..100 is the 99th value"],
)
def test_itl_summary_on_known_gaps(gaps: list[float], expected: ItlSummary) -> None:
    assert ItlSummary.of(gaps) == expected


def test_no_gaps_have_no_summary() -> None:
    assert ItlSummary.of([]) is None


@pytest.mark.parametrize(
    ("ok", "ttft_s", "itl_mean_s", "e2e_s", "met"),
    [
        (True, 0.4, 0.02, 5.0, True),
        (False, 0.4, 0.02, 5.0, False),
        (True, 0.6, 0.02, 5.0, False),
        (True, 0.4, 0.031, 5.0, False),
        (True, 0.4, 0.02, 11.0, False),
        (True, 0.4, None, 5.0, True),
        (True, None, None, 5.0, True),
        (True, 0.5, 0.03, 10.0, True),
    ],
    ids=[
        "a fast success meets its SLO",
        "a failure never meets its SLO",
        "a slow first token misses",
        "a slow mean gap misses",
        "a slow end misses",
        "a single-chunk answer is judged without ITL",
        "a non-streamed answer is judged on E2E alone",
        "values exactly at the objectives meet them",
    ],
)
def test_meets_slo(ok: bool, ttft_s: float | None, itl_mean_s: float | None, e2e_s: float, met: bool) -> None:
    assert meets_slo(ok=ok, ttft_s=ttft_s, itl_mean_s=itl_mean_s, e2e_s=e2e_s, slo=SLO) is met


def test_records_are_flushed_by_the_writer_thread_and_read_back_by_the_load_generators_reader(
    tmp_path: Path,
) -> None:
    path = tmp_path / "trace.jsonl"
    log = TraceLog(TraceLogConfig(path=path, batch=10, flush_interval_s=60))
    log.start()
    try:
        for i in range(10):
            assert log.write(record(f"r{i}"))
        wait_until(lambda: log.written == 10, what="a full batch to be written without waiting for the interval")
    finally:
        log.close()
    assert [r.request_id for r in iter_records(path)] == [f"r{i}" for i in range(10)]


def test_close_drains_what_is_still_buffered(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    log = TraceLog(TraceLogConfig(path=path, flush_interval_s=60))
    log.start()
    log.write(record("last"))
    log.close()
    assert [r.request_id for r in iter_records(path)] == ["last"]


def test_a_full_buffer_drops_and_counts_instead_of_blocking(tmp_path: Path) -> None:
    log = TraceLog(TraceLogConfig(path=tmp_path / "trace.jsonl", buffer_records=3, batch=100))
    results = [log.write(record(f"r{i}")) for i in range(5)]  # no writer thread: nothing drains
    assert results == [True, True, True, False, False]
    assert log.dropped == 2


def test_the_log_rotates_at_its_size_bound_and_keeps_n_old_files(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    line_bytes = len(TraceLog.serialise(record("r000")))
    log = TraceLog(TraceLogConfig(path=path, max_bytes=line_bytes * 3, keep=2, batch=2, flush_interval_s=60))
    log.start()
    for i in range(20):
        log.write(record(f"r{i:03d}"))
    log.close()
    files = rotated_files(path)
    assert [p.name for p in files] == ["trace.jsonl.2", "trace.jsonl.1", "trace.jsonl"]
    assert all(p.stat().st_size <= line_bytes * 3 for p in files)
    kept = [r.request_id for p in files for r in iter_records(p)]
    assert kept == [f"r{i:03d}" for i in range(20 - len(kept), 20)]
    assert len(kept) == 8  # three full files less the newest one's partial fill: 3 + 3 + 2


def test_a_log_reopened_after_a_restart_appends_and_counts_the_existing_size(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    line_bytes = len(TraceLog.serialise(record("r0")))
    for i in range(2):
        log = TraceLog(TraceLogConfig(path=path, max_bytes=line_bytes + 1, keep=1))
        log.start()
        log.write(record(f"r{i}"))
        log.close()
    assert [r.request_id for p in rotated_files(path) for r in iter_records(p)] == ["r0", "r1"]
    assert path.with_name("trace.jsonl.1").exists()


# Wired: behind real servers
# The request trace log end to end: one JSONL line per request, readable by the load generator.


def test_every_request_leaves_one_line_without_any_text(
    tmp_path: Path, backend_server: BackendServer, backend: FakeBackend
) -> None:
    log = tmp_path / "trace.jsonl"
    policy = tmp_path / "policy.yaml"
    policy.write_text(session_policy(backend_server.url))
    settings = Settings(policy_path=str(policy), trace_log_path=str(log), port=0, admin_port=0)
    secret = "a prompt that must never reach the log"
    with serve_gateway_in_thread(settings, parse_policy(policy.read_text(), str(policy))) as built:
        url = built.api_url
        headers = {"authorization": f"Bearer {KEY_ACME}"}
        body = {"model": CHAT_MODEL, "messages": [{"role": "user", "content": secret}], "stream": True}
        assert httpx.post(f"{url}/v1/chat/completions", headers=headers, json=body).status_code == 200
        assert httpx.post(f"{url}/v1/chat/completions", headers=headers, json={"model": CHAT_MODEL}).status_code == 400
    wait_until(lambda: log.exists() and len(log.read_bytes().splitlines()) == 2, what="two trace lines")
    text = log.read_text()
    assert secret not in text
    assert " t0" not in text  # nor any completion text
    first, second = (RequestRecord.from_json(line) for line in log.read_bytes().splitlines())
    assert (first.status, first.tenant, first.model, first.stream) == (200, "acme", CHAT_MODEL, True)
    assert first.tokens_out == backend.tokens
    assert first.ttft_s is not None
    assert second.status == 400
    raw = orjson.loads(log.read_bytes().splitlines()[0])
    assert raw["backend"] == "fake"
    (engine_id,) = raw["engine_request_ids"]
    assert engine_id == backend.received[-1].headers["x-request-id"], "the engine's id, to find it in its logs"
    assert orjson.loads(log.read_bytes().splitlines()[1])["engine_request_ids"] == [], "no attempt, no id"
    assert raw["t_arrival"] <= raw["t_admit"] <= raw["t_dispatch"] <= raw["t_first_token"] <= raw["t_end"]


def test_a_line_carries_the_prompts_signature_the_output_cap_and_the_hashed_session(
    tmp_path: Path, backend_server: BackendServer
) -> None:
    log = tmp_path / "trace.jsonl"
    policy = tmp_path / "policy.yaml"
    policy.write_text(session_policy(backend_server.url, models={CHAT_MODEL: {"routing": {"block_tokens": 16}}}))
    settings = Settings(policy_path=str(policy), trace_log_path=str(log), port=0, admin_port=0)
    prompt = "Which rake suits wet leaves best? " * 6  # rendered, 210 bytes: three blocks of 16 tokens (64 bytes)
    with serve_gateway_in_thread(settings, parse_policy(policy.read_text(), str(policy))) as built:
        headers = {"authorization": f"Bearer {KEY_ACME}", "x-session-id": "alice-chat-1"}
        body = {"model": CHAT_MODEL, "messages": [{"role": "user", "content": prompt}]}
        assert httpx.post(f"{built.api_url}/v1/chat/completions", headers=headers, json=body).status_code == 200
    wait_until(lambda: log.exists() and len(log.read_bytes().splitlines()) == 1, what="one trace line")
    line = orjson.loads(log.read_bytes())
    assert (line["api"], line["max_tokens"]) == ("chat", 16)  # the model's default_max_tokens
    assert line["session"] == session_hash("acme", "alice-chat-1")
    assert "alice" not in log.read_text()
    assert line["prefix_block_tokens"] == 16  # the model's routing block size
    assert len(line["prefix_hashes"]) == 3
    assert all(len(h) == 16 for h in line["prefix_hashes"])
    assert line["prompt_tokens_est"] >= 3 * 16


def test_a_lines_hashes_cannot_be_computed_or_continued_without_the_cache_salt_secret(
    tmp_path: Path, backend_server: BackendServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whoever reads the log and guesses the prompt can check the guess neither from the scope and
    the model (the old unkeyed chain) nor from one written hash and the next block."""
    secret = "trace-log-test-secret"
    monkeypatch.setenv("GATEWAY_CACHE_SALT_SECRET", secret)
    log = tmp_path / "trace.jsonl"
    policy = tmp_path / "policy.yaml"
    policy.write_text(session_policy(backend_server.url, models={CHAT_MODEL: {"routing": {"block_tokens": 16}}}))
    settings = Settings(policy_path=str(policy), trace_log_path=str(log), port=0, admin_port=0)
    body = {
        "model": CHAT_MODEL,
        "messages": [{"role": "user", "content": "Our merger with Initech closes on 3 May. " * 5}],
    }
    with serve_gateway_in_thread(settings, parse_policy(policy.read_text(), str(policy))) as built:
        headers = {"authorization": f"Bearer {KEY_ACME}"}
        assert httpx.post(f"{built.api_url}/v1/chat/completions", headers=headers, json=body).status_code == 200
    wait_until(lambda: log.exists() and len(log.read_bytes().splitlines()) == 1, what="one trace line")
    written = orjson.loads(log.read_bytes())["prefix_hashes"]
    rendered = CHAT.render(body)
    assert isinstance(rendered, str)
    data, size = rendered.encode(), CHARS_PER_TOKEN * 16
    blocks = [data[i : i + size] for i in range(0, len(data) - size + 1, size)]
    guessed = [f"{h:016x}" for h in chain(data, size, scope_root("tenant:acme", CHAT_MODEL))]
    assert len(written) == len(guessed) == len(blocks) >= 3
    assert not set(written) & set(guessed), "not the chain of the prompt, the scope and the model"
    continued = [
        f"{xxhash.xxh64_intdigest(block, int(h, 16)):016x}" for h, block in zip(written[:-1], blocks[1:], strict=True)
    ]
    assert not set(written) & set(continued), "no written hash is the seed of the next"
    keyed = PrefixSecret(secret.encode())
    assert written == list(keyed.trace_hashes(chain(data, size, keyed.root("tenant:acme", CHAT_MODEL)))), (
        "what a holder of the secret computes"
    )


# The line's contract: ``TraceLine``, defined once in the product, which the readers share.


def test_a_line_has_exactly_the_fields_of_its_type_in_their_order() -> None:
    signature = PrefixSignature(64, ("a" * 16,), 100)
    for signature_or_none in (signature, None):
        line = trace_line(
            request_id="r", epoch_offset=0.0, t_arrival=1.0, t_end=2.0, t_admit=None, t_dispatch=None,
            t_first_token=None, class_name="c", tenant="t", model="m", stream=False, status=200,
            outcome="completed", backend="b", queue_s=0.0, signature=signature_or_none,
        )  # fmt: skip
        assert tuple(line) == TRACE_LINE_FIELDS


def test_a_load_generator_record_is_the_head_of_a_trace_line() -> None:
    """The load generator and the report read a trace line as a ``RequestRecord`` (the rest kept
    as extras): every field it names must be a line's, in the same order."""
    record = [name for name in RequestRecord.__dataclass_fields__ if name not in ("lateness_s", "extra")]
    assert list(TRACE_LINE_FIELDS[: len(record)]) == record


def test_the_load_generator_writes_a_signature_under_the_trace_line_s_names() -> None:
    assert set(PrefixSignature(64, ("a" * 16,), 100).fields()) <= set(TRACE_LINE_FIELDS)
