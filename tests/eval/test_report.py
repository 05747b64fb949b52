"""The trial log survives a torn last line; reports are deterministic; folder identity."""

from __future__ import annotations

import csv
import json

import pytest

from rlinf_vla.eval.report import TrialLog, build_results, check_identity, write_reports


def _rec(state: int, success: bool | None, error: str | None = None) -> dict:
    return {
        "suite": "libero_goal",
        "task": "open_the_drawer",
        "task_index": 3,
        "init_state": state,
        "reset_id": state,
        "success": success,
        "steps": None if error else 10 + state,
        "error": error,
        "instruction": "open the drawer",
        "video": None,
    }


def test_log_drops_a_torn_line_and_appends_after_it(tmp_path) -> None:
    log = TrialLog(tmp_path)
    log.append(_rec(0, True))
    log.append(_rec(1, False))
    with open(tmp_path / "trials.jsonl", "a") as f:
        f.write('{"suite": "libero_goal", "task": "open_th')  # killed mid-write
    again = TrialLog(tmp_path)
    assert len(again) == 2 and ("libero_goal", "open_the_drawer", 1) in again
    again.append(_rec(2, None, "crashed"))
    lines = (tmp_path / "trials.jsonl").read_text().splitlines()
    assert [json.loads(x)["init_state"] for x in lines] == [0, 1, 2]


def test_reports(tmp_path) -> None:
    records = [_rec(0, True), _rec(1, False), _rec(2, None, "env crashed (after 2 attempt(s))")]
    header = {"env_name": "libero", "policy_name": "openvla_oft"}
    results = build_results(records, {**header, "protocol": {"name": "official", "scene_seed": 0}})
    write_reports(tmp_path, results)
    data = json.loads((tmp_path / "results.json").read_text())
    assert [t["init_state"] for t in data["trials"]] == [0, 1, 2]
    assert data["protocol"] == {"name": "official", "scene_seed": 0}
    suite = data["suites"]["libero_goal"]
    assert suite["successes"] == 1 and suite["valid"] == 2 and suite["errors"] == 1
    # The crashed trial is a failure in the headline rate (1 of 3), left out of the other.
    assert suite["success_rate"] == pytest.approx(1 / 3) and suite["success_rate_valid"] == 0.5
    with open(tmp_path / "results.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["success"] for r in rows] == ["True", "False", ""]
    assert rows[2]["error"].startswith("env crashed")
    summary = (tmp_path / "summary.md").read_text()
    # Wilson 95% of 1 / 3: [6.1, 79.2]%; of 1 / 2 (errors left out): 50.0%.
    assert "| libero_goal | 33.3 | [6.1, 79.2] | 1 / 3 | 50.0 | 1 |" in summary
    assert "Protocol: official, scene seed 0" in summary
    assert "init state 2: env crashed" in summary
    write_reports(tmp_path, results)
    assert json.loads((tmp_path / "results.json").read_text()) == data


def test_folder_identity(tmp_path) -> None:
    ident = {"env_name": "libero", "env": {"suite": "libero_goal"}, "greedy": True}
    check_identity(tmp_path, ident)
    check_identity(tmp_path, ident)
    with pytest.raises(ValueError, match=r"env\.suite"):
        check_identity(tmp_path, {**ident, "env": {"suite": "libero_10"}})
