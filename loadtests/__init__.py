"""The bench: the commands that drive the gateway, the harness, and the proofs of its claims.

Three layers, each importing only the ones below it (``tests/loadtests/test_layout.py`` checks):

* ``proofs/``: one module per claim or figure (``python -m loadtests.proofs.<name>``), whose
  output backs a number in a README; results go to ``results/``. A proof may import the harness,
  the commands, and another proof whose setup it extends (``telemetry_overhead`` runs
  ``overhead``'s phases).
* ``harness/``: what proofs and tests start and observe: processes, proxies, servers. It may import
  the commands, never a proof.
* the commands ``sim/``, ``loadgen/``, ``whatif/`` (``inference-gateway sim|demo``, ``loadtest|report``,
  ``whatif``): shipped with the ``bench`` extra, so they import neither the harness nor a proof.

Data beside them: ``workloads/`` (the load generator's workload files) and ``results/``.
The gateway never imports the bench (``tests/test_import_graph.py``).
"""
