"""A burst of streams broken at once on a young gateway: every one continues, within the retry budget.

The compose stack's test failed one CI run in several (issue 28): right after a Redis pause, an
engine dropped every stream it carried, and one of them reached the client as "dropped the
connection" instead of continuing elsewhere. The gateway was a few seconds old, so the retry
budget's share of recent requests was small, and its floor was per second: three retries a
second, whatever the burst. The budget now keeps a reserve per window (``gateway/upstream/retry.py``),
so a burst that fits in it continues whole. Proved here without Redis: a gateway just started,
the default retry budget, and more streams broken at once than the old floor allowed.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import openai

from tests.pipeline.test_migration import faulted, faults, faulty_first
from tests.resilience_harness import KEY, MODEL, engines, gateway
from tests.servers import wait_until

STREAMS = 32
"""At once, round robin from the faulty engine: about half break there, ten more than the old
budget allowed a gateway that had seen only these requests (20% of 32, plus 3 in one second)."""


def test_every_stream_of_a_burst_broken_at_once_continues_on_the_other_engine() -> None:
    with engines(2, names=["faulty", "healthy"]) as fleet:
        faulty, _ = fleet.engines
        default_budget = {"max_retries": 2}
        with (
            faulted(faulty, "close_mid_stream", after_tokens=5),
            gateway(faulty_first(fleet, retry=default_budget)) as gw,
        ):
            before = faults(fleet, faulty)
            with openai.OpenAI(base_url=gw.url + "/v1", api_key=KEY, max_retries=0, timeout=30) as client:

                def story(i: int) -> tuple[int, str | None]:
                    """Content chunks received, and the error the stream ended with (None: whole)."""
                    received = 0
                    try:
                        for chunk in client.chat.completions.create(
                            model=MODEL,
                            messages=[{"role": "user", "content": f"Tell me story {i}."}],
                            max_tokens=30,
                            stream=True,
                        ):
                            received += bool(chunk.choices and chunk.choices[0].delta.content)
                    except openai.APIError as error:
                        return received, error.message
                    return received, None

                with ThreadPoolExecutor(STREAMS) as pool:
                    ended = list(pool.map(story, range(STREAMS)))
            broken = faults(fleet, faulty) - before
            verdicts = {
                verdict: gw.metric("gateway_stream_migrations_total", outcome=verdict)
                for verdict in ("continued", "budget_exhausted", "attempts_exhausted", "deadline", "not_continuable")
            }
            refused = gw.metric("gateway_retry_budget_exhausted_total")
            wait_until(lambda: gw.metric("gateway_backend_in_flight_requests") == 0, what="slots released")
    assert broken > 10, "fewer streams broke than the old budget allowed: the scenario proves nothing"
    assert ended == [(30, None)] * STREAMS
    assert verdicts == {
        "continued": broken,
        "budget_exhausted": 0,
        "attempts_exhausted": 0,
        "deadline": 0,
        "not_continuable": 0,
    }
    assert refused == 0
