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
    results = build_results(records, {"env_name": "libero", "policy_name": "openvla_oft"})
    write_reports(tmp_path, results)
    data = json.loads((tmp_path / "results.json").read_text())
    assert [t["init_state"] for t in data["trials"]] == [0, 1, 2]
    suite = data["suites"]["libero_goal"]
    assert suite["successes"] == 1 and suite["valid"] == 2 and suite["errors"] == 1
    with open(tmp_path / "results.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["success"] for r in rows] == ["True", "False", ""]
    assert rows[2]["error"].startswith("env crashed")
    summary = (tmp_path / "summary.md").read_text()
    assert "| libero_goal | 50.0 | [9.5, 90.5] | 1 / 2 | 1 |" in summary
    assert "init state 2: env crashed" in summary
    write_reports(tmp_path, results)
    assert json.loads((tmp_path / "results.json").read_text()) == data


def test_folder_identity(tmp_path) -> None:
    ident = {"env_name": "libero", "env": {"suite": "libero_goal"}, "greedy": True}
    check_identity(tmp_path, ident)
    check_identity(tmp_path, ident)
    with pytest.raises(ValueError, match=r"env\.suite"):
        check_identity(tmp_path, {**ident, "env": {"suite": "libero_10"}})
