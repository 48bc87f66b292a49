"""`python -m rollout.cli`: the `rollout` command."""

import sys

from rollout.cli.main import main

sys.exit(main())
