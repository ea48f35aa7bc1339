"""The server: listening, guarding connections, draining, and the operator's endpoints.

Owns the two listeners and uvicorn (``serve.py``), the guards on every client connection
(``connections.py``: header and body deadlines, sizes, the connection bound), the graceful drain
and the stop of the background loops (``lifecycle.py``), ``/admin/*`` (``admin.py``), and the
``/metrics`` page with the live gauges it samples at scrape time (``exposition.py``). The
worker sets of ``serve --workers N`` are ``gateway/workers/``.

Sits above the whole request path, and below the app (``gateway/app.py``), which it is handed
(``serve.server_for``) rather than imports: the app serves the operator's endpoints from here.
"""
