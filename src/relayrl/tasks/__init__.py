"""Demo tasks (dataset generator + verifier) and the tiny demo model."""
