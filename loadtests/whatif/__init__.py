"""Policy what-if and capacity planning: replay recorded traffic against a candidate policy.

``inference-gateway whatif`` (``cli.py``) reads a trace (``trace.py``), stages one real gateway
process per policy in front of its own simulated engines (``stage.py``), replays the recorded
arrivals through each (``synth.py`` builds the prompts, ``replay.py`` sends them), and compares
the sides beyond their run-to-run spread (``compare.py``, ``report.py``); ``plan.py`` searches
the smallest fleet that meets every class's SLO. The shared value types are in ``model.py``;
starting, scraping and stopping the real processes in ``processes.py``.
"""
