"""The request: everything between the client's bytes and a parsed body with its checks.

Owns reading the body under its limits (``intake.py``, ``json_bounds.py``), the tenant's key
(``auth.py``, ``keys.py``: hashes only), the body's fields and media URLs (``body_fields.py``,
``media.py``), the field checks that need no dialect and the prompt estimate (``field_limits.py``,
``tokens.py``, ``text_shape.py``, ``output_length.py``). Building the ``InferenceRequest`` and the
tenant's limits are the admission stage's (``gateway/admission/``), above the dialects.

May import the policy and the errors; never the dialects, ``gateway/types.py`` or any stage above
them (the dialects import this stage's helpers).
"""
