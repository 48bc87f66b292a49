"""`python -m rollout`: the `rollout` command (what `accelerate launch -m rollout run RECIPE` starts on each rank)."""

import sys

from rollout.cli.main import command

sys.exit(command())
