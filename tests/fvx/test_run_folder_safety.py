"""Run folders are data: replay, export and resume never import a file a run folder names, and nothing in fvx
unpickles."""
import json
import pathlib
import re

from fvx import run

ROOT = pathlib.Path(__file__).resolve().parents[2]
EXPERIMENT = str(ROOT / "experiments" / "finetune_wan.py")


def test_a_run_json_pointing_at_code_never_runs_it(tmp_path):
    out = tmp_path / "run"
    quick = ["--steps", "2", "run.progress=false", "validation.every=0", "data.batch_size=2",
             "run.checkpoint.async_save=false"]
    assert run.main([EXPERIMENT, "--out", str(out), *quick]) == 0
    marker = tmp_path / "pwned"
    evil = tmp_path / "evil.py"
    evil.write_text(f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n")
    record = json.loads((out / "run.json").read_text())
    for launch in record["launches"]:
        launch["experiment"] = str(evil)
        launch["experiment_sha256"] = None
    (out / "run.json").write_text(json.dumps(record))
    assert run.main(["replay", str(out), "--step", "1"]) == 0
    assert run.main(["export", str(out), "--out", str(tmp_path / "exported")]) == 0
    assert run.main([EXPERIMENT, "--out", str(out), "--steps", "3", "--resume", *quick[2:]]) == 0
    assert not marker.exists()


UNPICKLING = [
    (re.compile(r"torch\.load\((?![^)]*weights_only\s*=\s*True)"), "torch.load without weights_only=True"),
    (re.compile(r"\bpickle\.loads?\(|\bimport pickle\b|\bfrom pickle\b|\bimport dill\b"), "pickle"),
    (re.compile(r"allow_pickle\s*=\s*True"), "np.load(allow_pickle=True)"),
]


def test_nothing_in_fvx_unpickles():
    found = []
    for package in ("fvx", "fvx_models", "fvx_methods"):
        for path in sorted((ROOT / package).rglob("*.py")):
            for number, line in enumerate(path.read_text().splitlines(), 1):
                code = line.split("#")[0]
                if code.strip().startswith(('"', "'", "``")) or "``" in code:
                    continue  # prose in docstrings
                for pattern, what in UNPICKLING:
                    if pattern.search(code):
                        found.append(f"{path.relative_to(ROOT)}:{number}: {what}")
    assert found == []
