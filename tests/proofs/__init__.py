"""The proofs' own parts (``loadtests/proofs/``), tested at the mirrored path: what a bench computes
and configures, without running the bench."""
