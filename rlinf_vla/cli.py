"""The ``rlinf-vla`` command line.

Each subcommand composes its config from the YAML groups shipped in ``rlinf_vla/configs/``
with Hydra overrides (``group=choice``, ``section.key=value``), converts it into typed,
validated configs (pure: nothing is started), then runs::

    rlinf-vla bench                                   # the default config
    rlinf-vla bench benchmark.rounds=5 cluster.num_cpus=2
    rlinf-vla bench --cfg job                         # print the resolved config and exit
    rlinf-vla bench --help                            # its config groups and their choices

Exit codes: 0 done, 1 the run stopped on an error (a crashed worker, too many non-finite
updates), 2 invalid config, 130 Ctrl-C, 143 SIGTERM (both after the console named the last
checkpoint and the command that resumes from it).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from rlinf_vla.config import ConfigError, RunAborted, SectionErrors, check_values

CONFIG_DIR = Path(__file__).parent / "configs"
#: Files shipped with the package (a config names one as ``${asset:<name>}``).
ASSET_DIR = Path(__file__).parent / "assets"


def _asset(name: str) -> str:
    path = ASSET_DIR / name
    if not path.exists():
        known = sorted(p.name for p in ASSET_DIR.iterdir() if p.is_dir())
        raise ConfigError(f"no shipped asset {name!r} (shipped: {', '.join(known)})")
    return str(path)


def _runner_folder(job: Any) -> tuple[str, Path]:
    """The run folder of a trainer's job (its ``runner`` section) and the key that sets it."""
    from rlinf_vla.run.tracking import run_folder

    r = job.runner
    return "runner.resume" if r.resume else "runner.output_dir", run_folder(
        r.name, r.output_dir, r.resume
    )


@dataclass(frozen=True)
class Command:
    """A subcommand: its primary config and the module implementing ``validate`` and ``run``.

    ``validate(cfg) -> job`` must be pure; ``run(job)`` does the work. ``config_root`` is a
    folder under ``configs/`` holding the command's own primary config and groups (e.g. the
    ``algo`` group of ``math-grpo``); groups it lacks (``cluster``...) come from ``configs/``.
    ``output(job)`` names the folder the command writes and the key that sets it (``None``:
    none this time); it must be writable before anything starts (:func:`preflight`). ``sections`` names the config class
    (``module:Class``) of a config group's section, whose fields and docstring ``--help`` lists
    (the policy and env groups' classes come from their registries). ``folder_key`` is the
    key of the folder a run writes, which ``--multirun`` sets for each run. ``example`` is the
    override ``--help`` shows.
    """

    name: str
    help: str
    config_name: str
    module: str
    config_root: str = ""
    output: Callable[[Any], tuple[str, Path] | None] | None = None
    sections: dict[str, str] = field(default_factory=dict)
    folder_key: str | None = None
    example: str = "cluster.num_cpus=2"

    @property
    def config_dir(self) -> Path:
        return CONFIG_DIR / self.config_root

    def load(self) -> tuple[Callable[[Any], Any], Callable[[Any], Any]]:
        mod = importlib.import_module(self.module)
        return mod.validate, mod.run


COMMANDS: dict[str, Command] = {
    c.name: c
    for c in [
        Command(
            "train",
            "RL post-training of a VLA policy in simulation (PPO, GRPO, DAPO, REINFORCE++ or RLOO; or DAgger, algo=dagger, from the env's scripted expert; collocated, disaggregated, hybrid, local (one process) or auto placement)",
            "train",
            "rlinf_vla.pipelines",
            output=_runner_folder,
            folder_key="runner.output_dir",
            sections={
                "cluster": "rlinf_vla.runtime.cluster:ClusterConfig",
                "placement": "rlinf_vla.pipelines.config:TrainPlacementConfig",
                "runner": "rlinf_vla.pipelines.config:RunnerConfig",
                "algo": "rlinf_vla.training.algo_config:AlgoConfig",
            },
        ),
        Command(
            "collect",
            "record successful episodes of an env's scripted expert as a LeRobotDataset v3.0",
            "collect",
            "rlinf_vla.pipelines.collect",
            output=lambda job: ("collect.output_dir", Path(job.collect.output_dir)),
            folder_key="collect.output_dir",
            example="collect.episodes=50",
        ),
        Command(
            "sft",
            "behaviour cloning of a VLA policy on LeRobot datasets, with greedy evaluation in the simulator",
            "sft",
            "rlinf_vla.pipelines.sft",
            output=_runner_folder,
            folder_key="runner.output_dir",
            sections={"cluster": "rlinf_vla.runtime.cluster:ClusterConfig"},
        ),
        Command(
            "eval",
            "success rates of a policy on a LIBERO suite or ManiSkill tasks (parallel envs, resumable reports, videos)",
            "eval",
            "rlinf_vla.eval",
            output=lambda job: ("eval.output_dir", Path(job.output_dir)),
            folder_key="eval.output_dir",
            sections={
                "cluster": "rlinf_vla.runtime.cluster:ClusterConfig",
                "eval": "rlinf_vla.eval.config:EvalConfig",
            },
        ),
        Command(
            "bench",
            "measure a part of the system (default: channel latency/throughput); prints a table, writes JSON",
            "bench",
            "rlinf_vla.bench",
        ),
        Command(
            "math-grpo",
            "GRPO, DAPO, REINFORCE++, RLOO or PPO on math problems with verifier rewards (an LLM on the same runtime)",
            "math_grpo",
            "rlinf_vla.reasoning",
            config_root="math_grpo",
            output=_runner_folder,
            folder_key="runner.output_dir",
            sections={
                "cluster": "rlinf_vla.runtime.cluster:ClusterConfig",
                "model": "rlinf_vla.reasoning.model:ModelConfig",
                "data": "rlinf_vla.reasoning.data:DataConfig",
                "algo": "rlinf_vla.reasoning.config:MathAlgoConfig",
                "placement": "rlinf_vla.reasoning.config:MathPlacementConfig",
                "runner": "rlinf_vla.reasoning.config:MathRunnerConfig",
            },
        ),
        Command(
            "math-eval",
            "avg@k and pass@k of a math model on a problems file, with confidence intervals; resumable",
            "math_eval",
            "rlinf_vla.reasoning.math_eval",
            output=lambda job: ("eval.output_dir", job.output_dir),
            example="sampling.k=16",
            sections={
                "model": "rlinf_vla.reasoning.model:ModelConfig",
                "data": "rlinf_vla.reasoning.math_eval:EvalDataConfig",
                "sampling": "rlinf_vla.reasoning.math_eval:SamplingConfig",
                "eval": "rlinf_vla.reasoning.math_eval:MathEvalConfig",
            },
        ),
        Command(
            "serve",
            "serve a policy over websockets (msgpack + numpy) for robot clients",
            "serve",
            "rlinf_vla.real_robot.serve",
            sections={"server": "rlinf_vla.real_robot.server:ServerConfig"},
            example="server.port=8000",
        ),
        Command(
            "deploy",
            "run a served policy on a Franka (real or simulated) through the safety layer, recording episodes",
            "deploy",
            "rlinf_vla.real_robot.deploy",
            # the episodes' folder must take files before the robot moves
            output=lambda job: (
                ("record.output_dir", Path(job.record.output_dir)) if job.record.enabled else None
            ),
            example="safety.max_translation_m=0.02",
            sections={
                "action": "rlinf_vla.real_robot.deploy:ActionConfig",
                "safety": "rlinf_vla.real_robot.safety:SafetyConfig",
                "record": "rlinf_vla.real_robot.deploy:RecordConfig",
            },
        ),
    ]
}


def preflight(command: Command, job: Any) -> None:
    """What a valid job needs from the machine, checked before anything starts: the folder it
    writes accepts a file (not read-only, not full) and ``cluster.address`` answers.

    Raises:
        ConfigError: naming the key of the folder or the address.
    """
    from rlinf_vla.runtime.cluster import ClusterConfig, check_address

    errors = SectionErrors()
    target = command.output(job) if command.output is not None else None
    if target is not None:
        from rlinf_vla.run.tracking import check_writable

        key, folder = target
        errors.build(lambda: check_writable(folder, key))
    cluster = getattr(job, "cluster", None)
    if isinstance(cluster, ClusterConfig):
        errors.build(lambda: check_address(cluster.address))
    for problem in _device_problems(job, cluster):
        errors.add(problem)
    errors.raise_any()


def _device_problems(job: Any, cluster: Any) -> list[str]:
    """The devices a job names that this machine lacks (only where the job runs here: an
    embedded Ray instance or none; a cluster's nodes have their own)."""
    from rlinf_vla.config import device_problem
    from rlinf_vla.runtime.cluster import ClusterConfig

    if isinstance(cluster, ClusterConfig) and cluster.address is not None:
        return []
    # eval's policy device comes from eval.device unless policy.device is set
    policy_key = (
        "eval.device"
        if hasattr(job, "eval") and "device" not in getattr(job, "policy", {})
        else "policy.device"
    )
    named = [
        (policy_key, getattr(getattr(job, "policy_config", None), "device", None)),
        ("env.device", getattr(getattr(job, "env_config", None), "device", None)),
    ]
    problems = [device_problem(v, k) for k, v in named if isinstance(v, str)]
    if isinstance(cluster, ClusterConfig) and cluster.num_gpus:
        import torch

        count = torch.cuda.device_count()
        if cluster.num_gpus > count:
            problems.append(f"cluster.num_gpus={cluster.num_gpus}: this machine has {count} GPU(s)")
    return [p for p in problems if p]


# --------------------------------------------------------------------------- config groups
def config_groups(config_name: str, config_dir: Path = CONFIG_DIR) -> dict[str, list[str]]:
    """The config groups a primary config composes, with their available choices."""
    data = yaml.safe_load((config_dir / f"{config_name}.yaml").read_text()) or {}
    groups: dict[str, list[str]] = {}
    for entry in data.get("defaults", []):
        if isinstance(entry, dict):
            for group in entry:
                group = group.split("@")[0].removeprefix("override ").strip()
                for root in (config_dir, CONFIG_DIR):
                    if (root / group).is_dir():
                        groups[group] = sorted(p.stem for p in (root / group).glob("*.yaml"))
                        break
    return groups


def _default_choices(config_name: str, config_dir: Path = CONFIG_DIR) -> dict[str, str]:
    data = yaml.safe_load((config_dir / f"{config_name}.yaml").read_text()) or {}
    return {
        k.split("@")[0]: str(v)
        for entry in data.get("defaults", [])
        if isinstance(entry, dict)
        for k, v in entry.items()
    }


def _check_group_choices(
    config_name: str, overrides: Sequence[str], config_dir: Path = CONFIG_DIR
) -> None:
    groups = config_groups(config_name, config_dir)
    for override in overrides:
        key, sep, value = override.partition("=")
        if not sep:
            raise ConfigError(
                f"cannot parse {override!r}: overrides look like group=choice or section.key=value"
            )
        key = key.lstrip("+~")
        if key in groups and value not in groups[key]:
            raise ConfigError(
                f"unknown choice {value!r} for config group {key!r} (known: {', '.join(groups[key])})"
            )


def compose(config_name: str, overrides: Sequence[str] = (), config_dir: Path = CONFIG_DIR) -> Any:
    """Compose the primary config ``config_name`` (in ``config_dir``) with Hydra ``overrides``.

    Groups missing from ``config_dir`` are looked up in the shared ``configs/`` folder. A key
    of the chosen policy's, env's or algo section's config class that its group YAML does not
    list (``policy.exact_logprob=false``, ``algo.lr=1e-5``) is added, as Hydra's
    ``++policy.exact_logprob=false`` would (the last of several settings wins).

    Raises:
        ConfigError: an unknown group choice (listing the known ones) or an unknown key
            (naming it), or an unparsable override.
    """
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    if not OmegaConf.has_resolver("asset"):
        OmegaConf.register_new_resolver("asset", _asset)

    _check_group_choices(config_name, overrides, config_dir)
    overrides = given = list(overrides)
    if Path(config_dir) != CONFIG_DIR:
        overrides.append(f"hydra.searchpath=[file://{CONFIG_DIR}]")
    # Hydra stops at the first unknown key: drop its override and compose again, so that one
    # run names every unknown key (with the closest known one).
    unknown: dict[str, list[str]] = {}  # key -> the overrides that set it
    while True:
        try:
            with initialize_config_dir(config_dir=str(config_dir), version_base=None):
                cfg = hydra_compose(config_name=config_name, overrides=overrides)
            break
        except (HydraException, OmegaConfBaseException) as e:
            key = _unknown_key(e)
            rest = [o for o in overrides if key is None or not _sets(o, key)]
            if key is None or len(rest) == len(overrides):
                raise ConfigError(_explain(e)) from None
            unknown[key] = [o for o in overrides if o not in rest]
            overrides = rest
    family = {
        o
        for key, sets in unknown.items()
        if key.partition(".")[2] in _family_keys(cfg, key.partition(".")[0])
        for o in sets
    }
    if family:  # again, with those added (and the other unknown keys, to name them)
        again = ["++" + o.lstrip("+") if o in family else o for o in given]
        return compose(config_name, again, config_dir)
    errors = SectionErrors()
    for key in unknown:
        errors.add(f"unknown config key: {key}{_did_you_mean(cfg, key)}")
    # The policy and env families build their configs from keywords themselves: their value
    # types (a list, not a string; finite numbers) are checked here, as other sections' are.
    for section in ("policy", "env"):
        config_cls = _family_class(cfg, section)
        if config_cls is not None:
            errors.build(lambda c=config_cls, s=section: check_values(c, cfg[s], s))
    errors.raise_any()
    return cfg


def _family_class(cfg: Any, section: str) -> type | None:
    """The config class of the policy or env that ``cfg``'s ``section`` names, or of the
    trainer's ``algo`` section (whose YAML holds only the algorithm's preset keys; ``None`` for
    other sections and unknown names)."""
    if section == "algo" and "algo" in cfg:
        if "model" in cfg:  # math-grpo
            from rlinf_vla.reasoning.config import MathAlgoConfig

            return MathAlgoConfig
        from rlinf_vla.training.algo_config import AlgoConfig

        return AlgoConfig
    name = cfg.get(section, {}).get("name") if section in ("policy", "env") else None
    if section == "policy":
        from rlinf_vla.policies import POLICIES

        return POLICIES[name].cls.config_cls if name in POLICIES else None
    if section == "env":
        from rlinf_vla.envs import ENVS

        return ENVS[name].config_cls if name in ENVS else None
    return None


def _family_keys(cfg: Any, section: str) -> set[str]:
    """The keys of the config class of the policy or env that ``cfg``'s ``section`` names
    (empty for other sections and unknown names)."""
    config_cls = _family_class(cfg, section)
    return {f.name for f in dataclasses.fields(config_cls)} if config_cls else set()


def _sets(override: str, key: str) -> bool:
    """Whether ``override`` sets ``key`` or a key inside it."""
    target = override.partition("=")[0].lstrip("+~")
    return target == key or target.startswith(key + ".")


def _unknown_key(error: BaseException) -> str | None:
    """The key of a "not in struct" error (an override of a key the config does not have)."""
    cause: BaseException | None = error
    while cause is not None:
        full_key = getattr(cause, "full_key", None)
        if full_key and "not in struct" in str(cause):
            return str(full_key)
        cause = cause.__cause__ or cause.__context__
    return None


def _did_you_mean(cfg: Any, key: str) -> str:
    """`` (did you mean <section>.<known key>?)`` for the closest key of the same section."""
    import difflib

    from omegaconf import DictConfig, OmegaConf

    parent, _, leaf = key.rpartition(".")
    node = OmegaConf.select(cfg, parent) if parent else cfg
    if not isinstance(node, DictConfig):
        return ""
    known = {str(k) for k in node} | (_family_keys(cfg, parent) if "." not in parent else set())
    close = difflib.get_close_matches(leaf, sorted(known), n=1, cutoff=0.6)
    return f" (did you mean {parent + '.' if parent else ''}{close[0]}?)" if close else ""


def _explain(error: BaseException) -> str:
    """A one-line reason from Hydra/OmegaConf's nested errors."""
    key = _unknown_key(error)
    if key is not None:
        return f"unknown config key: {key}"
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__


def _group_file(command: Command, group: str, choice: str) -> Path | None:
    for root in (command.config_dir, CONFIG_DIR):
        if (root / group / f"{choice}.yaml").is_file():
            return root / group / f"{choice}.yaml"
    return None


def _section_class(command: Command, group: str, file: Path) -> tuple[type | None, dict, dict]:
    """The config class of ``group``'s section as ``file`` chooses it, the defaults its
    registry entry gives on top of the class's (a policy's spec, an algorithm's preset), and
    the meanings of keys the class's docstring leaves to another (the preset keys)."""
    name = (yaml.safe_load(file.read_text()) or {}).get("name")
    if group == "algo" and group in command.sections:
        from rlinf_vla.algos.presets import ALGORITHMS, AlgorithmPreset
        from rlinf_vla.confighelp import attribute_docs

        preset = ALGORITHMS[name] if name in ALGORITHMS.names() else None
        cls = _import(command.sections[group])
        defaults = dataclasses.asdict(preset) if preset is not None else {}
        return cls, defaults, attribute_docs(AlgorithmPreset)
    if group in ("policy", "env"):
        if group == "policy":
            from rlinf_vla.policies import POLICIES

            spec = POLICIES.get(name)
            return (spec.cls.config_cls, dict(spec.defaults), {}) if spec else (None, {}, {})
        from rlinf_vla.envs import ENVS

        return (ENVS[name].config_cls, {}, {}) if name in ENVS else (None, {}, {})
    if group in command.sections:
        return _import(command.sections[group]), {}, {}
    return None, {}, {}


def _import(target: str) -> type:
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


def help_keys(command: Command, overrides: Sequence[str] = ()) -> list[str]:
    """Every key of ``command``'s config with its default and meaning, as ``--help`` lists
    them: the command's own, then each group's as the defaults or ``overrides``
    (``policy=pi0``) choose it."""
    from rlinf_vla.confighelp import attribute_docs, plain, section_keys, yaml_keys

    docs = {  # meanings of the command's own sections' keys, from their config classes
        f"{section}.{key}": text
        for section, target in command.sections.items()
        for key, text in attribute_docs(_import(target)).items()
    }
    lines = [
        k._replace(meaning=k.meaning or plain(docs.get(k.name, ""))).line()
        for k in yaml_keys(command.config_dir / f"{command.config_name}.yaml")
        if k.default
    ]
    choices = _default_choices(command.config_name, command.config_dir)
    groups = config_groups(command.config_name, command.config_dir)
    for override in overrides:
        key, _, value = override.partition("=")
        if key.lstrip("+~") in groups and value in groups[key.lstrip("+~")]:
            choices[key.lstrip("+~")] = value
    for group, choice in choices.items():
        file = _group_file(command, group, choice) if group in groups else None
        if file is None:
            continue
        if "@package _global_" in file.read_text():  # a whole setting (experiment=...)
            lines.append(f" {group}={choice} sets:")
            lines += [k.line() for k in yaml_keys(file) if k.default]
            continue
        cls, defaults, docs = _section_class(command, group, file)
        lines.append(f" {group}={choice}:")
        lines += [k.line() for k in section_keys(file, group, cls, defaults, docs)]
    return lines


def _keys_text(command: Command, overrides: Sequence[str]) -> str:
    keys = help_keys(command, overrides)
    return "\n\nkeys (section.key = default  (meaning)):\n" + "\n".join(keys) if keys else ""


# --------------------------------------------------------------------------- argument parsing
def _build_parser(
    help_for: str | None = None, overrides: Sequence[str] = ()
) -> argparse.ArgumentParser:
    """The parser; the ``help_for`` command's description lists its keys (composing them
    takes the config classes' imports, so only the command whose help is asked for does)."""
    parser = argparse.ArgumentParser(
        prog="rlinf-vla",
        description="Post-train vision-language-action policies with reinforcement learning.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Run `rlinf-vla <command> --help` for a command's config groups and their choices.",
    )
    sub = parser.add_subparsers(dest="command", metavar="<command>")
    for command in COMMANDS.values():
        groups = config_groups(command.config_name, command.config_dir)
        defaults = _default_choices(command.config_name, command.config_dir)
        lines = [
            f"  {g:<12} {', '.join(c + (' (default)' if c == defaults.get(g) else '') for c in cs)}"
            for g, cs in groups.items()
        ]
        p = sub.add_parser(
            command.name,
            help=command.help,
            description=command.help
            + (
                "\n\nconfig groups (choose with group=choice):\n" + "\n".join(lines)
                if lines
                else ""
            )
            + (_keys_text(command, overrides) if command.name == help_for else "")
            + f"\n\nany value can be set with section.key=value, e.g. {command.example}",
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        p.add_argument(
            "overrides", nargs="*", metavar="override", help="group=choice or section.key=value"
        )
        p.add_argument("--cfg", choices=["job"], help="print the resolved config and exit")
        if command.folder_key:
            p.add_argument(
                "-m",
                "--multirun",
                action="store_true",
                help="run every combination of comma-separated values (algo=ppo,grpo "
                "runner.seed=0,1), one after another, each in its own folder under "
                "hydra.sweep.dir (default runs/multirun-<time>); a table of results at the end",
            )
    p = sub.add_parser(
        "plot",
        help="render a training run's learning curves (metrics.jsonl) to a PNG",
        description="Render the learning curves of a `rlinf-vla train` run folder to a PNG.",
    )
    p.add_argument("run_dir", help="the run folder (it holds metrics.jsonl)")
    p.add_argument("-o", "--output", help="the PNG to write (default: <run_dir>/curves.png)")
    p = sub.add_parser(
        "export-episodes",
        help="convert episodes recorded by `rlinf-vla deploy` into a LeRobotDataset v3.0",
        description="Convert episodes recorded by `rlinf-vla deploy` (folders with steps.npz and "
        "meta.json, or folders holding them, e.g. deploy's record.output_dir) into one "
        "LeRobotDataset v3.0: every recorded camera, the proprio as observation.state, the "
        "executed action, the instruction as the task.",
    )
    p.add_argument("recordings", nargs="+", help="episode folders, or folders of them")
    p.add_argument("-o", "--output", required=True, help="the dataset folder to write")
    p.add_argument("--fps", type=int, help="frame rate (default: the recordings' control rate)")
    p.add_argument("--robot-type", help="the dataset's robot_type (default: the recorded robot)")
    p.add_argument("--overwrite", action="store_true", help="replace a dataset at --output")
    from rlinf_vla.doctor import CHECKS

    p = sub.add_parser(
        "doctor",
        help="check that this machine runs the simulators, Ray and the models",
        description="Check, by doing each on a small scale, that this machine runs what "
        "rlinf-vla needs; a failed check says how to fix it.\n\nchecks:\n"
        + "\n".join(f"  {name:<10} {what}" for name, (what, _, _) in CHECKS.items()),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("checks", nargs="*", metavar="check", help="checks to run (default: all)")
    return parser


def _plot(run_dir: str, output: str | None) -> int:
    from rlinf_vla.run.plot import plot_run

    try:
        out = plot_run(run_dir, output)
    except (FileNotFoundError, ValueError) as e:
        print(f"rlinf-vla plot: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


def _export_episodes(args: argparse.Namespace) -> int:
    from rlinf_vla.data import export_recordings

    folders: list[Path] = []
    for given in map(Path, args.recordings):
        if (given / "meta.json").exists():
            folders.append(given)
        else:  # a folder of recordings, in name (time) order
            folders += sorted(f.parent for f in given.glob("*/meta.json"))
    if not folders:
        print(
            f"rlinf-vla export-episodes: no recorded episode (a folder with meta.json) in "
            f"{', '.join(args.recordings)}",
            file=sys.stderr,
        )
        return 2
    skipped: list[Path] = []

    def on_skip(folder: Path, reason: str) -> None:
        skipped.append(folder)
        print(f"rlinf-vla export-episodes: skipped {folder}: {reason}", file=sys.stderr)

    try:
        out = export_recordings(
            folders,
            args.output,
            args.fps,
            robot_type=args.robot_type,
            overwrite=args.overwrite,
            on_skip=on_skip,
        )
    except (ValueError, FileExistsError, FileNotFoundError) as e:
        print(f"rlinf-vla export-episodes: {e}", file=sys.stderr)
        return 2
    print(
        f"wrote {out} ({len(folders) - len(skipped)} episodes"
        + (f"; {len(skipped)} skipped, see above" if skipped else "")
        + ")"
    )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    given = list(sys.argv[1:] if argv is None else argv)
    if given and given[0] in COMMANDS:  # -m anywhere among the overrides, as Hydra takes it
        flags = [a for a in given[1:] if a in ("-m", "--multirun")]
        given = [given[0], *flags, *[a for a in given[1:] if a not in flags]]
    asks_help = given and given[0] in COMMANDS and ("-h" in given or "--help" in given)
    parser = _build_parser(*((given[0], [a for a in given[1:] if "=" in a]) if asks_help else ()))
    args = parser.parse_args(given)
    if args.command is None:
        parser.print_help()
        return 2
    if args.command == "plot":
        return _plot(args.run_dir, args.output)
    if args.command == "export-episodes":
        return _export_episodes(args)
    if args.command == "doctor":
        from rlinf_vla.doctor import run_checks

        try:
            return run_checks(args.checks)
        except ValueError as e:
            print(f"rlinf-vla doctor: {e}", file=sys.stderr)
            return 2
    command = COMMANDS[args.command]
    try:
        check_hydra_keys(command, args.overrides, getattr(args, "multirun", False))
    except ConfigError as e:
        print(f"rlinf-vla {command.name}: invalid config: {e}", file=sys.stderr)
        return 2
    if getattr(args, "multirun", False):
        from rlinf_vla.multirun import multirun

        def prepare(overrides: list[str]) -> Any:
            job = command.load()[0](compose(command.config_name, overrides, command.config_dir))
            preflight(command, job)
            return job

        def run_job(job: Any) -> int:
            return execute(command, command.load()[1], job)

        assert command.folder_key is not None  # only such commands take --multirun
        return multirun(command.name, command.folder_key, args.overrides, prepare, run_job)
    cfg = None
    try:
        cfg = compose(command.config_name, args.overrides, command.config_dir)
        validate, run = command.load()
        job = validate(cfg)
        if args.cfg != "job":
            preflight(command, job)
    except ModuleNotFoundError as e:
        if missing_extra(e) is None:
            raise
        print(f"rlinf-vla {command.name}: {missing_extra(e)}", file=sys.stderr)
        return 1
    except ConfigError as e:
        if args.cfg == "job" and cfg is not None:  # what was composed, to see what to fix
            from omegaconf import OmegaConf

            print(OmegaConf.to_yaml(cfg), end="")
        print(f"rlinf-vla {command.name}: invalid config: {e}", file=sys.stderr)
        return 2
    if args.cfg == "job":
        _print_job(cfg, job)
        return 0
    return execute(command, run, job)


#: the optional modules, by the pyproject extra that installs them
EXTRAS: dict[str, str] = {
    "websockets": "serve",
    "msgpack": "serve",
    "mani_skill": "maniskill",
    "sapien": "maniskill",
    "libero": "libero",
    "robosuite": "robot",
    "metaworld": "metaworld",
    "franky": "robot",
    "pyrealsense2": "robot",
    "gguf": "math",
    "reasoning_gym": "math",
    "math_verify": "math",
    "peft": "math",
    "wandb": "wandb",
}


def missing_extra(error: ModuleNotFoundError) -> str | None:
    """One line naming the extra that installs the module ``error`` misses (``None`` for a
    module no extra brings)."""
    root = (error.name or "").split(".")[0]
    if root not in EXTRAS:
        return None
    extra = EXTRAS[root]
    return (
        f"this needs the optional module {root!r}: pip install 'rlinf-vla[{extra}]' "
        "(or bash scripts/install.sh for everything)"
    )


def check_hydra_keys(command: Command, overrides: Sequence[str], multirun: bool) -> None:
    """Hydra's own settings (``hydra.*``) are not used: a run's folder is a key of the
    command's config (named in the error); ``hydra.sweep.dir`` is honoured with ``--multirun``.

    Raises:
        ConfigError: naming each ``hydra.*`` override and the key to use instead.
    """
    errors = SectionErrors()
    for override in overrides:
        key = override.partition("=")[0].lstrip("+~")
        if not key.startswith("hydra.") or (multirun and key == "hydra.sweep.dir"):
            continue
        where = (
            f"; the run's folder is {command.folder_key}"
            if command.folder_key and key in ("hydra.run.dir", "hydra.sweep.dir")
            else ""
        )
        sweep = " (with --multirun, hydra.sweep.dir sets the sweep's folder)"
        errors.add(
            f"{key}: rlinf-vla does not use Hydra's own settings{where}"
            + (sweep if key == "hydra.sweep.dir" else "")
        )
    errors.raise_any()


def _print_job(cfg: Any, job: Any) -> None:
    """``--cfg job``: the composed config, with the sections whose defaults live in their
    config classes shown as the job builds them."""
    from omegaconf import OmegaConf

    from rlinf_vla.config import to_dict

    shown = OmegaConf.to_container(cfg, resolve=True)
    for section in ("env", "policy"):
        built = getattr(job, f"{section}_config", None)
        if dataclasses.is_dataclass(built) and section in shown:
            shown[section] = {"name": shown[section]["name"], **to_dict(built)}
    algo = getattr(job, "algo", None)
    if dataclasses.is_dataclass(algo):  # the trainer's own settings default there
        shown["algo"] = to_dict(algo)
    print(OmegaConf.to_yaml(shown), end="")


def execute(command: Command, run: Callable[[Any], Any], job: Any) -> int:
    """Run a validated ``job``; its exit code (0 done, 1 an error stopped it, 2 a config
    problem found while starting, 130 Ctrl-C, 143 SIGTERM)."""
    from rlinf_vla.runtime import WorkerError

    try:
        with _sigterm_interrupts():
            run(job)
    except ConfigError as e:  # found while starting (e.g. what the cluster turned out to be)
        print(f"rlinf-vla {command.name}: invalid config: {e}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as e:
        if missing_extra(e) is None:
            raise
        print(f"rlinf-vla {command.name}: {missing_extra(e)}", file=sys.stderr)
        return 1
    except (RunAborted, WorkerError) as e:
        # A worker's traceback or the reason for stopping, without the driver's own stack.
        print(f"rlinf-vla {command.name}: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    except (KeyboardInterrupt, SystemExit) as e:
        # Ray's driver turns SIGTERM into SystemExit(15) once it has started.
        sigterm = isinstance(e, Terminated) or (
            isinstance(e, SystemExit) and e.code == signal.SIGTERM
        )
        if isinstance(e, SystemExit) and not sigterm:
            raise
        # The trainers have printed the last checkpoint and how to resume; the cluster is down.
        print(
            f"rlinf-vla {command.name}: stopped by {'SIGTERM' if sigterm else 'Ctrl-C'}",
            file=sys.stderr,
        )
        return 143 if sigterm else 130
    return 0


class Terminated(KeyboardInterrupt):
    """SIGTERM (a scheduler's preemption, ``kill``), raised like Ctrl-C."""


@contextlib.contextmanager
def _sigterm_interrupts() -> Iterator[None]:
    """Turn SIGTERM into :class:`Terminated` while a job runs, so that it stops as on Ctrl-C:
    the console names the last checkpoint, the workers and the local Ray instance are shut
    down, and the exit code is 143. Only in the main thread (where Python handles signals).
    Once Ray's driver starts it installs its own handler, which raises ``SystemExit(15)``:
    :func:`main` takes that as SIGTERM too."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def terminate(signum: int, frame: Any) -> None:
        raise Terminated()

    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
