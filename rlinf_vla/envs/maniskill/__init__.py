"""The maniskill env; see ``env.py``."""
