"""The proofs: one module per claim or figure a README states, run as ``python -m loadtests.proofs.<name>``.

Each starts the real parts it measures (gateway processes, simulated engines, Redis), drives them,
and prints or writes what backs the claim (``loadtests/results/<name>/``, with the command that
made it). A proof may import the harness (``loadtests/harness/``), the commands (``loadtests/sim/``,
``loadtests/loadgen/``, ``loadtests/whatif/``), and another proof whose setup it extends
(``telemetry_overhead``, ``workers`` and ``instructions`` reuse ``overhead``'s requests and policy;
``fleet_faults`` ``fleet_capacity``'s; ``prefix_secret_cost`` ``routing_pick_cost``'s;
``fleet_stress --scenario fairness`` runs ``fleet_fairness``). Nothing but tests and other proofs
imports a proof.
"""
