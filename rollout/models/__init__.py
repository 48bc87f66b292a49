"""The models this project ships (`zoo`: the tiny target and draft trained on the arithmetic task, in `assets/`)."""
