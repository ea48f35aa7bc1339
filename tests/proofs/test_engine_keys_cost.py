"""``loadtests/proofs/engine_keys_cost.py`` runs end to end on a small real tokenizer and writes its table."""

from __future__ import annotations

from pathlib import Path

from loadtests.harness.tokenizers import write_tokenizer
from loadtests.proofs import engine_keys_cost

TEMPLATE = Path(__file__).parents[2] / "loadtests/sim/chat_template.jinja"


def test_the_bench_measures_each_step_for_each_size(tmp_path: Path) -> None:
    out = tmp_path / "cost.txt"
    argv = ["--tokenizer", str(write_tokenizer(tmp_path)), "--chat-template", str(TEMPLATE)]
    assert engine_keys_cost.main([*argv, "--sizes", "100,400", "--repeats", "3", "--out", str(out)]) == 0
    rows = [line.split() for line in out.read_text().splitlines() if line.startswith(("tokenize ", "per request"))]
    assert len(rows) == 2 + 2 * 2  # tokenize, and per request for sha256 and sha256_cbor, at each size
    sizes = sorted({int(row[-4]) for row in rows})
    assert len(sizes) == 2
    assert sizes[0] < sizes[1]
    assert all(float(row[-3]) > 0 for row in rows)
