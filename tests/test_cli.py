from pathlib import Path

import pytest
import tomllib
import yaml

from rlinf_vla import cli
from rlinf_vla.config import ConfigError


def test_help_lists_subcommands(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for name in cli.COMMANDS:
        assert name in out


def test_subcommand_help_lists_groups_and_choices(capsys):
    with pytest.raises(SystemExit):
        cli.main(["bench", "--help"])
    out = capsys.readouterr().out
    assert "cluster      local (default), ray" in out
    assert "benchmark    channel (default)" in out


@pytest.mark.parametrize("name", sorted(cli.COMMANDS))
def test_a_commands_help_example_sets_one_of_its_own_keys(capsys, name):
    with pytest.raises(SystemExit):
        cli.main([name, "--help"])
    out = capsys.readouterr().out
    keys = {line.split(" = ")[0].strip() for line in out.splitlines() if " = " in line}
    example = cli.COMMANDS[name].example.split("=")[0]
    assert example in keys, f"{name} --help shows {example}=..., not one of its keys"
    if "config groups" in out:  # listed only when the command has some
        assert out.split("config groups")[1].split("\n")[1].strip()


def test_cfg_job_prints_the_resolved_config(capsys):
    assert (
        cli.main(
            ["bench", "--cfg", "job", "benchmark.rounds=7", "cluster=ray", "cluster.num_nodes=2"]
        )
        == 0
    )
    cfg = yaml.safe_load(capsys.readouterr().out)
    assert cfg["benchmark"]["rounds"] == 7
    assert cfg["benchmark"]["name"] == "channel"
    assert cfg["cluster"]["address"] == "auto"
    assert cfg["cluster"]["num_nodes"] == 2
    assert cfg["output_dir"] == "benchmarks/results"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["benchmark=nope"], "unknown choice 'nope' for config group 'benchmark' (known: channel)"),
        (["cluster=gpu"], "unknown choice 'gpu' for config group 'cluster' (known: local, ray)"),
        (["benchmark.roundz=2"], "unknown config key: benchmark.roundz"),
        (["runner.max_iterations=2"], "unknown config key: runner"),
        (["benchmark.rounds=0"], "benchmark.rounds must be >= 1, got 0"),
        (["cluster.num_cpus=two"], "cluster.num_cpus: 'two' does not match"),
        (["cluster=ray", "cluster.num_cpus=2"], "cannot be set together with cluster.address"),
        (["rounds"], "cannot parse 'rounds'"),
    ],
)
def test_bad_config_fails_before_anything_starts(capsys, nothing_starts, overrides, message):
    assert cli.main(["bench", *overrides]) == 2
    assert message in capsys.readouterr().err


def test_every_unknown_key_is_named_at_once_with_the_closest_known_key(capsys, nothing_starts):
    args = ["train", "runner.max_iteration=5", "algo.lr=3e-4", "algo.lrr=1", "env.bogus.x=3"]
    assert cli.main(args) == 2
    assert capsys.readouterr().err == (
        "rlinf-vla train: invalid config: 3 problems:\n"
        "  - unknown config key: runner.max_iteration (did you mean runner.max_iterations?)\n"
        "  - unknown config key: algo.lrr (did you mean algo.lr?)\n"
        "  - unknown config key: env.bogus\n"
    )


def test_a_key_of_the_policy_or_env_class_that_its_yaml_leaves_out_can_be_set(capsys):
    # exact_logprob (OpenVLA) and step_time_per_env_s (toy env) are config fields that the
    # group YAMLs do not list; Hydra alone would need `+policy.exact_logprob=false`.
    from rlinf_vla.pipelines import validate
    from rlinf_vla.policies.resolve import policy_config_for

    args = ["env=toy", "policy.exact_logprob=false", "env.step_time_per_env_s=0.002"]
    job = validate(cli.compose("train", args))
    assert policy_config_for(job.policy_name, job.policy).exact_logprob is False
    assert job.env["step_time_per_env_s"] == 0.002
    # a key no class has is still unknown, named with the others
    with pytest.raises(ConfigError) as e:
        cli.compose("train", [*args, "policy.exact_logprobs=false", "runner.max_iteration=5"])
    assert "unknown config key: policy.exact_logprobs (did you mean policy.exact_logprob?)" in str(
        e.value
    )
    assert "unknown config key: runner.max_iteration (did you mean" in str(e.value)


def test_invalid_values_of_several_sections_are_named_at_once(capsys, nothing_starts):
    args = ["train", "algo.lr=-1", "runner.max_iterations=0", "env.num_envs=0"]
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("rlinf-vla train: invalid config: 3 problems:\n")
    assert "num_envs must be >= 1" in err
    assert "algo.lr and algo.value_lr must be > 0" in err
    assert "runner.max_iterations must be >= 1, got 0" in err


def test_the_checks_across_sections_are_named_at_once(capsys, nothing_starts):
    args = ["train", "env=toy", "algo=grpo", "algo.group_size=4", "env.group_size=2"]
    args.append("policy.action_dim=3")
    assert cli.main([*args, "placement=hybrid", "placement.stages=3"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rlinf-vla train: invalid config: 3 problems:\n")
    assert (
        "policy.action_dim=3 does not match the action size of env 'toy': 7 (env.action_dim)" in err
    )
    assert "algo.group_size=4 must equal env.group_size=2" in err
    assert "cannot be split evenly over 1 env worker(s) x placement.stages=3" in err


def _tiny_dataset(path: Path) -> Path:
    """A LeRobot dataset of one 4-frame episode: a 16 x 16 main camera, 16-D state, 7-D action."""
    import numpy as np

    from rlinf_vla.data import LeRobotWriter

    with LeRobotWriter(path, fps=20, cameras={"main": (16, 16)}, state_dim=16, action_dim=7) as w:
        w.add_episode(
            images={"main": np.zeros((4, 16, 16, 3), np.uint8)},
            state=np.zeros((4, 16), np.float32),
            action=np.zeros((4, 7), np.float32),
            task="pick up the cube",
        )
    return path


def test_every_config_group_choice_composes_and_validates(tmp_path):
    # what the commands cannot do without: a folder to write, demonstrations to read
    required = {
        "collect": [f"collect.output_dir={tmp_path / 'new'}"],
        "sft": [f"data.paths=[{_tiny_dataset(tmp_path / 'demos')}]"],
    }
    for command in cli.COMMANDS.values():
        validate, _ = command.load()
        groups = cli.config_groups(command.config_name, command.config_dir)
        for group, choices in groups.items():
            for choice in choices:
                overrides = [f"{group}={choice}", *required.get(command.name, [])]
                if "cluster" in groups and not (group == "cluster" and choice == "ray"):
                    # env, rollout and actor on their own devices need 3
                    devices = 3 if choice == "disaggregated" else 2
                    overrides.append(f"cluster.devices_per_node={devices}")
                if group == "robot" and choice == "franka":  # RealSense serials are required
                    overrides += ["robot.cameras.main=1", "robot.cameras.wrist=2"]
                # these read a wrist camera too; sft's OpenVLA-OFT reads the demos' camera and
                # their 16-D state, evaluated in ManiSkill (sft's env), whose state that is
                sft_oft = command.name == "sft" and choice == "openvla_oft"
                if group == "policy" and "env" in groups and choice != "openvla" and not sft_oft:
                    overrides.append("env=libero")
                metaworld = group == "env" and choice == "metaworld"
                if metaworld and "policy" in groups and command.name != "sft":
                    overrides.append("policy.action_dim=4")  # MetaWorld's 4-D actions
                if group == "algo" and choice in ("grpo", "dapo", "rloo") and "env" in groups:
                    overrides.append("env.num_envs=8")  # whole groups of algo.group_size=4
                    # whole episodes (PickCube's 50 steps at OpenVLA's one action per call)
                    overrides.append("runner.rollout_chunks=50")
                if group == "data" and choice == "file":  # a dataset file is required
                    overrides.append(
                        f"data.path={Path(__file__).parent / 'reasoning' / 'data' / 'tiny.jsonl'}"
                    )
                cfg = cli.compose(command.config_name, overrides, command.config_dir)
                if command.name == "collect" and choice == "libero":  # LIBERO has no expert
                    with pytest.raises(ConfigError, match="no scripted expert"):
                        validate(cfg)
                    continue
                if command.name == "math-grpo" and choice == "dagger":  # needs an env's expert
                    with pytest.raises(ConfigError, match="runs in `rlinf-vla train` only"):
                        validate(cfg)
                    continue
                if command.name == "sft" and metaworld:  # the 7-D demos cannot act there
                    with pytest.raises(ConfigError, match="takes 4-dim actions"):
                        validate(cfg)
                    continue
                if command.name == "sft" and group == "env" and choice in ("libero", "toy"):
                    # OpenVLA-OFT learns the demos' 16-D (ManiSkill) state: not the env's
                    with pytest.raises(ConfigError, match=r"proprio_dim=16 does not match the st"):
                        validate(cfg)
                    continue
                validate(cfg)


def test_a_key_only_the_config_class_knows_may_be_set_twice_the_last_wins():
    # algo.update_epochs is not in the algorithm's YAML (AlgoConfig defaults it)
    cfg = cli.compose("train", ["algo.update_epochs=1", "env=toy", "algo.update_epochs=3"])
    assert cfg.algo.update_epochs == 3
    cfg = cli.compose("train", ["policy.exact_logprob=false", "policy.exact_logprob=true"])
    assert cfg.policy.exact_logprob is True


def test_cfg_job_shows_every_algo_setting_as_resolved(capsys):
    assert cli.main(["train", "env=toy", "algo=rloo", "algo.lr=3e-5", "--cfg", "job"]) == 0
    out = capsys.readouterr().out
    # the preset's keys, the trainer's defaults and the override, in the algo section
    for line in ("advantage: rloo", "minibatch_size: 32", "lr: 3.0e-05", "group_size: 4"):
        assert f"\n  {line}\n" in out, line


def _help(capsys, *args):
    with pytest.raises(SystemExit) as info:
        cli.main([*args, "--help"])
    assert info.value.code == 0
    return capsys.readouterr().out


def _flat(tree, prefix=""):
    for k, v in tree.items():
        if isinstance(v, dict) and v:
            yield from _flat(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}"


def test_train_help_lists_every_key_the_job_has_with_its_default(capsys):
    out = _help(capsys, "train")
    listed = {line.split(" = ")[0].strip() for line in out.splitlines() if " = " in line}
    assert cli.main(["train", "--cfg", "job"]) == 0
    job = yaml.safe_load(capsys.readouterr().out)
    keys = {k for k in _flat(job) if not k.endswith(".name")}  # the group choice sets name

    def covered(key):  # the key, or the mapping holding it (policy.text_config = {...})
        parts = key.split(".")
        return any(".".join(parts[:n]) in listed for n in range(2, len(parts) + 1))

    assert {k for k in keys if not covered(k)} == set()
    assert "  runner.max_iterations = 10  (training iterations (rollout + update))" in out
    assert "  algo.update_epochs = 2  (passes over the rollout batch per iteration)" in out
    assert "  algo.advantage = gae  (name in ADVANTAGES" in out  # a preset key: its meaning too


@pytest.mark.parametrize("group", ["cluster", "env", "policy", "algo", "placement", "runner"])
def test_every_key_of_every_train_choice_has_a_meaning(capsys, group):
    for choice in cli.config_groups("train")[group]:
        out = _help(capsys, "train", f"{group}={choice}")
        lines = [line for line in out.splitlines() if line.startswith("  ") and " = " in line]
        assert len(lines) > 40, choice
        assert [line for line in lines if "  (" not in line] == [], f"{group}={choice}"


def test_help_lists_the_keys_of_the_choices_on_the_command_line(capsys):
    out = _help(capsys, "train", "policy=pi0", "algo=grpo")
    assert " policy=pi0:" in out and "  policy.num_steps = 10  (" in out
    assert "policy.n_action_bins" not in out  # OpenVLA's, the default policy's
    assert "  algo.advantage = grpo  (" in out  # the chosen preset's value
    default = _help(capsys, "train")
    assert "policy.n_action_bins = 256" in default


def test_cfg_job_of_an_invalid_config_prints_it_then_the_errors(capsys, nothing_starts):
    assert cli.main(["train", "env=toy", "algo.minibatch_size=0", "--cfg", "job"]) == 2
    captured = capsys.readouterr()
    shown = yaml.safe_load(captured.out)
    assert shown["algo"]["minibatch_size"] == 0 and shown["env"]["name"] == "toy"
    assert "algo.minibatch_size must be >= 1, got 0" in captured.err


def _cli_without(modules, args):
    """``rlinf-vla <args>`` in a fresh interpreter where ``modules`` cannot be imported."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        f"for m in {modules!r}: sys.modules[m] = None\n"
        "from rlinf_vla import cli\n"
        f"sys.exit(cli.main({args!r}))\n"
    )
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


def test_a_missing_optional_module_is_one_line_naming_its_extra():
    r = _cli_without(["msgpack", "websockets"], ["serve"])
    assert r.returncode == 1
    assert r.stderr.strip().splitlines() == [
        "rlinf-vla serve: this needs the optional module 'msgpack': pip install "
        "'rlinf-vla[serve]' (or bash scripts/install.sh for everything)"
    ]


def test_serving_needs_no_simulator_or_hardware_driver():
    drivers = ["franky", "pyrealsense2", "robosuite", "mujoco", "mani_skill", "libero", "metaworld"]
    r = _cli_without(drivers, ["serve", "--cfg", "job"])
    assert r.returncode == 0, r.stderr
    assert "protocol: native" in r.stdout
    extras = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    assert sorted(d.split(">")[0] for d in extras["serve"]) == ["msgpack", "websockets"]
    assert "rlinf-vla[serve]" in extras["robot"]


@pytest.mark.parametrize("name", sorted(cli.COMMANDS))
def test_every_command_names_an_unknown_top_level_key_and_the_known_ones(name):
    from rlinf_vla.config import ConfigError

    validate, _ = cli.COMMANDS[name].load()
    with pytest.raises(ConfigError, match=r"unknown config key\(s\): bogus \(known: \w+"):
        validate({"bogus": {}})
