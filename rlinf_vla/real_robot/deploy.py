"""``rlinf-vla deploy``: the robot client loop.

Each control tick (at the server's control rate unless ``control_rate_hz`` is set): read the
cameras and proprioception, ask the policy server for an action chunk when the previous one is
used up (in the background when ``realtime``, so the safety layer keeps ticking while the
request is in flight), scale the next action into metres/radians, pass it through the
:class:`~rlinf_vla.real_robot.safety.SafetyFilter` and send the safe target to the robot; every
tick is recorded (:mod:`.recording`). SIGINT/SIGTERM or Enter trigger the e-stop, which calls
``robot.stop()`` at once and ends the episode::

    rlinf-vla deploy robot=sim server=ws://127.0.0.1:8000 instruction="pick up the red cube"
    rlinf-vla deploy robot=franka robot.host=172.16.0.2 server=ws://gpu-box:8000 \\
        token=$TOKEN instruction="put the cup on the plate" max_steps=300
    rlinf-vla deploy robot=sim server=ws://gpu-box:8000 protocol=openpi control_rate_hz=20

``protocol=openpi`` talks to an openpi policy server (:class:`.openpi.OpenpiClient`: LIBERO's
flat observation keys, ``Api-Key`` token, ``{"actions": ...}`` replies).
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

from rlinf_vla.config import ConfigError, RunAborted, check_sections, from_section, to_dict
from rlinf_vla.real_robot.kinematics import matrix_to_rotvec
from rlinf_vla.real_robot.protocol import CONTROL_RATE_RANGE_HZ
from rlinf_vla.real_robot.robot import Robot
from rlinf_vla.real_robot.safety import EStop, SafetyConfig, SafetyFilter
from rlinf_vla.real_robot.validation import require_finite

__all__ = ["ROBOTS", "DeployJob", "EpisodeResult", "make_robot", "run", "run_episode", "validate"]

log = logging.getLogger(__name__)

#: Robot backends: name -> (config module:class, robot module:class). Imported when used.
ROBOTS: dict[str, tuple[str, str]] = {
    "sim": ("rlinf_vla.real_robot.sim:SimFrankaConfig", "rlinf_vla.real_robot.sim:SimFranka"),
    "franka": ("rlinf_vla.real_robot.franka:FrankaConfig", "rlinf_vla.real_robot.franka:Franka"),
}


def _load(path: str) -> Any:
    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)


def robot_config(section: Any) -> Any:
    """The typed config of the ``robot`` section (its ``name`` picks the backend)."""
    values = dict(section)
    name = values.get("name")
    if name not in ROBOTS:
        raise ConfigError(
            f"robot.name: unknown robot {name!r} (known: {', '.join(sorted(ROBOTS))})"
        )
    return from_section(_load(ROBOTS[name][0]), values, "robot")


def make_robot(cfg: Any) -> Robot:
    """Build the backend of a robot config (imports its libraries now)."""
    return _load(ROBOTS[cfg.name][1])(cfg)


@dataclass
class ActionConfig:
    """How the policy's actions map to the robot (the ``action`` section).

    Attributes:
        translation_scale: metres per policy unit of ``dx, dy, dz`` (1.0: already metres).
        rotation_scale: radians per policy unit of ``drx, dry, drz``.
        actions_per_query: execute this many actions of each chunk before asking again
            (``0``: the whole chunk).
    """

    translation_scale: float = 1.0
    rotation_scale: float = 1.0
    actions_per_query: int = 0

    def __post_init__(self) -> None:
        require_finite(self, "action")
        if self.translation_scale <= 0 or self.rotation_scale <= 0:
            raise ValueError("action.translation_scale and action.rotation_scale must be > 0")
        if self.actions_per_query < 0:
            raise ValueError("action.actions_per_query must be >= 0")


@dataclass
class RecordConfig:
    """The ``record`` section: where and how episodes are written (see :mod:`.recording`)."""

    enabled: bool = True
    output_dir: str = "episodes"
    video: str = "mp4"

    def __post_init__(self) -> None:
        if self.video not in ("mp4", "png"):
            raise ValueError(f"record.video must be 'mp4' or 'png', got {self.video!r}")


@dataclass
class DeployJob:
    """A validated ``rlinf-vla deploy`` job."""

    robot: Any
    server: str
    instruction: str
    token: str | None = None
    episodes: int = 1
    max_steps: int = 200
    control_rate_hz: float | None = None
    realtime: bool = True
    connect_timeout_s: float = 10.0
    max_refusals: int = 3
    protocol: str = "native"
    openpi_layout: str = "libero"
    action: ActionConfig = field(default_factory=ActionConfig)
    safety: SafetyConfig = field(default_factory=SafetyConfig)
    record: RecordConfig = field(default_factory=RecordConfig)

    def __post_init__(self) -> None:
        require_finite(self, "")
        if not self.server.startswith(("ws://", "wss://")):
            raise ValueError(f"server must be a ws:// or wss:// URL, got {self.server!r}")
        if not self.instruction.strip():
            raise ValueError("instruction is empty: say what the robot should do")
        if self.episodes < 1 or self.max_steps < 1:
            raise ValueError("episodes and max_steps must be >= 1")
        low, high = CONTROL_RATE_RANGE_HZ
        if self.control_rate_hz is not None and not low <= self.control_rate_hz <= high:
            raise ValueError(
                f"control_rate_hz must be in [{low:g}, {high:g}] Hz, got {self.control_rate_hz}"
            )
        if self.max_refusals < 1:
            raise ValueError(f"max_refusals must be >= 1, got {self.max_refusals}")
        if not self.connect_timeout_s > 0:
            raise ValueError(f"connect_timeout_s must be > 0, got {self.connect_timeout_s}")
        from rlinf_vla.real_robot.openpi import PROTOCOLS, OpenpiClient

        if self.protocol not in PROTOCOLS:
            raise ValueError(
                f"protocol must be one of {', '.join(PROTOCOLS)}, got {self.protocol!r}"
            )
        if self.openpi_layout not in OpenpiClient.ROBOT_LAYOUTS:
            raise ValueError(
                f"openpi_layout must be one of {', '.join(OpenpiClient.ROBOT_LAYOUTS)} (a Franka "
                "sends LIBERO's 8-d proprioception and executes its TCP-delta actions), got "
                f"{self.openpi_layout!r}"
            )


_TOP = {f for f in DeployJob.__dataclass_fields__}


def validate(cfg: Any) -> DeployJob:
    """Typed configs for a composed ``deploy`` config; starts nothing, connects to nothing."""
    from omegaconf import OmegaConf

    values = OmegaConf.to_container(cfg, resolve=True) if not isinstance(cfg, dict) else dict(cfg)
    check_sections(values, _TOP)
    robot = robot_config(values.pop("robot", {}) or {})
    job = from_section(DeployJob, {**values, "robot": {}}, "")
    job.robot = robot
    if robot.name == "franka" and not job.realtime:
        raise ConfigError(
            "realtime=false steps a simulator as fast as it can; a real arm needs realtime=true"
        )
    return job


# ------------------------------------------------------------------------------ the loop
@dataclass
class EpisodeResult:
    """What one episode did."""

    steps: int
    folder: Path | None
    interventions: dict[str, int]
    queries: int
    server_errors: int
    latency_ms: list[float]
    estopped: bool


#: The robot's proprioception: TCP position, axis-angle, two finger positions
#: (``RobotState.proprio()``).
PROPRIO_DIM = 8


def fit_problems(meta: Any, cameras: Sequence[str], job: DeployJob) -> list[str]:
    """Every way the served policy (its ``meta``) does not fit the robot (its ``cameras``): its
    cameras, the 7-D action convention, the proprioception size."""
    robot = job.robot.name
    problems = []
    missing = [k for k in meta.image_keys if k not in cameras]
    if missing:
        problems.append(
            f"the policy needs cameras {list(meta.image_keys)}; robot {robot!r} has "
            f"{list(cameras)} (missing {missing})"
        )
    if meta.action_dim != 7:
        problems.append(
            f"the policy's action_dim is {meta.action_dim}; the Franka convention needs 7"
        )
    if meta.state_dim is not None and (
        meta.state_dim < PROPRIO_DIM or (meta.state_dim_exact and meta.state_dim != PROPRIO_DIM)
    ):
        problems.append(
            f"the policy reads a state of {meta.state_dim} values; the robot sends "
            f"{PROPRIO_DIM} (TCP position, axis-angle, two finger positions)"
        )
    return problems


def rate_problem(meta: Any, job: DeployJob) -> str | None:
    """Why no control rate is known (``None`` when the job or the server gives one)."""
    if job.control_rate_hz or meta.control_rate_hz:
        return None
    return (
        f"the server at {job.server} does not advertise a control rate (openpi servers do "
        "not): set control_rate_hz to the rate the policy was trained at"
    )


class RecordingFailed(RunAborted):
    """Writing an episode's record failed (a full disk, a removed folder): the robot was
    stopped, and the message says how much of the record there is."""


@contextlib.contextmanager
def _recording(folder: Path, then: str) -> Iterator[None]:
    """``RecordingFailed`` naming ``folder`` for an ``OSError`` of the block."""
    try:
        yield
    except OSError as e:
        raise RecordingFailed(
            f"cannot record to {folder} ({type(e).__name__}: {e}); {then}"
        ) from None


def run_episode(
    robot: Robot,
    client: Any,
    job: DeployJob,
    estop: EStop | None = None,
    episode_index: int = 0,
) -> EpisodeResult:
    """Run one episode of ``job`` on ``robot`` with a connected :class:`PolicyClient`.

    Raises:
        ValueError: the served policy does not fit the robot (:func:`fit_problems`).
        RunAborted: the server sent a malformed reply (wrong type, shape or non-finite
            actions; nothing of it was executed) or refused ``job.max_refusals`` requests in
            a row. The robot was stopped and the episode so far recorded (``meta.json`` has
            the reason under ``aborted``).
    """
    from rlinf_vla.real_robot.client import BadReply, ServerError
    from rlinf_vla.real_robot.recording import EpisodeWriter

    meta = client.metadata
    problems = [*fit_problems(meta, robot.camera_names, job), rate_problem(meta, job)]
    if any(problems):
        raise ValueError("; ".join(p for p in problems if p))
    rate = job.control_rate_hz or meta.control_rate_hz
    dt = 1.0 / rate
    estop = estop or EStop()
    safety = SafetyFilter(job.safety, dt, estop)
    estop.on_trigger(robot.stop)
    per_query = job.action.actions_per_query or meta.chunk_size or None  # None: all of it
    scale = np.array([job.action.translation_scale] * 3 + [job.action.rotation_scale] * 3)

    writer = None
    if job.record.enabled:
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
        folder = Path(job.record.output_dir) / f"{stamp}-{job.robot.name}-ep{episode_index:03d}"
        with _recording(folder, "the robot did not move"):
            writer = EpisodeWriter(
                folder,
                list(robot.camera_names),
                job.record.video,
                rate,
                meta={
                    "instruction": job.instruction,
                    "robot": to_dict(job.robot),
                    "server": job.server,
                    "control_rate_hz": rate,
                    "policy": {**meta.__dict__, "image_keys": list(meta.image_keys)},
                    "action": to_dict(job.action),
                    "safety": to_dict(job.safety),
                },
            )
    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="policy-query")
    future: Future | None = None
    chunk: list[tuple[np.ndarray, float]] = []
    queries = server_errors = late_chunks = refused = 0
    aborted: str | None = None
    record_failed = False  # writing the record failed: the abort is the disk's, not the server's
    latency: list[float] = []
    steps = 0
    state = robot.reset()
    next_tick = time.monotonic()

    # The safety layer's clock: wall time on a real-time loop; simulated time (one dt per tick,
    # queries take none) when a simulator is stepped as fast as possible.
    def clock() -> float:
        return time.monotonic() if job.realtime else steps * dt

    try:
        for _ in range(job.max_steps):
            state = robot.read()
            images = {k: state.images[k] for k in meta.image_keys}
            proprio = state.proprio()
            if not chunk and future is None and not estop.triggered:
                # A chunk's age is measured from the observation it is computed on.
                sent = time.monotonic()
                observed = state.timestamp if job.realtime else clock()
                future = executor.submit(
                    client.infer, images, proprio if meta.state_dim else None, job.instruction
                )
                queries += 1
            if future is not None and (future.done() or not job.realtime):
                try:
                    actions, _timing = future.result()
                    latency.append((time.monotonic() - sent) * 1000.0)
                    # Action k is due k ticks after its observation; the safety layer drops
                    # (holds) any executed more than watchdog_s after that.
                    chunk = [(a, observed + k * dt) for k, a in enumerate(actions[:per_query])]
                    refused = 0
                except ServerError as e:
                    server_errors += 1
                    refused += 1
                    log.error("server refused the request: %s", e.reason)
                    if refused >= job.max_refusals:
                        aborted = (
                            f"the policy server refused {refused} requests in a row (the last: "
                            f"{e.reason})"
                        )
                        log.error("%s; stopping the robot", aborted)
                        robot.stop()
                        break
                except BadReply as e:
                    aborted = f"bad reply from the policy server: {e} (nothing of it was executed)"
                    log.error("%s; stopping the robot", aborted)
                    robot.stop()
                    break
                future = None
            raw, scheduled = chunk.pop(0) if chunk else (None, None)
            metric = None
            if raw is not None:
                metric = np.asarray(raw, dtype=np.float64).copy()
                if metric.shape == (7,):
                    metric[:6] = metric[:6] * scale
            cmd = safety(metric, state, clock(), scheduled)
            if raw is not None and cmd.hold and "watchdog" in cmd.interventions:
                # The rest of the chunk is as late: drop it and ask again on the next tick.
                late_chunks += 1
                log.warning("dropped a late chunk (%d actions not executed)", len(chunk) + 1)
                chunk = []
            if not estop.triggered:
                robot.command(
                    cmd.target_pos,
                    cmd.target_rot,
                    cmd.gripper_closed,
                    joint_target=cmd.joint_target,
                )
            steps += 1
            if writer is not None:
                executed = np.concatenate(
                    [
                        cmd.delta_pos / scale[:3],
                        cmd.delta_rot / scale[3:],
                        [1.0 if cmd.gripper_closed else -1.0],
                    ]
                )
                policy_action = (
                    np.full(meta.action_dim, np.nan)
                    if raw is None
                    else np.asarray(raw).reshape(-1)[: meta.action_dim]
                )
                try:
                    writer.add(
                        timestamp=state.timestamp,
                        images=state.images,
                        state=proprio,
                        joint_positions=state.joint_positions,
                        ee_pos=state.ee_pos,
                        ee_rotvec=matrix_to_rotvec(state.ee_rot),
                        gripper_width=state.gripper_width,
                        policy_action=policy_action,
                        action=executed,
                        hold=cmd.hold,
                        interventions=safety.last,
                    )
                except OSError as e:  # a full disk, a folder removed: stop, say so
                    record_failed = True
                    aborted = f"recording to {writer.folder} failed ({type(e).__name__}: {e})"
                    log.error("%s; stopping the robot", aborted)
                    robot.stop()
                    break
            if "estop" in cmd.interventions:
                break  # the stop is recorded as this tick's hold
            if estop.triggered:
                continue  # triggered during this tick: record the stop at once, no waiting
            if job.realtime:
                next_tick += dt
                delay = next_tick - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
                else:
                    next_tick = time.monotonic()  # overran: do not try to catch up
    except BaseException as e:  # the connection failed (closed, a frame too big, no answer)
        if aborted is None:
            aborted = f"{type(e).__name__}: {e}"
        raise
    finally:
        robot.stop()
        executor.shutdown(wait=False, cancel_futures=True)
        folder = None
        if writer is not None:
            try:
                folder = writer.close(
                    interventions=safety.summary(),
                    estop=estop.reason,
                    queries=queries,
                    server_errors=server_errors,
                    late_chunks=late_chunks,
                    aborted=aborted,
                )
            except OSError as e:
                record_failed = True
                reason = f"writing the record to {writer.folder} failed ({type(e).__name__}: {e})"
                log.error("%s", reason)
                aborted = reason if aborted is None else f"{aborted}; then {reason}"
    if aborted is not None:
        where = f"; the episode so far is in {folder}" if folder is not None else ""
        if record_failed and folder is None:
            where = "; the episode's record is incomplete"
        error = RecordingFailed if record_failed else RunAborted
        raise error(f"{aborted}; the robot was stopped{where}")
    return EpisodeResult(
        steps, folder, safety.summary(), queries, server_errors, latency, estop.triggered
    )


def run(job: DeployJob) -> list[EpisodeResult]:
    """Connect, run ``job.episodes`` episodes, print a summary per episode."""
    from rich.console import Console
    from websockets.exceptions import ConnectionClosed

    from rlinf_vla.real_robot.client import BadReply, PolicyClient
    from rlinf_vla.real_robot.openpi import OpenpiClient

    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    console = Console()
    estop = EStop()
    estop.install_signals()
    estop.watch_keys()
    console.print("[bold red]E-STOP:[/] press Enter (or Ctrl-C) to stop the robot at once")
    results = []
    robot = None  # made once the server has answered and told its rate: nothing moves before
    try:
        try:
            if job.protocol == "openpi":
                client = OpenpiClient(
                    job.server, job.token, job.openpi_layout, timeout=job.connect_timeout_s
                )
            else:
                client = PolicyClient(job.server, job.token, timeout=job.connect_timeout_s)
        except BadReply as e:
            raise RunAborted(f"{job.server}: {e}") from None
        with client:
            console.print(f"connected to {job.server}: {client.metadata}")
            # a missing setting, then everything that does not fit, before the robot starts
            missing_rate = rate_problem(client.metadata, job)
            if missing_rate:
                raise ConfigError(missing_rate)
            problems = fit_problems(client.metadata, job.robot.cameras, job)
            if problems:
                raise RunAborted(
                    f"the policy served at {job.server} does not fit robot "
                    f"{job.robot.name!r}, nothing was started: " + "; ".join(problems)
                )
            robot = make_robot(job.robot)
            for ep in range(job.episodes):
                if estop.triggered:
                    break
                res = run_episode(robot, client, job, estop, ep)
                results.append(res)
                lat = (
                    np.percentile(res.latency_ms, [50, 99]).round(1).tolist()
                    if res.latency_ms
                    else "n/a"
                )
                console.print(
                    f"episode {ep}: {res.steps} steps, {res.queries} queries (latency p50/p99 ms {lat}), "
                    f"interventions {{{', '.join(f'{k}: {v}' for k, v in res.interventions.items() if v)}}}"
                    f"{', E-STOP' if res.estopped else ''} -> {res.folder}"
                )
    except (OSError, TimeoutError, ConnectionClosed) as e:
        raise RunAborted(
            f"no answer from the policy server at {job.server} ({type(e).__name__}: {e}); the robot was "
            "stopped and the episode so far recorded"
        ) from e
    finally:
        if robot is not None:
            robot.stop()
            robot.close()
        estop.restore()
    if estop.triggered:  # the episodes were cut short: say how, with the exit code to match
        print(f"stopped by the e-stop ({estop.reason}); the episode so far is recorded")
        if estop.reason == "signal SIGTERM":
            from rlinf_vla.cli import Terminated

            raise Terminated()
        if estop.reason == "signal SIGINT":
            raise KeyboardInterrupt
        raise RunAborted(f"stopped by the e-stop ({estop.reason}); the episode so far is recorded")
    return results
