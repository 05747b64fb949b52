"""Checkpoint integrity and resume safety, shared by ``train``, ``sft`` and ``math-grpo``.

**Manifests.** After every file of a checkpoint is written (by the workers and the driver),
:func:`write_manifest` records each file's relative path, size and SHA-256 in
``checkpoints/<unit>_<n>/MANIFEST.json``, written last and atomically (a temporary file, then a
rename): its presence marks the checkpoint complete. :func:`resume_checkpoint` picks the newest
checkpoint whose files all match their manifest; a damaged one (a file missing, cut short or
changed) is skipped with a line naming the file and what is wrong, and the one before it is
used. Checkpoints older than the run's first manifest were written before manifests existed:
they resume unverified, with one warning.

**Config changes on resume.** :func:`check_resume_config` compares a resumed run's config with
the one its previous start ran with. Keys matching :data:`SAFE_ON_RESUME` may change (and are
reported); any other change is refused before anything starts, naming every changed key.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlinf_vla.config import ConfigError, RunAborted

__all__ = [
    "MANIFEST",
    "SAFE_ON_RESUME",
    "Resume",
    "begin_checkpoint",
    "check_resume_config",
    "checkpoint_folders",
    "damage",
    "finish_checkpoint",
    "latest_config",
    "latest_settings",
    "prepare_resume",
    "resume_checkpoint",
    "settings_of",
    "write_manifest",
]

#: The manifest's file name inside a checkpoint folder.
MANIFEST = "MANIFEST.json"

#: Config keys a resume may change (shell-style patterns over dotted keys): the run's length,
#: when it saves, evaluates and logs, the optimizer's step sizes (the actors set them from the
#: config on resume), batch splits that only change how an update is computed in memory
#: (``micro_batch_size``) or how the iteration's samples are cut (``minibatch_size``), FSDP
#: (checkpoints hold full weights either way), the cluster connection and the run folder keys.
#: Placement changes are refused unless the resumed run asks for ``placement.mode=auto``.
SAFE_ON_RESUME: tuple[str, ...] = (
    "runner.max_iterations",
    "runner.max_steps",
    "sft.steps",
    "runner.save_interval",
    "runner.keep_checkpoints",
    "runner.max_nan_updates",
    "runner.eval_*",
    "runner.logging.*",
    "runner.name",
    "runner.output_dir",
    "runner.resume",
    "algo.lr",
    "algo.value_lr",
    "algo.weight_decay",
    "algo.minibatch_size",
    "algo.micro_batch_size",
    "algo.fsdp",
    "sft.lr",
    "sft.weight_decay",
    "sft.micro_batch_size",
    "sft.fsdp",
    "cluster.*",
)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 22):  # 4 MiB at a time (Python 3.10 has no file_digest)
            digest.update(block)
    return digest.hexdigest()


def write_manifest(folder: Path) -> Path:
    """Record every file under ``folder`` (path relative to it, size, SHA-256) in
    ``folder/MANIFEST.json``. Call it after every writer of the checkpoint finished; the file
    is written to a temporary name, synced, then renamed, so it exists only complete."""
    folder = Path(folder)
    files = {}
    for p in sorted(folder.rglob("*")):
        rel = p.relative_to(folder).as_posix()
        if not p.is_file() or rel == MANIFEST or rel.startswith(f"{MANIFEST}."):
            continue
        files[rel] = {"size": p.stat().st_size, "sha256": _sha256(p)}
    target = folder / MANIFEST
    tmp = folder / f"{MANIFEST}.tmp"
    with tmp.open("w") as f:
        json.dump({"version": 1, "files": files}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, target)
    return target


def damage(folder: Path) -> str | None:
    """What is wrong with a checkpoint that has a manifest (``None``: every file matches):
    ``policy/model.safetensors: sha256 mismatch``, ``runner.pt: 812 bytes, 1604 expected``..."""
    folder = Path(folder)
    try:
        files = json.loads((folder / MANIFEST).read_text())["files"]
    except FileNotFoundError:
        return f"no {MANIFEST} (the save did not finish)"
    except (ValueError, KeyError, TypeError) as e:
        return f"{MANIFEST} is unreadable ({e})"
    for rel, entry in files.items():  # sizes first: cheap, and most damage shows there
        p = folder / rel
        if not p.is_file():
            return f"{rel}: missing"
        size = p.stat().st_size
        if size != entry["size"]:
            return f"{rel}: {size} bytes, {entry['size']} expected"
    for rel, entry in files.items():
        if _sha256(folder / rel) != entry["sha256"]:
            return f"{rel}: sha256 mismatch"
    return None


def load_runner_state(folder: Path) -> dict[str, Any]:
    """A checkpoint's ``runner.pt`` (the driver's state).

    Raises:
        RunAborted: the file cannot be read, naming it.
    """
    import torch

    try:
        return torch.load(folder / "runner.pt", weights_only=False)
    except Exception as e:
        raise RunAborted(
            f"{folder / 'runner.pt'} cannot be read ({type(e).__name__}: {e}): the checkpoint "
            "is damaged; resume from an earlier one (move this folder away) or start again"
        ) from None


def checkpoint_folders(run_dir: Path, prefix: str) -> list[Path]:
    """``<run_dir>/checkpoints/<prefix>_N`` folders, newest first."""
    found = []
    for p in (Path(run_dir) / "checkpoints").glob(f"{prefix}_*"):
        n = p.name.rsplit("_", 1)[1]
        if p.is_dir() and n.isdigit():
            found.append((int(n), p))
    return [p for _, p in sorted(found, reverse=True)]


@dataclass
class Resume:
    """The checkpoint a resumed run continues from and what was said about choosing it."""

    path: Path
    notes: list[str] = field(default_factory=list)

    @property
    def number(self) -> int:
        """The iteration or step the checkpoint was saved after."""
        return int(self.path.name.rsplit("_", 1)[1])


def resume_checkpoint(run_dir: str | Path, prefix: str) -> Resume:
    """The newest checkpoint of ``run_dir`` whose files match its manifest.

    Damaged or incomplete checkpoints newer than it are skipped, each with a note naming the
    file and what is wrong (``checkpoints/iter_20 is damaged (policy/model.safetensors: sha256
    mismatch); resuming from checkpoints/iter_10``). Checkpoints older than the run's first
    manifest (written before manifests existed) count as complete when they have their
    ``COMPLETE`` marker, with one warning that they are not verified.

    Raises:
        RunAborted: no checkpoint is complete, naming the folder and what is wrong with each.
    """
    run_dir = Path(run_dir)
    folders = checkpoint_folders(run_dir, prefix)
    with_manifest = [p for p in folders if (p / MANIFEST).exists()]
    oldest_manifest = min((int(p.name.rsplit("_", 1)[1]) for p in with_manifest), default=None)
    skipped: list[str] = []
    for p in folders:
        n = int(p.name.rsplit("_", 1)[1])
        name = f"checkpoints/{p.name}"
        legacy = oldest_manifest is None or n < oldest_manifest
        if not (p / "COMPLETE").exists():
            skipped.append(f"{name} is incomplete (no COMPLETE marker: the save did not finish)")
            continue
        if legacy and not (p / MANIFEST).exists():
            notes = [*_said(skipped, name)]
            notes.append(
                f"warning: {name} has no {MANIFEST} (saved before checkpoints had manifests): "
                "resuming from it without checking its files"
            )
            return Resume(p, notes)
        wrong = damage(p)
        if wrong is None:
            return Resume(p, _said(skipped, name))
        skipped.append(f"{name} is damaged ({wrong})")
    where = run_dir / "checkpoints"
    found = "; ".join(skipped) if skipped else "it holds none"
    raise RunAborted(
        f"{where} has no complete checkpoint to resume from ({found}); start the run again "
        "in another folder"
    )


def _said(skipped: list[str], chosen: str) -> list[str]:
    return [f"{s}; resuming from {chosen}" for s in skipped]


# ---------------------------------------------------------------------- config changes
def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict) and tree:
        out: dict[str, Any] = {}
        for k, v in tree.items():
            out.update(_flat(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: tree}


def settings_of(sections: dict[str, Any]) -> dict[str, Any]:
    """Every setting of a validated job, defaults included: each typed section as plain values
    (``{"env": {"name": ..., **env_config}, "algo": ..., ...}``), for ``configs/settings_<k>
    .yaml`` and the resume check. Values YAML cannot hold (arrays, paths) become lists and
    text."""
    from rlinf_vla.config import to_dict

    def plain(value: Any) -> Any:
        if isinstance(value, dict):
            return {str(k): plain(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [plain(v) for v in value]
        if value is None or isinstance(value, bool | int | float | str):
            return value
        if hasattr(value, "tolist"):  # numpy and torch values
            return plain(value.tolist())
        return str(value)

    return {name: plain(to_dict(section)) for name, section in sections.items()}


def latest_settings(run_dir: str | Path) -> tuple[Path, dict[str, Any]] | None:
    """The settings (:func:`settings_of`) the run's last start wrote, if it wrote them."""
    path = _newest(Path(run_dir), "settings")
    return None if path is None else (path, _read_map(path))


def latest_config(run_dir: str | Path) -> tuple[Path, dict[str, Any]] | None:
    """The config the run's last start ran with: its newest ``configs/start_<k>.yaml``, else
    ``config.yaml`` (the first start's); ``None`` when neither exists."""
    run_dir = Path(run_dir)
    path = _newest(run_dir, "start") or run_dir / "config.yaml"
    return (path, _read_map(path)) if path.is_file() else None


def _newest(run_dir: Path, kind: str) -> Path | None:
    """The run's newest ``configs/<kind>_<k>.yaml`` (largest ``k``), or ``None``."""
    numbered = sorted(
        (int(p.stem.rsplit("_", 1)[1]), p)
        for p in (run_dir / "configs").glob(f"{kind}_*.yaml")
        if p.stem.rsplit("_", 1)[1].isdigit()
    )
    return numbered[-1][1] if numbered else None


def _read_map(path: Path) -> dict[str, Any]:
    """A saved config or settings file; ``ConfigError`` naming it when it is not a readable
    map (a resume cannot compare with it)."""
    import yaml

    try:
        saved = yaml.safe_load(path.read_text()) or {}
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(
            f"runner.resume: {path} is not a readable config ({first}); restore it from a copy "
            "or start a new run"
        ) from None
    if not isinstance(saved, dict):
        raise ConfigError(
            f"runner.resume: {path} holds a {type(saved).__name__}, not a config; restore it "
            "or start a new run"
        )
    return saved


def _show(value: Any) -> str:
    return json.dumps(value) if isinstance(value, (list, dict, str)) else str(value)


def check_resume_config(
    run_dir: str | Path, config: dict[str, Any], settings: dict[str, Any] | None = None
) -> list[str]:
    """Compare a resumed run's resolved ``config`` with its previous start's, and its
    ``settings`` (every setting, defaults included: :func:`settings_of`) with those the
    previous start wrote, where it wrote them: a default that differs between the two starts
    (another version of the package) is a change too.

    Returns:
        One ``key: old -> new`` line per changed key that :data:`SAFE_ON_RESUME` allows, and
        one per setting only one of the starts has (a setting this version added or removed:
        nothing to compare it with).

    Raises:
        ConfigError: other keys changed, naming each with its old and new value.
    """
    import yaml

    found = latest_config(run_dir)
    if found is None:
        return []
    path, saved = found
    # The same YAML round trip as the saved file, so that equal values compare equal.
    new = _flat(yaml.safe_load(yaml.safe_dump(config, sort_keys=False)) or {})
    old = _flat(saved)
    auto = str(new.get("placement.mode")) == "auto"  # resolved again at start
    # a key set on only one side changed too (set now, or no longer: its default applies)
    changed = _changes(old, new, one_sided=True, skip_placement=auto)
    notes: dict[str, str] = {}
    earlier = latest_settings(run_dir) if settings is not None else None
    if earlier is not None:
        spath, saved_settings = earlier
        old_s = _flat(saved_settings)
        new_s = _flat(yaml.safe_load(yaml.safe_dump(settings, sort_keys=False)) or {})
        for k, line in _changes(old_s, new_s, one_sided=False, skip_placement=auto).items():
            changed.setdefault(k, line)
        for k in sorted(set(old_s) ^ set(new_s)):
            if not (auto and k.startswith("placement.")):
                side = "this start" if k in new_s else f"the previous start ({spath.name})"
                notes[k] = f"{k}: only {side} has this setting"
        path = f"{path}, {spath}"  # type: ignore[assignment]
    safe = [k for k in changed if any(fnmatch.fnmatchcase(k, p) for p in SAFE_ON_RESUME)]
    refused = [k for k in changed if k not in safe]
    if refused:
        raise ConfigError(
            f"runner.resume: {len(refused)} setting(s) differ from the run's ({path}) and a "
            f"resume cannot change them: {'; '.join(changed[k] for k in refused)}. Set them "
            "back, or start a new run (docs/training.md lists what a resume may change)"
        )
    allowed = [changed[k] for k in safe if not k.startswith(("runner.resume", "runner.output_dir"))]
    return allowed + [line for k, line in notes.items() if k not in changed]


def _changes(
    old: dict[str, Any], new: dict[str, Any], one_sided: bool, skip_placement: bool
) -> dict[str, str]:
    """``key -> "key: old -> new"`` for every key whose value differs (``one_sided``: also
    keys only one side has); placement keys left out when ``skip_placement``."""
    unset = object()
    keys = [*new, *(k for k in old if k not in new)]
    if not one_sided:
        keys = [k for k in keys if k in old and k in new]
    if skip_placement:
        keys = [k for k in keys if not k.startswith("placement.")]

    def show(side: dict[str, Any], k: str) -> str:
        return _show(side[k]) if k in side else "(unset)"

    return {
        k: f"{k}: {show(old, k)} -> {show(new, k)}"
        for k in keys
        if old.get(k, unset) != new.get(k, unset)
    }


# ---------------------------------------------------------------------- the trainers' side
def begin_checkpoint(path: Path) -> Path:
    """An empty checkpoint folder: one left by an earlier start (damaged, or newer than the
    checkpoint the run resumed from) is removed first, so no stale file joins the manifest."""
    import shutil

    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    return path


def finish_checkpoint(path: Path, number: int) -> Path:
    """Mark a checkpoint whose writers have all finished: the manifest, then ``COMPLETE``.

    ``COMPLETE`` comes last so that a run stopped between the two (SIGTERM, Ctrl-C) never
    leaves a folder that :func:`~rlinf_vla.run.tracking.last_checkpoint` counts as complete
    and :func:`resume_checkpoint` rejects for its missing manifest."""
    write_manifest(path)
    (path / "COMPLETE").write_text(str(number))
    return path


def prepare_resume(
    resume: str | None,
    config: dict[str, Any],
    prefix: str,
    say: Any = None,
    settings: dict[str, Any] | None = None,
) -> Resume | None:
    """Before anything starts: check a resumed run's config (:func:`check_resume_config`),
    then choose its checkpoint (:func:`resume_checkpoint`); ``say(line)`` hears the skipped
    checkpoints and the allowed changes. ``None`` for a run that is not resumed.

    Raises:
        ConfigError: a setting a resume cannot change differs.
        RunAborted: no complete checkpoint.
    """
    if not resume:
        return None
    metrics = Path(resume) / "metrics.jsonl"
    if metrics.is_file():
        from rlinf_vla.run.tracking import parse_metrics

        try:
            parse_metrics(metrics)  # a torn last row is dropped; damage before it is not
        except ValueError as e:
            raise ConfigError(
                f"runner.resume: {e}; repair or remove that row (the run's curves come from "
                "this file), or start a new run"
            ) from None
    changed = check_resume_config(resume, config, settings)
    chosen = resume_checkpoint(resume, prefix)
    if changed:
        chosen.notes.append("settings changed on resume (allowed): " + "; ".join(changed))
    if say is not None:
        for line in chosen.notes:
            say(line)
    return chosen
