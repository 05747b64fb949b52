"""rlinf-vla doctor: each check does the real thing; a failure names its fix."""

import pytest

from rlinf_vla import cli
from rlinf_vla.doctor import run_check


def test_a_machine_set_up_by_the_install_script_passes_the_quick_checks(capsys):
    assert cli.main(["doctor", "torch", "math", "ray"]) == 0
    out = capsys.readouterr().out
    table = out[out.index("rlinf-vla doctor") :]
    assert table.count(" ok ") == 3 and "FAILED" not in out
    assert "SmolLM2-135M-Instruct" in out and "a local instance and a worker" in out


def test_each_check_is_printed_as_it_completes(capsys, monkeypatch):
    from rlinf_vla import doctor

    seen = []  # what the console showed when each check started
    real = doctor.run_check

    def run_check(name):
        seen.append(capsys.readouterr().out)
        return real(name)

    monkeypatch.setattr(doctor, "run_check", run_check)
    assert cli.main(["doctor", "torch", "math"]) == 0
    assert "torch: ok (" in seen[1] and "torch 2." in seen[1]  # before the next one started
    assert "rlinf-vla doctor" not in seen[1]  # the table comes at the end


@pytest.mark.sim
@pytest.mark.parametrize("name", ["maniskill", "libero"])
def test_the_simulators_build_reset_and_render(name):
    result = run_check(name)
    assert result.ok, result.detail
    assert "(1, 64, 64, 3)" in result.detail  # one env's 64 px camera image


@pytest.mark.sim
def test_a_gpu_machine_without_the_physx_library_fails_the_maniskill_check_naming_it(
    offline_without_physx_gpu, monkeypatch
):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    result = run_check("maniskill")
    assert not result.ok
    assert "cpu simulation: PickCube-v1 image (1, 64, 64, 3)" in result.detail  # that part works
    assert "gpu simulation: ManiSkill's GPU simulation needs SAPIEN's PhysX GPU library" in (
        result.detail
    )
    assert "linux-so.zip" in result.detail


def test_a_failed_check_says_what_broke_and_how_to_fix_it(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("RLINF_SMOLLM2_GGUF", str(tmp_path / "missing.gguf"))
    monkeypatch.setattr("sys.prefix", str(tmp_path))  # no model installed into the env either
    result = run_check("math")
    assert not result.ok
    assert "missing.gguf" in result.detail and "scripts/install.sh" in result.fix
    assert cli.main(["doctor", "math"]) == 1
    out = capsys.readouterr().out
    assert "FAILED" in out and "fix:" in out and "failed: math" in out


def test_an_unknown_check_lists_the_known_ones(capsys):
    assert cli.main(["doctor", "vulkan"]) == 2
    assert "known: torch, ray, maniskill, libero, math, wandb, vllm" in capsys.readouterr().err
