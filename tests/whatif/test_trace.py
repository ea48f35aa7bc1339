"""Traces: recorded by a real gateway and the load generator, read back into a ``Trace``.

The first half records one: a simulated engine and a gateway with a trace log, each its own
process, serve a few scripted requests and a short load-generator run; the lines must carry
each prompt's tenant-scoped chain and never its text. The second half reads each accepted
format (gateway trace log, load-generator records, the minimal format and a Mooncake sample)
into the expected ``Trace``.
"""

from __future__ import annotations

import itertools
import os
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from gateway.routing.prefix_signature import private_scope, scoped_block_id, session_hash
from gateway.telemetry.prefix_signature import PrefixSignature
from gateway.telemetry.tracelog import TraceLog, trace_line
from loadtests.harness import processes as harness
from loadtests.loadgen.records import RequestRecord, read_records
from loadtests.loadgen.runner import RunConfig, run_sync, run_workload
from loadtests.loadgen.workload import parse_workload
from loadtests.whatif.model import Recorded, ReplayRequest, Trace
from loadtests.whatif.trace import TraceFormatError, read_trace
from tests.policy_builder import backend, build_policy, model, tenant

MODEL = "whatif/chat"
SECRET = "zanzibar-quokka"
"""A word in every prompt of the recorded run: it must appear in no trace."""
SYSTEM = f"You answer questions about garden tools for {SECRET} shop customers, briefly. " * 12
KEYS = {"acme": "key-acme", "globex": "key-globex", "initech": "key-initech"}


# --- a trace recorded by a real gateway and the load generator -------------------------------


@dataclass(frozen=True)
class Recording:
    log: Path
    records: Path
    lines: dict[str, dict[str, Any]]
    """The gateway's lines by request id."""


def policy(engine_port: int) -> str:
    return build_policy(
        f"http://127.0.0.1:{engine_port}",
        models=[model(MODEL, max_prompt_tokens=8192, max_output_tokens=256, default_max_tokens=16)],
        backends=[backend("engine", f"http://127.0.0.1:{engine_port}", [MODEL], kind="sim")],
        tenants={
            "globex": {"models": ["*"], "default_class": "interactive"},
            "initech": tenant("initech", KEYS["initech"], limits={"tpm": 100}),
        },
    )


def ask(client: httpx.Client, request_id: str, tenant: str, messages: list[dict[str, str]], **extra: Any) -> int:
    headers = {"authorization": f"Bearer {KEYS[tenant]}", "x-request-id": request_id, **extra.pop("headers", {})}
    body = {"model": MODEL, "messages": messages, "max_tokens": 4, **extra}
    return client.post("/v1/chat/completions", json=body, headers=headers).status_code


def system(*user: str) -> list[dict[str, str]]:
    roles = ["user", "assistant"]
    return [{"role": "system", "content": SYSTEM}, *({"role": roles[i % 2], "content": u} for i, u in enumerate(user))]


def scripted(client: httpx.Client) -> None:
    """The requests the tests below look at, by id; every status checked, so none is lost."""
    question = f"Which rake suits wet leaves in a {SECRET} garden? " * 8
    assert ask(client, "same-acme", "acme", system(question)) == 200
    assert ask(client, "same-globex", "globex", system(question)) == 200
    assert ask(client, "share-2", "acme", system("How long is the warranty on hedge shears? " * 8)) == 200
    turn_1 = system(question)
    assert ask(client, "turn-1", "acme", turn_1, headers={"x-session-id": "conversation-7"}) == 200
    turn_2 = [*turn_1, {"role": "assistant", "content": "A fan rake. " * 8}, {"role": "user", "content": "Why? " * 8}]
    assert ask(client, "turn-2", "acme", turn_2, headers={"x-session-id": "conversation-7"}) == 200
    assert ask(client, "cache-key", "acme", system("Hello. " * 8), prompt_cache_key="conversation-9") == 200
    assert ask(client, "refused", "initech", system(question), max_tokens=200) == 429  # more than its tpm
    assert ask(client, "invalid", "acme", []) == 400  # never validated: nothing to sign


def load_generator_run(url: str, out: Path) -> None:
    workload = parse_workload(
        {
            "name": "whatif-trace",
            "model": MODEL,
            "classes": {"interactive": {"share": 1, "priority": "interactive", "slo": {"ttft_ms": 500, "tpot_ms": 50}}},
            "tenants": {
                "acme": {"share": 0.5, "api_key": KEYS["acme"]},
                "globex": {"share": 0.5, "api_key": KEYS["globex"]},
            },
            "prompt_tokens": {"dist": "fixed", "value": 60},  # 300 bytes: each turn adds a block
            "output_tokens": {"dist": "fixed", "value": 4},
            "prefix": {"system_prompt_tokens": 120},
            "conversation": {"turns": {"dist": "fixed", "value": 3}, "active_per_tenant": 1},
        },
        source="test",
    )
    config = RunConfig(target=url, rate=40, duration_s=2.0, max_requests=12, out_dir=out, drain_timeout_s=20)
    result = run_sync(lambda: run_workload(workload, config, base_dir=out))
    assert [r.status for r in result.records] == [200] * len(result.records)


@pytest.fixture(scope="module")
def recording(tmp_path_factory: pytest.TempPathFactory) -> Recording:
    folder = tmp_path_factory.mktemp("recording")
    log = folder / "trace.jsonl"
    engine_port, gateway_port, admin_port = harness.free_port(), harness.free_port(), harness.free_port()
    (folder / "policy.yaml").write_text(policy(engine_port))
    engine = [sys.executable, "-m", "gateway", "sim", "--profile", "fixed", "--ttft-ms", "2", "--itl-ms", "1"]
    engine += ["--model", MODEL, "--port", str(engine_port)]
    gateway = [sys.executable, "-m", "gateway", "serve", "--policy", str(folder / "policy.yaml")]
    gateway += ["--port", str(gateway_port), "--admin-port", str(admin_port)]
    env = {**os.environ, "GATEWAY_TRACE_LOG": str(log)}
    url = f"http://127.0.0.1:{gateway_port}"
    with (
        harness.process(engine, f"http://127.0.0.1:{engine_port}/health"),
        harness.process(gateway, f"http://127.0.0.1:{admin_port}/readyz", env=env),
    ):
        with httpx.Client(base_url=url, timeout=10) as client:
            scripted(client)
        load_generator_run(url, folder / "loadgen")
    # the gateway stopped (SIGINT): its trace log is drained and closed
    lines = {line["request_id"]: line for line in map(orjson.loads, log.read_bytes().splitlines())}
    return Recording(log, folder / "loadgen" / "records.jsonl", lines)


def test_the_same_prompt_of_two_tenants_gives_chains_that_never_meet(recording: Recording) -> None:
    acme, globex = (recording.lines[name]["prefix_hashes"] for name in ("same-acme", "same-globex"))
    assert len(acme) == len(globex) >= 4
    assert not set(acme) & set(globex)


def test_two_requests_sharing_a_system_prompt_share_the_chain_head(recording: Recording) -> None:
    first, second = recording.lines["same-acme"]["prefix_hashes"], recording.lines["share-2"]["prefix_hashes"]
    system_blocks = len(SYSTEM) // (4 * 64)
    assert first[:system_blocks] == second[:system_blocks]
    assert first[system_blocks + 1 :] != second[system_blocks + 1 :]


def test_a_conversations_second_turn_extends_the_firsts_chain_under_one_hashed_session(recording: Recording) -> None:
    turn_1, turn_2 = recording.lines["turn-1"], recording.lines["turn-2"]
    assert turn_2["prefix_hashes"][: len(turn_1["prefix_hashes"])] == turn_1["prefix_hashes"]
    assert len(turn_2["prefix_hashes"]) > len(turn_1["prefix_hashes"])
    assert turn_1["session"] == turn_2["session"] == session_hash("acme", "conversation-7")
    assert recording.lines["cache-key"]["session"] == session_hash("acme", "conversation-9")
    assert recording.lines["same-acme"]["session"] is None


def test_every_line_carries_what_a_replay_needs(recording: Recording) -> None:
    line = recording.lines["same-acme"]
    assert (line["api"], line["max_tokens"], line["prefix_block_tokens"]) == ("chat", 4, 64)
    assert line["prompt_tokens_est"] >= len(line["prefix_hashes"]) * 64
    assert line["tokens_in"] > 0


def test_a_refused_request_keeps_its_estimate_and_chain_and_an_invalid_one_has_none(recording: Recording) -> None:
    refused, invalid = recording.lines["refused"], recording.lines["invalid"]
    assert (refused["status"], refused["tokens_in"], refused["max_tokens"]) == (429, None, 200)
    assert refused["prompt_tokens_est"] == recording.lines["same-acme"]["prompt_tokens_est"]
    assert len(refused["prefix_hashes"]) == len(recording.lines["same-acme"]["prefix_hashes"])
    assert (invalid["status"], invalid["prefix_hashes"], invalid["prompt_tokens_est"]) == (400, [], None)
    assert invalid["api"] == "chat"


def test_no_prompt_text_nor_raw_session_id_is_in_the_trace_log_or_the_records(recording: Recording) -> None:
    for path in (recording.log, recording.records):
        text = path.read_text()
        assert SECRET not in text
        assert "conversation-7" not in text
        assert "rake" not in text


def test_the_load_generators_records_carry_the_gateways_chain_shape_for_the_same_request(recording: Recording) -> None:
    """The same blocks, not the same hashes: the gateway's are keyed with its cache-salt secret,
    which a client never holds (a replay compares chains inside one trace only)."""
    records = read_records(recording.records)
    assert len(records) == 12
    for record in records:
        line = recording.lines[record.request_id]
        assert len(record.extra["prefix_hashes"]) == len(line["prefix_hashes"]) > 0
        assert not set(record.extra["prefix_hashes"]) & set(line["prefix_hashes"])
        assert record.extra["prompt_tokens_est"] == line["prompt_tokens_est"]
        assert record.extra["max_tokens"] == line["max_tokens"] == 4
        assert record.extra["api"] == line["api"] == "chat"
    turns: dict[str, list[RequestRecord]] = {}
    for record in records:
        turns.setdefault(record.extra["session"], []).append(record)
    assert all(len(conversation) <= 3 for conversation in turns.values())
    for conversation in turns.values():  # each turn extends the previous one's chain
        chains = [r.extra["prefix_hashes"] for r in sorted(conversation, key=lambda r: r.request_id)]
        assert all(b[: len(a)] == a and len(b) > len(a) for a, b in itertools.pairwise(chains))


def test_the_recorded_trace_log_reads_into_a_trace(recording: Recording) -> None:
    trace = read_trace(recording.log, default_tenant="unused")
    assert (trace.source, trace.skipped) == ("gateway", 1)  # the invalid request: nothing to replay
    assert len(trace.requests) == len(recording.lines) - 1
    assert trace.requests[0].offset_s == 0
    assert [r.offset_s for r in trace.requests] == sorted(r.offset_s for r in trace.requests)
    refused = next(r for r in trace.requests if r.recorded and r.recorded.status == 429)
    assert refused.tenant == "initech"
    assert refused.prompt_tokens > 0
    assert refused.recorded is not None
    assert refused.recorded == Recorded(429, "tenant_token_limited", None, refused.recorded.e2e_s, 0.0, None)
    turn_2 = next(r for r in trace.requests if r.session and r.think_s is not None)
    lines = recording.lines
    assert turn_2.think_s == pytest.approx(lines["turn-2"]["t_arrival"] - lines["turn-1"]["t_end"])


def test_the_load_generators_records_read_into_a_trace(recording: Recording) -> None:
    trace = read_trace(recording.records.parent)
    assert (trace.source, len(trace.requests), trace.skipped) == ("loadgen", 12, 0)
    assert {r.tenant for r in trace.requests} == {"acme", "globex"}
    assert all(r.output_tokens == 4 and r.recorded and r.recorded.status == 200 for r in trace.requests)
    assert all(r.prompt_tokens >= len(r.prefix_hashes) * r.block_tokens for r in trace.requests)
    assert len({r.session for r in trace.requests}) >= 2


# --- each format into the expected Trace -----------------------------------------------------

EPOCH = 1_700_000_000.0


def gateway_line(request_id: str, t: float, **overrides: Any) -> dict[str, Any]:
    values: dict[str, Any] = {
        "request_id": request_id,
        "epoch_offset": EPOCH,
        "t_arrival": t,
        "t_admit": t,
        "t_dispatch": t + 0.125,
        "t_first_token": t + 0.25,
        "t_end": t + 1.0,
        "class_name": "interactive",
        "tenant": "acme",
        "model": "m",
        "stream": True,
        "status": 200,
        "outcome": "completed",
        "backend": "b1",
        "queue_s": 0.125,
        "tokens_in": 160,
        "tokens_out": 30,
        "api": "chat",
        "max_tokens": 64,
        "signature": PrefixSignature(64, ("a" * 16, "b" * 16), 200),
    }
    values.update(overrides)
    return trace_line(**values)


def write_lines(path: Path, lines: list[dict[str, Any]]) -> Path:
    path.write_bytes(b"".join(TraceLog.serialise(line) for line in lines))
    return path


def test_gateway_lines_read_in_arrival_order_with_sizes_sessions_and_what_happened(tmp_path: Path) -> None:
    session = session_hash("acme", "c1")
    lines = [
        gateway_line("second", 12.0, session=session, signature=PrefixSignature(64, ("a" * 16, "c" * 16), 200)),
        gateway_line("first", 10.0, session=session),  # written first, arrived first: ends at 11.0
        gateway_line(
            "rejected",
            13.0,
            class_name="batch",
            status=429,
            outcome="tenant_rate_limited",
            backend="",
            t_dispatch=None,
            t_first_token=None,
            t_end=13.5,
            queue_s=0.0,
            tokens_in=None,
            tokens_out=None,
        ),
        gateway_line("unauthenticated", 14.0, tenant="-", model="-", class_name="-", signature=None, status=401),
    ]
    trace = read_trace(write_lines(tmp_path / "trace.jsonl", lines))
    # tokens_in / estimate = 160 / 200: blocks of 64 estimated tokens are 51 counted ones
    first = ReplayRequest(
        offset_s=0.0,
        tenant="acme",
        class_name="interactive",
        model="m",
        stream=True,
        prompt_tokens=160,
        output_tokens=30,
        block_tokens=51,
        prefix_hashes=("a" * 16, "b" * 16),
        session=session,
        recorded=Recorded(200, None, ttft_s=0.25, e2e_s=1.0, queue_s=0.125, backend="b1"),
    )
    second = replace(first, offset_s=2.0, prefix_hashes=("a" * 16, "c" * 16), think_s=1.0)
    rejected = replace(
        first,
        offset_s=3.0,
        class_name="batch",
        session=None,
        output_tokens=30,  # none completed in its class: the trace's median, under its max_tokens
        prompt_tokens=160,  # its estimate (200) converted
        recorded=Recorded(429, "tenant_rate_limited", None, 0.5, 0.0, None),
    )
    assert trace == Trace((first, second, rejected), "gateway", tmp_path / "trace.jsonl", skipped=1)


def test_a_rotated_log_is_read_whole_from_its_folder_or_its_base_path(tmp_path: Path) -> None:
    write_lines(tmp_path / "trace.jsonl.2", [gateway_line("r0", 0.0)])
    write_lines(tmp_path / "trace.jsonl.1", [gateway_line("r1", 1.0), gateway_line("r2", 2.0)])
    write_lines(tmp_path / "trace.jsonl", [gateway_line("r3", 3.0)])
    for path in (tmp_path, tmp_path / "trace.jsonl"):
        trace = read_trace(path)
        assert [r.offset_s for r in trace.requests] == [0.0, 1.0, 2.0, 3.0]
    assert len(read_trace(tmp_path / "trace.jsonl.1").requests) == 2  # a rotated file alone


def loadgen_record(request_id: str, t: float, **overrides: Any) -> RequestRecord:
    values: dict[str, Any] = {
        "request_id": request_id,
        "t_send": EPOCH + t,
        "class_name": "interactive",
        "tenant": "acme",
        "model": "m",
        "stream": True,
        "status": 200,
        "error": None,
        "ttft_s": 0.1,
        "itl_s": (0.01, 0.01),
        "e2e_s": 0.5,
        "tokens_in": 128,
        "tokens_out": 3,
        "cached_tokens": 0,
        "slo_met": True,
        "extra": {"api": "chat", "max_tokens": 3, "session": "s1", **PrefixSignature(64, ("d" * 16,), 128).fields()},
    }
    values.update(overrides)
    return RequestRecord(**values)


def test_load_generator_records_read_with_their_extras(tmp_path: Path) -> None:
    records = [
        loadgen_record("r-1", 0.0),
        loadgen_record("r-2", 0.25),  # the next turn left before the first ended: not paced
        loadgen_record("r-3", 2.0),
        loadgen_record("r-4", 3.0, status=0, error="cancelled_at_end", ttft_s=None, e2e_s=None, tokens_out=None),
    ]
    path = tmp_path / "records.jsonl"
    path.write_bytes(b"".join(r.to_json() + b"\n" for r in records))
    trace = read_trace(path)
    assert trace.source == "loadgen"
    assert [(r.offset_s, r.think_s) for r in trace.requests] == [(0.0, None), (0.25, None), (2.0, 1.25), (3.0, 0.5)]
    assert [r.prefix_hashes for r in trace.requests] == [("d" * 16,)] * 4
    assert {(r.prompt_tokens, r.output_tokens, r.block_tokens) for r in trace.requests} == {(128, 3, 64)}
    assert trace.requests[3].recorded == Recorded(0, "cancelled_at_end", None, None)


def test_old_lines_without_signatures_still_read_as_unshared_prompts(tmp_path: Path) -> None:
    line = {k: v for k, v in gateway_line("r", 0.0, signature=None).items() if k not in {"api", "max_tokens"}}
    (request,) = read_trace(write_lines(tmp_path / "old.jsonl", [line])).requests
    assert (request.prefix_hashes, request.prompt_tokens, request.output_tokens) == ((), 160, 30)


def minimal(path: Path, *lines: dict[str, Any]) -> Path:
    path.write_bytes(b"\n".join(orjson.dumps(line) for line in lines) + b"\n")
    return path


def test_minimal_lines_read_with_their_defaults_units_and_full_blocks_only(tmp_path: Path) -> None:
    path = minimal(
        tmp_path / "minimal.jsonl",
        {"timestamp_s": 5.5, "input_length": 100, "output_length": 7, "hash_ids": ["x", "y", "z"], "block_tokens": 40},
        {
            "timestamp_ms": 5000,
            "input_length": 30,
            "output_length": 2,
            "tenant": "globex",
            "model": "llama",
            "class": "batch",
            "stream": False,
            "session_id": 42,
        },
    )
    trace = read_trace(path, default_tenant="acme", default_model="m")
    scope = private_scope("acme")
    assert trace == Trace(
        requests=(
            ReplayRequest(0.0, "globex", "batch", "llama", False, 30, 2, 512, (), session=session_hash("globex", "42")),
            ReplayRequest(
                0.5,
                "acme",
                None,
                "m",
                True,
                100,
                7,
                40,
                (scoped_block_id(scope, "m", "x"), scoped_block_id(scope, "m", "y")),  # "z" was a partial block
            ),
        ),
        source="minimal",
        path=path,
    )


def test_a_mooncake_style_trace_reads_as_is(tmp_path: Path) -> None:
    path = tmp_path / "mooncake.jsonl"
    path.write_text(
        '{"timestamp": 0, "input_length": 6755, "output_length": 500, '
        '"hash_ids": [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]}\n'
        '{"timestamp": 0, "input_length": 7319, "output_length": 490, '
        '"hash_ids": [0, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27]}\n'
        '{"timestamp": 3052, "input_length": 2287, "output_length": 316, "hash_ids": [0, 42, 43, 44, 45]}\n'
    )
    trace = read_trace(path)
    assert trace.source == "minimal"
    assert [r.offset_s for r in trace.requests] == [0.0, 0.0, pytest.approx(3.052)]  # milliseconds, as Mooncake
    assert [len(r.prefix_hashes) for r in trace.requests] == [13, 14, 4]  # full 512-token blocks only
    first, second, third = (r.prefix_hashes for r in trace.requests)
    assert first[0] == second[0] == third[0]
    assert first[1] != second[1]
    assert {(r.tenant, r.model, r.block_tokens) for r in trace.requests} == {("default", "default", 512)}


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        (
            b'{"timestamp": 0, "input_length": 5, "output_length": 1}\n\n{"prompt": "x"}\n',
            r"x\.jsonl:3: not a trace line",
        ),
        (b'{"timestamp": 0, "input_length": 5, "output_length": 1}\nnot json\n', r"x\.jsonl:2: not JSON"),
        (b"[1, 2]\n", r"x\.jsonl:1: not a trace line"),
        (
            b'{"timestamp": 0, "input_length": 5}\n',
            r"x\.jsonl:1: not a valid minimal line: missing field 'output_length'",
        ),
        (b'{"timestamp": 0, "timestamp_s": 0, "input_length": 5, "output_length": 1}\n', r"x\.jsonl:1: .*exactly one"),
        (
            b'{"timestamp": "soon", "input_length": 5, "output_length": 1}\n',
            r"x\.jsonl:1: .*timestamp must be a number",
        ),
        (b'{"timestamp": 0, "input_length": -5, "output_length": 1}\n', r"x\.jsonl:1: .*must not be negative"),
        (
            b'{"timestamp": 0, "input_length": 5, "output_length": 1}\n{"request_id": "r", "t_send": 1}\n',
            r"x\.jsonl:2: a loadgen line in a file of minimal lines",
        ),
        (b"\n", r"no trace lines"),
    ],
    ids=[
        "a line of no format names its number",
        "a line that is not JSON names its number",
        "a line that is not an object is of no format",
        "a missing field is named",
        "two arrival fields are one too many",
        "a timestamp must be a number",
        "a length cannot be negative",
        "formats cannot be mixed in a file",
        "an empty file is no trace",
    ],
)
def test_a_line_of_unknown_shape_stops_the_reading_with_its_file_and_line(
    tmp_path: Path, lines: bytes, message: str
) -> None:
    path = tmp_path / "x.jsonl"
    path.write_bytes(lines)
    with pytest.raises(TraceFormatError, match=message):
        read_trace(path)


def test_files_of_two_formats_in_one_folder_are_refused(tmp_path: Path) -> None:
    write_lines(tmp_path / "a.jsonl", [gateway_line("r", 0.0)])
    minimal(tmp_path / "b.jsonl", {"timestamp": 0, "input_length": 5, "output_length": 1})
    with pytest.raises(TraceFormatError, match="minimal lines, but the files before it hold gateway lines"):
        read_trace(tmp_path)


def test_a_missing_trace_is_named(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"nope\.jsonl"):
        read_trace(tmp_path / "nope.jsonl")
