"""``python -m relayrl.cli``: the `relayrl` command (how the launcher, compose and the chart start the services)."""

import sys

from relayrl.cli import main

sys.exit(main())
