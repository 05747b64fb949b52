"""Math reasoning with verifier rewards (the ``math-grpo`` trainer is not built yet).

:mod:`rlinf_vla.reasoning.reward` extracts a response's final answer and verifies it against
the reference with ``math-verify``.
"""
