"""A stored response is found through any replica: two gateway processes share where it lives in Redis."""

from __future__ import annotations

import hashlib
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path

import openai

from loadtests.sim import build_engine_app
from tests.apis.test_responses import MODEL, policy
from tests.limitstore.redis_server import REDIS_URL, drop_keys, shared_client, unique_prefix
from tests.policy_builder import KEY_ACME, KEY_GLOBEX, redis_state
from tests.servers import metric, serve_in_process, serve_in_thread


def test_a_follow_up_through_another_replica_reaches_the_holder() -> None:
    prefix = unique_prefix()
    with ExitStack() as stack:
        engines = tuple(
            stack.enter_context(serve_in_thread(build_engine_app("fixed", model="served", ttft_ms=2, itl_ms=5)))
            for _ in range(2)
        )
        folder = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        path = folder / "policy.yaml"
        path.write_text(policy(engines, state=redis_state(REDIS_URL, prefix)))  # type: ignore[arg-type]
        argv = [sys.executable, "-m", "gateway", "serve", "--policy", str(path), "--port", "0", "--admin-port", "0"]
        one = stack.enter_context(serve_in_process([*argv, "--log-level", "info"]))
        two = stack.enter_context(serve_in_process([*argv, "--log-level", "info"]))
        stack.callback(drop_keys, REDIS_URL, prefix)
        client_one = stack.enter_context(openai.OpenAI(base_url=f"{one.url}/v1", api_key=KEY_ACME, max_retries=0))
        client_two = stack.enter_context(openai.OpenAI(base_url=f"{two.url}/v1", api_key=KEY_ACME, max_retries=0))
        globex = stack.enter_context(openai.OpenAI(base_url=f"{two.url}/v1", api_key=KEY_GLOBEX, max_retries=0))
        first = client_one.responses.create(model=MODEL, input="Remember 7.", max_output_tokens=4, store=True)
        served = [metric(e, "vllm:request_success_total", finished_reason="length") for e in engines]
        follow_ups = [
            client_two.responses.create(model=MODEL, input="Which?", previous_response_id=first.id, max_output_tokens=4)
            for _ in range(4)
        ]
        after = [metric(e, "vllm:request_success_total", finished_reason="length") for e in engines]
        try:
            globex.responses.create(model=MODEL, input="Which?", previous_response_id=first.id)
            other_tenant = 200
        except openai.NotFoundError as error:
            other_tenant = error.status_code
        stored_keys = [key.decode() for key in shared_client().scan_iter(match=f"{prefix}*responses*")]
        stored_fields = [field.decode() for field in shared_client().hkeys(f"{prefix}{{acme}}:responses")]
    holder = served.index(1)
    assert after[holder] == 5  # every follow-up through replica two went to the holder
    assert sum(after) == 5
    assert all(f.status == "completed" or f.status == "incomplete" for f in follow_ups)
    assert other_tenant == 404
    ids = [first.id, *(f.id for f in follow_ups)]
    assert sorted(stored_keys) == [f"{prefix}{{acme}}:responses", f"{prefix}{{acme}}:responses:expiry"]
    assert sorted(stored_fields) == sorted(hashlib.sha256(i.encode()).hexdigest() for i in ids)
    assert not any(i in key for i in ids for key in stored_keys + stored_fields)  # never an id a tenant could present
