"""Adapters that run the rollout generator inside other libraries' trainers (each imports its library lazily)."""
