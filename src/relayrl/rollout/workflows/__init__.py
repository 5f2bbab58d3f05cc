"""Rollout workflows: single-turn, multi-turn environments, tool calling, black-box agents (see api.py)."""
