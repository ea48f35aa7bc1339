"""The server: listening, guarding connections, draining, and the operator's endpoints.

Owns the two listeners and uvicorn (``serve.py``), the guards on every client connection
(``connections.py``: header and body deadlines, sizes, the connection bound), the graceful drain
and the stop of the background loops (``lifecycle.py``), ``/admin/*`` (``admin.py``), and the
``/metrics`` page with the live gauges it samples at scrape time (``exposition.py``). The
worker sets of ``serve --workers N`` are ``gateway/workers/``.

Sits above the whole request path: it builds the app (``gateway/app.py``), which builds the rest.
"""
