"""The toy env; see ``env.py``."""
