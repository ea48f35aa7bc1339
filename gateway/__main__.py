"""`python -m gateway` is `inference-gateway`."""

import sys

from gateway.cli import main

sys.exit(main())
