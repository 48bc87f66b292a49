"""`python -m rollout.cli`: the `rollout` command."""

import sys

from rollout.cli.main import command

sys.exit(command())
