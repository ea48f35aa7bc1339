"""The request: everything between the client's bytes and an admitted, validated request.

Owns reading the body under its limits (``intake.py``, ``json_bounds.py``), the tenant's key
(``auth.py``, ``keys.py``: hashes only), the body's fields and media URLs (``body_fields.py``,
``media.py``), validation and the prompt estimate (``validation.py``, ``tokens.py``,
``text_shape.py``, ``output_length.py``), and the tenant's limits at admission (``admission.py``,
over ``gateway/limitstore/``).

May import the policy, the dialects' value types, the errors and the limit store; never the
pipeline, dispatch or upstream stages.
"""
