"""Evaluation harness: ``rlinf-vla eval`` over the LIBERO suites and ManiSkill task sets.

Every task of the chosen suite is run ``eval.trials_per_task`` times (LIBERO: each official init
state once; other envs: fixed seeds), with greedy actions and the policy's action chunks executed
as emitted, on envs in parallel Ray workers with one batched policy call per round. Results go to
``eval.output_dir``: ``trials.jsonl`` (durable, one line per finished trial; a re-run into the
same folder skips them), ``results.json`` / ``results.csv`` / ``summary.md`` (success rates with
Wilson 95% intervals per task and per suite; crashed-twice trials reported as errors, outside the
rates) and optional MP4 videos. See docs/eval.md.

:func:`validate` (pure) types the config, checks that the policy fits the env and plans the
trials; :func:`run` evaluates.
"""

from rlinf_vla.eval.config import EvalConfig, EvalJob, Trial, plan_trials, validate
from rlinf_vla.eval.runner import run
from rlinf_vla.eval.stats import summarize, wilson_interval

__all__ = [
    "EvalConfig",
    "EvalJob",
    "Trial",
    "plan_trials",
    "run",
    "summarize",
    "validate",
    "wilson_interval",
]
