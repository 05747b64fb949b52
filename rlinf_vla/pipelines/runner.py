"""The embodied runner: one loop for every execution mode.

    for each iteration:
        sync weights actor -> rollout                     (collective broadcast)
        env.interact || rollout.generate                  (channel; S pipeline stages)
        actor.train                                       (advantages + PPO epochs)
        log metrics, checkpoint

The placement decides which devices each group uses and ``placement.stages`` how many
pipeline stages each env worker has; the loop never changes.
"""

from __future__ import annotations

import contextlib
import sys
import time
from pathlib import Path
from typing import Any

import torch

from rlinf_vla.config import RunAborted
from rlinf_vla.pipelines.actor import ActorWorker
from rlinf_vla.pipelines.config import TrainJob, check_env_split
from rlinf_vla.pipelines.evaluation import evaluate_on_worker
from rlinf_vla.pipelines.rollout import EnvWorker, RolloutWorker, trajectory_key
from rlinf_vla.pipelines.routing import Routing
from rlinf_vla.run.checkpoints import (
    Resume,
    begin_checkpoint,
    finish_checkpoint,
    prepare_resume,
    resume_checkpoint,
)
from rlinf_vla.run.loop import RunLoop, Say, count_text, device_ranges, device_summary
from rlinf_vla.run.tracking import MetricsLogger, run_folder
from rlinf_vla.runtime import (
    Channel,
    Cluster,
    WorkerError,
    WorkerGroup,
    create_collective,
    resolve_placement,
    wait_all,
    wait_started,
)
from rlinf_vla.runtime.local import (
    LocalChannel,
    LocalCluster,
    LocalGroup,
    worker_environment,
)
from rlinf_vla.runtime.memory import group_memory_metrics, read_memory, with_memory_hint
from rlinf_vla.runtime.threads import torch_threads
from rlinf_vla.training.objective import merge_ranks

WEIGHTS = "weights"
DATA_PARALLEL = "actor-dp"


def _mean(xs: list[float]) -> float | None:
    """Mean, or ``None`` (JSON null) when no episode ended in the iteration."""
    return sum(xs) / len(xs) if xs else None


class EmbodiedRunner:
    """Launches the env, rollout and actor groups of a :class:`TrainJob` and trains.

    ``checkpoint``: the checkpoint a resumed run continues from, chosen and verified by
    :func:`~rlinf_vla.run.checkpoints.prepare_resume` (default: the newest complete one
    of ``runner.resume``).
    """

    def __init__(
        self,
        job: TrainJob,
        cluster: Cluster,
        checkpoint: Resume | None = None,
        settings: dict[str, Any] | None = None,
    ) -> None:
        """``settings``: every setting of the job as validated (before ``placement=auto``
        resolved it), written beside the start's config; default: ``job.settings()``."""
        self.job, self.cluster = job, cluster
        self.settings = job.settings() if settings is None else settings
        placement = self.placement = resolve_placement(job.placement, cluster.num_devices)
        check_env_split(job, len(placement.of("env")), len(placement.of("actor")))
        if job.runner.resume and checkpoint is None:
            checkpoint = resume_checkpoint(job.runner.resume, "iter")
        self.checkpoint = checkpoint
        # A resume's runner state is read (and its worker counts checked) before any worker
        # starts.
        self._resumed = None if checkpoint is None else _runner_state(checkpoint.path, placement)
        sharded = job.algo.fsdp and len(placement.of("actor")) > 1
        # Collocated (or local) on GPUs: the policy copies that are idle (the actor's while the
        # rollout runs, the rollout's while the actor trains) wait in host memory
        # (placement.offload).
        offload = placement.mode in ("collocated", "local") and job.placement.offload
        self.offloads = offload and any(d.kind == "cuda" for d in cluster.devices)
        self.output_dir = self._output_dir()
        # placement=local: the same workers in threads of this process, no Ray (runtime.local)
        local = placement.mode == "local"
        self._synced: int | None = None  # the weights version the rollout workers hold
        self._sync_bytes = 0  # bytes the syncs of the current iteration sent
        self._memory: dict[str, list[dict[str, float]]] = {}  # the last memory readings
        try:
            self._start_workers(LocalGroup if local else WorkerGroup, offload, sharded)
            # Each rollout worker keeps the queues of a channel (Ray modes): it takes its
            # sources' observations and puts their actions without a call of its own, and the
            # env stages it serves call its process directly. The first one's channel also
            # carries the trajectories to the actor.
            name = f"embodied-{id(self)}"
            self.channels = [
                LocalChannel.create(f"{name}-{w}")
                if local
                else Channel.create(
                    f"{name}-{w}", host=self.rollout.actor(w), pipes=job.cluster.pipes
                )
                for w in range(self.rollout.world_size)
            ]
            self.channel = self.channels[0]
            self._connect(sharded)
            self.start_iteration = 0
            if self.checkpoint is not None:
                self.start_iteration = self._restore(self.checkpoint.path)
        except BaseException:
            # Nothing outlives a failed start (on a long-lived Ray cluster).
            self.shutdown(graceful=False)
            raise

    def _start_workers(self, Group: Any, offload: bool, sharded: bool) -> None:
        """Start the env, rollout and actor groups at once (a worker's start is mostly imports
        and model building) and wait until every worker has started."""
        job, placement, cluster = self.job, self.placement, self.cluster
        seed = job.runner.seed
        policy = job.policy_config.replace(seed=seed)
        imitation = job.algo.preset.imitation
        counts = {c: len(placement.of(c)) for c in ("env", "rollout", "actor")}
        _say(
            f"starting {counts['env']} env worker(s) ({job.env_config.num_envs} envs of "
            f"{_env_text(job)} in all), {counts['rollout']} rollout and {counts['actor']} actor "
            f"worker(s), {placement.mode} ..."
        )
        started = time.perf_counter()
        self.env = Group(
            cluster,
            EnvWorker,
            "env",
            placement.of("env"),
            args=(job.env_name, job.env_config, job.placement.stages),
            # DAgger: the env's scripted expert labels every state the policy visits
            kwargs={"expert": imitation},
            wait=False,
        )
        self.rollout = Group(
            cluster,
            RolloutWorker,
            "rollout",
            placement.of("rollout"),
            args=(job.policy_name, policy, seed, job.algo.autocast),
            # An actor that caches frozen features takes them from the rollout (FSDP never
            # caches: it runs the whole pass).
            kwargs={
                "features": job.algo.cache_frozen_features and not sharded and not imitation,
                "offload": offload,
            },
            wait=False,
            **({} if Group is LocalGroup else {"channels": True}),
        )
        self.actor = Group(
            cluster,
            ActorWorker,
            "actor",
            placement.of("actor"),
            args=(job.policy_name, policy, job.algo, seed),
            kwargs={"offload": offload and not sharded},
            wait=False,
        )
        wait_started([self.env, self.rollout, self.actor])
        _say(f"workers started in {time.perf_counter() - started:.0f} s")

    def _connect(self, sharded: bool) -> None:
        """The weight collective (actor rank 0 -> rollout workers), the actor ranks' data
        parallelism (FSDP2 shards over a default process group, or replicas all-reduce their
        gradients) and the routing of env stages to rollout workers and actor ranks."""
        create_collective(WEIGHTS, [(self.actor, [0]), (self.rollout, None)])
        self.fsdp = sharded
        if self.fsdp:
            create_collective(DATA_PARALLEL, [(self.actor, None)], as_default=True)
            self.actor.shard().wait()
        elif self.actor.world_size > 1:
            create_collective(DATA_PARALLEL, [(self.actor, None)])
            self.actor.join_data_parallel(DATA_PARALLEL).wait()
        # With FSDP every actor rank takes part in gathering the full weights.
        self._gather_ranks = None if self.fsdp else [0]
        # Env stage (rank, s) -> rollout worker and actor rank, fixed for the whole run.
        self.routing = Routing.round_robin(
            self.env.world_size,
            self.job.placement.stages,
            self.rollout.world_size,
            self.actor.world_size,
        )

    def _output_dir(self) -> Path:
        r = self.job.runner
        return run_folder(r.name, r.output_dir, r.resume)

    def run(self) -> Path:
        """Train from ``start_iteration`` to ``runner.max_iterations``; returns the run folder.

        Raises:
            TrainingAborted: too many non-finite updates in a row.
            WorkerError: a worker crashed (its name and traceback are in the message).
            WorkerStalled: a worker stopped answering (named, with its process).
            Either way the console names the last checkpoint to resume from.
        """
        r = self.job.runner
        loop = RunLoop(
            self.output_dir,
            self.job.raw,
            r.logging,
            command="train",
            unit="iter",
            total=r.max_iterations,
            save_interval=r.save_interval,
            max_nan_updates=r.max_nan_updates,
            devices=[str(d) for d in self.cluster.devices],
            header=self.header(),
            last_checkpoint=None if self.checkpoint is None else self.checkpoint.path,
            settings=self.settings,
        )

        def iteration(it: int, logger: MetricsLogger, say: Say) -> dict[str, Any]:
            try:
                metrics = self.iteration(it)
            except WorkerError as e:
                raise with_memory_hint(e, self._memory, it) from None
            if r.eval_interval and (it + 1) % r.eval_interval == 0:
                say("greedy evaluation ...")
                metrics.update(self.evaluate(it + 1, logger))
            return metrics

        def before(logger: MetricsLogger, say: Say) -> str | None:
            if not (r.eval_at_start and self.start_iteration == 0):
                return None
            say("greedy evaluation of the starting policy ...")
            m = self.evaluate(0, logger)
            logger.log({"iteration": 0, "env_steps": 0, **m})
            return f"iter 0: greedy success {m['eval/success_rate']:.2f}"

        return loop.run(self.start_iteration, iteration, self.save, _status, before=before)

    def header(self) -> list[str]:
        """What this run trains, on what, where: printed before the first iteration."""
        job, r = self.job, self.job.runner
        counts = self.actor.parameter_counts(ranks=[0]).wait()[0]
        chunk = job.policy_config.chunk_size
        pol = job.policy_config
        source = (
            f"from {pol.checkpoint}" if pol.checkpoint else f"preset {pol.preset}, random weights"
        )
        mode = self.placement.mode
        stages = f", {job.placement.stages} stages" if job.placement.stages > 1 else ""
        groups = ", ".join(
            f"{c} {device_ranges(self.placement.of(c))}" for c in ("env", "rollout", "actor")
        )
        fsdp = " (FSDP)" if self.fsdp else ""
        offload = " (idle policies offloaded to host memory)" if self.offloads else ""
        return [
            f"rlinf-vla train: {job.algo.name} on {_env_text(job)}, {job.env_config.num_envs} envs, "
            f"{r.rollout_chunks} chunks of {chunk} steps per iteration, "
            f"{r.max_iterations} iterations",
            f"policy {job.policy_name} ({source}): {count_text(counts['total'])} parameters, "
            f"{count_text(counts['trained'])} trained",
            f"placement {mode}{stages}: {groups}{fsdp} on {device_summary(self.cluster.devices)}"
            f"{offload}",
        ]

    def iteration(self, it: int) -> dict[str, Any]:
        """One rollout and one update; returns the iteration's metrics."""
        r = self.job.runner
        t0 = time.perf_counter()
        self._sync_bytes = 0
        self._sync(version=it)
        t1 = time.perf_counter()
        calls = [self.env.interact(self.channels, r.rollout_chunks, self.routing)]
        for w in range(self.rollout.world_size):
            mine, dests = self.routing.served_by(w)
            calls.append(
                self.rollout.generate(
                    self.channels[w],
                    r.rollout_chunks,
                    mine,
                    dests,
                    trajectories=self.channel,
                    ranks=[w],
                )
            )
        env_stats, *served = wait_all(calls)
        t2 = time.perf_counter()
        train = wait_all(
            [
                self.actor.train(
                    self.channel,
                    trajectory_key(a),
                    self.routing.trajectories_for(a),
                    it,
                    r.max_iterations,
                    ranks=[a],
                )
                for a in range(self.actor.world_size)
            ]
        )
        t3 = time.perf_counter()
        groups = {"env": self.env, "rollout": self.rollout, "actor": self.actor}
        self._memory = read_memory(groups)
        # every rank takes the same optimizer steps (and skips): their counts are one rank's
        train_metrics = merge_ranks(
            [result[0] for result in train],
            summed=("train/samples", "dagger/aggregate_samples"),
            maxed=("train/skipped_updates", "train/nan_streak"),
        )
        stats = {k: [x for s in env_stats for x in s[k]] for k in env_stats[0]}
        num_envs = self.job.env_config.num_envs
        env_steps = num_envs * r.rollout_chunks * self.job.policy_config.chunk_size
        return {
            "iteration": it + 1,
            "env_steps": env_steps * (it + 1),
            "env/success_rate": _mean(stats["success"]),
            # each env's first episode of the rollout: not weighted towards quick episodes
            "env/first_episode_success_rate": _mean(stats["first_success"]),
            "env/episode_return": _mean(stats["return"]),
            "env/episodes": len(stats["success"]),
            "env/first_episodes": len(stats["first_success"]),
            "env/invalid_episodes": sum(stats["invalid"]),
            **train_metrics,
            "time/sync_s": t1 - t0,
            "sync/sent_mib": self._sync_bytes / 2**20,
            "time/rollout_s": t2 - t1,
            # the busiest env stage's seconds in its simulators (reset, then chunk steps)
            "time/env_reset_s": max(stats["reset_s"]),
            "time/env_step_s": max(stats["step_s"]),
            **rollout_breakdown(stats, [r[0] for r in served]),
            "time/train_s": t3 - t2,
            "throughput/env_steps_per_s": env_steps / (t2 - t1),
            **group_memory_metrics(self._memory),
        }

    def _sync(self, version: int) -> None:
        """Send the actor's weights (``version``: updates done) to the rollout workers, unless
        they have them already (an evaluation after the previous update sent them)."""
        if self._synced == version:
            return
        sent, _ = wait_all(
            [
                self.actor.sync_to(WEIGHTS, ranks=self._gather_ranks),
                self.rollout.sync_from(WEIGHTS, version),
            ]
        )
        self._synced = version
        self._sync_bytes += sent[0]

    def evaluate(self, iteration: int, logger: MetricsLogger) -> dict[str, float]:
        """Greedy episodes of the weights after ``iteration`` updates on held-out scenes
        (``eval/*`` metrics).

        Rollout worker 0 runs them where its policy is (on its GPU, not in the driver), on an
        env of its own, so the training envs' reset-id cursors (and hence a resumed run's
        metrics) are untouched; the weights it receives here serve the next iteration too.
        """
        r = self.job.runner
        t0 = time.perf_counter()
        self._sync(version=iteration)
        metrics = evaluate_on_worker(
            self.rollout,
            self.job.env_name,
            self.job.env_config,
            r,
            self.output_dir / "videos" / f"iter_{iteration}",
            logger,
            iteration,
        )
        return {**metrics, "time/eval_s": time.perf_counter() - t0}

    # ------------------------------------------------------------------ checkpoints
    def save(self, iteration: int) -> Path:
        path = begin_checkpoint(self.output_dir / "checkpoints" / f"iter_{iteration}")
        self.actor.save(str(path)).wait()  # rank 0 writes the policy, every rank its state
        state = {
            "iteration": iteration,
            "env_cursors": self.env.get_state().wait(),
            "rollout_rng": self.rollout.rng_state().wait(),
        }
        torch.save(state, path / "runner.pt")
        # Every writer (the actor workers, on this machine, and the driver) has finished.
        return finish_checkpoint(path, iteration)

    def _restore(self, path: Path) -> int:
        iteration = int(path.name.split("_")[1])
        self.actor.load(str(path)).wait()
        state = self._resumed
        wait_all([self.env.set_state(s, ranks=[i]) for i, s in enumerate(state["env_cursors"])])
        wait_all(
            [self.rollout.set_rng_state(s, ranks=[i]) for i, s in enumerate(state["rollout_rng"])]
        )
        return iteration

    def shutdown(self, graceful: bool = True) -> None:
        """Stop every worker. ``graceful``: first let the rollout workers close their
        evaluation envs; a run that stopped on an error or a signal skips that (a stalled or
        blocked worker would not answer, and the simulators' subprocesses end with their
        worker anyway)."""
        if graceful and "rollout" in self.__dict__:
            with contextlib.suppress(Exception):
                self.rollout.close().wait(timeout=60)
        # first the channel: a (local) worker blocked on it ends its call, so its group's
        # shutdown can wait for its thread
        for channel in self.__dict__.get("channels", ()):  # made once the workers started
            channel.close()
        for name in ("env", "rollout", "actor"):
            if name in self.__dict__:  # all of them unless the start failed
                self.__dict__[name].shutdown()


def rollout_breakdown(
    env: dict[str, list[float]], rollout: list[dict[str, float]]
) -> dict[str, float]:
    """Where a rollout's seconds went, from the workers' own clocks (``time/rollout/*``).

    ``env``: the env workers' :meth:`EnvWorker.interact` stats (per-stage lists); ``rollout``:
    each rollout worker's :meth:`RolloutWorker.generate` times. The env side is read on the
    critical path of the env worker that ran longest (its longest stage, or all its stages
    when they took turns): reset, chunk steps (``env_sim_s``), channel calls (``env_wait_s``:
    sending observations, waiting for actions) and wall time; the rollout side on the busiest
    worker: policy compute, waiting for observations, offload copies and the trajectories'
    hand-off after the last chunk.
    ``serialise_s`` adds every worker's serialisation and object-store fetches.
    """
    worker = max(range(len(env["path_wall_s"])), key=env["path_wall_s"].__getitem__)
    busiest = max(rollout, key=lambda r: r["policy_s"])
    return {
        "time/rollout/env_reset_s": env["path_reset_s"][worker],
        "time/rollout/env_sim_s": env["path_step_s"][worker],
        "time/rollout/env_wait_s": env["path_wait_s"][worker],
        "time/rollout/env_wall_s": env["path_wall_s"][worker],
        "time/rollout/policy_s": busiest["policy_s"],
        "time/rollout/rollout_wait_s": busiest["wait_s"],
        "time/rollout/copy_s": max(r["copy_s"] for r in rollout),
        "time/rollout/finish_s": max(r["finish_s"] for r in rollout),
        "time/rollout/serialise_s": sum(env["send_s"])
        + sum(env["fetch_s"])
        + sum(r["send_s"] + r["fetch_s"] for r in rollout),
    }


def _runner_state(path: Path, placement: Any) -> dict[str, Any]:
    """A checkpoint's ``runner.pt``, checked to fit the placement's env and actor workers.

    Raises:
        RunAborted: the file cannot be read, or the worker counts differ (naming both).
    """
    from rlinf_vla.run.checkpoints import load_runner_state

    state = load_runner_state(path)
    actors = len(list(path.glob("actor_rank*.pt")))
    counts = {
        "env": (len(state["env_cursors"]), len(placement.of("env"))),
        "rollout": (len(state["rollout_rng"]), len(placement.of("rollout"))),
        "actor": (actors, len(placement.of("actor"))),
    }
    wrong = [f"{g}: {saved} saved, {now} now" for g, (saved, now) in counts.items() if saved != now]
    if wrong:
        raise RunAborted(
            f"{path} was saved with other worker counts than this placement has "
            f"({', '.join(wrong)}): resume with the run's placement and cluster settings"
        )
    return state


def _status(metrics: dict[str, Any]) -> str:
    # the first episodes' rate: env/success_rate over-counts quick successes
    success = metrics["env/first_episode_success_rate"]
    rate = "-" if success is None else f"{success:.2f}"
    text = f"{metrics['throughput/env_steps_per_s']:.0f} env steps/s  success {rate}"
    if "memory/total_rss_gib" in metrics:  # what the workers hold together
        text += f"  {metrics['memory/total_rss_gib']:.1f} GiB"
    return text


def _env_text(job: TrainJob) -> str:
    """``maniskill PickCube-v1``, ``libero libero_goal tasks [2, 5]``, ``toy``: the env's name
    and what its config says it runs."""
    return f"{job.env_name} {job.env_config.describe()}".strip()


def _placement_dict(job: TrainJob) -> dict[str, Any]:
    from rlinf_vla.config import to_dict

    return to_dict(job.placement)


def _say(line: str) -> None:
    print(line, file=sys.stderr)


def run(job: TrainJob) -> Path:
    """``rlinf-vla train``: start the cluster, train, print where the outputs are."""
    # A resume's config and checkpoint are checked before anything starts.
    settings = job.settings()  # as validated: placement=auto is resolved again at each start
    checkpoint = prepare_resume(job.runner.resume, job.raw, "iter", _say, settings)
    # placement=local needs no Ray (runtime.local); auto may still choose it
    local = job.placement.mode == "local"
    with contextlib.ExitStack() as stack:
        cluster = stack.enter_context((LocalCluster if local else Cluster)(job.cluster))
        if job.placement.mode == "auto":
            from rlinf_vla.pipelines.auto import resolve_auto

            job = resolve_auto(job, cluster)
            job.raw["placement"] = _placement_dict(job)
        if job.placement.mode == "local":
            # the workers compute here, with the device's threads
            stack.enter_context(torch_threads(cluster.device(0).threads))
            stack.enter_context(worker_environment())  # simulators start as under Ray
        runner = EmbodiedRunner(job, cluster, checkpoint, settings)
        try:
            out = runner.run()
        except BaseException:
            runner.shutdown(graceful=False)
            raise
        runner.shutdown()
    for line in closing_lines(out):
        print(line)
    print(f"run folder: {out}  (metrics.jsonl, config.yaml, checkpoints/, curves.png)")
    return out


def closing_lines(out: Path) -> list[str]:
    """What a finished run says last: greedy success at its first and last evaluation (when
    it had two), and its learning curves drawn to ``<run>/curves.png``."""
    from rlinf_vla.run.plot import plot_run
    from rlinf_vla.run.tracking import read_metrics

    rows = read_metrics(out)
    evals = [r for r in rows if "eval/success_rate" in r]
    lines = []
    if len(evals) >= 2:
        first, last = evals[0], evals[-1]
        n = int(last.get("eval/episodes", 0)) or "the"
        lines.append(
            f"greedy success on {n} held-out scenes: {first['eval/success_rate']:.2f} after "
            f"iteration {first['iteration']}, {last['eval/success_rate']:.2f} after iteration "
            f"{last['iteration']}"
        )
    if rows:
        lines.append(f"curves: {plot_run(out)}")
    return lines
