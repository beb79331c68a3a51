"""Run folders are data: replay, export and resume never import a file a run folder names, and nothing in fvx
unpickles."""
import json
import pathlib
import pickle  # the tests write payloads; fvx never unpickles
import re

from fvx import run
from fvx.storage import files

ROOT = pathlib.Path(__file__).resolve().parents[3]
EXPERIMENT = str(ROOT / "experiments" / "finetune_wan.py")
QUICK = ["--steps", "2", "run.progress=false", "validation.every=0", "data.batch_size=2",
         "run.checkpoint.async_save=false"]


def a_run_and_a_payload(tmp_path: pathlib.Path) -> tuple[pathlib.Path, pathlib.Path, str]:
    """(a 2-step run folder, the file a payload would create, Python code that creates it)."""
    out = tmp_path / "run"
    assert run.main([EXPERIMENT, "--out", str(out), *QUICK]) == 0
    marker = tmp_path / "pwned"
    return out, marker, f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n"


def test_a_run_json_pointing_at_code_never_runs_it(tmp_path):
    out, marker, code = a_run_and_a_payload(tmp_path)
    evil = tmp_path / "evil.py"
    evil.write_text(code)
    record = json.loads((out / "run.json").read_text())
    for launch in record["launches"]:
        launch["experiment"] = str(evil)
        launch["experiment_sha256"] = None
    record["crc32"] = files.json_checksum(record["launches"])  # a planted file carries a valid checksum
    (out / "run.json").write_text(json.dumps(record))
    assert run.main(["replay", str(out), "--step", "1"]) == 0
    assert run.main(["export", str(out), "--out", str(tmp_path / "exported")]) == 0
    assert run.main([EXPERIMENT, "--out", str(out), "--steps", "3", "--resume", *QUICK[2:]]) == 0
    assert not marker.exists()


def test_payloads_planted_in_a_run_folder_and_the_working_directory_never_run(tmp_path, monkeypatch):
    """A pickled payload as an old-style ``dcp/.metadata``, a config.json naming a module of the working directory
    and a run.json naming none: replay, export and resume read data only."""
    out, marker, code = a_run_and_a_payload(tmp_path)
    work = tmp_path / "work"
    work.mkdir()
    (work / "evilmod.py").write_text(code)
    monkeypatch.chdir(work)
    monkeypatch.syspath_prepend(str(work))

    class Payload:
        def __reduce__(self):
            return (exec, (code,))

    legacy = out / "checkpoints" / "2" / "dcp"
    legacy.mkdir()
    (legacy / ".metadata").write_bytes(pickle.dumps(Payload()))
    record = json.loads((out / "run.json").read_text())
    for launch in record["launches"]:
        launch["experiment"] = None
    (out / "run.json").write_text(json.dumps(record))
    config = json.loads((out / "config.json").read_text())
    config["config_type"] = "evilmod:FinetuneWan"
    (out / "config.json").write_text(json.dumps(config))
    for argv in (["replay", str(out), "--step", "1"], ["export", str(out), "--out", str(tmp_path / "exported")],
                 [EXPERIMENT, "--out", str(out), "--steps", "3", "--resume", *QUICK[2:]]):
        run.main(argv)  # refused or not: nothing runs
        assert not marker.exists(), argv


UNPICKLING = [
    (re.compile(r"torch\.load\((?![^)]*weights_only\s*=\s*True)"), "torch.load without weights_only=True"),
    (re.compile(r"\bpickle\.loads?\(|\bimport pickle\b|\bfrom pickle\b|\bimport dill\b"), "pickle"),
    (re.compile(r"allow_pickle\s*=\s*True"), "np.load(allow_pickle=True)"),
    (re.compile(r"torch\.distributed\.checkpoint|FileSystemReader|\bdcp\.load\b"),
     "torch.distributed.checkpoint (its .metadata is pickled)"),
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
