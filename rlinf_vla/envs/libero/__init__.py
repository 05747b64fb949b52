"""The libero env; see ``env.py``."""
