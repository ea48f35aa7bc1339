"""``serve --workers N``: N gateway processes behind one API port, seen from outside as one gateway.

``supervisor.py`` starts and restarts the workers, owns the signals and serves the public
operator listener (``operator.py``: probes, admin fan-out, ``/metrics`` merged by ``merge.py``);
``sockets.py`` binds every socket of the set; ``child.py`` is a worker (a full gateway built by
``gateway/server/serve.py``); ``spec.py`` is what the supervisor hands a worker.
"""
