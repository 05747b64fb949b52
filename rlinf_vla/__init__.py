"""rlinf-vla: reinforcement-learning post-training of vision-language-action policies.

Importing the package is cheap: simulators, model libraries and Ray are imported by the
subpackages that need them, when they are first used.
"""

__version__ = "0.1.0"
