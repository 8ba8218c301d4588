"""``python -m tensorhub_cli.bench.faults``: one endpoint process of the benchmark."""

import sys

from .peer import main

sys.exit(main())
