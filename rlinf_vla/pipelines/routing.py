"""Who talks to whom in one `rlinf-vla train` iteration: the routing table.

Each env worker runs ``stages`` pipeline stages (groups of its envs); a *source* is one
``(env_rank, stage)`` pair. Every source is served by exactly one rollout worker, which sends
its trajectory to exactly one actor worker:

    source (env_rank, stage) ──obs/act──> rollout worker ──trajectory──> actor worker

Sources are dealt out in order, round-robin: the i-th source goes to rollout worker
``i % rollout_workers`` and to actor worker ``i % actor_workers``. Each rollout worker hosts the
channel its sources' observations and actions go through, so a source talks to its rollout
worker's process directly (with as many env workers as rollout workers, as in ``collocated``,
env worker ``r`` and rollout worker ``r`` on the same device). The table is fixed for a
run, and an actor orders what it receives by source, so the update does not depend on which
rollout worker finished first.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlinf_vla.pipelines.rollout import trajectory_key

Source = tuple[int, int]  # (env_rank, stage)


@dataclass(frozen=True)
class Route:
    """One source's path: the rollout worker that serves it, the actor worker that trains on
    its trajectory."""

    source: Source
    rollout: int
    actor: int


@dataclass(frozen=True)
class Routing:
    """The routing table of a run (see the module docstring)."""

    routes: tuple[Route, ...]

    @classmethod
    def round_robin(
        cls, env_workers: int, stages: int, rollout_workers: int, actor_workers: int
    ) -> Routing:
        sources = [(r, s) for r in range(env_workers) for s in range(stages)]
        return cls(
            tuple(
                Route(src, i % rollout_workers, i % actor_workers) for i, src in enumerate(sources)
            )
        )

    @property
    def sources(self) -> list[Source]:
        return [r.source for r in self.routes]

    def rollout_of(self, source: Source) -> int:
        """The rollout worker that serves ``source``."""
        for r in self.routes:
            if r.source == source:
                return r.rollout
        raise KeyError(f"no route for env stage {source}")

    def served_by(self, rollout: int) -> tuple[list[Source], list[str]]:
        """The sources rollout worker ``rollout`` serves and the channel keys of their
        trajectories (their actor workers')."""
        mine = [r for r in self.routes if r.rollout == rollout]
        return [r.source for r in mine], [trajectory_key(r.actor) for r in mine]

    def trajectories_for(self, actor: int) -> int:
        """How many trajectories actor worker ``actor`` receives per iteration."""
        return sum(r.actor == actor for r in self.routes)

    def table(self) -> list[str]:
        """The table as lines, ``env 0 stage 1 -> rollout 1 -> actor 0``."""
        return [
            f"env {r.source[0]} stage {r.source[1]} -> rollout {r.rollout} -> actor {r.actor}"
            for r in self.routes
        ]
