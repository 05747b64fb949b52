"""The ``math-grpo`` loop: sample groups, verify, compute advantages, update, sync weights.

One step::

    prompts ──rollout workers──> n responses each ──reward workers──> verifier scores
        -> overlong penalty, advantages (the algorithm's estimator: grpo, rloo, reinforce_pp,
           or gae on the actor's value head for PPO)
        -> DAPO: drop groups whose scores are all equal, sample more (up to max_sample_rounds)
        -> actor workers: token-level PPO loss, optional KL and value terms, gradient
           accumulation (rlinf_vla.training.Learner)
        -> weights broadcast to the rollout workers

Responses whose advantage is exactly 0 (every response of the group scored the same) add
nothing to the gradient; the actor skips their forward and backward passes but keeps them in
the loss normaliser, so the update equals the one over the whole batch.
"""

from __future__ import annotations

import random
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch

from rlinf_vla.algos import dynamic_sampling, overlong_penalty, whiten
from rlinf_vla.algos.presets import estimate, estimator_kind
from rlinf_vla.config import ConfigError, to_dict
from rlinf_vla.reasoning.config import MathGrpoJob
from rlinf_vla.reasoning.data import Problem, PromptSampler, load_problems
from rlinf_vla.reasoning.scoring import summarize
from rlinf_vla.reasoning.workers import ActorWorker, RewardWorker, RolloutWorker, Sequence
from rlinf_vla.run.checkpoints import (
    Resume,
    begin_checkpoint,
    finish_checkpoint,
    load_runner_state,
    prepare_resume,
    resume_checkpoint,
)
from rlinf_vla.run.loop import (
    RunLoop,
    Say,
    count_text,
    device_ranges,
    device_summary,
)
from rlinf_vla.run.tracking import (
    MetricsLogger,
    complete_checkpoints,
    run_folder,
)
from rlinf_vla.runtime import (
    Cluster,
    WorkerError,
    WorkerGroup,
    create_collective,
    split_evenly,
    wait_all,
    wait_started,
)
from rlinf_vla.runtime.memory import group_memory_metrics, read_memory, with_memory_hint
from rlinf_vla.training.objective import Counts, LossSettings, merge_ranks

WEIGHTS = "math-weights"

DATA_PARALLEL = "math-data-parallel"


class MathGrpoRunner:
    """Launches the rollout, reward and actor groups of a :class:`MathGrpoJob` and trains."""

    def __init__(
        self,
        job: MathGrpoJob,
        cluster: Cluster,
        train: list[Problem],
        held_out: list[Problem],
        checkpoint: Resume | None = None,
    ) -> None:
        """``checkpoint``: the checkpoint a resumed run continues from (default: the newest
        complete one of ``runner.resume``)."""
        self.job, self.held_out, self.num_train = job, held_out, len(train)
        self._memory: dict[str, list[dict[str, float]]] = {}  # the last memory readings
        self.cluster_devices = cluster.devices
        r, a = job.runner, job.algo
        placement = self.placement = job.placement.resolve(cluster.num_devices)
        offload = job.placement.mode == "collocated"
        model = to_dict(job.model)
        longest = max(a.max_new_tokens, r.eval_max_new_tokens or 0)
        max_model_len = job.data.max_prompt_tokens + longest
        self.output_dir = run_folder(r.name, r.output_dir, r.resume)
        if r.resume and checkpoint is None:
            checkpoint = resume_checkpoint(r.resume, "step")
        self.checkpoint = checkpoint
        try:
            self.actor = WorkerGroup(
                cluster,
                ActorWorker,
                "actor",
                placement.of("actor"),
                args=(model, to_dict(a), r.seed, offload),
                wait=False,
            )
            self.rollout = WorkerGroup(
                cluster,
                RolloutWorker,
                "rollout",
                placement.of("rollout"),
                args=(model, r.seed, offload, max_model_len),
                wait=False,
            )
            self.reward = WorkerGroup(
                cluster,
                RewardWorker,
                "reward",
                placement.of("reward"),
                args=(a.format_weight, a.fallback_last_number),
                wait=False,
            )
            # The groups start at once: a worker's start is mostly imports and model building.
            wait_started([self.actor, self.rollout, self.reward])
            create_collective(WEIGHTS, [(self.actor, [0]), (self.rollout, None)])
            if self.actor.world_size > 1:
                create_collective(DATA_PARALLEL, [(self.actor, None)])
                self.actor.join_data_parallel(DATA_PARALLEL).wait()
            self.pad_id = self.rollout.pad_id(ranks=[0]).wait()[0]
            self.sampler = PromptSampler(train, r.seed)
            self.shuffle = random.Random(r.seed + 1)
            self.start_step = 0
            if self.checkpoint is not None:
                self.start_step = self._restore(self.checkpoint.path)
            self.version = self.start_step
            self._sync()
        except BaseException:
            # Nothing outlives a failed start (on a long-lived Ray cluster).
            self.shutdown()
            raise

    # ----------------------------------------------------------------- pieces
    def _sync(self) -> float:
        t = time.perf_counter()
        wait_all(
            [
                self.actor.sync_to(WEIGHTS, self.version, ranks=[0]),
                self.rollout.sync_from(WEIGHTS, self.version),
            ]
        )
        return time.perf_counter() - t

    def _data(self) -> dict[str, Any]:
        d = self.job.data
        return {
            "system_prompt": d.system_prompt,
            "prompt_suffix": d.prompt_suffix,
            "max_prompt_tokens": d.max_prompt_tokens,
        }

    def _sampling(self, greedy: bool = False) -> dict[str, Any]:
        a, r = self.job.algo, self.job.runner
        return {
            "max_new_tokens": (r.eval_max_new_tokens or a.max_new_tokens)
            if greedy
            else a.max_new_tokens,
            "temperature": 0.0 if greedy else a.temperature,
            "top_p": a.top_p,
            "top_k": a.top_k,
            "stop_strings": a.stop_strings,
        }

    def _generate(self, problems: list[Problem], n: int, greedy: bool = False) -> dict[str, Any]:
        """Responses of the rollout workers, each taking a contiguous share of the prompts."""
        results = self.rollout.scatter(
            "generate",
            [p.question for p in problems],
            args=(n, self._data(), self._sampling(greedy)),
        )
        merged: dict[str, Any] = {k: [] for k in ("prompts", "responses", "texts", "stopped")}
        for res in results:
            for k in merged:
                merged[k].extend(res[k])
        merged["truncated_prompts"] = sum(res["truncated_prompts"] for res in results)
        merged["seconds"] = max(res["seconds"] for res in results)
        return merged

    def _score(
        self, texts: list[str], references: list[str]
    ) -> list[tuple[float, bool, bool, bool]]:
        return [row for rows in self.reward.scatter("score", texts, references) for row in rows]

    # ----------------------------------------------------------------- one step
    def sample_batch(self) -> tuple[list[dict[str, Any]], dict[str, float]]:
        """Groups of responses with their scores; DAPO refills filtered groups."""
        a = self.job.algo
        preset = a.preset
        groups: list[dict[str, Any]] = []
        stats = {
            "gen_s": 0.0,
            "reward_s": 0.0,
            "sampled_groups": 0,
            "filtered_groups": 0,
            "truncated_prompts": 0,
            "all": [],
        }
        rounds = a.max_sample_rounds if preset.dynamic_sampling else 1
        for _ in range(rounds):
            need = a.prompts_per_step - len(groups)
            if need <= 0:
                break
            problems = self.sampler.sample(need)
            gen = self._generate(problems, a.group_size)
            stats["gen_s"] += gen["seconds"]
            stats["truncated_prompts"] += gen["truncated_prompts"]
            t = time.perf_counter()
            texts = [t_ for group in gen["texts"] for t_ in group]
            refs = [p.answer for p in problems for _ in range(a.group_size)]
            scored = self._score(texts, refs)
            stats["reward_s"] += time.perf_counter() - t
            lengths = torch.tensor([len(r) for g in gen["responses"] for r in g])
            reward = torch.tensor([s[0] for s in scored], dtype=torch.float32)
            if a.overlong_tokens:
                reward = reward + overlong_penalty(
                    lengths,
                    max_length=a.max_new_tokens,
                    buffer_length=a.overlong_tokens,
                    penalty_factor=a.overlong_penalty_factor,
                )
            keep = torch.ones(len(problems), dtype=torch.bool)
            if preset.dynamic_sampling:
                mask, _ = dynamic_sampling(reward, a.group_size)
                keep = mask.view(-1, a.group_size)[:, 0]
            stats["sampled_groups"] += len(problems)
            stats["filtered_groups"] += int((~keep).sum())
            G = a.group_size
            for i, p in enumerate(problems):
                rows = range(i * G, (i + 1) * G)
                group = {
                    "problem": p,
                    "prompt": gen["prompts"][i],
                    "responses": gen["responses"][i],
                    "stopped": gen["stopped"][i],
                    "score": reward[i * G : (i + 1) * G],
                    "scored": [scored[j] for j in rows],
                }
                stats["all"].append(group)
                if keep[i]:
                    groups.append(group)
        return groups, stats

    def sequences(self, groups: list[dict[str, Any]]) -> list[Sequence]:
        """Every response of ``groups`` with its per-token advantages (``rlinf_vla.algos``, as
        the algorithm's ``advantage`` says; PPO also with its value targets)."""
        a = self.job.algo
        seqs = [Sequence(g["prompt"], r, []) for g in groups for r in g["responses"]]
        if not seqs:
            return []
        scores = torch.cat([g["score"] for g in groups])
        lengths = [len(s.response) for s in seqs]
        kind = estimator_kind(a.advantage)
        if kind == "group":  # one advantage per response, on each of its tokens
            adv, _ = estimate(a, scores=scores, group_size=a.group_size)
            for s, value, n in zip(seqs, adv.tolist(), lengths, strict=True):
                s.advantages = [value] * n
            return seqs
        # Token sequences, time-major [L, B]: the score on each response's last token.
        L, B = max(lengths), len(lengths)
        mask = torch.zeros(L, B, dtype=torch.bool)
        rewards = torch.zeros(L, B)
        for b, n in enumerate(lengths):
            mask[:n, b] = True
            rewards[n - 1, b] = scores[b]
        if kind == "return":  # REINFORCE++: the KL to the reference may join the reward
            kl = None
            if a.kl_coef > 0 and a.kl_in_reward:
                kl = _per_token(
                    self.actor.scatter("kl_to_reference", seqs, args=(self.pad_id,)), L, B
                )
            adv, _ = estimate(
                a,
                rewards=rewards,
                mask=mask,
                dones=None,
                gamma=a.gamma,
                kl=kl,
                kl_coef=a.kl_coef,
            )
            for b, s in enumerate(seqs):
                s.advantages = adv[: lengths[b], b].tolist()
            return seqs
        # a critic (e.g. gae, PPO): its values at rollout time; 0 after the last token.
        values = torch.zeros(L + 1, B)
        values[:L] = _per_token(self.actor.scatter("token_values", seqs, args=(self.pad_id,)), L, B)
        terminated = torch.zeros(L, B, dtype=torch.bool)
        for b, n in enumerate(lengths):
            terminated[n - 1, b] = True
        adv, ret = estimate(
            a,
            rewards=rewards,
            values=values,
            terminated=terminated,
            truncated=torch.zeros_like(terminated),
            final_values=None,
            gamma=a.gamma,
        )
        if a.normalize_advantages and mask.sum() > 1:
            adv = whiten(adv, mask)
        for b, s in enumerate(seqs):
            n = lengths[b]
            s.advantages = adv[:n, b].tolist()
            s.returns = ret[:n, b].tolist()
            s.values = values[:n, b].tolist()
        return seqs

    def update(self, groups: list[dict[str, Any]], step: int) -> dict[str, float]:
        a = self.job.algo
        seqs = self.sequences(groups)
        self.shuffle.shuffle(seqs)
        n_mb = a.batch_size // a.minibatch_size if a.minibatch_size else 1
        minibatches = [mb for mb in split_evenly(seqs, min(n_mb, len(seqs))) if mb]
        # Each term divides by its count over the whole minibatch (all micro-batches and
        # ranks): the policy and KL terms as algo.agg counts, the value term its tokens.
        counts = [
            Counts(
                policy=float(sum(len(s.response) for s in mb))
                if a.agg == "token-mean"
                else float(len(mb)),
                value=float(sum(len(s.response) for s in mb)),
                tokens=float(sum(len(s.response) for s in mb)),
            )
            for mb in minibatches
        ]
        settings = LossSettings.of(a)
        skip = a.skip_zero_advantage and not settings.kl_coef and not settings.value_coef
        active = [not skip or any(not s.zero_advantage for s in mb) for mb in minibatches]
        if not any(active):  # no gradient anywhere: no update, the weights stay as they are
            return {
                "train/updates": 0.0,
                "train/skipped_updates": 0.0,
                "train/skipped_zero_advantage": 1.0,
            }
        world = self.actor.world_size
        # Each rank takes every world-th response of a minibatch (by length, for balance).
        shards = [
            [sorted(mb, key=lambda s: len(s.response))[r::world] for mb in minibatches]
            for r in range(world)
        ]
        calls = [
            self.actor.train(shards[r], counts, active, self.pad_id, step, ranks=[r])
            for r in range(world)
        ]
        per_rank = [c.wait()[0] for c in calls]
        out = merge_ranks(per_rank, summed=("train/skipped_zero_advantage",))
        out["train/skipped_zero_advantage"] /= max(1, len(seqs) * a.update_epochs)
        return out

    def step(self, step: int) -> dict[str, Any]:
        t0 = time.perf_counter()
        groups, stats = self.sample_batch()
        metrics = _rollout_metrics(stats, self.job.algo.max_new_tokens)
        metrics["time/sync_s"] = 0.0
        metrics.update(self.update(groups, step) if groups else {"train/updates": 0.0})
        if metrics["train/updates"]:
            self.version += 1
            metrics["time/sync_s"] = self._sync()
        for key in ("time/train_s", "time/logprob_s", "train/skipped_updates"):
            metrics.setdefault(key, 0.0)
        metrics["time/generation_s"] = stats["gen_s"]
        metrics["time/reward_s"] = stats["reward_s"]
        elapsed = time.perf_counter() - t0
        metrics["time/step_s"] = elapsed
        metrics["throughput/tokens_per_s"] = metrics["response/tokens"] / elapsed
        metrics["throughput/generated_tokens_per_s"] = metrics["response/tokens"] / max(
            stats["gen_s"], 1e-9
        )
        metrics["train/groups"] = float(len(groups))
        workers = {"rollout": self.rollout, "reward": self.reward, "actor": self.actor}
        self._memory = read_memory(workers)
        metrics.update(group_memory_metrics(self._memory))
        return metrics

    # ----------------------------------------------------------------- evaluation
    def evaluate(self) -> dict[str, float]:
        """Greedy accuracy on the held-out problems: ``avg@1`` of ``rlinf-vla math-eval``,
        scored and aggregated by the same functions (:mod:`~rlinf_vla.reasoning.scoring`)."""
        t = time.perf_counter()
        bs = self.job.runner.eval_batch_size * self.rollout.world_size
        texts, stopped, lengths = [], [], []
        for i in range(0, len(self.held_out), bs):
            gen = self._generate(self.held_out[i : i + bs], 1, greedy=True)
            texts += [g[0] for g in gen["texts"]]
            stopped += [g[0] for g in gen["stopped"]]
            lengths += [len(g[0]) for g in gen["responses"]]
        references = [p.answer for p in self.held_out]
        cut = [not s for s in stopped]
        scored = [
            row
            for rows in self.reward.scatter("score_samples", texts, references, lengths, cut)
            for row in rows
        ]
        m = summarize([[s] for s in scored])
        return {
            "eval/accuracy": m["avg@1"]["value"],
            "eval/boxed_rate": m["boxed_rate"],
            "eval/unparseable_rate": m["unparseable_rate"],
            "eval/response_length": m["mean_length"],
            "eval/cut_at_limit_rate": m["cut_at_limit_rate"],
            "time/eval_s": time.perf_counter() - t,
        }

    def header(self) -> list[str]:
        """What this run trains, on what, where: printed before the first step."""
        job, a = self.job, self.job.algo
        counts = self.actor.parameter_counts(ranks=[0]).wait()[0]
        folder, gguf = job.model.source()
        model = Path(gguf).name if gguf else folder
        lora = f", LoRA rank {job.model.lora_rank}" if job.model.lora_rank else ""
        data = job.data.path or f"{job.data.source} problems"
        groups = ", ".join(
            f"{c} {device_ranges(self.placement.of(c))}" for c in ("rollout", "reward", "actor")
        )
        mode = self.job.placement.mode
        return [
            f"rlinf-vla math-grpo: {a.name}, {a.prompts_per_step} prompts x {a.group_size} "
            f"responses per step (up to {a.max_new_tokens} new tokens), {job.runner.max_steps} "
            "steps",
            f"model {model}{lora}: {count_text(counts['total'])} parameters, "
            f"{count_text(counts['trained'])} trained"
            + (", sampled by vLLM" if job.model.rollout_backend == "vllm" else ""),
            f"data {data}: {self.num_train} train, {len(self.held_out)} held-out problems",
            f"placement {mode}: {groups} on {device_summary(self.cluster_devices)}",
        ]

    # ----------------------------------------------------------------- loop
    def run(self) -> Path:
        """Train from ``start_step`` to ``runner.max_steps``; returns the run folder (the
        console names the last checkpoint to resume from if it stops early)."""
        r = self.job.runner
        loop = RunLoop(
            self.output_dir,
            self.job.raw,
            r.logging,
            command="math-grpo",
            unit="step",
            total=r.max_steps,
            save_interval=r.save_interval,
            max_nan_updates=r.max_nan_updates,
            devices=[str(d) for d in self.cluster_devices],
            header=self.header(),
            last_checkpoint=None if self.checkpoint is None else self.checkpoint.path,
            settings=self.job.settings(),
        )

        def before(logger: MetricsLogger, say: Say) -> str | None:
            if not r.eval_interval or self.start_step:
                return None
            say("greedy evaluation of the initial model ...")
            first = {"iteration": 0, "samples": 0, **self.evaluate()}
            logger.log(first)
            return f"held-out accuracy before training: {first['eval/accuracy']:.3f}"

        def iteration(step: int, logger: MetricsLogger, say: Say) -> dict[str, Any]:
            try:
                metrics = {"iteration": step + 1, **self.step(step)}
            except WorkerError as e:
                raise with_memory_hint(e, self._memory, step) from None
            metrics["samples"] = (step + 1) * self.job.algo.batch_size
            if r.eval_interval and ((step + 1) % r.eval_interval == 0 or step + 1 == r.max_steps):
                say("greedy evaluation ...")
                metrics.update(self.evaluate())
            return metrics

        return loop.run(self.start_step, iteration, self.save, _status, before)

    # ----------------------------------------------------------------- checkpoints
    def save(self, step: int) -> Path:
        path = begin_checkpoint(self.output_dir / "checkpoints" / f"step_{step}")
        self.actor.save(str(path)).wait()
        state = {
            "step": step,
            "sampler": (self.sampler.order, self.sampler.epoch, self.sampler.rng.getstate()),
            "shuffle": self.shuffle.getstate(),
            "rollout_rng": self.rollout.rng_state().wait(),
        }
        torch.save(state, path / "runner.pt")
        # Every writer (the actor workers, on this machine, and the driver) has finished.
        finish_checkpoint(path, step)
        keep = self.job.runner.keep_checkpoints
        if keep:
            # Up to this step: a newer folder is one a resume skipped as damaged, which must
            # not push the good ones out.
            done = complete_checkpoints(self.output_dir, "step")
            done = [p for p in done if int(p.name.rsplit("_", 1)[1]) <= step]
            for old in done[:-keep]:
                shutil.rmtree(old, ignore_errors=True)
        return path

    def _restore(self, path: Path) -> int:
        state = load_runner_state(path)
        self.actor.load(str(path)).wait()
        order, epoch, rng = state["sampler"]
        self.sampler.order, self.sampler.epoch = list(order), epoch
        self.sampler.rng.setstate(rng)
        self.shuffle.setstate(state["shuffle"])
        saved = state["rollout_rng"]
        if len(saved) == self.rollout.world_size:
            wait_all([self.rollout.set_rng_state(s, ranks=[i]) for i, s in enumerate(saved)])
        return int(state["step"])

    def shutdown(self) -> None:
        for name in ("rollout", "reward", "actor"):
            if name in self.__dict__:  # all of them unless the start failed
                self.__dict__[name].shutdown()


def _per_token(per_rank: list[list[list[float]]], L: int, B: int) -> torch.Tensor:
    """Per-response token values gathered from the actor ranks (in response order) ->
    ``[L, B]``, 0 after each response's end."""
    out = torch.zeros(L, B)
    for b, row in enumerate(r for rows in per_rank for r in rows):
        out[: len(row), b] = torch.tensor(row)
    return out


def _rollout_metrics(stats: dict[str, Any], max_new_tokens: int) -> dict[str, float]:
    """Reward, accuracy and length statistics of every sampled response (kept or filtered)."""
    rows = [(s, r) for g in stats["all"] for s, r in zip(g["scored"], g["responses"], strict=True)]
    stopped = [x for g in stats["all"] for x in g["stopped"]]
    scores = torch.cat([g["score"] for g in stats["all"]])
    n = len(rows)
    lengths = [len(r) for _, r in rows]
    return {
        "reward/mean": float(scores.mean()),
        "reward/accuracy": sum(s[1] for s, _ in rows) / n,
        "reward/boxed_rate": sum(s[2] for s, _ in rows) / n,
        "reward/unparseable": float(sum(not s[3] for s, _ in rows)),
        "response/length_mean": sum(lengths) / n,
        "response/length_max": float(max(lengths)),
        "response/cut_at_limit_rate": sum(not s for s in stopped) / n,
        "response/tokens": float(sum(lengths)),
        "rollout/truncated_prompts": float(stats["truncated_prompts"]),
        "dapo/filtered_group_fraction": stats["filtered_groups"] / max(1, stats["sampled_groups"]),
    }


def _status(metrics: dict[str, Any]) -> str:
    text = (
        f"reward {metrics['reward/mean']:.2f}  acc {metrics['reward/accuracy']:.2f}  "
        f"len {metrics['response/length_mean']:.0f}  {metrics['throughput/tokens_per_s']:.0f} tok/s"
    )
    if "eval/accuracy" in metrics:
        text += f"  held-out {metrics['eval/accuracy']:.3f}"
    if "memory/total_rss_gib" in metrics:  # what the workers hold together
        text += f"  {metrics['memory/total_rss_gib']:.1f} GiB"
    return text


def run(job: MathGrpoJob) -> Path:
    """``rlinf-vla math-grpo``: load the data, start the cluster, train, print the run folder."""
    try:
        train, held_out = load_problems(job.data)
    except ValueError as e:
        raise ConfigError(f"data: {e}") from None
    # A resume's config and checkpoint are checked before anything starts.
    checkpoint = prepare_resume(
        job.runner.resume,
        job.raw,
        "step",
        lambda line: print(line, file=sys.stderr),
        settings=job.settings(),
    )
    with Cluster(job.cluster) as cluster:
        runner = MathGrpoRunner(job, cluster, train, held_out, checkpoint)
        try:
            out = runner.run()
        finally:
            runner.shutdown()
    print(f"run folder: {out}  (metrics.jsonl, config.yaml, checkpoints/)")
    return out
