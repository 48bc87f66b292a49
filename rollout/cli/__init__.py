"""The command line: `rollout run | train | bench | report` over YAML recipes (`recipe`), loading what a recipe
names (`sources`, `runs`), recording runs (`tracking`, `files`, `plots`, `progress`), `bench` and `train`.

Nothing here is imported by the engine or the rollout loop. `main` imports torch only after the recipe is checked.
"""
